"""How much of the objective's credit for compensated key rounding depends on the queries whose
second moment weighs it.

Scores five key formats on layers of a capture with nearest rounding, and with compensated
rounding weighed by the moment of (a) all the capture's queries (what ``kverr calibrate
--compensated-keys`` does), (b) its first 512 queries, (c) its queries 256-511, and prints each
format's predicted key damage over nearest rounding's, averaged over the kv heads.

    PYTHONPATH=. python experiments/does-pricing-compensated-keys-pay/moment.py CAPTURE [--layers 3 9 20]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import kverr.accessor  # noqa: F401  (registers ds.kv)
from kverr.calibration import OuterOption
from kverr.calibration.objective import _layer_arrays, prepare_layer, score_layer
from kverr.catalog import default_candidates, fitted_templates
from kverr.io import open_capture
from kverr.quant.compensated import query_moment
from kverr.rope import layer_rope

FORMATS = ("int2a/ch32/fp16", "int3a/tg32/fp16/mse/had", "int2a/chall/fp16", "int3a/chall/fp16")
MOMENTS = {"all": slice(0, None), "0-512": slice(0, 512), "256-512": slice(256, 512)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture")
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 9, 20])
    a = ap.parse_args()
    torch.set_num_threads(1)
    ds = open_capture(a.capture)
    cands = [f for f in default_candidates(ds.kv.head_dim) if f.label() in FORMATS] + [fitted_templates(ds.kv.head_dim)[2]]
    opts = [OuterOption(window=64, sinks=4, key_pre_rope=True, salient=8)]
    print("layer,moment," + ",".join(f.label() for f in cands))
    for layer in a.layers:
        q, k, v, kp, scale, kv_map = _layer_arrays(ds, layer, True)
        rows = {}
        for name, sl in (("nearest", None), *MOMENTS.items()):
            prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=32,
                                 positions=ds.kv.positions, rope=layer_rope(ds.kv.rope, layer), salient=True,
                                 compensated_keys=sl is not None)
            if sl is not None:
                qs = torch.as_tensor(q)[None, :, sl]
                prep.moment = query_moment(qs, k.shape[0], qs.shape[2])[0]
            dk, _ = score_layer(prep, cands, cands[:1], opts, page_size=64, window_dtype="int8",
                                compensated_keys=sl is not None)
            rows[name] = dk[0]
        for name in MOMENTS:
            print(f"{layer},{name}," + ",".join(f"{r:.3f}" for r in (rows[name] / rows["nearest"]).mean(1)))


if __name__ == "__main__":
    main()
