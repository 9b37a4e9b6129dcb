"""KverrCache beyond one plain sequence: left-padded batches, crop, copies, batch selections --
each against the same cache fed the tokens it should then hold, and, with fp32 storage, inside
``generate`` against the model's own cache. The kernel path refuses what it cannot do."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kverr.config import PRESETS, CacheConfig
from kverr.exceptions import ConfigError
from kverr.hf import KverrCache, cache_kwarg
from kverr.quant import PerChannel, PerHead, PerToken, float_format, fp8_format, int_format, is_static, quantize

from strategies import configs

L, H, D = 2, 3, 16
EXACT = CacheConfig(k=float_format("fp32"), v=float_format("fp32"), window_dtype="fp32")


def _rotary(positions: torch.Tensor):
    """A RoPE table for head dim ``D`` (what ``model_rotary`` gives for a model)."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = positions.float()[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _cache(cfg, **kw):
    return KverrCache(cfg, L, H, D, rotary=_rotary if cfg.key_pre_rope else None, **kw)


def _dynamic(cfg: CacheConfig) -> bool:
    return not any(not f.is_float and is_static(f.granularity) for _, f in cfg._all_formats())


def _positions(pads, n):
    """Position ids of a left-padded batch, as generate derives them from the attention mask."""
    return torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), torch.arange(n - p)]) for p in pads])


def _padded(g, pads, n, extra):
    """Per layer, K and V ``[B, H, n + extra, D]``: real tokens after the pads; the pads are
    huge, so a pad that reached a scale, a sink or a stored row would show."""
    out = []
    for _ in range(L):
        kv = []
        for _ in "kv":
            x = torch.randn(len(pads), H, n + extra, D, generator=g)
            for b, p in enumerate(pads):
                x[b, :, :p] = 1e4 * torch.randn(H, p, D, generator=g)
            kv.append(x)
        out.append(kv)
    return out


def _feed(cache, data, cuts, pads=None, lo=0, row=None):
    """Feed tokens ``[lo, cut)`` chunk by chunk; position ids (left padding) with the first."""
    start = lo
    for end in cuts:
        for i, (k, v) in enumerate(data):
            k, v = k[:, :, start:end], v[:, :, start:end]
            if row is not None:
                k, v = k[row:row + 1], v[row:row + 1]
            kw = {}
            if start == lo and pads is not None:
                kw["kwargs"] = {"position_ids": _positions(pads, end - start)}
            cache.update(k, v, i, **kw)
        start = end


def _reads(cache):
    return [(cache.read(i, "k"), cache.read(i, "v")) for i in range(L)]


@given(cfg=configs(L, H, D).filter(_dynamic), pads=st.lists(st.integers(0, 20), min_size=2, max_size=3),
       n=st.integers(1, 50), steps=st.lists(st.integers(1, 3), max_size=3), seed=st.integers(0, 2**16))
@settings(max_examples=25)
def test_left_padded_batch_stores_each_sequence_as_it_stores_it_alone(cfg, pads, n, steps, seed):
    # Formats whose scales are dynamic: each sequence of a left-padded batch is stored exactly
    # as it is stored alone (its sinks its first real tokens, its token blocks from its first
    # real token, pre-RoPE keys at its own positions); pads (huge here) are never stored and
    # read as zeros, which the attention mask hides.
    g = torch.Generator().manual_seed(seed)
    N = max(pads) + n
    cuts = [N]
    for s in steps:
        cuts.append(cuts[-1] + s)
    data = _padded(g, pads, N, cuts[-1] - N)
    batch = _cache(cfg)
    _feed(batch, data, cuts, pads)
    assert batch.get_seq_length() == cuts[-1]
    got = _reads(batch)
    total = 0
    for b, p in enumerate(pads):
        alone = _cache(cfg)
        _feed(alone, data, cuts, lo=p, row=b)
        total += alone.nbytes()
        for (bk, bv), (ak, av) in zip(got, _reads(alone)):
            assert torch.equal(bk[b, :, p:], ak[0]) and torch.equal(bv[b, :, p:], av[0])
            assert not bk[b, :, :p].any() and not bv[b, :, :p].any()
    if any(pads):
        assert batch.nbytes() == total  # nothing stored for the pads


