"""Keys rounded with compensation on the store kernel: codes bit-exact against
:func:`kverr.quant.compensated.compensated_quantize` given the same moment.

Runs the Triton kernels in the interpreter on the CPU (tests/conftest.py). Every factor is the
one :func:`~kverr.quant.compensated.compensation_factor` computes on the host for both sides, so
the claim is the kernel's own arithmetic: the scales, the sequential rule's float64 updates in
the factor's order, each channel encoded and decoded as the format does, the packing.
"""

from __future__ import annotations

import pytest
import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.gpu import PagedKVCache, calibrate_static_scales
from kverr.quant import MSEClip, PerChannel, PerToken, PerTokenGroup, QuantFormat, codebook_format, int_format, quantize
from kverr.quant.compensated import compensable, compensated_quantize, turned_cost
from kverr.quant.store import receive
from kverr.rope import default_inv_freq, rope_cos_sin

from paged_data import D, H, P, data, sentinel

B = 2
LENS = [46, 30]
#: prefill chunks, then single tokens that leave the window, then a chunk
SCHEDULE = [[25, 20], [1, 1], [1, 1], [1, 0], [18, 8]]


def moment(seed: int) -> torch.Tensor:
    """[B, H, D, D] float64 second moments, far from a multiple of the identity."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, H, D, D, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2.0, D, dtype=torch.float64)
    return a @ a.transpose(-1, -2) / D


def rope_tables(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(torch.arange(T), default_inv_freq(D, 10000.0))


def run(cfg: CacheConfig, seed: int, *, static=None, every_step: bool = True, given: bool = True):
    """Fill a sentinel cache per :data:`SCHEDULE`, the moment given with every store (or only with
    the first, or never); returns the cache, the keys and the moment."""
    x, y = data(B, max(LENS), seed), data(B, max(LENS), seed + 1)
    M = moment(seed)
    kw = dict(rope=rope_tables(64)) if cfg.key_pre_rope else {}
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=B, max_tokens=64,
                         device="cpu", static_scales=static, **kw)
    sentinel(cache)
    done = [0] * B
    for i, counts in enumerate(SCHEDULE):
        step = cache.plan(counts)
        k = torch.cat([x[b, :, done[b]:done[b] + n].transpose(0, 1) for b, n in enumerate(counts)])
        v = torch.cat([y[b, :, done[b]:done[b] + n].transpose(0, 1) for b, n in enumerate(counts)])
        cache.store(step, 0, k, v, key_moment=M if given and (every_step or i == 0) else None)
        done = [d + n for d, n in zip(done, counts)]
    assert done == LENS
    return cache, x, M


def expected(cfg: CacheConfig, fmt: QuantFormat, region: torch.Tensor, M: torch.Tensor, start: int, static=None):
    """The oracle's codes of ``region [h, n, D]`` (tokens ``start ..``) under ``M [h, D, D]``."""
    kw = dict(page_size=cfg.page_size)
    if static is not None:
        kw.update(scale=static[0], zero=static[1])
    if not compensable(fmt):
        return quantize(region, fmt, **kw)
    cost = M[:, None]
    if cfg.key_pre_rope:
        cos, sin = rope_tables(64)
        cost = turned_cost(M, cos[start:start + region.shape[1]], sin[start:start + region.shape[1]])
    return compensated_quantize(region, fmt, cost, **kw)


def check(cache, cfg, x, M, static=None) -> int:
    compared = 0
    for b, n in enumerate(LENS):
        for qt, heads, start, end in cache.quantized(0, "k", b):
            if end == start:
                continue
            region = receive(x[b, :, :n], cfg.window_dtype)[heads, start:end]
            st = static.get((0, "k", heads[0])) if static else None
            ref = expected(cfg, qt.fmt, region, M[b, heads], start, st)
            bad = (qt.codes != ref.codes).nonzero()
            assert bad.numel() == 0, f"{qt.fmt.label()} seq {b}: codes differ at {bad[:5].tolist()}"
            compared += 1
    return compared


KEY_FORMATS = [
    int_format(2, PerToken()),
    int_format(3, PerTokenGroup(16), symmetric=True, rotate="hadamard", scale_dtype="bf16"),
    int_format(4, PerChannel(8), clip=MSEClip(grid=4, min_ratio=0.5)),
    int_format(3, PerToken(), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6)),
]


@pytest.mark.float_order
@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
@pytest.mark.parametrize("kf", KEY_FORMATS, ids=[f.label() for f in KEY_FORMATS])
def test_compensated_codes_bit_exact(kf, pre_rope):
    """Per-token, token-group and channel-group scales, symmetric and asymmetric, rotated and
    MSE-clipped: every quantized key row's codes are the oracle's under the same moment (turned
    to each row's position for pre-RoPE keys), in a batch of unequal lengths over prefill chunks
    and single-token steps."""
    cfg = CacheConfig(k=kf, v=int_format(4, PerToken()), page_size=P, window=5, sinks=2,
                      key_rounding="compensated", key_pre_rope=pre_rope)
    cache, x, M = run(cfg, 11)
    assert check(cache, cfg, x, M) == B
    # and the codes are not the nearest ones: the kernel did compensate
    qt, _, start, end = cache.quantized(0, "k", 0)[0]
    near = quantize(receive(x[0, :, :LENS[0]], cfg.window_dtype)[:, start:end], kf, page_size=P)
    assert (qt.codes != near.codes).any()


