"""Calibration: the knapsack (against brute force), the objective (against kverr.error), the
search (bytes == kverr.memory, provenance, bad input) and the CLI, on a tiny random model."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.calibration import (
    CalibrationConfig,
    OuterOption,
    brute_force,
    calibrate,
    check_model_matches,
    predict,
    solve,
)
from kverr.calibration.candidates import default_candidates, head_bytes
from kverr.calibration.knapsack import layer_items, n_partitions, set_partitions
from kverr.calibration.objective import key_damage, prepare_layer, value_damage
from kverr.config import CacheConfig
from kverr.exceptions import CaptureError, ConfigError
from kverr.memory import ModelShape, account
from kverr.quant import PerChannel, PerHead, PerToken, PerTokenGroup, float_format, fp8_format, int_format

# ---------------------------------------------------------------------------------------------
# knapsack
# ---------------------------------------------------------------------------------------------

groups_st = st.lists(
    st.lists(st.tuples(st.integers(0, 12), st.floats(0, 10, allow_nan=False)), min_size=1, max_size=4),
    min_size=1, max_size=4,
)


def _arrays(groups):
    return [np.array([c for c, _ in g]) for g in groups], [np.array([d for _, d in g]) for g in groups]


@given(groups_st, st.integers(0, 50))
def test_knapsack_is_optimal_against_brute_force(groups, budget):
    costs, dmg = _arrays(groups)
    fr = solve(costs, dmg)
    assert fr.exact
    best, _ = brute_force(costs, dmg, budget)
    if best == np.inf:
        with pytest.raises(ConfigError, match="cheapest"):
            fr.best_within(budget)
        return
    i = fr.best_within(budget)
    assert fr.cost[i] <= budget  # budget respected exactly, in true cost
    assert fr.damage[i] == pytest.approx(best, rel=1e-12, abs=1e-12)
    # the reported cost and damage are those of the reported choices
    pick = fr.choices[i]
    assert sum(int(costs[g][j]) for g, j in enumerate(pick)) == fr.cost[i]
    assert sum(float(dmg[g][j]) for g, j in enumerate(pick)) == pytest.approx(fr.damage[i], rel=1e-12, abs=1e-12)


@given(groups_st)
def test_frontier_is_monotone_and_deterministic(groups):
    costs, dmg = _arrays(groups)
    a, b = solve(costs, dmg), solve(costs, dmg)
    assert np.all(np.diff(a.cost) > 0) and np.all(np.diff(a.damage) < 0)
    assert np.array_equal(a.choices, b.choices) and np.array_equal(a.cost, b.cost)
    assert a.cost[0] == a.min_cost


@given(st.integers(0, 10_000))
def test_rounded_units_never_exceed_the_budget(seed):
    rng = np.random.default_rng(seed)
    costs = [rng.integers(100, 5000, 5) for _ in range(6)]
    dmg = [rng.random(5) for _ in range(6)]
    fr = solve(costs, dmg, max_states=64)  # forces coarse units
    budget = int(rng.integers(fr.min_cost, fr.max_cost + 1))
    i = fr.best_within(budget)
    assert fr.cost[i] <= budget
    exact = brute_force(costs, dmg, budget)[0]
    assert fr.damage[i] >= exact - 1e-12  # never better than optimal


def _grouped_brute(ck, dk, cv, dv, max_groups):
    """Every assignment of (K, V) candidates to the heads with at most ``max_groups`` distinct
    pairs: its (cost, damage)."""
    import itertools

    H = dk.shape[1]
    pairs = list(itertools.product(range(ck.size), range(cv.size)))
    out = []
    for pick in itertools.product(pairs, repeat=H):
        if len(set(pick)) <= max_groups:
            out.append((sum(int(ck[a] + cv[b]) for a, b in pick),
                        sum(float(dk[a, h] + dv[b, h]) for h, (a, b) in enumerate(pick))))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_groups", [1, 2])
def test_layer_items_are_the_exact_pareto_set_of_grouped_choices(seed, max_groups):
    """A layer's items under a bound on (K, V) pairs: every Pareto point of a brute-force
    enumeration is reached, and every item is a feasible assignment with its true cost/damage."""
    rng = np.random.default_rng(seed)
    H, nk, nv = 3, 4, 3
    ck, cv = rng.integers(1, 6, nk), rng.integers(1, 6, nv)
    dk, dv = rng.random((nk, H)), rng.random((nv, H))
    items = layer_items(ck, dk, cv, dv, max_groups)
    for c, d, ks, vs in zip(items.cost, items.damage, items.k, items.v):
        assert len(set(zip(ks.tolist(), vs.tolist()))) <= max_groups
        assert c == int((ck[ks] + cv[vs]).sum())
        assert d == pytest.approx(float(dk[ks, range(H)].sum() + dv[vs, range(H)].sum()), abs=1e-12)
    brute = _grouped_brute(ck, dk, cv, dv, max_groups)
    for budget in range(int(items.cost.min()), int(items.cost.max()) + 2):
        want = min(d for c, d in brute if c <= budget)
        got = items.damage[items.cost <= budget].min()
        assert got == pytest.approx(want, abs=1e-12)
    assert np.all(np.diff(items.cost) > 0) and np.all(np.diff(items.damage) < 0)


def test_set_partitions_and_the_bound_on_them():
    assert [len(set_partitions(4, n)) for n in (1, 2, 3, 4)] == [1, 8, 14, 15]  # Stirling sums, Bell(4)
    assert [n_partitions(4, n) for n in (1, 2, 3, 4)] == [1, 8, 14, 15] and n_partitions(12, 12) == 4213597
    assert sorted(map(len, set_partitions(3, 2))) == [1, 2, 2, 2]
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="too many ways to group the heads"):
        layer_items(np.ones(2, int), rng.random((2, 12)), np.ones(2, int), rng.random((2, 12)), 6)
    with pytest.raises(ConfigError, match="max_groups=0"):
        layer_items(np.ones(2, int), rng.random((2, 3)), np.ones(2, int), rng.random((2, 3)), 0)


def test_knapsack_bad_input():
    with pytest.raises(ConfigError):
        solve([], [])
    with pytest.raises(ConfigError, match="group 0"):
        solve([np.array([1, 2])], [np.array([1.0])])
    with pytest.raises(ConfigError, match="finite"):
        solve([np.array([1])], [np.array([np.nan])])


# ---------------------------------------------------------------------------------------------
# objective
# ---------------------------------------------------------------------------------------------


def _layer(seed=0, Hq=4, H=2, T=96, D=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, T, D, generator=g)
    k = torch.randn(H, T, D, generator=g) * 2
    v = torch.randn(H, T, D, generator=g)
    kv_map = np.repeat(np.arange(H), Hq // H)
    return q, k, v, kv_map


@pytest.mark.parametrize("opt", [OuterOption(), OuterOption(sinks=5), OuterOption(sinks=3, window=7)])
@pytest.mark.parametrize("errors", ["small", "huge", "huge-on-sinks"])
@pytest.mark.parametrize("decode, sliding, sinks", [(None, 0, False), (5, 0, False), (None, 9, False), (5, 9, False),
                                                    (None, 0, True), (5, 9, True)])
def test_objective_terms_equal_kverr_error_decompose(opt, errors, decode, sliding, sinks):
    """The objective's key and value terms are kverr.error.decompose's, also for key errors so
    large that exp(δs) overflows fp32 (|δs| up to ~300: catastrophic 2-bit formats on outlier
    layers), and for huge errors on the sink tokens only, which the masked sums must not feel.
    With ``decode`` the queries are decode steps after a wholly quantized prompt: the window of
    step d holds its min(window, d + 1) newest tokens. In a sliding-window layer a query sees
    its last ``sliding`` keys only, as the decomposition's window does; learned sink logits join
    the softmax in both (the fast growth form and the float64 fallback of huge errors)."""
    from kverr.error import decompose

    q, k, v, kv_map = _layer()
    T, D = k.shape[1], k.shape[2]
    sink = torch.tensor([2.0, -1.0, 4.0, 0.5]) if sinks else None
    prep = prepare_layer(q, k, v, None, layer=0, kv_map=kv_map, scale=1 / np.sqrt(D), queries=12, decode=decode,
                         sliding_window=sliding, sinks=sink)
    big = {"small": 0.05, "huge": 60.0, "huge-on-sinks": 0.05}[errors]
    e_k = torch.randn(k.shape, generator=torch.Generator().manual_seed(1)) * big
    e_v = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) * big
    if errors == "huge-on-sinks":
        e_k[:, :5] *= 200.0
        e_v[:, :5] *= 200.0
    got_k = key_damage(prep, e_k, [opt])[0]
    got_v = value_damage(prep, e_v, [opt])[0]
    assert np.isfinite(got_k).all() and np.isfinite(got_v).all()
    want_k, want_v = np.zeros(2), np.zeros(2)
    pos = prep.pos.numpy()
    for i, p in enumerate(pos):
        w = opt.window if decode is None else min(opt.window, int(prep.steps[i]) + 1)
        m = torch.zeros(T, 1)
        m[opt.sinks : max(opt.sinks, p - w + 1)] = 1.0
        d2 = decompose(q[:, p : p + 1].double(), k.double(), v.double(), k.double(),
                       (v + m * e_v).double(), kv_head_of_q=kv_map, q_positions=[p], window=sliding, sink=sink)
        d1 = decompose(q[:, p : p + 1].double(), k.double(), v.double(), (k + m * e_k).double(),
                       v.double(), kv_head_of_q=kv_map, q_positions=[p], window=sliding, sink=sink)
        kk = (d1.total ** 2).sum(-1)[:, 0].numpy()
        vv = (d2.value_term ** 2).sum(-1)[:, 0].numpy()
        np.add.at(want_k, kv_map, kk / len(pos))
        np.add.at(want_v, kv_map, vv / len(pos))
    np.testing.assert_allclose(got_k, want_k / prep.norm, rtol=2e-4, atol=1e-12)
    np.testing.assert_allclose(got_v, want_v / prep.norm, rtol=2e-4, atol=1e-12)


@pytest.mark.parametrize("sides,recent", [("kv", 0), ("k", 0), ("v", 0), ("kv", 2)])
@pytest.mark.parametrize("decode", [None, 5])
def test_objective_takes_each_querys_salient_tokens_out(sides, recent, decode):
    """With salient tokens (``OuterOption.salient``) each sampled query sees its kv head's
    ``salient`` most salient quantized tokens without error, on the sides that keep them: the
    tokens of highest ``Σ a²`` over every 8th of the last 256 queries of the prompt that ends
    just before the query (before its first generated token for a decode step), recomputed here
    in float64, ties to the earlier token -- with ``salient_recent`` = R, the R newest quantized
    tokens of that prompt and the others by ``Σ a²``; the damage is then kverr.error.decompose's
    with those tokens left out of the mask."""
    from kverr.error import decompose

    q, k, v, kv_map = _layer(seed=4, T=160)
    T, D = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D)
    opt = OuterOption(sinks=3, window=7, salient=5, salient_sides=sides, salient_recent=recent)
    prep = prepare_layer(q, k, v, None, layer=0, kv_map=kv_map, scale=scale, queries=12, decode=decode,
                         salient=True)
    e_k = torch.randn(k.shape, generator=torch.Generator().manual_seed(1)) * 0.3
    e_v = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) * 0.3
    got_k = key_damage(prep, e_k, [opt])[0]
    got_v = value_damage(prep, e_v, [opt])[0]
    plain = OuterOption(sinks=3, window=7)
    want_k, want_v = np.zeros(2), np.zeros(2)
    qd, kd = q.double(), k.double()
    for i, p in enumerate(prep.pos.numpy()):
        step = 0 if decode is None else int(prep.steps[i])
        w = opt.window if decode is None else min(opt.window, step + 1)
        end = p - 1 - step  # the prompt's last token
        rows = np.arange(end, max(end - 256, -1), -8)
        for h in range(2):
            m = torch.zeros(T, 1)
            m[opt.sinks: max(opt.sinks, p - w + 1)] = 1.0
            s = torch.einsum("gqd,td->gqt", qd[kv_map == h][:, rows], kd[h, :end + 1]) * scale
            s = s.masked_fill(torch.arange(end + 1)[None, None, :] > torch.as_tensor(rows)[None, :, None], -np.inf)
            sal = (torch.softmax(s, -1) ** 2).sum((0, 1)).numpy()
            cand = [t for t in range(opt.sinks, min(p - w, end) + 1)]
            r = min(recent, end + 1 - opt.sinks) if cand else 0
            newest = list(range(end + 1 - r, end + 1))  # the prompt's last, wherever they are
            rest = [t for t in cand if t <= end - r]
            top = newest + sorted(rest, key=lambda t: (-sal[t], t))[:opt.salient - r]
            ms = m.clone()
            ms[top] = 0.0
            mk, mv = (ms if "k" in sides else m), (ms if "v" in sides else m)
            qi = np.nonzero(kv_map == h)[0]
            d1 = decompose(qd[qi][:, p:p + 1], kd[h:h + 1], v[h:h + 1].double(), (k[h:h + 1] + mk * e_k[h:h + 1]).double(),
                           v[h:h + 1].double(), kv_head_of_q=np.zeros(len(qi), int), q_positions=[p])
            d2 = decompose(qd[qi][:, p:p + 1], kd[h:h + 1], v[h:h + 1].double(), kd[h:h + 1],
                           (v[h:h + 1] + mv * e_v[h:h + 1]).double(), kv_head_of_q=np.zeros(len(qi), int), q_positions=[p])
            want_k[h] += float((d1.total ** 2).sum()) / len(prep.pos)
            want_v[h] += float((d2.value_term ** 2).sum()) / len(prep.pos)
    np.testing.assert_allclose(got_k, want_k / prep.norm, rtol=2e-4, atol=1e-12)
    np.testing.assert_allclose(got_v, want_v / prep.norm, rtol=2e-4, atol=1e-12)
    # the other side's damage is that of the option without rows (errors can cancel, so the
    # side that keeps them need not lose damage in every head: it changes)
    for which, got, damage in (("k", got_k, key_damage), ("v", got_v, value_damage)):
        base = damage(prep, e_k if which == "k" else e_v, [plain])[0]
        if which in sides:
            assert np.all(got != base)
        else:
            np.testing.assert_array_equal(got, base)
    with pytest.raises(ConfigError, match="salient=True"):
        key_damage(prepare_layer(q, k, v, None, layer=0, kv_map=kv_map, scale=scale, queries=12), e_k,
                   [OuterOption(salient=2, salient_sides="k")])


def test_objective_sanity_more_bits_less_damage_and_zero_error_zero_damage():
    q, k, v, kv_map = _layer(seed=3)
    prep = prepare_layer(q, k, v, None, layer=0, kv_map=kv_map, scale=0.25, queries=16)
    z = torch.zeros_like(k)
    assert np.all(key_damage(prep, z, [OuterOption()]) == 0)
    assert np.all(value_damage(prep, z, [OuterOption()]) == 0)
    from kverr.calibration.objective import key_error, value_error

    def _errors_both(prep, f, _pre, _page, _wd):
        cfg = CacheConfig(k=f, v=f)
        return key_error(prep, cfg), value_error(prep, cfg)

    dmg = {}
    for bits in (2, 4, 8):
        ek, ev = _errors_both(prep, int_format(bits, PerToken()), False, 64, "fp16")
        dmg[bits] = (key_damage(prep, ek, [OuterOption()]).sum(), value_damage(prep, ev, [OuterOption()]).sum())
    assert dmg[2][0] > dmg[4][0] > dmg[8][0] > 0
    assert dmg[2][1] > dmg[4][1] > dmg[8][1] > 0
    # a sink mask can only remove error
    ek, _ = _errors_both(prep, int_format(2, PerToken()), False, 64, "fp16")
    a, b = key_damage(prep, ek, [OuterOption(), OuterOption(sinks=40)])
    assert np.all(b <= a)


def test_candidate_set_and_exact_bytes():
    c = default_candidates(64)
    assert len(c) >= 64 and len(set(c)) == len(c)
    kinds = {f.granularity.kind for f in c}
    assert {"token", "token_group", "channel", "head"} <= kinds
    assert {f.bits for f in c} >= {2, 3, 4, 8, 16} and any(f.is_fp8 for f in c)
    assert any(f.rotate == "hadamard" for f in c) and any(f.clip.kind == "mse" for f in c)
    # per-head bytes add up to the accounting of a layer of mixed heads (salient rows on the keys only)
    opt = OuterOption(sinks=4, window=16, salient=5, salient_sides="k")
    fa, fb = int_format(3, PerChannel(32)), fp8_format(PerHead())
    cfg = CacheConfig(k=fa, v=fb, sinks=4, window=16, salient=5, salient_sides="k",
                      heads={(0, 1): __import__("kverr.config").config.Override(k=fb, v=fa)})
    rep = account(cfg, ModelShape(1, 2, 64), 1000)
    assert rep.total_bytes == sum(head_bytes(f, opt, 64, 1000, which=w) for f in (fa, fb) for w in "kv")
    # five fp16 rows (128 bytes each) and five int32 positions, each section aligned to 16 bytes
    assert head_bytes(fa, opt, 64, 1000, which="k") - head_bytes(fa, opt, 64, 1000, which="v") == 5 * 128 + 32


# ---------------------------------------------------------------------------------------------
# the search on a tiny random model's real capture
# ---------------------------------------------------------------------------------------------

SMALL = (int_format(2, PerToken()), int_format(4, PerTokenGroup(16)), int_format(4, PerChannel(32)),
         int_format(8, PerToken()), fp8_format(PerHead()), float_format("fp16"))


def cal_at(cap, budget, *, scores=None, sensitivity=None, model=None, **fields):
    """``calibrate`` at one budget, every other option a CalibrationConfig field."""
    return calibrate(cap, CalibrationConfig(budgets=budget, **fields), scores=scores, sensitivity=sensitivity,
                     model=model, workers=1)


def test_fitted_channel_widths_are_scored_written_and_predicted_alike(tiny_capture):
    """Templates (``channel_bits``) are refitted per (layer, kv head, K|V, RoPE side); the config
    holds the fitted widths, its bytes are what memory counts, and predicting the written config
    from scratch gives the damage the search chose it for."""
    from kverr.catalog import template

    cap, _, loaded = tiny_capture
    D = loaded.head_dim
    tmpls = (template(1.5, D), template(2.5, D))
    cands = (int_format(2, PerChannel(None)), *tmpls, float_format("fp16"))
    opts = (OuterOption(sinks=4), OuterOption(sinks=4, key_pre_rope=True))
    cal = cal_at(cap, 2.5, context=160, options=opts, cands_k=cands, cands_v=cands, queries=16, objective="rel")
    cfg, pv = cal.config, cal.config.provenance
    fmts = [cfg.format_for(l, h, w) for l in range(loaded.n_layers) for h in range(loaded.n_kv_heads) for w in "kv"]
    fitted = [f for f in fmts if f.channel_bits is not None]
    assert fitted and any(f.channel_bits not in {t.channel_bits for t in tmpls} for f in fitted)
    rep = account(cfg, ModelShape(loaded.n_layers, loaded.n_kv_heads, D), 160)
    assert rep.total_bytes == pv["bytes"] and rep.effective_bits <= 2.5
    p = predict(cap, cfg, queries=16)
    assert p["relative"] == pytest.approx(pv["predicted_relative"], rel=1e-4)


def test_refit_widths_count_each_sequences_width_tables(tiny_capture, tmp_path):
    """With ``refit_widths`` the budget holds the config's bytes with the width tables every
    sequence stores when its widths are refit (as ``kverr evaluate --refit-widths`` counts them),
    which the default count leaves out; a template costs one table row per sequence more, a
    format without widths nothing."""
    from kverr.calibration.refit import add_width_tables, width_row_nbytes
    from kverr.catalog import template

    cap, path, loaded = tiny_capture
    D = loaded.head_dim
    tmpls = (template(1.5, D), template(2.5, D))
    cands = (int_format(2, PerChannel(None)), *tmpls, float_format("fp16"))
    common = dict(context=160, options=(OuterOption(sinks=4),), cands_k=cands, cands_v=cands, queries=16,
                  objective="rel", batch=4)
    plain = cal_at(cap, 2.5, **common)
    refit = cal_at(cap, 2.5, scores=plain.scores, refit_widths=True, **common)
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, D)
    for cal in (plain, refit):
        rep = account(cal.config, shape, 160, batch=4)
        counted = rep.total_bytes
        add_width_tables(rep, cal.config)
        assert rep.total_bytes > counted  # both chose formats with per-channel widths
        if cal is refit:
            assert rep.total_bytes == cal.config.provenance["bytes"] and rep.effective_bits <= 2.5
        else:
            assert counted == cal.config.provenance["bytes"]
    assert refit.config.provenance["refit_widths"] is True and "refit_widths" not in plain.config.provenance
    opt = OuterOption(sinks=4)
    for f, extra in ((tmpls[0], 4 * width_row_nbytes(D)), (cands[0], 0)):
        assert (head_bytes(f, opt, D, 160, which="k", batch=4, width_tables=True)
                - head_bytes(f, opt, D, 160, which="k", batch=4)) == extra
    with pytest.raises(ConfigError, match="refit_widths"):
        CalibrationConfig(budgets=3, refit_widths=1)
    from kverr.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate", "--capture", str(path), "--budget-bits", "3", "--context", "160", "--refit-widths",
                 "--candidates", "fitted", "--queries", "8", "--workers", "1", "--objective", "rel",
                 "--out", str(out)]) == 0
    assert CacheConfig.load(out).provenance["refit_widths"] is True


def test_compensated_keys_are_scored_written_and_predicted_alike(tiny_capture, tmp_path, capsys):
    """With ``compensated_keys`` the integer key candidates are scored rounded with compensation
    (other key candidates and every value candidate as without it), the written config rounds
    its keys so, and predicting it from scratch gives the damage the search chose it for."""
    from kverr.catalog import template
    from kverr.quant.compensated import compensable

    cap, path, loaded = tiny_capture
    D = loaded.head_dim
    cands = (int_format(2, PerChannel(None)), int_format(3, PerToken(), rotate="hadamard"), template(1.5, D),
             fp8_format(PerToken()), float_format("fp16"))
    opts = (OuterOption(sinks=4), OuterOption(sinks=4, key_pre_rope=True))
    common = dict(context=160, options=opts, cands_k=cands, cands_v=cands, queries=16, objective="rel")
    plain = cal_at(cap, 2.5, **common)
    ck = cal_at(cap, 2.5, compensated_keys=True, **common)
    a, b = plain.scores, ck.scores
    assert np.array_equal(a.v, b.v)
    for j, f in enumerate(cands):
        same = np.array_equal(a.k[:, :, j], b.k[:, :, j])
        assert same != compensable(f), f.label()
    cfg, pv = ck.config, ck.config.provenance
    assert cfg.key_rounding == "compensated" and pv["compensated_keys"] is True
    assert cfg.key_moments is None and "static_moments" not in pv
    # static moments: the configs carry the moments they were scored under (the same scores), and
    # the budget counts their bytes -- the tiny model's are large beside 160 tokens of one
    # sequence, so they are counted for 8
    from kverr.calibration.objective import capture_key_moments
    from kverr.memory import ModelShape, account

    st = cal_at(cap, 2.5, compensated_keys=True, static_moments=True, batch=8, scores=b, **common)
    scfg, spv = st.config, st.config.provenance
    assert scfg.key_moments == capture_key_moments(cap) and spv["static_moments"] is True
    rep = account(scfg, ModelShape(loaded.n_layers, loaded.n_kv_heads, D), 160, batch=8)
    assert rep.total_bytes == spv["bytes"] and rep.effective_bits <= 2.5
    assert spv["bytes"] == int(st.choices[2.5]["bytes"].sum()) + scfg.key_moments.nbytes
    with pytest.raises(ConfigError, match="infeasible"):  # one sequence cannot pay for them at 2.5 bits
        cal_at(cap, 2.5, compensated_keys=True, static_moments=True, scores=b, **common)
    with pytest.raises(ConfigError, match="set compensated_keys too"):
        cal_at(cap, 2.5, static_moments=True, **common)
    assert plain.config.key_rounding == "nearest" and "compensated_keys" not in plain.config.provenance
    p = predict(cap, cfg, queries=16)
    assert p["relative"] == pytest.approx(pv["predicted_relative"], rel=1e-4)
    with pytest.raises(ConfigError, match="compensated_keys"):
        cal_at(cap, 2.5, scores=a, compensated_keys=True, **common)
    from kverr.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate", "--capture", str(path), "--budget-bits", "3", "--context", "160", "--compensated-keys",
                 "--static-moments", "--batch", "8", "--queries", "8", "--workers", "1", "--objective", "rel", "--out", str(out)]) == 0
    assert CacheConfig.load(out).key_rounding == "compensated" and CacheConfig.load(out).key_moments is not None
    assert main(["calibrate", "--capture", str(path), "--budget-bits", "3", "--compensated-keys", "--target", "vllm",
                 "--out", str(tmp_path / "v.json")]) != 0
    assert "--compensated-keys does not apply" in capsys.readouterr().err


def test_decode_scores_generated_keys_as_the_cache_rounds_them(tiny_capture):
    """With decode steps a cache without static moments rounds the keys generated after the
    prompt to nearest: the search scores them so (templates too) and predicting the written config
    from scratch gives what it chose it for; with static moments every key is compensated, and
    scores made one way are refused for the other."""
    from kverr.catalog import template
    from kverr.quant.compensated import compensable

    cap, _, loaded = tiny_capture
    cands = (int_format(2, PerChannel(None)), template(1.5, loaded.head_dim), fp8_format(PerToken()))
    opts = (OuterOption(sinks=4), OuterOption(sinks=4, window=8, key_pre_rope=True))
    common = dict(context=160, options=opts, cands_k=cands, cands_v=cands, queries=16, objective="rel", decode=48,
                  compensated_keys=True)
    near = cal_at(cap, 2.5, **common)
    comp = cal_at(cap, 2.5, static_moments=True, batch=8, **common)
    a, b = near.scores, comp.scores
    assert np.array_equal(a.v, b.v)
    for j, f in enumerate(cands):  # the generated keys' rounding moves every compensable candidate
        assert np.array_equal(a.k[:, :, j], b.k[:, :, j]) != compensable(f), f.label()
    pv = near.config.provenance
    p = predict(cap, near.config, queries=16, decode=48)
    assert p["relative"] == pytest.approx(pv["predicted_relative"], rel=1e-4)
    with pytest.raises(ConfigError, match="static_moments"):
        cal_at(cap, 2.5, static_moments=True, batch=8, scores=a, **common)


def test_scoring_splices_the_generated_keys_error_as_the_definition_does():
    """score_layer with decode and compensated keys: each (candidate, option) is key_damage of the
    compensated error with the nearest-rounded one on the generated keys."""
    from kverr.calibration.objective import key_error, score_layer
    from kverr.rope import apply_rope, default_inv_freq

    q, k, v, kv_map = _layer(seed=6)
    rope = {"inv_freq": default_inv_freq(k.shape[-1], 10000.0).tolist()}
    T = k.shape[1]
    k_post = apply_rope(k, np.arange(T), rope).to(torch.float32)
    prep = prepare_layer(q, k_post, v, k, layer=0, kv_map=kv_map, scale=0.2, queries=10, positions=np.arange(T),
                         rope=rope, decode=40, compensated_keys=True)
    cands = (int_format(2, PerChannel(None)), int_format(3, PerToken(), rotate="hadamard"), fp8_format(PerToken()))
    opts = [OuterOption(sinks=2), OuterOption(sinks=2, window=5, key_pre_rope=True)]
    dk, _ = score_layer(prep, cands, cands, opts, compensated_keys=True)
    dk_static, _ = score_layer(prep, cands, cands, opts, compensated_keys=True, static_moments=True)
    for j, f in enumerate(cands):
        for i, o in enumerate(opts):
            cfg = CacheConfig(k=f, v=f, key_pre_rope=o.key_pre_rope, key_rounding="compensated")
            ek, en = key_error(prep, cfg), key_error(prep, cfg.with_(key_rounding="nearest"))
            np.testing.assert_allclose(dk[i, j], key_damage(prep, ek, [o], en)[0], rtol=1e-5)
            np.testing.assert_allclose(dk_static[i, j], key_damage(prep, ek, [o])[0], rtol=1e-5)
    assert np.all(np.abs(dk[:, :2] / dk_static[:, :2] - 1) > 1e-3)  # the splice is seen (int formats)
    np.testing.assert_array_equal(dk[:, 2], dk_static[:, 2])  # fp8 is never compensated


def test_codebook_candidates_join_the_named_set(tiny_capture):
    """``codebooks=True`` searches the named set and the nine codebook candidates: the search is
    named for both, it counts them, and a superset of candidates predicts no more damage."""
    from kverr.catalog import codebook_candidates

    cap, _, loaded = tiny_capture
    common = dict(context=160, options=(OuterOption(sinks=4),), candidates="dynamic", queries=16, objective="rel")
    plain = cal_at(cap, 4.0, **common)
    with_cb = cal_at(cap, 4.0, codebooks=True, **common)
    assert [s.candidates for s in with_cb.searches] == ["dynamic+codebooks"]
    n = len(default_candidates(loaded.head_dim, static=False)) + len(codebook_candidates(loaded.head_dim))
    assert with_cb.config.provenance["candidates_k"] == n == plain.config.provenance["candidates_k"] + 9
    assert with_cb.config.provenance["predicted_damage"] <= plain.config.provenance["predicted_damage"]


def test_calibrate_respects_budget_bytes_match_memory_and_prediction_matches(tiny_capture):
    cap, _, loaded = tiny_capture
    opts = (OuterOption(), OuterOption(sinks=4))
    cal = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16)
    cfg = cal.config
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    rep = account(cfg, shape, 160)
    pv = cfg.provenance
    assert rep.total_bytes == pv["bytes"] and rep.effective_bits == pytest.approx(pv["effective_bits"])
    assert rep.effective_bits <= 4.0
    assert pv["capture"]["weights_sha256"] == cap.attrs["weights_sha256"]
    assert pv["budget_bits"] == 4.0 and pv["objective"] and pv["context_tokens"] == 160
    # the predicted damage of the written config, recomputed from scratch, is the knapsack's
    sens = cal.sensitivity
    p = predict(cap, cfg, queries=16, weights=sens.weights_k, weights_v=sens.weights_v)
    assert p["total"] == pytest.approx(pv["predicted_damage"], rel=1e-4)
    assert p["relative"] == pytest.approx(pv["predicted_relative"], rel=1e-4)
    assert float(p["k"].sum()) == pytest.approx(pv["predicted_k"], rel=1e-4)
    assert pv["objective"] == "predicted_kl" and len(pv["sensitivity"]["weights_k"]) == loaded.n_layers
    assert pv["sensitivity"]["noise"] == "o_proj"
    # with noise in the cached keys and values: a weight per side, sparing the options' sinks
    kv = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16,
                   scores=cal.scores, model=loaded, sensitivity_noise="kv")
    sv = kv.sensitivity
    assert sv.noise == "kv" and sv.sinks == 4 and not np.array_equal(sv.weights_k, sv.weights_v)
    p = predict(cap, kv.config, queries=16, weights=sv.weights_k, weights_v=sv.weights_v)
    assert p["total"] == pytest.approx(kv.config.provenance["predicted_damage"], rel=1e-4)
    with pytest.raises(ConfigError, match="sensitivity_noise"):
        cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, sensitivity_noise="q")
    # round trip of the config file, provenance included
    assert CacheConfig.from_json(cfg.to_json()) == cfg
    # frontier: monotone, and more budget never predicts more damage
    fr = cal.frontier
    assert np.all(np.diff(fr.effective_bits) > 0) and np.all(np.diff(fr.predicted) < 0)
    hi = cal.config_at(6.0)
    assert hi.provenance["predicted_damage"] <= pv["predicted_damage"]
    # deterministic
    cal2 = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, scores=cal.scores)
    assert cal2.config == cfg


def test_salient_tokens_are_counted_against_the_budget(tiny_capture):
    # Salient rows and positions take budget bytes, so the formats chosen with them fit in what
    # is left; the objective scores the formats with each query's salient tokens taken out, and
    # predict() of the written config gives the damage the search chose it at.
    cap, _, loaded = tiny_capture
    opts = (OuterOption(), OuterOption(sinks=4))
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    cal = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, salient=6)
    cfg = cal.config
    sens = cal.sensitivity
    p = predict(cap, cfg, queries=16, weights=sens.weights_k, weights_v=sens.weights_v)
    assert p["total"] == pytest.approx(cfg.provenance["predicted_damage"], rel=1e-4)
    assert p["total"] != pytest.approx(predict(cap, cfg.with_(salient=0), queries=16, weights=sens.weights_k,
                                               weights_v=sens.weights_v)["total"], rel=1e-4)
    rep = account(cfg, shape, 160)
    assert cfg.salient == 6 and cfg.provenance["outer_option"].endswith("/X6")
    assert rep.total_bytes == cfg.provenance["bytes"] and rep.effective_bits <= 4.0
    assert rep.totals.salient > 0
    assert account(cfg.with_(salient=0), shape, 160).total_bytes == rep.total_bytes - rep.totals.salient - (
        rep.totals.padding - account(cfg.with_(salient=0), shape, 160).totals.padding)
    # keys only: half the rows, and the values' bytes as without salient tokens
    keys = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, salient=6,
                  salient_sides="k").config
    kr = account(keys, shape, 160)
    assert keys.salient_sides == "k" and keys.provenance["outer_option"].endswith("/X6k")
    assert kr.total_bytes == keys.provenance["bytes"] and kr.effective_bits <= 4.0
    assert kr.totals.salient == rep.totals.salient // 2
    assert all(e["v"].salient == 0 and e["k"].salient > 0 for e in kr.per_layer)
    # recent rows: the same bytes, other tokens taken out, written and predicted alike
    new = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, salient=6,
                 salient_recent=4)
    nc = new.config
    assert nc.salient_recent == 4 and nc.provenance["outer_option"].endswith("/X6r4")
    assert account(nc, shape, 160).totals.salient == rep.totals.salient
    pn = predict(cap, nc, queries=16, weights=sens.weights_k, weights_v=sens.weights_v)
    assert pn["total"] == pytest.approx(nc.provenance["predicted_damage"], rel=1e-4)
    assert pn["total"] != pytest.approx(predict(cap, nc.with_(salient_recent=0), queries=16, weights=sens.weights_k,
                                                weights_v=sens.weights_v)["total"], rel=1e-4)
    with pytest.raises(ConfigError, match="salient_recent"):
        CalibrationConfig(budgets=3.0, salient=2, salient_recent=3)
    with pytest.raises(ConfigError, match="salient"):
        CalibrationConfig(budgets=3.0, salient=-1)
    with pytest.raises(ConfigError, match="salient_sides"):
        CalibrationConfig(budgets=3.0, salient=2, salient_sides="q")


def test_a_batch_pays_the_static_bytes_once(tiny_capture, tmp_path, capsys):
    """Counted for 8 sequences the budget holds the batch's bytes exactly as ``kverr memory``
    counts them (static scales once); a config of the one-sequence count fits it too, so the
    batch's choice predicts no more damage; engine targets refuse a batch."""
    from kverr.calibration.target import calibrate_for_vllm

    cap, _, loaded = tiny_capture
    cands = (int_format(2, PerChannel()), int_format(3, PerChannel())) + SMALL  # static scales: 2 fp16 per channel
    opts = (OuterOption(sinks=4),)
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    one = cal_at(cap, 3.0, context=160, options=opts, cands_k=cands, cands_v=cands, queries=16, objective="rel")
    eight = cal_at(cap, 3.0, context=160, options=opts, cands_k=cands, cands_v=cands, queries=16, objective="rel",
                   scores=one.scores, batch=8)
    pv = eight.config.provenance
    rep = account(eight.config, shape, 160, batch=8)
    assert pv["batch"] == 8 and one.config.provenance["batch"] == 1
    assert rep.total_bytes == pv["bytes"] and rep.effective_bits == pytest.approx(pv["effective_bits"])
    assert rep.effective_bits <= 3.0
    assert account(eight.config, shape, 160).effective_bits > pv["effective_bits"]  # static bytes in it
    assert account(one.config, shape, 160, batch=8).effective_bits <= 3.0
    assert pv["predicted_damage"] <= one.config.provenance["predicted_damage"]
    fr = eight.frontier.iloc[0]
    cheapest = account(eight.config_at(float(fr.effective_bits)), shape, 160, batch=8)
    assert cheapest.effective_bits == pytest.approx(fr.effective_bits)
    with pytest.raises(ConfigError, match=r"infeasible at 160 tokens x 8 sequences"):
        cal_at(cap, 0.5, context=160, options=opts, cands_k=cands, cands_v=cands, batch=8)
    with pytest.raises(ConfigError, match="batch=0"):
        CalibrationConfig(budgets=3, batch=0)
    with pytest.raises(ConfigError, match="batch=8: the engine targets"):
        calibrate_for_vllm(cap, CalibrationConfig(budgets=3, batch=8))
    # the command line counts the same batch, records it and says so
    from kverr.cli import main

    _, path, _ = tiny_capture
    out = tmp_path / "c.json"
    assert main(["calibrate", "--capture", str(path), "--budget-bits", "3", "--context", "160", "--batch", "8",
                 "--queries", "8", "--workers", "1", "--objective", "rel", "--out", str(out)]) == 0
    assert "effective bits at 160 tokens x 8 sequences" in capsys.readouterr().out
    assert CacheConfig.load(out).provenance["batch"] == 8


