"""Salient prompt tokens (``CacheConfig.salient``): which tokens, what is read back, what is
counted, and what is refused."""

from __future__ import annotations

import pytest
import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.hf import KverrCache, cache_kwarg, kernels_support
from kverr.error.salient import OBSERVED_QUERIES, choose
from kverr.memory import ModelShape, account
from kverr.quant import PerChannel, PerToken, int_format, quantize, reconstruct
from kverr.quant.store import receive, without_salient

P, SINKS, WINDOW, N = 48, 2, 4, 5
PER_TOKEN = int_format(2, granularity=PerToken())
STATIC = int_format(2, granularity=PerChannel())


def _prefill(tiny, cfg, ids):
    cache = KverrCache.for_model(tiny.model, cfg)
    with torch.no_grad():
        tiny.model(ids, use_cache=True, **{cache_kwarg(tiny.model): cache})
    return cache


def _ids(seed=0):
    return torch.randint(0, 250, (1, P), generator=torch.Generator().manual_seed(seed))


def _attention(tiny, ids):
    """The model's own attention weights ``[layer][q_head, query, token]`` (eager kernel)."""
    model = tiny.model
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True)
    finally:
        model.set_attn_implementation(before.split("|")[-1])
    return [a[0].double() for a in out.attentions]


@pytest.mark.parametrize("recent", [0, 2])
def test_the_salient_tokens_are_those_the_last_queries_attend_to_most(tiny, recent):
    # Against the model's own eager attention weights: per kv head, the N tokens between the
    # sinks and the window with the largest sum of a² over the prompt's last queries and the
    # query heads that read that kv head -- with salient_recent = R, the prompt's last R tokens
    # (in the window here: their rows are the window's) and the N - R of largest sum. They read
    # back as the int8 rows of their exact values; every other token reads what a cache without
    # salient tokens holds (per-token scales: the salient tokens change nothing else).
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N,
                      salient_recent=recent)
    ids = _ids()
    cache = _prefill(tiny, cfg, ids)
    plain = _prefill(tiny, cfg.with_(salient=0, salient_recent=0), ids)
    exact = _prefill(tiny, CacheConfig(k=PER_TOKEN, v=PER_TOKEN, window=P, window_dtype="fp32"), ids)  # as computed
    attn = _attention(tiny, ids)
    n_kv = tiny.shape.n_kv_heads
    assert P < OBSERVED_QUERIES  # every prompt query votes
    for layer, a in enumerate(attn):
        G = a.shape[0] // n_kv
        votes = (a ** 2).sum(1).reshape(n_kv, G, P).sum(1)  # [kv head, token]
        for w in ("k", "v"):
            got = cache.read(layer, w)
            want_rows = receive(exact.read(layer, w), "int8")
            other = plain.read(layer, w)
            for h in range(n_kv):
                part = votes[h, SINKS:P - WINDOW]
                newest = list(range(P - recent, P))
                want = sorted((torch.topk(part, N - recent).indices + SINKS).tolist()) + newest
                assert cache.layers[layer].groups[w][0].salient_pos[0, h].tolist() == want
                rest = [t for t in range(P) if t not in want]
                assert torch.equal(got[0, h, want], want_rows[0, h, want])
                assert torch.equal(got[0, h, rest], other[0, h, rest])


def test_each_kv_head_chooses_among_the_tokens_both_its_formats_quantize(tiny):
    # kv head 1's values are quantized in blocks of 16 tokens: its prefill quantizes tokens
    # SINKS .. 33 of both sides (32 tokens), so its positions, keys and values alike, lie there;
    # kv head 0, per token on both sides, chooses up to the window. Asked for more tokens than
    # head 1 has, every head keeps as many as head 1 can: 32.
    from kverr.config import Override

    blocks = int_format(2, granularity=PerChannel(16))
    n_layers, many = tiny.shape.n_layers, 36
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=many,
                      heads={(layer, 1): Override(v=blocks) for layer in range(n_layers)})
    ids = _ids()
    cache = _prefill(tiny, cfg, ids)
    attn = _attention(tiny, ids)
    hi1 = SINKS + (P - SINKS - WINDOW) // 16 * 16
    m = hi1 - SINKS
    assert m < many
    beyond = 0
    for layer, a in enumerate(attn):
        G = a.shape[0] // tiny.shape.n_kv_heads
        votes = (a ** 2).sum(1).reshape(-1, G, P).sum(1)
        for h, hi in ((0, P - WINDOW), (1, hi1)):
            want = sorted((torch.topk(votes[h, SINKS:hi], m).indices + SINKS).tolist())
            for w in ("k", "v"):
                g = next(g for g in cache.layers[layer].groups[w] if h in g.heads)
                assert g.salient_pos[0, g.heads.index(h)].tolist() == want, (layer, h, w)
            beyond += h == 0 and max(want) >= hi1
    assert beyond  # head 0 did choose tokens head 1 could not: the ranges are per head


