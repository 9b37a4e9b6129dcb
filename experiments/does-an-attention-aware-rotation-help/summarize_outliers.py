"""Dense-and-sparse key outliers against plain per-channel widths at equal bits: key damage summed
over layers (option S4/R32) and each variant's bits, an outlier costing a 16-bit value and a 16-bit
index and every token a 32-bit pointer shared by the model's kv heads (KVQuant's CSR count), at the
fraction of held-out key elements the run kept exact.

Usage: python summarize_outliers.py OUTLIERS.csv PLAIN_AT_MORE_BITS.csv [N_KV_HEADS HEAD_DIM]
"""
import sys

import pandas as pd

n_kv, d = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (3, 64)
runs = pd.concat([pd.read_csv(p, comment="#") for p in sys.argv[1:3]])
frac = runs[runs.option == "outliers"].groupby("variant").damage.mean()
dmg = runs[runs.option == "S4/R32/post"].groupby(["variant", "bits"]).damage.sum()
print("variant,dense_bits,bits,damage")
for (variant, bits), v in dmg.items():
    extra = frac[variant] * 32 + 32 / (n_kv * d) if variant.endswith("/sparse") else 0.0
    print(f"{variant},{bits:g},{bits + extra:.3f},{v:.4g}")
