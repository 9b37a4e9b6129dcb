"""Predicted-damage frontiers of an int8 window against an fp16 one (the ``window_dtype="auto"`` rule).

An int8 window halves the bytes of the sinks, window and pending token blocks, but every token the
cache quantizes later is quantized from its int8 copy. This calibrates the same capture with the
same 78 candidates (static scales included) and outer options twice, the window in int8 and in
fp16 (one sensitivity measurement, reused), and prints the best predicted KL of each frontier at
a grid of effective bits, their ratio, and where the int8 frontier stops being the lower one.
The objective leaves the window's own rounding out, so the crossover it shows is an upper bound
for the int8 window's useful range (:data:`kverr.calibration.candidates.INT8_WINDOW_BELOW_BITS`).

Usage::

    python experiments/where-does-an-int8-window-stop-paying/window_dtype.py CAPTURE OUT.txt [--context 1280] [--max-bits 9]
"""
import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from kverr.calibration import CalibrationConfig, calibrate
from kverr.calibration.candidates import INT8_WINDOW_BELOW_BITS, default_candidates
from kverr.calibration.search import outer_options
from kverr.config import atomic_write_text
from kverr.io import open_capture


def best_at(frontier, bits: float) -> float:
    """Least predicted damage of a frontier within ``bits`` effective bits."""
    ok = frontier[frontier.effective_bits <= bits + 1e-9]
    return float(ok.predicted.min()) if len(ok) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("out", type=Path)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--max-bits", type=float, default=9.0)
    args = ap.parse_args()
    cap = open_capture(args.capture)
    opts = outer_options(cap)
    cands = default_candidates(cap.sizes["channel"], static=True)
    t0 = time.perf_counter()
    cals = {}
    for wdt in ("int8", "fp16"):
        first = next(iter(cals.values()), None)
        settings = CalibrationConfig(budgets=3.0, context=args.context, options=opts, queries=32, cands_k=cands,
                                     cands_v=cands, window_dtype=wdt, max_bits=max(args.max_bits, 3.0))
        cals[wdt] = calibrate(cap, settings, workers=2, sensitivity=None if first is None else first.sensitivity)
    grid = np.round(np.arange(2.5, args.max_bits + 1e-9, 0.25), 2)
    lines = [
        "# Predicted-KL frontiers, int8 window vs fp16 window (python experiments/where-does-an-int8-window-stop-paying/window_dtype.py "
        f"{args.capture} {args.out.name} --context {args.context} --max-bits {args.max_bits:g})",
        f"# date: {time.strftime('%Y-%m-%d', time.gmtime())}  machine: {platform.node()} ({os.cpu_count()} cpus)  "
        f"wall: {time.perf_counter() - t0:.0f} s",
        f"# same {len(cands)} candidates and outer options ({', '.join(o.label() for o in opts)}) for both; "
        "effective bits at the context, every byte counted",
        f"# rule in kverr: window_dtype='auto' is int8 below {INT8_WINDOW_BELOW_BITS} bits",
        "",
        f"{'bits':>5}  {'int8 window':>12}  {'fp16 window':>12}  {'int8/fp16':>9}",
    ]
    crossover = None
    for b in grid:
        a, f = best_at(cals["int8"].frontier, b), best_at(cals["fp16"].frontier, b)
        r = a / f if np.isfinite(a) and np.isfinite(f) else float("nan")
        if crossover is None and np.isfinite(r) and r >= 1.0:
            crossover = b
        lines.append(f"{b:>5.2f}  {a:>12.4g}  {f:>12.4g}  {r:>9.2f}")
    lines += ["", f"first grid point where the int8 window predicts no less damage: {crossover} bits"]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
