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


def test_predicted_speedups_in_the_docs_and_readme_are_the_cost_models():
    """docs/performance.md's tables and the README's performance figures are what kverr.cost
    predicts today (and the held-out KL the README quotes is the committed rows')."""
    out = subprocess.run([sys.executable, "-m", "bench.performance_table", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import pandas as pd

    from bench.performance_table import llama_shape
    from kverr.config import CacheConfig, named_presets
    from kverr.cost import speedups
    from kverr.memory import DEFAULT_SHAPE

    readme = (ROOT / "README.md").read_text()
    at = dict(tokens=(32768,), batches=(16,))
    p = named_presets()
    for name in ("int8-token", "q4_0", "kivi-2"):
        assert f"{speedups(p[name], llama_shape(), **at)[(32768, 16)]:.2f}× for {name}" in readme, name
    # "at 4k x batch 1 every config is launch-bound and slower than fp16"
    for name in p:
        assert speedups(p[name], llama_shape(), tokens=(4096,), batches=(1,))[(4096, 1)] < 1, name
    cfg = {s: CacheConfig.load(ROOT / "data" / "configs" / f"calibrated-3b{s}.json") for s in ("", "-g2", "-g1")}
    sp = {s: speedups(c, DEFAULT_SHAPE, **at)[(32768, 16)] for s, c in cfg.items()}
    assert f"calibrated-3b is predicted at {sp['']:.2f}×" in readme
    assert f"{round(100 * (sp['-g2'] / sp[''] - 1))} % faster at" in readme
    seg = pd.concat([pd.read_csv(ROOT / "bench/results/heldout.segments.csv"),
                     pd.read_csv(ROOT / "bench/results/heldout-groups.segments.csv")])
    kl = seg.groupby("scheme")["mean_kl"].mean()
    more = round(100 * (kl["calibrated-3b-g1"] / kl["calibrated-3b"] - 1))
    assert f"one pair {round(100 * (sp['-g1'] / sp[''] - 1))} % faster for {more} % more KL" in readme
    # the held-out group-bound table of performance.md, predicted speedups included
    from bench.heldout_groups import table

    assert table() in (ROOT / "docs" / "performance.md").read_text()


def test_retrieval_tables_in_the_docs_are_the_committed_rows():
    """docs/results.md's pass-key tables are what bench.retrieval renders from the committed rows."""
    from bench.retrieval import baseline_table, table

    text = (ROOT / "docs" / "results.md").read_text()
    assert table() in text and baseline_table() in text
