"""The held-out protocol of ``decode_salient.py`` (``--keep 0 --compensated-keys``) with keys rounded
under a static second moment -- that of all the queries of a calibration capture, per layer and kv
head, the moment the calibration objective scores compensated keys under -- instead of the moment
of each prompt's own last queries: state a deployed cache would share across sequences (static
bytes) rather than keep per sequence.

Usage (from the repository root): PYTHONPATH=. python experiments/does-compensation-need-per-sequence-state/static_moment.py
    CAPTURE CONFIG OUT.csv --segments 0 1 2 3 --keep 0 --compensated-keys --refit
"""
from __future__ import annotations

import sys

import torch

from bench.heldout import experiment_script
import kverr.hf.reference as reference
from kverr.hf.reference import KverrLayer
from kverr.io import open_capture
from kverr.quant.compensated import query_moment

decode_salient = experiment_script("where-does-the-held-out-kl-come-from", "decode_salient.py")

STATIC: list[torch.Tensor] = []  # per layer, [kv_head, D, D] float64
_observe = KverrLayer.observe
_query_moment = reference.query_moment
NOW: dict = {}


def observe(self, query, key, scaling, **kw):
    NOW["layer"] = self.layer_idx
    return _observe(self, query, key, scaling, **kw)


def static_moment(query, n_kv_heads, last):
    return STATIC[NOW["layer"]][None].expand(query.shape[0], -1, -1, -1).to(query.device)


def load(capture: str) -> None:
    ds = open_capture(capture)
    n_kv = ds.sizes["kv_head"]
    for layer in range(ds.sizes["layer"]):
        q = torch.from_numpy(ds.q.isel(layer=layer).values)[None]  # [1, q_head, T, D]
        STATIC.append(query_moment(q, n_kv, q.shape[2])[0])


if __name__ == "__main__":
    load(sys.argv.pop(1))
    KverrLayer.observe = observe
    reference.query_moment = static_moment
    raise SystemExit(decode_salient.main())
