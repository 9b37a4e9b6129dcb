"""kverr: understand and choose KV-cache quantization.

``import kverr as kv`` gives what a notebook needs; each name is imported on first use, so
``import kverr`` itself needs only numpy and torch (xarray, dask, transformers and triton are
imported by the functions that use them)::

    import kverr as kv

    ds = kv.open_capture("data/smollm2-pydoc-512.zarr")    # or kv.capture(kv.load_model(), ids)
    cfg = kv.resolve("kivi-4")                             # a preset, a JSON file or a CacheConfig
    kv.account(cfg, ds.kv.shape, tokens=4096).effective_bits
    dec = kv.decompose(ds, cfg, queries=64).compute()      # key / value / cross terms per query
    k_hat = kv.reconstruct(ds.k.sel(layer=0).values, cfg, layer=0, which="k")

Sections (the module each name comes from):

* configs and memory -- :class:`CacheConfig`, :data:`PRESETS`, :func:`resolve`,
  :class:`ModelShape`, :func:`model_shape`, :func:`account` (:mod:`kverr.config`,
  :mod:`kverr.memory`);
* the oracle -- :func:`quantize`, :func:`dequantize`, :func:`fake_quantize`,
  :func:`reconstruct` and the format constructors (:mod:`kverr.quant`);
* captures -- :func:`load_model`, :func:`load_text`, :func:`tokenize`, :func:`capture`,
  :func:`open_capture` (:mod:`kverr.capturing`, :mod:`kverr.io`); ``ds.kv`` on a capture
  (:mod:`kverr.accessor`);
* analysis -- :func:`decompose` (:func:`kverr.error.decompose_capture`), :func:`evaluate`,
  pass-key retrieval (:func:`passkey_trials`, :func:`evaluate_passkey`), :func:`calibrate` with
  its :class:`CalibrationConfig`, :func:`validate` (:mod:`kverr.error`, :mod:`kverr.evaluation`,
  :mod:`kverr.retrieval`, :mod:`kverr.calibration`, :mod:`kverr.validation`), and
  :func:`run_pipeline`, all of them in order as ``make demo`` runs them (:mod:`kverr.pipeline`);
* models -- :func:`cache_for`, a transformers cache that stores K/V per a config (:mod:`kverr.hf`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: Public name -> (module, attribute). One table, so that ``__all__``, ``dir()`` and the lazy
#: lookup cannot disagree.
_EXPORTS: dict[str, tuple[str, str]] = {
    # configs and memory
    "CacheConfig": ("kverr.config", "CacheConfig"),
    "PRESETS": ("kverr.config", "PRESETS"),
    "resolve": ("kverr.config", "resolve"),
    "ModelShape": ("kverr.memory", "ModelShape"),
    "model_shape": ("kverr.memory", "model_shape"),
    "account": ("kverr.memory", "account"),
    # the oracle
    "QuantFormat": ("kverr.quant", "QuantFormat"),
    "int_format": ("kverr.quant", "int_format"),
    "fp8_format": ("kverr.quant", "fp8_format"),
    "fp4_format": ("kverr.quant", "fp4_format"),
    "codebook_format": ("kverr.quant", "codebook_format"),
    "quantize": ("kverr.quant", "quantize"),
    "dequantize": ("kverr.quant", "dequantize"),
    "fake_quantize": ("kverr.quant", "fake_quantize"),
    "reconstruct": ("kverr.quant", "reconstruct"),
    # captures
    "load_model": ("kverr.capturing", "load_model"),
    "load_text": ("kverr.capturing", "load_text"),
    "tokenize": ("kverr.capturing", "tokenize"),
    "capture": ("kverr.capturing", "capture"),
    "open_capture": ("kverr.io", "open_capture"),
    # analysis
    "decompose": ("kverr.error", "decompose_capture"),
    "evaluate": ("kverr.evaluation", "evaluate"),
    "passkey_trials": ("kverr.retrieval", "passkey_trials"),
    "evaluate_passkey": ("kverr.retrieval", "evaluate_passkey"),
    "calibrate": ("kverr.calibration", "calibrate"),
    "CalibrationConfig": ("kverr.calibration", "CalibrationConfig"),
    "validate": ("kverr.validation", "validate"),
    "run_pipeline": ("kverr.pipeline", "run_pipeline"),
    # models
    "cache_for": ("kverr.hf", "cache_for"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kverr' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
