"""Capture from small random models of every supported family, through the PATH route.

The three proofs that a capture is the model's own state (KV cache bit for bit, RoPE of k_pre
gives k, attention recomputed from q/k/v gives the module's pre-projection output), plus the
dataset schema, layer subsets, storage dtypes, the CLI and bad input.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kverr.capturing import capture, capture_to_zarr, load_model, load_text, supported_shape, tokenize
from kverr.capturing.hooks import attention_modules
from kverr.capturing.stats import causal_attention
from kverr.capturing.tiny import TINY_VARIANTS, make_tiny_model
from kverr.dims import CAPTURE_VARS, KV_HEAD_OF_Q, SCHEMA_VERSION
from kverr.exceptions import CaptureError, DTypeError, ModelError, OutputExistsError, TextError
from kverr.io import open_capture
from kverr.rope import apply_rope, default_inv_freq

from bounds import attention_rounding_bound

# Captures of small models and RoPE round trips run torch's float32 kernels: again under
# ATen's baseline kernels in `make test` (their sums run in another order there).
pytestmark = pytest.mark.float_order

N_TOKENS = 120  # longer than the Mistral variant's sliding window of 40


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {v: make_tiny_model(root / v, v, seed=i) for i, v in enumerate(TINY_VARIANTS)}


@pytest.fixture(scope="module")
def pydoc():
    return load_text("pydoc")


@pytest.fixture(scope="module")
def captured(tiny_dirs, pydoc):
    """variant -> (loaded model, token ids, capture dataset), all layers, float32."""
    out = {}
    for variant, path in tiny_dirs.items():
        loaded = load_model(str(path))
        ids = tokenize(loaded.tokenizer, pydoc, N_TOKENS, offset=1000)
        out[variant] = (loaded, ids, capture(loaded, ids, text=pydoc, offset=1000))
    return out


def _plain_forward(loaded, ids, *, o_proj_inputs: dict | None = None):
    """The model's own forward with a KV cache, optionally recording o_proj's inputs."""
    handles = []
    if o_proj_inputs is not None:
        for layer, module in enumerate(attention_modules(loaded.model)):
            def pre(_m, args, layer=layer):
                o_proj_inputs[layer] = args[0].detach().clone()
            handles.append(module.o_proj.register_forward_pre_hook(pre))
    try:
        with torch.inference_mode():
            return loaded.model(input_ids=torch.as_tensor(ids)[None], use_cache=True)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_k_and_v_equal_the_models_kv_cache_bit_for_bit(captured, variant):
    loaded, ids, ds = captured[variant]
    cache = _plain_forward(loaded, ids).past_key_values
    assert len(cache.layers) == loaded.n_layers
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys[0].numpy(), layer.values[0].numpy()
        # A sliding-window layer's cache keeps only the most recent tokens: compare those.
        n = keys.shape[1]
        if ds.sliding_window.values[i]:
            assert n < N_TOKENS
        else:
            assert n == N_TOKENS
        assert np.array_equal(ds.k.values[i][:, N_TOKENS - n :], keys), f"layer {i} keys"
        assert np.array_equal(ds.v.values[i][:, N_TOKENS - n :], values), f"layer {i} values"


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_rope_of_captured_k_pre_gives_captured_k(captured, variant):
    _, _, ds = captured[variant]
    for i in range(ds.sizes["layer"]):
        k = ds.k.values[i]
        rope = ds.kv.rope_of(int(ds.layer.values[i]))  # Gemma 3: its layer type's RoPE
        rotated = apply_rope(ds.k_pre.values[i], ds.position.values, rope).numpy()
        np.testing.assert_allclose(rotated, k, rtol=1e-6, atol=1e-6 * np.abs(k).max())
        # And back again (exact only without RoPE attention scaling, e.g. YaRN).
        if rope["attention_scaling"] == 1.0:
            back = apply_rope(k, ds.position.values, rope, inverse=True).numpy()
            k_pre = ds.k_pre.values[i]
            np.testing.assert_allclose(back, k_pre, rtol=1e-5, atol=1e-5 * np.abs(k_pre).max())


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_attention_recomputed_from_capture_equals_module_output(captured, variant):
    loaded, ids, ds = captured[variant]
    o_in: dict[int, torch.Tensor] = {}
    _plain_forward(loaded, ids, o_proj_inputs=o_in)
    for i in range(ds.sizes["layer"]):
        expected = (
            o_in[i][0].reshape(N_TOKENS, loaded.n_q_heads, loaded.head_dim).transpose(0, 1).numpy()
        )
        got = causal_attention(
            ds.q.values[i],
            ds.k.values[i],
            ds.v.values[i],
            scale=float(ds.attn_scale.values[i]),
            kv_head_of_q=ds[KV_HEAD_OF_Q].values,
            sliding_window=int(ds.sliding_window.values[i]),
            sinks=ds.attn_sink.values[i] if "attn_sink" in ds else None,
        )
        bound = attention_rounding_bound(ds.q.values[i], ds.k.values[i], ds.v.values[i],
                                         scale=float(ds.attn_scale.values[i]),
                                         kv_head_of_q=ds[KV_HEAD_OF_Q].values)
        # got is float64; expected is the model's float32 attention
        assert (np.abs(got - expected) <= bound).all(), f"layer {i}: {np.abs(got - expected).max()}"


def test_the_proofs_are_not_vacuous(captured):
    """The Mistral window and the peaked random attention make the checks above sensitive."""
    loaded, ids, ds = captured["mistral"]
    q, k, v = ds.q.values[0], ds.k.values[0], ds.v.values[0]
    kvh, scale = ds[KV_HEAD_OF_Q].values, float(ds.attn_scale.values[0])
    windowed = causal_attention(q, k, v, scale=scale, kv_head_of_q=kvh, sliding_window=40)
    full = causal_attention(q, k, v, scale=scale, kv_head_of_q=kvh)
    assert np.abs(windowed - full).max() > 1e-2 * np.abs(full).max()
    # q and k_pre differ from k: RoPE really rotated them.
    assert np.abs(ds.k_pre.values - ds.k.values).max() > 0.1
    # gpt-oss's sinks take real weight: without them the attention is another one
    loaded, ids, ds = captured["gpt_oss"]
    q, k, v = ds.q.values[1], ds.k.values[1], ds.v.values[1]
    kvh, scale = ds[KV_HEAD_OF_Q].values, float(ds.attn_scale.values[1])
    with_sinks = causal_attention(q, k, v, scale=scale, kv_head_of_q=kvh, sinks=ds.attn_sink.values[1])
    full = causal_attention(q, k, v, scale=scale, kv_head_of_q=kvh)
    assert np.abs(with_sinks - full).max() > 1e-2 * np.abs(full).max()
    assert list(ds.sliding_window.values) == [32, 0] and ds.attrs["model_sliding_windows"] == [32, 0]


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_schema_coords_and_attrs(captured, tiny_dirs, pydoc, variant):
    loaded, ids, ds = captured[variant]
    for name, dims in CAPTURE_VARS.items():
        assert ds[name].dims == dims
    assert ds.sizes["layer"] == loaded.n_layers
    assert ds.sizes["q_head"] == loaded.n_q_heads and ds.sizes["kv_head"] == loaded.n_kv_heads
    assert ds.sizes["channel"] == loaded.head_dim == ds.attrs["head_dim"]
    shape = supported_shape(str(tiny_dirs[variant]))
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim) == (loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    assert shape.max_context == loaded.max_context
    group = loaded.n_q_heads // loaded.n_kv_heads
    assert list(ds[KV_HEAD_OF_Q].values) == [h // group for h in range(loaded.n_q_heads)]
    assert np.array_equal(ds.token_id.values, ids) and np.array_equal(ds.position.values, np.arange(N_TOKENS))
    # Gemma 3 scales by query_pre_attn_scalar ** -0.5, the others by head_dim ** -0.5
    want_scale = TINY_VARIANTS[variant][1].get("query_pre_attn_scalar", loaded.head_dim) ** -0.5
    np.testing.assert_allclose(ds.attn_scale.values, want_scale)
    a = ds.attrs
    assert a["schema_version"] == SCHEMA_VERSION and a["dtype"] == "float32"
    assert a["text_source"] == "pydoc" and a["text_sha256"] == pydoc.sha256 and a["token_offset"] == 1000
    weights = tiny_dirs[variant] / "model.safetensors"
    assert a["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert a["model_id"] == str(tiny_dirs[variant].resolve())
    recorded = json.loads(a["rope"])
    given = TINY_VARIANTS[variant][1]["rope_parameters"]
    by_type = given if "rope_type" not in given else None  # Gemma 3: a RoPE per layer type
    for layer in range(loaded.n_layers):
        rope = ds.kv.rope_of(layer)
        expected_type = (by_type[recorded["layer_types"][layer]] if by_type else given)["rope_type"]
        assert rope["rope_type"] == expected_type and len(rope["inv_freq"]) == loaded.head_dim // 2
        if expected_type == "default":
            assert np.array_equal(
                np.float32(rope["inv_freq"]), default_inv_freq(loaded.head_dim, rope["rope_theta"]).numpy()
            )
    if by_type:
        assert recorded["layer_types"] == TINY_VARIANTS[variant][1]["layer_types"]
        assert ds.kv.rope_of(0)["inv_freq"] != ds.kv.rope_of(2)["inv_freq"]
    for var in ("q", "k_pre", "k", "v"):
        assert np.isfinite(ds[var].values).all()


def test_layer_subset_equals_full_capture_and_stops_early(captured):
    loaded, ids, full = captured["llama"]
    ran: list[int] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, i=i: ran.append(i))
        for i, m in enumerate(attention_modules(loaded.model))
    ]
    try:
        sub = capture(loaded, ids, layers=[1, 0])
    finally:
        for h in handles:
            h.remove()
    assert list(sub.layer.values) == [0, 1]
    assert ran == [0, 1], "the forward must stop after the last requested layer"
    for var in ("q", "k_pre", "k", "v"):
        assert np.array_equal(sub[var].values, full[var].sel(layer=[0, 1]).values)
    only_last = capture(loaded, ids, layers=[2])
    assert np.array_equal(only_last.k.values, full.k.sel(layer=[2]).values)


def test_float16_storage_is_the_float32_capture_rounded(captured):
    loaded, ids, full = captured["qwen2"]
    half = capture(loaded, ids, dtype="float16")
    assert half.attrs["dtype"] == "float16"
    for var in ("q", "k_pre", "k", "v"):
        assert half[var].dtype == np.float16
        assert np.array_equal(half[var].values, full[var].values.astype(np.float16))


def test_capture_leaves_the_model_as_it_was(captured):
    loaded, ids, _ = captured["qwen3"]
    modules = attention_modules(loaded.model)
    impl = loaded.model.config._attn_implementation
    before = _plain_forward(loaded, ids).logits
    capture(loaded, ids, layers=[0])
    with pytest.raises(CaptureError):
        capture(loaded, ids, layers=[99])
    assert loaded.model.config._attn_implementation == impl
    assert all(not hasattr(m, "_kverr_recorder") for m in modules)
    assert all(not m.k_proj._forward_hooks and not m.k_norm._forward_hooks for m in modules)
    assert torch.equal(_plain_forward(loaded, ids).logits, before)


def test_eager_attention_is_captured_as_the_eager_model_runs(tiny_dirs, captured):
    _, ids, sdpa = captured["llama"]
    loaded = load_model(str(tiny_dirs["llama"]))
    loaded.model.config._attn_implementation = "eager"
    eager = capture(loaded, ids)
    assert loaded.model.config._attn_implementation == "eager"
    # Layer 0 sees the same inputs whatever the kernel; later layers see the kernel's rounding.
    for var in ("q", "k_pre", "k", "v"):
        assert np.array_equal(eager[var].values[0], sdpa[var].values[0])
    cache = _plain_forward(loaded, ids).past_key_values
    for i, layer in enumerate(cache.layers):
        assert np.array_equal(eager.k.values[i], layer.keys[0].numpy())
        assert np.array_equal(eager.v.values[i], layer.values[0].numpy())


def test_bad_capture_requests(captured):
    loaded, ids, _ = captured["llama"]
    with pytest.raises(CaptureError, match="out of range"):
        capture(loaded, ids, layers=[0, 3])
    with pytest.raises(CaptureError, match="empty"):
        capture(loaded, ids, layers=[])
    with pytest.raises(DTypeError, match="bfloat16"):
        capture(loaded, ids, dtype="bfloat16")
    with pytest.raises(CaptureError, match="context of 1024"):
        capture(loaded, np.zeros(1025, dtype=np.int64))
    with pytest.raises(CaptureError, match="non-empty"):
        capture(loaded, np.zeros(0, dtype=np.int64))
    with pytest.raises(CaptureError, match="0..257"):
        capture(loaded, np.array([1, 2, 999]))


def test_load_model_rejects_missing_and_unsupported(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelError, match="not found"):
        supported_shape(str(tmp_path / "nope"))
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelError, match="'gpt2' .* not supported.*llama, mistral, qwen2"):
        load_model(str(tmp_path / "gpt2"))
    with pytest.raises(ModelError, match="not supported"):
        supported_shape(str(tmp_path / "gpt2"))
    with pytest.raises(ModelError, match="dtype"):
        load_model(str(tmp_path), dtype=torch.int8)


def test_load_model_rejects_a_directory_without_weights(tiny_dirs, tmp_path):
    src = tiny_dirs["llama"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    shape = supported_shape(str(tmp_path))  # the shape needs no weights
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim) == (3, 2, 64)
    with pytest.raises(ModelError, match="no weight files"):
        load_model(str(tmp_path))


def test_capture_to_zarr_round_trip(captured, tmp_path):
    loaded, ids, ds = captured["mistral"]
    out = capture_to_zarr(loaded, ids, tmp_path / "c.zarr", layers=[1])
    back = open_capture(out)
    assert back.k.chunks is not None  # lazy, dask-backed
    for var in CAPTURE_VARS:
        assert np.array_equal(back[var].values, ds[var].sel(layer=[1]).values if "layer" in ds[var].dims else ds[var].values)
    assert list(back.sliding_window.values) == [40]
    with pytest.raises(OutputExistsError, match="--overwrite"):
        capture_to_zarr(loaded, ids, out)


def _cli(*argv: str) -> int:
    from kverr.cli import main

    return main(list(argv))


def test_cli_capture_and_info(tiny_dirs, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("Keys and values, stored in fewer bits. " * 40, encoding="utf-8")
    out = tmp_path / "caps" / "t.zarr"
    model = str(tiny_dirs["qwen2"])
    args = ["capture", "--model", model, "--text", str(text), "--tokens", "256", "--out", str(out)]
    assert _cli(*args, "--layers", "0-1", "--dtype", "float16", "--offset", "3") == 0
    ds = open_capture(out)
    assert ds.sizes["token"] == 256 and ds.q.dtype == np.float16 and ds.attrs["token_offset"] == 3
    assert ds.attrs["text_source"] == str(text.resolve())
    capsys.readouterr()
    assert _cli(*args) == 2
    assert "already exists" in capsys.readouterr().err
    assert _cli(*args, "--overwrite", "--layers", "1") == 0
    assert list(open_capture(out).layer.values) == [1]
    capsys.readouterr()
    assert _cli("info", str(out)) == 0
    shown = capsys.readouterr().out
    assert "q heads" in shown and "kv_head_of_q [0, 0, 0, 1, 1, 1]" in shown and "256 tokens" in shown
    assert _cli("info", "--json", str(out)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dims"]["token"] == 256 and summary["layers"] == [1]
    assert summary["kv_head_of_q"] == [0, 0, 0, 1, 1, 1]


def test_cli_bad_input_gives_one_line_and_no_output(tiny_dirs, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("too short", encoding="utf-8")
    out = tmp_path / "x.zarr"
    model = str(tiny_dirs["llama"])
    cases = [
        (["--model", model, "--text", str(text), "--tokens", "256"], "tokens"),
        (["--model", str(tmp_path / "missing"), "--tokens", "256"], "not found"),
        (["--model", model, "--text", str(tmp_path / "none.txt")], "not found"),
        (["--model", model, "--layers", "0,x"], "--layers"),
        (["--model", model, "--tokens", "300", "--layers", "7"], "out of range"),
    ]
    for extra, needle in cases:
        assert _cli("capture", "--out", str(out), *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists()
    assert not list(tmp_path.glob(".x.zarr*")), "no temporary store may be left behind"
    assert _cli("info", str(tmp_path / "none.zarr")) == 2
    assert "no capture" in capsys.readouterr().err


def test_tokenize_too_short_text_names_the_numbers(captured):
    loaded, _, _ = captured["llama"]
    with pytest.raises(TextError, match=r"has 5 tokens; 10 from offset 0"):
        tokenize(loaded.tokenizer, "hello", 10)
