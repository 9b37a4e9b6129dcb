"""Quantize-and-store kernel: codes and scales bit-exact against the reference quantizer.

Runs the Triton kernels in the interpreter on the CPU (tests/conftest.py). Shapes are small and
odd: T=63 tokens, pages of 16 (a partial last page), sinks and a window, sequences of unequal
lengths filled in prefill chunks and single-token steps. Every pool is pre-filled with sentinels
(NaN scales and window slots, 0xA5 code bytes) so an unwritten slot fails the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kverr.config import CacheConfig
from kverr.exceptions import KernelError, ShapeError
from kverr.gpu import PagedKVCache, calibrate_static_scales
from kverr.quant import (
    MSEClip,
    Percentile,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    codebook_format,
    float_format,
    fp4_format,
    fp8_format,
    int_format,
    quantize,
    reconstruct,
)
from kverr.engines.vllm_dtypes import PRESETS as VLLM_PRESETS
from kverr.quant.store import receive
from paged_data import D, H, P, data, sentinel

# Bit-exact claims (the store kernel against the oracle) must hold whichever kernels torch
# picks for the oracle's arithmetic: the tests marked float_order run again under ATen's
# baseline kernels in `make test` (the MSE clip search's sums, int8 windows, fp8 rounding,
# static scales: the arithmetic whose order could differ).



def fill(cache: PagedKVCache, ks, vs, schedule) -> None:
    """Append tokens per ``schedule`` (a list of per-sequence counts per step)."""
    done = [0] * cache.B
    for counts in schedule:
        step = cache.plan(counts)
        for layer in range(cache.L):
            rows_k, rows_v = [], []
            for b, n in enumerate(counts):
                rows_k.append(ks[layer][b][:, done[b]:done[b] + n].transpose(0, 1))
                rows_v.append(vs[layer][b][:, done[b]:done[b] + n].transpose(0, 1))
            cache.store(step, layer, torch.cat(rows_k), torch.cat(rows_v))
        done = [d + n for d, n in zip(done, counts)]


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.dtype == torch.float32 else t


def check_exact(cache: PagedKVCache, cfg: CacheConfig, ks, vs, static=None) -> int:
    """Compare codes and scales of every group of every sequence; returns regions compared."""
    compared = 0
    for layer in range(cache.L):
        for which, xs in (("k", ks), ("v", vs)):
            for b in range(cache.B):
                x = xs[layer][b]
                for qt, heads, start, end in cache.quantized(layer, which, b):
                    if end == start:
                        continue
                    # the cache receives K/V in its window dtype (as reconstruct() does)
                    region = receive(x, cfg.window_dtype)[heads, start:end]
                    key = (layer, which, heads[0])
                    if static and key in static:
                        s, z = static[key]
                        ref = quantize(region, qt.fmt, page_size=cfg.page_size, scale=s, zero=z)
                    else:
                        ref = quantize(region, qt.fmt, page_size=cfg.page_size)
                    assert qt.codes.dtype == ref.codes.dtype
                    if qt.fmt.is_float:
                        assert torch.equal(bits(qt.codes), bits(ref.codes)), (layer, which, b, qt.fmt.label())
                    else:
                        bad = (qt.codes != ref.codes).nonzero()
                        assert bad.numel() == 0, f"{qt.fmt.label()} {which} seq {b}: codes differ at {bad[:5].tolist()}"
                        if not qt.fmt.is_float and not cache.pools[layer][which][0].spec.static:
                            assert torch.equal(bits(qt.scale), bits(ref.scale)), f"{qt.fmt.label()} scales differ"
                            if ref.zero is not None:
                                assert torch.equal(bits(qt.zero), bits(ref.zero)), f"{qt.fmt.label()} zeros differ"
                    compared += 1
                # and what the cache gives back is what the reference gives back
                got = cache.read(layer, which, b)
                want = reconstruct(x, cfg, layer=layer, which=which) if not static else None
                if want is not None:
                    assert torch.equal(got, want), f"layer {layer} {which} seq {b}: read != reconstruct"
                assert not torch.isnan(got).any()
    return compared


# K and V formats paired to cover every element kind, bit width, symmetry, granularity and scale
# dtype the kernels serve, in few runs.
PAIRS = [
    ("int8a/tok", int_format(8, PerToken()), "int4s/tg16/bf16", int_format(4, PerTokenGroup(16), symmetric=True, scale_dtype="bf16")),
    ("int4a/tg8", int_format(4, PerTokenGroup(8)), "int2s/tok/fp32", int_format(2, PerToken(), symmetric=True, scale_dtype="fp32")),
    ("int2a/ch8", int_format(2, PerChannel(8)), "int3a/tok", int_format(3, PerToken())),
    ("int3s/ch4/bf16", int_format(3, PerChannel(4), symmetric=True, scale_dtype="bf16"), "int8s/page/fp32", int_format(8, PerPage(), symmetric=True, scale_dtype="fp32")),
    ("int4a/page", int_format(4, PerPage()), "fp8e4m3/tok", fp8_format(PerToken())),
    ("fp8e5m2/tg8/fp16", fp8_format(PerTokenGroup(8), variant="e5m2", scale_dtype="fp16"), "int8s/ch16", int_format(8, PerChannel(16), symmetric=True)),
    ("fp16", float_format("fp16"), "bf16", float_format("bf16")),
    # Hadamard rotation and MSE clip search, on every scale layout the store kernel computes
    ("int4a/tg16/had/mse", int_format(4, PerTokenGroup(16), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6)),
     "int2a/ch8/mse", int_format(2, PerChannel(8), clip=MSEClip(grid=4, min_ratio=0.5))),
    ("int3s/tok/had", int_format(3, PerToken(), symmetric=True, rotate="hadamard"),
     "fp8e4m3/tg8/had/mse", fp8_format(PerTokenGroup(8), rotate="hadamard", clip=MSEClip(grid=3, min_ratio=0.7))),
    ("int8a/page/mse", int_format(8, PerPage(), clip=MSEClip(grid=4)),
     "int4s/ch4/had/bf16/mse", int_format(4, PerChannel(4), symmetric=True, scale_dtype="bf16", rotate="hadamard",
                                          clip=MSEClip(grid=6, min_ratio=0.3))),
]


#: Three sequences of unequal lengths, and the tokens each step appends: prefill chunks, then
#: single-token steps that flush token blocks out of the window ring.
UNEQUAL_LENS = [63, 17, 40]
UNEQUAL_SCHEDULE = [[30, 10, 27], [20, 0, 1]] + [[1, 1, 1]] * 6 + [[7, 1, 6]]


def store_unequal_batch(cfg: CacheConfig, seed_k: int, seed_v: int):
    """A sentinel-filled cache of :data:`UNEQUAL_LENS` sequences stored per
    :data:`UNEQUAL_SCHEDULE`; returns the cache, its K and V rows and the keys' data."""
    lens = UNEQUAL_LENS
    assert [sum(s[b] for s in UNEQUAL_SCHEDULE) for b in range(3)] == lens
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=3, max_tokens=64, device="cpu")
    sentinel(cache)
    x, y = data(3, 63, seed_k), data(3, 63, seed_v)
    ks = [[x[b, :, :n] for b, n in enumerate(lens)]]
    vs = [[y[b, :, :n] for b, n in enumerate(lens)]]
    fill(cache, ks, vs, UNEQUAL_SCHEDULE)
    return cache, ks, vs, x


