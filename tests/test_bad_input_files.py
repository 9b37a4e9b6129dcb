"""Bad files and outputs: each gives one line on stderr, exit status 2 and nothing half-written.

The captures are small synthetic ones (``test_io.synthetic_capture``), so no model is loaded
except where a command needs one (the tiny random model of :mod:`kverr.capturing.tiny`).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from kverr.cli import main
from kverr.io import write_dataset

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from captures import synthetic_capture  # noqa: E402


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *needles):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def listing(folder):
    return sorted(p.name for p in pathlib.Path(folder).iterdir())


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """A valid 2-layer capture (2 kv heads, head dim 64, 64 tokens) of a 'synthetic' model."""
    ds = synthetic_capture(n_layers=2, n_q=4, n_kv=2, n_tokens=64, head_dim=64)
    ds.attrs["model_n_layers"] = 2
    return write_dataset(ds, tmp_path_factory.mktemp("cap") / "c.zarr")


def model_dir(tmp_path):
    """A model folder (config.json only) of the capture's shape: 2 layers, 2 kv heads, head dim 64."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "hidden_size": 256}))
    return model


def damaged_copy(capture, dest):
    """A copy of ``capture`` whose first chunk of ``k`` is truncated."""
    import shutil

    shutil.copytree(capture, dest)
    chunk = next(p for p in sorted((dest / "k").rglob("*")) if p.is_file() and "c" in p.parts)
    chunk.write_bytes(chunk.read_bytes()[:100])
    return dest


# ---- 1. configs too deep or with too long numbers ----------------------------------------------

CONFIG_READERS = {
    "memory": lambda cfg, cap, out: ["memory", cfg, "--tokens", "8"],
    "decompose": lambda cfg, cap, out: ["decompose", "--capture", cap, "--config", cfg, "--out", out / "d.zarr"],
    "validate": lambda cfg, cap, out: ["validate", cfg, "--capture", cap, "--tokens", "16", "--batch", "1"],
    "export": lambda cfg, cap, out: ["export", cfg, "--format", "hf", "--out", out / "e"],
    "evaluate": lambda cfg, cap, out: ["evaluate", "--config", cfg, "--out", out / "ev.csv"],
}


@pytest.mark.parametrize("kind", ["nested", "long_int"])
@pytest.mark.parametrize("command", sorted(CONFIG_READERS))
def test_unreadable_config_json_is_a_config_error_naming_the_file(capsys, tmp_path, capture, command, kind):
    cfg = tmp_path / "bad.json"
    if kind == "nested":
        cfg.write_text("[" * 5000 + "]" * 5000)
        needle = "nested too deeply"
    else:
        cfg.write_text('{"version": 1, "k": {"dtype": "fp16"}, "v": {"dtype": "fp16"}, "window": '
                       + "9" * 5001 + "}")
        needle = "too long to read"
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run(capsys, *CONFIG_READERS[command](cfg, capture, out))
    one_line_error(code, err, str(cfg), needle)
    assert listing(out) == []


# ---- 2. a damaged chunk ------------------------------------------------------------------------

DATA_READERS = {
    "decompose": lambda cap, out: ["decompose", "--capture", cap, "--config", "kivi-4", "--out", out / "d.zarr",
                                   "--no-progress"],
    "calibrate": lambda cap, out: ["calibrate", "--capture", cap, "--budget-bits", "4", "--objective", "rel",
                                   "--workers", "1", "--queries", "4", "--sinks", "0", "--window", "0",
                                   "--out", out / "c.json"],
    "export": lambda cap, out: ["export", "fp8-e4m3-head", "--format", "vllm", "--capture", cap,
                                "--model", "capture", "--out", out / "e"],
    "validate": lambda cap, out: ["validate", "fp16", "--capture", cap, "--tokens", "16", "--batch", "1",
                                  "--steps", "1"],
}


