"""Static query moments (``CacheConfig.key_moments``): a config that carries them rounds every key
it quantizes -- prompt and decode, every sequence -- under its layer and head's stored moment,
needs no queries, and counts their bytes once per model."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.hf import KverrCache, cache_kwarg
from kverr.memory import ModelShape, account
from kverr.quant import PerChannel, PerToken, int_format, quantize
from kverr.quant.compensated import KeyMoments, compensated_quantize, query_moment, stored_moment, turned_cost
from kverr.quant.store import receive
from kverr.rope import unrotate
from model_keys import prefill_keys

P, SINKS, WINDOW, STEPS = 40, 2, 6, 12
KEYS = int_format(2, granularity=PerChannel())
VALUES = int_format(2, granularity=PerToken())


def moments(L: int, H: int, D: int, seed: int = 0) -> torch.Tensor:
    """``[L, H, D, D]`` second moments of random queries with channels of unequal size (far from a
    multiple of the identity)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, 3 * H, 64, D, generator=g, dtype=torch.float64) * torch.linspace(0.05, 4.0, D, dtype=torch.float64)
    return torch.stack([query_moment(q[i][None], H, 64)[0] for i in range(L)])


@pytest.fixture
def cfg(tiny):
    s = tiny.shape
    km = KeyMoments.of(moments(s.n_layers, s.n_kv_heads, s.head_dim))
    return CacheConfig(k=KEYS, v=VALUES, sinks=SINKS, window=WINDOW, key_rounding="compensated", key_moments=km)


def test_the_stored_moment_is_the_normalised_moment_to_fp16():
    M = moments(2, 3, 16, seed=4)
    S = stored_moment(M)
    N = M / M.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    assert torch.equal(S, S.transpose(-1, -2))
    # each entry is the normalised entry rounded to fp16: within half an fp16 ulp (2^-11 relative,
    # or 2^-25 absolute below fp16's normal range)
    assert bool(((S - N).abs() <= torch.maximum(N.abs() * 2.0**-11, torch.full_like(N, 2.0**-25))).all())
    assert torch.equal(stored_moment(4.0 * M), S)  # the scale is divided out (exactly, for a power of two)
    assert torch.equal(stored_moment(torch.zeros(4, 4)), torch.zeros(4, 4, dtype=torch.float64))
    km = KeyMoments.of(M)
    assert km.nbytes == KeyMoments.bytes_for(2, 3, 16) == 2 * 3 * 136 * 2
    for layer in range(2):
        assert torch.equal(km.layer(layer), S[layer])


def test_the_json_round_trips_and_bad_moments_name_what_is_wrong(cfg, tiny):
    text = cfg.to_json()
    back = CacheConfig.from_json(text)
    assert back == cfg and back.key_moments == cfg.key_moments and back.to_json() == text
    obj = cfg.to_dict()["key_moments"]
    assert obj["dtype"] == "fp16" and obj["shape"] == [tiny.shape.n_layers, tiny.shape.n_kv_heads, tiny.shape.head_dim]
    assert len(base64.b64decode(obj["data"])) == cfg.key_moments.nbytes
    assert cfg.key_moments != KeyMoments.of(moments(tiny.shape.n_layers, tiny.shape.n_kv_heads, tiny.shape.head_dim, 1))
    bad = [
        (dict(obj, dtype="fp32"), "key_moments.dtype='fp32' is not allowed"),
        (dict(obj, data=obj["data"][:-8]), "is not base64 of"),
        (dict(obj, data="not base64!"), "is not base64 of"),
        (dict(obj, shape=[1, 2]), "key_moments.shape="),
        ({"dtype": "fp16"}, "exactly 'dtype', 'shape' and 'data'"),
    ]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message):
            CacheConfig.from_dict(dict(cfg.to_dict(), key_moments=value))
    nan = np.array(cfg.key_moments.packed)
    nan[0, 0, 1] = np.nan
    with pytest.raises(ConfigError, match="NaN"):
        KeyMoments(nan, tiny.shape.head_dim)
    neg = np.array(cfg.key_moments.packed)
    neg[0, 0, 0] = -1.0  # the first diagonal entry
    with pytest.raises(ConfigError, match="negative diagonal"):
        KeyMoments(neg, tiny.shape.head_dim)
    with pytest.raises(ShapeError, match="float16"):
        KeyMoments(cfg.key_moments.packed.astype(np.float32), tiny.shape.head_dim)
    with pytest.raises(ConfigError, match="key_rounding='nearest' does not use them"):
        cfg.with_(key_rounding="nearest")
    s = tiny.shape
    with pytest.raises(ConfigError, match="key_moments are for"):
        cfg.check_model(s.n_layers + 1, s.n_kv_heads, s.head_dim)
    sub = cfg.select_layers([1])
    assert sub.key_moments.n_layers == 1 and torch.equal(sub.key_moments.layer(0), cfg.key_moments.layer(1))


