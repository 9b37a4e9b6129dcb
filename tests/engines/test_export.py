"""The transformers export: round trips and refusals that name what the target cannot express
(the vLLM export's tests are in test_vllm.py)."""

from __future__ import annotations

import json

import pytest

from kverr.config import PRESETS, CacheConfig, Override
from kverr.engines import export
from kverr.engines.hf import check_hf, import_hf
from kverr.exceptions import ConfigError
from kverr.quant import PerTokenGroup, int_format


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


def test_cli_export(tmp_path, capsys):
    from kverr.cli import main

    assert main(["export", "int4-token-g64", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "generation_config.json").exists()
