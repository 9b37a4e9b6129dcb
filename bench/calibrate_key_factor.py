"""Calibrate with the key side's damage multiplied by a constant factor (an experiment).

Evaluated alone on argparse.py, keys-only and values-only versions of the 2.5- and 3-bit configs
measured 3.6-3.9x and 2.2x their predicted KL (bench/results/eval/calibrate-kv-only-argparse.*):
the default objective under-weights key errors about 1.7x. This script scores once with the
defaults and re-solves the knapsack with ``K`` damage times ``FACTOR``.

Usage::

    python bench/calibrate_key_factor.py CAPTURE FACTOR OUT_DIR [BUDGET ...]
    (e.g. /tmp/kv/pydoc-4096.zarr 1.7 /tmp/kw 2.5 3; writes OUT_DIR/kw<FACTOR>-<budget>b.json)
"""
import dataclasses
import sys
from pathlib import Path

from kverr.calibrate import calibrate
from kverr.calibrate.search import outer_options
from kverr.io import open_capture


def main() -> None:
    cap_path, factor, out = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    budgets = [float(b) for b in sys.argv[4:]] or [3.0]
    out.mkdir(parents=True, exist_ok=True)
    cap = open_capture(cap_path)
    opts = outer_options(cap)
    base = calibrate(cap, min(budgets), context=1280, options=opts, queries=32, workers=2, capture_path=cap_path)
    scores = dataclasses.replace(base.scores, k=base.scores.k * factor)
    for b in budgets:
        name = f"kw{factor:g}-{b:g}b"
        c = calibrate(cap, b, context=1280, options=opts, queries=32, scores=scores, sensitivity=base.sensitivity,
                      name=name)
        c.config.save(out / f"{name}.json")
        pv = c.config.provenance
        print(name, pv["outer_option"], "predicted K (x factor)", pv["predicted_k"], "V", pv["predicted_v"])


if __name__ == "__main__":
    main()
