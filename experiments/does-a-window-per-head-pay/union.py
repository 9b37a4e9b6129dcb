"""Would a window length per (layer, kv head, K|V) pay, by the calibration objective?

Scores every candidate under every outer option of one sinks count and several window lengths
(one calibration, :func:`kverr.calibration.calibrate`), then solves the knapsack twice per budget:
one option for the whole model (what `kverr calibrate` does), and the union -- each (layer, kv
head, K|V) group picks its format *and* its option, with that option's bytes for the group
(window rows included). The ratio of the two predicted damages bounds what per-head windows could
buy by the objective's own account; the cache and kernels have one window per model, so nothing
here can be measured held out.

Usage (from the repository root):
    PYTHONPATH=. python experiments/does-a-window-per-head-pay/union.py CAPTURE OUT.csv \
        [--budgets 2,2.5,3] [--windows 16,32,64,128] [--queries 32]
"""
from __future__ import annotations

import argparse
import collections
import math
import time

import numpy as np
import pandas as pd

from kverr.calibration import CalibrationConfig, calibrate, solve
from kverr.calibration.search import _costs, _elements, _groups, bits_of, budget_bytes_of
from kverr.exceptions import ConfigError
from kverr.io import open_capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("out")
    ap.add_argument("--budgets", default="2,2.5,3")
    ap.add_argument("--windows", default="16,32,64,128")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    cap = open_capture(a.capture)
    budgets = tuple(float(b) for b in a.budgets.split(","))
    cfg = CalibrationConfig(budgets=budgets, context=a.context, batch=a.batch, refit_widths=True,
                            compensated_keys=True, candidates="fitted", codebooks=True, salient=8,
                            queries=a.queries, sinks=(a.sinks,), windows=tuple(int(w) for w in a.windows.split(",")))
    t0 = time.perf_counter()
    cal = calibrate(cap, cfg, workers=2, progress=True)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s")
    kv = cap.kv
    L, H, D = kv.n_layers, kv.n_kv_heads, kv.head_dim
    rows = []
    # the calibration's own DP range, so that the single-option solve finds the config it wrote
    # (the DP's cost unit, and so its rounding, depends on the range)
    max_bytes = math.ceil(cfg.frontier_bits * _elements(L, H, D, a.context, a.batch) / 8)
    for b in budgets:
        s = cal.searches[cal.budget_search[b]]
        sc, opts = s.scores, s.scores.options
        budget = budget_bytes_of(b, L, H, D, a.context, a.batch)
        per_opt = []  # per option: group keys, damages [group][cand], costs [group][cand]
        for oi, opt in enumerate(opts):
            keys, dmg = _groups(sc, oi, H, s.weights)
            ck, cv = (_costs(c, opt, D, a.context, s.page_size, s.window_dtype, s.align, which=w, batch=a.batch,
                             width_tables=True) for w, c in (("k", sc.cands_k), ("v", sc.cands_v)))
            per_opt.append((keys, dmg, [ck if w == "k" else cv for (_, _, w) in keys]))
        single = []
        for oi, (keys, dmg, costs) in enumerate(per_opt):
            fr = solve(costs, dmg, max_cost=max_bytes)
            try:
                single.append(float(fr.damage[fr.best_within(budget)]))
            except ConfigError:  # this option's cheapest config is above the budget
                single.append(np.inf)
        keys = per_opt[0][0]
        n_c = [len(c) for c in per_opt[0][2]]
        u_cost = [np.concatenate([p[2][g] for p in per_opt]) for g in range(len(keys))]
        u_dmg = [np.concatenate([p[1][g] for p in per_opt]) for g in range(len(keys))]
        fr = solve(u_cost, u_dmg, max_cost=max_bytes)
        i = fr.best_within(budget)
        chosen = fr.choices[i]
        picked = collections.Counter((w, opts[int(c) // n_c[g]].window) for g, ((_, _, w), c) in enumerate(zip(keys, chosen)))
        best = int(np.argmin(single))
        # the single-option knapsack is the calibration's own: it finds the config it wrote
        written = cal.configs[b].provenance["predicted_damage"]
        if not np.isclose(single[best], written, rtol=1e-9):
            print(f"warning: {b} bits: the single-option solve gives {single[best]}, the calibration {written}")
        row = dict(budget=b, bits_union=bits_of(int(fr.cost[i]), L, H, D, a.context, a.batch),
                   best_option=opts[best].label(), predicted_best_option=single[best],
                   predicted_written=written,
                   predicted_union=float(fr.damage[i]), ratio=float(fr.damage[i]) / single[best],
                   **{f"single_{opts[j].label()}": single[j] for j in range(len(opts))},
                   **{f"{w}_R{r}": picked.get((w, r), 0) for w in "kv" for r in sorted({o.window for o in opts})})
        rows.append(row)
        print(row)
        pd.DataFrame(rows).to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
