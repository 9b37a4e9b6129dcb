"""The xarray/dask layer and the ``kverr decompose`` command.

K̂ and V̂ always come from the one oracle, :func:`kverr.quant.reconstruct`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from kverr.config import PRESETS, CacheConfig, resolve
from kverr.error import QUERY_METRICS, decompose_capture, decompose_stream
from kverr.exceptions import CaptureError, ConfigError, ShapeError
from kverr.error.salient import OBSERVED_QUERIES, positions
from kverr.quant import PerChannel, PerToken, PerTokenGroup, int_format, reconstruct
from kverr.quant.compensated import KeyCost, turned_cost
from kverr.rope import apply_rope, parse_rope, rope_cos_sin

from captures import synthetic_capture as shared_capture

REAL = Path(__file__).resolve().parents[2] / "data" / "smollm2-pydoc-512.zarr"


def synthetic_capture(n_layers=2, hq=4, hkv=2, T=160, D=64, seed=0):
    """The shared synthetic capture at this module's sizes, with an outlier key channel."""
    return shared_capture(n_layers, hq, hkv, T, D, seed, outlier_channel=3)


def _direct(cap, config, layer_pos, queries, pre_rope=False, window=0, sink=None):
    """The array core on one layer, with K̂/V̂ from the oracle."""
    q = torch.from_numpy(cap.q.values[layer_pos, :, -queries:])
    k = torch.from_numpy(cap.k.values[layer_pos])
    v = torch.from_numpy(cap.v.values[layer_pos])
    layer = int(cap.layer.values[layer_pos])
    if pre_rope:
        kp = torch.from_numpy(cap.k_pre.values[layer_pos])
        k_hat = apply_rope(reconstruct(kp, config, layer=layer, which="k"), cap.position.values,
                           cap.attrs["rope"])
    else:
        k_hat = reconstruct(k, config, layer=layer, which="k")
    v_hat = reconstruct(v, config, layer=layer, which="v")
    d = decompose_stream(q, k, v, k_hat, v_hat, kv_head_of_q=cap.kv_head_of_q.values, window=window, sink=sink)
    return d, k_hat, v_hat


@pytest.mark.parametrize("preset", ["q4_0", "kivi-2"])
def test_capture_layer_matches_array_core(preset):
    cap = synthetic_capture()
    cfg = resolve(preset)
    ds = decompose_capture(cap, cfg, queries=40)
    assert ds["kl"].chunks is not None  # lazy
    assert set(ds["kl"].dims) == {"layer", "q_head", "query"}
    assert set(ds["k_mse"].dims) == {"layer", "kv_head"}
    ds = ds.compute(scheduler="synchronous")
    for li in range(2):
        d, k_hat, v_hat = _direct(cap, cfg, li, 40)
        for name in QUERY_METRICS:
            np.testing.assert_allclose(ds[name].values[li], d.metrics[name].double().numpy(),
                                       rtol=1e-6, atol=1e-9, equal_nan=True, err_msg=name)
        err = (k_hat.double() - torch.from_numpy(cap.k.values[li]).double()) ** 2
        np.testing.assert_allclose(ds.k_mse.values[li], err.mean(dim=(-2, -1)).numpy(), rtol=1e-9)
    np.testing.assert_array_equal(ds["query"].values, cap["token"].values[-40:])
    shares = ds.key_share + ds.value_share + ds.cross_share
    np.testing.assert_allclose(shares.values, 1.0, rtol=1e-12)
    assert np.all(ds.layer_key_share.values >= 0)


def test_sliding_window_layers_see_their_window():
    """Each layer is decomposed under its own window: equal to the array core with that window,
    and unlike the full-attention answer (the window hides most of the 160 keys)."""
    cap = shared_capture(2, 4, 2, 160, 64, 0, outlier_channel=3, sliding_windows=[24, 0])
    cfg = resolve("q4_0")
    ds = decompose_capture(cap, cfg, queries=40).compute(scheduler="synchronous")
    for li, w in enumerate([24, 0]):
        d, _, _ = _direct(cap, cfg, li, 40, window=w)
        for name in QUERY_METRICS:
            np.testing.assert_allclose(ds[name].values[li], d.metrics[name].double().numpy(),
                                       rtol=1e-6, atol=1e-9, equal_nan=True, err_msg=name)
    full, _, _ = _direct(cap, cfg, 0, 40)
    assert not np.allclose(ds["kl"].values[0], full.metrics["kl"].double().numpy(), rtol=1e-2)
    assert "sliding_window" not in ds.coords and cap.kv.shape.sliding_windows == (24, 0)


