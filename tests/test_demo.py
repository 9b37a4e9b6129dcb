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