def test_max_groups_per_layer_bounds_the_launch_groups(tiny_capture):
    """With at most one (K, V) pair per layer every layer is one launch group; the bound costs
    damage, never bytes over budget; the prediction of the written config is the search's."""
    cap, _, loaded = tiny_capture
    opts = (OuterOption(sinks=4),)
    free = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, objective="rel")
    one = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, objective="rel",
                 scores=free.scores, max_groups_per_layer=1)
    H = loaded.n_kv_heads
    assert max(len(free.config.launch_groups(li, H)) for li in range(loaded.n_layers)) > 1  # the bound binds
    assert all(len(one.config.launch_groups(li, H)) == 1 for li in range(loaded.n_layers))
    pv = one.config.provenance
    assert pv["max_groups_per_layer"] == 1 and "max_groups_per_layer" not in free.config.provenance
    assert pv["effective_bits"] <= 4.0 and pv["predicted_damage"] >= free.config.provenance["predicted_damage"]
    assert account(one.config, ModelShape(loaded.n_layers, H, loaded.head_dim), 160).total_bytes == pv["bytes"]
    assert predict(cap, one.config, queries=16)["total"] == pytest.approx(pv["predicted_damage"], rel=1e-4)
    # a bound of at least the head count is no bound
    same = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, objective="rel",
                  scores=free.scores, max_groups_per_layer=H)
    assert same.config.with_(provenance={}) == free.config.with_(provenance={})
    with pytest.raises(ConfigError, match="max_groups_per_layer=0"):
        CalibrationConfig(budgets=4, max_groups_per_layer=0)