@pytest.mark.parametrize("command", sorted(DATA_READERS))
def test_a_damaged_capture_chunk_is_a_capture_error(capsys, tmp_path, capture, command):
    bad = damaged_copy(capture, tmp_path / "bad.zarr")
    assert main(["info", str(bad)]) == 0  # metadata alone is intact
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    argv = DATA_READERS[command](bad, out)
    if "capture" in argv:  # export: the model is the capture's shape
        argv[argv.index("capture")] = model_dir(tmp_path)
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, str(bad), "damaged", "capture it again")
    assert listing(out) == []


# ---- 3. a damaged zarr.json: the error line alone ------------------------------------------------

def test_a_damaged_zarr_json_prints_one_line_without_asyncio_reports(tmp_path, capture):
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(capture, bad)
    for name in ("q", "k", "k_pre", "v"):  # several failing concurrent reads
        (bad / name / "zarr.json").write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "kverr.cli", "info", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot open" in proc.stderr and str(bad) in proc.stderr


# ---- 4. an unreadable capture --------------------------------------------------------------------

@pytest.mark.parametrize("command, what", [("info", "folder"), ("decompose", "folder"), ("decompose", "chunks")])
def test_an_unreadable_capture_is_one_clean_line(capsys, monkeypatch, tmp_path, capture, command, what):
    """Permissions are simulated (root reads everything): the store's folder cannot be listed
    (as after ``chmod 000`` on it), or the chunks of its data variables cannot be opened (as
    after ``chmod 000`` on them; its metadata and coordinates stay readable)."""
    import shutil

    cap = tmp_path / "c.zarr"
    shutil.copytree(capture, cap)
    real_is_file, real_read = pathlib.Path.is_file, pathlib.Path.read_bytes

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    if what == "folder":
        monkeypatch.setattr(pathlib.Path, "is_file",
                            lambda self: denied(self) if self.parent == cap else real_is_file(self))
    else:
        monkeypatch.setattr(pathlib.Path, "read_bytes",  # chunks are VAR/c/...
                            lambda self: denied(self) if cap in self.parents
                            and self.relative_to(cap).parts[0] in ("q", "k", "k_pre", "v")
                            and self.relative_to(cap).parts[1:2] == ("c",) else real_read(self))
    out = tmp_path / "out"
    out.mkdir()
    argv = ["info", cap] if command == "info" else \
        ["decompose", "--capture", cap, "--config", "kivi-4", "--out", out / "d.zarr", "--no-progress"]
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, str(cap), "Permission denied")
    assert listing(out) == []


# ---- 5. an output folder that cannot be written: refused before any work -----------------------

def _no_work(monkeypatch):
    """Make every long step fail loudly, so a refusal must come before it."""
    import kverr.capturing
    import kverr.io

    def forbidden(*a, **k):
        raise AssertionError("work started before the output was checked")

    monkeypatch.setattr(kverr.capturing, "load_model", forbidden)
    monkeypatch.setattr(kverr.io, "open_capture", forbidden)


OUTPUT_WRITERS = {
    # command -> (argv given the output path, whether --out is a file)
    "capture": lambda p, cap: ["capture", "--out", p / "c.zarr"],
    "decompose": lambda p, cap: ["decompose", "--capture", cap, "--config", "kivi-4", "--out", p / "d.zarr"],
    "calibrate": lambda p, cap: ["calibrate", "--capture", cap, "--budget-bits", "4", "--out", p / "c.json"],
    "evaluate": lambda p, cap: ["evaluate", "--scheme", "kivi-4", "--out", p / "ev.csv"],
    "export": lambda p, cap: ["export", "int4-token-g64", "--format", "hf", "--out", p / "hf"],
    "demo": lambda p, cap: ["demo", "--out", p / "demo"],
}


