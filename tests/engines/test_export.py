"""Exports for vLLM and transformers: round trips, oracle scales, and refusals that name what
the target cannot express."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kverr.engines import export
from kverr.engines.hf import check_hf, import_hf
from kverr.engines.vllm import check_vllm, import_vllm
from kverr.config import PRESETS, CacheConfig, Override
from kverr.exceptions import CaptureError, ConfigError
from kverr.quant import PerHead, PerTensor, PerTokenGroup, fp8_format, int_format, quantize


def test_hf_round_trip_of_the_quanto_preset(tmp_path):
    cfg = PRESETS["int4-token-g64"]
    out = tmp_path / "hf"
    export(cfg, "hf", out, n_layers=30, n_kv=3, head_dim=64)
    obj = json.loads((out / "generation_config.json").read_text())
    assert obj["cache_implementation"] == "quantized"
    assert obj["cache_config"] == {"backend": "quanto", "nbits": 4, "axis_key": 0, "axis_value": 0,
                                   "q_group_size": 64, "residual_length": 128}
    back = import_hf(out)
    assert back == cfg.with_(name=None)


@pytest.mark.parametrize("bits,backend", [(2, "quanto"), (3, "HQQ"), (8, "HQQ")])
def test_hf_backends(bits, backend):
    f = int_format(bits, PerTokenGroup(32))
    assert check_hf(CacheConfig(k=f, v=f, window=64), 2, 2, 64)["backend"] == backend


@pytest.mark.parametrize(
    "cfg,needle",
    [
        (PRESETS["kivi-4"], "'channel' scales"),
        (PRESETS["q4_0"], "symmetric codes"),
        (PRESETS["fp8-e4m3-head"], "integer codes only"),
        (CacheConfig(k=int_format(4, PerTokenGroup(32)), v=int_format(2, PerTokenGroup(32))), "one nbits"),
        (CacheConfig(k=int_format(4, PerTokenGroup(32)), v=int_format(4, PerTokenGroup(32)), sinks=4), "sinks=4"),
        (CacheConfig(k=int_format(4, PerTokenGroup(32)), v=int_format(4, PerTokenGroup(32)), window=8,
                     window_dtype="int8"), "window_dtype=int8"),
        (CacheConfig(k=int_format(4, PerTokenGroup(32), rotate="hadamard"), v=int_format(4, PerTokenGroup(32))), "Hadamard"),
        (CacheConfig(k=int_format(4, PerTokenGroup(32)), v=int_format(4, PerTokenGroup(32)),
                     heads={(1, 0): Override(k=int_format(8, PerTokenGroup(32)))}), "keys use 2 formats"),
    ],
)
def test_hf_refusals_name_what_cannot_be_expressed(cfg, needle, tmp_path):
    with pytest.raises(ConfigError, match="QuantizedCache cannot express") as exc:
        export(cfg, "hf", tmp_path, n_layers=2, n_kv=2, head_dim=64)
    assert needle in str(exc.value)
    assert not (tmp_path / "generation_config.json").exists()


@pytest.fixture(scope="module")
def capture():
    from kverr.io import open_capture

    ds = open_capture("data/smollm2-pydoc-512.zarr").isel(layer=[0, 1]).load()
    ds = ds.assign_coords(layer=[0, 1])
    ds.attrs["model_n_layers"] = 2
    return ds


@pytest.mark.parametrize("preset,strategy", [("fp8-e4m3-tensor", "tensor"), ("fp8-e4m3-head", "attn_head")])
def test_vllm_export_scales_are_the_oracles_and_round_trip(preset, strategy, capture, tmp_path):
    from safetensors.numpy import load_file

    cfg = PRESETS[preset]
    out = tmp_path / "vllm"
    files = export(cfg, "vllm", out, capture=capture)
    assert {f.name for f in files} == {"config.json", "kv_scales.json", "kv_scales.safetensors"}
    obj = json.loads((out / "config.json").read_text())
    assert obj["quantization_config"]["kv_cache_scheme"] == {
        "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    t = load_file(str(out / "kv_scales.safetensors"))
    assert set(t) == {f"model.layers.{l}.self_attn.{w}_scale" for l in (0, 1) for w in "kv"}
    x = torch.as_tensor(capture["k"].sel(layer=1).values).half().float()
    want = quantize(x, cfg.k, page_size=64).scale.float().reshape(-1).numpy()
    got = t["model.layers.1.self_attn.k_scale"]
    assert got.shape == ((1,) if strategy == "tensor" else (3,))
    np.testing.assert_array_equal(got.reshape(-1), want)
    assert import_vllm(out) == cfg.with_(name=None)


def test_vllm_refusals(tmp_path, capture):
    with pytest.raises(ConfigError, match="fp8 e4m3 with static scales"):
        export(PRESETS["kivi-4"], "vllm", tmp_path, n_layers=2, n_kv=3)
    with pytest.raises(ConfigError, match="'token' scales are dynamic"):
        f = fp8_format(__import__("kverr.quant").quant.PerToken())
        check_vllm(CacheConfig(k=f, v=f), 2, 3)
    with pytest.raises(ConfigError, match="window=128"):
        check_vllm(PRESETS["fp8-e4m3-head"].with_(window=128), 2, 3)
    with pytest.raises(ConfigError, match="window_dtype=int8"):
        check_vllm(PRESETS["fp8-e4m3-head"].with_(window_dtype="int8"), 2, 3)
    with pytest.raises(ConfigError, match="differ"):
        check_vllm(CacheConfig(k=fp8_format(PerHead()), v=fp8_format(PerTensor())), 2, 3)
    with pytest.raises(CaptureError, match="--capture"):
        export(PRESETS["fp8-e4m3-head"], "vllm", tmp_path, n_layers=2, n_kv=3)
    assert check_vllm(PRESETS["fp16"], 2, 3) is None
    with pytest.raises(ConfigError, match="--format"):
        export(PRESETS["fp16"], "onnx", tmp_path)


def test_cli_export(tmp_path, capsys):
    from kverr.cli import main

    assert main(["export", "int4-token-g64", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "generation_config.json").exists()
    code = main(["export", "kivi-2", "--format", "vllm", "--out", str(tmp_path / "v")])
    _, err = capsys.readouterr()
    assert code == 2 and "vLLM cannot express" in err
