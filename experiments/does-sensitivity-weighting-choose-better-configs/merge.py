"""Merge the held-out evaluation runs of 2026-11-29 into one per-segment CSV.

Usage::

    python experiments/does-sensitivity-weighting-choose-better-configs/merge.py OUT.csv OLD_PRESETS.segments.csv RUN.segments.csv ...

Rows of ``OLD_PRESETS`` (bench/results/calibrate-heldout.segments.csv, the first, partial run) are kept for
presets and peers only: its calibrated rows were measured with an earlier oracle (Hadamard as a
matrix product, fp32 MSE sums), which none of the presets or peers uses; the calibrated configs
were re-run on the current code. Every run's segment is renumbered by its text offset (offset 0 is
segment 0, offset 1281 = P + N + 1 is segment 1), because a run started at --offset 1281 numbers
its only segment 0. A (scheme, segment) pair measured twice keeps the later file's row.
"""

from __future__ import annotations

import sys

import pandas as pd


def main() -> None:
    out, old, *runs = sys.argv[1:]
    from kverr.config import PRESETS
    from kverr.evaluation import PEERS

    o = pd.read_csv(old)
    frames = [o[o.scheme.isin([*PRESETS, *PEERS])]] + [pd.read_csv(p) for p in runs]
    df = pd.concat(frames, ignore_index=True)
    length = df["prefill"] + df["decode"] + 1
    df["segment"] = (df["offset"] // length).astype(int)
    df = df.drop_duplicates(["scheme", "segment"], keep="last").sort_values(["segment", "effective_bits", "scheme"])
    df.to_csv(out, index=False)
    print(df.groupby("scheme").segment.nunique().to_string())


if __name__ == "__main__":
    main()
