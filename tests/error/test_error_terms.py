"""The attention-error terms (kverr.error.terms): against the plain per-query reference
(kverr.error.naive), and the proof that both of their users -- the streaming decomposition and
the calibration objective -- take the math from them instead of deriving it again.

Tolerances are in float64 units ``EPS``: every comparison here is float64 against float64, so
the bounds are a modest multiple of ``n·EPS`` times the size of the quantities summed, stated
beside each claim.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.calibration import objective
from kverr.calibration.candidates import OuterOption
from kverr.calibration.objective import key_damage_batch, prepare_layer, value_damage_batch
from kverr.error import decompose, decompose_stream, terms
from kverr.error.naive import decompose_query
from kverr.exceptions import ConfigError, ShapeError

EPS = float(np.finfo(np.float64).eps)


def gamma(n: int) -> float:
    """Worst-case relative error of an ``n``-term float64 sum (Higham, ch. 3)."""
    return n * EPS / (1 - n * EPS)


def _row(seed: int, T: int = 23, D: int = 8, Dv: int = 5, ek: float = 0.3, ev: float = 0.2):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=D)
    k = 1.5 * rng.normal(size=(T, D))
    v = rng.normal(size=(T, Dv))
    return q, k, v, k + ek * rng.normal(size=k.shape), v + ev * rng.normal(size=v.shape)


# ---------------------------------------------------------------------------------------------
# the terms against the definitions
# ---------------------------------------------------------------------------------------------


@given(st.integers(0, 10**6), st.sampled_from([1e-3, 0.1, 1.0, 4.0]), st.integers(1, 23))
def test_every_form_of_the_weight_change_and_terms_is_the_definition(seed, ek, n_vis):
    """The three cancellation-free forms of δa, the output terms, the first-order change and KL,
    each against kverr.error.naive on one query's visible keys."""
    q, k, v, kh, vh = _row(seed, ek=ek)
    c = 0.35
    ref = decompose_query(q, k, v, kh, vh, c, n_visible=n_vis)
    a = torch.from_numpy(ref.attn)[None]  # [1, T]
    ds = torch.from_numpy(ref.delta_logits)[None]
    V, EV, VH = (torch.from_numpy(x[:n_vis]) for x in (v, vh - v, vh))
    # sizes the roundings scale with: |δs| up to max|δs|, e^{δs} up to e^{max|δs|}
    big = float(np.exp(np.abs(ref.delta_logits).max()))
    vmax = float(np.abs(v).max() + np.abs(vh).max())
    tol_w = 16 * gamma(n_vis + 8) * big * (1 + float(np.abs(ref.delta_logits).max()))
    da_ref = ref.attn_hat - ref.attn  # naive subtraction: absolute error ~EPS, fine at these sizes

    da1 = terms.weight_change(a, ds)[0].numpy()
    np.testing.assert_allclose(da1, da_ref, rtol=0, atol=tol_w)

    Z = 3.7  # any positive scale of the unnormalised weights p = Z·a
    p = a * Z
    u = terms.growth(p, ds)
    dlse = terms.delta_lse(u.sum(-1), p.sum(-1))
    c_mul, c_add = terms.weight_change_factors(dlse)
    e1 = torch.expm1(ds)
    da2 = terms.weight_change_from_expm1(p, e1, c_mul, c_add)
    assert da2.data_ptr() == e1.data_ptr()  # in place, as documented
    np.testing.assert_allclose(da2[0].numpy() / Z, da_ref, rtol=0, atol=tol_w)

    ua = terms.growth(a, ds)
    us, z = terms.growth_normaliser(ua)
    o = a @ V
    key3 = terms.key_term_from_growth(ua, us, z, V, o)[0].numpy()
    np.testing.assert_allclose(key3, ref.key_term, rtol=0, atol=tol_w * vmax * n_vis)

    tset = terms.output_terms(a @ torch.cat([V, EV], -1), torch.from_numpy(da1)[None] @ terms.value_stack(V, VH))
    tol_o = tol_w * vmax * n_vis
    for name, want in (("out", ref.out), ("value", ref.value_term), ("key", ref.key_term),
                       ("cross", ref.cross_term), ("total", ref.total)):
        np.testing.assert_allclose(tset[name][0].numpy(), want, rtol=0, atol=tol_o, err_msg=name)
    np.testing.assert_allclose(terms.key_term(torch.from_numpy(da1)[None], V)[0].numpy(), ref.key_term,
                               rtol=0, atol=tol_o)
    np.testing.assert_allclose(terms.value_term(a, EV)[0].numpy(), ref.value_term, rtol=0, atol=tol_o)

    mu = (a * ds).sum(-1)
    lin = terms.first_order_weight_change(a, ds.clone(), mu)[0].numpy()
    np.testing.assert_allclose(lin, ref.first_order_weight_change, rtol=0,
                               atol=4 * gamma(n_vis) * float(np.abs(ref.delta_logits).max()))
    # KL = δlse − μ: both sides are O(|δs|) and their difference O(|δs|²), so the absolute error
    # is a few ulps of |δs| (the naive Σ a·(log a − log a′) likewise, of the logits' size)
    kl = float(terms.kl_divergence(dlse, mu)[0])
    smax = float(np.abs(c * (k[:n_vis] @ q)).max() + np.abs(ref.delta_logits).max())
    assert abs(kl - ref.kl) <= 16 * gamma(n_vis + 8) * (1 + smax)


