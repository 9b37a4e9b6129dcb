"""Would per-channel widths fitted on the served prompt (its prefill) beat widths fitted on the
calibration text, on the decode steps that follow?

For every (layer, kv head) of keys (pre-RoPE) and values, a template of B mean bits (zero floor,
static channel scales, the calibrator's MSE clip; :func:`kverr.catalog.template`) has its widths
allocated (:func:`kverr.calibration.channel_bits.allocate`) from the error curves of:

* ``calibration``: the calibration capture, 32 sampled queries (what ``kverr calibrate
  --candidates fitted`` does);
* ``prefill N``: the segment's own first ``P`` tokens, ``N`` sampled queries among them (what a
  server could do when the prompt is prefilled: it has those queries, keys and values);
* ``prompt, no queries``: the prompt's own keys or values without its queries (what a cache
  that sees only keys and values could do): every prompt token weighs the same, each key channel
  its mean weight on the calibration capture, value channels alike;
* ``pooled``: the calibration curves and the prefill-32 curves, each normalised, summed;
* ``bound``: the scored decode queries themselves (no server can do this).

Each allocation is scored with the calibration objective on the decode queries at positions
``P .. P+N-1`` of the segment (decode steps after a prompt quantized whole, sinks 4, window 64,
as the committed ``fitted-*b`` configs), the static scales fitted on all of the segment's tokens
(the same for every variant). Layer damages are weighted by the committed ``fitted-2.5b``'s layer
sensitivities into predicted KL.

Usage: python prefill_fit.py CALIBRATION_CAPTURE SEGMENT_CAPTURE... [--prefill 1024] [--out result.csv]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kverr.calibration import channel_bits as cb
from kverr.calibration.objective import (LayerPrep, _head_groups, _layer_arrays, key_damage_batch, prepare_layer,
                                         value_damage_batch, width_weights)
from kverr.calibration.candidates import OuterOption
from kverr.catalog import template
from kverr.io import open_capture
from kverr.quant import CHANNEL_BITS, channel_reconstructions
from kverr.rope import apply_rope

BUDGETS = (2.0, 2.5, 3.0)
OPTION = OuterOption(sinks=4, window=64, key_pre_rope=True)
ROOT = Path(__file__).resolve().parents[2]


def _prep(cap, layer, queries, upto=None):
    q, k, v, kp, scale, kv_map = _layer_arrays(cap, layer, True)
    if upto is not None:
        q, k, v, kp = (x[:, :upto] for x in (q, k, v, kp))
    pos = cap.kv.positions if upto is None else cap.kv.positions[:upto]
    return prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=queries,
                         positions=pos, rope=cap.kv.rope_of(layer))


def _decode_prep(cap, layer, prefill):
    """The objective's prep with the queries at positions ``prefill ..`` as decode steps."""
    q, k, v, kp, scale, kv_map = _layer_arrays(cap, layer, True)
    T = k.shape[1]
    full = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=T,
                         positions=cap.kv.positions, rope=cap.kv.rope_of(layer))
    sel = torch.nonzero(full.pos >= prefill).flatten()
    o = full.o[:, sel]
    norm = float((o * o).sum(-1).mean()) * q.shape[0]
    return LayerPrep(layer, full.q[:, sel], full.k, full.v, full.k_pre, full.a[:, sel], o, full.causal[sel],
                     full.pos[sel], full.kv_map, norm, full.positions, full.rope,
                     full.pos[sel] - prefill, None)


def _curves(prep, which, recon, clean):
    out = []
    for h, qi in _head_groups(prep):
        w = width_weights(prep, h, qi, which, pre_rope=True, skip=OPTION.sinks)
        T = w.shape[0]
        out.append(cb.curves(recon[:, h, :T], clean[h, :T], w))
    return out