@pytest.mark.parametrize("how", ["read_only", "parent_is_a_file"])
@pytest.mark.parametrize("command", sorted(OUTPUT_WRITERS))
def test_an_unwritable_output_is_refused_before_any_work(capsys, monkeypatch, tmp_path, capture, command, how):
    import tempfile

    folder = tmp_path / "out"
    if how == "parent_is_a_file":
        folder.write_text("a file where a folder is needed")
        needle = "is a file, not a folder"
    else:
        # root writes into a chmod 555 folder, so the refusal of the folder is simulated
        folder.mkdir()
        real = tempfile.mkstemp

        def read_only(*a, dir=None, **k):
            if dir is not None and pathlib.Path(dir) == folder:
                raise PermissionError(13, "Permission denied", str(dir))
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "mkstemp", read_only)
        needle = "not writable"
    before = listing(tmp_path)
    _no_work(monkeypatch)
    code, _, err = run(capsys, *OUTPUT_WRITERS[command](folder, capture))
    one_line_error(code, err, "cannot write", str(folder), needle)
    assert listing(tmp_path) == before
    if folder.is_dir():
        assert listing(folder) == []


@pytest.mark.parametrize("writer", ["store", "file", "replacing"])
def test_a_write_that_fails_late_is_one_line_and_leaves_nothing(capsys, monkeypatch, tmp_path, capture, writer):
    """Permissions changed or the disk filled after the up-front check: a clean error, and no
    temporary, output or folder made for it is left (an output being replaced stays as it was)."""
    import errno
    import os

    import xarray as xr

    full = OSError(errno.ENOSPC, "No space left on device")
    out = tmp_path / "new" / "sub"
    if writer == "replacing":
        argv = ["export", "int4-token-g64", "--format", "hf", "--out", tmp_path / "hf", "--overwrite"]
        assert run(capsys, *argv)[0] == 0
        before = (tmp_path / "hf" / "generation_config.json").read_text()
        real_rename = os.rename

        def rename(src, dst):
            if ".tmp-" in str(src) and pathlib.Path(dst) == tmp_path / "hf":
                raise OSError(errno.EACCES, "Permission denied")
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        code, _, err = run(capsys, *argv)
        one_line_error(code, err, "cannot write", "Permission denied", "nothing was written")
        assert listing(tmp_path) == ["hf"] and listing(tmp_path / "hf") == ["generation_config.json"]
        assert (tmp_path / "hf" / "generation_config.json").read_text() == before
        return
    if writer == "store":
        real = xr.Dataset.to_zarr

        def half(self, store, *a, **k):
            real(self[["key_rel_mse"]] if "key_rel_mse" in self else self, store, *a, **k)
            raise full

        monkeypatch.setattr(xr.Dataset, "to_zarr", half)
        argv = ["decompose", "--capture", capture, "--config", "kivi-4", "--out", out / "d.zarr", "--no-progress"]
    else:
        import kverr.io

        def fail(tmp, target, **k):
            assert tmp.exists()  # the file was written in full, beside the target
            raise full

        monkeypatch.setattr(kverr.io, "_replace", fail)
        argv = ["export", "int4-token-g64", "--format", "hf", "--out", out / "hf"]
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, "cannot write", "No space left on device", "nothing was written")
    assert listing(tmp_path) == []


# ---- 6. --out naming a folder, for outputs that are files ---------------------------------------

@pytest.mark.parametrize("command", ["calibrate", "calibrate-frontier", "evaluate"])
def test_out_naming_a_folder_is_refused_up_front(capsys, monkeypatch, tmp_path, capture, command):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep")
    argv = {
        "calibrate": ["calibrate", "--capture", capture, "--budget-bits", "4", "--out", folder],
        "calibrate-frontier": ["calibrate", "--capture", capture, "--budget-bits", "4",
                               "--out", tmp_path / "c.json", "--frontier", folder],
        "evaluate": ["evaluate", "--scheme", "kivi-4", "--out", folder],
    }[command]
    _no_work(monkeypatch)
    code, _, err = run(capsys, *argv, "--overwrite")
    one_line_error(code, err, f"output {folder} is a directory", "give a file path")
    assert listing(tmp_path) == ["results"] and listing(folder) == ["mine.txt"]


