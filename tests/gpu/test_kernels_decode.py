"""Decode attention over the paged quantized cache vs reference attention (kverr.error) over what
the oracle reconstructs (kverr.quant.reconstruct): relative RMS <= 1e-3 in fp32.

Interpreter on the CPU; small odd shapes: GQA, split-K with a merge, sequences of unequal
lengths (one shorter than the sinks), sinks and window, K and V formats with different token
blocks, per-layer and per-head formats, static scales. The output is pre-filled with NaN.
"""

from __future__ import annotations

import pytest
import torch

from kverr.config import CacheConfig, Override
from kverr.exceptions import KernelError, ShapeError
from kverr.gpu import PagedKVCache, calibrate_static_scales
from kverr.memory import ModelShape, account
from kverr.quant import (
    MSEClip, PerChannel, PerHead, PerPage, PerToken, PerTokenGroup, float_format, fp8_format, int_format, reconstruct,
)
from kverr.validation import reference_decode, rel_rms, validate_arrays

# The kernels against the oracle's torch arithmetic: the tests marked float_order run again
# under ATen's baseline kernels in `make test`.

D, P = 32, 16


def _data(L, B, Hq, H, T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, B, Hq, T, D, generator=g) * 2.0
    k = (torch.randn(L, B, H, T, D, generator=g) * torch.linspace(0.2, 3.0, D)).half().float()
    v = torch.randn(L, B, H, T, D, generator=g).half().float()
    return q, k, v


