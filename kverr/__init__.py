"""kverr: understand and choose KV-cache quantization.

The core (``kverr.quant``, ``kverr.config``, ``kverr.memory``) needs only numpy and torch;
heavier dependencies (xarray, dask, transformers, triton) are imported where they are used.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]