@pytest.mark.float_order
def test_compensated_per_channel_widths_and_int8_window():
    """Per-channel widths (width-0 channels first in every row's order, static channel scales),
    rows flushed from an int8 window, pre-RoPE keys."""
    pool = torch.tensor([3] * 8 + [2] * 8 + [0] * 4 + [4] * 4 + [8] * 8)
    widths = tuple(int(b) for b in pool[torch.randperm(D, generator=torch.Generator().manual_seed(3))])
    kf = QuantFormat("int", 8, False, PerChannel(None), "fp16", channel_bits=widths)
    cfg = CacheConfig(k=kf, v=int_format(2, PerToken()), page_size=P, window=4, sinks=2, window_dtype="int8",
                      key_rounding="compensated", key_pre_rope=True)
    x = data(B, max(LENS), 21)
    static = calibrate_static_scales(cfg, [x], [data(B, max(LENS), 22)])
    cache, x, M = run(cfg, 21, static=static)
    assert check(cache, cfg, x, M, static) == B


def test_keys_stored_without_the_moment_round_to_nearest():
    """The moment weighs the store it is given with (the prefill): the first store's rows are
    compensated, those later stores quantize (given none) get the format's own codes."""
    kf = int_format(3, PerToken())
    cfg = CacheConfig(k=kf, v=kf, page_size=P, window=5, sinks=2, key_rounding="compensated")
    cache, x, M = run(cfg, 5, every_step=False)
    for b, n in enumerate(LENS):
        qt, heads, start, end = cache.quantized(0, "k", b)[0]
        region = receive(x[b, :, :n], cfg.window_dtype)[:, start:end]
        first = SCHEDULE[0][b] - cfg.window - start  # rows the first store quantized
        comp = expected(cfg, kf, region[:, :first], M[b], start)
        near = quantize(region[:, first:], kf, page_size=P)
        assert first > 0 and end - start > first
        assert torch.equal(qt.codes[:, :first], comp.codes) and torch.equal(qt.codes[:, first:], near.codes)
        assert not torch.equal(comp.codes, quantize(region[:, :first], kf, page_size=P).codes)


@pytest.mark.float_order
@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
def test_static_moments_round_every_store_s_keys(pre_rope):
    """A config with static ``key_moments`` takes no moment from the caller: every store, the
    prefill's chunks and the single-token steps alike, rounds its keys under the layer's stored
    moment (one for both sequences), bit for bit the oracle's; a moment given as well is refused."""
    from kverr.quant.compensated import KeyMoments

    kf = int_format(3, PerTokenGroup(16), rotate="hadamard")
    km = KeyMoments.of(moment(8)[:1])  # one layer
    cfg = CacheConfig(k=kf, v=int_format(4, PerToken()), page_size=P, window=5, sinks=2, key_rounding="compensated",
                      key_pre_rope=pre_rope, key_moments=km)
    cache, x, _ = run(cfg, 13, given=False)
    M = km.layer(0)[None].expand(B, -1, -1, -1)
    assert check(cache, cfg, x, M) == B
    qt, _, start, end = cache.quantized(0, "k", 1)[0]
    near = quantize(receive(x[1, :, :LENS[1]], cfg.window_dtype)[:, start:end], kf, page_size=P)
    first = SCHEDULE[0][1] - cfg.window - start
    assert (qt.codes[:, first:] != near.codes[:, first:]).any()  # the decode steps' keys too
    with pytest.raises(ConfigError, match="static key_moments"):
        cache.store(cache.plan([1, 0]), 0, x[:1, :, 0], x[:1, :, 0], key_moment=moment(8))


def test_codebook_keys_keep_nearest_rounding():
    """Formats compensation does not take (codebooks) keep their own codes under a moment."""
    kf = codebook_format(3, PerToken())
    cfg = CacheConfig(k=kf, v=kf, page_size=P, window=5, sinks=2, key_rounding="compensated")
    cache, x, M = run(cfg, 7)
    assert check(cache, cfg, x, M) == B


def test_key_moment_checked():
    kf = int_format(3, PerToken())
    cfg = CacheConfig(k=kf, v=kf, page_size=P, window=5, sinks=2, key_rounding="compensated")
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=B, max_tokens=64, device="cpu")
    step = cache.plan([20, 20])
    k = data(B, 20, 1).permute(0, 2, 1, 3).reshape(-1, H, D)
    with pytest.raises(ShapeError, match="key_moment"):
        cache.store(step, 0, k, k, key_moment=moment(1)[:, :1])
    bad = moment(1)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        cache.store(step, 0, k, k, key_moment=bad)
    near = CacheConfig(k=kf, v=kf, page_size=P, window=5, sinks=2)
    cache = PagedKVCache(near, n_layers=1, n_kv_heads=H, n_q_heads=H, head_dim=D, max_batch=B, max_tokens=64, device="cpu")
    with pytest.raises(ConfigError, match="nearest"):
        cache.store(cache.plan([20, 20]), 0, k, k, key_moment=moment(1))
