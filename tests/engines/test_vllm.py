"""vLLM: which configs it serves and how, the scales it reads, and model directories that load.

vLLM itself is not installed (it needs a CUDA build of torch); what it reads is checked against
the rules its loader follows, stated in :mod:`kverr.engines.vllm`: compressed-tensors' own
``QuantizationConfig`` validates the ``quantization_config``, scale names end in
``.self_attn.{k,v}_scale`` (float32, ``[1]`` or ``[num_kv_heads]``), and every file an index
names exists; transformers reloads the directory with the same weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kverr.config import PRESETS, CacheConfig, Override
from kverr.engines import export
from kverr.engines.vllm import (
    INDEX,
    SCALES,
    SUMMARY,
    export_vllm,
    import_vllm,
    serving,
    static_scales,
)
from kverr.exceptions import CaptureError, ConfigError, ModelError, OutputExistsError
from kverr.quant import PerHead, PerTensor, PerToken, float_format, fp8_format, int_format, quantize

N_LAYERS, N_KV, HEAD_DIM = 2, 3, 64


@pytest.fixture(scope="module")
def capture():
    """Layers 0 and 15 of the bundled capture, as a two-layer model's (3 kv heads, head dim 64)."""
    from kverr.io import open_capture

    ds = open_capture("data/smollm2-pydoc-512.zarr").isel(layer=[0, 1], token=slice(0, 128)).load()
    ds = ds.assign_coords(layer=[0, 1])
    ds.attrs["model_n_layers"] = N_LAYERS
    return ds