@pytest.mark.parametrize("kname,kf,vname,vf", PAIRS, ids=[f"{a}+{c}" for a, _, c, _ in PAIRS])
def test_store_bit_exact_unequal_batch(kname, kf, vname, vf):
    """Three sequences of 63, 17 and 40 tokens: prefill chunks, then single-token steps that flush
    token blocks out of the window ring."""
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=5, sinks=2)
    cache, ks, vs, _ = store_unequal_batch(cfg, 1, 2)
    assert check_exact(cache, cfg, ks, vs) >= 3


# int8 windows: every token-block size the store kernel reads back from the window (one token,
# channel groups, pages), rotated and MSE-clipped formats, fp and int sinks
INT8_WINDOW_PAIRS = [
    (int_format(2, PerChannel(8)), int_format(4, PerToken(), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6))),
    (int_format(3, PerPage(), symmetric=True), float_format("fp16")),
]


@pytest.mark.float_order
@pytest.mark.parametrize("kf,vf", INT8_WINDOW_PAIRS, ids=[f"{a.label()}+{b.label()}" for a, b in INT8_WINDOW_PAIRS])
def test_store_int8_window_bit_exact(kf, vf):
    """An int8 window: the window slots hold the oracle's int8 rows, and every token quantized
    from them when its block fills, or straight from the input, gets the oracle's codes."""
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=5, sinks=2, window_dtype="int8")
    cache, ks, vs, x = store_unequal_batch(cfg, 5, 6)
    assert check_exact(cache, cfg, ks, vs) >= 3
    pool = cache.pools[0]["k"][0]
    assert pool.fp.dtype == torch.uint8 and pool.fp_scale.dtype == torch.float16
    # the window rows are the oracle's: codes and scales of the last five tokens of sequence 0
    slots = [2 + (t - 2) % pool.cap for t in range(58, 63)]
    ref = quantize(x[0, :, 58:63], int_format(8, PerToken(), symmetric=True))
    assert torch.equal(pool.fp[0][:, slots], ref.codes)
    assert torch.equal(pool.fp_scale[0][:, slots], ref.scale[..., 0])


