"""Do fitted per-channel widths over-fit the calibration text, and does shrinking the fit's
query weighting toward plain squared error help held out?

For every (layer, kv head) of keys (pre-RoPE, as the committed fitted configs store them) and
values, and a template of B mean bits (zero floor, static channel scales, the calibrator's MSE
clip), the widths are allocated (:func:`kverr.calibration.channel_bits.allocate`) on the
calibration capture's error curves blended with plain squared error::

    curves(λ) = (1 − λ) · C_w / ΣC_w[0 bits] + λ · C_u / ΣC_u[0 bits]

``C_w``: the calibrator's curves (token- and channel-weighted by the first-order key/value
weights, :func:`kverr.calibration.channel_bits.curves`); ``C_u``: the same with unit weights
(sink tokens left out of both). λ = 0 is what ``kverr calibrate --candidates fitted`` does.
Each allocation is then scored on a held-out capture with the calibration objective (relative
squared attention-output error, option S4/R64; the format's static scales fitted on the
held-out keys, as a cache calibrating on its prefill does), and beside it the allocation fitted
on the held-out capture itself ("held-out fit": what no calibration can reach, the bound), and
allocations fitted (λ = 0) from more sampled queries of the calibration capture than the
calibrator's 32 per layer (``--fit-queries``): is the fit's specialisation sampling noise? And
(``--also-fit``) allocations on the calibration capture's curves pooled with another text's
(each normalised by its total error at 0 bits): does fitting on more varied text help?

Usage: python shrink.py CALIBRATION_CAPTURE HELDOUT_CAPTURE [--layers 0-29] [--out result.csv]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from kverr.calibration import channel_bits as cb
from kverr.calibration.candidates import OuterOption
from kverr.catalog import template
from kverr.calibration.objective import (DEFAULT_DECODE, _grouped, _head_groups, _layer_arrays, key_damage_batch, prepare_layer,
                                         value_damage_batch)
from kverr.io import open_capture
from kverr.quant import CHANNEL_BITS, channel_reconstructions
from kverr.rope import apply_rope

BUDGETS = (2.0, 2.5, 3.0)
LAMBDAS = (0.0, 0.1, 0.3, 0.5, 1.0)
OPTION = OuterOption(sinks=4, window=64, key_pre_rope=True)
QUERIES = 32  # as kverr calibrate


def _prep(capture, layer, queries=QUERIES):
    q, k, v, kp, scale, kv_map = _layer_arrays(capture, layer, True)
    return prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=queries,
                         positions=capture.kv.positions, rope=capture.kv.rope, decode=DEFAULT_DECODE)


def _curves(prep, which):
    """Per kv head: (weighted curves, unit curves), each ``(C [W, D], widths)``, and the
    reconstructions ``[W, kv_head, T, D]``."""
    probe = template(2.5, prep.k.shape[-1]).with_bits(2)
    clean = prep.k_pre if which == "k" else prep.v
    recon = channel_reconstructions(clean, probe)
    out = []
    for h, qi in _head_groups(prep):
        a = _grouped(prep, qi, prep.a)
        if which == "k":
            w = cb.key_weights(_grouped(prep, qi, prep.q), a, prep.v[h], _grouped(prep, qi, prep.o),
                               pre_rope=True, skip=OPTION.sinks)
        else:
            w = cb.value_weights(a, clean.shape[-1], skip=OPTION.sinks)
        unit = torch.ones_like(w)
        unit[:OPTION.sinks] = 0.0
        out.append((cb.curves(recon[:, h], clean[h], w), cb.curves(recon[:, h], clean[h], unit)))
    return out, recon


def _blend(cw, cu, lam):
    c = (1 - lam) * cw[0] / cw[0][0].sum() + lam * cu[0] / cu[0][0].sum()
    return c, cw[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("calibration")
    ap.add_argument("heldout")
    ap.add_argument("--layers", default="0-29")
    ap.add_argument("--out", default="result.csv")
    ap.add_argument("--fit-queries", type=int, nargs="*", default=[128, 512],
                    help="also fit with this many sampled queries of the calibration capture (λ = 0)")
    ap.add_argument("--also-fit", nargs="*", default=[],
                    help="captures of other texts: also fit on the calibration capture's curves pooled with each's")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.layers.split("-"))
    cal, held = open_capture(a.calibration), open_capture(a.heldout)
    extra = {Path(p).stem: open_capture(p) for p in a.also_fit}
    rows = []
    D = cal.sizes["channel"]
    for layer in range(lo, hi + 1):
        t0 = time.time()
        pc, ph = _prep(cal, layer), _prep(held, layer)
        more = {n: _prep(cal, layer, n) for n in a.fit_queries}
        also = {name: _prep(x, layer) for name, x in extra.items()}
        for which in ("k", "v"):
            fit_c, _ = _curves(pc, which)
            fit_more = {f"{n} queries": _curves(p, which)[0] for n, p in more.items()}
            for name, p in also.items():  # pooled: each text's curves normalised, then summed
                fit_more[f"pooled with {name}"] = [((cw[0] / cw[0][0].sum() + xw[0] / xw[0][0].sum(), cw[1]), cu)
                                                   for (cw, cu), (xw, _) in zip(fit_c, _curves(p, which)[0])]
            fit_h, recon_h = _curves(ph, which)
            clean_h = ph.k_pre if which == "k" else ph.v
            T = clean_h.shape[1]
            variants = ([(f"λ={lam:g}", lam, fit_c) for lam in LAMBDAS] + [("held-out fit", 0.0, fit_h)]
                        + [(f"λ=0, {n}", 0.0, f) for n, f in fit_more.items()])
            for B in BUDGETS:
                budget = int(B * D // 8)
                errs = torch.zeros((len(variants), clean_h.shape[0], T, D))
                for i, (_, lam, fits) in enumerate(variants):
                    for h, (cw, cu) in enumerate(fits):
                        c, widths = _blend(cw, cu, lam)
                        bits = cb.allocate(c, budget, widths)
                        pick = torch.as_tensor([CHANNEL_BITS.index(b) for b in bits])
                        hat = recon_h[:, h].gather(0, pick[None, None, :].expand(1, T, D))[0]
                        if which == "k":
                            hat = apply_rope(hat[None], ph.positions, ph.rope)[0].to(torch.float32)
                        errs[i, h] = hat - (ph.k[h] if which == "k" else clean_h[h])
                dmg = (key_damage_batch if which == "k" else value_damage_batch)(ph, errs, [OPTION])  # [C, 1, kv]
                for i, (name, _, _) in enumerate(variants):
                    for h in range(errs.shape[1]):
                        rows.append(dict(layer=layer, which=which, kv_head=h, bits=B, variant=name,
                                         damage=float(dmg[i, 0, h])))
        print(f"layer {layer}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(a.out, index=False)
    summary = df.pivot_table(index=["which", "bits"], columns="variant", values="damage", aggfunc="sum")
    print(summary.div(summary["λ=0"], axis=0).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
