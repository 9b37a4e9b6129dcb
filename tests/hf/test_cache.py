"""KverrCache: the same numbers as the oracle, inside real transformers models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kverr.hf import KverrCache
from kverr.config import PRESETS, CacheConfig, Override
from kverr.exceptions import ConfigError, ShapeError
from kverr.memory import ModelShape, account
from kverr.quant import PerHead, float_format, fp8_format, is_static, quantize, reconstruct
from kverr.rope import rotate, unrotate

from bounds import gamma
from strategies import configs

L, H, D = 2, 3, 16


def _dynamic(cfg: CacheConfig) -> bool:
    fmts = [cfg.k, cfg.v] + [getattr(o, w) for o in (*cfg.layers.values(), *cfg.heads.values()) for w in "kv"]
    return not any(f is not None and not f.is_float and is_static(f.granularity) for f in fmts)


def _feed(cache: KverrCache, ks, vs, cuts):
    """Append K/V of every layer to the cache in chunks ending at ``cuts``; return what attention saw last."""
    start = 0
    seen = None
    for end in cuts:
        seen = [cache.update(k[:, :, start:end], v[:, :, start:end], i) for i, (k, v) in enumerate(zip(ks, vs))]
        start = end
    return seen


@given(
    cfg=configs(L, H, D).filter(lambda c: not c.key_pre_rope and _dynamic(c)),
    T=st.integers(1, 120),
    n_cuts=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40)
def test_cache_holds_exactly_what_reconstruct_says_whatever_the_chunking(cfg, T, n_cuts, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(2, H, T, D, generator=g) for _ in range(L)]
    vs = [torch.randn(2, H, T, D, generator=g) for _ in range(L)]
    cuts = sorted(set(torch.randint(1, T + 1, (n_cuts,), generator=g).tolist()) | {T})
    cache = KverrCache(cfg, L, H, D)
    _feed(cache, ks, vs, cuts)
    for i in range(L):
        assert torch.equal(cache.read(i, "k"), reconstruct(ks[i], cfg, layer=i, which="k"))
        assert torch.equal(cache.read(i, "v"), reconstruct(vs[i], cfg, layer=i, which="v"))
    assert cache.get_seq_length() == T
    # The cache holds exactly the unpadded bytes of the accounting: no pages, no alignment here.
    t = account(cfg, ModelShape(L, H, D), T, batch=2).totals
    assert cache.nbytes() == t.total - t.page_rounding - t.padding


@given(cfg=configs(L, H, D).filter(lambda c: not c.key_pre_rope), T=st.integers(1, 90),
       seed=st.integers(0, 2**16))
@settings(max_examples=25)
def test_beam_reorder_selects_the_stored_sequences_as_stored(cfg, T, seed):
    # Beam search keeps some sequences and repeats others: every stored tensor (codes, scales,
    # sinks, window rows, the dequantized chunks) is selected along the batch, nothing quantized
    # again, so the cache then reads exactly the selected rows of what it read before; and a
    # later step stores on top of the reordered rows as it would on any others.
    g = torch.Generator().manual_seed(seed)
    B = 3
    ks = [torch.randn(B, H, T + 1, D, generator=g) for _ in range(L)]
    vs = [torch.randn(B, H, T + 1, D, generator=g) for _ in range(L)]
    cache = KverrCache(cfg, L, H, D)
    _feed(cache, [k[:, :, :T] for k in ks], [v[:, :, :T] for v in vs], [T])
    before = [(cache.read(i, "k"), cache.read(i, "v")) for i in range(L)]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for i in range(L):
        assert torch.equal(cache.read(i, "k"), before[i][0][beam_idx])
        assert torch.equal(cache.read(i, "v"), before[i][1][beam_idx])
    for i in range(L):
        cache.update(ks[i][:, :, T:], vs[i][:, :, T:], i)
    assert cache.get_seq_length() == T + 1 and cache.read(0, "k").shape == (B, H, T + 1, D)


def test_prefill_attends_to_fresh_values_later_steps_to_storage():
    cfg = PRESETS["q4_0"]
    ks = [torch.randn(1, H, 40, 32)]
    vs = [torch.randn(1, H, 40, 32)]
    cache = KverrCache(cfg, 1, H, 32)
    first_k, _ = cache.update(ks[0][:, :, :30], vs[0][:, :, :30], 0)
    assert torch.equal(first_k, ks[0][:, :, :30])  # the prefill attends to fresh keys
    k, v = cache.update(ks[0][:, :, 30:], vs[0][:, :, 30:], 0)
    # a decode step stores first, then reads everything back, its own tokens included
    assert torch.equal(k, reconstruct(ks[0], cfg, layer=0, which="k"))
    assert torch.equal(v, reconstruct(vs[0], cfg, layer=0, which="v"))


def test_flush_quantizes_whole_blocks_regardless_of_the_window():
    cfg = PRESETS["kivi-2"]  # keys in 32-token groups, window 128
    k = torch.randn(1, H, 100, 64)
    cache = KverrCache(cfg, 1, H, 64)
    cache.update(k, k.clone(), 0)
    assert cache.layers[0].groups["k"][0].n_quantized == 0  # all 100 inside the window
    cache.flush()
    gk, gv = cache.layers[0].groups["k"][0], cache.layers[0].groups["v"][0]
    assert gk.n_quantized == 96 and gk.n_pending == 4  # 3 whole key groups
    assert gv.n_quantized == 100 and gv.n_pending == 0  # per-token values: everything


def test_static_scales_come_from_the_first_chunk_or_are_given():
    fmt = fp8_format(PerHead())
    cfg = CacheConfig(k=fmt, v=fmt)
    x = torch.randn(1, H, 50, 16).half().float()  # the cache's own dtype: no extra rounding
    cache = KverrCache(cfg, 1, H, 16)
    cache.update(x[:, :, :20], x[:, :, :20], 0)
    cache.update(x[:, :, 20:] * 4, x[:, :, 20:] * 4, 0)
    first = quantize(x[:, :, :20], fmt)
    expect = quantize(torch.cat([x[:, :, :20], x[:, :, 20:] * 4], 2), fmt, scale=first.scale, zero=None).dequantize()
    assert torch.equal(cache.read(0, "k"), expect)
    given_scale = torch.full((H, 1, 1), 0.01)
    cache = KverrCache(cfg, 1, H, 16, static_scales={0: {"k": (given_scale, None)}})
    cache.update(x, x, 0)
    assert torch.equal(cache.read(0, "k"), quantize(x, fmt, scale=given_scale).dequantize())


def test_rope_inverse():
    pos = torch.arange(10)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2) / 16))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    assert torch.allclose(unrotate(rotate(x, cos, sin), cos, sin), x, atol=1e-12)


def test_cache_rejects_what_does_not_fit():
    with pytest.raises(ConfigError, match="layers.5 overrides a layer the model does not have"):
        KverrCache(PRESETS["q4_0"].with_(layers={5: Override(k=float_format())}), 2, H, 64)
    with pytest.raises(ConfigError, match="does not divide the head dimension 48"):
        KverrCache(PRESETS["q4_0"], 2, H, 48)
    with pytest.raises(ConfigError, match="rotary"):
        KverrCache(PRESETS["q4_0"].with_(key_pre_rope=True), 2, H, 64)
    cache = KverrCache(PRESETS["q4_0"], 1, H, 64)
    with pytest.raises(ShapeError, match="do not have 3 kv heads"):
        cache.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), 0)


# ---------------------------------------------------------------------------------------------
# Inside real transformers models (small random ones; the bundled model where the claim needs it)
# ---------------------------------------------------------------------------------------------


# the `tiny` fixture: tests/hf/conftest.py


def _logits(model, cache, ids, prefill):
    from kverr.evaluation import teacher_forced

    return teacher_forced(model, cache, ids, prefill, flush=False)


@pytest.mark.float_order
@pytest.mark.parametrize("pre_rope", [False, True])
def test_full_precision_config_reproduces_the_model(tiny, pre_rope):
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (60,))
    cfg = CacheConfig(k=float_format("fp32"), v=float_format("fp32"), window_dtype="fp32", key_pre_rope=pre_rope)
    ref = _logits(tiny.model, DynamicCache(), ids, 40)
    got = _logits(tiny.model, KverrCache.for_model(tiny.model, cfg), ids, 40)
    if pre_rope:
        # undoing and redoing RoPE changes the keys in their last bits (two rotations, a few ulps),
        # which the layers above propagate like any last-bit difference: at most the attention's
        # worst-case fp32 rounding (_logprob_bound, as in _kernel_path_agrees)
        assert float((ref - got).abs().max()) <= _logprob_bound(tiny.model, len(ids), ref)
    else:
        assert torch.equal(ref, got)


def test_generate_runs_through_the_cache(tiny):
    cfg = PRESETS["kivi-2"].with_(window=8)
    ids = torch.randint(0, 256, (1, 30))
    cache = KverrCache.for_model(tiny.model, cfg)
    from kverr.hf import cache_kwarg

    out = tiny.model.generate(ids, **{cache_kwarg(tiny.model): cache}, max_new_tokens=12, do_sample=False)
    assert out.shape == (1, 42)
    assert cache.get_seq_length() == 41  # the last generated token is never fed back
    assert cache.layers[0].groups["v"][0].n_quantized > 0


def test_beam_search_through_the_cache(tiny):
    # With fp32 storage the cache holds exactly what the model's own cache holds, so beam search
    # (which reorders the cache every step) gives the same tokens; a quantized config runs too.
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=2)
    exact = CacheConfig(k=float_format("fp32"), v=float_format("fp32"), window_dtype="fp32")
    from kverr.hf import cache_kwarg

    def generate(cache):
        return tiny.model.generate(ids, **{cache_kwarg(tiny.model): cache}, **kw)

    want = generate(DynamicCache())
    assert torch.equal(generate(KverrCache.for_model(tiny.model, exact)), want)
    out = generate(KverrCache.for_model(tiny.model, PRESETS["kivi-2"]))
    assert out.shape == want.shape


@pytest.mark.float_order
def test_pre_rope_keys_are_what_gets_quantized(tiny):
    """With key_pre_rope, the stored keys equal the oracle applied to pre-RoPE keys."""
    from kverr.hf import model_rotary

    cfg = PRESETS["q4_0"].with_(key_pre_rope=True)
    rotary = model_rotary(tiny.model)
    cache = KverrCache(cfg, 1, 2, 64, rotary=rotary)
    k = torch.randn(1, 2, 20, 64)
    cache.update(k, k.clone(), 0)
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # move the first chunk into storage view
    cos, sin = rotary(torch.arange(20))
    expect = rotate(reconstruct(unrotate(k, cos, sin), cfg, layer=0, which="k"), cos, sin)
    assert torch.allclose(cache.read(0, "k")[:, :, :20], expect, atol=1e-6)


def _rotated_pre_rope():
    from kverr.quant import MSEClip, PerChannel, PerTokenGroup, int_format

    mse = MSEClip(grid=5, min_ratio=0.6)
    return CacheConfig(k=int_format(4, PerChannel(16), rotate="hadamard", clip=mse),
                       v=int_format(4, PerTokenGroup(16), rotate="hadamard", clip=mse), sinks=2, key_pre_rope=True)


def _static_pre_rope():
    from kverr.quant import MSEClip, PerChannel, int_format

    return CacheConfig(k=int_format(2, PerChannel(None), rotate="hadamard", clip=MSEClip(grid=9, min_ratio=0.2)),
                       v=int_format(3, PerChannel(None), clip=MSEClip(grid=5, min_ratio=0.6)), sinks=2,
                       key_pre_rope=True)


def _recording(cache, record=None, force=None):
    """Wrap each layer's ``update`` of ``cache``: record the keys and values it receives per
    (layer, call), or replace them by those of ``force`` (the other path's inputs)."""
    calls: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        def update(k, v, *args, _inner=layer.update, _i=i, **kwargs):
            n = calls[_i] = calls.get(_i, 0) + 1
            if force is not None:
                fk, fv = force[_i, n - 1]
                assert fk.shape == k.shape, (fk.shape, k.shape)
                k, v = fk.to(k.dtype), fv.to(v.dtype)
            if record is not None:
                record[_i, n - 1] = (k.clone(), v.clone())
            return _inner(k, v, *args, **kwargs)

        layer.update = update
    return cache


def _chunked_logprobs(model, cache, ids, chunks):
    from kverr.hf import cache_kwarg

    out, t, kw = [], 0, cache_kwarg(model)
    with torch.no_grad():
        for n in chunks:
            logits = model(input_ids=ids[None, t:t + n], use_cache=True, **{kw: cache}).logits[0]
            out.append(torch.log_softmax(logits.float(), -1))
            t += n
    return torch.cat(out)


def _kernel_path_agrees(model, cfg, ids, chunks):
    """Run ``cfg`` through KverrCache and through the kernel path, and check that they agree.

    Each layer's keys and values come from the layers below it, whose attention the two paths
    compute with different float32 summation orders (torch's attention against the kernels'):
    from layer 1 on, the inputs the two caches receive differ in the last bits, and a 2-bit code
    at a rounding boundary may flip -- one quantization step, which the next layers amplify
    (by ~3e-4 in the log-probs on some CPUs). Which codes sit at a boundary depends on the CPU's
    vector width, so a tolerance could not hold everywhere. Instead the kernel path's caches
    receive exactly the keys and values the reference path's caches received. Then:

    - what each cache holds is kverr's own arithmetic on the same inputs (the store kernel
      against the oracle), so it must agree bit for bit, every layer, keys and values;
    - the log-probs differ only by the attention's float32 rounding, propagated upwards. Each
      layer's attention sums over ``D`` channels for the scores and ``T`` keys for the softmax
      and the weighted sum: a worst-case relative error of ``gamma(D) + 2 gamma(T)`` per layer
      (``gamma(n) = n u / (1 - n u)``, u = 2**-24), added over the layers and scaled by the
      log-probs' magnitude (:func:`_logprob_bound`).
    """
    from kverr.hf import KernelKVCache, cache_for, model_rotary

    inputs: dict = {}
    reference = _recording(cache_for(model, cfg), record=inputs)
    ref = _chunked_logprobs(model, reference, ids, chunks)
    attn = model.config._attn_implementation
    with KernelKVCache.for_model(model, cfg, max_tokens=64) as kc:
        got = _chunked_logprobs(model, _recording(kc, force=inputs), ids, chunks)
        assert kc.nbytes() > 0
        T = len(ids)
        cos, sin = model_rotary(model)(torch.arange(T))
        for i in range(model.config.num_hidden_layers):
            for which in "kv":
                held = kc.paged.read(i, which, 0)[None]
                if which == "k" and cfg.key_pre_rope:
                    held = rotate(held, cos, sin)
                want = reference.read(i, which)
                assert torch.equal(held, want), (i, which, int((held != want).sum()))
                if cfg.salient:  # the same positions, chosen by the same prefill queries
                    for g in reference.layers[i].groups[which]:
                        pool = next(p for p in kc.paged.pools[i][which] if p.heads == g.heads)
                        if g.salient_pos is None:
                            assert pool.sal_pos is None
                        else:
                            assert torch.equal(pool.sal_pos[:, :, :g.salient_pos.shape[-1]], g.salient_pos)
                            assert g.salient_pos.shape[-1] == cfg.salient
    assert model.config._attn_implementation == attn  # the model is restored
    assert float((ref - got).abs().max()) <= _logprob_bound(model, len(ids), ref)
    return ref


def _logprob_bound(model, T, ref):
    """How far last-bit differences in each layer's attention can move the log-probs: the
    worst-case rounding of the attention's reductions (``gamma(D)`` for the scores, ``gamma(T)``
    twice for the softmax and the weighted sum), added over the layers, times |log p|."""
    c = model.config
    D = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * (gamma(D) + 2 * gamma(T)) * float(ref.abs().max())


def _moments(tiny):
    """Static key moments for the tiny model: those of random queries with channels of unequal size."""
    from kverr.quant.compensated import KeyMoments, query_moment

    s = tiny.shape
    g = torch.Generator().manual_seed(9)
    q = torch.randn(s.n_layers, s.n_kv_heads, 32, s.head_dim, generator=g) * torch.linspace(0.1, 3.0, s.head_dim)
    return KeyMoments.of(torch.stack([query_moment(x[None], s.n_kv_heads, 32)[0] for x in q]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kivi-2", "int8-token", "static-pre-rope", "int8-window-pre-rope", "salient",
                                  "compensated", "compensated-pre-rope", "static-moments-pre-rope",
                                  "window-per-head"])
def test_kernel_path_in_the_model_agrees_with_the_reference_path(tiny, name):
    """The same config through the Triton kernels (interpreter here) and through KverrCache:
    the same cache contents and next-token distributions, through every layer of a real
    transformers model (including Hadamard-rotated, MSE-clipped formats on keys stored before
    RoPE with sinks, window and pending key blocks held as int8 rows, static per-channel
    scales, which both caches set from the prefill, and salient prompt tokens, which both
    choose from the prefill's queries (two of them the prompt's newest, in one config), K and V with different token blocks, and keys rounded with
    compensation under the prefill queries' moment, which both take from the same queries, before
    and after RoPE, or under static moments the config carries, the decode keys too, and a window
    length per layer and (layer, kv head, K|V), from none to 20 tokens). A prefill of
    40 tokens, then three
    single-token decode steps (the decode kernel; each moves a token out of the 8-token window
    into the quantized region, the path every later step repeats)."""
    from kverr.hf import cache_for

    named = {"static-pre-rope": _static_pre_rope,
             "int8-window-pre-rope": lambda: _rotated_pre_rope().with_(window_dtype="int8"),
             "salient": lambda: _static_pre_rope().with_(v=_rotated_pre_rope().k, window_dtype="int8", salient=5),
             "compensated": lambda: PRESETS["kivi-2"].with_(key_rounding="compensated"),
             "compensated-pre-rope": lambda: _static_pre_rope().with_(window_dtype="int8", salient=5, salient_recent=2,
                                                                      key_rounding="compensated"),
             "static-moments-pre-rope": lambda: _static_pre_rope().with_(key_rounding="compensated",
                                                                         key_moments=_moments(tiny)),
             "window-per-head": lambda: PRESETS["kivi-2"].with_(
                 layers={1: Override(v_window=20)},
                 heads={(0, 0): Override(k_window=0, v_window=0), (1, 1): Override(k_window=12),
                        (2, 1): Override(v_window=3)})}
    cfg = (named[name]() if name in named else PRESETS[name]).with_(window=8)
    ids = torch.randint(0, 256, (43,), generator=torch.Generator().manual_seed(3))
    chunks = [40] + [1] * 3
    ref = _kernel_path_agrees(tiny.model, cfg, ids, chunks)
    fp16 = _chunked_logprobs(tiny.model, cache_for(tiny.model, PRESETS["fp16"]), ids, chunks)
    assert float((ref - fp16)[40:].abs().max()) > 1e-3  # the check can fail: formats differ


def test_cache_for_picks_the_reference_path_on_a_cpu(tiny):
    from kverr.hf import cache_for, kernels_support

    assert isinstance(cache_for(tiny.model, PRESETS["kivi-2"]), KverrCache)
    assert kernels_support(PRESETS["kivi-2"])
    assert kernels_support(_rotated_pre_rope())
    from kverr.quant import Percentile, PerToken, int_format

    assert not kernels_support(PRESETS["kivi-2"].with_(k=int_format(4, PerToken(), clip=Percentile(99.0))))
    with pytest.raises(ConfigError, match="backend='gpu' is not allowed"):
        cache_for(tiny.model, PRESETS["kivi-2"], backend="gpu")


@pytest.mark.float_order
@pytest.mark.slow
def test_kernel_path_chunked_prefill_agrees_with_the_reference_path(tiny):
    """Chunks of several tokens after the prefill run the chunked-prefill kernel (causal attention
    over the cache as stored); single tokens the decode kernel. Same cache contents and log-probs
    as KverrCache, given the same inputs (see _kernel_path_agrees)."""
    from kverr.hf import cache_for

    cfg = PRESETS["kivi-2"].with_(window=6, sinks=2)
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(5))
    chunks = [20, 9, 1, 14, 1]
    ref = _kernel_path_agrees(tiny.model, cfg, ids, chunks)
    fp16 = _chunked_logprobs(tiny.model, cache_for(tiny.model, PRESETS["fp16"]), ids, chunks)
    assert float((ref - fp16)[20:].abs().max()) > 1e-3  # the chunks really read quantized tokens