def _tiny_model_dir(path, *, shard: bool = False, n_kv: int = N_KV):
    """A random two-layer Llama of the capture's shape, saved as transformers saves it (bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=N_KV * HEAD_DIM, intermediate_size=128,
                      num_hidden_layers=N_LAYERS, num_attention_heads=N_KV, num_key_value_heads=n_kv,
                      head_dim=HEAD_DIM, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="200KB" if shard else "5GB")
    return model


def _skip_edges(base: CacheConfig, layers) -> CacheConfig:
    fp16 = float_format("fp16")
    return base.with_(layers={l: Override(k=fp16, v=fp16) for l in layers})


# ---- how vLLM serves a config ---------------------------------------------------------------


@pytest.mark.parametrize("preset,strategy", [("fp8-e4m3-tensor", "tensor"), ("fp8-e4m3-head", "attn_head")])
def test_static_fp8_presets_are_served_as_fp8_with_checkpoint_scales(preset, strategy):
    plan = serving(PRESETS[preset], 30, 3)
    assert (plan.kv_cache_dtype, plan.strategy, plan.skip_layers) == ("fp8", strategy, ())
    assert plan.kv_cache_scheme() == {"num_bits": 8, "type": "float", "strategy": strategy,
                                      "dynamic": False, "symmetric": True}
    assert plan.command("out", "bfloat16") == "vllm serve out --dtype bfloat16 --kv-cache-dtype fp8"


def test_layers_kept_in_16_bits_become_skip_layers():
    plan = serving(_skip_edges(PRESETS["fp8-e4m3-head"], (0, 29)), 30, 3)
    assert plan.skip_layers == (0, 29) and plan.kv_cache_dtype == "fp8"
    assert plan.command("m").endswith("--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 29")
    unquantized = serving(PRESETS["fp16"], 30, 3)
    assert (unquantized.kv_cache_dtype, unquantized.skip_layers) == ("auto", ())
    assert unquantized.k is None and unquantized.strategy is None


@pytest.mark.parametrize(
    "cfg,needle",
    [
        (PRESETS["kivi-4"], "not a vLLM cache dtype"),
        (PRESETS["nvfp4"], "the preset vllm-nvfp4 (--kv-cache-dtype nvfp4) is this layout with vLLM's arithmetic "
                           "(reciprocal=True, scale_rounding='nearest')"),
        (CacheConfig(k=fp8_format(PerToken()), v=fp8_format(PerToken())), "'token' scales are dynamic"),
        (PRESETS["fp8-e4m3-head"].with_(window=128), "window=128"),
        (PRESETS["fp8-e4m3-head"].with_(sinks=4), "sinks=4"),
        (PRESETS["fp8-e4m3-head"].with_(key_rounding="compensated"), "key_rounding=compensated (vLLM rounds keys"),
        (PRESETS["fp8-e4m3-head"].with_(window_dtype="int8"), "window_dtype=int8"),
        (CacheConfig(k=fp8_format(PerHead()), v=fp8_format(PerTensor())), "differ"),
        (CacheConfig(k=fp8_format(PerHead(), rotate="hadamard"), v=fp8_format(PerHead(), rotate="hadamard")),
         "Hadamard"),
        (PRESETS["fp8-e4m3-head"].with_(heads={(1, 2): Override(k=float_format("fp16"))}), "layer 1: its kv heads"),
        (PRESETS["fp8-e4m3-head"].with_(layers={1: Override(k=fp8_format(PerTensor()), v=fp8_format(PerTensor()))}),
         "2 format pairs"),
        (_skip_edges(PRESETS["fp8-e4m3-head"], (0,)).with_(layers={0: Override(k=float_format("fp32"), v=float_format("fp32"))}),
         "fp32 storage"),
    ],
)
def test_refusals_name_what_vllm_cannot_express(cfg, needle, tmp_path):
    with pytest.raises(ConfigError, match="vLLM cannot express") as exc:
        export(cfg, "vllm", tmp_path / "out", n_layers=N_LAYERS, n_kv=N_KV)
    assert needle in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_every_calibrated_config_is_refused_with_its_reasons():
    """The committed calibrated configs mix formats per head: no engine serves them as they are."""
    from pathlib import Path

    for path in sorted(Path("data/configs").glob("calibrated-*b.json")):
        with pytest.raises(ConfigError, match="vLLM cannot express this config: .*kv heads use"):
            serving(CacheConfig.load(path), 30, 3)


# ---- scales and the overlay -----------------------------------------------------------------


@pytest.mark.parametrize("preset,strategy", [("fp8-e4m3-tensor", "tensor"), ("fp8-e4m3-head", "attn_head")])
def test_overlay_holds_the_oracles_scales_and_a_valid_quantization_config(preset, strategy, capture, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.numpy import load_file

    cfg = PRESETS[preset]
    res = export_vllm(cfg, tmp_path / "v", capture=capture)
    assert {f.name for f in res.files} == {SUMMARY, SCALES, "quantization_config.json"} and res.linked == ()
    qc = json.loads((tmp_path / "v" / "quantization_config.json").read_text())
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.strategy == strategy and parsed.kv_cache_scheme.num_bits == 8
    t = load_file(str(tmp_path / "v" / SCALES))
    assert set(t) == {f"model.layers.{l}.self_attn.{w}_scale" for l in range(N_LAYERS) for w in "kv"}
    for layer in range(N_LAYERS):
        for w in "kv":
            # the cache receives fp16 values (the default model dtype): the scale is the oracle's on them
            x = torch.as_tensor(capture[w].sel(layer=layer).values).half().float()
            want = quantize(x, cfg.k, page_size=cfg.page_size).scale.float().reshape(-1).numpy()
            got = t[f"model.layers.{layer}.self_attn.{w}_scale"]
            assert got.dtype == np.float32 and got.shape == ((1,) if strategy == "tensor" else (N_KV,))
            np.testing.assert_array_equal(got, want)
    assert import_vllm(tmp_path / "v") == cfg.with_(name=None)
    summary = json.loads((tmp_path / "v" / SUMMARY).read_text())
    assert summary["command"] == "vllm serve MODEL --dtype float16 --kv-cache-dtype fp8"


def test_skip_layers_get_no_scales(capture, tmp_path):
    from safetensors.numpy import load_file

    cfg = _skip_edges(PRESETS["fp8-e4m3-head"], (1,))
    res = export_vllm(cfg, tmp_path / "v", capture=capture)
    assert set(load_file(str(tmp_path / "v" / SCALES))) == {f"model.layers.0.self_attn.{w}_scale" for w in "kv"}
    assert res.command.endswith("--kv-cache-dtype-skip-layers 1")
    back = import_vllm(tmp_path / "v")
    assert back.format_for(1, 0, "k").dtype == "fp16" and back.format_for(0, 2, "v") == cfg.v


def test_mse_clip_scales_are_no_larger_than_absmax(capture):
    """A format's clip decides its static scale: the MSE-optimal clip never exceeds absmax."""
    from kverr.quant import MSEClip

    absmax = static_scales(capture, fp8_format(PerHead()), "k", page_size=64)
    mse = static_scales(capture, fp8_format(PerHead(), clip=MSEClip()), "k", page_size=64)
    for a, m in zip(absmax, mse):
        assert np.all(m <= a) and np.all(m > 0)


def test_static_scales_need_a_whole_capture(capture, tmp_path):
    with pytest.raises(CaptureError, match="--capture"):
        export_vllm(PRESETS["fp8-e4m3-head"], tmp_path / "v", n_layers=N_LAYERS, n_kv=N_KV)
    part = capture.isel(layer=[0])
    with pytest.raises(CaptureError, match="scales are needed for all 2"):
        export_vllm(PRESETS["fp8-e4m3-head"], tmp_path / "v", capture=part)
    assert not (tmp_path / "v").exists()


# ---- complete model directories ---------------------------------------------------------------


