"""Predicted KL (the calibration objective of ``kverr calibrate --target vllm``: 32 queries per
layer, no decode steps (the command's --decode 0), weighted by the layer sensitivity recorded in ``configs/vllm-8.05b.json``) of
the fp8 configs whose scales the capture gives (absmax per tensor / per head, the calibrated
config), on the calibration capture; the per-token-head rows come from the calibration's own
table (``calibrate-vllm-table.csv``), and the calibrated config is predicted again here as a check.

    .venv/bin/python experiments/does-calibrating-for-vllm-help/predicted.py CAPTURE OUT.csv
"""

import sys
from pathlib import Path

import pandas as pd
import torch

from kverr.calibration import Sensitivity, predict
from kverr.config import PRESETS, CacheConfig
from kverr.io import open_capture

HERE = Path(__file__).parent
torch.set_num_threads(1)
cap = open_capture(sys.argv[1])
calibrated = CacheConfig.load(HERE / "configs" / "vllm-8.05b.json")
sens = Sensitivity.from_dict(calibrated.provenance["sensitivity"])
rows = []
for name, cfg in (("fp8-e4m3-tensor", PRESETS["fp8-e4m3-tensor"]), ("fp8-e4m3-head", PRESETS["fp8-e4m3-head"]),
                  ("vllm-8.05b", calibrated)):
    p = predict(cap, cfg, queries=32, weights=sens.weights_k, weights_v=sens.weights_v, decode=None)
    rows.append(dict(config=name, predicted=p["total"], predicted_k=float(p["k"].sum()), predicted_v=float(p["v"].sum())))
    print(rows[-1], flush=True)
pd.DataFrame(rows).to_csv(sys.argv[2], index=False)