def test_static_scales_of_a_padded_batch_come_from_its_real_tokens_jointly():
    # Static scales are shared by the batch (one calibrated set per layer in a deployed cache):
    # not given, they come jointly from the real tokens the sequences quantize first (sinks
    # and window left out); the pads (huge here) count for nothing.
    kfmt, vfmt = int_format(4, PerChannel(None)), fp8_format(PerHead())
    cfg = CacheConfig(k=kfmt, v=vfmt, window=3, sinks=1, window_dtype="fp32")
    pads, N = [0, 6], 20
    g = torch.Generator().manual_seed(0)
    data = _padded(g, pads, N, 2)
    batch = _cache(cfg)
    _feed(batch, data, [N, N + 1, N + 2], pads)
    got = _reads(batch)
    for i in range(L):
        given = {}
        for w, fmt in (("k", kfmt), ("v", vfmt)):
            x = data[i]["kv".index(w)]
            first = torch.cat([x[b:b + 1, :, p + 1:N - 3] for b, p in enumerate(pads)], 2)  # after sinks, before window
            ref = quantize(first, fmt)
            given[w] = (ref.scale[0], None if ref.zero is None else ref.zero[0])
            for b in range(2):
                assert torch.equal(batch.layers[i].rows[b].groups[w][0].static_scale, given[w][0])
        for b, p in enumerate(pads):
            alone = KverrCache(cfg, L, H, D, static_scales={j: given for j in range(L)})
            _feed(alone, [data[i]] * L, [N, N + 1, N + 2], lo=p, row=b)
            assert torch.equal(got[i][0][b, :, p:], alone.read(0, "k")[0])
            assert torch.equal(got[i][1][b, :, p:], alone.read(0, "v")[0])


@given(cfg=configs(L, H, D), pads=st.sampled_from([None, [0, 0], [0, 5], [3, 1]]), n=st.integers(6, 60),
       steps=st.lists(st.integers(1, 6), max_size=3), remove=st.integers(1, 6), seed=st.integers(0, 2**16))
@settings(max_examples=25)
def test_crop_holds_what_the_kept_tokens_alone_give(cfg, pads, n, steps, remove, seed):
    # crop removes tokens of the last update exactly: the cache then holds, byte for byte, what
    # a cache fed only the kept tokens (in the same chunks) holds -- the token policy and static
    # scales re-derived from them -- and the next update stores on top of it the same way.
    g = torch.Generator().manual_seed(seed)
    cuts = [n]
    for s in steps:
        cuts.append(cuts[-1] + s)
    last = cuts[-1] - (cuts[-2] if len(cuts) > 1 else 0)
    assume(remove <= last and (len(cuts) > 1 or remove < n - 5))
    data = _padded(g, pads or [0, 0], cuts[-1] + 1, 0)
    cache, want = _cache(cfg), _cache(cfg)
    _feed(cache, data, cuts, pads)
    cache.crop(-remove)
    kept = cuts[:-1] + ([cuts[-1] - remove] if last > remove else [])
    _feed(want, data, kept, pads)
    assert cache.get_seq_length() == want.get_seq_length() == cuts[-1] - remove
    for got, ref in zip(_reads(cache), _reads(want)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert cache.nbytes() == want.nbytes()
    for c in (cache, want):  # one more token on both
        for i, (k, v) in enumerate(data):
            c.update(k[:, :, cuts[-1] - remove:cuts[-1] - remove + 1], v[:, :, cuts[-1] - remove:cuts[-1] - remove + 1], i)
    for got, ref in zip(_reads(cache), _reads(want)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_crop_refuses_what_it_cannot_undo_and_takes_a_length_to_keep():
    g = torch.Generator().manual_seed(1)
    data = _padded(g, [0], 40, 0)
    cfg = CacheConfig(k=int_format(4, PerChannel(4)), v=int_format(4, PerToken()), window=4)
    cache = _cache(cfg)
    _feed(cache, data, [30, 33])
    with pytest.raises(ConfigError, match="only the 3 tokens of the last update can be removed exactly"):
        cache.crop(-4)
    before = _reads(cache)
    cache.crop(0)  # removes nothing
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_reads(cache), before))
    cache.crop(31)  # a positive value is the length to keep (transformers 4)
    want = _cache(cfg)
    _feed(want, data, [30, 31])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(_reads(cache), _reads(want)))
    cache.crop(-1)  # the kept token of the last update can go too
    assert cache.get_seq_length() == 30
    with pytest.raises(ConfigError, match="the last update was already cropped away"):
        cache.crop(-1)
    _feed(cache, data, [32], lo=30)
    cache.flush()
    with pytest.raises(ConfigError, match="flushed after its last update"):
        cache.crop(-1)
    _feed(cache, data, [33], lo=32)
    cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ConfigError, match="reordered or selected after the last update"):
        cache.crop(-1)