# MSE clip search on heavy-tailed data, where it moves off the first (absmax) ratio: symmetric
# per-token, symmetric channel groups, asymmetric pages with rotation, and fp8 (whose relative
# error keeps ratio 1: the search still runs and must still agree).
MSE_PAIRS = [
    (int_format(3, PerToken(), symmetric=True, clip=MSEClip(grid=8, min_ratio=0.3)),
     int_format(2, PerChannel(16), symmetric=True, clip=MSEClip(grid=8, min_ratio=0.2))),
    (int_format(4, PerPage(), clip=MSEClip(grid=8, min_ratio=0.2), rotate="hadamard"),
     fp8_format(PerTokenGroup(8), variant="e5m2", clip=MSEClip(grid=8, min_ratio=0.1))),
]


@pytest.mark.float_order
@pytest.mark.parametrize("kf,vf", MSE_PAIRS, ids=[f"{a.label()}+{b.label()}" for a, b in MSE_PAIRS])
def test_store_mse_clip_search_bit_exact(kf, vf):

    from kverr.quant import AbsMax

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, H, 63, D, generator=g) ** 3).half().float()
    y = (torch.randn(2, H, 63, D, generator=g) ** 3).half().float()
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=3, sinks=1)
    for fmt, t in ((kf, x), (vf, y)):
        if not fmt.is_fp8:  # the search must really choose: some scale differs from absmax's
            chosen = quantize(t, fmt, page_size=P).scale
            absmax = quantize(t, dataclasses.replace(fmt, clip=AbsMax()), page_size=P).scale
            assert bool((chosen != absmax).any()), fmt.label()
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=2, max_tokens=64, device="cpu")
    sentinel(cache)
    ks, vs = [[x[0], x[1, :, :40]]], [[y[0], y[1, :, :40]]]
    fill(cache, ks, vs, [[33, 20], [1, 1], [29, 19]])
    assert check_exact(cache, cfg, ks, vs) >= 4


def test_store_one_shot_equals_token_by_token():
    """The same sequence stored in one prefill and token by token gives identical pages."""
    cfg = CacheConfig(k=int_format(2, PerChannel(8)), v=int_format(4, PerTokenGroup(16)), page_size=P, window=3, sinks=1)
    x, y = data(1, 63, 3), data(1, 63, 4)
    caches = []
    for schedule in ([[63]], [[1]] * 63):
        c = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=1, max_tokens=63, device="cpu")
        sentinel(c)
        fill(c, [[x[0]]], [[y[0]]], schedule)
        caches.append(c)
    for which in "kv":
        a, b = (c.quantized(0, which, 0)[0][0] for c in caches)
        assert torch.equal(a.codes, b.codes) and torch.equal(bits(a.scale), bits(b.scale))
        assert torch.equal(caches[0].read(0, which, 0), caches[1].read(0, which, 0))


