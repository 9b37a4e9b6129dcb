"""Calibrate on several captures at once: each capture scored and its sensitivity measured as
``windows-3b``'s calibration scores one (``../does-a-window-per-head-pay/calibrate.py``'s
settings), the damage tables and the sensitivity weights averaged over the captures (each
capture's queries count alike: ``Scores.mean`` and ``Sensitivity.mean`` of
``kverr.calibration``), and the knapsack solved once on the averages. ``kverr calibrate
--capture A B ...`` does the same in one command; this script keeps each capture's tables in
OUTDIR, so that another mix reuses them.

An entry of a capture's table is a candidate's damage relative to the layer's output on that
capture, over its sampled queries; the captures count alike. Fitted widths of
template candidates are the first capture's (the configs are served with their widths refit on
each prompt). The configs written are ``perhead-<budget>b-b8-ck-q<queries><tag>.json``.

Usage (from the repository root):
    PYTHONPATH=. python experiments/does-calibrating-on-code-pay/calibrate_mix.py OUTDIR CAPTURE [CAPTURE ...] \
        [--budgets 2.944] [--queries 512] [--tag=-mix]
"""
from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import numpy as np

from kverr.calibration import CalibrationConfig, Sensitivity, calibrate
from kverr.calibration.search import Scores
from kverr.io import open_capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--budgets", default="2.944")
    ap.add_argument("--windows", default="16,32,64,128")
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--salient", type=int, default=8)
    ap.add_argument("--tag", default="-mix")
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    budgets = tuple(float(b) for b in a.budgets.split(","))
    cfg = CalibrationConfig(budgets=budgets, context=a.context, batch=a.batch, refit_widths=True,
                            compensated_keys=True, candidates="fitted", codebooks=True, salient=a.salient,
                            queries=a.queries, sinks=(4,), windows=tuple(int(w) for w in a.windows.split(",")),
                            window_per_head=True)
    got = []  # (scores, sensitivity) per capture, kept in OUTDIR so that another mix reuses them
    for path in a.captures:
        kept = a.outdir / f"scores-{Path(path).stem}-q{a.queries}.pkl"
        if kept.exists():
            got.append(pickle.loads(kept.read_bytes()))
            continue
        t0 = time.perf_counter()
        cal = calibrate(open_capture(path), cfg, workers=2, progress=False)
        print(f"{path}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        cal.config_at(budgets[0]).with_(name=f"alone-{Path(path).stem}").save(
            a.outdir / f"alone-{Path(path).stem}-{budgets[0]:g}b.json")
        got.append((cal.scores, cal.sensitivity))
        kept.write_bytes(pickle.dumps(got[-1]))
    scores = Scores.mean([s for s, _ in got])
    sens = [w for _, w in got]
    sensitivity = Sensitivity.mean(sens)
    np.savez(a.outdir / "weights.npz", **{f"k{i}": s.weights_k for i, s in enumerate(sens)},
             **{f"v{i}": s.weights_v for i, s in enumerate(sens)})
    mix = calibrate(open_capture(a.captures[0]), cfg, scores=scores, sensitivity=sensitivity, workers=2)
    summary = []
    for b in budgets:
        c = mix.config_at(b).with_(name=f"perhead-{b:g}b-b8-ck-q{a.queries}{a.tag}")
        c.save(a.outdir / f"{c.name}.json")
        pv = c.provenance
        summary.append(dict(config=c.name, budget=b, bits=pv["effective_bits"], predicted=pv["predicted_damage"],
                            captures=a.captures))
        print(summary[-1], flush=True)
    (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
