"""Exact multiple-choice knapsack by dynamic programming: the whole Pareto frontier in one pass.

Groups ``g = 1..G`` (one per layer, kv head and K|V) each hold candidates with an integer cost
(bytes) and a damage. A solution picks one candidate per group; its cost and damage are the sums.
:func:`solve` first drops, per group, every candidate that another one dominates (no more
bytes and no more damage), then runs the classic DP over the extra cost above the cheapest
solution, in units of ``u`` bytes::

    best_g[c] = min_j best_{g-1}[c - w_gj] + d_gj        (c = 0 .. C)

keeping the arg-min per group and cost for backtracking. One pass yields the minimum damage for
*every* cost ``c``; the prefix minimum over ``c`` is the frontier (each strict improvement is a
Pareto-optimal solution). ``u`` is the greatest common divisor of all extra costs, so the DP is
exact; only when that would need more than ``max_states`` cost cells is ``u`` enlarged and every
extra cost rounded *up* to whole units (``Frontier.exact`` is then False): a solution found is
still within budget in true bytes, and it is optimal among solutions whose rounded cost fits.
Ties go to the lower candidate index and the lower cost: the result is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

from kverr.exceptions import ConfigError


@dataclass
class Frontier:
    """Pareto frontier of a multiple-choice knapsack (see the module docs).

    Attributes
    ----------
    cost : ndarray ``[n]`` int64
        True bytes of each frontier solution, strictly increasing.
    damage : ndarray ``[n]`` float64
        Its damage, strictly decreasing.
    choices : ndarray ``[n, G]`` int64
        The candidate index chosen in every group.
    unit : int
        Cost unit of the DP (bytes).
    exact : bool
        Whether ``unit`` divides every cost (the DP is then exact in bytes).
    min_cost, max_cost : int
        Cheapest and dearest possible solutions (bytes).
    """

    cost: np.ndarray
    damage: np.ndarray
    choices: np.ndarray
    unit: int
    exact: bool
    min_cost: int
    max_cost: int

    def best_within(self, budget: int) -> int:
        """Index of the least-damage frontier solution costing at most ``budget`` bytes."""
        ok = np.nonzero(self.cost <= budget)[0]
        if ok.size == 0:
            raise ConfigError(
                f"budget of {budget} bytes is below the cheapest solution ({self.min_cost} bytes)"
            )
        return int(ok[-1])


def _pareto(cost: np.ndarray, dmg: np.ndarray) -> np.ndarray:
    """Indices of the undominated candidates, by increasing cost (ties: lower index first)."""
    order = np.lexsort((np.arange(len(cost)), dmg, cost))
    keep, best = [], math.inf
    for i in order:
        if dmg[i] < best:
            keep.append(int(i))
            best = float(dmg[i])
    return np.asarray(keep, dtype=np.int64)


def solve(
    costs: Sequence[np.ndarray],
    damages: Sequence[np.ndarray],
    *,
    max_cost: int | None = None,
    max_states: int = 1 << 19,
) -> Frontier:
    """The Pareto frontier of choosing one candidate per group.

    Parameters
    ----------
    costs : sequence of ndarray ``[n_g]`` int
        Non-negative integer cost of each candidate of each group.
    damages : sequence of ndarray ``[n_g]`` float
        Finite damage of each candidate.
    max_cost : int, optional
        Solutions dearer than this are not needed (bounds the DP).
    max_states : int
        Most cost cells of the DP; beyond it costs are rounded up to coarser units.
    """
    if len(costs) != len(damages) or not costs:
        raise ConfigError("give the same, non-zero number of cost and damage groups")
    cs, ds = [], []
    for g, (c, d) in enumerate(zip(costs, damages)):
        c = np.asarray(c, dtype=np.int64)
        d = np.asarray(d, dtype=np.float64)
        if c.ndim != 1 or c.shape != d.shape or c.size == 0:
            raise ConfigError(f"group {g}: costs and damages must be equal-length, non-empty 1-d arrays")
        if (c < 0).any() or not np.isfinite(d).all():
            raise ConfigError(f"group {g}: costs must be >= 0 and damages finite")
        cs.append(c)
        ds.append(d)
    keep = [_pareto(c, d) for c, d in zip(cs, ds)]
    base = [int(c[k[0]]) for c, k in zip(cs, keep)]
    extra = [cs[g][keep[g]] - base[g] for g in range(len(cs))]
    min_cost = int(sum(base))
    full = int(sum(int(e[-1]) for e in extra))
    span = full if max_cost is None else max(0, min(full, int(max_cost) - min_cost))
    nz = [int(x) for e in extra for x in e if x > 0]
    unit = reduce(math.gcd, nz, 0) or 1
    exact = True
    if span // unit + 1 > max_states:
        unit = -(-span // (max_states - 1))
        exact = all(x % unit == 0 for x in nz)
    n_cells = span // unit + 1
    w = [-(-e // unit) for e in extra]  # rounded up: never under-counts bytes
    G = len(cs)
    best = np.full(n_cells, np.inf)
    best[0] = 0.0
    choice = np.zeros((G, n_cells), dtype=np.uint8 if max(len(k) for k in keep) < 256 else np.int32)
    cand_buf = np.empty(n_cells)
    better_buf = np.empty(n_cells, dtype=bool)
    for g in range(G):
        new = np.full(n_cells, np.inf)
        arg = choice[g]
        for j, (wj, dj) in enumerate(zip(w[g], ds[g][keep[g]])):
            wj = int(wj)
            if wj >= n_cells:
                break  # costs are increasing within the pruned group
            n = n_cells - wj
            cand, better, tgt = cand_buf[:n], better_buf[:n], new[wj:]
            np.add(best[:n], dj, out=cand)
            np.less(cand, tgt, out=better)  # strict: ties keep the lower candidate index
            np.copyto(tgt, cand, where=better)
            np.copyto(arg[wj:], j, where=better, casting="unsafe")
        best = new
    # Frontier: strict improvements of the prefix minimum over cost cells.
    prev = np.concatenate([[np.inf], np.minimum.accumulate(best)[:-1]])
    c = np.nonzero(best < prev)[0].astype(np.int64)
    choices = np.empty((len(c), G), dtype=np.int64)
    cost = np.zeros(len(c), dtype=np.int64)
    damage = np.zeros(len(c), dtype=np.float64)
    for g in range(G - 1, -1, -1):  # backtrack every frontier cell at once
        j = choice[g, c].astype(np.int64)
        orig = keep[g][j]
        choices[:, g] = orig
        cost += cs[g][orig]
        damage += ds[g][orig]
        c = c - w[g][j]
    if (c != 0).any():  # internal invariant, not input validation
        raise RuntimeError("knapsack backtracking did not return to cost 0")
    # Rounding can make true costs non-monotone along the rounded frontier; keep the Pareto set.
    order = np.lexsort((damage, cost))
    d_sorted = damage[order]
    prev_d = np.concatenate([[np.inf], np.minimum.accumulate(d_sorted)[:-1]])
    sel_a = order[d_sorted < prev_d].astype(np.int64)
    return Frontier(cost[sel_a], damage[sel_a], choices[sel_a], int(unit), bool(exact), min_cost,
                    min_cost + full)


def brute_force(costs: Sequence[np.ndarray], damages: Sequence[np.ndarray], budget: int):
    """Least damage within ``budget`` by enumeration (tests; tiny instances only)."""
    import itertools

    best = (math.inf, None)
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        c = sum(int(costs[g][j]) for g, j in enumerate(pick))
        if c <= budget:
            d = sum(float(damages[g][j]) for g, j in enumerate(pick))
            if d < best[0]:
                best = (d, pick)
    return best