@pytest.mark.float_order
@pytest.mark.parametrize("gran", [PerTensor(), PerHead(), PerChannel(None)], ids=["tensor", "head", "channel-all"])
def test_store_static_scales(gran):
    """Static (calibrated) scales: codes equal the reference's with the same scales; what the cache
    returns equals reconstruct() of the batch (which calibrates jointly over the batch)."""
    kf = fp8_format(gran) if not isinstance(gran, PerChannel) else int_format(4, gran, symmetric=True)
    vf = int_format(8, gran)
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=4, sinks=2)
    x, y = data(2, 37, 5), data(2, 37, 6)
    static = calibrate_static_scales(cfg, [x], [y])
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=2, max_tokens=40,
                         device="cpu", static_scales=static)
    sentinel(cache)
    ks, vs = [[x[0], x[1]]], [[y[0], y[1]]]
    fill(cache, ks, vs, [[20, 20], [17, 17]])
    check_exact(cache, cfg, ks, vs, static=static)
    for which, t in (("k", x), ("v", y)):
        want = reconstruct(t, cfg, layer=0, which=which)
        for b in range(2):
            assert torch.equal(cache.read(0, which, b), want[b])


def test_store_per_channel_widths_bit_exact():
    """Per-channel widths (0, 2, 3, 4 and 8 bits in one row; static channel scales): codes bit-exact
    with the oracle's rows, including rows flushed from an int8 window and a rotated format; what
    the cache returns equals reconstruct() of the batch."""
    # eight 3-bit channels: one byte of their 1-bit plane holds eight pieces, the most a byte holds
    pool = torch.tensor([3] * 8 + [2] * 8 + [0] * 4 + [4] * 4 + [8] * 8)
    widths = tuple(int(b) for b in pool[torch.randperm(D, generator=torch.Generator().manual_seed(3))])
    kf = QuantFormat("int", 8, False, PerChannel(None), "fp16", MSEClip(grid=4, min_ratio=0.5), channel_bits=widths)
    vf = QuantFormat("int", 4, False, PerChannel(None), "bf16", rotate="hadamard",
                     channel_bits=tuple(min(b, 4) for b in reversed(widths)))
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=4, sinks=2, window_dtype="int8")
    x, y = data(2, 37, 5), data(2, 37, 6)
    static = calibrate_static_scales(cfg, [x], [y])
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=2, max_tokens=40,
                         device="cpu", static_scales=static)
    assert {p.spec.bits for per in cache.pools for ps in per.values() for p in ps} == {0}
    sentinel(cache)
    ks, vs = [[x[0], x[1]]], [[y[0], y[1]]]
    fill(cache, ks, vs, [[20, 20], [1, 1], [16, 16]])
    assert check_exact(cache, cfg, ks, vs, static=static) == 4
    for which, t in (("k", x), ("v", y)):
        want = reconstruct(t, cfg, layer=0, which=which)
        for b in range(2):
            assert torch.equal(cache.read(0, which, b), want[b])


# Codebooks: absmax and rms scales on every scale layout the store kernel computes (per row, per
# channel group of rows, per page), named and fitted levels, 2, 3 and 4 bits, rotated, MSE-clipped.
FITTED = (-2.4, -0.4, 0.3, 1.7)  # the largest magnitude is the first level
CODEBOOK_PAIRS = [
    (codebook_format(3, PerToken(), rotate="hadamard", scale_stat="rms"),
     codebook_format(4, PerTokenGroup(8), codebook="nf", clip=MSEClip(grid=4, min_ratio=0.5))),
    (codebook_format(2, PerChannel(8), codebook=FITTED, scale_dtype="fp32"),
     codebook_format(3, PerPage(), scale_stat="rms", scale_dtype="bf16")),
]


