"""Two facts about the papers' peers on held-out rows, behind sentences of docs/results.md:

1. OSCAR: the rms score error ``q·(k_hat - k)`` of its clipped INT2 keys with its fitted rotation,
   against the same INT2 with no rotation (identity), for kv head 0 and the query heads reading it;
2. KVQuant: the fraction of held-out elements its fit treats as outliers (keys beyond their
   calibrated per-channel thresholds; values at their per-token 0.5/99.5 % quantiles), first token
   left out.

Usage: python peer_rows.py CALIBRATION_CAPTURE HELDOUT_CAPTURE [--layers 2,15]
"""
import argparse

import numpy as np
import torch

from kverr.io import open_capture
from kverr.peers import kvquant, oscar

ap = argparse.ArgumentParser()
ap.add_argument("calibration")
ap.add_argument("heldout")
ap.add_argument("--layers", default="0,2,10,15,20,29")
args = ap.parse_args()
layers = [int(x) for x in args.layers.split(",")]
torch.set_num_threads(1)
cal = open_capture(args.calibration).sel(layer=layers)
held = open_capture(args.heldout)
rot = oscar.fit(cal)
kvq = kvquant.fit(cal, bits=3)
kv_of_q = [int(x) for x in np.asarray(held["kv_head_of_q"].values)]
print("layer,oscar_score_rms,identity_score_rms,kvquant_key_outliers,kvquant_value_outliers")
for layer in layers:
    sel = held.sel(layer=layer)
    q, k, kp, v = (torch.from_numpy(np.asarray(sel[n].values)) for n in ("q", "k", "k_pre", "v"))
    reads = q[[i for i, h in enumerate(kv_of_q) if h == 0]]
    rms = []
    for r in (rot[layer][0], torch.eye(k.shape[-1])):
        e = oscar.int2_rows(oscar.rotate(k, r), oscar.CLIP_RATIO["k"]) @ oscar._bf16(r).T - k
        rms.append(float((reads @ e[0].T).pow(2).mean().sqrt()))
    f = kvq[layer]
    _, ko = kvquant.quantize_keys(kp[None, :, 1:], f["k_upper"], f["k_lower"], f["k_levels"])
    _, vo = kvquant.quantize_values(v[None, :, 1:], f["v_levels"])
    print(f"{layer},{rms[0]:.4g},{rms[1]:.4g},{float(ko.float().mean()):.4f},{float(vo.float().mean()):.4f}")