@pytest.mark.parametrize("recent", [0, 2])
def test_static_scales_are_fitted_on_the_other_tokens(tiny, recent):
    # (with salient_recent the prompt's last tokens are in the window, past the fitted block)
    cfg = CacheConfig(k=STATIC, v=STATIC, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N,
                      salient_recent=recent)
    cache = _prefill(tiny, cfg, _ids(1))
    exact = _prefill(tiny, CacheConfig(k=PER_TOKEN, v=PER_TOKEN, window=P, window_dtype="int8"), _ids(1))
    layer = cache.layers[1]
    x = exact.layers[1]._read("v")  # the int8 rows the cache received (values: no RoPE)
    g = layer.groups["v"][0]
    pos = g.salient_pos[0].long()
    assert (pos[:, N - recent:] == torch.arange(P - recent, P)).all()
    for h in range(x.shape[1]):
        keep = [t for t in range(SINKS, P - WINDOW) if t not in pos[h].tolist()]
        ref = quantize(x[:, h:h + 1, keep], STATIC)
        assert torch.equal(g.static_scale[h:h + 1], ref.scale[0])


@pytest.mark.parametrize("fmt,recent", [(PER_TOKEN, 0), (STATIC, 0), (STATIC, 2)],
                         ids=["per-token", "static", "static-recent"])
def test_the_cache_holds_what_reconstruct_says_given_its_salient_positions(tiny, fmt, recent):
    # The oracle given the cache's own positions: salient rows read back as received, static
    # scales fitted on the other tokens, the rest quantized -- bit for bit, both sides, every layer
    # (with salient_recent, positions in the window too).
    cfg = CacheConfig(k=fmt, v=fmt, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N,
                      salient_recent=recent)
    ids = _ids(2)
    cache = _prefill(tiny, cfg, ids)
    exact = _prefill(tiny, CacheConfig(k=PER_TOKEN, v=PER_TOKEN, window=P, window_dtype="fp32"), ids)  # as computed
    for layer in range(tiny.shape.n_layers):
        for w in ("k", "v"):
            pos = cache.layers[layer].groups[w][0].salient_pos
            assert torch.equal(cache.read(layer, w), reconstruct(exact.read(layer, w), cfg, layer=layer, which=w, salient=pos))
            assert torch.equal(cache.read(layer, w), reconstruct(exact.read(layer, w), cfg, layer=layer, which=w,
                                                                 salient=pos[0]))  # shared by the batch
    if recent:
        return
    # without them the oracle reads those tokens back quantized: not what the cache holds
    x = exact.read(0, "v")
    assert not torch.equal(cache.read(0, "v"), reconstruct(x, cfg, layer=0, which="v"))
    pos = cache.layers[0].groups["v"][0].salient_pos.long()
    with pytest.raises(ConfigError, match="keeps no salient"):
        reconstruct(x, cfg.with_(salient=0), layer=0, which="v", salient=pos)
    with pytest.raises(ShapeError, match="want integer"):
        reconstruct(x, cfg, layer=0, which="v", salient=pos.float())
    with pytest.raises(ShapeError, match="want integer"):
        reconstruct(x, cfg, layer=0, which="v", salient=pos > 0)
    with pytest.raises(ShapeError, match="want integer"):  # more than config.salient
        reconstruct(x, cfg, layer=0, which="v", salient=torch.arange(SINKS, SINKS + N + 1).expand(1, x.shape[1], -1))
    with pytest.raises(ShapeError, match="ascend"):
        reconstruct(x, cfg, layer=0, which="v", salient=pos.flip(-1))
    with pytest.raises(ShapeError, match="must lie among"):  # a sink
        reconstruct(x, cfg, layer=0, which="v", salient=torch.cat([pos[..., :1] * 0, pos[..., 1:]], -1))


def test_the_salient_rows_are_counted_as_the_cache_holds_them(tiny):
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N)
    cache = _prefill(tiny, cfg, _ids())
    plain = _prefill(tiny, cfg.with_(salient=0), _ids())
    shape = ModelShape(tiny.shape.n_layers, tiny.shape.n_kv_heads, tiny.shape.head_dim)
    t, t0 = account(cfg, shape, P).totals, account(cfg.with_(salient=0), shape, P).totals
    # one int8 row (64 codes + an fp16 scale) and an int32 position per salient token, head and side
    assert t.salient == 2 * shape.n_layers * shape.n_kv_heads * N * (shape.head_dim + 2 + 4)
    assert cache.nbytes() - plain.nbytes() == t.salient
    assert (t.total - t.page_rounding - t.padding) - (t0.total - t0.page_rounding - t0.padding) == t.salient


