"""Exact memory accounting: equal to the bytes the reference store allocates."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.config import PRESETS, CacheConfig
from kverr.exceptions import ConfigError, ModelError, ShapeError
from kverr.memory import DEFAULT_SHAPE, ModelShape, account, model_shape
from kverr.quant import PerChannel, PerTokenGroup, ReferenceStore, int_format, reconstruct, token_regions

from strategies import configs

L, H, D = 2, 3, 16


def _kv(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(B, H, T, D, generator=g) for _ in range(L)],
        [torch.randn(B, H, T, D, generator=g) for _ in range(L)],
    )


@given(cfg=configs(L, H, D), T=st.integers(0, 150), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_accounting_equals_the_bytes_the_reference_store_allocates(cfg, T, B, seed):
    ks, vs = _kv(B, T, seed)
    store = ReferenceStore(cfg, ks, vs)
    rep = account(cfg, ModelShape(L, H, D), T, batch=B)
    assert rep.total_bytes == store.nbytes
    for layer in range(L):
        assert rep.layer_total(layer).total == store.nbytes_of(layer)


@given(cfg=configs(L, H, D), T=st.integers(0, 150), B=st.integers(1, 2), seed=st.integers(0, 2**16),
       windows=st.lists(st.integers(0, 160), min_size=L, max_size=L))
def test_sliding_layers_hold_their_window_and_count_what_they_hold(cfg, T, B, seed, windows):
    """A sliding layer frees the pages behind its window: the count equals the store's bytes,
    the held tokens read back as the oracle says, the freed ones are gone (NaN), and no layer
    holds more than it would without a window."""
    ks, vs = _kv(B, T, seed)
    store = ReferenceStore(cfg, ks, vs, sliding_windows=windows)
    rep = account(cfg, ModelShape(L, H, D, sliding_windows=tuple(windows)), T, batch=B)
    full = account(cfg, ModelShape(L, H, D), T, batch=B)
    assert rep.total_bytes == store.nbytes
    for layer, w in enumerate(windows):
        assert rep.layer_total(layer).total == store.nbytes_of(layer) <= full.layer_total(layer).total
        live = max(0, T - w) if w else 0
        for which, x in (("k", ks[layer]), ("v", vs[layer])):
            got = store.read(layer, which)
            assert torch.equal(got[:, :, live:], reconstruct(x, cfg, layer=layer, which=which)[:, :, live:])
            assert bool(got[:, :, :live].isnan().all())


def test_a_sliding_layer_holds_whole_pages_from_the_one_its_window_starts_in():
    """By hand: asymmetric int4 per token (D/2 bytes of codes, an fp16 scale and zero a token),
    pages of 16, 8 recent tokens in fp16; a sliding window of 26 at T = 100 holds tokens
    74..99: the window 92..99 and the quantized 74..91, in the pages 64..79 and 80..95 (0..63
    freed); the slots 64..73 (behind the window) and 92..95 (not yet filled) are rounding."""
    cfg = CacheConfig(k=int_format(4, PerTokenGroup(D)), v=int_format(4, PerTokenGroup(D)), window=8,
                      page_size=16, align=1)
    k = account(cfg, ModelShape(1, 1, D, sliding_windows=(26,)), 100).per_layer[0]["k"]
    per_token = D // 2 + 2 + 2
    assert k.window == 8 * D * 2 and k.payload == 18 * D // 2 and k.scales == k.zeros == 18 * 2
    assert k.page_rounding == (10 + 4) * per_token
    assert k.total == 8 * D * 2 + 32 * per_token


@pytest.mark.parametrize("cfg, want", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}, (64, 0)),
    ({"sliding_window": 40}, (40, 40)),
    ({"sliding_window": 4096, "use_sliding_window": False}, ()),
    ({"sliding_window": 512, "sliding_window_pattern": 2}, (512, 0)),
    ({"layer_types": ["full_attention", "full_attention"], "sliding_window": None}, ()),
    ({}, ()),
])
def test_sliding_windows_are_read_from_the_config_as_transformers_lays_them_out(cfg, want):
    from kverr.memory import sliding_windows_of

    assert sliding_windows_of(cfg, 2) == want


def test_unknown_layer_types_and_bad_windows_are_refused():
    from kverr.memory import sliding_windows_of

    with pytest.raises(ModelError, match="chunked_attention"):
        sliding_windows_of({"layer_types": ["chunked_attention", "full_attention"]}, 2)
    with pytest.raises(ModelError, match="no sliding_window"):
        sliding_windows_of({"layer_types": ["sliding_attention", "full_attention"]}, 2)
    with pytest.raises(ShapeError, match="one non-negative window per layer"):
        ModelShape(2, 1, 8, sliding_windows=(4,))


@pytest.mark.parametrize("T", [0, 1, 5, 70])
def test_int8_window_bytes_at_the_edges(T):
    """An int8 window: D + 2 bytes per held token (codes, fp16 scale), each row aligned; also with
    no token yet (a case the drawn configs reach only by chance)."""
    cfg = CacheConfig(k=int_format(2, PerChannel(8)), v=int_format(2, PerTokenGroup(8)), window=8, sinks=2,
                      window_dtype="int8")
    ks, vs = _kv(2, T, 0)
    store = ReferenceStore(cfg, ks, vs)
    rep = account(cfg, ModelShape(L, H, D), T, batch=2)
    assert rep.total_bytes == store.nbytes
    t = rep.totals
    held = t.sinks + t.window
    assert held % (D + 2) == 0 and held // (D + 2) == sum(
        2 * H * (T - (e - s)) for l in range(L) for w in "kv"
        for s, e in [token_regions(T, cfg, cfg.format_for(l, 0, w))])
    assert torch.equal(store.read(0, "k"), reconstruct(ks[0], cfg, layer=0, which="k"))


@given(cfg=configs(L, H, D), T=st.integers(1, 90), seed=st.integers(0, 2**16))
def test_the_store_reads_back_what_reconstruct_says(cfg, T, seed):
    """Pages, scale sections and full-precision rows hold exactly the oracle's values."""
    ks, vs = _kv(2, T, seed)
    store = ReferenceStore(cfg, ks, vs)
    for layer in range(L):
        assert torch.equal(store.read(layer, "k"), reconstruct(ks[layer], cfg, layer=layer, which="k"))
        assert torch.equal(store.read(layer, "v"), reconstruct(vs[layer], cfg, layer=layer, which="v"))