def run_decode(cfg, lens, *, H=2, Hq=6, L=1, seed=0, num_splits=3, dot_fp16=False, static=False, block_n=16):
    """Fill sequences of ``lens`` tokens (prefill chunks, then one decode step) and decode."""
    B, T = len(lens), max(lens)
    q, k, v = _data(L, B, Hq, H, T, seed)
    st = calibrate_static_scales(cfg, [k[l] for l in range(L)], [v[l] for l in range(L)]) if static else None
    cache = PagedKVCache(cfg, n_layers=L, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", static_scales=st, dot_fp16=dot_fp16, block_n=block_n)
    first = [max(n - 1, 0) for n in lens]
    for counts, off in ((first, [0] * B), ([1] * B, first)):
        step = cache.plan(counts, num_splits=num_splits)
        for l in range(L):
            ks = torch.cat([k[l, b, :, off[b]:off[b] + n].transpose(0, 1) for b, n in enumerate(counts)])
            vs = torch.cat([v[l, b, :, off[b]:off[b] + n].transpose(0, 1) for b, n in enumerate(counts)])
            cache.store(step, l, ks, vs)
    worst = 0.0
    kv_map = [h // (Hq // H) for h in range(Hq)]
    for l in range(L):
        qd = torch.stack([q[l, b, :, n - 1] for b, n in enumerate(lens)])
        out = torch.full((B, Hq, D), float("nan"))
        cache.decode(step, l, qd, out=out)
        assert not torch.isnan(out).any()
        for b, n in enumerate(lens):
            kk, vv = k[l, b, :, :n], v[l, b, :, :n]
            if static:  # the reference calibrates static scales over the batch, as the cache did
                kh = reconstruct(k[l], cfg, layer=l, which="k")[b, :, :n]
                vh = reconstruct(v[l], cfg, layer=l, which="v")[b, :, :n]
            else:
                kh = reconstruct(kk, cfg, layer=l, which="k")
                vh = reconstruct(vv, cfg, layer=l, which="v")
            ref, _, _ = reference_decode(qd[b], kk, vv, kh, vh, kv_map)
            worst = max(worst, rel_rms(out[b], ref))
    return worst, step


KIVI2 = CacheConfig(k=int_format(2, PerChannel(8)), v=int_format(2, PerTokenGroup(8)), page_size=P, window=5, sinks=2)


@pytest.mark.float_order
def test_decode_int8_window():
    """An int8 window (sinks, window and pending key blocks as int8 rows with fp16 scales): decode
    matches reference attention over what the oracle reconstructs, which differs from the fp16
    window's (the test sees the int8 rounding)."""
    cfg = KIVI2.with_(window_dtype="int8")
    worst, _ = run_decode(cfg, [45, 3, 30], num_splits=2)
    assert worst <= 1e-3
    _, k, _ = _data(1, 1, 6, 2, 45, 0)
    a = reconstruct(k[0, 0], cfg, layer=0, which="k")
    b = reconstruct(k[0, 0], KIVI2, layer=0, which="k")
    assert not torch.equal(a[:, -5:], b[:, -5:]) and rel_rms(a[:, -5:], b[:, -5:]) < 1e-2


def test_decode_gqa_split_k_unequal_lengths():
    """K quantized in blocks of 8 tokens, V per token: their quantized ranges end differently, so
    the tail program mixes paged and full-precision rows; one sequence is shorter than the sinks."""
    worst, step = run_decode(KIVI2, [63, 1, 40, 18])
    assert step.num_splits == 3
    assert worst <= 1e-3


@pytest.mark.parametrize("splits", [1, 7])
def test_decode_split_counts(splits):
    cfg = CacheConfig(k=int_format(8, PerToken()), v=int_format(4, PerTokenGroup(16), symmetric=True), page_size=P)
    worst, step = run_decode(cfg, [63, 33], num_splits=splits, Hq=2, H=2)
    assert worst <= 1e-3


def test_decode_mixed_per_layer_and_per_head_formats():
    cfg = CacheConfig(
        k=int_format(4, PerToken()), v=int_format(4, PerTokenGroup(8)), page_size=P, window=3, sinks=1,
        layers={1: Override(k=fp8_format(PerToken(), variant="e5m2"), v=int_format(3, PerToken()))},
        heads={(1, 0): Override(k=int_format(8, PerPage(), symmetric=True)), (0, 1): Override(v=float_format("fp16"))},
    )
    worst, _ = run_decode(cfg, [45, 30], L=2, Hq=4)
    assert worst <= 1e-3


@pytest.mark.float_order
def test_decode_static_scales_and_fp8():
    cfg = CacheConfig(k=fp8_format(PerHead()), v=int_format(4, PerChannel(None), symmetric=True), page_size=P, window=4)
    worst, _ = run_decode(cfg, [50, 50], static=True, Hq=2)
    assert worst <= 1e-3


def test_decode_per_channel_widths():
    """Keys and values with a width per channel (0, 2, 3, 4 and 8 bits; static channel scales), one
    of them rotated: decode matches reference attention over what the oracle reconstructs."""
    from kverr.quant import QuantFormat

    widths = tuple((0, 2, 3, 4, 8, 3, 2)[i % 7] for i in range(D))
    kf = QuantFormat("int", 8, False, PerChannel(None), "fp16", channel_bits=widths)
    vf = QuantFormat("int", 4, False, PerChannel(None), "fp16", rotate="hadamard",
                     channel_bits=tuple(min(b, 4) for b in reversed(widths)))
    worst, _ = run_decode(CacheConfig(k=kf, v=vf, page_size=P, window=4, sinks=1), [50, 50], static=True, Hq=4)
    assert worst <= 1e-3


@pytest.mark.float_order
def test_decode_codebooks():
    """Codebook keys (rotated, rms scales per token) and values (fitted levels, static per-head
    scales): decode matches reference attention over what the oracle reconstructs."""
    from kverr.quant import codebook_format

    kf = codebook_format(3, PerToken(), rotate="hadamard", scale_stat="rms")
    vf = codebook_format(2, PerHead(), codebook=(-1.9, -0.4, 0.3, 2.2), scale_dtype="fp32")
    worst, _ = run_decode(CacheConfig(k=kf, v=vf, page_size=P, window=4, sinks=1), [50, 50], static=True, Hq=4)
    assert worst <= 1e-3


@pytest.mark.float_order
def test_decode_microscaling():
    """fp4 codes with fp8 e4m3 scales per 16 channels (NVFP4) and e8m0 scales per page, rotated,
    then MXFP8 keys with static per-head e8m0 scales: decode matches reference attention over
    what the oracle reconstructs."""
    from kverr.quant import fp4_format

    nv = fp4_format(PerTokenGroup(16))
    mx = fp4_format(PerPage(), scale_dtype="e8m0", rotate="hadamard")
    worst, _ = run_decode(CacheConfig(k=nv, v=mx, page_size=P, window=4, sinks=1), [50, 37], Hq=4)
    assert worst <= 1e-3
    kf = fp8_format(PerHead(), scale_dtype="e8m0")
    worst, _ = run_decode(CacheConfig(k=kf, v=nv, page_size=P, window=4, sinks=1), [50, 50], static=True, Hq=4)
    assert worst <= 1e-3


def test_decode_fp16_products():
    """fp16 tensor-core products (fp32 accumulation) stay within a looser bound."""
    worst, _ = run_decode(KIVI2, [63, 20], dot_fp16=True)
    assert worst <= 5e-3


@pytest.mark.float_order
def test_validate_arrays_agrees_and_reports():
    L, B, Hq, H, T = 2, 2, 4, 2, 40
    q, k, v = _data(L, B, Hq, H, T, 3)
    cfg = CacheConfig(k=int_format(2, PerChannel(8)), v=int_format(4, PerTokenGroup(16)), page_size=P, window=4, sinks=1, name="t")
    rep = validate_arrays(cfg, q, k, v, [0, 0, 1, 1], steps=3, num_splits=2, block_n=16)
    assert rep.ok and len(rep.layers) == L
    assert all(r.mismatched == 0 and r.rel_rms <= 1e-3 and r.quant_rel_error > 1e-3 for r in rep.layers)
    d = rep.to_dict()
    assert d["ok"] and d["layers"][0]["k_formats"] == "int2a/ch8/fp16"
    assert "rel RMS" in rep.to_table()
    strict = validate_arrays(cfg, q, k, v, [0, 0, 1, 1], steps=1, tol=1e-12, num_splits=2, block_n=16)
    assert not strict.ok


def test_decode_hadamard_rotated_and_mse_clipped_formats():
    """Rotated keys (channel groups of 8 tokens) and rotated values (per token) with MSE clips:
    the main launch rotates the query and un-rotates the value accumulator, the tail (whose rows
    mix codes and the full-precision window, the two token blocks differing either way) un-rotates its
    rows.
    Layer 1 mixes a rotated and an unrotated head group in one launch pair."""
    mse = MSEClip(grid=5, min_ratio=0.6)
    cfg = CacheConfig(
        k=int_format(2, PerChannel(8), rotate="hadamard", clip=mse),
        v=int_format(4, PerTokenGroup(16), rotate="hadamard", clip=mse),
        page_size=P, window=5, sinks=2,
        layers={1: Override(k=fp8_format(PerToken(), rotate="hadamard"), v=int_format(3, PerChannel(8), symmetric=True))},
        heads={(1, 1): Override(k=int_format(4, PerToken(), clip=mse), v=int_format(8, PerPage(), rotate="hadamard"))},
    )
    worst, step = run_decode(cfg, [63, 1, 40, 18], L=2)
    assert step.num_splits == 3
    assert worst <= 1e-3


_KIVI_HAD = int_format(2, PerChannel(8), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6))


@pytest.mark.float_order
@pytest.mark.parametrize("kf,wdt", [(int_format(4, PerToken()), "fp16"), (_KIVI_HAD, "fp16"), (_KIVI_HAD, "int8")],
                         ids=["int4a-tok", "int2a-ch8-had-mse", "int2a-ch8-had-mse-int8-window"])
def test_decode_pre_rope_keys(kf, wdt):
    """Keys stored before RoPE: the kernel rotates each key row (paged codes, sinks and window) to
    its position; the reference applies RoPE to what the oracle reconstructs of the pre-RoPE keys.
    With an int8 window the kernel decodes the window's int8 rows before rotating them."""
    from kverr.rope import default_inv_freq, rope_cos_sin
    from kverr.rope import rotate

    cfg = CacheConfig(k=kf, v=int_format(4, PerTokenGroup(16)), page_size=P, window=5, sinks=2, key_pre_rope=True,
                      window_dtype=wdt)
    lens, H, Hq = [63, 1, 40], 2, 4
    B, T = len(lens), max(lens)
    q, k_pre, v = _data(1, B, Hq, H, T, 7)
    cos, sin = rope_cos_sin(torch.arange(T), default_inv_freq(D, 10000.0))
    with pytest.raises(KernelError, match="rope="):
        PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T, device="cpu")
    odd = sin.clone()
    odd[3, 1] += 1e-3  # tables outside the half-rotation convention: the halves of a row differ
    with pytest.raises(ShapeError, match="rope sin table: its two halves differ"):
        PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                     device="cpu", rope=(cos, odd))
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", rope=(cos, sin), num_pages=16)
    assert cache.rope_cos.shape == (T, D // 2)  # one half of each table is kept
    first = [n - 1 for n in lens]
    for counts, off in ((first, [0] * B), ([1] * B, first)):
        step = cache.plan(counts, num_splits=3)
        cache.store(step, 0, torch.cat([k_pre[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]),
                    torch.cat([v[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]))
    qd = torch.stack([q[0, b, :, n - 1] for b, n in enumerate(lens)])
    out = torch.full((B, Hq, D), float("nan"))
    cache.decode(step, 0, qd, out=out)
    kv_map = [h // (Hq // H) for h in range(Hq)]
    for b, n in enumerate(lens):
        kk = rotate(k_pre[0, b, :, :n], cos[:n], sin[:n])
        kh = rotate(reconstruct(k_pre[0, b, :, :n], cfg, layer=0, which="k"), cos[:n], sin[:n])
        vv = v[0, b, :, :n]
        ref, clean, _ = reference_decode(qd[b], kk, vv, kh, reconstruct(vv, cfg, layer=0, which="v"), kv_map)
        assert rel_rms(out[b], ref) <= 1e-3
        if n > cfg.sinks + cfg.window + 8:  # some keys are quantized: the format's error is visible
            assert rel_rms(ref, clean) > 1e-3


def _two_chunks(cfg, q, k, v, first, second, **kwargs):
    """A one-layer cache (3 splits) filled with chunks of ``first`` then ``second`` tokens per
    sequence, and the chunked prefill of the second chunk's queries (output pre-filled with NaN)."""
    H, Hq, B, T = k.shape[2], q.shape[2], len(first), k.shape[3]
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", **kwargs)
    for counts, off in ((first, [0] * B), (second, first)):
        step = cache.plan(counts, num_splits=3)
        cache.store(step, 0, torch.cat([k[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]),
                    torch.cat([v[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]))
    qr = torch.cat([q[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(second, first))])
    out = torch.full_like(qr, float("nan"))
    cache.prefill(step, 0, qr, out=out)
    return cache, step, out


@pytest.mark.parametrize("cfg", [
    KIVI2,
    CacheConfig(k=int_format(4, PerToken(), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6)),
                v=int_format(3, PerChannel(16), symmetric=True), page_size=P, window=3, sinks=1),
    KIVI2.with_(window_dtype="int8"),
], ids=["kivi2", "had-mse", "kivi2-int8-window"])
def test_chunked_prefill_over_the_quantized_cache(cfg):
    """A second chunk of queries (unequal per sequence, one sequence with none, one chunk longer
    than the window so its own early tokens are already quantized) attends causally to the cache
    as stored; compared row by row with reference attention over reconstruct() at the final length."""
    H, Hq = 2, 6
    first, second = [20, 9, 33, 5], [30, 0, 7, 1]
    B = len(first)
    lens = [a + b for a, b in zip(first, second)]
    q, k, v = _data(1, B, Hq, H, max(lens), 11)
    cache, step, out = _two_chunks(cfg, q, k, v, first, second)
    assert not torch.isnan(out).any()
    kv_map = [h // (Hq // H) for h in range(Hq)]
    row, worst = 0, 0.0
    for b, n in enumerate(lens):
        kh = reconstruct(k[0, b, :, :n], cfg, layer=0, which="k")
        vh = reconstruct(v[0, b, :, :n], cfg, layer=0, which="v")
        for p in range(first[b], n):
            ref, _, _ = reference_decode(q[0, b, :, p], k[0, b, :, :p + 1], v[0, b, :, :p + 1], kh[:, :p + 1], vh[:, :p + 1], kv_map)
            worst = max(worst, rel_rms(out[row], ref))
            row += 1
    assert row == sum(second) and worst <= 1e-3
    # the last query of each sequence is what decode computes
    last = torch.stack([out[sum(second[:b + 1]) - 1] for b in range(B) if second[b]])
    dec = cache.decode(step, 0, torch.stack([q[0, b, :, n - 1] for b, n in enumerate(lens)]))
    assert rel_rms(last, dec[[b for b in range(B) if second[b]]]) <= 1e-5


@pytest.mark.parametrize("window, with_sinks", [(7, True), (0, True)], ids=["window-sinks", "sinks"])
def test_sliding_window_and_learned_sinks(window, with_sinks):
    """A sliding-window layer (a query at p sees p − W < t ≤ p) and learned sink logits (one more
    softmax term without a value): a chunked prefill row by row and the decode of each sequence's
    last token against reference attention with the same window and sinks. The windows are
    shorter than most sequences, so whole splits and pages fall behind them; with three splits
    some split of a sequence sees nothing."""
    cfg = KIVI2
    H, Hq = 2, 6
    first, second = [20, 9, 33, 5], [6, 0, 7, 1]
    B = len(first)
    lens = [a + b for a, b in zip(first, second)]
    q, k, v = _data(1, B, Hq, H, max(lens), 12)
    sinks = torch.linspace(-1.0, 3.0, Hq)[None] if with_sinks else None
    cache, step, out = _two_chunks(cfg, q, k, v, first, second, sliding_windows=[window], sinks=sinks)
    dec = torch.full((B, Hq, D), float("nan"))
    cache.decode(step, 0, torch.stack([q[0, b, :, n - 1] for b, n in enumerate(lens)]), out=dec)
    assert not torch.isnan(out).any() and not torch.isnan(dec).any()
    kv_map = [h // (Hq // H) for h in range(Hq)]
    sink = None if sinks is None else sinks[0]
    row, worst, moved = 0, 0.0, 0.0
    for b, n in enumerate(lens):
        kh = reconstruct(k[0, b, :, :n], cfg, layer=0, which="k")
        vh = reconstruct(v[0, b, :, :n], cfg, layer=0, which="v")
        for p in range(first[b], n):
            args = (q[0, b, :, p], k[0, b, :, :p + 1], v[0, b, :, :p + 1], kh[:, :p + 1], vh[:, :p + 1], kv_map)
            ref, _, _ = reference_decode(*args, window=window, sink=sink)
            worst = max(worst, rel_rms(out[row], ref))
            if p == n - 1:
                worst = max(worst, rel_rms(dec[b], ref))
            moved = max(moved, rel_rms(reference_decode(*args)[0], ref))
            row += 1
    assert worst <= 1e-3
    assert moved > 1e-2  # the window and the sinks change the attention: the check is not vacuous


@pytest.mark.parametrize("kf, sides", [(KIVI2.k, "kv"), (float_format("fp16"), "kv"), (KIVI2.k, "k")],
                         ids=["int2-keys", "fp16-keys", "key-rows-only"])
def test_salient_rows_are_read_in_place_of_their_codes(kf, sides):
    """Salient tokens (``config.salient``): the prefill's store keeps their int8 rows beside their
    codes. What the cache holds is the oracle's reconstruction with those tokens' rows (bit for
    bit); a chunked prefill after them and decode -- the main launch masking them out of its
    chunks, the tail attending to them from their rows, or from the pages for fp16 keys, which
    keep none, as values do when only keys keep rows -- match reference attention over it. Each
    head has its own positions; one sequence keeps none (its prefill quantizes no token: -1
    entries); reset frees the slot."""
    from kverr.error.salient import choose
    from kverr.quant.store import receive, salient_candidates

    cfg = KIVI2.with_(k=kf, window_dtype="int8", salient=3, salient_sides=sides)
    H, Hq, lens, second = 2, 6, [45, 6, 37], 4
    B, T = len(lens), max(lens)
    q, k, v = _data(1, B, Hq, H, T, 3)
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", block_n=16)
    first = [n - second for n in lens]
    score = torch.rand(1, H, T, generator=torch.Generator().manual_seed(0))
    pos = torch.full((B, H, cfg.salient), -1)
    for b, n in enumerate(first):
        p = choose(score, *salient_candidates(n, cfg, 0, 0), cfg.salient)[0]
        pos[b, :, :p.shape[-1]] = p
    assert (pos[1] == -1).all() and (pos[[0, 2]] >= 0).all()

    def rows(x, counts, off):
        return torch.cat([x[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))])

    step = cache.plan(first, num_splits=3)
    kp, vp = rows(k, first, [0] * B), rows(v, first, [0] * B)
    window = pos.clone()
    window[0, 0, -1] = first[0]  # a token past the step's cannot be salient
    with pytest.raises(ShapeError, match="must ascend"):
        cache.store(step, 0, kp, vp, salient=window)
    cache.store(step, 0, kp, vp, salient=pos)
    with pytest.raises(KernelError, match="already holds"):
        cache.store(cache.plan([0] * B), 0, kp[:0], vp[:0], salient=pos)
    step = cache.plan([second] * B, num_splits=3)
    cache.store(step, 0, rows(k, [second] * B, first), rows(v, [second] * B, first))
    qr = rows(q, [second] * B, first)
    out = torch.full_like(qr, float("nan"))
    cache.prefill(step, 0, qr, out=out)
    kv_map = [h // (Hq // H) for h in range(Hq)]
    worst = 0.0
    for b, n in enumerate(lens):
        held = {}
        for which, x in (("k", k), ("v", v)):
            want = reconstruct(x[0, b, :, :n], cfg, layer=0, which=which)
            if cfg.keeps_salient(which, cfg.k if which == "k" else cfg.v):
                for h in range(H):
                    at = pos[b, h][pos[b, h] >= 0]
                    want[h, at] = receive(x[0, b, h:h + 1, at], "int8")[0]
            held[which] = cache.read(0, which, b)
            assert torch.equal(held[which], want), (b, which)
        for i, p in enumerate(range(first[b], n)):
            ref, _, _ = reference_decode(q[0, b, :, p], k[0, b, :, :p + 1], v[0, b, :, :p + 1], held["k"][:, :p + 1],
                                         held["v"][:, :p + 1], kv_map)
            worst = max(worst, rel_rms(out[b * second + i], ref))
    assert worst <= 1e-3
    dec = cache.decode(step, 0, torch.stack([q[0, b, :, n - 1] for b, n in enumerate(lens)]))
    assert rel_rms(out[second - 1::second], dec) <= 1e-5
    # the rows matter: without them the cache would hold other values at those positions
    side, x = ("v", v) if sides == "kv" else ("k", k)
    plain = reconstruct(x[0, 0, :, :lens[0]], cfg, layer=0, which=side)
    assert not torch.equal(plain[0, pos[0, 0]], cache.read(0, side, 0)[0, pos[0, 0]])
    cache.reset(0)
    sal = cache.pools[0][side][0].sal_pos
    assert (sal[0] == -1).all() and (sal[2] >= 0).all()
    # bytes: per slot, what kverr.memory counts for one sequence (an int8 row, its fp16 scale and
    # an int32 position per salient token, kv head and quantized side)
    plain = PagedKVCache(cfg.with_(salient=0), n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B,
                         max_tokens=T, device="cpu")
    counted = account(cfg, ModelShape(1, H, D), T).totals.salient
    assert counted == (1 if kf.is_float or sides == "k" else 2) * H * cfg.salient * (D + 2 + 4)
    assert cache.nbytes - plain.nbytes == B * counted


def test_the_prompts_newest_tokens_are_read_once_in_the_window_and_from_their_rows_after():
    """``salient_recent``: two of the three salient positions are the prompt's last tokens, still
    in the window when the prefill stores them. While there, the tail reads each once (from the
    ring, not again from its salient row); decode steps then push them out of the window, and
    the main launch masks their codes and the tail reads their rows. At every step the cache
    holds the oracle's reconstruction with those rows (bit for bit) and decode matches
    reference attention over it."""
    from kverr.error.salient import choose, kept_count
    from kverr.quant.store import salient_candidates, token_regions

    cfg = CacheConfig(k=int_format(2, PerToken()), v=int_format(2, PerTokenGroup(8)), page_size=P, window=5, sinks=2,
                      window_dtype="int8", salient=3, salient_recent=2)
    H, Hq, B, n0, steps = 2, 6, 2, 20, 9
    T = n0 + steps
    q, k, v = _data(1, B, Hq, H, T, 5)
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", block_n=16)
    lo, hi = salient_candidates(n0, cfg, 0, 0)
    m, r = kept_count(cfg, n0, [(lo, hi)] * H)
    pos = choose(torch.rand(B, H, n0, generator=torch.Generator().manual_seed(1)), lo, hi, m, r, n0)
    assert (m, r) == (3, 2) and (pos[..., 1:] == torch.tensor([n0 - 2, n0 - 1])).all() and n0 - 2 >= hi

    def rows(x, off, n):
        return torch.cat([x[0, b, :, off:off + n].transpose(0, 1) for b in range(B)])

    step = cache.plan([n0] * B, num_splits=3)
    cache.store(step, 0, rows(k, 0, n0), rows(v, 0, n0), salient=pos)
    kv_map = [h // (Hq // H) for h in range(Hq)]
    worst = 0.0
    for t in range(n0, T):
        step = cache.plan([1] * B, num_splits=2)
        cache.store(step, 0, rows(k, t, 1), rows(v, t, 1))
        out = torch.full((B, Hq, D), float("nan"))
        cache.decode(step, 0, q[0, :, :, t], out=out)
        for b in range(B):
            held = {}
            for which, x in (("k", k), ("v", v)):
                held[which] = reconstruct(x[0, b, :, :t + 1], cfg, layer=0, which=which, salient=pos[b])
                assert torch.equal(cache.read(0, which, b), held[which]), (t, b, which)
            ref, _, _ = reference_decode(q[0, b, :, t], k[0, b, :, :t + 1], v[0, b, :, :t + 1], held["k"], held["v"],
                                         kv_map)
            worst = max(worst, rel_rms(out[b], ref))
    assert worst <= 1e-3
    # by the last step both left the window, and their rows are not their codes
    assert min(token_regions(T, cfg, f)[1] for f in (cfg.k, cfg.v)) > n0 - 1
    plain = reconstruct(v[0, 0, :, :T], cfg, layer=0, which="v")
    assert not torch.equal(plain[:, n0 - 2:n0], cache.read(0, "v", 0)[:, n0 - 2:n0])


def _per_head_windows(window_dtype):
    """Three kv heads: keys int2 in 16-token channel groups (head 2: int4 per token), values int4 per
    token; a 16-token window, except the keys of heads 0 and 1 (none) and the values of head 1
    (40 tokens). K head groups [0, 1] and [2], V head groups [0, 2] and [1]: three launches,
    each side of each with its own window."""
    return CacheConfig(k=int_format(2, PerChannel(16)), v=int_format(4, PerToken()), page_size=P, window=16, sinks=2,
                       window_dtype=window_dtype,
                       heads={(0, 0): Override(k_window=0), (0, 1): Override(k_window=0, v_window=40),
                              (0, 2): Override(k=int_format(4, PerToken()))})


@pytest.mark.parametrize("window_dtype", ["fp16", pytest.param("int8", marks=pytest.mark.float_order)])
def test_decode_a_window_per_head_through_decode_steps(window_dtype):
    """A window length per (kv head, K|V): a prefill, then four single-token steps, decoding after
    each. Every head group's quantized region ends at its own window (head 1's keys, with none,
    end 27 to 39 tokens after its values, with 40: the tail reads more than a key block of codes
    there), tokens leave the windows at different steps, a key block fills in the middle; what
    the cache holds is the oracle's reconstruction bit for bit, and decode matches reference
    attention over it."""
    cfg = _per_head_windows(window_dtype)
    H, Hq, lens, steps = 3, 6, [67, 30, 9], 4
    B, T = len(lens), max(lens)
    q, k, v = _data(1, B, Hq, H, T, 21)
    cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device="cpu", block_n=16)
    assert [ln.heads for ln in cache.launches[0]] == [[0], [1], [2]]
    assert [(p.heads, p.window) for w in "kv" for p in cache.pools[0][w]] == [([0, 1], 0), ([2], 16), ([0, 2], 16), ([1], 40)]
    kv_map = [h // (Hq // H) for h in range(Hq)]
    first = [n - steps for n in lens]
    worst, ends = 0.0, []
    for i in range(steps + 1):
        counts, off = (first, [0] * B) if i == 0 else ([1] * B, [f + i - 1 for f in first])
        step = cache.plan(counts, num_splits=2)
        cache.store(step, 0, torch.cat([k[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]),
                    torch.cat([v[0, b, :, o:o + n].transpose(0, 1) for b, (n, o) in enumerate(zip(counts, off))]))
        now = [f + i for f in first]
        qd = torch.stack([q[0, b, :, n - 1] for b, n in enumerate(now)])
        out = torch.full((B, Hq, D), float("nan"))
        cache.decode(step, 0, qd, out=out)
        assert not torch.isnan(out).any()
        for b, n in enumerate(now):
            kk, vv = k[0, b, :, :n], v[0, b, :, :n]
            kh, vh = reconstruct(kk, cfg, layer=0, which="k"), reconstruct(vv, cfg, layer=0, which="v")
            assert torch.equal(cache.read(0, "k", b), kh) and torch.equal(cache.read(0, "v", b), vh), (i, b)
            ref, _, _ = reference_decode(qd[b], kk, vv, kh, vh, kv_map)
            worst = max(worst, rel_rms(out[b], ref))
        ends.append([end for w in "kv" for *_, end in cache.quantized(0, w, 0)])
    assert worst <= 1e-3
    # sequence 0 (63 .. 67 tokens): keys of heads 0, 1 | head 2 | values of heads 0, 2 | head 1
    assert ends == [[50, 47, 47, 23], [50, 48, 48, 24], [50, 49, 49, 25], [66, 50, 50, 26], [66, 51, 51, 27]]