def test_learned_sinks_join_each_layers_softmax():
    """A capture with ``attn_sink`` (gpt-oss) is decomposed with each layer's sink logits."""
    cap = shared_capture(2, 4, 2, 96, 64, 1, sliding_windows=[16, 0])
    sinks = np.random.default_rng(0).normal(scale=3.0, size=(2, 4))
    cap["attn_sink"] = (("layer", "q_head"), sinks)
    cfg = resolve("q4_0")
    ds = decompose_capture(cap, cfg, queries=24).compute(scheduler="synchronous")
    for li, w in enumerate([16, 0]):
        d, _, _ = _direct(cap, cfg, li, 24, window=w, sink=torch.from_numpy(sinks[li].astype(np.float32)))
        for name in QUERY_METRICS:
            np.testing.assert_allclose(ds[name].values[li], d.metrics[name].double().numpy(),
                                       rtol=1e-6, atol=1e-9, equal_nan=True, err_msg=name)
    plain, _, _ = _direct(cap, cfg, 1, 24)
    assert not np.allclose(ds["out_norm"].values[1], plain.metrics["out_norm"].double().numpy(), rtol=1e-3)


def test_pre_rope_keys_are_quantized_then_rotated():
    cap = synthetic_capture(n_layers=1)
    cfg = PRESETS["q4_0"].with_(key_pre_rope=True)
    ds = decompose_capture(cap, cfg, queries=16).compute()
    d, _, _ = _direct(cap, cfg, 0, 16, pre_rope=True)
    np.testing.assert_allclose(ds.kl.values[0], d.metrics["kl"].double().numpy(), rtol=1e-6, atol=1e-12)
    # and it differs from quantizing post-RoPE keys
    post = decompose_capture(cap, PRESETS["q4_0"], queries=16).compute()
    assert not np.allclose(post.kl.values, ds.kl.values)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_compensated_keys_are_rounded_under_the_capture_s_last_queries(pre_rope):
    # As a cache that prefilled the capture: each kv head's keys are rounded with compensation
    # under the second moment of its query heads' last OBSERVED_QUERIES queries (written out here,
    # and turned to each position for keys stored before RoPE), however many queries are
    # decomposed; the values and the grid are the config's.
    T, hq, hkv = OBSERVED_QUERIES + 40, 4, 2
    cap = synthetic_capture(n_layers=1, hq=hq, hkv=hkv, T=T)
    cfg = CacheConfig(k=int_format(2, PerChannel()), v=int_format(4, PerToken()), sinks=2, window=8,
                      key_rounding="compensated", key_pre_rope=pre_rope)
    ds = decompose_capture(cap, cfg, queries=16).compute(scheduler="synchronous")
    q = torch.from_numpy(cap.q.values[0, :, -OBSERVED_QUERIES:]).double()
    G = hq // hkv
    moment = torch.stack([torch.einsum("gnd,gne->de", q[h * G:(h + 1) * G], q[h * G:(h + 1) * G]) / (G * OBSERVED_QUERIES)
                          for h in range(hkv)])
    k = torch.from_numpy(cap.k.values[0]).double()
    if pre_rope:
        pos, rope = cap.position.values, cap.attrs["rope"]
        cost = turned_cost(moment, *rope_cos_sin(pos, *parse_rope(rope)))
        k_hat = apply_rope(reconstruct(torch.from_numpy(cap.k_pre.values[0]), cfg, layer=0, which="k",
                                       key_cost=KeyCost(cost)), pos, rope)
    else:
        k_hat = reconstruct(k.float(), cfg, layer=0, which="k", key_cost=KeyCost(moment[:, None]))
    want = ((k_hat.double() - k) ** 2).mean(dim=(-2, -1)).numpy()
    np.testing.assert_allclose(ds.k_mse.values[0], want, rtol=1e-9)
    more = decompose_capture(cap, cfg, queries=64).compute(scheduler="synchronous")
    np.testing.assert_array_equal(more.k_mse.values, ds.k_mse.values)
    near = decompose_capture(cap, cfg.with_(key_rounding="nearest"), queries=16).compute(scheduler="synchronous")
    assert not np.allclose(near.k_mse.values, ds.k_mse.values, rtol=1e-6)
    np.testing.assert_array_equal(near.v_mse.values, ds.v_mse.values)