# ---- 7. existing outputs: --overwrite, the same rule for side outputs ---------------------------

def test_export_refuses_an_existing_output_unless_overwrite(capsys, tmp_path):
    out = tmp_path / "hf"
    out.write_text("not an export")
    code, _, err = run(capsys, "export", "int4-token-g64", "--format", "hf", "--out", out)
    one_line_error(code, err, f"output {out} already exists", "--overwrite")
    assert out.read_text() == "not an export"
    # --overwrite replaces it, and a previous export, but never a folder of other files
    assert run(capsys, "export", "int4-token-g64", "--format", "hf", "--out", out, "--overwrite")[0] == 0
    assert listing(out) == ["generation_config.json"]
    assert run(capsys, "export", "kivi-4", "--format", "hf", "--out", out)[0] == 2
    assert run(capsys, "export", "q8_0", "--format", "hf", "--out", out, "--overwrite")[0] == 2  # symmetric: refused
    (out / "weights.bin").write_text("precious")
    code, _, err = run(capsys, "export", "int4-token-g64", "--format", "hf", "--out", out, "--overwrite")
    one_line_error(code, err, "holding files other than generation_config.json")
    assert listing(out) == ["generation_config.json", "weights.bin"]
    assert listing(tmp_path) == ["hf"]


def test_demo_refuses_an_out_that_is_a_file(capsys, monkeypatch, tmp_path):
    out = tmp_path / "out"
    out.write_text("mine")
    _no_work(monkeypatch)
    code, _, err = run(capsys, "demo", "--out", out)
    one_line_error(code, err, f"{out} is a file, not a folder")
    assert out.read_text() == "mine" and listing(tmp_path) == ["out"]


@pytest.mark.parametrize("side", ["ev.png", "ev.segments.csv"])
def test_evaluate_side_outputs_obey_the_overwrite_rule(capsys, monkeypatch, tmp_path, side):
    (tmp_path / side).write_text("earlier result")
    _no_work(monkeypatch)
    code, _, err = run(capsys, "evaluate", "--scheme", "kivi-4", "--out", tmp_path / "ev.csv")
    one_line_error(code, err, f"output {tmp_path / side} already exists", "--overwrite")
    assert listing(tmp_path) == [side] and (tmp_path / side).read_text() == "earlier result"


# ---- 8. a capture without tokens ----------------------------------------------------------------

@pytest.mark.parametrize("command", ["decompose", "info", "export", "validate"])
def test_a_capture_with_no_tokens_is_a_clear_error(capsys, tmp_path, command):
    ds = synthetic_capture(n_layers=2, n_q=4, n_kv=2, n_tokens=0, head_dim=64)
    empty = tmp_path / "empty.zarr"
    ds.to_zarr(empty, consolidated=False)  # write_dataset itself refuses to write it
    out = tmp_path / "out"
    out.mkdir()
    argv = {
        "decompose": ["decompose", "--capture", empty, "--config", "kivi-4", "--out", out / "d.zarr"],
        "info": ["info", empty],
        "export": ["export", "fp8-e4m3-head", "--format", "vllm", "--capture", empty, "--out", out / "e"],
        "validate": ["validate", "fp16", "--capture", empty],
    }[command]
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, f"{empty} holds no tokens", "--tokens")
    assert listing(out) == []


# ---- 9. exports are all or nothing --------------------------------------------------------------

