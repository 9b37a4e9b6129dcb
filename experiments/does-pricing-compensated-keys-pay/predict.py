"""The objective's prediction for a config with its keys rounded to nearest and with compensation
(``kverr.calibration.predict``, 32 queries per layer, weighted by the config's own sensitivity).

    PYTHONPATH=. python experiments/does-pricing-compensated-keys-pay/predict.py CONFIG CAPTURE
"""

from __future__ import annotations

import sys

from kverr.calibration import predict
from kverr.calibration.sensitivity import Sensitivity
from kverr.config import CacheConfig
from kverr.io import open_capture


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    cfg, cap = CacheConfig.load(sys.argv[1]), open_capture(sys.argv[2])
    s = Sensitivity.from_dict(cfg.provenance["sensitivity"])
    print("key_rounding,total,k,v,relative")
    for rounding in ("nearest", "compensated"):
        p = predict(cap, cfg.with_(key_rounding=rounding), queries=32, weights=s.weights_k, weights_v=s.weights_v)
        print(f"{rounding},{p['total']:.6f},{p['k'].sum():.6f},{p['v'].sum():.6f},{p['relative']:.6f}", flush=True)


if __name__ == "__main__":
    main()
