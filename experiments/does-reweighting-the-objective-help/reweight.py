"""Calibrate with parts of the objective re-weighted by constant factors (experiments).

* ``--key F``: key damage times F. Evaluated alone on argparse.py, keys-only and values-only
  versions of the 2.5- and 3-bit configs measured 3.6-3.9x and 2.2x their predicted KL
  (bench/results/eval/calibrate-kv-only-argparse.*, experiments/do-key-errors-cost-more-than-predicted/): the default objective under-weights key
  errors about 1.7x.
* ``--static F``: damage of the integer candidates with static per-channel scales times F. At 4.5 bits the objective under-rates static scales about 2x on both sides
  (bench/results/eval/calibrate-static-kv-only-argparse-4.5b.*).

Scores once with the default 78 candidates (static scales offered at every budget, as
``--candidates all``) and outer options, then re-solves the knapsack.

Usage::

    python experiments/does-reweighting-the-objective-help/reweight.py CAPTURE OUT_DIR [--key F] [--static F] [--budgets 2.5,3]
    (writes OUT_DIR/<prefix>-<budget>b.json: prefix kw<F> for --key alone, sp<F> for --static alone)
"""
import argparse
import dataclasses
from pathlib import Path

import numpy as np

from kverr.calibration import CalibrationConfig, calibrate
from kverr.calibration.candidates import default_candidates
from kverr.calibration.search import outer_options
from kverr.io import open_capture
from kverr.quant import is_static


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("out", type=Path)
    ap.add_argument("--key", type=float, default=1.0)
    ap.add_argument("--static", type=float, default=1.0)
    ap.add_argument("--budgets", default="3")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    cap = open_capture(args.capture)
    opts = outer_options(cap)
    cands = default_candidates(cap.sizes["channel"], static=True)
    settings = CalibrationConfig(budgets=min(budgets), context=1280, options=opts, queries=32,
                                 cands_k=cands, cands_v=cands)
    base = calibrate(cap, settings, workers=2)
    sc = base.scores
    static = np.array([args.static if not c.is_float and is_static(c.granularity) else 1.0 for c in cands])
    scores = dataclasses.replace(sc, k=sc.k * args.key * static[None, None, :, None],
                                 v=sc.v * static[None, None, :, None])
    prefix = "-".join(p for p in (f"kw{args.key:g}" if args.key != 1 else "",
                                  f"sp{args.static:g}" if args.static != 1 else "") if p) or "plain"
    for b in budgets:
        name = f"{prefix}-{b:g}b"
        c = calibrate(cap, settings.with_(budgets=b, name=name), scores=scores, sensitivity=base.sensitivity)
        c.config.save(args.out / f"{name}.json")
        pv = c.config.provenance
        print(name, pv["outer_option"], "predicted (re-weighted) K", pv["predicted_k"], "V", pv["predicted_v"],
              "static choices", int(c.choices[b].format.str.contains("/chall").sum()))


if __name__ == "__main__":
    main()