def test_decode_steps_and_a_flush_keep_the_salient_rows(tiny):
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N)
    ids = _ids(2)
    cache = _prefill(tiny, cfg, ids)
    before = {w: cache.read(0, w) for w in ("k", "v")}
    with torch.no_grad():
        tiny.model(torch.tensor([[7]]), use_cache=True, **{cache_kwarg(tiny.model): cache})
    cache.flush()
    for w in ("k", "v"):
        g = cache.layers[0].groups[w][0]
        assert g.n_quantized == P + 1 - SINKS
        pos = g.salient_pos[0].long()
        after = cache.read(0, w)
        for h in range(pos.shape[0]):
            assert torch.equal(after[0, h, pos[h]], before[w][0, h, pos[h]])


def test_beam_reorder_takes_the_salient_rows_along(tiny):
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N)
    ids = torch.cat([_ids(3), _ids(4)])
    cache = _prefill(tiny, cfg, ids)
    before = cache.read(1, "k")
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    assert torch.equal(cache.read(1, "k"), before[[1, 1, 0]])


def test_a_cache_that_never_sees_the_queries_refuses_to_quantize(tiny):
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, salient=N)
    shape = tiny.shape
    cache = KverrCache(cfg, shape.n_layers, shape.n_kv_heads, shape.head_dim)
    k = torch.randn(1, shape.n_kv_heads, P, shape.head_dim)
    cache.update(k, k, 0)
    with pytest.raises(ConfigError, match="never saw"):
        cache.flush()


def test_crop_refuses_the_prefill_of_salient_tokens(tiny):
    # (the kernel path runs salient tokens: tests/hf/test_cache.py compares it with this cache)
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, salient=N)
    assert kernels_support(cfg)
    cache = _prefill(tiny, cfg, _ids())
    with pytest.raises(ConfigError, match="crop the prefill"):
        cache.crop(-1)


def test_without_salient_leaves_out_the_tokens_in_the_block():
    # indices past the block (the prompt's last tokens, still in the window) are not in it; every
    # row must have as many in it
    x = torch.arange(12.0).reshape(2, 1, 6, 1)
    out = without_salient(x, torch.tensor([[[1, 7]], [[4, 6]]]))
    assert out[:, 0, :, 0].tolist() == [[0, 2, 3, 4, 5], [6, 7, 8, 9, 11]]
    with pytest.raises(ShapeError, match="as many in it"):
        without_salient(x, torch.tensor([[[1, 2]], [[4, 6]]]))


def test_choose_breaks_ties_to_the_earlier_token_and_stays_in_range():
    sal = torch.tensor([[5.0, 1.0, 1.0, 3.0, 1.0, 9.0]])
    assert choose(sal, 1, 5, 2).tolist() == [[1, 3]]
    assert choose(sal, 1, 3, 5).tolist() == [[1, 2]]
    assert choose(sal, 4, 4, 3).shape == (1, 0)
    # recent: the prompt's last tokens (by default the candidates end it), the rest by saliency
    # among the candidates before them
    assert choose(sal, 0, 6, 3, recent=1).tolist() == [[0, 3, 5]]
    assert choose(sal, 0, 5, 3, recent=2).tolist() == [[0, 3, 4]]
    assert choose(sal, 1, 3, 5, recent=4).tolist() == [[1, 2]]
    assert choose(sal, 0, 6, 2, recent=2).tolist() == [[4, 5]]
    assert choose(sal, 1, 3, 3, recent=2, end=6).tolist() == [[1, 4, 5]]  # past the candidates
    assert choose(sal, 1, 5, 3, recent=2, end=6).tolist() == [[3, 4, 5]]  # 4 is one of both
    with pytest.raises(ValueError, match="recent=3"):
        choose(sal, 0, 6, 2, recent=3)
    with pytest.raises(ValueError, match="past the prompt"):
        choose(sal, 0, 6, 2, end=5)


