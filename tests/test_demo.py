"""`kverr demo` end to end on a tiny random model with reduced sizes (the real demo: make demo)."""

from __future__ import annotations

import pandas as pd

from kverr.config import CacheConfig


def test_demo_pipeline_on_a_tiny_model(tmp_path):
    from kverr.capturing.tiny import make_tiny_model
    from kverr.commands.demo import run_demo

    model = make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "out"
    text = run_demo(out=out, model=str(model), tokens=192, budget=4.0, prefill=64, decode=8,
                    segments=1, offset=0, schemes=("kivi-4", "quanto-int4"), queries=8, workers=1,
                    validate=False)
    for name in ("capture.zarr", "decompose-kivi-4.txt", "calibrated-4b.json", "frontier.csv",
                 "frontier.png", "choices.csv", "export.txt", "evaluate.csv", "evaluate.png", "summary.txt"):
        assert (out / name).exists(), name
    cfg = CacheConfig.load(out / "calibrated-4b.json")
    assert cfg.provenance["effective_bits"] <= 4.0
    ev = pd.read_csv(out / "evaluate.csv")
    assert set(ev.scheme) == {"kivi-4", "quanto-int4", "calibrated-4b"}
    assert ev.predicted.notna().sum() == 2  # kverr configs get a prediction, the quanto peer not
    assert "vllm:" in text and "hf:" in text and "calibrated-4b" in text


def test_pipeline_on_an_existing_capture_returns_what_it_wrote(tmp_path):
    """run_pipeline (what `kverr demo` runs) on a capture made earlier: the same calibrated config
    as calibrating on it directly, and a typed result naming the files it wrote."""
    from kverr.calibration import CalibrationConfig, calibrate
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.capturing.tiny import make_tiny_model
    from kverr.io import open_capture
    from kverr.pipeline import run_pipeline

    loaded = load_model(str(make_tiny_model(tmp_path / "m", "llama")))
    text = load_text("pydoc")
    cap_path = capture_to_zarr(loaded, tokenize(loaded.tokenizer, text, 160, 0), tmp_path / "cap.zarr", text=text)
    steps = []
    res = run_pipeline(tmp_path / "out", model=str(tmp_path / "m"), capture=cap_path, budget=4.0, prefill=64,
                       decode=8, schemes=("kivi-4",), queries=8, workers=1, validate=False, on_step=steps.append)
    assert res.capture_path == cap_path and not (tmp_path / "out" / "capture.zarr").exists()
    assert res.config == CacheConfig.load(res.config_path) and res.config_path.name == "calibrated-4b.json"
    assert set(res.summary.scheme) == {"kivi-4", "calibrated-4b"} and set(res.exports) == {"vllm", "hf"}
    assert len(steps) == 5 and steps == res.steps and res.validation == "validate: skipped"
    direct = calibrate(open_capture(cap_path), CalibrationConfig(budgets=4.0, context=72, queries=8), workers=1,
                       model=loaded)
    assert direct.config == res.config
