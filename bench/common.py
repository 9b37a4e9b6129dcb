"""What every benchmark shares: the machine it ran on, the long results table, the bench captures.

A benchmark module exposes ``measure(quick: bool) -> list[Row]``; :mod:`bench.run` stamps each
row with the benchmark's name, the mode, the machine, the date and the command, and writes them
into :data:`TABLE`, one row per measurement.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
#: The long table: one row per measurement, every benchmark, both modes.
TABLE = RESULTS / "benchmarks.csv"
COLUMNS = ["benchmark", "mode", "case", "metric", "value", "unit", "machine", "date", "command"]
#: Captures the benchmarks make once and reuse (ignored by git, removed by ``make clean``).
WORK = ROOT / "out" / "bench"


class Row(NamedTuple):
    """One measurement. ``value`` is a number, or a label (``unit == "label"``). ``machine`` and
    ``date`` default to the runner's; a benchmark that summarises earlier measurements sets them."""

    case: str
    metric: str
    value: float | str
    unit: str
    machine: str | None = None
    date: str | None = None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def machine(threads: int | None = None) -> str:
    """The processor, its logical CPUs and memory, torch's thread count (``threads`` when another
    process ran the measurement with its own) and the software versions."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{cpu_name()}, {os.cpu_count()} cpus{mem}, {threads} torch threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def pydoc_capture(tokens: int, make: bool = True) -> Path:
    """The first ``tokens`` of pydoc captured from the default model, every layer, made once under
    :data:`WORK` with ``kverr capture --model default --text pydoc --tokens N`` in the reproducible
    float environment (``kverr.capturing.REPRODUCIBLE_FLOAT_ENV``, set before torch starts: a
    subprocess), as ``data/README.md`` documents for the calibration capture (``make=False``: its
    path only)."""
    import subprocess
    import sys

    from kverr.capturing import REPRODUCIBLE_FLOAT_ENV

    path = WORK / f"pydoc-{tokens}.zarr"
    if make and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "kverr.cli", "capture", "--model", "default", "--text", "pydoc",
                        "--tokens", str(tokens), "--out", str(path)],
                       env={**os.environ, **REPRODUCIBLE_FLOAT_ENV}, check=True)
    return path