@pytest.mark.float_order
@pytest.mark.parametrize("kf,vf", CODEBOOK_PAIRS, ids=[f"{a.label()}+{b.label()}" for a, b in CODEBOOK_PAIRS])
def test_store_codebooks_bit_exact(kf, vf):
    """Codebook codes and scales bit-exact with the oracle over prefill chunks and single-token
    steps of unequal sequences (rms: the float64 sums of squares, their order aside)."""
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=5, sinks=2)
    cache, ks, vs, _ = store_unequal_batch(cfg, 7, 8)
    assert check_exact(cache, cfg, ks, vs) >= 3


# fp4 codes and the one-byte scales: NVFP4's and MXFP4's layouts, MXFP8 (fp8 codes, e8m0
# scales), a two-level integer with fp8 scales; per row, per channel group of rows, per page,
# rotated, MSE-clipped; the data scaled so that no fp8 e4m3 block scale overflows
MICROSCALING_PAIRS = [
    (fp4_format(PerTokenGroup(16)), fp4_format(PerTokenGroup(32), scale_dtype="e8m0")),
    (fp4_format(PerPage(), scale_dtype="e8m0", rotate="hadamard"),
     fp4_format(PerChannel(8), clip=MSEClip(grid=4, min_ratio=0.5))),
    (fp8_format(PerTokenGroup(8), scale_dtype="e8m0"), int_format(2, PerToken(), symmetric=True, scale_dtype="fp8_e4m3")),
    # "four over six", and clip candidates that widen and shrink the range, in the order given
    (fp4_format(PerTokenGroup(16), clip=MSEClip(candidates=(1.0, 1.5))),
     int_format(4, PerTokenGroup(8), symmetric=True, clip=MSEClip(candidates=(0.9, 1.0, 1.25)))),
]


@pytest.mark.float_order
@pytest.mark.parametrize("kf,vf", MICROSCALING_PAIRS, ids=[f"{a.label()}+{b.label()}" for a, b in MICROSCALING_PAIRS])
def test_store_microscaling_bit_exact(kf, vf):
    """fp4 codes and fp8 e4m3 / e8m0 scale bytes bit-exact with the oracle over prefill chunks and
    single-token steps of unequal sequences, the tiny token's blocks included (zero and subnormal
    e4m3 scales, e8m0's 2**-127)."""
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=5, sinks=2)
    lens = UNEQUAL_LENS
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=3, max_tokens=64, device="cpu")
    sentinel(cache)
    x, y = data(3, 63, 9) * 0.125, data(3, 63, 10) * 0.125
    ks = [[x[b, :, :n] for b, n in enumerate(lens)]]
    vs = [[y[b, :, :n] for b, n in enumerate(lens)]]
    fill(cache, ks, vs, UNEQUAL_SCHEDULE)
    assert check_exact(cache, cfg, ks, vs) >= 3
    for which, fmt in (("k", kf), ("v", vf)):  # one-byte scales are stored as their bytes
        want = torch.uint8 if fmt.scale_dtype in ("fp8_e4m3", "e8m0") else torch.float16
        assert cache.pools[0][which][0].scale.dtype == want


