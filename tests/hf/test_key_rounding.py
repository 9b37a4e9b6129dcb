"""Keys rounded with error compensation in the reference cache (``CacheConfig.key_rounding``):
the codes are the oracle's under the prefill queries' second moment, the bytes and everything
else are the config's, and what cannot run it says so."""

from __future__ import annotations

import pytest
import torch

from kverr.config import CacheConfig
from kverr.error.salient import OBSERVED_QUERIES
from kverr.exceptions import ConfigError
from kverr.hf import KverrCache, cache_kwarg, kernels_support
from kverr.quant import PerChannel, PerToken, int_format
from kverr.quant.compensated import compensated_quantize, query_moment, turned_cost
from kverr.quant.store import receive
from kverr.rope import rotate, unrotate
from model_keys import prefill_keys

P, SINKS, WINDOW = 40, 2, 6
KEYS = int_format(2, granularity=PerChannel())  # static per-channel scales, as the calibrated configs' keys
VALUES = int_format(2, granularity=PerToken())
CFG = CacheConfig(k=KEYS, v=VALUES, sinks=SINKS, window=WINDOW, key_rounding="compensated")


def _ids(seed=0, n=P):
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(tiny, cfg, ids):
    cache = KverrCache.for_model(tiny.model, cfg)
    with torch.no_grad():
        tiny.model(ids, use_cache=True, **{cache_kwarg(tiny.model): cache})
    return cache


