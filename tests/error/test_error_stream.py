"""Streaming over key blocks: same numbers as the direct path, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.error import QUERY_METRICS, decompose, decompose_stream

TERMS = ("key_term", "value_term", "cross_term", "total", "out")


def _inputs(rng, hq=4, hkv=2, Q=37, T=300, D=16, ek=0.05, ev=0.05, dtype=np.float64):
    q = rng.normal(size=(hq, Q, D))
    k = 2 * rng.normal(size=(hkv, T, D))
    v = rng.normal(size=(hkv, T, D))
    kh = k + ek * rng.normal(size=k.shape)
    vh = v + ev * rng.normal(size=v.shape)
    return tuple(x.astype(dtype) for x in (q, k, v, kh, vh))


def _compare(d0, d1, tol):
    for name in TERMS:
        a, b = getattr(d0, name), getattr(d1, name)
        np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(d0.out).max(), err_msg=name)
    for n in QUERY_METRICS:
        a, b = d0.metrics[n], d1.metrics[n]
        np.testing.assert_allclose(b, a, rtol=100 * tol, atol=tol, equal_nan=True, err_msg=n)


@pytest.mark.parametrize("block", [1, 7, 64, 299, 300, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_streamed_equals_direct(block, causal):
    rng = np.random.default_rng(block)
    arrs = _inputs(rng)
    m = [0, 1, 0, 1]
    d0 = decompose(*arrs, causal=causal, kv_head_of_q=m)
    d1 = decompose_stream(*arrs, causal=causal, kv_head_of_q=m, block_size=block)
    assert d1.attn is None and d1.delta_logits is None
    _compare(d0, d1, 1e-12)


@given(st.integers(1, 40), st.integers(1, 30), st.integers(0, 60), st.integers(0, 10**6))
def test_streamed_equals_direct_property(block, Q, extra, seed):
    rng = np.random.default_rng(seed)
    arrs = _inputs(rng, hq=2, hkv=1, Q=Q, T=Q + extra, D=8)
    d0 = decompose(*arrs, kv_head_of_q=[0, 0], topk=5)
    d1 = decompose_stream(*arrs, kv_head_of_q=[0, 0], topk=5, block_size=block)
    _compare(d0, d1, 1e-12)


def test_streamed_float32_torch():
    rng = np.random.default_rng(0)
    arrs = tuple(torch.from_numpy(a) for a in _inputs(rng, T=1000, dtype=np.float32))
    d0 = decompose(*arrs, kv_head_of_q=[0, 0, 1, 1])
    d1 = decompose_stream(*arrs, kv_head_of_q=[0, 0, 1, 1], block_size=128)
    for name in TERMS:
        a, b = getattr(d0, name), getattr(d1, name)
        assert isinstance(b, torch.Tensor) and b.dtype == torch.float32
        assert float((a - b).abs().max()) < 2e-6 * float(d0.out.abs().max()), name
    assert float((d0.metrics["kl"] - d1.metrics["kl"]).abs().max()) < 1e-4 * float(
        d0.metrics["kl"].max()
    )


def test_default_block_is_chosen_to_bound_memory():
    from kverr.error.stream import DEFAULT_SLAB_ELEMENTS, choose_block, choose_rows

    blk = choose_block(1, 512, 32768, None)
    assert blk < 32768  # a 32k context streams
    assert choose_rows(blk) * blk <= DEFAULT_SLAB_ELEMENTS
    assert choose_block(1, 4, 100, None) == 100
    assert choose_block(2, 10, 100, 7) == 7


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    from kverr.error import decompose_stream
    T, Q, D = 32768, 512, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, Q, D, generator=g)
    k = torch.randn(1, T, D, generator=g)
    v = torch.randn(1, T, D, generator=g)
    kh = k + 0.05 * torch.randn(k.shape, generator=g)
    vh = v + 0.05 * torch.randn(v.shape, generator=g)
    def hwm():
        # VmHWM is this process's own peak; ru_maxrss would inherit the parent's RSS
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = hwm()
    t0 = time.perf_counter()
    d = decompose_stream(q, k, v, kh, vh, causal=True)
    dt = time.perf_counter() - t0
    peak = hwm()
    ok = bool(torch.isfinite(d.total).all())
    print(json.dumps({"peak_mib": peak / 1024, "before_mib": before / 1024, "seconds": dt,
                      "finite": ok}))
    """
)


@pytest.mark.slow
def test_32k_context_512_queries_under_2gb():
    """A 32k-token context with 512 queries, streamed, peaks well under 2 GB (whole process)."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, check=True,
        timeout=600,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["finite"]
    assert res["peak_mib"] < 2048, res


def test_engine_without_first_order_output_matmul():
    from kverr.error.stream import run_engine

    rng = np.random.default_rng(3)
    q, k, v, kh, vh = (torch.from_numpy(a) for a in _inputs(rng, hq=1, hkv=1, Q=5, T=20, D=8))
    full = run_engine(q, k, v, kh, vh, None, 0.3, block=20, keep_rows=False, topk=4)
    lean = run_engine(q, k, v, kh, vh, None, 0.3, block=20, keep_rows=False, topk=4,
                      first_order_out=False)
    assert torch.isnan(lean.metrics["first_order_key_err"]).all()
    assert torch.equal(lean.total, full.total)
    assert torch.equal(lean.metrics["first_order_err"], full.metrics["first_order_err"])
