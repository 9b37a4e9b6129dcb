"""kverr: understand and choose KV-cache quantization.

The core (``kverr.quant``, ``kverr.config``, ``kverr.memory``) needs only numpy and torch;
heavier dependencies (xarray, dask, transformers, triton) are imported where they are used.

``kverr.decompose(capture, config)`` is the named-dim decomposition of a capture
(:func:`kverr.error.decompose_capture`), imported on first use.
"""

from __future__ import annotations

import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__", "decompose"]


def __getattr__(name: str) -> Any:
    # Lazy: the xarray layer pulls in xarray and dask, which `import kverr` must not need.
    if name == "decompose":
        from kverr.error import decompose_capture

        return decompose_capture
    raise AttributeError(f"module 'kverr' has no attribute {name!r}")
