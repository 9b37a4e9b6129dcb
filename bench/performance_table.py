"""The predicted-speedup tables of ``docs/performance.md``, rendered from :mod:`kverr.cost`.

    .venv/bin/python -m bench.performance_table            # print both tables
    .venv/bin/python -m bench.performance_table --check    # exit 1 unless the docs hold them

Predictions, not measurements: ``kverr plan`` on an H200 with CUDA graphs / eager launches, at the
contexts and batches of :data:`POINTS`; the presets on the Llama-3-8B attention shape, the
calibrated configs on the bundled model's.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import ROOT

POINTS = ((4096, 1), (32768, 1), (32768, 16), (131072, 16), (131072, 64))
LLAMA_PRESETS = ("int8-token", "vllm-int8-per-token-head", "fp8-e4m3-head", "q4_0", "nvfp4", "mxfp4", "int4-token-g64",
                 "kivi-4", "kivi-2")
MODEL_PRESETS = ("int8-token", "q4_0", "kivi-2")
MODEL_CONFIGS = ("3b", "3b-g2", "3b-g1", "4.5b", "4.5b-g2", "4.5b-g1", "5b", "8b")
DOC = ROOT / "docs" / "performance.md"


def llama_shape():
    from kverr.memory import ModelShape

    return ModelShape(32, 8, 128, name="Llama-3-8B attention", n_q_heads=32)


def _table(first: str, named) -> str:
    from kverr.cost import speedups

    head = f"| {first} | " + " | ".join(f"{t // 1024}k, batch {b}" for t, b in POINTS) + " |"
    lines = [head, "|---|" + "---:|" * len(POINTS)]
    tokens, batches = sorted({t for t, _ in POINTS}), sorted({b for _, b in POINTS})
    for name, cfg, shape in named:
        g = speedups(cfg, shape, tokens=tokens, batches=batches, graphs=True)
        e = speedups(cfg, shape, tokens=tokens, batches=batches, graphs=False)
        lines.append(f"| {name} | " + " | ".join(f"{g[p]:.2f}× / {e[p]:.2f}×" for p in POINTS) + " |")
    return "\n".join(lines) + "\n"


def render() -> list[str]:
    """The two tables: presets on the Llama shape, presets and calibrated configs on the bundled model."""
    from kverr.config import CacheConfig, named_presets
    from kverr.memory import DEFAULT_SHAPE

    presets = named_presets()
    llama = llama_shape()
    cfgs = [CacheConfig.load(ROOT / "data" / "configs" / f"calibrated-{c}.json") for c in MODEL_CONFIGS]
    return [_table("preset", [(n, presets[n], llama) for n in LLAMA_PRESETS]),
            _table("config", [(n, presets[n], DEFAULT_SHAPE) for n in MODEL_PRESETS]
                   + [(c.name, c, DEFAULT_SHAPE) for c in cfgs])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help=f"exit 1 unless {DOC.relative_to(ROOT)} holds the tables")
    args = ap.parse_args(argv)
    tables = render()
    if not args.check:
        sys.stdout.write("\n".join(tables))
        return 0
    text = DOC.read_text(encoding="utf-8")
    stale = [t for t in tables if t not in text]
    for t in stale:
        sys.stderr.write(f"{DOC.relative_to(ROOT)} does not hold:\n{t}\n")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