def test_window_per_head_picks_a_window_per_group_counted_and_predicted_alike(tiny_capture, tmp_path, capsys):
    """With ``window_per_head`` each (layer, kv head, K|V) picks its window among the options'
    with its format: the config gives the heads whose window differs an override, its bytes are
    what memory counts, predicting it from scratch gives the search's damage, and it never
    predicts more damage than the best single window within the same budget."""
    cap, _, loaded = tiny_capture
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    opts = tuple(OuterOption(sinks=4, window=w) for w in (0, 16, 48))
    one = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, objective="rel")
    per = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=16, objective="rel",
                 scores=one.scores, window_per_head=True)
    varied = 0
    for b in (3.5, 4.0, 5.0, 6.0):
        cfg, single = per.config_at(b), one.config_at(b)
        pv = cfg.provenance
        assert pv["outer_option"] == "S4/R0|16|48/post"
        assert pv["predicted_damage"] <= single.provenance["predicted_damage"] * (1 + 1e-12)
        assert pv["bytes"] == account(cfg, shape, 160).total_bytes and pv["effective_bits"] <= b
        assert predict(cap, cfg, queries=16)["total"] == pytest.approx(pv["predicted_damage"], rel=1e-4)
        assert CacheConfig.from_json(cfg.to_json()) == cfg
        ch = per.searches[0].choices_at(b)
        for r in ch.itertuples():
            assert cfg.window_for(r.layer, r.kv_head, r.which) == r.window
        varied += cfg.windows_vary
    assert varied  # the freedom is taken somewhere
    with pytest.raises(ConfigError, match="two or more"):
        CalibrationConfig(budgets=3, windows=(16,), window_per_head=True)
    with pytest.raises(ConfigError, match="max_groups_per_layer"):
        CalibrationConfig(budgets=3, windows=(16, 32), window_per_head=True, max_groups_per_layer=1)
    with pytest.raises(ConfigError, match="differ only in their window"):
        cal_at(cap, 3.0, context=160, options=(OuterOption(), OuterOption(sinks=4, window=16)), cands_k=SMALL,
               cands_v=SMALL, queries=16, objective="rel", window_per_head=True)
    # the command line: --window-per-head over the --window lengths
    from kverr.cli import main

    code = main(["calibrate", "--capture", str(tiny_capture[1]), "--budget-bits", "3.5,4,5,6", "--out",
                 str(tmp_path / "w{bits}.json"), "--queries", "16", "--workers", "1", "--objective", "rel",
                 "--sinks", "4", "--window", "0,16,48", "--window-per-head"])
    out = capsys.readouterr().out
    written = [CacheConfig.load(tmp_path / f"w{b}.json") for b in ("3.5", "4", "5", "6")]
    assert code == 0 and any(c.windows_vary and "/R0|16|48/" in c.provenance["outer_option"] for c in written)
    # each budget whose windows vary says how many (layer, kv head, K|V) keep each length
    line = next(ln for ln in out.splitlines() if "window per (layer, kv head)" in ln)
    n = sum(int(m) for m in re.findall(r"x(\d+)", line))
    assert n == 2 * shape.n_layers * shape.n_kv_heads