def test_tiny_key_error_weight_change_keeps_relative_accuracy():
    """At |δs| ~ 1e-9 the naive subtraction a′ − a has lost most digits; every form here keeps
    them, so the sharp reference is the first-order change (exact to O(δs²))."""
    q, k, v, kh, vh = _row(4, ek=1e-9)
    ref = decompose_query(q, k, v, kh, vh, 0.35)
    a = torch.from_numpy(ref.attn)[None]
    ds = torch.from_numpy(ref.delta_logits)[None]
    lin = ref.first_order_weight_change
    # The logsumexp form (overflow-proof, for huge errors) adds δs to log a: it keeps δs only to
    # EPS·|log a| absolutely, so its error is a few EPS·a·(1 + |log a|) per weight
    an = ref.attn
    np.testing.assert_allclose(terms.weight_change(a, ds)[0].numpy(), lin, rtol=1e-6,
                               atol=8 * EPS * np.max(an * (1 - np.log(an))))
    # the streaming form keeps full relative accuracy: the O(|δs|) ~ 1e-9 second-order term
    p = a * 2.0
    dlse = terms.delta_lse(terms.growth(p, ds).sum(-1), p.sum(-1))
    da = terms.weight_change_from_expm1(p, torch.expm1(ds), *terms.weight_change_factors(dlse))
    np.testing.assert_allclose(da[0].numpy() / 2.0, lin, rtol=1e-6, atol=0)


def test_naive_reference_rejects_bad_shapes():
    q, k, v, kh, vh = _row(0)
    with pytest.raises(ShapeError, match="n_visible"):
        decompose_query(q, k, v, kh, vh, 0.3, n_visible=0)
    with pytest.raises(ShapeError, match="q \\[D\\]"):
        decompose_query(q[None], k, v, kh, vh, 0.3)


# ---------------------------------------------------------------------------------------------
# the streaming decomposition against the naive reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream,block", [(False, None), (True, 7)])
@pytest.mark.parametrize("ek", [1e-3, 0.3, 3.0])
def test_decompose_equals_the_naive_reference_per_query(stream, block, ek):
    """Causal GQA decomposition (direct and streamed in 7-key blocks), every query of every query
    head against decompose_query on that query's visible keys."""
    rng = np.random.default_rng(11)
    hq, hkv, Q, T, D = 4, 2, 6, 29, 8
    kv_map = np.array([1, 0, 1, 0])
    q = rng.normal(size=(hq, Q, D))
    k = 1.5 * rng.normal(size=(hkv, T, D))
    v = rng.normal(size=(hkv, T, D))
    kh = k + ek * rng.normal(size=k.shape)
    vh = v + 0.2 * rng.normal(size=v.shape)
    c = 0.4
    fn = decompose_stream if stream else decompose
    d = fn(q, k, v, kh, vh, causal=True, scale=c, kv_head_of_q=kv_map, block_size=block)
    for h in range(hq):
        kh_i = kv_map[h]
        for i in range(Q):
            ref = decompose_query(q[h, i], k[kh_i], v[kh_i], kh[kh_i], vh[kh_i], c, n_visible=T - Q + i + 1)
            size = float(np.exp(np.abs(ref.delta_logits).max())) * (np.abs(v).max() + np.abs(vh).max())
            # naive a′ − a: absolute error ~γ(T) per weight; summed over T keys of size max|v|
            tol = 16 * gamma(2 * T + D) * size * T
            for name in ("key_term", "value_term", "cross_term", "total", "out"):
                np.testing.assert_allclose(getattr(d, name)[h, i], getattr(ref, name), rtol=0, atol=tol,
                                           err_msg=f"{name} head {h} query {i}")
            kl = d.metrics["kl"][h, i]
            assert abs(kl - ref.kl) <= tol * (1 + np.abs(q).max() * np.abs(k).max() * D), (h, i)
            fo = np.linalg.norm(ref.first_order_key_term - ref.key_term) / np.linalg.norm(ref.key_term)
            np.testing.assert_allclose(d.metrics["first_order_key_err"][h, i], fo, rtol=1e-6 if ek > 1e-3 else 1e-3)