# The serving engines' arithmetic (scales rounded to nearest, a floor, codes from the reciprocal,
# integer codes rounded half away from zero): vLLM's per-token-head dtypes and nvfp4 as kverr
# defines them, quanto's nearest fp32 scales with a zero point, and the options on other layouts
# (channel groups of tokens, pages, rms codebooks, the MSE clip search)
ARITH_PAIRS = [
    (VLLM_PRESETS["vllm-int8-per-token-head"].k, VLLM_PRESETS["vllm-fp8-per-token-head"].v),
    (VLLM_PRESETS["vllm-nvfp4"].k, dataclasses.replace(int_format(4, PerTokenGroup(16), scale_dtype="fp32"),
                                                        scale_rounding="nearest")),
    (dataclasses.replace(int_format(2, PerChannel(8), clip=MSEClip(grid=4, min_ratio=0.5)), scale_rounding="nearest",
                         reciprocal=True, rounding="half_away"),
     dataclasses.replace(codebook_format(3, PerPage(), scale_stat="rms", rotate="hadamard"), scale_rounding="nearest",
                         scale_floor=1e-3)),
    (dataclasses.replace(fp4_format(PerTokenGroup(16), scale_dtype="e8m0", clip=MSEClip(candidates=(1.0, 1.5))),
                         scale_rounding="nearest"),
     dataclasses.replace(int_format(3, PerToken(), symmetric=True, scale_dtype="bf16"), scale_rounding="nearest",
                         rounding="half_away", scale_floor=0.5)),
    # vLLM's turboquant_k8v4 (a fixed unit fp8 scale; int4 codes from the fp32 scale and zero), its
    # nvfp4_4over6, and codes from fp32 metadata stored in bf16 on channel groups of tokens
    (VLLM_PRESETS["vllm-turboquant-k8v4"].k, VLLM_PRESETS["vllm-turboquant-k8v4"].v),
    (VLLM_PRESETS["vllm-nvfp4-4over6"].k, VLLM_PRESETS["vllm-turboquant-k8v4"].v),
    (dataclasses.replace(int_format(3, PerTokenGroup(16), symmetric=True, scale_dtype="bf16"),
                         scale_rounding="nearest", encode_with="fp32"),
     dataclasses.replace(int_format(2, PerChannel(8), scale_dtype="bf16"), scale_rounding="nearest",
                         encode_with="fp32", scale_floor=1e-3)),
]


@pytest.mark.float_order
@pytest.mark.parametrize("kf,vf", ARITH_PAIRS, ids=[f"{a.label()}+{b.label()}" for a, b in ARITH_PAIRS])
def test_store_engine_arithmetic_bit_exact(kf, vf):
    """The arithmetic options on the store kernel: codes and scales bit for bit the oracle's over
    prefill chunks and single-token steps of unequal sequences."""
    cfg = CacheConfig(k=kf, v=vf, page_size=P, window=5, sinks=2)
    cache, ks, vs, _ = store_unequal_batch(cfg, 11, 12)
    assert {p.spec.arith for w in "kv" for p in cache.pools[0][w]} != {0}
    assert check_exact(cache, cfg, ks, vs) >= 3


@pytest.mark.float_order
def test_store_reciprocal_rows_bit_exact():
    """Rows in which ``x * (1 / s)`` and ``x / s`` round some elements to different codes (for
    int8 and for fp8 per-token scales): the kernel takes the reciprocal where the format says so."""
    from specs import reciprocal_split_rows

    x = torch.stack([reciprocal_split_rows(torch.int8, torch.float16, D), reciprocal_split_rows(torch.float8_e4m3fn,
                                                                                               torch.float16, D)])
    x = x.reshape(1, 1, 4, D).expand(1, H, 4, D).contiguous()  # [B, H, T, D]: four split rows per head
    cfg = CacheConfig(k=VLLM_PRESETS["vllm-int8-per-token-head"].k, v=VLLM_PRESETS["vllm-fp8-per-token-head"].v,
                      page_size=P)
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=1, max_tokens=16,
                         device="cpu")
    sentinel(cache)
    fill(cache, [[x[0]]], [[x[0]]], [[4]])
    assert check_exact(cache, cfg, [[x[0]]], [[x[0]]]) == 2
    # and the rows do tell the two apart: dividing gives other codes
    for which, fmt in (("k", cfg.k), ("v", cfg.v)):
        divided = quantize(x[0], dataclasses.replace(fmt, reciprocal=False)).codes
        assert not torch.equal(cache.quantized(0, which, 0)[0][0].codes, divided)


