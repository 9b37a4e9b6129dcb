"""The transformers export through ``kverr.engines.export`` and the CLI (its backends, refusals
and numbers are in test_hf.py; the vLLM export's tests in test_vllm.py)."""

from __future__ import annotations

import json

from kverr.config import PRESETS
from kverr.engines import export
from kverr.engines.hf import import_hf


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


def test_cli_export(tmp_path, capsys):
    from kverr.cli import main

    assert main(["export", "int4-token-g64", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "generation_config.json").exists()
