"""How many candidates would a second scoring on more query positions have to score again?

Scores one layer of a capture with the salient-*b-b8-ck calibration's candidates and outer
options (`kverr calibrate ... --candidates fitted --codebooks --salient 8 --compensated-keys
--context 1280 --batch 8 --refit-widths`) on ``--queries`` positions and on ``--more``
positions, timing each, and counts, for margins m, the candidates whose damage on the first
positions is within (1 + m) times the least damage of any candidate of no more bytes: the ones a
second scoring on ``--more`` positions would have to score again. Counted per (outer option, kv
head) and as unions over them, beside how many entries of the frontier on ``--more`` positions
(the knapsack's Pareto set per option and head) each rule would miss.

    PYTHONPATH=. python experiments/does-sampling-more-queries-pay/frontier.py CAPTURE OUT.csv --layers 2 10 20
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import pandas as pd
import torch

import kverr.accessor  # noqa: F401  (registers ds.kv)
from kverr.calibration.config import CalibrationConfig
from kverr.calibration.knapsack import _pareto
from kverr.calibration.objective import _layer_arrays, prepare_layer, score_layer
from kverr.calibration.search import _costs, _search_candidates, _search_key, outer_options
from kverr.io import open_capture
from kverr.rope import layer_rope

MARGINS = (0.1, 0.2, 0.5, 1.0)


def near_frontier(damage: np.ndarray, cost: np.ndarray, margin: float) -> np.ndarray:
    """``damage [option, cand, head]`` within ``1 + margin`` of the least damage of a candidate
    of no more bytes (``cost [option, cand]``) -> bool ``[option, cand, head]``."""
    cheaper = cost[:, :, None] <= cost[:, None, :]
    best = np.where(cheaper[..., None], damage[:, :, None, :], np.inf).min(axis=1)
    return damage <= (1.0 + margin) * best


def frontier(damage: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """bool ``[option, cand, head]``: the candidates the knapsack keeps per (option, head) -- its
    Pareto set by bytes and damage (:func:`kverr.calibration.knapsack._pareto`)."""
    out = np.zeros(damage.shape, dtype=bool)
    for o in range(damage.shape[0]):
        for h in range(damage.shape[2]):
            out[o, _pareto(cost[o], damage[o, :, h]), h] = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, nargs="+", default=[10])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--more", type=int, default=256)
    ap.add_argument("--budget", type=float, default=2.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cap = open_capture(args.capture)
    kv = cap.kv
    cfg = CalibrationConfig(budgets=(args.budget,), candidates="fitted", codebooks=True, salient=8,
                            compensated_keys=True, context=1280, batch=8, refit_widths=True)
    wdt, cand_set = _search_key(cfg, args.budget)
    ck, cv = _search_candidates(cfg, cand_set, kv.head_dim)
    opts = tuple(dataclasses.replace(o, salient=8) for o in outer_options(cap))
    cost = {w: np.stack([_costs(c, o, kv.head_dim, 1280, 64, wdt, 16, which=w, batch=8, width_tables=True)
                         for o in opts]) for w, c in (("k", ck), ("v", cv))}
    rows = []
    for layer in args.layers:
        q, k, v, kp, scale, kv_map = _layer_arrays(cap, layer, True)
        tables, seconds = {}, {}
        for n in (args.queries, args.more):
            t0 = time.thread_time()
            prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=float(scale), queries=n,
                                 positions=kv.positions, rope=layer_rope(kv.rope, layer), decode=None,
                                 sliding_window=0, sinks=None, salient=True, compensated_keys=True)
            tables[n] = score_layer(prep, ck, cv, opts, page_size=64, window_dtype=wdt, widths={},
                                    compensated_keys=True)
            seconds[n] = time.thread_time() - t0
        print(f"layer {layer}: {seconds[args.queries]:.1f} s on {args.queries} positions, "
              f"{seconds[args.more]:.1f} s on {args.more}", flush=True)
        for side, i in (("k", 0), ("v", 1)):
            few, many = tables[args.queries][i], tables[args.more][i]
            front = frontier(many, cost[side])
            for m in MARGINS:
                live = near_frontier(few, cost[side], m)
                rows.append(dict(layer=layer, side=side, margin=m, seconds_few=seconds[args.queries],
                                 seconds_many=seconds[args.more], union=live.any(axis=(0, 2)).mean(),
                                 per_head=live.any(axis=0).mean(), per_option_head=live.mean(),
                                 frontier=int(front.sum()), missed=int((front & ~live).sum())))
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
