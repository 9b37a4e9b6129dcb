"""Exact decomposition of KV-cache quantization error in attention.

Array core (numpy or torch, named by axes): :func:`decompose` and :func:`decompose_stream`.
Named-dim layer over a capture Dataset (xarray + dask): :func:`decompose_capture`.
The terms themselves (weight change, key, value and cross terms, first order, KL) are defined
once, in :mod:`kverr.error.terms`, which the calibration objective uses too; :mod:`kverr.error.naive`
is their plain per-query reference.
"""

from __future__ import annotations

from kverr.error.core import Decomposition, decompose, decompose_stream
from kverr.error.metrics import QUERY_METRICS, RECON_METRICS, reconstruction_error

__all__ = [
    "Decomposition",
    "QUERY_METRICS",
    "RECON_METRICS",
    "decompose",
    "decompose_capture",
    "decompose_stream",
    "reconstruction_error",
]


def __getattr__(name: str):
    # The xarray layer pulls in xarray and dask; import it only when asked for.
    if name in ("decompose_capture", "summarize"):
        from kverr.error import xr as _xr

        return getattr(_xr, name)
    raise AttributeError(f"module 'kverr.error' has no attribute {name!r}")