def test_max_step_time_takes_the_most_groups_that_fit(tiny_capture):
    """A bound on the predicted step time picks, per budget, the most format pairs per layer
    whose prediction fits; a bound nothing meets is refused with the fastest prediction."""
    from kverr.calibration.search import _step_time

    cap, _, loaded = tiny_capture
    base = dict(context=160, options=(OuterOption(sinks=4),), cands_k=SMALL, cands_v=SMALL, queries=16,
                objective="rel")
    free = cal_at(cap, 4.0, **base)
    one = cal_at(cap, 4.0, scores=free.scores, max_groups_per_layer=1, **base)
    at = dict(step_tokens=32768, step_batch=16)
    settings = CalibrationConfig(budgets=4.0, max_step_time=1.0, **at, **base)
    r_free = _step_time(free.config, settings, cap.kv, 160)["ratio"]
    r_one = _step_time(one.config, settings, cap.kv, 160)["ratio"]
    assert r_one < r_free  # fewer launch groups, a faster predicted step
    fit = cal_at(cap, 4.0, scores=free.scores, max_step_time=(r_one + r_free) / 2, **at, **base)
    assert fit.config.with_(provenance={}) == one.config.with_(provenance={})
    st = fit.config.provenance["predicted_step"]
    assert st["ratio"] == pytest.approx(r_one) and (st["tokens"], st["batch"], st["gpu"]) == (32768, 16, "h200")
    # the frontier names each search's bound: the free one (0) and, two kv heads here, one pair
    assert loaded.n_kv_heads == 2 and set(fit.frontier["max_groups_per_layer"]) == {0, 1}
    # every frontier point's predicted step, as the chosen config's own prediction is computed
    steps = fit.frontier_steps()
    assert len(steps) == len(fit.frontier) and (steps["predicted_step"] > 0).all()
    for s in fit.searches:
        rows = steps[steps.max_groups_per_layer == (s.max_groups_per_layer or 0)]
        i = rows["bytes"].searchsorted(fit.config.provenance["bytes"], side="right") - 1
        cfg = s.config_at(float(rows["effective_bits"].iloc[i]))
        assert rows["predicted_step"].iloc[i] == pytest.approx(_step_time(cfg, settings, cap.kv, 160)["ratio"],
                                                               rel=1e-12)
    picked = steps[(steps.max_groups_per_layer == 1) & (steps.bytes == fit.config.provenance["bytes"])]
    assert picked["predicted_step"].tolist() == pytest.approx([st["ratio"]], rel=1e-12)
    loose = cal_at(cap, 4.0, scores=free.scores, max_step_time=r_free * 1.01, **at, **base)
    assert loose.config.with_(provenance={}) == free.config.with_(provenance={})
    with pytest.raises(ConfigError, match=r"with one format pair per layer the predicted decode step takes"):
        cal_at(cap, 4.0, scores=free.scores, max_step_time=r_one / 2, **at, **base)
    with pytest.raises(ConfigError, match="give max_step_time"):
        CalibrationConfig(budgets=4, step_batch=16)
    with pytest.raises(ConfigError, match="gpu='v100'"):
        CalibrationConfig(budgets=4, max_step_time=1.0, gpu="v100")