def test_the_bytes_are_counted_once_per_model(cfg, tiny):
    s = tiny.shape
    km = cfg.key_moments
    shape = ModelShape(s.n_layers, s.n_kv_heads, s.head_dim)
    plain = cfg.with_(key_moments=None)
    for batch in (1, 3):
        a, b = account(cfg, shape, 100, batch=batch), account(plain, shape, 100, batch=batch)
        assert a.total_bytes - b.total_bytes == km.nbytes
        assert a.totals.static - b.totals.static == km.nbytes
        for layer in range(s.n_layers):
            assert a.layer_total(layer).total - b.layer_total(layer).total == km.layer_nbytes()


@pytest.mark.parametrize("pre_rope", [False, True])
def test_every_key_prompt_and_decode_is_rounded_under_the_static_moment(tiny, cfg, pre_rope):
    # No queries are needed: the cache quantizes the prefill at once. Each chunk of layer 0's keys
    # (the embeddings' projections: the same numbers whatever the cache holds) is the oracle's
    # compensated codes under the stored moment, on the cache's own static scales; the same keys
    # rounded to nearest on those scales differ. The values, and the bytes but the moments', are
    # those of the nearest-rounding config.
    cfg = cfg.with_(key_pre_rope=pre_rope)
    assert not cfg.needs_queries
    ids = torch.randint(0, 250, (2, P + STEPS), generator=torch.Generator().manual_seed(2))
    caches = [KverrCache.for_model(tiny.model, c) for c in (cfg, cfg.with_(key_rounding="nearest", key_moments=None))]
    with torch.no_grad():
        for c in caches:
            tiny.model(ids[:, :P], use_cache=True, **{cache_kwarg(tiny.model): c})
            for t in range(P, ids.shape[1]):
                tiny.model(ids[:, t:t + 1], use_cache=True, **{cache_kwarg(tiny.model): c})
    comp, near = caches
    k0 = prefill_keys(tiny.model, ids)[0]
    layer = comp.layers[0]
    g = layer.groups["k"][0]
    M = cfg.key_moments.layer(0)[None, g.heads]  # [1, h, D, D]: the same for both sequences
    assert torch.equal(g.key_cost, M)
    start = SINKS
    assert len(g.chunks) > 1  # the prefill's chunk and those of the decode steps
    for chunk in g.chunks:
        n = chunk.shape[-2]
        x = k0[:, g.heads, start:start + n].float()
        cost = M[:, :, None]
        if pre_rope:
            cos, sin = layer._cos_sin(start, start + n)
            x = unrotate(x, cos, sin)
            cost = turned_cost(M, cos, sin)
        x = receive(x, cfg.window_dtype)
        want = compensated_quantize(x, KEYS, cost, page_size=cfg.page_size, scale=g.static_scale, zero=g.static_zero)
        assert torch.equal(chunk.codes, want.codes), start
        assert not torch.equal(chunk.codes, quantize(x, KEYS, page_size=cfg.page_size, scale=g.static_scale,
                                                     zero=g.static_zero).codes)
        start += n
    assert start == P + STEPS - WINDOW
    assert comp.nbytes() == near.nbytes() + cfg.key_moments.nbytes
    comp.reorder_cache(torch.tensor([1, 0]))  # static moments are shared by the batch: kept as they are
    assert torch.equal(comp.layers[0].groups["k"][0].key_cost, M)
