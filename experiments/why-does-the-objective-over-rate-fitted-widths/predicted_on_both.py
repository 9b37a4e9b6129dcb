"""The calibration objective (predicted next-token KL) of committed configs on the calibration
capture and on a held-out one: does the objective over-rate fitted widths, or do the widths
specialise to the calibration text?

Usage: python predicted_on_both.py CALIBRATION_CAPTURE HELDOUT_CAPTURE [CONFIG ...]
(configs: names in data/configs/, default the 2.5- and 3-bit calibrated and fitted ones)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from kverr.calibration import Sensitivity, predict
from kverr.config import CacheConfig
from kverr.io import open_capture

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    names = argv[2:] or ["calibrated-2.5b", "fitted-2.5b", "calibrated-3b", "fitted-3b"]
    rows = []
    for path in argv[:2]:
        cap = open_capture(path)
        for name in names:
            c = CacheConfig.load(CONFIGS / f"{name}.json")
            s = Sensitivity.from_dict(c.provenance["sensitivity"])  # the layer weights it was calibrated with
            p = predict(cap, c, queries=32, weights=s.weights_k, weights_v=s.weights_v)
            rows.append(dict(capture=Path(path).stem, config=name, predicted=p["total"], keys=p["k"].sum(),
                             values=p["v"].sum()))
    df = pd.DataFrame(rows)
    print(df.pivot_table(index="config", columns="capture", values=["predicted", "keys", "values"]).to_string(
        float_format=lambda x: f"{x:.5f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