def _separable(prep, which, recon, clean, upto):
    """Curves from the prompt's own keys or values with no queries: every prompt token (sinks
    left out) weighs the same, and key channel ``d`` the calibration's mean weight of that
    channel (its query second moment as the objective weights it); values: plain squared error."""
    out = []
    for h, qi in _head_groups(prep):
        if which == "k":
            wc = width_weights(prep, h, qi, "k", pre_rope=True, skip=OPTION.sinks).sum(0)
        else:
            wc = torch.ones(clean.shape[-1], dtype=torch.float64)
        w = wc[None, :].expand(upto, -1).clone()
        w[:OPTION.sinks] = 0.0
        out.append(cb.curves(recon[:, h, :upto], clean[h, :upto], w))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("calibration")
    ap.add_argument("segments", nargs="+")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--layers", default="0-29")
    ap.add_argument("--out", default="result.csv")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.layers.split("-"))
    cal = open_capture(a.calibration)
    segs = [open_capture(p) for p in a.segments]
    sens = json.loads((ROOT / "data/configs/fitted-2.5b.json").read_text())["provenance"]["sensitivity"]
    wk, wv = (np.asarray(json.loads(sens[k]) if isinstance(sens[k], str) else sens[k], dtype=float)
              for k in ("weights_k", "weights_v"))
    D = cal.sizes["channel"]
    rows = []
    for layer in range(lo, hi + 1):
        t0 = time.time()
        pc = _prep(cal, layer, 32)
        probe = template(2.5, D).with_bits(2)
        cal_fit = {w: _curves(pc, w, channel_reconstructions(pc.k_pre if w == "k" else pc.v, probe),
                              pc.k_pre if w == "k" else pc.v) for w in ("k", "v")}
        for si, seg in enumerate(segs):
            ps = _decode_prep(seg, layer, a.prefill)
            fits = {"prefill 32": _prep(seg, layer, 32, a.prefill), "prefill 128": _prep(seg, layer, 128, a.prefill)}
            for which in ("k", "v"):
                clean = ps.k_pre if which == "k" else ps.v
                recon = channel_reconstructions(clean, probe)  # static scales of the whole segment
                T = clean.shape[1]
                variants = {"calibration": cal_fit[which]}
                for name, pf in fits.items():
                    variants[name] = _curves(pf, which, recon, clean)
                variants["prompt, no queries"] = _separable(pc, which, recon, clean, a.prefill)
                variants["pooled"] = [(c[0] / c[0][0].sum() + p[0] / p[0][0].sum(), c[1])
                                      for c, p in zip(cal_fit[which], variants["prefill 32"])]
                variants["bound"] = _curves(ps, which, recon, clean)
                for B in BUDGETS:
                    budget = int(B * D // 8)
                    errs = torch.zeros((len(variants), clean.shape[0], T, D))
                    for i, fit in enumerate(variants.values()):
                        for h, (c, widths) in enumerate(fit):
                            bits = cb.allocate(c, budget, widths)
                            pick = torch.as_tensor([CHANNEL_BITS.index(b) for b in bits])
                            hat = recon[:, h].gather(0, pick[None, None, :].expand(1, T, D))[0]
                            if which == "k":
                                hat = apply_rope(hat[None], ps.positions, ps.rope)[0].to(torch.float32)
                            errs[i, h] = hat - (ps.k[h] if which == "k" else clean[h])
                    dmg = (key_damage_batch if which == "k" else value_damage_batch)(ps, errs, [OPTION])
                    weight = (wk if which == "k" else wv)[layer]
                    for i, name in enumerate(variants):
                        for h in range(errs.shape[1]):
                            rows.append(dict(segment=si, layer=layer, which=which, kv_head=h, bits=B, variant=name,
                                             damage=float(dmg[i, 0, h]), predicted_kl=float(dmg[i, 0, h]) * weight))
        print(f"layer {layer}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    # per (segment, side, budget, variant), summed over layers and kv heads
    df.groupby(["segment", "which", "bits", "variant"], as_index=False)[["damage", "predicted_kl"]].sum().to_csv(
        a.out, index=False, float_format="%.6g")
    tot = df.pivot_table(index=["bits", "which"], columns="variant", values="predicted_kl", aggfunc="sum") / len(segs)
    print("predicted KL per segment (mean over segments), keys and values:")
    print(tot.to_string(float_format=lambda x: f"{x:.5f}"))
    both = df.pivot_table(index="bits", columns="variant", values="predicted_kl", aggfunc="sum") / len(segs)
    print("\nkeys + values:")
    print(both.to_string(float_format=lambda x: f"{x:.5f}"))
    print("\nrelative to calibration:")
    print(both.div(both["calibration"], axis=0).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