@pytest.mark.parametrize("shard", [False, True])
def test_model_directory_loads_with_its_weights_and_scales(shard, capture, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = _tiny_model_dir(tmp_path / "model", shard=shard)
    cfg = _skip_edges(PRESETS["fp8-e4m3-head"], (1,))
    res = export_vllm(cfg, tmp_path / "out", capture=capture, model_dir=tmp_path / "model")
    out = tmp_path / "out"
    assert res.command == f"vllm serve {out} --dtype bfloat16 --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1"
    src = {p.name for p in (tmp_path / "model").iterdir()}
    assert {p.name for p in out.iterdir()} == src | {SCALES, SUMMARY}
    config = json.loads((out / "config.json").read_text())
    QuantizationConfig.model_validate(config["quantization_config"])
    assert config["num_hidden_layers"] == N_LAYERS  # the model's own config, kept
    scales = load_file(str(out / SCALES))
    assert set(scales) == {f"model.layers.0.self_attn.{w}_scale" for w in "kv"}
    x = torch.as_tensor(capture["v"].sel(layer=0).values).to(torch.bfloat16).float()  # a bf16 model's values
    want = quantize(x, cfg.v, page_size=cfg.page_size).scale.float().reshape(-1).numpy()
    np.testing.assert_array_equal(scales["model.layers.0.self_attn.v_scale"], want)
    if shard:
        index = json.loads((out / INDEX).read_text())
        assert {n: index["weight_map"][n] for n in scales} == {n: SCALES for n in scales}
        assert all((out / f).is_file() for f in index["weight_map"].values())
        assert len(set(index["weight_map"].values())) > 2  # really sharded
    else:
        assert not (out / INDEX).exists()  # vLLM then loads every *.safetensors file
    again = AutoModelForCausalLM.from_pretrained(out)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    assert (tmp_path / "model" / "config.json").read_text() != (out / "config.json").read_text()
    assert "quantization_config" not in json.loads((tmp_path / "model" / "config.json").read_text())


def test_dynamic_dtypes_write_no_checkpoint(tmp_path):
    res = export_vllm(PRESETS["fp16"], tmp_path / "v", n_layers=N_LAYERS, n_kv=N_KV)
    assert [f.name for f in res.files] == [SUMMARY]
    assert res.command == "vllm serve MODEL --dtype float16 --kv-cache-dtype auto"
    assert import_vllm(tmp_path / "v") == PRESETS["fp16"].with_(name=None)


def test_bad_model_directories_are_refused_before_writing(capture, tmp_path):
    cfg = PRESETS["fp8-e4m3-head"]
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="not a directory"):
        export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "empty")
    _tiny_model_dir(tmp_path / "noweights")
    for f in (tmp_path / "noweights").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelError, match="no safetensors weights"):
        export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "noweights")
    _tiny_model_dir(tmp_path / "other", n_kv=1)  # another model: one kv head
    with pytest.raises(ModelError, match="another model"):
        export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "other")
    calibrated = cfg.with_(provenance={"capture": {"model_id": "x", "n_layers": 30, "n_kv_heads": 3, "head_dim": 64}})
    _tiny_model_dir(tmp_path / "model")
    with pytest.raises(ConfigError, match="calibrated on a capture of 'x'"):
        export_vllm(calibrated, out, capture=capture, model_dir=tmp_path / "model")
    assert not out.exists()
    export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "model")
    with pytest.raises(OutputExistsError):
        export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "model")
    export_vllm(cfg, out, capture=capture, model_dir=tmp_path / "model", overwrite=True)


def test_cli_prints_the_serve_command(capture, tmp_path, capsys):
    from kverr.cli import main

    capture.to_zarr(tmp_path / "cap.zarr")
    _tiny_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    code = main(["export", "fp8-e4m3-tensor", "--format", "vllm", "--capture", str(tmp_path / "cap.zarr"),
                 "--model-dir", str(tmp_path / "model"), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert f"vllm serve {out} --dtype bfloat16 --kv-cache-dtype fp8" in text
    assert f"wrote {out / SCALES}" in text and "linked" in text
    code = main(["export", "kivi-2", "--format", "vllm", "--out", str(tmp_path / "v")])
    _, err = capsys.readouterr()
    assert code == 2 and "vLLM cannot express" in err


def test_int_formats_are_no_vllm_dtype_by_name():
    with pytest.raises(ConfigError, match="int8a/tok"):
        serving(CacheConfig(k=int_format(8, PerToken()), v=int_format(8, PerToken())), 2, 3)


def test_the_bundled_model_as_model_directory(tmp_path, capsys):
    """--model-dir default: the bundled model's transformers copy (float32: served in fp16)."""
    from kverr.capturing import transformers_dir
    from kverr.cli import main

    out = tmp_path / "out"
    assert main(["export", "vllm-int8-per-token-head", "--format", "vllm", "--model-dir", "default",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    want = f"vllm serve {transformers_dir('default')} --dtype float16 --kv-cache-dtype int8_per_token_head"
    assert want in text
    assert json.loads((out / SUMMARY).read_text())["command"] == want