def test_window_dtype_rule_and_scores_of_another_window_dtype_are_refused(tiny_capture):
    """``auto`` keeps int8 windows below INT8_WINDOW_BELOW_BITS, fp16 from there on; an int8
    window costs fewer bytes for the same formats; damage tables are tied to the dtype the cache
    received its input in."""
    from kverr.calibration.candidates import INT8_WINDOW_BELOW_BITS, window_dtype_for_budget

    assert window_dtype_for_budget(INT8_WINDOW_BELOW_BITS - 0.01) == "int8"
    assert window_dtype_for_budget(INT8_WINDOW_BELOW_BITS) == "fp16"
    assert window_dtype_for_budget(2.0, "bf16") == "bf16"
    with pytest.raises(ConfigError, match="window_dtype='int4' is not known"):
        window_dtype_for_budget(3.0, "int4")
    cap, _, loaded = tiny_capture
    opts = (OuterOption(sinks=4, window=8),)
    cal = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8)
    assert cal.config.window_dtype == "int8" and cal.scores.window_dtype == "int8"
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    assert account(cal.config, shape, 160).total_bytes < account(cal.config.with_(window_dtype="fp16"), shape, 160).total_bytes
    hi = cal_at(cap, 7.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                   sensitivity=cal.sensitivity)
    assert hi.config.window_dtype == "fp16"
    with pytest.raises(ConfigError, match="window_dtype='int8', not 'fp16'"):
        cal_at(cap, 5.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                  scores=cal.scores, window_dtype="fp16")


def test_calibrate_bad_input(tiny_capture):
    cap, _, _ = tiny_capture
    with pytest.raises(ConfigError, match=r"infeasible.*cheapest possible config costs \d+\.\d+ effective bits"):
        cal_at(cap, 1.0, context=160, cands_k=SMALL, cands_v=SMALL, queries=8)
    with pytest.raises(CaptureError, match="every layer"):
        cal_at(cap.isel(layer=[0]), 4.0, cands_k=SMALL, cands_v=SMALL)
    with pytest.raises(ConfigError, match="tensor"):
        cal_at(cap, 4.0, cands_k=(int_format(4, __import__("kverr.quant").quant.PerTensor()),), cands_v=SMALL)


def test_calibration_config_round_trips_and_refuses_bad_fields():
    cfg = CalibrationConfig(budgets=(3, 4.5), context=1280, options=(OuterOption(sinks=4, window=16, key_pre_rope=True),),
                            cands_k=SMALL, cands_v=SMALL[:3], queries=16, decode=64, max_bits=9, objective="rel",
                            name="x")
    d = cfg.to_dict()
    assert d["version"] == 1 and json.loads(json.dumps(d)) == d and cfg.budgets == (3.0, 4.5)
    assert CalibrationConfig.from_dict(d) == cfg and CalibrationConfig.from_json(cfg.to_json()) == cfg
    plain = CalibrationConfig(budgets=4)
    assert CalibrationConfig.from_dict(plain.to_dict()) == plain and plain.frontier_bits == 8.0
    assert CalibrationConfig(budgets=(4, 9.5)).frontier_bits == 9.5
    with pytest.raises(ConfigError, match=r"unknown field calibration config\.budget; allowed fields: .*budgets"):
        CalibrationConfig.from_dict({**plain.to_dict(), "budget": 4})
    with pytest.raises(ConfigError, match="version=2 is not allowed"):
        CalibrationConfig.from_dict({**plain.to_dict(), "version": 2})
    for bad, match in [(dict(budgets=()), "budgets=() is not allowed"),
                       (dict(budgets=(4, float("nan"))), "budgets=nan is not allowed"),
                       (dict(budgets=(4, 4)), "without duplicates"),
                       (dict(budgets=4, candidates="some"), "candidates='some' is not allowed; one of auto, all, dynamic"),
                       (dict(budgets=4, window_dtype="int4"), "window_dtype='int4' is not allowed"),
                       (dict(budgets=4, objective="mse"), "objective='mse' is not allowed; one of kl, rel"),
                       (dict(budgets=4, sensitivity_noise="q"), "sensitivity_noise='q' is not allowed"),
                       (dict(budgets=4, key_rope="mid"), "key_rope='mid' is not allowed; one of post, pre, both"),
                       (dict(budgets=4, queries=0), "queries=0 is not allowed"),
                       (dict(budgets=4, align=24), "align=24 is not allowed"),
                       (dict(budgets=5, max_bits=4), "max_bits=4.0 is not allowed"),
                       (dict(budgets=4, sinks=(-1,)), "sinks=-1 is not allowed"),
                       (dict(budgets=4, cands_k=("int4",)), "cands_k=('int4',) is not allowed"),
                       (dict(budgets=4, options=(OuterOption(),), sinks=(4,)), "leave key_rope, sinks and windows unset")]:
        with pytest.raises(ConfigError, match=re.escape(match)):
            CalibrationConfig(**bad)


def test_calibrate_several_budgets_and_one_form_of_call(tiny_capture):
    """Budgets of one window dtype and candidate set share a search; each search is what a
    calibration at its budget alone gives; options come only in a CalibrationConfig."""
    cap, _, _ = tiny_capture
    settings = CalibrationConfig(budgets=(5.0, 4.0), context=160, options=(OuterOption(sinks=4, window=8),),
                                 cands_k=SMALL, cands_v=SMALL, queries=8, objective="rel")
    cal = calibrate(cap, settings, workers=1)
    assert list(cal.configs) == [5.0, 4.0] and [s.window_dtype for s in cal.searches] == ["int8", "fp16"]
    assert cal.budget_search == {5.0: 1, 4.0: 0} and set(cal.frontier.window_dtype) == {"int8", "fp16"}
    assert cal.config_at(5.0) == cal.configs[5.0] and cal.configs[4.0].window_dtype == "int8"
    assert list(cal.choices[4.0].columns[:4]) == ["layer", "kv_head", "which", "format"]
    with pytest.raises(ConfigError, match=r"read \.configs\[budget\]"):
        cal.config  # noqa: B018
    one = calibrate(cap, settings.with_(budgets=5.0), workers=1)
    assert one.config == cal.configs[5.0] and np.array_equal(one.scores.k, cal.searches[1].scores.k)
    with pytest.raises(ConfigError, match=r"takes a kverr\.calibration\.CalibrationConfig, got float"):
        calibrate(cap, 5.0)
    with pytest.raises(TypeError, match="queries"):
        calibrate(cap, settings, queries=8)


def test_scores_do_not_depend_on_the_scheduler_or_the_workers(tiny_capture):
    """Local threads, the synchronous scheduler and a dask.distributed cluster give the same bits."""
    distributed = pytest.importorskip("distributed")
    from kverr.calibration import score

    cap, _, loaded = tiny_capture
    kw = dict(cands_k=SMALL, cands_v=SMALL[:3], window_dtype="fp16", queries=8,
              options=(OuterOption(), OuterOption(sinks=4, window=8, key_pre_rope=True)))
    ref = score(cap, scheduler="synchronous", **kw)
    assert ref.k.shape == (2, loaded.n_layers, len(SMALL), loaded.n_kv_heads) and ref.v.shape[2] == 3
    runs = [score(cap, workers=2, **kw)]
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address=None) as cluster:
        # by address, with the progress bar: the path `kverr calibrate --scheduler ADDR` takes
        runs.append(score(cap, scheduler=cluster.scheduler_address, progress=True, **kw))
        with distributed.Client(cluster, set_as_default=False) as client:
            runs.append(score(cap, scheduler=client, **kw))
    for s in runs:
        assert np.array_equal(s.k, ref.k) and np.array_equal(s.v, ref.v) and s.layers == ref.layers


def test_config_from_another_model_is_refused(tiny_capture):
    cap, _, loaded = tiny_capture
    cal = cal_at(cap, 8.0, context=160, options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=8)
    check_model_matches(cal.config, loaded.weights_sha256)  # same model: fine
    with pytest.raises(ConfigError, match="calibrated on a capture of"):
        check_model_matches(cal.config, "0" * 64, "other")


