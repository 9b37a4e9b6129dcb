"""The capture proofs on the bundled default model (SmolLM2-135M-Instruct), and data/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kverr.capturing import DEFAULT_MODEL_ID, capture, load_model, load_text, supported_shape, tokenize
from kverr.capturing.hooks import attention_modules
from kverr.capturing.model import _converted_default_dir, _sha256_file, default_gguf_path
from kverr.capturing.stats import causal_attention
from kverr.dims import KV_HEAD_OF_Q
from kverr.io import open_capture
from kverr.rope import apply_rope, default_inv_freq

from bounds import attention_rounding_bound

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "smollm2-pydoc-512.zarr"
GGUF_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
N_TOKENS = 256


def test_default_model_shape_without_loading_weights():
    # read from the GGUF header, and equal to the shape kverr.memory assumes for the default
    from kverr.memory import DEFAULT_SHAPE

    def dims(s):
        return s.n_layers, s.n_kv_heads, s.head_dim, s.max_context

    assert dims(supported_shape("default")) == dims(supported_shape()) == dims(DEFAULT_SHAPE)


@pytest.fixture(scope="module")
def smol():
    return load_model("default")


@pytest.fixture(scope="module")
def smol_capture(smol):
    text = load_text("pydoc")
    ids = tokenize(smol.tokenizer, text, N_TOKENS, offset=2000)
    return ids, capture(smol, ids, text=text, offset=2000)


@pytest.mark.slow
def test_default_model_identity(smol):
    assert (smol.n_layers, smol.n_q_heads, smol.n_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert smol.max_context == 8192 and smol.model_id == DEFAULT_MODEL_ID
    assert smol.weights_sha256 == GGUF_SHA
    assert smol.rope["rope_theta"] == 100000.0 and smol.rope["rope_type"] == "default"
    assert np.array_equal(np.float32(smol.rope["inv_freq"]), default_inv_freq(64, 1e5).numpy())


@pytest.mark.float_order
@pytest.mark.slow
def test_default_capture_is_the_models_own_state(smol, smol_capture):
    """KV cache bit for bit, RoPE(k_pre) == k, attention from q/k/v == o_proj input."""
    ids, ds = smol_capture
    o_in = {}
    handles = [
        m.o_proj.register_forward_pre_hook(lambda _m, a, i=i: o_in.__setitem__(i, a[0].clone()))
        for i, m in enumerate(attention_modules(smol.model))
    ]
    try:
        with torch.inference_mode():
            cache = smol.model(input_ids=torch.as_tensor(ids)[None], use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    rope = ds.attrs["rope"]
    for i in range(30):
        assert np.array_equal(ds.k.values[i], cache.layers[i].keys[0].numpy()), f"keys, layer {i}"
        assert np.array_equal(ds.v.values[i], cache.layers[i].values[0].numpy()), f"values, layer {i}"
        k = ds.k.values[i]
        rotated = apply_rope(ds.k_pre.values[i], ds.position.values, rope).numpy()
        np.testing.assert_allclose(rotated, k, rtol=1e-6, atol=1e-6 * np.abs(k).max())
        expected = o_in[i][0].reshape(N_TOKENS, 9, 64).transpose(0, 1).numpy()
        got = causal_attention(
            ds.q.values[i], k, ds.v.values[i], scale=float(ds.attn_scale.values[i]),
            kv_head_of_q=ds[KV_HEAD_OF_Q].values,
        )
        bound = attention_rounding_bound(ds.q.values[i], k, ds.v.values[i], scale=float(ds.attn_scale.values[i]),
                                         kv_head_of_q=ds[KV_HEAD_OF_Q].values)
        assert (np.abs(got - expected) <= bound).all(), f"layer {i}: {np.abs(got - expected).max()}"


@pytest.mark.slow
def test_data_capture_is_reproducible_bit_for_bit(smol, tmp_path):
    """data/ holds exactly what its documented command produces, on any x86-64 processor.

    The committed capture was made under REPRODUCIBLE_FLOAT_ENV (ATen's baseline kernels, MKL's
    most conservative code path), whose float32 sums run in the same order on every x86-64 CPU;
    the documented command is run again here under the same environment, in a fresh process
    (both variables are read when torch starts). With the same torch/transformers stack the
    tensors must be equal bit for bit. With another stack (other kernels, other algorithms) only
    closeness can be claimed: a last-bit difference in a layer's input grows through the layers
    below the captured one, so the bound is relative to each tensor's scale (1e-3).
    """
    import os
    import subprocess
    import sys

    from kverr.capturing import NUMERICS_ATTRS, REPRODUCIBLE_FLOAT_ENV

    committed = open_capture(DATA)
    assert list(committed.layer.values) == [0, 15, 29] and committed.sizes["token"] == 512
    a = committed.attrs
    assert a["weights_sha256"] == GGUF_SHA and a["text_source"] == "pydoc" and a["dtype"] == "float32"
    assert a["cpu_capability"] == "DEFAULT" and a["mkl_cbwr"] == "COMPATIBLE", "made without REPRODUCIBLE_FLOAT_ENV"
    text = load_text("pydoc")
    assert a["text_sha256"] == text.sha256, "the pydoc text differs on this Python version"
    ids = tokenize(smol.tokenizer, text, 512)
    assert np.array_equal(committed.token_id.values, ids)
    out = tmp_path / "fresh.zarr"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | REPRODUCIBLE_FLOAT_ENV
    cmd = [sys.executable, "-m", "kverr.cli", "capture", "--model", "default", "--text", "pydoc",
           "--tokens", "512", "--layers", "0,15,29", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    fresh = open_capture(out)
    assert fresh.attrs["cpu_capability"] == "DEFAULT" and fresh.attrs["mkl_cbwr"] == "COMPATIBLE"
    same_stack = all(a[key] == fresh.attrs[key] for key in NUMERICS_ATTRS)
    for var in ("q", "k_pre", "k", "v"):
        if same_stack:
            assert np.array_equal(committed[var].values, fresh[var].values), var
        else:
            want, got = committed[var].values, fresh[var].values
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max(), err_msg=var)
    assert json.loads(a["rope"]) == json.loads(fresh.attrs["rope"])


@pytest.mark.slow
def test_pydoc_is_long_enough_for_the_full_context(smol):
    text = load_text("pydoc")
    n = len(smol.tokenizer(text.text, add_special_tokens=False, verbose=False)["input_ids"])
    assert n > 100_000
    assert tokenize(smol.tokenizer, text, 8192).shape == (8192,)


@pytest.mark.slow
def test_converted_weights_are_cached_and_identical(tmp_path, monkeypatch, smol):
    """First load converts the GGUF (~20 s) into the cache; the second load is fast."""
    monkeypatch.setenv("KVERR_CACHE_DIR", str(tmp_path))
    gguf = default_gguf_path()
    assert _sha256_file(gguf) == GGUF_SHA
    t0 = time.perf_counter()
    first = load_model("default")
    convert_s = time.perf_counter() - t0
    target = _converted_default_dir(GGUF_SHA)
    assert target.parent == tmp_path and (target / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".*tmp-*")), "no temporary conversion may remain"
    t0 = time.perf_counter()
    second = load_model("default")
    load_s = time.perf_counter() - t0
    assert load_s < max(5.0, convert_s / 3), (load_s, convert_s)
    sd0, sd1, sd2 = smol.model.state_dict(), first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(sd0[k], sd1[k]) and torch.equal(sd1[k], sd2[k]) for k in sd0)
    assert supported_shape("default").n_layers == 30  # now read from the converted config


@pytest.mark.slow
def test_default_model_in_float16_storage_and_bf16_compute(smol_capture):
    ids, ds = smol_capture
    bf16 = load_model("default", dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    small = capture(bf16, ids[:64], layers=[0], dtype="float16")
    assert small.attrs["model_dtype"] == "bfloat16" and small.k.dtype == np.float16
    np.testing.assert_allclose(small.k.values[0], ds.k.values[0][:, :64], rtol=0.05, atol=0.05)
