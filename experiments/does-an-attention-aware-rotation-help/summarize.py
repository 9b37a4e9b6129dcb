"""Totals of rotation_damage.py's output over layers: damage per variant and mean bits, for the
S4/R32 option (4 fp16 sinks, 32-token window, as the committed 2.5-bit config), and per layer how
often the query-weighted widths beat plain squared error.

Usage: python summarize.py result-2026-12-02.csv
"""
import sys

import pandas as pd

d = pd.read_csv(sys.argv[1], comment="#")
d = d[d.option == "S4/R32/post"]
print(d.pivot_table(index=["side", "variant"], columns=["bits"], values="damage", aggfunc="sum")
      .to_string(float_format=lambda x: f"{x:.3g}"))
p = d.pivot_table(index=["layer"], columns=["side", "variant", "bits"], values="damage")
for b in sorted(d.bits.unique()):
    r = p[("k", "pre/id/q", b)] / p[("k", "pre/id/mse", b)]
    print(f"{b} bits: pre/id/q below pre/id/mse in {(r < 1).sum()} of {len(r)} layers, median ratio {r.median():.2f}")