def test_cli_calibrate_writes_configs_and_frontier(tiny_capture, tmp_path, capsys):
    from kverr.cli import main

    cap, path, loaded = tiny_capture
    out = tmp_path / "cal-{bits}b.json"
    code = main(["calibrate", "--capture", str(path), "--budget-bits", "3,4,5", "--out", str(out),
                 "--frontier", str(tmp_path / "f.csv"), "--queries", "8", "--workers", "1"])
    o, _ = capsys.readouterr()
    assert code == 0 and "budget 3 bits" in o and "budget 4 bits" in o and "budget 5 bits" in o
    c3 = CacheConfig.load(tmp_path / "cal-3b.json")
    assert c3.provenance["effective_bits"] <= 3.0
    assert (tmp_path / "f.csv").read_text().startswith("option,")
    # --candidates auto: static per-channel scales below 3.5 bits only; the search at 4 bits reuses
    # the 3-bit run's tables (same window dtype), every search its sensitivity; the 5-bit config
    # equals a run with the dynamic set alone
    from kverr.calibration.candidates import STATIC_BELOW_BITS, default_candidates
    from kverr.quant import is_static

    assert 3 < STATIC_BELOW_BITS < 5
    c5 = CacheConfig.load(tmp_path / "cal-5b.json")
    L, H, D = cap.sizes["layer"], cap.sizes["kv_head"], cap.sizes["channel"]
    assert c3.provenance["candidates_k"] == len(default_candidates(D))
    assert c5.provenance["candidates_k"] == len(default_candidates(D, static=False)) < len(default_candidates(D))
    assert not any(is_static(c5.format_for(l, h, w).granularity) and c5.format_for(l, h, w).dtype == "int"
                   for l in range(L) for h in range(H) for w in "kv")
    fr = __import__("pandas").read_csv(tmp_path / "f.csv")
    assert set(fr["candidates"]) == {"all", "dynamic"}
    # --window-dtype auto: int8 windows below 4.75 bits, fp16 from there on (its own frontier)
    c4 = CacheConfig.load(tmp_path / "cal-4b.json")
    assert (c3.window_dtype, c4.window_dtype, c5.window_dtype) == ("int8", "int8", "fp16")
    assert set(zip(fr["window_dtype"], fr["candidates"])) == {("int8", "all"), ("int8", "dynamic"), ("fp16", "dynamic")}
    assert c4.provenance["candidates_k"] == c5.provenance["candidates_k"]
    code = main(["calibrate", "--capture", str(path), "--budget-bits", "5", "--out", str(tmp_path / "d.json"),
                 "--queries", "8", "--workers", "1", "--candidates", "dynamic"])
    assert code == 0
    d5 = CacheConfig.load(tmp_path / "d.json")
    assert d5.with_(provenance={}) == c5.with_(provenance={})
    capsys.readouterr()
    # a generous step-time bound keeps the free config and says what it predicts
    code = main(["calibrate", "--capture", str(path), "--budget-bits", "5", "--out", str(tmp_path / "t.json"),
                 "--queries", "8", "--workers", "1", "--candidates", "dynamic", "--max-step-time", "100",
                 "--step-at", "4096,16", "--frontier", str(tmp_path / "ft.csv")])
    o, _ = capsys.readouterr()
    assert code == 0 and "predicted decode step" in o and "at 4096 tokens x batch 16 on h200 (bound 100x)" in o
    ft = __import__("pandas").read_csv(tmp_path / "ft.csv")
    ratio = CacheConfig.load(tmp_path / "t.json").provenance["predicted_step"]["ratio"]
    assert (ft["predicted_step"] > 0).all() and ratio == pytest.approx(
        ft.loc[ft["bytes"] == CacheConfig.load(tmp_path / "t.json").provenance["bytes"], "predicted_step"].iloc[0])
    assert CacheConfig.load(tmp_path / "t.json").with_(provenance={}) == c5.with_(provenance={})
    code = main(["calibrate", "--capture", str(path), "--budget-bits", "5", "--out", str(tmp_path / "u.json"),
                 "--step-at", "4096,16"])
    assert code == 2 and "give max_step_time" in capsys.readouterr().err
    code = main(["calibrate", "--capture", str(path), "--budget-bits", "0.5", "--out", str(tmp_path / "x.json")])
    _, err = capsys.readouterr()
    assert code == 2 and "cheapest possible config costs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_cli_default_options_are_the_library_defaults(tiny_capture, tmp_path, capsys, monkeypatch):
    """`kverr calibrate` asks for the CalibrationConfig defaults, so it tries the library's default
    (sinks, window) pairs (S0/R0, S4/R16, S4/R32, S4/R64), with pre-RoPE keys when the capture has
    them (--key-rope both: each post and pre); --sinks/--window cross instead."""
    import kverr.calibration as kc
    from kverr.calibration.search import DEFAULT_OPTIONS
    from kverr.cli import main

    seen = []
    real = kc.calibrate

    def spy(capture, settings, **kw):
        assert settings.with_(key_rope=None, sinks=None, windows=None) == CalibrationConfig(budgets=5.0, queries=8)
        cal = real(capture, settings, **kw)
        seen.append(cal.options)
        return cal

    monkeypatch.setattr(kc, "calibrate", spy)
    _, path, _ = tiny_capture
    for extra, want in (([], {o for o in DEFAULT_OPTIONS if o.key_pre_rope}),  # capture holds k_pre: pre
                        (["--key-rope", "both"], set(DEFAULT_OPTIONS)),
                        (["--sinks", "0,2", "--window", "8", "--key-rope", "post"],
                         {kc.OuterOption(window=8, sinks=s) for s in (0, 2)})):
        assert main(["calibrate", "--capture", str(path), "--budget-bits", "5", "--out", str(tmp_path / "c.json"),
                     "--queries", "8", "--workers", "1", "--overwrite", *extra]) == 0
        assert set(seen[-1]) == want
    capsys.readouterr()
    assert len(DEFAULT_OPTIONS) == 8 and {o.key_pre_rope for o in DEFAULT_OPTIONS} == {False, True}
    # the CLI's literal choices (it does not import the torch-heavy modules to register) are the library's
    from kverr.calibration.candidates import CALIBRATION_WINDOW_DTYPES, CANDIDATE_SETS
    from kverr.calibration.sensitivity import NOISE_SITES
    from kverr.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["calibrate"]
    choices = {a.dest: a.choices for a in sub._actions}
    assert tuple(choices["candidates"]) == CANDIDATE_SETS
    assert tuple(choices["sensitivity_noise"]) == tuple(NOISE_SITES)
    assert tuple(choices["window_dtype"]) == CALIBRATION_WINDOW_DTYPES


def test_evaluate_refuses_a_config_calibrated_on_another_model(tiny_capture):
    from kverr.capturing import load_text
    from kverr.evaluation import Scheme, evaluate

    cap, _, loaded = tiny_capture
    cal = cal_at(cap, 8.0, context=160, options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=8)
    prov = dict(cal.config.provenance)
    prov["capture"] = {**prov["capture"], "weights_sha256": "0" * 64, "model_id": "another/model"}
    other = cal.config.with_(provenance=prov)
    text = load_text("pydoc")
    with pytest.raises(ConfigError, match="calibrated on a capture of 'another/model'"):
        evaluate(loaded, text, [Scheme("other", "kverr", other)], prefill=(8,), decode=2, offset=0,
                 progress=False)
    # The same model's calibrated config and configs without provenance pass the check.
    df = evaluate(loaded, text, [Scheme("same", "kverr", cal.config),
                                 Scheme("plain", "kverr", cal.config.with_(provenance={}))],
                  prefill=(8,), decode=2, offset=0, greedy_steps=0, progress=False)
    assert set(df["scheme"]) >= {"same", "plain"}


def test_batched_scoring_equals_one_candidate_at_a_time_and_the_oracle():
    """score_layer (one oracle call per format, K/V/pre-RoPE stacked, damage in batches) gives
    exactly what the one-candidate path through kverr.quant.reconstruct gives."""
    from kverr.calibration.objective import key_error, score_layer, value_error

    q, k, v, kv_map = _layer(seed=5)
    from kverr.rope import apply_rope, default_inv_freq

    rope = {"inv_freq": default_inv_freq(k.shape[-1], 10000.0).tolist()}

    T = k.shape[1]
    k_pre = k
    k_post = apply_rope(k_pre, np.arange(T), rope).to(torch.float32)
    prep = prepare_layer(q, k_post, v, k_pre, layer=0, kv_map=kv_map, scale=0.2, queries=10,
                         positions=np.arange(T), rope=rope)
    cands = SMALL[:5]
    opts = [OuterOption(), OuterOption(sinks=3), OuterOption(window=5, key_pre_rope=True)]
    dk1, dv1 = score_layer(prep, cands, cands[1:], opts, batch=1)
    dk3, dv3 = score_layer(prep, cands, cands[1:], opts, batch=3)
    np.testing.assert_array_equal(dk1, dk3)
    np.testing.assert_array_equal(dv1, dv3)
    for j, f in enumerate(cands):
        for i, o in enumerate(opts):
            cfg = CacheConfig(k=f, v=f, key_pre_rope=o.key_pre_rope)
            np.testing.assert_allclose(dk1[i, j], key_damage(prep, key_error(prep, cfg), [o])[0], rtol=1e-5)
    for j, f in enumerate(cands[1:]):
        np.testing.assert_allclose(dv1[:, j], value_damage(prep, value_error(prep, CacheConfig(k=f, v=f)), opts),
                                   rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# measured layer sensitivity (the "kl" objective)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["mistral", "gpt_oss", "gemma3"])
def sliding_capture(tmp_path_factory, request):
    """A tiny Mistral (sliding window 40 in both layers), gpt-oss (window 32, then a full layer;
    learned sinks) or Gemma 3 (two layers of window 32, one full; a RoPE per layer type), 160
    tokens captured."""
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.capturing.tiny import make_tiny_model
    from kverr.io import open_capture

    d = tmp_path_factory.mktemp("cal-sliding")
    loaded = load_model(str(make_tiny_model(d / "m", request.param)))
    text = load_text("pydoc")
    path = capture_to_zarr(loaded, tokenize(loaded.tokenizer, text, 160, 0), d / "cap.zarr", text=text)
    return open_capture(path), path, loaded


def test_sensitivity_runner_reproduces_the_model(tiny_capture):
    """The layer-by-layer runner (clean pass, then layers l.. on the suffix over a cache of the
    prefix) gives the model's own logits; a run from any layer restores the cache."""
    _check_runner(*tiny_capture[::2])


def test_sensitivity_runner_reproduces_a_sliding_window_model(sliding_capture):
    """The same with sliding-window layers whose window (40, 32) is shorter than the prefix
    (70), and gpt-oss's sinks and alternating layer types."""
    _check_runner(*sliding_capture[::2])


def _check_runner(cap, loaded):
    from kverr.calibration.sensitivity import _Runner

    ids = torch.as_tensor(np.asarray(cap["token_id"].values[:100], dtype=np.int64))
    P = 70
    with torch.no_grad():
        full = torch.log_softmax(loaded.model(ids[None], use_cache=False).logits[0, P:].double(), -1)
        r = _Runner(loaded.model, ids, P)
        hs: list = []
        h = r.clean(hs)
        sel = torch.arange(100 - P)
        torch.testing.assert_close(r.logp(h, sel)[0], full, atol=1e-5, rtol=0)
        r.fill_prefix(2)
        for start in (0, 1, loaded.n_layers - 1):
            hb = r.run(hs[start].expand(2, -1, -1), start)
            torch.testing.assert_close(r.logp(hb, sel)[1], full, atol=1e-5, rtol=0)
            assert all(lay.keys.shape[-2] == P for lay in r.cache.layers)


def test_calibration_of_a_sliding_window_model(sliding_capture):
    """Sliding layers hold their window of the 160 tokens: the budget counts what they hold (the
    written bytes are memory's with the windows, not without), the damage is the one the windows
    (and sinks) let queries see, and the prediction of the written config is the search's."""
    cap, _, loaded = sliding_capture
    shape = cap.kv.shape
    assert shape.sliding_windows in ((40,) * loaded.n_layers, (32, 0), (32, 32, 0))
    cal = cal_at(cap, 4.0, context=160, options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=16)
    cfg, pv = cal.config, cal.config.provenance
    rep = account(cfg, shape, 160)
    assert rep.total_bytes == pv["bytes"] and rep.effective_bits <= 4.0
    assert account(cfg, ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim), 160).total_bytes > pv["bytes"]
    sens = cal.sensitivity
    p = predict(cap, cfg, queries=16, weights=sens.weights_k, weights_v=sens.weights_v)
    assert p["total"] == pytest.approx(pv["predicted_damage"], rel=1e-4)
    full = cap.drop_vars("sliding_window").assign_attrs(model_sliding_windows=[])
    unmasked = cal_at(full, 4.0, context=160, options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=16,
                      sensitivity=sens)
    assert not np.allclose(unmasked.scores.k, cal.scores.k, rtol=1e-3)


