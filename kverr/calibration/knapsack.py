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
    d = np.asarray(dmg, dtype=np.float64)[order]
    prev = np.concatenate([[math.inf], np.minimum.accumulate(d)[:-1]])
    return order[d < prev].astype(np.int64)


@dataclass
class LayerItems:
    """The Pareto set of one layer's whole choices under a bound on its format groups.

    Attributes
    ----------
    cost : ndarray ``[m]`` int64
        Bytes of the layer (every head's K and V).
    damage : ndarray ``[m]`` float64
        Its damage (the sum over heads and K|V).
    k, v : ndarray ``[m, H]`` int64
        The K and V candidate index of every kv head.
    """

    cost: np.ndarray
    damage: np.ndarray
    k: np.ndarray
    v: np.ndarray

    def take(self, idx: np.ndarray) -> LayerItems:
        return LayerItems(self.cost[idx], self.damage[idx], self.k[idx], self.v[idx])

    def pruned(self) -> LayerItems:
        return self.take(_pareto(self.cost, self.damage))


def set_partitions(n: int, max_blocks: int) -> list[list[list[int]]]:
    """Every partition of ``0..n-1`` into at most ``max_blocks`` blocks (restricted growth
    strings, each partition once; blocks in order of their first element)."""
    out: list[list[list[int]]] = []

    def grow(i: int, blocks: list[list[int]]) -> None:
        if i == n:
            out.append([list(b) for b in blocks])
            return
        for b in blocks:
            b.append(i)
            grow(i + 1, blocks)
            b.pop()
        if len(blocks) < max_blocks:
            blocks.append([i])
            grow(i + 1, blocks)
            blocks.pop()

    grow(0, [])
    return out


def n_partitions(n: int, max_blocks: int) -> int:
    """How many partitions :func:`set_partitions` gives: Stirling numbers of the second kind
    ``S(n, k)`` summed over ``k <= max_blocks``."""
    row = [1] + [0] * max_blocks  # S(0, k)
    for i in range(1, n + 1):
        row = [0] + [k * row[k] + row[k - 1] for k in range(1, max_blocks + 1)]
    return sum(row[1:]) if n else 1


#: Most set partitions of one layer's kv heads :func:`layer_items` enumerates.
MAX_PARTITIONS = 20_000


def layer_items(cost_k: np.ndarray, dmg_k: np.ndarray, cost_v: np.ndarray, dmg_v: np.ndarray,
                max_groups: int) -> LayerItems:
    """The Pareto set of a layer's choices whose heads use at most ``max_groups`` distinct
    (K format, V format) pairs.

    Exact: every partition of the heads into at most ``max_groups`` blocks is tried, each block
    sharing one pair; a block's best pairs are the Pareto set of its K and V sides' sums, and
    blocks combine by Pareto-pruned sums. Two blocks may still pick the same pair (the layer
    then has fewer groups), so the bound is respected and nothing feasible is missed.

    Parameters
    ----------
    cost_k, cost_v : ndarray ``[n_k]``, ``[n_v]`` int
        Bytes of one head in each K (V) candidate.
    dmg_k, dmg_v : ndarray ``[n_k, H]``, ``[n_v, H]`` float
        Damage of each candidate on each kv head.
    max_groups : int
        Most distinct (K, V) pairs in the layer (at least 1).
    """
    cost_k, cost_v = np.asarray(cost_k, dtype=np.int64), np.asarray(cost_v, dtype=np.int64)
    dmg_k, dmg_v = np.asarray(dmg_k, dtype=np.float64), np.asarray(dmg_v, dtype=np.float64)
    H = dmg_k.shape[1]
    if dmg_v.shape[1] != H or dmg_k.shape[0] != cost_k.size or dmg_v.shape[0] != cost_v.size:
        raise ConfigError("layer_items: damages must be [candidates, heads] matching the costs")
    if isinstance(max_groups, bool) or not isinstance(max_groups, (int, np.integer)) or max_groups < 1:
        raise ConfigError(f"max_groups={max_groups!r}: give a positive integer")
    if n_partitions(H, min(int(max_groups), H)) > MAX_PARTITIONS:
        raise ConfigError(
            f"at most {max_groups} format groups among {H} kv heads: too many ways to group the heads "
            f"to search exactly (more than {MAX_PARTITIONS}); give a smaller bound (1 or 2)"
        )
    parts = set_partitions(H, min(int(max_groups), H))
    blocks: dict[tuple[int, ...], LayerItems] = {}

    def block(heads: tuple[int, ...]) -> LayerItems:
        if heads not in blocks:
            n = len(heads)
            ik = _pareto(n * cost_k, dmg_k[:, heads].sum(1))
            iv = _pareto(n * cost_v, dmg_v[:, heads].sum(1))
            kk, vv = np.meshgrid(ik, iv, indexing="ij")
            kk, vv = kk.ravel(), vv.ravel()
            cost = n * (cost_k[kk] + cost_v[vv])
            dmg = dmg_k[kk][:, heads].sum(1) + dmg_v[vv][:, heads].sum(1)
            ks = np.full((kk.size, H), -1, dtype=np.int64)
            vs = np.full((kk.size, H), -1, dtype=np.int64)
            ks[:, heads], vs[:, heads] = kk[:, None], vv[:, None]
            blocks[heads] = LayerItems(cost, dmg, ks, vs).pruned()
        return blocks[heads]

    found = []
    for part in parts:
        acc = block(tuple(part[0]))
        for b in part[1:]:
            other = block(tuple(b))
            i, j = (x.ravel() for x in np.meshgrid(np.arange(acc.cost.size), np.arange(other.cost.size), indexing="ij"))
            hs = list(b)
            ks, vs = acc.k[i].copy(), acc.v[i].copy()
            ks[:, hs], vs[:, hs] = other.k[j][:, hs], other.v[j][:, hs]
            acc = LayerItems(acc.cost[i] + other.cost[j], acc.damage[i] + other.damage[j], ks, vs).pruned()
        found.append(acc)
    return LayerItems(*(np.concatenate([getattr(f, a) for f in found]) for a in ("cost", "damage", "k", "v"))).pruned()


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
