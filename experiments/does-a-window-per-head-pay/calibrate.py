"""Calibrate with a window per (layer, kv head, K|V) and, from the same scores, with one window
for the model; write both configs per budget.

One ``kverr.calibration.calibrate`` call with ``window_per_head`` (what ``kverr calibrate
--window-per-head`` runs), then a second on its scores and sensitivity without it (no new
scoring): the two configs of a budget differ only in that freedom.

Usage (from the repository root):
    PYTHONPATH=. python experiments/does-a-window-per-head-pay/calibrate.py CAPTURE OUTDIR \
        [--budgets 2,2.5,3] [--windows 16,32,64,128] [--queries 512] [--decode 256] [--salient 8 --salient-recent 0]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kverr.calibration import CalibrationConfig, calibrate
from kverr.io import open_capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--budgets", default="2,2.5,3")
    ap.add_argument("--windows", default="16,32,64,128")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode", type=int, default=None, help="decode steps the objective models (kverr calibrate --decode)")
    ap.add_argument("--salient", type=int, default=8, help="salient rows per (layer, kv head) (kverr calibrate --salient)")
    ap.add_argument("--salient-recent", type=int, default=0,
                    help="of them, the prompt's last tokens (kverr calibrate --salient-recent)")
    ap.add_argument("--tag", default="", help="appended to the config names")
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    budgets = tuple(float(b) for b in a.budgets.split(","))
    cfg = CalibrationConfig(budgets=budgets, context=a.context, batch=a.batch, refit_widths=True,
                            compensated_keys=True, candidates="fitted", codebooks=True, salient=a.salient,
                            salient_recent=a.salient_recent,
                            queries=a.queries, sinks=(a.sinks,), windows=tuple(int(w) for w in a.windows.split(",")),
                            window_per_head=True, decode=a.decode)
    t0 = time.perf_counter()
    cal = calibrate(cap := open_capture(a.capture), cfg, workers=2, progress=True)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s ({cal.seconds})", flush=True)
    one = calibrate(cap, cfg.with_(window_per_head=False), scores=cal.scores, sensitivity=cal.sensitivity, workers=2)
    summary = []
    for b in budgets:
        q = a.queries
        for tag, c in (("perhead", cal.config_at(b)), ("single", one.config_at(b))):
            c = c.with_(name=f"{tag}-{b:g}b-b8-ck-q{q}{a.tag}")
            c.save(a.outdir / f"{c.name}.json")
            pv = c.provenance
            summary.append(dict(config=c.name, budget=b, option=pv["outer_option"], bits=pv["effective_bits"],
                                predicted=pv["predicted_damage"], windows_vary=c.windows_vary))
            print(summary[-1], flush=True)
    (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    del cap


if __name__ == "__main__":
    main()
