"""Cache configs: exact JSON round trip, presets, and every bad-config error."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given

from kverr.config import PRESETS, CacheConfig, Override, resolve
from kverr.exceptions import ConfigError
from kverr.quant import PerChannel, PerTensor, PerToken, PerTokenGroup, QuantFormat, fp8_format, int_format

from strategies import configs


@given(configs())
def test_json_round_trips_exactly(cfg):
    text = cfg.to_json()
    back = CacheConfig.from_json(text)
    assert back == cfg
    assert back.to_json() == text


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_and_fit_the_default_model(name, tmp_path):
    cfg = PRESETS[name]
    path = cfg.save(tmp_path / f"{name}.json")
    assert CacheConfig.load(path) == cfg
    assert resolve(str(path)) == cfg
    assert resolve(name) is cfg
    cfg.check_model(30, 3, 64, max_context=8192)


def test_presets_say_what_they_claim():
    kivi = PRESETS["kivi-2"]
    assert kivi.k == int_format(2, PerChannel(32)) and kivi.v == int_format(2, PerTokenGroup(32))
    assert kivi.window == 128 and kivi.k.scale_dtype == "fp16" and kivi.k.has_zero
    g64 = PRESETS["int4-token-g64"]
    assert g64.k.granularity == PerTokenGroup(64) and g64.window == 128 and not g64.k.symmetric
    q4 = PRESETS["q4_0"]
    assert q4.k.symmetric and q4.k.granularity == PerTokenGroup(32) and q4.k.scale_dtype == "fp16"
    assert PRESETS["fp8-e4m3-tensor"].k == fp8_format(PerTensor())
    assert PRESETS["fp8-e4m3-head"].v.scale_dtype == "fp32"
    assert PRESETS["int8-token"].k == int_format(8, PerToken())


def test_format_lookup_prefers_head_then_layer_then_default():
    d, lay, hd = int_format(4, PerToken()), int_format(2, PerToken()), int_format(8, PerToken())
    cfg = CacheConfig(k=d, v=d, layers={1: Override(k=lay)}, heads={(1, 2): Override(k=hd)})
    assert cfg.format_for(0, 2, "k") == d
    assert cfg.format_for(1, 0, "k") == lay
    assert cfg.format_for(1, 2, "k") == hd
    assert cfg.format_for(1, 2, "v") == d
    groups = cfg.head_groups(1, 3, "k")
    assert groups == [(lay, [0, 1]), (hd, [2])]


BASE = json.loads(PRESETS["kivi-2"].to_json())


def mutate(path: str, value) -> dict:
    cfg = json.loads(json.dumps(BASE))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return cfg


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("colour", "red", r"unknown field config\.colour; allowed fields: align, heads, k, key_moments, key_pre_rope"),
        ("k.colour", 1, r"unknown field k\.colour; allowed fields: bits, channel_bits, clip, codebook, dtype"),
        ("k.dtype", "int5", r"k\.dtype='int5' is not allowed; one of int, fp8_e4m3"),
        ("k.bits", 5, r"bits=5 is not allowed; int allows 2, 3, 4, 8"),
        ("k.bits", 16, r"bits=16 is not allowed"),
        ("k.bits", KeyError, r"missing field k\.bits"),
        ("v.granularity.kind", "row", r"v\.granularity\.kind='row' is not allowed; one of tensor, head, token"),
        ("v.granularity.group", 0, r"granularity\.group=0 is not allowed; a positive number of channels"),
        ("k.granularity.tokens", -3, r"granularity\.tokens=-3 is not allowed"),
        ("k.scale_dtype", "fp64", r"scale_dtype='fp64' is not allowed; one of fp32, fp16, bf16"),
        ("k.clip.kind", "soft", r"k\.clip\.kind='soft' is not allowed; one of absmax, percentile, mse"),
        ("k.rotate", "random", r"rotate='random' is not allowed; one of none, hadamard"),
        ("window", -1, r"window=-1 is not allowed; an integer in \[0, "),
        ("window", "128", r"window='128' is not allowed"),
        ("sinks", 1.5, r"sinks=1.5 is not allowed"),
        ("page_size", 48, r"k\.granularity\.tokens=32 does not fit whole pages of page_size=48"),
        ("page_size", 0, r"page_size=0 is not allowed"),
        ("align", 24, r"align=24 is not allowed; a power of two"),
        ("window_dtype", "int4", r"window_dtype='int4' is not allowed; one of fp16, bf16, fp32, int8"),
        ("key_pre_rope", "yes", r"key_pre_rope='yes' is not allowed; true or false"),
        ("version", 2, r"version=2 is not allowed; this kverr reads config version 1"),
        ("version", KeyError, r"missing field config\.version"),
        ("layers", {"x": {"k": {"dtype": "fp16"}}}, r"layers key 'x' is not allowed"),
        ("heads", {"3": {"k": {"dtype": "fp16"}}}, r"heads key '3' is not allowed; use 'LAYER:KV_HEAD'"),
        ("heads", {"3:1": {}}, r"heads\.3:1 is empty"),
        ("heads", {"3:1": {"q": {"dtype": "fp16"}}}, r"unknown field heads\.3:1\.q; allowed fields: k, v"),
        ("provenance", [1], r"provenance must be a JSON object"),
    ],
)
def test_bad_configs_name_the_field_the_value_and_what_is_allowed(path, value, message):
    with pytest.raises(ConfigError, match=message):
        CacheConfig.from_dict(mutate(path, value))


def test_more_bad_formats():
    with pytest.raises(ConfigError, match="fp8_e4m3 is symmetric"):
        QuantFormat.from_dict({"dtype": "fp8_e4m3", "symmetric": False})
    with pytest.raises(ConfigError, match="bf16.*too coarse for 8-bit"):
        QuantFormat.from_dict({"dtype": "int", "bits": 8, "scale_dtype": "bf16"})
    with pytest.raises(ConfigError, match="has no meaning for plain fp16"):
        QuantFormat.from_dict({"dtype": "fp16", "bits": 4})
    with pytest.raises(ConfigError, match=r"clip\.percentile=40 is not allowed; a number in \(50, 100\]"):
        QuantFormat.from_dict({"dtype": "int", "bits": 4, "clip": {"kind": "percentile", "percentile": 40}})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        QuantFormat.from_dict("int4")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CacheConfig.from_json("{")


def test_config_must_fit_the_model():
    cfg = CacheConfig.from_dict(mutate("v.granularity.group", 48))
    with pytest.raises(ConfigError, match=r"v\.granularity\.group=48 does not divide the head dimension 64; allowed groups: 1, 2, 4, 8, 16, 32, 64"):
        cfg.check_model(30, 3, 64)
    cfg = PRESETS["q4_0"].with_(layers={30: Override(k=int_format(8, PerToken()))})
    with pytest.raises(ConfigError, match=r"layers\.30 overrides a layer the model does not have \(it has 30 layers"):
        cfg.check_model(30, 3, 64)
    cfg = PRESETS["q4_0"].with_(heads={(2, 3): Override(k=int_format(8, PerToken()))})
    with pytest.raises(ConfigError, match=r"heads\.2:3 names a head the model does not have"):
        cfg.check_model(30, 3, 64)
    with pytest.raises(ConfigError, match="exceeds the model's context of 8192"):
        PRESETS["kivi-2"].with_(window=8100, sinks=100).check_model(30, 3, 64, max_context=8192)
    with pytest.raises(ConfigError, match="power-of-two head dimension, got 80"):
        PRESETS["q8_0"].with_(k=int_format(4, PerToken(), rotate="hadamard")).check_model(2, 2, 80)


def test_resolve_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset nor a config file; presets: fp16, int8-token"):
        resolve("kivi-3")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(mutate("k.bits", 7)))
    with pytest.raises(ConfigError, match=r"bad\.json: k: bits=7 is not allowed"):
        resolve(str(bad))


def test_save_is_atomic(tmp_path, monkeypatch):
    """A crash while writing leaves the old file untouched and no temporary behind."""
    path = PRESETS["kivi-4"].save(tmp_path / "c.json")
    before = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        PRESETS["kivi-2"].save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_saved_files_get_the_umask_permissions_not_the_temporary_files(tmp_path):
    old = os.umask(0o027)
    try:
        path = PRESETS["kivi-4"].save(tmp_path / "c.json")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


def test_select_layers_maps_a_layer_subset_to_positions():
    d, o29, o15 = int_format(4, PerToken()), int_format(8, PerToken()), int_format(2, PerToken())
    cfg = CacheConfig(k=d, v=d, layers={29: Override(k=o29), 3: Override(k=o15)}, heads={(15, 1): Override(v=o15)})
    sub = cfg.select_layers([0, 15, 29])
    assert sub.format_for(2, 0, "k") == o29 and sub.format_for(0, 0, "k") == d
    assert sub.format_for(1, 1, "v") == o15 and sub.format_for(1, 0, "v") == d
    sub.check_model(3, 3, 64)
    with pytest.raises(ConfigError, match="repeats a layer"):
        cfg.select_layers([1, 1])


def test_a_window_per_head_resolves_groups_heads_and_runs_on_the_kernel_path():
    """A head's window override beats its layer's, which beats the config's; heads of one format
    but other windows are stored apart, and launched apart; the paged kernel cache sizes each
    group's ring by its window, and the kernels' cost model counts each group's bytes as
    kverr.memory does; the engines, which keep one window per model, refuse such a config by name."""
    from kverr.cost import step_cost
    from kverr.engines.vllm import serving
    from kverr.gpu.cache import PagedKVCache
    from kverr.memory import ModelShape, account

    f = int_format(2, PerToken())
    cfg = CacheConfig(k=f, v=f, window=32, sinks=4, layers={1: Override(v_window=64)},
                      heads={(1, 2): Override(v_window=16, k_window=0), (0, 1): Override(k=int_format(4, PerToken()))})
    assert [cfg.window_for(1, h, "v") for h in range(3)] == [64, 64, 16]
    assert [cfg.window_for(1, h, "k") for h in range(3)] == [32, 32, 0]
    assert cfg.window_for(0, 1, "k") == 32 and cfg.windows_vary and cfg.max_window() == 64
    assert [heads for _, heads in cfg.head_groups(1, 3, "v")] == [[0, 1], [2]]
    assert [heads for _, heads in cfg.head_groups(0, 3, "k")] == [[0, 2], [1]]
    assert [(w, heads) for _, w, heads in cfg.window_groups(1, 3, "v")] == [(64, [0, 1]), (16, [2])]
    bare = cfg.without_windows()
    assert not bare.windows_vary and bare.window == 0 and bare.layers == {} and list(bare.heads) == [(0, 1)]
    same = cfg.with_(layers={1: Override(v_window=32)}, heads={})
    assert not same.windows_vary  # an override equal to the config's window varies nothing
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        cfg.check_model(2, 3, 16, max_context=60)
    # layer 1: K (32, 32, 0) and V (64, 64, 16): heads 0 and 1 share a launch, head 2 has its own
    assert [heads for *_, heads in cfg.launch_groups(1, 3)] == [[0, 1], [2]]
    assert [heads for *_, heads in cfg.launch_groups(0, 3)] == [[0, 2], [1]]
    cache = PagedKVCache(cfg, n_layers=2, n_kv_heads=3, n_q_heads=3, head_dim=16, max_batch=1, max_tokens=64,
                         device="cpu")
    assert [(p.heads, p.window, p.cap) for p in cache.pools[1]["v"]] == [([0, 1], 64, 65), ([2], 16, 17)]
    assert [(p.heads, p.window, p.cap) for p in cache.pools[1]["k"]] == [([0, 1], 32, 33), ([2], 0, 1)]
    assert [ln.heads for ln in cache.launches[1]] == [[0, 1], [2]] and cache.job_keys == [(1, 0), (1, 16), (1, 32), (1, 64)]
    shape = ModelShape(2, 3, 16, n_q_heads=3)
    for tokens, batch in ((1, 1), (40, 2), (128, 3)):
        by = step_cost(cfg, shape, tokens, batch).bytes_by_kind()
        mem = account(cfg, shape, tokens, batch=batch).totals
        assert (by["codes"], by["scales"], by["zeros"]) == (mem.payload, mem.scales, mem.zeros)
        assert by["window"] == mem.sinks + mem.window
    # the windows count: the same formats with one window read other bytes, and plan fewer job lists
    one = cfg.with_(layers={}, heads={(0, 1): Override(k=int_format(4, PerToken()))})
    assert step_cost(cfg, shape, 128).bytes_by_kind()["window"] != step_cost(one, shape, 128).bytes_by_kind()["window"]
    assert step_cost(cfg, shape, 128).plan_copies > step_cost(one, shape, 128).plan_copies
    with pytest.raises(ConfigError, match="window length per layer or kv head"):
        serving(cfg, 2, 3)
    for bad, match in [({"window": {}}, "is empty"), ({"window": {"q": 3}}, "unknown field"),
                       ({"window": {"k": -1}}, "window.k=-1"), ({"window": 3}, "must be a JSON object"), ({}, "is empty")]:
        obj = json.loads(cfg.to_json())
        obj["heads"]["1:2"] = bad
        with pytest.raises(ConfigError, match=match):
            CacheConfig.from_dict(obj)