def _queries(tiny, ids):
    """The model's post-RoPE queries ``[layer][B, q_head, n, D]``, from its own q_proj and RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, out = tiny.model, []
    hooks = [m.q_proj.register_forward_hook(lambda m, i, o, out=out: out.append(o.detach()))
             for m in model.modules() if hasattr(m, "q_proj")]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    B, n = ids.shape
    D = tiny.shape.head_dim
    cos, sin = model.model.rotary_emb(out[0], torch.arange(n)[None])
    qs = []
    for q in out:
        q = q.view(B, n, -1, D).transpose(1, 2)
        qs.append(apply_rotary_pos_emb(q, q, cos, sin)[0])
    return qs


@pytest.mark.parametrize("pre_rope", [False, True])
def test_the_prefill_keys_are_the_oracles_compensated_codes_on_the_nearest_grid(tiny, pre_rope):
    # Each layer's key cost is the second moment of its prefill's last queries; the quantized keys
    # are compensated_quantize's codes under it (turned to each position for pre-RoPE keys), on the
    # same static scales as a nearest-rounding cache; the values, and the bytes, are unchanged.
    cfg = CFG.with_(key_pre_rope=pre_rope)
    ids = _ids()
    comp, near = _prefill(tiny, cfg, ids), _prefill(tiny, cfg.with_(key_rounding="nearest"), ids)
    qs, ks = _queries(tiny, ids), prefill_keys(tiny.model, ids)
    assert P < OBSERVED_QUERIES
    for layer in range(tiny.shape.n_layers):
        g, g0 = comp.layers[layer].groups["k"][0], near.layers[layer].groups["k"][0]
        torch.testing.assert_close(g.key_cost, query_moment(qs[layer], tiny.shape.n_kv_heads, OBSERVED_QUERIES),
                                   rtol=1e-5, atol=1e-6)  # the model's float32 queries, two computations
        assert torch.equal(g.static_scale, g0.static_scale) and torch.equal(g.static_zero, g0.static_zero)
        x = ks[layer][:, :, SINKS:P - WINDOW]
        cost = g.key_cost[:, :, None]
        if pre_rope:
            cos, sin = comp.layers[layer]._cos_sin(SINKS, P - WINDOW)
            x = unrotate(x.float(), cos, sin)  # the keys as the cache stores them
            cost = turned_cost(g.key_cost, cos, sin)
        x = receive(x, cfg.window_dtype)  # pending tokens wait in the window dtype
        want = compensated_quantize(x, KEYS, cost, page_size=cfg.page_size, scale=g.static_scale, zero=g.static_zero)
        assert len(g.chunks) == 1 and torch.equal(g.chunks[0].codes, want.codes)
        assert not torch.equal(g.chunks[0].codes, g0.chunks[0].codes)
        assert torch.equal(comp.read(layer, "v"), near.read(layer, "v"))
    assert comp.nbytes() == near.nbytes()


@pytest.mark.parametrize("pre_rope", [False, True])
def test_the_oracle_given_the_prefill_s_moment_holds_what_the_cache_holds(tiny, pre_rope):
    # reconstruct with the key cost of the cache's own moment (KeyCost.of_moment; turned under the
    # model's RoPE for pre-RoPE keys) reads back every key as the cache does, bit for bit.
    from kverr.quant import reconstruct
    from kverr.quant.compensated import KeyCost

    cfg = CFG.with_(key_pre_rope=pre_rope)
    ids = _ids(7)
    cache = _prefill(tiny, cfg, ids)
    rotary = tiny.model.model.rotary_emb
    rope = {"inv_freq": rotary.inv_freq.tolist(), "attention_scaling": float(rotary.attention_scaling)}
    for layer, k in enumerate(prefill_keys(tiny.model, ids)):
        moment = cache.layers[layer].groups["k"][0].key_cost
        if pre_rope:
            cos, sin = cache.layers[layer]._cos_sin(0, P)
            got = rotate(reconstruct(unrotate(k.float(), cos, sin), cfg, layer=layer, which="k",
                                     key_cost=KeyCost.of_moment(moment, positions=torch.arange(P), rope=rope)), cos, sin)
        else:
            got = reconstruct(k, cfg, layer=layer, which="k", key_cost=KeyCost.of_moment(moment))
        assert torch.equal(cache.read(layer, "k"), got)


def test_decode_tokens_leaving_the_window_round_to_nearest(tiny):
    # the prefill's moment weighs the keys quantized with the prefill (and by a flush right after
    # it), then the cache drops it: the decode tokens that leave the window get the nearest codes
    # on the same grid, and the cache keeps nothing per sequence
    ids = _ids(1, P + 3 * WINDOW)
    for flush in (False, True):
        comp = _prefill(tiny, CFG, ids[:, :P])
        near = _prefill(tiny, CFG.with_(key_rounding="nearest"), ids[:, :P])
        if flush:
            comp.flush()
            near.flush()
        first = [len(c.layers[0].groups["k"][0].chunks) for c in (comp, near)]
        with torch.no_grad():
            for t in range(P, ids.shape[1]):
                for c in (comp, near):
                    tiny.model(ids[:, t:t + 1], use_cache=True, **{cache_kwarg(tiny.model): c})
        for layer in range(tiny.shape.n_layers):
            g, g0 = comp.layers[layer].groups["k"][0], near.layers[layer].groups["k"][0]
            assert g.key_cost is None and g.n_quantized == g0.n_quantized > P - SINKS - WINDOW
            prompt = [torch.cat([c.codes for c in x.chunks[:n]], -2) for x, n in zip((g, g0), first)]
            assert not torch.equal(*prompt)  # compensated with the prefill (and its flush)
            late = [torch.cat([c.codes for c in x.chunks[n:]], -2) for x, n in zip((g, g0), first)]
            # layer 0's decode keys are the same numbers in both caches (the embeddings'); above it
            # they follow attention over differently rounded prompt keys
            assert late[0].shape[-2] > 0 and (layer > 0 or torch.equal(*late))
        assert comp.nbytes() == near.nbytes()


def test_beam_reorder_takes_the_key_cost_along(tiny):
    cache = _prefill(tiny, CFG, torch.cat([_ids(3), _ids(4)]))
    before = cache.layers[1].groups["k"][0].key_cost.clone()
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    assert torch.equal(cache.layers[1].groups["k"][0].key_cost, before[[1, 1, 0]])


def test_a_left_padded_batch_weighs_each_sequence_by_its_own_queries(tiny):
    a, b = _ids(5)[0], _ids(6)[0, :P - 9]
    pad = P - b.shape[0]
    ids = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = (torch.arange(P)[None] >= torch.tensor([[0], [pad]])).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KverrCache.for_model(tiny.model, CFG)
    with torch.no_grad():
        tiny.model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(tiny.model): cache})
    alone = [_prefill(tiny, CFG, x[None]) for x in (a, b)]
    for layer in range(tiny.shape.n_layers):
        for r, one in zip(cache.layers[layer].rows, alone):
            torch.testing.assert_close(r.groups["k"][0].key_cost, one.layers[layer].groups["k"][0].key_cost,
                                       rtol=1e-4, atol=1e-6)  # a padded batch's float32 attention differs a little


def test_what_cannot_run_it_says_so(tiny):
    shape = tiny.shape
    cache = KverrCache(CFG, shape.n_layers, shape.n_kv_heads, shape.head_dim)
    k = torch.randn(1, shape.n_kv_heads, P, shape.head_dim)
    cache.update(k, k, 0)
    with pytest.raises(ConfigError, match="never saw"):
        cache.flush()
    with pytest.raises(ConfigError, match="crop the prefill"):
        _prefill(tiny, CFG, _ids()).crop(-1)
    assert kernels_support(CFG)  # the store kernel rounds with compensation (tests/gpu/test_kernels_compensated.py)


def test_the_json_carries_key_rounding_only_when_set():
    assert CacheConfig.from_json(CFG.to_json()) == CFG and CFG.to_dict()["key_rounding"] == "compensated"
    assert "key_rounding" not in CFG.with_(key_rounding="nearest").to_dict()
    assert CFG.needs_queries and not CFG.with_(key_rounding="nearest").needs_queries
    with pytest.raises(ConfigError, match="key_rounding='gptq' is not allowed"):
        CFG.with_(key_rounding="gptq")


def test_evaluate_compensated_keys_measures_the_same_bytes_with_other_codes(tiny, tmp_path):
    from kverr.capturing.text import load_text
    from kverr.evaluation import evaluate, parse_schemes

    path = CFG.with_(key_rounding="nearest", name="plain").save(tmp_path / "plain.json")
    schemes = parse_schemes(["fp16"], [str(path)], compensated_keys=True)
    assert [s.name for s in schemes] == ["fp16", "plain+ck"] and schemes[1].config.key_rounding == "compensated"
    with pytest.raises(ConfigError, match="--compensated-keys: no scheme"):
        parse_schemes(["fp16"], compensated_keys=True)
    both = [*parse_schemes([], [str(path)]), schemes[1]]
    df = evaluate(tiny, load_text("pydoc"), both, prefill=(P,), decode=2 * WINDOW, segments=1, offset=0,
                  greedy_steps=0, progress=False).set_index("scheme")
    assert df.loc["plain+ck", "cache_bytes"] == df.loc["plain", "cache_bytes"]
    assert df.loc["plain+ck", "measured_cache_bytes"] == df.loc["plain", "measured_cache_bytes"]
    assert df.loc["plain+ck", "mean_kl"] != df.loc["plain", "mean_kl"]
