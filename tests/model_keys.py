"""A model's own keys, shared by the cache tests (tests/hf)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kverr.hf import cache_kwarg


def prefill_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The post-RoPE keys ``[layer][B, kv_head, n, D]`` ``model`` computes for ``ids [B, n]``
    (through a plain ``DynamicCache``)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): cache})
    return [layer.keys for layer in cache.layers]
