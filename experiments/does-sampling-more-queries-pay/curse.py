"""The objective's prediction of configs on the query positions a calibration sampled and on others.

A calibration picks, per (layer, kv head, K|V), the format its sampled queries rate best; with few
query positions that choice also fits their noise, so the chosen config scores better on them than
on other positions of the same capture. This prints ``kverr.calibration.predict`` of each config at
``--queries`` Q and at Q2 positions per layer (``query_positions`` spreads them evenly; 97 against
32 share only the first and last), weighted by the sensitivity recorded in REF's provenance.

    PYTHONPATH=. python experiments/does-sampling-more-queries-pay/curse.py CAPTURE REF CONFIG... \
        [--queries 32 97]
"""

from __future__ import annotations

import argparse
import time

from kverr.calibration import predict
from kverr.calibration.sensitivity import Sensitivity
from kverr.config import CacheConfig
from kverr.io import open_capture


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("capture")
    p.add_argument("ref", help="a calibrated config whose provenance holds the sensitivity weights")
    p.add_argument("configs", nargs="+")
    p.add_argument("--queries", type=int, nargs="+", default=[32, 97])
    args = p.parse_args()
    cap = open_capture(args.capture)
    s = Sensitivity.from_dict(CacheConfig.load(args.ref).provenance["sensitivity"])
    print("config,queries,predicted_kl,k,v,seconds", flush=True)
    for path in args.configs:
        cfg = CacheConfig.load(path)
        for q in args.queries:
            t = time.time()
            r = predict(cap, cfg, queries=q, weights=s.weights_k, weights_v=s.weights_v)
            print(f"{cfg.name},{q},{r['total']:.6f},{r['k'].sum():.6f},{r['v'].sum():.6f},{time.time() - t:.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