@pytest.mark.parametrize("pads", [None, [2, 0, 5]])
def test_copies_and_batch_selections(pads):
    # deepcopy is independent of its original; batch_select_indices and batch_repeat_interleave
    # read exactly the selected rows of what was read before, and store on top as any rows.
    cfg = PRESETS["kivi-2"].with_(window=3, sinks=1, page_size=16, k=int_format(2, PerChannel(4)),
                                  v=int_format(2, PerToken()))
    g = torch.Generator().manual_seed(2)
    data = _padded(g, pads or [0, 0, 0], 30, 2)
    cache = _cache(cfg)
    _feed(cache, data, [30], pads)
    before = _reads(cache)
    twin = copy.deepcopy(cache)
    _feed(twin, data, [31], lo=30)
    assert twin.get_seq_length() == 31 and cache.get_seq_length() == 30
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(_reads(cache), before))
    _feed(cache, data, [31], lo=30)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(_reads(cache), _reads(twin)))

    for op, arg, idx in [("batch_select_indices", torch.tensor([2, 0]), [2, 0]),
                         ("batch_select_indices", torch.tensor([True, False, True]), [0, 2]),
                         ("batch_repeat_interleave", 2, [0, 0, 1, 1, 2, 2])]:
        c = copy.deepcopy(twin)
        ref = _reads(c)
        getattr(c, op)(arg)
        assert all(torch.equal(a[0], b[0][idx]) and torch.equal(a[1], b[1][idx]) for a, b in zip(_reads(c), ref))
        for i, (k, v) in enumerate(data):  # a step on the selected rows: each row on its own
            c.update(k[idx, :, 31:32], v[idx, :, 31:32], i)
        assert c.read(0, "k").shape == (len(idx), H, 32, D)
        if op == "batch_repeat_interleave":  # repeated rows stay equal, and independent objects
            r = c.read(1, "v")
            assert torch.equal(r[0], r[1]) and torch.equal(r[4], r[5])


# ---------------------------------------------------------------------------------------------
# Inside generate (the small random llama of tests/hf/conftest.py)
# ---------------------------------------------------------------------------------------------


def _prompts():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 256, (12,), generator=g), torch.randint(1, 256, (7,), generator=g)
    ids, mask = torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 5:], mask[1, 5:] = b, 1
    return (a, b), ids, mask


def _generate(model, cache, ids, mask=None, **kw):
    out = model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