def test_static_scales_set_later_and_refused_until_set():
    """static_scales="first": the head groups wait for set_static_scales (each once); a store
    before that, a second set, or an unknown key are refused; once set, the cache stores exactly
    what it stores with the same scales given up front."""
    from kverr.exceptions import ConfigError, KernelError

    cfg = CacheConfig(k=int_format(4, PerChannel(None), symmetric=True), v=int_format(8, PerToken()),
                      page_size=P, window=4, sinks=2)
    x, y = data(2, 37, 5), data(2, 37, 6)
    static = calibrate_static_scales(cfg, [x], [y])
    kw = dict(n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=2, max_tokens=40, device="cpu")
    with pytest.raises(ConfigError, match="first"):
        PagedKVCache(cfg, static_scales="prefill", **kw)
    with pytest.raises(KernelError, match="static scales"):
        PagedKVCache(cfg, **kw)
    late = PagedKVCache(cfg, static_scales="first", **kw)
    assert late.unset_static == set(static)
    with pytest.raises(KernelError, match="not set yet"):
        late.store(late.plan([3, 3]), 0, torch.zeros(2, H, 3, D), torch.zeros(2, H, 3, D))
    late.reset(0), late.reset(1)
    late.set_static_scales(static)
    assert not late.unset_static
    with pytest.raises(KernelError, match="already set"):
        late.set_static_scales(static)
    early = PagedKVCache(cfg, static_scales=static, **kw)
    ks, vs = [[x[0], x[1]]], [[y[0], y[1]]]
    for c in (late, early):
        fill(c, ks, vs, [[20, 20], [17, 17]])
    for b in range(2):
        assert torch.equal(late.read(0, "k", b), early.read(0, "k", b))


def test_store_per_head_and_per_layer_formats():
    """Two layers; layer 1 overrides V, and (1, kv head 1) overrides K: several head groups."""
    from kverr.config import Override

    cfg = CacheConfig(
        k=int_format(4, PerToken()), v=int_format(4, PerTokenGroup(8)), page_size=P, window=2, sinks=0,
        layers={1: Override(v=fp8_format(PerToken(), variant="e5m2"))},
        heads={(1, 1): Override(k=int_format(2, PerChannel(16), symmetric=True))},
    )
    x, y = data(1, 45, 7), data(1, 45, 8)
    cache = PagedKVCache(cfg, n_layers=2, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=1, max_tokens=48, device="cpu")
    assert len(cache.pools[1]["k"]) == 2 and len(cache.launches[1]) == 2
    sentinel(cache)
    ks = [[x[0]], [x[0] * 0.5]]
    vs = [[y[0]], [y[0] * 2.0]]
    fill(cache, ks, vs, [[30], [1], [1], [13]])
    check_exact(cache, cfg, ks, vs)


@pytest.mark.float_order
def test_fp8_rounding_corner_values():
    """Ties, subnormals, the largest finite value and negative zero, for both fp8 variants."""
    e4 = torch.tensor([0.0, -0.0, 448.0, -448.0, 0.0009765625, 0.00146484375, 0.001953125 * 1.5, 2.0 ** -10,
                       17.0, 18.0, 19.0, 20.0, 9.5, 0.3, -7.1, 1e-3] * 2)
    x = torch.stack([e4, e4 * 128.0]).reshape(1, 1, 2, D).expand(1, H, 2, D).contiguous()
    for fmt in (fp8_format(PerTensor()), fp8_format(PerTensor(), variant="e5m2")):
        cfg = CacheConfig(k=fmt, v=fmt, page_size=P)
        static = {(0, w, 0): (torch.tensor(1.0), None) for w in "kv"}
        cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=1, max_tokens=16,
                             device="cpu", static_scales=static)
        fill(cache, [[x[0]]], [[x[0]]], [[2]])
        qt = cache.quantized(0, "k", 0)[0][0]
        ref = quantize(x[0], fmt, scale=torch.tensor(1.0))
        assert torch.equal(qt.codes, ref.codes), fmt.label()