def test_the_json_carries_salient_only_when_set():
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, salient=12)
    assert CacheConfig.from_json(cfg.to_json()) == cfg
    assert "salient" not in cfg.with_(salient=0).to_dict() and "salient_sides" not in cfg.to_dict()
    keys = cfg.with_(salient_sides="k")
    assert keys.to_dict()["salient_sides"] == "k" and CacheConfig.from_json(keys.to_json()) == keys
    with pytest.raises(ConfigError, match="salient"):
        CacheConfig(k=PER_TOKEN, v=PER_TOKEN, salient=-1)
    with pytest.raises(ConfigError, match="salient_sides='vk'"):
        cfg.with_(salient_sides="vk")
    recent = cfg.with_(salient_recent=4)
    assert "salient_recent" not in cfg.to_dict() and recent.to_dict()["salient_recent"] == 4
    assert CacheConfig.from_json(recent.to_json()) == recent
    with pytest.raises(ConfigError, match="salient_recent=13"):
        cfg.with_(salient_recent=13)
    with pytest.raises(ConfigError, match="salient_recent=-1"):
        cfg.with_(salient_recent=-1)


def test_one_side_keeps_rows_the_other_reads_its_codes(tiny):
    # salient_sides="k": the keys read the rows at the positions a "kv" cache chooses, the values
    # read what a cache without salient tokens holds; only the key rows are counted and held.
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N)
    ids = _ids()
    both, keys, plain = (_prefill(tiny, c, ids) for c in (cfg, cfg.with_(salient_sides="k"), cfg.with_(salient=0)))
    for layer in range(tiny.shape.n_layers):
        assert torch.equal(keys.read(layer, "k"), both.read(layer, "k"))
        assert torch.equal(keys.read(layer, "v"), plain.read(layer, "v"))
        assert not torch.equal(keys.read(layer, "k"), plain.read(layer, "k"))
        assert keys.layers[layer].groups["v"][0].salient_pos is None
    shape = ModelShape(tiny.shape.n_layers, tiny.shape.n_kv_heads, tiny.shape.head_dim)
    counted = account(cfg.with_(salient_sides="k"), shape, P).totals.salient
    assert counted * 2 == account(cfg, shape, P).totals.salient
    assert keys.nbytes() - plain.nbytes() == counted


def test_a_left_padded_batch_chooses_each_sequence_its_own_tokens(tiny):
    # Each sequence is stored from its first real token; its salient tokens are chosen from its
    # own prompt's attention: the same as that sequence prefilled alone, up to float ties.
    cfg = CacheConfig(k=PER_TOKEN, v=PER_TOKEN, sinks=SINKS, window=WINDOW, window_dtype="int8", salient=N)
    a, b = _ids(5)[0], _ids(6)[0, :P - 9]
    pad = P - b.shape[0]
    ids = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = (torch.arange(P)[None] >= torch.tensor([[0], [pad]])).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KverrCache.for_model(tiny.model, cfg)
    with torch.no_grad():
        tiny.model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(tiny.model): cache})
    alone = [_prefill(tiny, cfg, x[None]) for x in (a, b)]
    for layer in range(tiny.shape.n_layers):
        rows = cache.layers[layer].rows
        assert rows is not None and len(rows) == 2
        for r, one in zip(rows, alone):
            for w in ("k", "v"):
                got, want = r.groups[w][0].salient_pos, one.layers[layer].groups[w][0].salient_pos
                assert torch.equal(got, want)


def test_prompt_saliency_is_the_saliency_of_each_prefix():
    # One sequence, prompts ending at several tokens: each row is token_saliency of that prefix
    # (bit for bit: the same arithmetic), 0 past its end; stride s lets every s-th query vote.
    from kverr.error.salient import prompt_saliency, token_saliency

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g)
    ends = [299, 40, 0]
    got = prompt_saliency(q, k, 0.3, ends)
    for i, e in enumerate(ends):
        assert torch.equal(got[:, i, :e + 1], token_saliency(q[:, :e + 1], k[:, :e + 1], 0.3))
        assert not got[:, i, e + 1:].any()
    strided = prompt_saliency(q, k, 0.3, [40], stride=8)[:, 0, :41]
    a = torch.softmax((q[:, 40 - torch.arange(6) * 8][:, :, None] * k.repeat_interleave(2, 0)[:, None, :41]).sum(-1)
                      .mul(0.3).masked_fill(torch.arange(41)[None, None] > (40 - torch.arange(6) * 8)[None, :, None],
                                            float("-inf")), -1)
    torch.testing.assert_close(strided, (a.double() ** 2).sum(1).reshape(2, 2, 41).sum(1), rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="stride"):
        prompt_saliency(q, k, 0.3, [40], stride=0)
    with pytest.raises(ValueError, match="prompt end 300"):
        prompt_saliency(q, k, 0.3, [300])