# ---------------------------------------------------------------------------------------------
# the calibration objective against the naive reference
# ---------------------------------------------------------------------------------------------


def _prep64(seed: int, decode: int | None):
    """A LayerPrep whose tensors are float64 (the objective's arithmetic follows their dtype), so
    that its math can be held to float64 bounds; float32 rounding is the other test's concern."""
    g = torch.Generator().manual_seed(seed)
    Hq, H, T, D = 4, 2, 64, 8
    q = torch.randn(Hq, T, D, generator=g)
    k = torch.randn(H, T, D, generator=g) * 2
    v = torch.randn(H, T, D, generator=g)
    kv_map = np.array([0, 1, 1, 0])
    c = 0.3
    prep = prepare_layer(q, k, v, None, layer=0, kv_map=kv_map, scale=c, queries=9, decode=decode)
    qs = q.double()[:, prep.pos] * c
    s = torch.einsum("hnd,htd->hnt", qs, k.double()[prep.kv_map]).masked_fill(prep.causal == 0, -torch.inf)
    a = torch.softmax(s, -1)
    o = torch.einsum("hnt,htd->hnd", a, v.double()[prep.kv_map])
    prep = dataclasses.replace(prep, q=qs, k=k.double(), v=v.double(), a=a, o=o)
    return prep, (q.double().numpy(), k.double().numpy(), v.double().numpy(), kv_map, c)


def _naive_damage(prep, arrays, e_k, e_v, opt: OuterOption, e_gen=None):
    """Relative key and value damage ``[kv_head]`` by the objective's definition, one query at a
    time through decompose_query, and a float64 rounding bound on the difference to the objective.
    With ``e_gen`` each decode-step query's key error is ``e_gen`` on the tokens generated after
    its prompt (``t > p − 1 − step``) and ``e_k`` on the others.

    Per entry of a query's key term (worst case, Higham ch. 3; every sum has at most T + D
    terms, γ = γ(2(T + D))):

    * the objective's growth form (uV − o·Σu)/z sums Σ|u||v| + |o||Σu| ≤ (a′ + a/z)·|v| + |o|(1 + 1/z),
      each off by γ of its size; its fallback a·expm1(δs − δlse) by EPS·(|δs| + |δlse|) per weight;
    * δs itself is off by η = γ·c·Σ_d|q_d||e_d|, which moves a′ by at most 2η relatively;
    * the naive softmaxes are off by γ·(1 + max|s + δs|) per weight.

    A sum of squares ‖t‖² then moves by at most 2‖t‖·δ + δ² with δ = √D times the entry bound.
    """
    q, k, v, kv_map, c = arrays
    H, T, D = k.shape
    gam = gamma(2 * (T + D))
    dk, dv, bk, bv = (np.zeros(H) for _ in range(4))
    n = len(prep.pos)

    def moved(t2: float, entry: float) -> float:
        d = np.sqrt(D) * entry
        return 2 * np.sqrt(t2) * d + d * d

    for i, p in enumerate(prep.pos.numpy()):
        w = opt.window if prep.steps is None else min(opt.window, int(prep.steps[i]) + 1)
        m = np.zeros((T, 1))
        m[opt.sinks: max(opt.sinks, p - w + 1)] = 1.0
        for h in range(q.shape[0]):
            j = kv_map[h]
            src = e_k[j]
            if e_gen is not None:
                src = np.where((np.arange(T) > p - 1 - int(prep.steps[i]))[:, None], e_gen[j], e_k[j])
            ek, ev = m * src, m * e_v[j]
            rk = decompose_query(q[h, p], k[j], v[j], k[j] + ek, v[j], c, n_visible=p + 1)
            rv = decompose_query(q[h, p], k[j], v[j], k[j], v[j] + ev, c, n_visible=p + 1)
            tk, tv = np.sum(rk.key_term ** 2), np.sum(rv.value_term ** 2)
            dk[j] += tk / n
            dv[j] += tv / n
            ds = rk.delta_logits
            top = ds.max()
            lz = np.log(np.sum(rk.attn * np.exp(ds - top))) + top  # δlse
            inv_z = np.exp(max(-lz, 0.0))  # 1 / min(z, 1)
            vmax, onorm = np.abs(v[j, : p + 1]).max(), np.linalg.norm(rk.out)
            eta = gam * c * np.max(np.abs(ek[: p + 1]) @ np.abs(q[h, p]))
            smax = np.max(np.abs(c * (k[j, : p + 1] @ q[h, p]))) + np.abs(ds).max()
            entry = (4 * gam * (2 + inv_z) * (vmax + onorm) + 4 * eta * vmax
                     + 4 * EPS * (np.abs(ds).max() + abs(lz)) * vmax + 2 * gam * (1 + smax) * vmax)
            bk[j] += moved(tk, entry) / n
            bv[j] += moved(tv, 2 * gam * (1 + smax) * np.abs(ev).max()) / n
    return dk / prep.norm, dv / prep.norm, bk / prep.norm, bv / prep.norm


