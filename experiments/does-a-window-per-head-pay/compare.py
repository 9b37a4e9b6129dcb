"""Paired held-out comparison of two configs measured on the same segments.

Usage: python compare.py A.csv B.csv   (the CSVs ``decode_salient.py`` writes, ``--keep 0``)

Prints each config's mean KL (standard error over segments) and top-1 agreement, then B against
A: the ratio of mean KLs, on how many segments B is lower, and the mean paired log-ratio of the
segments' KLs with its standard error. Refuses CSVs whose segments or reference perplexities
differ (they were not measured on the same tokens).
"""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd


def main(a_path: str, b_path: str) -> None:
    a, b = (pd.read_csv(p).sort_values("segment").reset_index(drop=True) for p in (a_path, b_path))
    if list(a.segment) != list(b.segment) or not np.allclose(a.ppl_ref, b.ppl_ref, rtol=1e-9):
        raise SystemExit("the two CSVs are not the same segments with the same reference perplexities")
    n = len(a)
    for name, d in ((a_path, a), (b_path, b)):
        print(f"{name}: {d.config[0]} bits {d.bits[0]:.4f} mean KL {d.mean_kl.mean():.5f} "
              f"(s.e. {d.mean_kl.std(ddof=1) / np.sqrt(n):.5f}) top-1 {d.top1.mean():.4f} over {n} segments")
    lr = np.log(b.mean_kl.to_numpy() / a.mean_kl.to_numpy())
    print(f"B/A: ratio {b.mean_kl.mean() / a.mean_kl.mean():.3f}, lower on {int((lr < 0).sum())} of {n} "
          f"({np.exp(lr.min()):.2f}-{np.exp(lr.max()):.2f}), paired log-ratio {lr.mean():+.3f} "
          f"(s.e. {lr.std(ddof=1) / np.sqrt(n):.3f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