def _suffix_run(model, ids, P, edit=None, o_noise=None):
    """The model itself over a fresh cache of the prompt ``ids[:P]`` (``edit``ed), then the suffix:
    log-probabilities at the suffix and each layer's o_proj input there (``o_noise = (layer, x)``
    adds ``x`` to that layer's o_proj input)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids[None, :P], cache=cache, use_cache=True)
    if edit is not None:
        edit(cache)
    got, hooks = {}, []
    for i, lay in enumerate(model.model.layers):
        def pre(_m, a, i=i):
            got[i] = a[0][0].double()
            if o_noise is not None and o_noise[0] == i:
                return (a[0] + o_noise[1],)
        hooks.append(lay.self_attn.o_proj.register_forward_pre_hook(pre))
    try:
        out = model(ids[None, P:], cache=cache, use_cache=True).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(out.double(), -1), got


def test_sensitivity_equals_a_direct_noise_injection(tiny_capture):
    """For both noise sites, KL and r of every (site, layer, eps) equal a from-scratch run of the
    model -- a prompt cache filled by the model itself, the same noise added to layer l's o_proj
    input at the suffix, or to its cached keys (values) past the sinks, the suffix run over it --
    and w = KL / r; small eps is in the linear regime."""
    from kverr.calibration.sensitivity import Sensitivity, measure_sensitivity

    cap, _, loaded = tiny_capture
    ids = torch.as_tensor(np.asarray(cap["token_id"].values[:120], dtype=np.int64))
    noisy, eps, sinks = 40, (1e-2, 2e-2), 3
    P = 120 - noisy
    model = loaded.model
    so = measure_sensitivity(loaded, ids, noisy=noisy, eps=eps, kl_positions=1000, seed=3)
    s = measure_sensitivity(loaded, ids, noisy=noisy, eps=eps, kl_positions=1000, noise="kv", sinks=sinks, seed=3)
    assert so.kl.shape == (1, loaded.n_layers, 2) and s.kl.shape == (2, loaded.n_layers, 2)
    with torch.no_grad():
        ref, o_ref = _suffix_run(model, ids, P)
        kl_of = lambda lp: float((ref.exp() * (ref - lp)).sum(-1).clamp(min=0).mean())  # noqa: E731
        for i in range(loaded.n_layers):
            # o_proj noise
            n = model.model.layers[i].self_attn.o_proj.in_features
            msq = float((o_ref[i] ** 2).sum(-1).mean())
            z = torch.randn((noisy, n), generator=torch.Generator().manual_seed(3 * 1_000_003 + i)) * np.sqrt(msq / n)
            for j, e in enumerate(eps):
                lp, _ = _suffix_run(model, ids, P, o_noise=(i, (e * z).float()))
                assert so.kl[0, i, j] == pytest.approx(kl_of(lp), rel=2e-3)
            # kv noise
            g = torch.Generator().manual_seed(3 * 1_000_003 + i)
            probe = {}
            _suffix_run(model, ids, P, edit=lambda c: probe.update(k=c.layers[i].keys[0], v=c.layers[i].values[0]))
            noise = []
            for x in (probe["k"], probe["v"]):
                z = torch.randn(x.shape, generator=g)
                z[:, :sinks] = 0
                noise.append(z * x.pow(2).mean((-2, -1), keepdim=True).sqrt())
            for side in (0, 1):
                for j, e in enumerate(eps):
                    def edit(c, side=side, e=e):
                        lay = c.layers[i]
                        if side == 0:
                            lay.keys = lay.keys + e * noise[0]
                        else:
                            lay.values = lay.values + e * noise[1]
                    lp, o = _suffix_run(model, ids, P, edit=edit)
                    r = float(((o[i] - o_ref[i]) ** 2).sum(-1).mean() / (o_ref[i] ** 2).sum(-1).mean())
                    assert r > 0
                    assert s.kl[side, i, j] == pytest.approx(kl_of(lp), rel=2e-3, abs=1e-12)
                    assert s.rel[side, i, j] == pytest.approx(r, rel=2e-3)
    np.testing.assert_allclose(so.weights_k, so.kl[0, :, 0] / eps[0] ** 2)
    np.testing.assert_array_equal(so.weights_k, so.weights_v)
    np.testing.assert_allclose(s.weights_k, s.kl[0, :, 0] / s.rel[0, :, 0])
    np.testing.assert_allclose(s.weights_v, s.kl[1, :, 0] / s.rel[1, :, 0])
    for x in (so, s):
        np.testing.assert_allclose(x.quadratic_ratio, 1.0, atol=0.05)
        assert Sensitivity.from_dict(json.loads(json.dumps(x.to_dict()))).to_dict() == x.to_dict()
    assert s.kl_positions == noisy and s.noisy == noisy and s.tokens == 120 and s.sinks == sinks and s.noise == "kv"
    # a record of the earlier o_proj measurement (one weight per layer) reads as o_proj noise
    old = Sensitivity.from_dict({"weights": [1.0, 2.0], "kl": [[1e-4, 4e-4], [2e-4, 8e-4]], "eps": [0.01, 0.02],
                                 "tokens": 640, "noisy": 128, "kl_positions": 128})
    np.testing.assert_array_equal(old.weights_v, [1.0, 2.0])
    np.testing.assert_allclose(old.quadratic_ratio, [[1.0, 1.0]])
    with pytest.raises(ConfigError, match="sinks"):
        measure_sensitivity(loaded, ids, noisy=noisy, eps=eps, noise="kv", sinks=P)
    with pytest.raises(ConfigError, match="noise"):
        measure_sensitivity(loaded, ids, noisy=noisy, eps=eps, noise="q")


def test_kl_objective_with_equal_weights_is_the_rel_objective(tiny_capture):
    """Weights multiply each layer's relative damage: equal weights choose exactly the configs of
    the unweighted objective; a weight concentrated on one layer moves bytes to that layer."""
    from kverr.calibration import Sensitivity

    cap, _, loaded = tiny_capture
    L = loaded.n_layers
    opts = (OuterOption(),)
    rel = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8, objective="rel")
    assert rel.config.provenance["objective"] == "rel_attn_out_sq" and "sensitivity" not in rel.config.provenance

    def sens(w, wv=None):
        return Sensitivity.uniform(w, wv, eps=(0.01, 0.02), tokens=160, noisy=32, kl_positions=32)

    eq = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                   scores=rel.scores, sensitivity=sens([2.0] * L))
    assert eq.config.heads == rel.config.heads and (eq.config.k, eq.config.v) == (rel.config.k, rel.config.v)
    assert eq.config.provenance["predicted_damage"] == pytest.approx(2 * rel.config.provenance["predicted_damage"])
    bytes_of = lambda cal, layer: int(cal.choices[4.0].loc[cal.choices[4.0].layer == layer, "bytes"].sum())  # noqa: E731
    for hot in range(L):
        w = [1e-3] * L
        w[hot] = 1.0
        c = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                      scores=rel.scores, sensitivity=sens(w))
        assert bytes_of(c, hot) >= bytes_of(rel, hot)
        assert c.config.provenance["sensitivity"]["weights_k"][hot] == 1.0
    # a side weighted up gets bytes from the other one
    side_bytes = lambda cal, w: int(cal.choices[4.0].loc[cal.choices[4.0].which == w, "bytes"].sum())  # noqa: E731
    kh = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                   scores=rel.scores, sensitivity=sens([1.0] * L, [1e-3] * L))
    vh = cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, queries=8,
                   scores=rel.scores, sensitivity=sens([1e-3] * L, [1.0] * L))
    assert side_bytes(kh, "k") > side_bytes(vh, "k") and side_bytes(kh, "v") < side_bytes(vh, "v")
    with pytest.raises(ConfigError, match="objective"):
        cal_at(cap, 4.0, context=160, cands_k=SMALL, cands_v=SMALL, objective="mse")
    with pytest.raises(ConfigError, match="layer weights"):
        cal_at(cap, 4.0, context=160, options=opts, cands_k=SMALL, cands_v=SMALL, scores=rel.scores,
                  sensitivity=sens([1.0] * (L + 1)))


def test_kl_objective_refuses_another_model(tiny_capture, tmp_path):
    from kverr.capturing import load_model
    from kverr.capturing.tiny import make_tiny_model

    cap, _, loaded = tiny_capture
    other = load_model(str(make_tiny_model(tmp_path / "o", "llama", seed=1)))
    with pytest.raises(CaptureError, match="not with the model given"):
        cal_at(cap, 4.0, context=160, cands_k=SMALL, cands_v=SMALL, model=other)
    with pytest.raises(CaptureError, match="token_id"):
        cal_at(cap.drop_vars("token_id"), 4.0, context=160, cands_k=SMALL, cands_v=SMALL)
    # a capture whose model cannot be found by its recorded name
    bad = cap.assign_attrs(model_id=str(tmp_path / "nowhere"))
    with pytest.raises(CaptureError, match="neither the default model nor a local"):
        cal_at(bad, 4.0, context=160, cands_k=SMALL, cands_v=SMALL)


def test_cli_calibrate_objectives(tiny_capture, tmp_path, capsys):
    from kverr.cli import main

    _, path, _ = tiny_capture
    for obj in ("kl", "rel"):
        out = tmp_path / f"{obj}.json"
        assert main(["calibrate", "--capture", str(path), "--budget-bits", "4", "--out", str(out),
                     "--queries", "8", "--workers", "1", "--objective", obj]) == 0
        o, _ = capsys.readouterr()
        pv = CacheConfig.load(out).provenance
        assert pv["objective"] == {"kl": "predicted_kl", "rel": "rel_attn_out_sq"}[obj]
        assert ("layer sensitivity (o_proj noise) on 160 tokens" in o) == (obj == "kl") and ("sensitivity" in pv) == (obj == "kl")


# ---------------------------------------------------------------------------------------------
# the shared reconstruction used by scoring: the oracle, bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,T,wdt", [pytest.param(0, 437, "fp16", marks=pytest.mark.float_order), (29, 512, "int8")])
def test_shared_reconstruct_equals_the_oracle_for_every_default_candidate(layer, T, wdt):
    """Real keys and values (the bundled capture, layer 0 or 29), every default candidate plus
    static, percentile and symmetric formats, a length that leaves partial token blocks; the
    cache receiving fp16, or int8 rows."""
    from kverr.calibration.candidates import CALIBRATION_MSE_CLIP
    from kverr.calibration.fastrecon import SharedReconstruct
    from kverr.catalog import codebook_candidates
    from kverr.io import open_capture
    from kverr.quant import Percentile
    from kverr.quant.store import reconstruct

    cap = open_capture("data/smollm2-pydoc-512.zarr")
    extra = (int_format(4, PerChannel(32), clip=Percentile(99.0)), int_format(4, PerHead(), symmetric=True),
             int_format(3, PerTokenGroup(16), symmetric=True, clip=CALIBRATION_MSE_CLIP), float_format("bf16"))
    sel = cap.sel(layer=layer)
    x = torch.cat([torch.as_tensor(sel["k"].values[:, :T]), torch.as_tensor(sel["v"].values[:, :T])])
    shared = SharedReconstruct(x, window_dtype=wdt)
    for f in (*default_candidates(64), *codebook_candidates(64), *extra):
        want = reconstruct(x, CacheConfig(k=f, v=f, window_dtype=wdt), layer=0, which="k")
        got = shared(f)
        assert got.dtype == torch.float32 and torch.equal(got, want), f.label()


# ---------------------------------------------------------------------------------------------
# several captures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_capture(tiny_capture, tmp_path_factory):
    """``(capture, its path)``: the 160 pydoc tokens after the tiny capture's, on the same model."""
    from kverr.capturing import capture_to_zarr, load_text, tokenize
    from kverr.io import open_capture

    _, _, loaded = tiny_capture
    text = load_text("pydoc")
    ids = tokenize(loaded.tokenizer, text, 160, 160)
    path = capture_to_zarr(loaded, ids, tmp_path_factory.mktemp("cal2") / "cap2.zarr", text=text, offset=160)
    return open_capture(path), path


