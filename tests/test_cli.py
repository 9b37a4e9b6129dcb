"""The `kverr` command: help, presets, memory, and bad input as one line and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kverr.cli import build_parser, main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_and_explains_every_subcommand(capsys):
    parser = build_parser()
    text = parser.format_help()
    for name in ("presets", "memory", "demo"):
        assert name in text
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--help"])
    assert exc.value.code == 0
    assert "payload, scales, zero points" in capsys.readouterr().out


def test_presets_lists_every_preset_with_effective_bits(capsys):
    from kverr.config import PRESETS
    from kverr.memory import DEFAULT_SHAPE, account

    code, out, _ = run(capsys, "presets")
    assert code == 0
    for name, cfg in PRESETS.items():
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert f"{account(cfg, DEFAULT_SHAPE, 4096).effective_bits:.3f}" in line
    # the peers evaluate runs beside them are named, each once
    from kverr.evaluation import EMULATED, PEERS

    peers = out.splitlines()[-1]
    names = re.findall(r"[\w.\-]+", peers)  # whole names: "oscar-int2" is not counted in "oscar-int2-s4r32"
    assert peers.startswith("peers") and all(names.count(p) == 1 for p in (*PEERS, *EMULATED))


def test_presets_show_prints_loadable_json(capsys, tmp_path):
    from kverr.config import PRESETS, CacheConfig

    code, out, _ = run(capsys, "presets", "--show", "kivi-2")
    assert code == 0 and CacheConfig.from_json(out) == PRESETS["kivi-2"]


def test_memory_json_and_table(capsys):
    code, out, _ = run(capsys, "memory", "kivi-2", "--tokens", "1000", "--json")
    assert code == 0
    rep = json.loads(out)
    assert rep["tokens"] == 1000 and len(rep["layers"]) == 30
    assert rep["total_bytes"] == sum(l["k"]["total"] + l["v"]["total"] for l in rep["layers"])
    code, out, _ = run(capsys, "memory", "q4_0", "--shape", "2,4,128", "--tokens", "100", "--batch", "3", "--page-size", "16")
    assert code == 0 and "seed formula" in out and out.count("\n") >= 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["memory", "kivi-9", "--tokens", "10"], "neither a preset nor a config file"),
        (["memory", "kivi-2", "--tokens", "10", "--page-size", "48"], "does not fit whole pages"),
        (["memory", "q4_0", "--shape", "2,2,80", "--tokens", "10"], "does not divide the head dimension 80"),
        (["memory", "q4_0", "--model", "/nonexistent/model", "--tokens", "10"], "not found"),
        (["memory", "q4_0", "--shape", "2,2", "--tokens", "10"], "LAYERS,KV_HEADS,HEAD_DIM"),
        (["memory", "kivi-2", "--tokens", "10", "--refit-widths"], "no format of this config has per-channel widths"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_installed_command_has_no_traceback_on_bad_config(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text('{"version": 1, "k": {"dtype": "int", "bits": 4, "colour": 1}, "v": {"dtype": "fp16"}}')
    proc = subprocess.run(
        [sys.executable, "-m", "kverr.cli", "memory", str(bad), "--tokens", "8"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "unknown field k.colour; allowed fields: bits, channel_bits, clip, codebook, dtype, encode_with, fixed_scale, "
        "granularity, reciprocal, rotate, rounding, scale_dtype, scale_floor, scale_rounding, scale_stat, symmetric")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [
    ["frob"], [], ["memory", "kivi-2", "--tokens", "x"], ["validate", "kivi-2", "--capture", "c", "--tol", "nan"],
    ["calibrate", "--budget-bits", "4"],
])
def test_argument_errors_are_one_line_naming_the_help(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert err.startswith("kverr") and ": error: " in err and err.rstrip().endswith("--help)")
