"""kverr.cost's launch and host-operation counts against the real PagedKVCache: every Triton
launch and every eager torch operation (non-view aten operations other than allocations, one
kernel each on a GPU) of one steady-state decode step, counted on the cache in the interpreter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kverr.gpu.launch as launch
from kverr.config import CacheConfig, Override
from kverr.cost import step_cost
from kverr.gpu import PagedKVCache
from kverr.memory import ModelShape
from kverr.quant import PerToken, PerTokenGroup, int_format


class _Ops(TorchDispatchMode):
    """Counts the non-view aten operations run outside the Triton launches, and host reads of
    device values (synchronisations)."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs, self.inside = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # allocations (empty, empty_like) launch no kernel
        if not self.inside and not func.is_view and not str(func).startswith("aten.empty"):
            self.ops += 1
            self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window_dtype, windows", [("fp16", False), ("int8", False), ("fp16", True)],
                         ids=["fp16", "int8", "fp16-window-per-head"])
def test_counts_of_one_decode_step_match_the_real_cache(monkeypatch, window_dtype, windows):
    L, H, Hq, D, B = 2, 3, 6, 32, 2
    i8, i4 = int_format(8, PerToken()), int_format(4, PerTokenGroup(16))
    # layer 0: keys in two formats (two key head groups), three (K, V) launch groups
    heads = {(0, 0): Override(k=i8), (0, 1): Override(v=i4)}
    if windows:  # head 2's keys in layer 0 and head 1's values in layer 1 keep no window: the new
        # row is quantized at once (a store, no host write); layer 1 then has two launch groups
        heads |= {(0, 2): Override(k_window=0), (1, 1): Override(v_window=0)}
    cfg = CacheConfig(k=i4, v=i8, window=8, sinks=2, window_dtype=window_dtype, heads=heads)
    shape = ModelShape(L, H, D, n_q_heads=Hq)
    cache = PagedKVCache(cfg, n_layers=L, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=32,
                         device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, 14, D, generator=g).half()
    step = cache.plan([14] * B)
    for layer in range(L):
        cache.store(step, layer, x, x)
    step = cache.plan([1] * B)
    T = int(step.lengths[0])
    plan = step_cost(cfg, shape, T, B)
    ops, triton = _Ops(), Counter()

    def counted(name):
        real = getattr(launch, name)

        def run(*a, **k):
            triton[name] += 1
            ops.inside += 1
            try:
                return real(*a, **k)
            finally:
                ops.inside -= 1
        monkeypatch.setattr(launch, name, run)

    for name in ("launch_store", "launch_decode", "launch_merge"):
        counted(name)
    new = torch.randn(B, H, D, generator=g).half()
    q = torch.randn(B, Hq, D, generator=g).half()
    for layer in range(L):
        ops.ops = ops.syncs = 0
        triton.clear()
        with ops:
            cache.store(step, layer, new, new)
            cache.decode(step, layer, q)
        lc = plan.layers[layer]
        by = Counter()
        for ln in lc.launches:
            by[ln.kind] += ln.count
        assert lc.groups == len(cache.launches[layer]) == (3 if layer == 0 else 2 if windows else 1)
        assert triton["launch_decode"] == by["main"] + by["tail"] and triton["launch_merge"] == by["merge"] == 1
        # per-token formats: a store every step; an int8 window receives the new rows in one more
        assert triton["launch_store"] == by["store"] + by["receive"]
        assert ops.ops == by["host"], layer
        assert ops.syncs == 0  # nothing of the step waits for the device