def test_unsupported_formats_raise_kernel_error():
    bad = [int_format(4, PerToken(), clip=Percentile(99.0)), int_format(4, PerChannel(8), clip=Percentile(99.9))]
    for fmt in bad:
        cfg = CacheConfig(k=fmt, v=fmt)
        with pytest.raises(KernelError, match="not implemented"):
            PagedKVCache(cfg, n_layers=1, n_kv_heads=1, n_q_heads=1, head_dim=64, max_batch=1, max_tokens=8, device="cpu")
    cfg = CacheConfig(k=int_format(4, PerToken()), v=int_format(4, PerToken()))
    with pytest.raises(KernelError, match="power-of-two head dimension"):
        PagedKVCache(cfg, n_layers=1, n_kv_heads=1, n_q_heads=1, head_dim=96, max_batch=1, max_tokens=8, device="cpu")
    with pytest.raises(KernelError, match="static scales"):
        PagedKVCache(CacheConfig(k=fp8_format(PerTensor()), v=fp8_format(PerTensor())), n_layers=1, n_kv_heads=1,
                     n_q_heads=1, head_dim=32, max_batch=1, max_tokens=8, device="cpu")


def test_plan_and_store_input_checks():
    cfg = CacheConfig(k=int_format(4, PerToken()), v=int_format(4, PerToken()), page_size=P)
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=2 * H, head_dim=D, max_batch=2, max_tokens=20,
                         device="cpu", num_pages=2)
    with pytest.raises(ShapeError, match="non-negative counts"):
        cache.plan([1])
    with pytest.raises(ShapeError, match="max_tokens"):
        cache.plan([33, 0])
    step = cache.plan([3, 2])
    with pytest.raises(ShapeError, match=r"want \[5, 2, 32\]"):
        cache.store(step, 0, torch.zeros(4, H, D), torch.zeros(4, H, D))
    with pytest.raises(ShapeError, match="layer=3"):
        cache.store(step, 3, torch.zeros(5, H, D), torch.zeros(5, H, D))
    with pytest.raises(KernelError, match="out of pages"):
        cache.plan([15, 15])
    with pytest.raises(ShapeError, match="q must be"):
        cache.decode(step, 0, torch.zeros(2, H, D))


@pytest.mark.parametrize("window_dtype", ["fp16", pytest.param("int8", marks=pytest.mark.float_order)])
def test_store_a_window_per_head_bit_exact(window_dtype):
    """Three kv heads whose windows differ per side (keys: none for heads 0 and 1; values: 40
    tokens for head 1; the rest 16), with formats of other token blocks (16-token channel groups,
    pages, per token): each head group's ring holds its own window (plus a token block), its
    tokens leave it when its own window says, and the codes, scales and what the cache reads back
    are the oracle's, through the prefill chunks and single-token steps of the unequal batch."""
    from kverr.config import Override

    cfg = CacheConfig(k=int_format(2, PerChannel(16)), v=int_format(4, PerTokenGroup(8), symmetric=True), page_size=P,
                      window=16, sinks=2, window_dtype=window_dtype,
                      heads={(0, 0): Override(k_window=0, v=int_format(8, PerPage())),
                             (0, 1): Override(k_window=0, v_window=40), (0, 2): Override(k=fp8_format(PerToken()))})
    lens = UNEQUAL_LENS
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=3, n_q_heads=3, head_dim=D, max_batch=3, max_tokens=64, device="cpu")
    assert [(p.heads, p.window, p.cap) for w in "kv" for p in cache.pools[0][w]] == [
        ([0, 1], 0, 16), ([2], 16, 17), ([0], 16, 32), ([1], 40, 41), ([2], 16, 17)]
    assert cache.job_keys == [(1, 16), (1, 40), (16, 0), (16, 16)]
    sentinel(cache)
    x = torch.cat([data(3, 63, 31), data(3, 63, 32)[:, :1]], dim=1)
    y = torch.cat([data(3, 63, 33), data(3, 63, 34)[:, :1]], dim=1)
    ks = [[x[b, :, :n] for b, n in enumerate(lens)]]
    vs = [[y[b, :, :n] for b, n in enumerate(lens)]]
    fill(cache, ks, vs, UNEQUAL_SCHEDULE)
    assert check_exact(cache, cfg, ks, vs) == 9  # head groups x sequences with a quantized token
    # sequence 0, 63 tokens: keys of heads 0, 1 | head 2; values of head 0 | head 1 | head 2
    assert [end for w in "kv" for *_, end in cache.quantized(0, w, 0)] == [50, 47, 34, 23, 47]