@pytest.mark.parametrize("failure", ["nan", "truncated", "scales_not_written"])
def test_a_failed_vllm_export_leaves_nothing(capsys, monkeypatch, tmp_path, capture, failure):
    import shutil

    import numpy as np
    import xarray as xr

    model = model_dir(tmp_path)
    cap = tmp_path / "cap.zarr"
    if failure == "nan":
        ds = xr.open_zarr(capture, consolidated=False).load()
        ds["k"][1, 0, 5, 3] = np.nan
        write_dataset(ds, cap)
    elif failure == "truncated":
        damaged_copy(capture, cap)
    else:
        shutil.copytree(capture, cap)
        import safetensors.numpy

        def half(tensors, filename, *a, **k):
            pathlib.Path(filename).write_bytes(b"\0" * 10)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.numpy, "save_file", half)
    out = tmp_path / "exports" / "vllm"
    code, _, err = run(capsys, "export", "fp8-e4m3-head", "--format", "vllm", "--capture", cap, "--model", model,
                       "--out", out)
    one_line_error(code, err)
    assert listing(tmp_path) == ["cap.zarr", "model"], "no folder, config.json or temporary may remain"


# ---- 10. temporaries of a killed writer -----------------------------------------------------------

def test_a_rerun_clears_only_the_stale_temporaries_of_its_own_target(tmp_path):
    import signal
    import textwrap

    from kverr.io import temporary_path

    target = tmp_path / "c.zarr"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import xarray as xr
        from kverr.io import write_dataset
        from captures import synthetic_capture
        real = xr.Dataset.to_zarr
        def half(self, store, *a, **k):
            real(self[["q"]], store, *a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        xr.Dataset.to_zarr = half
        write_dataset(synthetic_capture(), {str(target)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (stale,) = tmp_path.iterdir()
    assert stale.name.startswith(".c.zarr.tmp-")
    # temporaries that must stay: a live writer's (this process), another target's, a user's file
    live = temporary_path(target)
    live.mkdir()
    other = stale.with_name(stale.name.replace(".c.zarr.", ".d.zarr."))
    other.mkdir()
    users = tmp_path / ".c.zarr.tmp-notes"
    users.write_text("mine")
    write_dataset(synthetic_capture(), target)
    assert listing(tmp_path) == sorted([".c.zarr.tmp-notes", live.name, other.name, "c.zarr"])


# ---- 11. a config calibrated on another model ---------------------------------------------------

@pytest.fixture
def foreign_config(tmp_path):
    """kivi-4 as if calibrated on a capture of a 30-layer model with other weights."""
    from kverr.config import PRESETS

    cfg = PRESETS["kivi-4"].with_(name="calibrated-elsewhere", provenance={"capture": {
        "model_id": "other/model", "weights_sha256": "f" * 64, "n_layers": 30, "n_kv_heads": 3, "head_dim": 64}})
    return cfg.save(tmp_path / "foreign.json")


@pytest.mark.parametrize("command", ["decompose", "validate", "memory", "export-vllm", "export-hf", "evaluate"])
def test_a_config_calibrated_on_another_model_is_refused(capsys, monkeypatch, tmp_path, capture, foreign_config,
                                                         command):
    model = model_dir(tmp_path)  # a model of the capture's shape
    out = tmp_path / "out"
    out.mkdir()
    argv = {
        "decompose": ["decompose", "--capture", capture, "--config", foreign_config, "--out", out / "d.zarr"],
        "validate": ["validate", foreign_config, "--capture", capture, "--tokens", "16", "--batch", "1"],
        "memory": ["memory", foreign_config, "--shape", "2,2,64", "--tokens", "100"],
        "export-vllm": ["export", foreign_config, "--format", "vllm", "--capture", capture, "--model", model,
                        "--out", out / "e"],
        "export-hf": ["export", foreign_config, "--format", "hf", "--model", model, "--out", out / "e"],
        "evaluate": ["evaluate", "--config", foreign_config, "--model", model, "--out", out / "ev.csv"],
    }[command]
    import kverr.capturing

    monkeypatch.setattr(kverr.capturing, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, "'calibrated-elsewhere' was calibrated on a capture of 'other/model'",
                   "calibrate on a capture of this model")
    assert listing(out) == []
    # on the model it was calibrated for, the same config is accepted
    if command == "memory":
        assert run(capsys, "memory", foreign_config, "--tokens", "100")[0] == 0