def test_static_key_moments_weigh_the_keys_instead_of_the_capture_s_queries():
    # A config carrying static moments (key_moments) rounds the keys under its own moment, not the
    # capture's queries': the decomposition's key error is reconstruct's under that moment.
    from kverr.quant.compensated import KeyMoments, query_moment

    cap = synthetic_capture(n_layers=1, hq=4, hkv=2, T=96)
    g = torch.Generator().manual_seed(5)
    other = torch.randn(1, 4, 50, 64, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, 64, dtype=torch.float64)
    km = KeyMoments.of(query_moment(other, 2, 50))  # [1 layer, 2 kv heads, D, D]
    cfg = CacheConfig(k=int_format(2, PerChannel()), v=int_format(4, PerToken()), sinks=2, window=8,
                      key_rounding="compensated", key_moments=km)
    ds = decompose_capture(cap, cfg, queries=16).compute(scheduler="synchronous")
    k = torch.from_numpy(cap.k.values[0]).double()
    k_hat = reconstruct(k.float(), cfg, layer=0, which="k", key_cost=KeyCost(km.layer(0)[:, None]))
    np.testing.assert_allclose(ds.k_mse.values[0], ((k_hat.double() - k) ** 2).mean(dim=(-2, -1)).numpy(), rtol=1e-9)
    prefill = decompose_capture(cap, cfg.with_(key_moments=None), queries=16).compute(scheduler="synchronous")
    assert not np.allclose(prefill.k_mse.values, ds.k_mse.values, rtol=1e-6)


def test_salient_tokens_are_those_the_capture_s_queries_choose_read_back_as_received():
    # As a cache that prefilled the capture: the positions kverr.error.salient.positions chooses
    # from the captured queries (each layer's window and sink logits in their softmax), given to
    # the oracle, whose static scales are fitted on the other tokens.
    windows = [24, 0]
    cap = shared_capture(2, 4, 2, 200, 64, 2, outlier_channel=3, sliding_windows=windows)
    sinks = np.random.default_rng(1).normal(scale=2.0, size=(2, 4))
    cap["attn_sink"] = (("layer", "q_head"), sinks)
    cfg = CacheConfig(k=int_format(2, PerChannel()), v=int_format(2, PerToken()), sinks=2, window=8,
                      window_dtype="int8", salient=6)
    ds = decompose_capture(cap, cfg, queries=24).compute(scheduler="synchronous")
    plain = decompose_capture(cap, cfg.with_(salient=0), queries=24).compute(scheduler="synchronous")
    for li, w in enumerate(windows):
        q, k, v = (torch.from_numpy(cap[n].values[li]) for n in ("q", "k", "v"))
        sink = torch.from_numpy(sinks[li].astype(np.float32))
        pos = positions(cfg, li, q[None], k[None], float(cap.kv.attn_scales().values[li]), sliding_window=w, sink=sink)[0]
        assert pos.shape == (2, 6)
        k_hat = reconstruct(k, cfg, layer=li, which="k", salient=pos)
        v_hat = reconstruct(v, cfg, layer=li, which="v", salient=pos)
        d = decompose_stream(q[:, -24:], k, v, k_hat, v_hat, kv_head_of_q=cap.kv_head_of_q.values, window=w, sink=sink)
        for name in ("kl", "key_rel", "value_rel"):
            np.testing.assert_allclose(ds[name].values[li], d.metrics[name].double().numpy(), rtol=1e-6, atol=1e-12,
                                       err_msg=name)
    assert not np.allclose(plain.kl.values, ds.kl.values)


def test_unquantized_config_gives_almost_no_error():
    cap = synthetic_capture(n_layers=1)
    ds = decompose_capture(cap, "fp16", queries=8).compute()
    assert float(ds.total_rel.max()) < 1e-3
    assert float(ds.top1_flip.max()) == 0.0