def test_left_padded_generate_with_fp32_storage_is_the_models_own_cache(tiny):
    # Pads are not stored (read as zeros); the attention mask gives them weight exactly 0, so
    # with fp32 storage the tokens and logits are bit for bit the model's own cache's.
    from transformers import DynamicCache

    _, ids, mask = _prompts()
    cache = KverrCache.for_model(tiny.model, EXACT)
    got = _generate(tiny.model, cache, ids, mask, max_new_tokens=6)
    assert cache.layers[0].pads == [0, 5]  # the padding reached the cache
    want = _generate(tiny.model, DynamicCache(), ids, mask, max_new_tokens=6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.slow
def test_left_padded_generate_stores_each_prompt_as_generated_alone(tiny):
    # A quantized config whose key scales span tokens (2-bit keys per channel over 4-token
    # groups) with sinks and a window. The model computes a batch in a different float order
    # than one sequence (its logits differ by ~1e-6 even with its own cache), so the padded run's
    # cache is given exactly the keys and values the prompts' own runs gave theirs (the pads:
    # its own, times 1e3); then each sequence is stored bit for bit as it is alone.
    from kverr.quant import PerTokenGroup

    cfg = CacheConfig(k=int_format(2, PerChannel(4)), v=int_format(4, PerTokenGroup(32)), window=3, sinks=2,
                      page_size=16)
    prompts, ids, mask = _prompts()
    pads = [12 - len(p) for p in prompts]
    seen, alone = [], []
    for p in prompts:
        rec: dict = {}
        alone.append(_spy(KverrCache.for_model(tiny.model, cfg), record=rec))
        seen.append((_generate(tiny.model, alone[-1], p[None], max_new_tokens=5)[0][0], rec))

    def force(i, n, k, v):
        ks, vs = [], []
        for b, (_, rec) in enumerate(seen):
            ak, av = rec[i, n]
            ks.append(torch.cat([k[b:b + 1, :, :pads[b]] * 1e3, ak], 2) if n == 0 else ak)
            vs.append(torch.cat([v[b:b + 1, :, :pads[b]] * 1e3, av], 2) if n == 0 else av)
        return torch.cat(ks), torch.cat(vs)

    batch = _spy(KverrCache.for_model(tiny.model, cfg), force=force)
    out = _generate(tiny.model, batch, ids, mask, max_new_tokens=5)[0]
    for b, p in enumerate(pads):
        assert torch.equal(out[b, p:], seen[b][0])
        for i in range(tiny.model.config.num_hidden_layers):
            for w in "kv":
                got, want = batch.read(i, w)[b], alone[b].read(i, w)[0]
                assert torch.equal(got[:, p:], want) and not got[:, :p].any()
    assert any(c.n_quantized for c in batch.layers[0].rows[1].groups["k"])  # keys really quantized


def _spy(cache, record=None, force=None):
    """Wrap each layer's update: record its (k, v) per call, or replace them by force(i, n, k, v)."""
    calls: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        def update(k, v, *args, _inner=layer.update, _i=i, **kwargs):
            n = calls[_i] = calls.get(_i, 0) + 1
            if force is not None:
                k, v = force(_i, n - 1, k, v)
            if record is not None:
                record[_i, n - 1] = (k.clone(), v.clone())
            return _inner(k, v, *args, **kwargs)

        layer.update = update
    return cache


def test_assisted_decoding_crops_exactly(tiny):
    # Prompt-lookup decoding verifies several drafted tokens per step and crops the rejected
    # ones: with fp32 storage, the same tokens and logits as the model's own cache.
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(4)
    half = torch.randint(1, 60, (1, 16), generator=g)
    ids = torch.cat([half, half, half[:, :4]], 1)  # repeats: prompt lookup finds drafts
    crops: list[int] = []
    cache = KverrCache.for_model(tiny.model, EXACT)
    inner = cache.crop
    cache.crop = lambda n: (crops.append(n), inner(n))[1]
    got = _generate(tiny.model, cache, ids, prompt_lookup_num_tokens=3, max_new_tokens=8)
    want = _generate(tiny.model, DynamicCache(), ids, prompt_lookup_num_tokens=3, max_new_tokens=8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert any(n < 0 for n in crops)  # drafts were rejected and cropped
    q = KverrCache.for_model(tiny.model, PRESETS["kivi-2"].with_(window=4))
    out = _generate(tiny.model, q, ids, prompt_lookup_num_tokens=3, max_new_tokens=8)[0]
    assert q.get_seq_length() == out.shape[1] - 1


def test_what_generate_calls_for_several_sequences(tiny):
    # num_return_sequences expands the prompt before the prefill: transformers' generate calls
    # neither batch_repeat_interleave nor batch_select_indices (tested above, at the cache);
    # the sampled sequences are the model's own cache's, seed for seed.
    from transformers import DynamicCache

    calls: list[str] = []
    cache = KverrCache.for_model(tiny.model, EXACT)
    for name in ("batch_repeat_interleave", "batch_select_indices", "reorder_cache", "crop"):
        inner = getattr(cache, name)
        setattr(cache, name, lambda *a, _n=name, _f=inner: (calls.append(_n), _f(*a))[1])
    ids = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(6))
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=5, top_k=0)
    torch.manual_seed(0)
    got = tiny.model.generate(ids, **{cache_kwarg(tiny.model): cache}, **kw)
    torch.manual_seed(0)
    want = tiny.model.generate(ids, **{cache_kwarg(tiny.model): DynamicCache()}, **kw)
    assert torch.equal(got, want) and got.shape[0] == 3
    assert calls == []


def test_kernel_path_refuses_what_it_cannot_do(tiny):
    from kverr.hf import KernelKVCache

    _, ids, mask = _prompts()
    with KernelKVCache.for_model(tiny.model, PRESETS["int8-token"], batch=2, max_tokens=64) as kc:
        with pytest.raises(ConfigError, match="left-padded batches .* not supported on the kernel path"):
            tiny.model.generate(ids, attention_mask=mask, **{cache_kwarg(tiny.model): kc}, max_new_tokens=2)
        with pytest.raises(ConfigError, match="crop .* not supported on the kernel path"):
            kc.crop(-1)
        kc.crop(0)
        with pytest.raises(ConfigError, match="cannot be copied"):
            copy.deepcopy(kc)
        for op, arg in (("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([0]))):
            with pytest.raises(ConfigError, match=f"{op} is not supported on the kernel path"):
                getattr(kc, op)(arg)
