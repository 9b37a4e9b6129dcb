"""Fixtures of the calibration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory):
    """``(capture, its path, the loaded model)``: 160 tokens of pydoc on a tiny random llama."""
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.capturing.tiny import make_tiny_model
    from kverr.io import open_capture

    d = tmp_path_factory.mktemp("cal")
    loaded = load_model(str(make_tiny_model(d / "m", "llama")))
    text = load_text("pydoc")
    ids = tokenize(loaded.tokenizer, text, 160, 0)
    path = capture_to_zarr(loaded, ids, d / "cap.zarr", text=text)
    return open_capture(path), path, loaded