def test_layers_selection_and_model_layer_index():
    cap = synthetic_capture(n_layers=2)
    # a per-layer override on layer 1 only: layer 0 must be unaffected by it
    base = PRESETS["q4_0"]
    d = base.to_dict()
    d["layers"] = {"1": {"k": PRESETS["q8_0"].to_dict()["k"]}}
    cfg = CacheConfig.from_dict(d)
    both = decompose_capture(cap, cfg, queries=8).compute()
    only1 = decompose_capture(cap, cfg, queries=8, layers=[1]).compute()
    assert list(only1.layer.values) == [1]
    np.testing.assert_allclose(only1.kl.values[0], both.kl.values[1], rtol=1e-12)
    plain = decompose_capture(cap, base, queries=8, layers=[0]).compute()
    np.testing.assert_allclose(plain.kl.values[0], both.kl.values[0], rtol=1e-12)


def test_distributed_local_cluster_two_workers():
    distributed = pytest.importorskip("distributed")
    cap = synthetic_capture()
    local = decompose_capture(cap, "q4_0", queries=16, scheduler="synchronous")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  host="127.0.0.1", protocol="tcp://", dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1")
        remote = decompose_capture(cap, "q4_0", queries=16, scheduler=cluster.scheduler_address,
                                   progress=True)  # the progress bar needs no default client
        with distributed.Client(cluster) as client:
            assert len(client.scheduler_info()["workers"]) == 2
    for name in ("kl", "key_rel", "value_rel", "k_mse", "layer_key_share"):
        np.testing.assert_allclose(remote[name].values, local[name].values, rtol=1e-12, err_msg=name)
    assert remote["kl"].chunks is None  # computed


def test_bad_captures_and_configs():
    cap = synthetic_capture(n_layers=1)
    with pytest.raises(CaptureError, match="lacks the variables \\['v'\\]"):
        decompose_capture(cap.drop_vars("v"), "q4_0")
    with pytest.raises(CaptureError, match="k_pre"):
        decompose_capture(cap.drop_vars("k_pre"), PRESETS["q4_0"].with_(key_pre_rope=True))
    with pytest.raises(CaptureError, match="kv_head_of_q"):
        decompose_capture(cap.drop_vars("kv_head_of_q"), "q4_0")
    with pytest.raises(CaptureError, match="dims"):
        decompose_capture(cap.assign(v=cap.v.transpose("layer", "token", "kv_head", "channel")), "q4_0")
    with pytest.raises(ShapeError, match="queries"):
        decompose_capture(cap, "q4_0", queries=0)
    with pytest.raises(CaptureError, match="need query head i"):
        decompose_capture(cap.assign_coords(kv_head_of_q=("q_head", [0, 1, 0, 1])),
                          PRESETS["q4_0"].with_(key_rounding="compensated"), queries=8)
    assert decompose_capture(cap, "q4_0", queries=10_000).sizes["query"] == 160  # all tokens
    with pytest.raises(ShapeError, match="not in the capture"):
        decompose_capture(cap, "q4_0", layers=[7], queries=8)
    # a group of 64 channels cannot fit a head dim of 48
    small = synthetic_capture(n_layers=1, D=48)
    bad = CacheConfig(k=int_format(4, PerTokenGroup(64)), v=int_format(4, PerTokenGroup(64)))
    with pytest.raises(ConfigError):
        decompose_capture(small, bad, queries=8)
    with pytest.raises(ConfigError, match="scheduler"):
        decompose_capture(cap, "q4_0", queries=8, scheduler="nonsense")


@pytest.mark.skipif(not REAL.exists(), reason="the real capture is not in data/")
def test_cli_on_the_real_capture(tmp_path, capsys):
    from kverr.cli import main

    out = tmp_path / "d.zarr"
    rc = main(["decompose", "--capture", str(REAL), "--config", "kivi-4", "--out", str(out),
               "--queries", "64", "--layers", "0,29", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "key" in text and "value" in text and "cross" in text and "KL" in text and "flips" in text
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "29 "))]
    assert len(lines) == 2
    ds = xr.open_zarr(out, consolidated=False)
    assert ds.sizes["query"] == 64 and list(ds.layer.values) == [0, 29]
    assert json.loads(ds.attrs["config"])["name"] == "kivi-4"
    # a second run refuses to overwrite: one clear line, exit 2
    rc = main(["decompose", "--capture", str(REAL), "--config", "kivi-4", "--out", str(out)])
    assert rc == 2
    assert "exists" in capsys.readouterr().err
    rc = main(["decompose", "--capture", str(REAL), "--config", "no-such-preset",
               "--out", str(tmp_path / "x.zarr")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "preset" in err[0]