@pytest.mark.parametrize("block", [64, 4])
@pytest.mark.parametrize("decode", [None, 3])
@pytest.mark.parametrize("big", [0.05, 60.0, 3000.0])
def test_objective_damage_equals_the_naive_reference(decode, big, block, monkeypatch):
    """key_damage_batch / value_damage_batch against decompose_query per query, every outer option
    of a batch at once: the growth form (small and large errors) and, where e^{δs} overflows even
    float64 (|δs| ~ 1e3), the logsumexp fallback; the 9 queries in one block, and in blocks of 4
    that each see only the tokens up to their last query (the bound is per query either way)."""
    monkeypatch.setattr(objective, "QUERY_BLOCK", block)
    prep, arrays = _prep64(2, decode)
    blocks = objective.query_blocks(prep)
    assert len(blocks) == -(-9 // block)
    assert (blocks[0][3] < prep.k.shape[1]) == (len(blocks) > 1)  # a first block of several sees fewer tokens
    H, T, D = prep.k.shape
    g = torch.Generator().manual_seed(7)
    e = torch.randn((2, H, T, D), generator=g, dtype=torch.float64) * big
    e[1, :, :4] *= 50.0  # huge errors on the sinks, which the masks must hide
    opts = [OuterOption(), OuterOption(sinks=4), OuterOption(sinks=2, window=5)]
    got_k = key_damage_batch(prep, e, opts)
    got_v = value_damage_batch(prep, e, opts)
    for ci in range(2):
        for oi, opt in enumerate(opts):
            dk, dv, bk, bv = _naive_damage(prep, arrays, e[ci].numpy(), e[ci].numpy(), opt)
            assert np.all(np.abs(got_k[ci, oi] - dk) <= bk), (ci, opt, got_k[ci, oi], dk, bk)
            assert np.all(np.abs(got_v[ci, oi] - dv) <= bv), (ci, opt, got_v[ci, oi], dv, bv)


@pytest.mark.parametrize("block", [64, 4])
def test_generated_keys_take_their_own_error(block, monkeypatch):
    """With decode steps, ``e_generated`` is what each query sees on the keys its sequence
    generated after its prompt, ``e_k`` on its prompt's: against decompose_query per query with
    that error spliced in; and the splice matters (some query sees generated keys quantized)."""
    monkeypatch.setattr(objective, "QUERY_BLOCK", block)
    prep, arrays = _prep64(3, 16)
    H, T, D = prep.k.shape
    g = torch.Generator().manual_seed(11)
    e, e_gen = (torch.randn((1, H, T, D), generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    opts = [OuterOption(), OuterOption(sinks=2, window=3)]
    got = key_damage_batch(prep, e, opts, e_gen)
    plain = key_damage_batch(prep, e, opts)
    for oi, opt in enumerate(opts):
        dk, _, bk, _ = _naive_damage(prep, arrays, e[0].numpy(), e[0].numpy(), opt, e_gen=e_gen[0].numpy())
        assert np.all(np.abs(got[0, oi] - dk) <= bk), (opt, got[0, oi], dk, bk)
        assert np.all(np.abs(plain[0, oi] - dk) > bk), (opt, plain[0, oi], dk)
    with pytest.raises(ConfigError, match="decode"):
        key_damage_batch(_prep64(3, None)[0], e, opts, e_gen)


# ---------------------------------------------------------------------------------------------
# both users take the math from kverr.error.terms
# ---------------------------------------------------------------------------------------------

#: What each user must call (the rest of kverr.error.terms may be used by either).
STREAM_USES = {"delta_lse", "weight_change_factors", "weight_change_from_expm1", "first_order_weight_change",
               "kl_divergence", "value_stack", "output_terms"}
OBJECTIVE_FAST = {"growth", "growth_normaliser", "key_term_from_growth", "value_term"}
OBJECTIVE_FALLBACK = {"weight_change", "key_term"}


def _count(monkeypatch) -> dict[str, int]:
    calls = {n: 0 for n in terms.__all__}
    for n in terms.__all__:
        f = getattr(terms, n)

        def wrapped(*a, _f=f, _n=n, **kw):
            calls[_n] += 1
            return _f(*a, **kw)

        monkeypatch.setattr(terms, n, wrapped)
    return calls


def _poison(monkeypatch, name: str, factor: float = 1.5) -> None:
    """Make ``terms.name`` return its result times ``factor`` (tuples: every element)."""
    f = getattr(terms, name)

    def poisoned(*a, **kw):
        r = f(*a, **kw)
        if isinstance(r, tuple):
            return tuple(x * factor for x in r)
        if isinstance(r, dict):
            return {k_: x * factor for k_, x in r.items()}
        return r.mul_(factor) if name.endswith("expm1") or name == "first_order_weight_change" else r * factor

    monkeypatch.setattr(terms, name, poisoned)


def _decomp_inputs():
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 5, 8))
    k = 1.5 * rng.normal(size=(1, 17, 8))
    v = rng.normal(size=(1, 17, 8))
    return q, k, v, k + 0.3 * rng.normal(size=k.shape), v + 0.2 * rng.normal(size=v.shape)


def test_decompose_routes_every_term_through_the_terms_module(monkeypatch):
    arrs = _decomp_inputs()
    clean = decompose(*arrs, kv_head_of_q=[0, 0])
    calls = _count(monkeypatch)
    again = decompose_stream(*arrs, kv_head_of_q=[0, 0], block_size=6)
    assert {n for n, c in calls.items() if c} >= STREAM_USES, calls
    np.testing.assert_allclose(again.total, clean.total, rtol=0, atol=1e-14)
    monkeypatch.undo()
    # poisoned definitions show up in the results: the engine does not compute them itself
    for name, field in (("weight_change_from_expm1", "key_term"), ("output_terms", "total"),
                        ("kl_divergence", "kl"), ("value_stack", "value_term"),
                        ("first_order_weight_change", "first_order_key_err"), ("delta_lse", "cross_term")):
        with monkeypatch.context() as mp:
            _poison(mp, name)
            bad = decompose(*arrs, kv_head_of_q=[0, 0])
            got = bad.metrics[field] if field in bad.metrics else getattr(bad, field)
            want = clean.metrics[field] if field in clean.metrics else getattr(clean, field)
            assert not np.allclose(got, want), name


def test_objective_routes_every_term_through_the_terms_module(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g) * 2, torch.randn(2, 64, 8, generator=g)
    prep = prepare_layer(q, k, v, None, layer=0, kv_map=[0, 1, 1, 0], scale=0.3, queries=9)  # float32, as in use
    small = torch.randn((1, 2, 64, 8), generator=g) * 0.05
    huge = small * 1200.0  # |δs| ~ 100: e^{δs} overflows float32, so the float64 fallback runs
    opts = [OuterOption(), OuterOption(sinks=3)]
    clean = {"small": key_damage_batch(prep, small, opts), "huge": key_damage_batch(prep, huge, opts),
             "v": value_damage_batch(prep, small, opts)}
    calls = _count(monkeypatch)
    key_damage_batch(prep, small, opts)
    value_damage_batch(prep, small, opts)
    assert {n for n, c in calls.items() if c} >= OBJECTIVE_FAST, calls
    calls.update({n: 0 for n in calls})
    key_damage_batch(prep, huge, opts)
    assert {n for n, c in calls.items() if c} >= OBJECTIVE_FALLBACK, calls
    monkeypatch.undo()
    for name, which in (("key_term_from_growth", "small"), ("growth", "small"), ("weight_change", "huge"),
                        ("key_term", "huge"), ("value_term", "v")):
        with monkeypatch.context() as mp:
            _poison(mp, name)
            fn = value_damage_batch if which == "v" else key_damage_batch
            got = fn(prep, small if which != "huge" else huge, opts)
            assert not np.allclose(got, clean[which]), name
