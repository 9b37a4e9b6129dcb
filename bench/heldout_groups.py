"""Held out: what bounding the (K, V) format pairs per layer costs, and what it buys in
predicted decode time (``docs/performance.md``).

The 3- and 4.5-bit calibrations with at most one or two pairs per layer
(``data/configs/calibrated-{3,4.5}b-g{1,2}.json``) are evaluated as :mod:`bench.heldout`
evaluates the unconstrained ones, on the stdlib's ``typing.py`` (Python 3.11), one torch thread::

    kverr evaluate --threads 1 --greedy 0 --text <python 3.11 lib>/typing.py --offset 0 \\
        --prefill 1024 --decode 256 --segments 8 \\
        --config data/configs/calibrated-3b-gN.json --config data/configs/calibrated-4.5b-gN.json \\
        --out heldout-gN.csv

(N = 1, 2; their per-segment rows, stamped with machine and date, are
``bench/results/heldout-groups.segments.csv``). ``python -m bench.heldout_groups`` prints the
table from the committed rows, beside the unconstrained configs' rows of
``bench/results/heldout.segments.csv``, with each config's predicted KL (its provenance) and its
predicted decode speedup over fp16 from :mod:`kverr.cost` (CUDA graphs, H200).
"""

from __future__ import annotations

import sys

from bench.common import RESULTS, ROOT

SEGMENTS_CSV = RESULTS / "heldout-groups.segments.csv"
BUDGETS = ("3", "4.5")
#: (tokens, batch) of the predicted speedups shown.
AT = ((32768, 16), (131072, 16))


def table() -> str:
    import pandas as pd

    from kverr.config import CacheConfig
    from kverr.cost import speedups
    from kverr.memory import DEFAULT_SHAPE

    seg = pd.concat([pd.read_csv(RESULTS / "heldout.segments.csv"), pd.read_csv(SEGMENTS_CSV)])
    head = ("| config | format pairs per layer | effective bits | mean KL, 8 segments (s.e.) | top-1 | predicted KL | "
            + " | ".join(f"predicted speedup, {t // 1024}k x {b}" for t, b in AT) + " |")
    lines = [head, "|---|---|---:|---:|---:|---:|" + "---:|" * len(AT)]
    for b in BUDGETS:
        for suffix, bound in (("", "up to 3"), ("-g2", "at most 2"), ("-g1", "1")):
            name = f"calibrated-{b}b{suffix}"
            cfg = CacheConfig.load(ROOT / "data" / "configs" / f"{name}.json")
            g = seg[seg.scheme == name]
            n = g["segment"].nunique()
            sp = speedups(cfg, DEFAULT_SHAPE, tokens=[t for t, _ in AT], batches=sorted({b for _, b in AT}))
            lines.append(
                f"| {name} | {bound} | {g['effective_bits'].iloc[0]:.2f} | {g['mean_kl'].mean():#.3g} "
                f"({g['mean_kl'].std(ddof=1) / n ** 0.5:#.2g}) | {g['top1'].mean():.3f} | "
                f"{cfg.provenance['predicted_damage']:#.3g} | " + " | ".join(f"{sp[p]:.2f}x" for p in AT) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
