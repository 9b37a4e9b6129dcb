"""Sliding-window and hybrid attention end to end, through the command line: random Mistral-like
(every layer sliding), gpt-oss-like (sliding and full layers alternating, learned sinks) and
Gemma-3-like (two sliding layers to one full, a RoPE per layer type) models pass capture ->
decompose -> calibrate -> memory -> evaluate -> validate.

The numbers each stage produces are tested where the stage is (the window and sink rules in
tests/error, the byte counts in test_memory, the objective in tests/calibration, the kernels in
tests/gpu); here the stages must accept what the previous one wrote for these layouts, and what
they report must carry the windows and sinks: the decomposition differs from full attention,
the config's bytes are those a sliding layer holds, the kernel path agrees with the reference.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kverr.cli import main

@pytest.fixture(scope="module", params=["mistral", "gpt_oss", "gemma3"])
def pipeline(request, tmp_path_factory):
    """The tiny model, and what each stage wrote for it (the stages run once per model)."""
    from kverr.capturing.tiny import make_tiny_model

    d = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    model = str(make_tiny_model(d / "model", request.param))
    text = d / "words.txt"
    text.write_text(" ".join(["the cache keeps every key and value of the tokens it has seen"] * 80), encoding="utf-8")
    out = dict(model=model, dir=d, variant=request.param, text=text)
    assert main(["capture", "--model", model, "--text", str(text), "--tokens", "160", "--out", str(d / "cap.zarr")]) == 0
    assert main(["decompose", "--capture", str(d / "cap.zarr"), "--config", "q4_0", "--queries", "48",
                 "--out", str(d / "dec.zarr"), "--no-progress"]) == 0
    assert main(["calibrate", "--capture", str(d / "cap.zarr"), "--budget-bits", "4", "--queries", "16",
                 "--model", model, "--out", str(d / "cfg.json")]) == 0
    return out


def test_decomposition_carries_the_windows_and_sinks(pipeline):
    import xarray as xr

    from kverr.error import decompose_capture
    from kverr.io import open_capture

    d = pipeline["dir"]
    cap = open_capture(d / "cap.zarr")
    got = xr.open_zarr(d / "dec.zarr")
    assert cap.kv.has_sliding_window and cap.kv.has_sinks == (pipeline["variant"] == "gpt_oss")
    # the same capture as if every layer attended to all tokens, without sinks: another answer
    plain = cap.drop_vars([n for n in ("sliding_window", "attn_sink") if n in cap.variables])
    full = decompose_capture(plain.assign_attrs(model_sliding_windows=[]), "q4_0", queries=48).compute(
        scheduler="synchronous")
    sliding = [i for i, w in enumerate(cap.sliding_window.values) if w]
    assert not np.allclose(got["kl"].values[sliding], full["kl"].values[sliding], rtol=1e-2)


def test_calibrated_bytes_are_what_the_sliding_layers_hold(pipeline, capsys):
    from kverr.config import CacheConfig
    from kverr.memory import account, model_shape

    d, model = pipeline["dir"], pipeline["model"]
    cfg = CacheConfig.from_json((d / "cfg.json").read_text(encoding="utf-8"))
    shape = model_shape(model)
    assert any(shape.sliding_windows)
    rep = account(cfg, shape, 160)
    assert rep.total_bytes == cfg.provenance["bytes"] and rep.effective_bits <= 4.0
    capsys.readouterr()
    assert main(["memory", str(d / "cfg.json"), "--model", model, "--tokens", "4096", "--json"]) == 0
    long = json.loads(capsys.readouterr().out)
    # a sliding layer's bytes do not grow with the context; a full layer's do
    for layer, w in zip(long["layers"], shape.sliding_windows):
        short = rep.layer_total(layer["layer"]).total
        assert (layer["k"]["total"] + layer["v"]["total"] == short) == bool(w)


def test_evaluate_and_validate_the_calibrated_config(pipeline, capsys):
    d, model = pipeline["dir"], pipeline["model"]
    ev = d / "ev.csv"
    assert main(["evaluate", "--model", model, "--text", str(pipeline["text"]), "--config", str(d / "cfg.json"),
                 "--scheme", "fp16", "--prefill", "96", "--decode", "8", "--segments", "1", "--offset", "0", "--out", str(ev)]) == 0
    df = pd.read_csv(ev).set_index("scheme")
    # fp16 rounds the cache only; the calibrated config costs more; bits are counted as the
    # sliding layers hold them (fp16 at 104 tokens in pages of 64: a full model would pay 19.7)
    assert df.loc["fp16", "mean_kl"] < 1e-4 and df.drop("fp16")["mean_kl"].iloc[0] > df.loc["fp16", "mean_kl"]
    assert df.loc["fp16", "effective_bits"] < 16.0
    capsys.readouterr()
    # 56 tokens: longer than every window (32, 40), so masks hide keys; two sequences
    code = main(["validate", str(d / "cfg.json"), "--capture", str(d / "cap.zarr"), "--tokens", "56", "--batch", "2",
                 "--steps", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report


def test_validation_moves_each_layer_with_its_own_rope(pipeline):
    """The kernel path rotates pre-RoPE keys to local positions with each layer's tables and turns
    the captured queries back to match: the attention scores are the captured ones, layer by layer
    (Gemma 3: local and global layers rotate differently; a single table would fail here)."""
    import torch

    from kverr.io import open_capture
    from kverr.rope import rotate
    from kverr.validation import _local_positions

    cap = open_capture(pipeline["dir"] / "cap.zarr")
    tokens, batch = 48, 2
    sel = dict(token=slice(0, tokens * batch))

    def split(x):  # [L, heads, B*T, D] -> [L, B, heads, T, D]
        x = torch.from_numpy(np.asarray(x, dtype=np.float32))
        return x.reshape(x.shape[0], x.shape[1], batch, tokens, x.shape[-1]).permute(0, 2, 1, 3, 4)

    q, kp, k = (split(cap[n].isel(sel).values) for n in ("q", "k_pre", "k"))
    q_local, tables = _local_positions(cap, q, tokens, batch)
    rep = q.shape[2] // k.shape[2]
    for layer, (cos, sin) in enumerate(tables):
        k_local = rotate(kp[layer], cos, sin)
        got = q_local[layer] @ k_local.repeat_interleave(rep, dim=1).transpose(-1, -2)
        want = q[layer] @ k[layer].repeat_interleave(rep, dim=1).transpose(-1, -2)
        # float32: two rotations and a D-term dot product round at ~1e-6 of the largest score
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert (len({id(t) for t in tables}) == 2) == (pipeline["variant"] == "gemma3")