def test_fp16_matches_the_seed_formula_when_pages_are_full():
    rep = account(PRESETS["fp16"], DEFAULT_SHAPE, 4096)
    assert rep.total_bytes == rep.seed_bytes == 2 * 30 * 3 * 64 * 4096 * 2
    assert rep.effective_bits == 16.0


def test_kivi_metadata_costs_one_bit_per_element_for_each_of_k_and_v():
    """2-bit codes + fp16 scale and zero per 32 elements = 3 bits, by hand."""
    rep = account(PRESETS["kivi-2"].with_(window=0), DEFAULT_SHAPE, 4096)
    assert rep.effective_bits == 3.0
    t = rep.totals
    assert t.payload * 8 == rep.elements * 2
    assert t.scales == t.zeros == rep.elements * 2 // 32  # one fp16 per 32 elements
    assert t.page_rounding == t.padding == t.window == t.sinks == 0


def test_window_sinks_pages_and_padding_are_counted():
    cfg = CacheConfig(k=int_format(4, PerChannel(32)), v=int_format(4, PerTokenGroup(32)), window=10, sinks=3, page_size=64)
    T = 100
    rep = account(cfg, ModelShape(1, 1, 64), T)
    k, v = rep.per_layer[0]["k"], rep.per_layer[0]["v"]
    # keys: 97 tokens after the sinks, 87 beyond the window -> 2 whole groups of 32 quantized
    assert k.payload == 64 * 32 and k.sinks == 3 * 64 * 2 and k.window == (100 - 3 - 64) * 64 * 2
    # values: per-token scales, every one of the 87 tokens is quantized
    assert v.payload == 87 * 32 and v.window == 10 * 64 * 2
    # one page of 64 tokens holds 87 -> two pages, 41 unused token slots of codes and scales
    assert v.page_rounding == (128 - 87) * 32 + 2 * (128 - 87) * 2 * 2
    assert rep.effective_bits == pytest.approx(8 * rep.total_bytes / (2 * 64 * T))


def test_static_scales_are_counted_once_not_per_sequence():
    cfg = PRESETS["fp8-e4m3-head"]
    one = account(cfg, DEFAULT_SHAPE, 1024, batch=1)
    four = account(cfg, DEFAULT_SHAPE, 1024, batch=4)
    assert one.totals.static == four.totals.static == 30 * 2 * 3 * 4
    assert four.totals.payload == 4 * one.totals.payload


def test_page_size_changes_rounding():
    small = account(PRESETS["int8-token"], DEFAULT_SHAPE, 1000, page_size=16)
    big = account(PRESETS["int8-token"], DEFAULT_SHAPE, 1000, page_size=256)
    assert small.totals.payload == big.totals.payload
    assert big.totals.page_rounding > small.totals.page_rounding
    assert big.total_bytes > small.total_bytes


def test_model_shape_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 1024, "max_position_embeddings": 4096})
    )
    assert model_shape(str(tmp_path)) == ModelShape(4, 2, 128, name=str(tmp_path), max_context=4096)
    with pytest.raises(ModelError, match="not found"):
        model_shape(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="does not describe a decoder"):
        model_shape(str(tmp_path))


def test_bad_accounting_input():
    with pytest.raises(ShapeError, match="tokens=-1"):
        account(PRESETS["fp16"], DEFAULT_SHAPE, -1)
    with pytest.raises(ShapeError, match="batch=0"):
        account(PRESETS["fp16"], DEFAULT_SHAPE, 4, batch=0)
    with pytest.raises(ConfigError, match="page_size=48"):
        account(PRESETS["kivi-2"], DEFAULT_SHAPE, 4, page_size=48)
    with pytest.raises(ConfigError, match="does not divide the head dimension 80"):
        account(PRESETS["q4_0"], ModelShape(2, 2, 80), 4)
