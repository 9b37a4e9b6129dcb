"""``kverr validate`` on the real capture in data/: the kernel path (Triton interpreter on the CPU)
agrees with the reference path; exit status 0 only when they agree; errors are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kverr.cli import main

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "smollm2-pydoc-512.zarr"
needs_capture = pytest.mark.skipif(not CAPTURE.exists(), reason="the data/ capture is not present")


@needs_capture
def test_validate_preset_agrees(capsys):
    pytest.importorskip("zarr")
    code = main(["validate", "kivi-2", "--capture", str(CAPTURE), "--tokens", "150", "--layers", "0,2", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "AGREE" in out and "largest difference" in out and "int2a/ch32/fp16" in out


@needs_capture
def test_validate_json_and_disagreement(capsys, tmp_path):
    pytest.importorskip("zarr")
    code = main(["validate", "int8-token", "--capture", str(CAPTURE), "--tokens", "40", "--batch", "1",
                 "--layers", "1", "--steps", "1", "--tol", "0", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and rep["ok"] is False  # a zero tolerance cannot be met: exit 1, not 0
    assert rep["layers"][0]["mismatched"] == 0 and rep["layers"][0]["rel_rms"] < 1e-3


def test_validate_errors_are_one_line(capsys, tmp_path):
    code = main(["validate", "kivi-2", "--capture", str(tmp_path / "missing.zarr")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no capture" in err
    cfg = tmp_path / "had.json"
    cfg.write_text(json.dumps({"version": 1, "k": {"dtype": "int", "bits": 4, "rotate": "hadamard"},
                               "v": {"dtype": "fp16"}}))
    if CAPTURE.exists():
        pytest.importorskip("zarr")
        code = main(["validate", str(cfg), "--capture", str(CAPTURE), "--tokens", "20", "--batch", "1", "--steps", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "not implemented" in err and err.count("\n") == 1