def test_several_captures_average_tables_and_sensitivity(tiny_capture, second_capture):
    """Calibrating on two captures scores each as alone, averages the damage tables and the layer
    weights (the captures counting alike) and solves the knapsack once on the means: the config
    is the one a single capture's calibration chooses from those means, and its provenance names
    both captures. The tables of one capture are the same bits however often it is scored (one
    torch thread per layer task), so the mean of two tables of one capture is that table."""
    from kverr.calibration import Sensitivity
    from kverr.calibration.search import Scores

    (a_cap, _, loaded), (b_cap, _) = tiny_capture, second_capture
    kw = dict(context=160, options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=8)
    a = cal_at(a_cap, 3.0, model=loaded, **kw)
    b = cal_at(b_cap, 3.0, model=loaded, **kw)
    assert not np.array_equal(a.scores.k, b.scores.k)  # two texts: the average is not trivially one of them
    both = calibrate([a_cap, b_cap], CalibrationConfig(budgets=3.0, **kw), model=loaded, workers=1)
    np.testing.assert_array_equal(both.scores.k, (a.scores.k + b.scores.k) / 2)
    np.testing.assert_array_equal(both.scores.v, (a.scores.v + b.scores.v) / 2)
    for side in ("weights_k", "weights_v"):
        np.testing.assert_array_equal(getattr(both.sensitivity, side),
                                      (getattr(a.sensitivity, side) + getattr(b.sensitivity, side)) / 2)
    # the knapsack on the means, run from one capture, chooses the same config
    again = cal_at(a_cap, 3.0, scores=Scores.mean([a.scores, b.scores]),
                   sensitivity=Sensitivity.mean([a.sensitivity, b.sensitivity]), **kw)
    assert (both.config.k, both.config.v, both.config.heads) == (again.config.k, again.config.v, again.config.heads)
    pv = both.config.provenance
    assert [c["token_offset"] for c in pv["captures"]] == [0, 160]
    assert pv["capture"] == a.config.provenance["capture"] and "captures" not in a.config.provenance
    assert pv["sensitivity"]["captures"] == 2
    assert Sensitivity.from_dict(pv["sensitivity"]).extra == {"captures": 2}
    # the config's damage on each capture, under the averaged weights, is what predicting it there
    # gives, and the objective their mean
    for c, d in zip((a_cap, b_cap), pv["predicted_damage_each"]):
        got = predict(c, both.config, queries=8, weights=both.sensitivity.weights_k,
                      weights_v=both.sensitivity.weights_v)
        assert got["total"] == pytest.approx(d, rel=1e-4)  # float32 sums grouped otherwise, as above
    assert np.mean(pv["predicted_damage_each"]) == pytest.approx(pv["predicted_damage"], rel=1e-12)
    assert "predicted_damage_each" not in again.config.provenance  # scores given: no capture's own
    assert both.config.provenance["predicted_damage"] == pytest.approx(again.config.provenance["predicted_damage"])
    # one capture twice: the mean is that capture's tables, the config its own
    twice = calibrate([a_cap, a_cap], CalibrationConfig(budgets=3.0, **kw), model=loaded, workers=1)
    np.testing.assert_array_equal(twice.scores.k, a.scores.k)
    assert (twice.config.k, twice.config.v, twice.config.heads) == (a.config.k, a.config.v, a.config.heads)


def test_several_captures_refused_when_they_cannot_be_averaged(tiny_capture, second_capture):
    from kverr.calibration.search import Scores

    (a_cap, _, loaded), (b_cap, _) = tiny_capture, second_capture
    kw = dict(options=(OuterOption(),), cands_k=SMALL, cands_v=SMALL, queries=8, objective="rel")
    with pytest.raises(CaptureError, match="capture 2 is of .* calibrate on captures of one model"):
        calibrate([a_cap, b_cap.assign_attrs(weights_sha256="1" * 64, model_id="other")],
                  CalibrationConfig(budgets=4.0, context=160, **kw), workers=1)
    with pytest.raises(CaptureError, match="capture 2 .*n_kv_heads 1.* not of capture 1's model"):
        calibrate([a_cap, b_cap.isel(kv_head=[0], q_head=[0, 1])], CalibrationConfig(budgets=4.0, context=160, **kw),
                  workers=1)
    with pytest.raises(CaptureError, match="at least one capture"):
        calibrate([], CalibrationConfig(budgets=4.0, **kw), workers=1)
    with pytest.raises(CaptureError, match="capture 2 has layers"):
        calibrate([a_cap, b_cap.isel(layer=[0])], CalibrationConfig(budgets=4.0, context=160, **kw), workers=1)
    short = b_cap.isel(token=slice(0, 128))
    with pytest.raises(ConfigError, match="hold 160, 128 tokens: give the context"):
        calibrate([a_cap, short], CalibrationConfig(budgets=4.0, **kw), workers=1)
    # with the context given, captures of different lengths are averaged
    calibrate([a_cap, short], CalibrationConfig(budgets=4.0, context=128, **kw), workers=1)
    with pytest.raises(ConfigError, match="several captures need refit_widths"):
        calibrate([a_cap, b_cap], CalibrationConfig(budgets=3.0, context=160, candidates="fitted",
                                                    queries=8, objective="rel"), workers=1)
    # the kl objective loads the model once and checks every capture against it
    with pytest.raises(CaptureError, match="does not record its model's weights sha256"):
        calibrate([a_cap, b_cap.assign_attrs(weights_sha256="")],
                  CalibrationConfig(budgets=4.0, context=160, options=(OuterOption(),), cands_k=SMALL,
                                    cands_v=SMALL, queries=8), model=loaded, workers=1)
    a = calibrate(a_cap, CalibrationConfig(budgets=4.0, context=160, **kw), workers=1).scores
    with pytest.raises(ConfigError, match="computed alike; these differ in queries"):
        Scores.mean([a, dataclasses.replace(a, queries=16)])


def test_cli_calibrate_on_several_captures(tiny_capture, second_capture, tmp_path, capsys):
    from kverr.cli import main

    (_, a, _), (_, b) = tiny_capture, second_capture
    out = tmp_path / "two.json"
    args = ["calibrate", "--capture", str(a), str(b), "--budget-bits", "4", "--queries", "8", "--workers", "1"]
    assert main(args + ["--out", str(out)]) == 0
    o, _ = capsys.readouterr()
    assert re.search(r"averaged over 2 captures: .*cap\.zarr \(pydoc.*tokens 0\.\.159\); .*cap2\.zarr .*tokens "
                     r"160\.\.319\)", o), o
    assert re.search(r"\n  on each capture: [0-9.e-]+, [0-9.e-]+\n", o), o
    pv = CacheConfig.load(out).provenance
    assert [c["token_offset"] for c in pv["captures"]] == [0, 160] and pv["sensitivity"]["captures"] == 2
    code = main(args + ["--capture", str(a), os.path.relpath(a), "--out", str(tmp_path / "x.json")])
    _, err = capsys.readouterr()
    assert code != 0 and "names a capture twice" in err, err
    assert not (tmp_path / "x.json").exists()


def test_several_captures_with_static_moments_score_under_their_mean(tiny_capture, second_capture):
    """With static moments a config rounds every key under the moments it carries: of two
    captures, their moments averaged, and each capture is scored under those, so the config's
    predicted damage on each capture is what predicting it there (under its moments) gives."""
    from kverr.calibration.objective import capture_key_moments

    (a_cap, _, loaded), (b_cap, _) = tiny_capture, second_capture
    ints = (int_format(2, PerToken()), int_format(3, PerToken()), int_format(4, PerTokenGroup(16)),
            float_format("fp16"))
    kw = dict(budgets=6.0, context=160, options=(OuterOption(),), cands_k=ints, cands_v=ints, queries=8,
              compensated_keys=True, static_moments=True, decode=4)
    both = calibrate([a_cap, b_cap], CalibrationConfig(**kw), model=loaded, workers=1)
    cfg, pv = both.config, both.config.provenance
    mean = capture_key_moments([a_cap, b_cap])
    assert cfg.key_moments == mean and mean != capture_key_moments(a_cap) and mean != capture_key_moments(b_cap)
    for c, d in zip((a_cap, b_cap), pv["predicted_damage_each"]):
        got = predict(c, cfg, queries=8, weights=both.sensitivity.weights_k, weights_v=both.sensitivity.weights_v,
                      decode=4)
        assert got["total"] == pytest.approx(d, rel=1e-4)  # float32 sums grouped otherwise, as above
    # the stored mean: each capture's moments as stored, averaged, stored again
    np.testing.assert_array_equal(mean.layer(1), capture_key_moments(
        [a_cap.isel(layer=[1]), b_cap.isel(layer=[1])]).layer(0))
