"""Calibrate with each format family's damage weighted by a constant, from one scoring.

The families of ``../do-format-families-cost-what-the-objective-says/``: keys with fitted widths
(template candidates), the other keys, values with static per-channel integer scales, the other
values. One ``kverr.calibration.calibrate`` call with the settings of ``data/configs/windows-*b``
(``--window-per-head``, compensated keys, fitted widths, codebooks, 8 salient tokens, batch 8) at
``--queries`` positions; its damage tables are pickled (``OUTDIR/scores.pkl``; ``--scores``
reuses them) and the knapsack solved again with the tables of each family times its weight
(``--weights KW KO VS VD``). Writes ``OUTDIR/plain-<b>b.json`` (weights 1) and
``OUTDIR/<tag>-<b>b.json``.

Usage (from the repository root):
    PYTHONPATH=. python experiments/does-reweighting-the-objective-help/by_family.py CAPTURE OUTDIR \
        --weights 10.7 9.2 5.0 1.9 [--tag fw] [--budgets 3] [--queries 128] [--scores OUTDIR/scores.pkl]
"""
from __future__ import annotations

import argparse
import dataclasses
import pickle
import time
from pathlib import Path

import numpy as np

from kverr.calibration import CalibrationConfig, calibrate
from kverr.io import open_capture
from kverr.quant import is_static


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--weights", type=float, nargs=4, required=True, metavar=("KW", "KO", "VS", "VD"))
    ap.add_argument("--tag", default="fw")
    ap.add_argument("--budgets", default="3")
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--scores", type=Path, help="a scores.pkl of an earlier run with the same settings")
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    budgets = tuple(float(b) for b in a.budgets.split(","))
    cap = open_capture(a.capture)
    settings = CalibrationConfig(budgets=budgets, context=1280, batch=8, refit_widths=True, compensated_keys=True,
                                 candidates="fitted", codebooks=True, salient=8, queries=a.queries, sinks=(4,),
                                 windows=(16, 32, 64, 128), window_per_head=True)
    if a.scores:
        scores, sensitivity = pickle.loads(a.scores.read_bytes())
    else:
        t0 = time.perf_counter()
        base = calibrate(cap, settings, workers=2, progress=True)
        print(f"scored in {time.perf_counter() - t0:.0f} s ({base.seconds})", flush=True)
        scores, sensitivity = base.scores, base.sensitivity
        (a.outdir / "scores.pkl").write_bytes(pickle.dumps((scores, sensitivity)))
    kw, ko, vs, vd = a.weights
    wk = np.array([kw if f.channel_bits is not None else ko for f in scores.cands_k])
    wv = np.array([vs if not f.is_float and is_static(f.granularity) else vd for f in scores.cands_v])
    weighted = dataclasses.replace(scores, k=scores.k * wk[None, None, :, None], v=scores.v * wv[None, None, :, None])
    for tag, sc in (("plain", scores), (a.tag, weighted)):
        cal = calibrate(cap, settings, scores=sc, sensitivity=sensitivity, workers=2)
        for b in budgets:
            c = cal.config_at(b).with_(name=f"{tag}-{b:g}b")
            c.save(a.outdir / f"{c.name}.json")
            pv = c.provenance
            print(c.name, pv["outer_option"], "bits", pv["effective_bits"], "predicted (weighted)", pv["predicted_damage"],
                  flush=True)


if __name__ == "__main__":
    main()
