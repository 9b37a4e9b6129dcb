"""The README's results table is what ``python -m bench.table`` renders from the long benchmark
table, and the benchmark registry's runner lists what it runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_results_tables_are_rendered_from_the_long_table():
    out = subprocess.run([sys.executable, "-m", "bench.table", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_registry_lists_every_benchmark():
    out = subprocess.run([sys.executable, "-m", "bench.run", "--list"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for name in ("quant", "decompose", "capture", "cache", "calibrate", "heldout"):
        assert out.startswith(name) or f"\n{name} " in out
