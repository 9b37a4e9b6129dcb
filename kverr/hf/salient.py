"""Salient prompt tokens in transformers: the prefill's queries handed to the cache.

The rules -- which tokens, by what saliency -- are :mod:`kverr.error.salient`'s. transformers
does not pass queries to a cache: :func:`observe_queries` points the model's attention at a
wrapper (the model's own kernel, unchanged) that hands each layer's prefill queries to the cache
layer that returned those keys (:class:`~kverr.hf.reference.KverrCache.for_model` installs it;
the kernel path's attention function takes them itself). A cache given a prefill it never sees
the queries of refuses to quantize it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_PREFIX = "kverr_salient|"
# id(prefill key tensor) -> (that tensor, the cache layer that returned it): the tensor is held
# so that its id cannot be reused before the attention call hands its queries over.
_AWAITING: dict[int, tuple[torch.Tensor, Any]] = {}


def await_queries(key: torch.Tensor, layer: Any) -> None:
    """``layer`` (a cache layer) returned ``key`` for a prefill and waits for its queries."""
    _AWAITING[id(key)] = (key, weakref.ref(layer))


def forget(key: torch.Tensor | None) -> None:
    if key is not None:
        _AWAITING.pop(id(key), None)


def attention_context(module: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What :func:`kverr.error.salient.token_saliency` needs of an attention call besides its queries and keys:
    ``scaling``, ``sliding_window`` and the learned ``sink`` logits (gpt-oss), if any."""
    sink = getattr(module, "sinks", None)
    return dict(scaling=float(kwargs.get("scaling") or module.scaling),
                sliding_window=int(kwargs.get("sliding_window") or 0),
                sink=sink.detach() if isinstance(sink, torch.Tensor) else None)


def _observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kwargs: dict[str, Any]) -> None:
    entry = _AWAITING.get(id(key))
    if entry is not None and entry[0] is key:
        del _AWAITING[id(key)]
        layer = entry[1]()
        if layer is not None:
            layer.observe(query.detach(), key.detach(), **attention_context(module, kwargs))
    return None


def observe_queries(model: Any) -> None:
    """Point ``model``'s attention at the observing wrapper (idempotent; the model's own kernel
    still computes every output)."""
    from kverr.capturing.hooks import attention_modules, register_attention_wrapper

    modules = attention_modules(model)
    for cfg in {id(c): c for c in [model.config, *(m.config for m in modules if hasattr(m, "config"))]}.values():
        impl = cfg._attn_implementation or "eager"
        if not impl.startswith(_PREFIX):
            cfg._attn_implementation = register_attention_wrapper(_PREFIX, impl, _observe)
