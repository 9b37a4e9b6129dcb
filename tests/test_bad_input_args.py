"""Bad arguments, wrong messages and missing progress, as a new user meets them: one line on
stderr, a non-zero exit, nothing half-written, and checks made before long work."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kverr.cli import build_parser, main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_argparse(capsys, *argv):
    """An argparse refusal: exit status 2 and the error as the last line."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert exc.value.code == 2
    return err.strip().splitlines()[-1]


def one_line_error(code, err):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def no_work(*_a, **_k):
    raise AssertionError("long work started before the arguments were checked")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (3 layers, 2 kv heads, head dim 64), its captures of every layer
    (160 tokens) and of layers 0 and 2, and a text file."""
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.capturing.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("bad")
    model = make_tiny_model(d / "m", "llama")
    loaded = load_model(str(model))
    text = load_text("pydoc")
    full = capture_to_zarr(loaded, tokenize(loaded.tokenizer, text, 160, 0), d / "cap.zarr", text=text)
    part = capture_to_zarr(loaded, tokenize(loaded.tokenizer, text, 48, 0), d / "part.zarr", text=text,
                           layers=[0, 2])
    short = capture_to_zarr(loaded, tokenize(loaded.tokenizer, text, 16, 0), d / "short.zarr", text=text)
    words = d / "words.txt"
    words.write_text(" ".join(["cache key value softmax token layer head scale bits error"] * 60))
    return dict(model=model, loaded=loaded, cap=full, part=part, short=short, words=words, dir=d)


def _damaged(tiny, tmp_path, name, index, value):
    """A copy of the full capture with ``value`` written at ``index`` of variable ``name``."""
    from kverr.io import open_capture, write_dataset

    ds = open_capture(tiny["cap"]).load()
    ds[name].values[index] = value
    return write_dataset(ds, tmp_path / f"bad-{name}.zarr")


# 1 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["validate", "kivi-2", "--capture", "x", "--tol", "-1"],
    ["validate", "kivi-2", "--capture", "x", "--tol", "nan"],
    ["validate", "kivi-2", "--capture", "x", "--tol", "0"],
    ["validate", "kivi-2", "--capture", "x", "--tol", "inf"],
    ["calibrate", "--capture", "x", "--out", "c.json", "--budget-bits", "inf"],
    ["calibrate", "--capture", "x", "--out", "c.json", "--budget-bits", "4,nan"],
    ["calibrate", "--capture", "x", "--out", "c.json", "--budget-bits", "4", "--max-bits", "nan"],
    ["demo", "--budget", "-1"],
])
def test_float_options_must_be_finite_and_positive(capsys, argv):
    last = run_argparse(capsys, *argv)
    assert "error: argument" in last and ("finite" in last), last


# 2 -----------------------------------------------------------------------------------------------

def test_counts_out_of_range_are_refused_before_any_computation(tiny, tmp_path, capsys, monkeypatch):
    import kverr.calibration.search as search
    import kverr.error.xr as xr_mod

    monkeypatch.setattr(search, "score", no_work)
    monkeypatch.setattr(search, "check_capture_model", no_work)
    monkeypatch.setattr(xr_mod, "compute", no_work)
    out = tmp_path / "c.json"
    err = one_line_error(*run(capsys, "calibrate", "--capture", tiny["cap"], "--budget-bits", "4", "--out", out,
                              "--queries", "100000000")[::2])
    assert "give 1..140" in err and "160-token capture" in err
    err = one_line_error(*run(capsys, "calibrate", "--capture", tiny["dir"] / "missing.zarr", "--budget-bits", "4,5",
                              "--out", tmp_path / "c{bits}.json", "--max-bits", "4.5")[::2])
    assert "--max-bits 4.5 is below the budget of 5 bits" in err  # before the capture is even opened
    dec = tmp_path / "d.zarr"
    err = one_line_error(*run(capsys, "decompose", "--capture", tiny["cap"], "--config", "kivi-2", "--out", dec,
                              "--topk", "161")[::2])
    assert "topk=161" in err and "give 1..160" in err
    err = one_line_error(*run(capsys, "decompose", "--capture", tiny["cap"], "--config", "kivi-2", "--out", dec,
                              "--queries", "1000")[::2])
    assert "--queries 1000 exceeds the capture's 160 tokens; give 1..160" in err
    assert not out.exists() and not dec.exists()


# 3 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, index, value, where", [
    ("v", (0, 1, 70, 0), np.inf, "layer 0, kv_head 1, token 70, channel 0"),
    ("k", (2, 0, 5, 63), np.nan, "layer 2, kv_head 0, token 5, channel 63"),
    ("q", (1, 3, 100, 7), -np.inf, "layer 1, q_head 3, token 100, channel 7"),
])
def test_non_finite_values_are_named_by_variable_and_coordinates(tiny, tmp_path, capsys, name, index, value, where):
    from kverr.exceptions import NonFiniteError
    from kverr.io import check_finite, open_capture

    bad = _damaged(tiny, tmp_path, name, index, value)
    err = one_line_error(*run(capsys, "calibrate", "--capture", bad, "--budget-bits", "4",
                              "--out", tmp_path / "c.json", "--objective", "rel", "--workers", "1")[::2])
    assert f"the capture's {name!r} holds 1 NaN/Inf value(s), the first at {where}" in err
    # decompose and validate name it the same way, before their work
    for argv in (["decompose", "--capture", bad, "--config", "kivi-2", "--out", tmp_path / "d.zarr"],
                 ["validate", "kivi-2", "--capture", bad, "--tokens", "80", "--batch", "2", "--steps", "1"]):
        err = one_line_error(*run(capsys, *argv)[::2])
        assert f"the capture's {name!r} holds 1 NaN/Inf value(s), the first at {where}" in err
    assert not (tmp_path / "d.zarr").exists()
    # a selection keeps the model's layer indices
    ds = open_capture(bad)
    if index[0] == 2:
        with pytest.raises(NonFiniteError, match="layer 2, kv_head 0"):
            check_finite(ds.isel(layer=[2]))
    check_finite(ds.isel(layer=[l for l in range(3) if l != index[0]]))  # the rest is fine


# 4 -----------------------------------------------------------------------------------------------

def test_calibrate_refuses_nan_before_scoring_and_sensitivity(tiny, tmp_path, capsys, monkeypatch):
    import kverr.calibration.search as search

    monkeypatch.setattr(search, "score", no_work)
    monkeypatch.setattr(search, "check_capture_model", no_work)
    bad = _damaged(tiny, tmp_path, "k", (1, 1, 30, 2), np.nan)
    out = tmp_path / "c.json"
    err = one_line_error(*run(capsys, "calibrate", "--capture", bad, "--budget-bits", "4", "--out", out)[::2])
    assert "'k' holds 1 NaN/Inf" in err and "layer 1, kv_head 1, token 30, channel 2" in err
    assert "costs must be" not in err and not out.exists()


# 5 -----------------------------------------------------------------------------------------------

def test_layers_are_layer_indices_in_every_command(tiny, tmp_path, capsys, monkeypatch):
    import kverr.validation as kv
    from kverr.commands._common import parse_layers
    from kverr.exceptions import ConfigError

    assert parse_layers("0-2,5") == [0, 1, 2, 5] and parse_layers("all") is None
    with pytest.raises(ConfigError, match="runs backwards"):
        parse_layers("3-1")
    seen = {}

    def spy(config, q, k, v, kv_map, *, layers=None, **kw):
        seen["layers"] = layers
        raise AssertionError("stop here")

    monkeypatch.setattr(kv, "validate_arrays", spy)
    with pytest.raises(AssertionError, match="stop here"):
        main(["validate", "kivi-2", "--capture", str(tiny["part"]), "--tokens", "8", "--batch", "1",
              "--steps", "1", "--layers", "2"])
    assert seen["layers"] == [1]  # layer 2 of the model is the capture's second layer
    want = "layers [1] are not in the capture; it has layers [0, 2]"
    for argv in (["validate", "kivi-2", "--capture", tiny["part"], "--tokens", "8", "--batch", "1",
                  "--steps", "1", "--layers", "1"],
                 ["decompose", "--capture", tiny["part"], "--config", "kivi-2", "--out", tmp_path / "d.zarr",
                  "--layers", "1"]):
        err = one_line_error(*run(capsys, *argv)[::2])
        assert want in err
    code, out, _ = run(capsys, "decompose", "--capture", tiny["part"], "--config", "kivi-2", "--out",
                       tmp_path / "d2.zarr", "--layers", "2", "--queries", "8", "--no-progress")
    assert code == 0 and "\n    2 " in out


# 6 -----------------------------------------------------------------------------------------------

def test_presets_marks_the_presets_that_do_not_fit_a_head_dim(capsys):
    code, out, err = run(capsys, "presets", "--shape", "32,32,80")
    assert code == 0 and not err
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "does not fit" not in rows["fp16"] and "16.000" in rows["fp16"]
    assert "does not fit: k.granularity.group=32 does not divide the head dimension 80" in rows["q4_0"]
    assert "does not fit" in rows["kivi-2"] and "does not fit" not in rows["fp8-e4m3-head"]


# 7 -----------------------------------------------------------------------------------------------

def test_short_capture_and_decode_steps_state_the_real_limit(tiny, tmp_path, capsys):
    err = one_line_error(*run(capsys, "calibrate", "--capture", tiny["short"], "--budget-bits", "4",
                              "--out", tmp_path / "c.json", "--queries", "8")[::2])
    assert "model's context" not in err
    assert "more than the 16 tokens at which effective bits are counted (the capture's length, 16 tokens)" in err
    err = one_line_error(*run(capsys, "validate", "kivi-2", "--capture", tmp_path / "missing.zarr",
                              "--tokens", "1", "--steps", "1")[::2])
    assert "1 tokens per sequence leave no prefill before 1 decode step(s)" in err
    assert "at least steps + 1 = 2" in err and "[1, 0]" not in err


# 8 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--scheme", "kivi-3"], "--scheme 'kivi-3' is not known"),
    (["--budget", "0.5"], "budget of 0.5 effective bits is infeasible"),
    (["--eval-text", "/nonexistent/held.txt"], "--eval-text: text file '/nonexistent/held.txt' not found"),
    (["--tokens", "192", "--prefill", "1000", "--decode", "100"], "exceeds the model's context of 1024"),
    (["--tokens", "16", "--queries", "32"], "--queries 32 is more than the 14 positions"),
])
def test_demo_checks_every_argument_before_any_work(tiny, tmp_path, capsys, monkeypatch, extra, message):
    import kverr.capturing as kc

    monkeypatch.setattr(kc, "capture_to_zarr", no_work)
    out = tmp_path / "out"
    err = one_line_error(*run(capsys, "demo", "--model", tiny["model"], "--out", out, "--no-validate", *extra)[::2])
    assert message in err
    for foreign in ("--config", "--text ", "--text,", "--budget-bits"):
        assert foreign not in err
    assert not out.exists()


# 9 -----------------------------------------------------------------------------------------------

def test_evaluate_checks_segment_lengths_first_and_tokenizes_once(tiny, tmp_path, capsys, monkeypatch):
    import kverr.evaluation as ev
    from kverr.capturing import load_text
    from kverr.exceptions import TextError

    monkeypatch.setattr(ev, "teacher_forced", no_work)
    out = tmp_path / "r.csv"
    err = one_line_error(*run(capsys, "evaluate", "--model", tiny["model"], "--text", tiny["words"],
                              "--scheme", "kivi-2", "--prefill", "40", "--decode", "8", "--offset", "0",
                              "--segments", "900", "--out", out)[::2])
    assert "900 segment(s) of prefill 40 + decode 8 + 1 tokens from offset 0 need 44100 tokens" in err
    assert "fit" in err and not out.exists()

    calls = []
    tok = tiny["loaded"].tokenizer

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *a, **k):
            calls.append(1)
            return tok(*a, **k)

    fake = type("L", (), {"tokenizer": Counting(), "max_context": None})()
    jobs = ev.segment_jobs(fake, load_text(str(tiny["words"])), prefill=[20], decode=4, segments=20, offset=0)
    assert len(jobs) == 20 and len(calls) <= 2  # the text once (and the BOS probe), not once per segment
    with pytest.raises(TextError, match="segment 1 of 2"):
        ev.segment_jobs(fake, load_text(str(tiny["words"])), prefill=[2000], decode=4, segments=2, offset=0)


# 10 ----------------------------------------------------------------------------------------------

def test_progress_bars_only_on_a_terminal_through_one_helper(monkeypatch):
    import kverr
    from kverr.progress import progress

    assert progress(range(3)).disable  # pytest's stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not progress(range(3)).disable
    assert progress(range(3), enabled=False).disable
    root = Path(kverr.__file__).parent
    imports_tqdm = re.compile(r"^\s*(from tqdm|import tqdm)", re.M)
    direct = [str(p.relative_to(root)) for p in root.rglob("*.py")
              if p.name != "progress.py" and imports_tqdm.search(p.read_text())]
    assert direct == [], f"tqdm used directly (use kverr.progress.progress): {direct}"


# 11 ----------------------------------------------------------------------------------------------

def test_help_states_the_pipeline_order():
    text = build_parser().format_help()
    assert "capture -> info -> decompose -> calibrate -> (project) -> export -> evaluate -> validate" in text
    assert "presets, memory and plan need no capture" in text and "demo runs the whole pipeline" in text


# 12 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, verbose", [
    (["presets"], False), (["-v", "presets"], True), (["presets", "-v"], True),
    (["calibrate", "--capture", "c", "--budget-bits", "4", "--out", "o", "--verbose"], True),
])
def test_verbose_is_accepted_before_and_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


# 13 and 10 (calibrate draws no bar off a terminal) --------------------------------------------------

def test_calibrate_summary_wording_and_no_bar_clutter(tiny, tmp_path, capsys):
    code, out, err = run(capsys, "calibrate", "--capture", tiny["cap"], "--budget-bits", "4", "--out",
                         tmp_path / "c.json", "--queries", "8", "--workers", "1", "--sinks", "0", "--window", "0")
    assert code == 0, err
    assert "predicted predicted" not in out and "objective predicted_kl = " in out
    assert "\r" not in err


# 14 ----------------------------------------------------------------------------------------------

def test_evaluate_reports_the_bits_of_the_cache_the_run_held(tiny):
    from kverr.capturing.text import Text
    from kverr.config import PRESETS
    from kverr.evaluation import evaluate, parse_schemes
    from kverr.memory import ModelShape, account

    lm = tiny["loaded"]
    text = Text(text=tiny["words"].read_text(), source="words", sha256="0" * 64)
    shape = ModelShape(lm.n_layers, lm.n_kv_heads, lm.head_dim)
    kivi = PRESETS["kivi-2"]
    rows = {}
    for policy in ("all", "window"):
        df = evaluate(lm, text, parse_schemes(["kivi-2", "quanto-int2"]), prefill=[128], decode=8, offset=0,
                      greedy_steps=0, progress=False, prefill_policy=policy)
        rows[policy] = df.set_index("scheme")
    got = rows["all"].loc["kivi-2"]
    # the whole prefill was quantized: 128 tokens at 2 bits (plus metadata), 8 in the window
    assert got["effective_bits"] < 5
    assert got["effective_bits"] == pytest.approx(account(kivi, shape, 136, prefill_quantized=128).effective_bits)
    # the bytes the cache really held agree with the accounting within its page rounding
    assert abs(got["measured_cache_bytes"] - got["cache_bytes"]) < 0.25 * got["cache_bytes"]
    # with the window policy, the 128-token window keeps everything in fp16
    assert rows["window"].loc["kivi-2", "effective_bits"] > 16
    # quanto quantizes its prefill whole whatever the policy
    assert rows["window"].loc["quanto-int2", "effective_bits"] < 5


# 15 ----------------------------------------------------------------------------------------------

def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_calibrate_leaves_no_process_behind(tiny, tmp_path, sig):
    """Layers are scored by dask's local threads inside the calibrate process: killing it while
    it scores, even with SIGKILL, leaves no worker and no resource tracker running."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    err_path = tmp_path / "err.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kverr.cli", "-v", "calibrate", "--capture", str(tiny["cap"]), "--budget-bits",
             "4", "--out", str(tmp_path / "c.json"), "--objective", "rel", "--workers", "2", "--queries", "140",
             "--candidates", "all"],
            stdout=subprocess.DEVNULL, stderr=err_file, env=env, text=True)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and "scoring 3 layers" not in err_path.read_text():
            time.sleep(0.1)
        assert proc.poll() is None, "calibrate ended before it was killed: " + err_path.read_text()
        time.sleep(0.2)  # let the threads get into their layers (scoring takes ~0.7 s on a 2-core Zen 3)
        kids = _children(proc.pid)
        proc.send_signal(sig)
        assert "scored 3 layers" not in err_path.read_text(), "scoring ended before the signal: " + err_path.read_text()
        proc.wait(timeout=60)
        err = err_path.read_text()
        if sig == signal.SIGTERM:
            assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err
        else:
            assert proc.returncode == -signal.SIGKILL
        assert kids == set(), "scoring started processes"
        assert not (tmp_path / "c.json").exists()
    finally:
        for pid in [proc.pid, *kids]:  # a failed run must not leave its processes behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()
