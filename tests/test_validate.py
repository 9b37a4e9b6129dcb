"""``kverr validate`` on the real capture in data/: the kernel path (Triton interpreter on the CPU)
agrees with the reference path; exit status 0 only when they agree; errors are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kverr.cli import main
from kverr.config import CacheConfig

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "smollm2-pydoc-512.zarr"
needs_capture = pytest.mark.skipif(not CAPTURE.exists(), reason="the data/ capture is not present")


@needs_capture
@pytest.mark.float_order
def test_validate_preset_agrees(capsys):
    pytest.importorskip("zarr")
    code = main(["validate", "kivi-2", "--capture", str(CAPTURE), "--tokens", "150", "--layers", "0,29", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "AGREE" in out and "largest difference" in out and "int2a/ch32/fp16" in out


@needs_capture
def test_validate_json_and_disagreement(capsys, tmp_path):
    pytest.importorskip("zarr")
    code = main(["validate", "int8-token", "--capture", str(CAPTURE), "--tokens", "40", "--batch", "1",
                 "--layers", "15", "--steps", "1", "--tol", "1e-12", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and rep["ok"] is False  # a tolerance below fp32 round-off cannot be met: exit 1, not 0
    assert rep["layers"][0]["mismatched"] == 0 and rep["layers"][0]["rel_rms"] < 1e-3


@needs_capture
@pytest.mark.parametrize("name,layers", [("fitted-3b", "0,29"), ("codebooks-4b", "15"), ("salient-2.5b", "15"),
                                         ("compensated-2.5b", "0"), ("windows-2b", "15")])
def test_validate_calibrated_configs_agree(capsys, name, layers):
    """Configs the calibrator emitted -- per-head formats with Hadamard rotations and MSE clips,
    keys stored before RoPE, static per-channel scales with fitted widths per channel, codebook
    formats (layer 15 of codebooks-4b has three), an int8 window, salient prompt tokens (chosen
    by the capture's queries: their rows read in place of their codes), keys rounded with
    compensation under the prefill queries' moment, a window length per (kv head, K|V) -- run on
    the kernel path and agree with the reference. (notebooks/04_kernel_validation.ipynb, run by the tests,
    asserts the same of calibrated-4b and calibrated-prerope-3b on every captured layer.)"""
    pytest.importorskip("zarr")
    path = CAPTURE.parent / "configs" / f"{name}.json"
    if name == "calibrated-prerope-3b":  # an earlier calibration's config, kept beside its experiment
        path = CAPTURE.parents[1] / "experiments" / "does-sensitivity-weighting-choose-better-configs" / "configs" / f"{name}.json"
    text = path.read_text()
    assert '"hadamard"' in text and '"mse"' in text  # the branches this test is for
    if name in ("calibrated-3b", "fitted-3b"):
        assert '"tokens": null' in text  # static per-channel scales
    if name == "fitted-3b":
        assert '"channel_bits"' in text and '"key_pre_rope": true' in text
    if name == "codebooks-4b":
        assert '"dtype": "codebook"' in text
    if name in ("salient-2.5b", "compensated-2.5b"):
        assert '"salient": 8' in text
    if name in ("compensated-2.5b", "windows-2b"):
        assert '"key_rounding": "compensated"' in text
    if name == "windows-2b":
        cfg = CacheConfig.load(path)
        assert len({cfg.window_for(15, h, w) for h in range(3) for w in "kv"}) > 1  # layer 15's windows differ
    if name in ("calibrated-3b", "calibrated-4b", "fitted-3b", "codebooks-4b", "salient-2.5b"):
        assert '"window_dtype": "int8"' in text
    code = main(["validate", str(path), "--capture", str(CAPTURE), "--tokens", "120", "--batch", "2",
                 "--layers", layers, "--steps", "1", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and rep["ok"], rep
    assert all(r["mismatched"] == 0 and r["rel_rms"] <= 1e-3 and r["quant_rel_error"] > 1e-3 for r in rep["layers"])


def test_validate_errors_are_one_line(capsys, tmp_path):
    code = main(["validate", "kivi-2", "--capture", str(tmp_path / "missing.zarr")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no capture" in err
    cfg = tmp_path / "pct.json"
    cfg.write_text(json.dumps({"version": 1, "k": {"dtype": "int", "bits": 4, "clip": {"kind": "percentile", "percentile": 99.0}},
                               "v": {"dtype": "fp16"}}))
    if CAPTURE.exists():
        pytest.importorskip("zarr")
        code = main(["validate", str(cfg), "--capture", str(CAPTURE), "--tokens", "20", "--batch", "1", "--steps", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "not implemented" in err and err.count("\n") == 1


@needs_capture
def test_validate_compensated_keys_after_rope_agree():
    """Keys after RoPE rounded with compensation, a short window so the decode steps quantize keys
    (to nearest: the prefill's moment weighs only the prefill's keys) on both paths."""
    pytest.importorskip("zarr")
    from kverr.config import named_presets
    from kverr.validation import validate

    cfg = named_presets()["kivi-2"].with_(key_rounding="compensated", window=16)
    rep = validate(cfg, CAPTURE, tokens=120, batch=2, steps=3, layers=[0, 15])
    assert rep.ok and all(r.mismatched == 0 and r.rel_rms <= 1e-3 for r in rep.layers), rep


@needs_capture
@pytest.mark.float_order
def test_validate_static_key_moments_agree():
    """A config carrying the capture's static query moments (``key_moments``), keys stored before
    RoPE: every key, the prefill's and those the decode steps quantize (token-group scales, a
    16-token window), rounded under them on both paths, bit for bit. (Post-RoPE keys under static
    moments: tests/gpu/test_kernels_compensated.py.)"""
    pytest.importorskip("zarr")
    from kverr.calibration.objective import capture_key_moments
    from kverr.config import CacheConfig
    from kverr.io import open_capture
    from kverr.quant import PerToken, PerTokenGroup, int_format
    from kverr.quant.compensated import KeyMoments
    from kverr.validation import validate

    ds = open_capture(CAPTURE)
    captured = capture_key_moments(ds)  # of the captured layers; the model's other layers take layer 0's
    at = {int(layer): i for i, layer in enumerate(ds.kv.layers)}
    moments = KeyMoments(captured.packed[[at.get(layer, 0) for layer in range(ds.kv.n_layers)]], captured.head_dim)
    cfg = CacheConfig(k=int_format(3, PerTokenGroup(32), rotate="hadamard"), v=int_format(2, PerToken()), window=16,
                      sinks=4, key_pre_rope=True, key_rounding="compensated", key_moments=moments)
    rep = validate(cfg, CAPTURE, tokens=64, batch=2, steps=2, layers=[15])
    assert rep.ok and all(r.mismatched == 0 and r.rel_rms <= 1e-3 for r in rep.layers), rep
