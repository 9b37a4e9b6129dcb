"""The transformers integration: caches that store K/V per a :class:`~kverr.config.CacheConfig`.

* :class:`KverrCache` (:mod:`kverr.hf.reference`) -- the CPU reference path: packed codes and
  scales per group of kv heads, the token policy of :func:`kverr.quant.reconstruct`;
* :class:`KernelKVCache` (:mod:`kverr.hf.kernel`) -- the same config on the Triton kernels of
  :mod:`kverr.gpu`, with the decode kernel registered as the model's attention function;
* :func:`cache_for` picks one for a model.

Importing this package imports transformers (>= 4.56, layer-based caches).
"""

from __future__ import annotations

from typing import Any

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError
from kverr.hf.kernel import KernelKVCache
from kverr.hf.reference import Cache, KverrCache, KverrLayer, model_rotary

__all__ = ["KernelKVCache", "KverrCache", "KverrLayer", "cache_for", "cache_kwarg", "kernels_support",
           "model_rotary"]


def cache_kwarg(model: Any) -> str:
    """Name of the cache argument of ``model.forward`` and ``generate`` (``cache`` from
    transformers 5.x, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_for(model: Any, config: CacheConfig, *, backend: str = "auto", **kwargs: Any) -> Cache:
    """The cache that runs ``config`` for ``model``.

    ``backend="auto"`` picks the Triton kernel path (:class:`KernelKVCache`) when the model is on
    a CUDA device and the kernels support the config, and the CPU reference path
    (:class:`KverrCache`) otherwise; ``"reference"`` and ``"triton"`` force one. The two agree
    (tests compare them through a whole model in the Triton interpreter).
    """
    if backend not in ("auto", "reference", "triton"):
        raise ConfigError(f"backend={backend!r} is not allowed; 'auto', 'reference' or 'triton'")
    if backend == "auto":
        on_cuda = next(model.parameters()).device.type == "cuda"
        backend = "triton" if on_cuda and kernels_support(config) else "reference"
    if backend == "triton":
        return KernelKVCache.for_model(model, config, **kwargs)
    return KverrCache.for_model(model, config, **kwargs)


def kernels_support(config: CacheConfig) -> bool:
    """Whether the Triton kernels can run ``config`` (all but percentile clips with dynamic scales)."""
    from kverr.exceptions import KernelError
    from kverr.gpu.spec import kernel_spec

    for _, fmt in config._all_formats():
        try:
            kernel_spec(fmt, 64, config.page_size)
        except (KernelError, ConfigError):
            return False
    return True
