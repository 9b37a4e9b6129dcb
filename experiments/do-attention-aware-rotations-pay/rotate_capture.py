"""Does rotating keys into the eigenbasis of their queries (and values into their own) pay, once
bits are spent per channel?

kverr's objective prices a key error ``e`` by the scores it moves, ``q·e``: its expected cost is
``eᵀ Σ_q e`` with ``Σ_q`` the second moment of the queries reading the key. In the eigenbasis
``U`` of ``Σ_q`` the cost is ``Σ_i λ_i e_i²``: a channel's error weighs by its eigenvalue, and
fitted per-channel widths can spend bits where ``λ`` is large. Scores are unchanged by the
rotation (``(qU)·(kU) = q·k``), so the experiment rotates the capture itself: post-RoPE keys and
the queries of each kv head by ``U`` (per layer and kv head), values by the eigenbasis of their
own second moment (an output error ``a·E_V`` weighs every direction alike; the eigenbasis makes
the channels' spreads unequal, which widths exploit). Pre-RoPE keys are left as they are and
not used (``key_rope="post"``): a rotation of them does not commute with RoPE.

Then ``kverr calibrate --candidates fitted --key-rope post`` runs on the original capture and on
the rotated one at the same budgets, and the predicted KL of the chosen configs is compared (in
sample)::

    PYTHONPATH=. python experiments/do-attention-aware-rotations-pay/rotate_capture.py
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import xarray as xr

import kverr as kv
from kverr.calibration import Sensitivity
from kverr.calibration.config import CalibrationConfig
from kverr.calibration.search import calibrate
from kverr.config import CacheConfig
from kverr.io import write_dataset

BUDGETS = (2.5, 3.0)
OUT = Path("out/rotations")


def eigenbasis(x: np.ndarray) -> np.ndarray:
    """Eigenvectors (columns, largest eigenvalue first) of the second moment of rows ``x [n, D]``."""
    m = (x.astype(np.float64).T @ x.astype(np.float64)) / len(x)
    w, u = np.linalg.eigh(m)
    return u[:, ::-1].copy()


def rotated(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with post-RoPE keys and their queries in the queries' eigenbasis, values in their own,
    per layer and kv head (pre-RoPE keys unchanged)."""
    q, k, v = ds["q"].values.copy(), ds["k"].values.copy(), ds["v"].values.copy()
    kv_of_q = ds["kv_head_of_q"].values
    for layer in range(q.shape[0]):
        for h in range(k.shape[1]):
            heads = np.flatnonzero(kv_of_q == h)
            uk = eigenbasis(q[layer, heads].reshape(-1, q.shape[-1])).astype(np.float32)
            q[layer, heads] = q[layer, heads] @ uk
            k[layer, h] = k[layer, h] @ uk
            uv = eigenbasis(v[layer, h]).astype(np.float32)
            v[layer, h] = v[layer, h] @ uv
    out = ds.copy()
    out["q"] = (ds["q"].dims, q)
    out["k"] = (ds["k"].dims, k)
    out["v"] = (ds["v"].dims, v)
    out.attrs = dict(ds.attrs)
    return out


def main() -> None:
    from bench.common import ROOT, pydoc_capture

    OUT.mkdir(parents=True, exist_ok=True)
    cap = kv.open_capture(pydoc_capture(4096)).load()
    path = OUT / "pydoc-4096-rotated.zarr"
    if not path.exists():
        write_dataset(rotated(cap), path)
    sens = Sensitivity.from_dict(CacheConfig.load(ROOT / "data/configs/calibrated-4b.json").provenance["sensitivity"])
    for name, ds in (("original", cap), ("rotated", kv.open_capture(path))):
        t = time.time()
        cal = calibrate(ds, CalibrationConfig(budgets=BUDGETS, context=1280, candidates="fitted", key_rope="post"),
                        sensitivity=sens)
        print(f"{name}: {time.time() - t:.0f} s", flush=True)
        for b, cfg in cal.configs.items():
            p = cfg.provenance
            print(f"  {b:4g} bits: predicted {p['predicted_damage']:.4g} (keys {np.sum(p['predicted_k']):.4g}, "
                  f"values {np.sum(p['predicted_v']):.4g}), outer {p['outer_option']}", flush=True)
            cfg.save(OUT / f"{name}-{b:g}b.json")


if __name__ == "__main__":
    main()
