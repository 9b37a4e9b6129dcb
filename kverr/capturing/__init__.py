"""Capture queries, keys and values from real models on real text.

Public API::

    loaded = load_model("default")               # or a local transformers model directory
    text = load_text("pydoc")                    # or a UTF-8 file
    ids = tokenize(loaded.tokenizer, text, 4096)
    ds = capture(loaded, ids, layers=[0, 5, 10], text=text)
    capture_to_zarr(loaded, ids, "caps/smol.zarr", text=text)   # atomic write
    supported_shape("default")                   # ModelShape(30, 3, 64, ...) without loading weights

Statistics for notebooks live in :mod:`kverr.capturing.stats`, their figures in
:mod:`kverr.capturing.figures`; :mod:`kverr.capturing.tiny` builds small random models for tests.
"""

from __future__ import annotations

from .hooks import STORAGE_DTYPES, attention_modules, capture, capture_to_zarr
from .model import (
    DEFAULT_MODEL_ID,
    NUMERICS_ATTRS,
    REPRODUCIBLE_FLOAT_ENV,
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    cache_dir,
    default_gguf_path,
    float_environment,
    load_model,
    transformers_dir,
    supported_shape,
)
from .text import Text, load_text, tokenize

__all__ = [
    "DEFAULT_MODEL_ID",
    "NUMERICS_ATTRS",
    "REPRODUCIBLE_FLOAT_ENV",
    "STORAGE_DTYPES",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "Text",
    "attention_modules",
    "cache_dir",
    "capture",
    "capture_to_zarr",
    "default_gguf_path",
    "float_environment",
    "load_model",
    "transformers_dir",
    "load_text",
    "supported_shape",
    "tokenize",
]
