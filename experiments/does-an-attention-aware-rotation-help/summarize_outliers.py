"""Dense-and-sparse key outliers against plain per-channel widths at equal bits: key damage summed
over layers (option S4/R32) and each variant's bits, an outlier costing a 16-bit value and a 16-bit
index and every token a 32-bit pointer shared by the model's kv heads (KVQuant's CSR count), at the
fraction of held-out key elements the run kept exact.

Usage: python summarize_outliers.py [--heads N_KV_HEADS --head-dim HEAD_DIM] RUN.csv ...
"""
import sys

import pandas as pd

args = sys.argv[1:]
n_kv, d = 3, 64
if args[:1] == ["--heads"]:
    n_kv, d, args = int(args[1]), int(args[3]), args[4:]
runs = pd.concat([pd.read_csv(p, comment="#") for p in args])
frac = runs[runs.option == "outliers"].groupby("variant").damage.mean()
dmg = runs[runs.option == "S4/R32/post"].groupby(["variant", "bits"]).damage.sum()
print("variant,dense_bits,bits,damage")
for (variant, bits), v in dmg.items():
    extra = frac[variant] * 32 + 32 / (n_kv * d) if variant.split("/")[-1].startswith("sparse") else 0.0
    print(f"{variant},{bits:g},{bits + extra:.3f},{v:.4g}")
