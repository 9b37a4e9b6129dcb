"""Array core of kverr.error: the exact identity, its limits, and invariances.

References here are the *definitions* of attention (softmax of scaled logits, weighted sum),
evaluated naively in float64; no quantization is involved (perturbations are synthetic).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.error import QUERY_METRICS, decompose, decompose_stream
from kverr.error.naive import decompose_query
from kverr.exceptions import DTypeError, NonFiniteError, ShapeError

# ---------------------------------------------------------------------------------------------
# naive float64 reference (definitions only): kverr.error.naive, one query at a time
# ---------------------------------------------------------------------------------------------


def _mask(Q, T, causal, window=0):
    if not causal:
        return np.ones((Q, T), bool)
    pos = (np.arange(Q) + T - Q)[:, None]
    seen = np.arange(T)[None, :] <= pos
    return seen & (np.arange(T)[None, :] > pos - window) if window else seen


def naive(q, k, v, kh, vh, causal=True, scale=None, window=0, sink=None):
    """:func:`kverr.error.naive.decompose_query` over ``q [..., Q, D]`` and ``k, v [..., T, ·]``
    (batch dims broadcast; causal: the queries are the last Q positions, each seeing its last
    ``window`` keys when a window is given; ``sink`` logits broadcast against the batch dims).
    Rows ``[..., Q, T]`` are 0 (weights) or −inf (logits) at hidden keys."""
    q, k, v, kh, vh = (np.asarray(x, np.float64) for x in (q, k, v, kh, vh))
    D = q.shape[-1]
    Q, T, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1 / np.sqrt(D) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q = np.broadcast_to(q, batch + (Q, D))
    k, kh = (np.broadcast_to(x, batch + (T, D)) for x in (k, kh))
    v, vh = (np.broadcast_to(x, batch + (T, Dv)) for x in (v, vh))
    msk = _mask(Q, T, causal, window)
    sinks = None if sink is None else np.broadcast_to(np.asarray(sink, np.float64), batch)
    rows = {n: np.zeros(batch + (Q, T)) for n in ("attn", "attn_hat")}
    rows.update({n: np.full(batch + (Q, T), -np.inf) for n in ("s", "s2")})
    outs = {n: np.zeros(batch + (Q, Dv)) for n in ("key_term", "value_term", "cross_term", "total", "out")}
    outs["kl"] = np.zeros(batch + (Q,))
    for b in np.ndindex(batch):
        for i in range(Q):
            seen = np.flatnonzero(msk[i])  # the visible keys are contiguous
            r = decompose_query(q[b][i], k[b], v[b], kh[b], vh[b], scale, n_visible=seen[-1] + 1,
                                window=window if causal else 0, sink=None if sinks is None else sinks[b])
            outs["kl"][b + (i,)] = r.kl
            for name, x in (("attn", r.attn), ("attn_hat", r.attn_hat), ("s", r.logits),
                            ("s2", r.logits + r.delta_logits)):
                rows[name][b + (i, slice(seen[0], seen[-1] + 1))] = x
            for name in ("key_term", "value_term", "cross_term", "total", "out"):
                outs[name][b + (i,)] = getattr(r, name)
    return {**rows, **outs, "mask": msk}


def make(rng, batch=(2,), Q=4, T=9, D=8, Dv=None, ek=0.05, ev=0.05, dtype=np.float64, kscale=1.5):
    Dv = D if Dv is None else Dv
    q = rng.normal(size=(*batch, Q, D))
    k = kscale * rng.normal(size=(*batch, T, D))
    v = rng.normal(size=(*batch, T, Dv))
    kh = k + ek * rng.normal(size=k.shape)
    vh = v + ev * rng.normal(size=v.shape)
    return tuple(x.astype(dtype) for x in (q, k, v, kh, vh))


shapes = st.tuples(
    st.integers(1, 3),  # batch
    st.integers(1, 6),  # Q
    st.integers(0, 12),  # T - Q
    st.sampled_from([1, 2, 5, 8, 16]),  # D
    st.integers(0, 2**31 - 1),  # seed
    st.sampled_from([0.0, 1e-6, 1e-3, 0.1, 1.0]),  # key error size
    st.sampled_from([0.0, 1e-6, 1e-3, 0.1, 1.0]),  # value error size
    st.booleans(),  # causal
)


# ---------------------------------------------------------------------------------------------
# the identity and the definitions
# ---------------------------------------------------------------------------------------------


@given(shapes)
def test_terms_sum_to_total_float64(p):
    b, Q, dT, D, seed, ek, ev, causal = p
    rng = np.random.default_rng(seed)
    q, k, v, kh, vh = make(rng, (b,), Q, Q + dT, D, ek=ek, ev=ev)
    d = decompose(q, k, v, kh, vh, causal=causal)
    s = d.key_term + d.value_term + d.cross_term
    scale = np.abs(d.out).max() + np.abs(vh).max()
    np.testing.assert_allclose(s, d.total, rtol=0, atol=64 * np.finfo(np.float64).eps * scale)
    ref = naive(q, k, v, kh, vh, causal)
    # Every field against the naive definition (the naive subtraction is the less accurate one).
    for name in ("attn", "attn_hat", "key_term", "value_term", "cross_term", "total", "out"):
        np.testing.assert_allclose(getattr(d, name), ref[name], rtol=0,
                                   atol=256 * np.finfo(np.float64).eps * scale, err_msg=name)
    np.testing.assert_allclose(s, ref["total"], rtol=0, atol=256 * np.finfo(np.float64).eps * scale)


@given(shapes)
def test_zero_key_error_gives_zero_key_and_cross(p):
    b, Q, dT, D, seed, _, ev, causal = p
    rng = np.random.default_rng(seed)
    q, k, v, _, vh = make(rng, (b,), Q, Q + dT, D, ev=ev)
    d = decompose(q, k, v, k.copy(), vh, causal=causal)
    assert np.all(d.delta_logits == 0)
    assert np.all(d.key_term == 0) and np.all(d.cross_term == 0)
    np.testing.assert_array_equal(d.attn, d.attn_hat)
    assert np.all(d.metrics["kl"] == 0) and np.all(d.metrics["tv"] == 0)
    np.testing.assert_allclose(d.value_term, d.total, atol=1e-14 * (1 + np.abs(v).max()))


@given(shapes)
def test_zero_value_error_gives_zero_value_and_cross(p):
    b, Q, dT, D, seed, ek, _, causal = p
    rng = np.random.default_rng(seed)
    q, k, v, kh, _ = make(rng, (b,), Q, Q + dT, D, ek=ek)
    d = decompose(q, k, v, kh, v.copy(), causal=causal)
    assert np.all(d.value_term == 0) and np.all(d.cross_term == 0)
    np.testing.assert_allclose(d.key_term, d.total, atol=1e-14 * (1 + np.abs(v).max()))


def test_no_error_at_all_is_exactly_zero():
    rng = np.random.default_rng(1)
    q, k, v, _, _ = make(rng)
    d = decompose(q, k, v, k, v)
    for name in ("key_term", "value_term", "cross_term"):
        assert np.all(getattr(d, name) == 0), name
    # total is formed from its definition a′V̂ − aV, so it is zero to round-off only
    np.testing.assert_allclose(d.total, 0, atol=4 * np.finfo(np.float64).eps * np.abs(v).max())
    assert np.all(d.metrics["top1_flip"] == 0)
    assert np.all(d.metrics["rank_flips"] == 0)
    assert np.all(d.metrics["topk_overlap"] == 1)


def test_tiny_key_error_keeps_relative_accuracy():
    """δa is formed without cancellation: a 1e-9 key error still gives an accurate key term."""
    rng = np.random.default_rng(2)
    q, k, v, _, _ = make(rng, (1,), 3, 7, 8)
    ek = 1e-9 * rng.normal(size=k.shape)
    d = decompose(q, k, v, k + ek, v)
    # first order is exact to O(eps²) here, so it is a sharp reference
    a = d.attn
    ds = d.delta_logits
    lin = a * (ds - (a * ds).sum(-1, keepdims=True))
    np.testing.assert_allclose(d.key_term, lin @ v, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_dtype_and_library_round_trip(dtype, lib):
    rng = np.random.default_rng(3)
    arrs = make(rng, (2, 3), 4, 10, 16, dtype=dtype)
    if lib == "torch":
        arrs = tuple(torch.from_numpy(a) for a in arrs)
    d = decompose(*arrs)
    ref = naive(*(np.asarray(a) for a in arrs))
    for name in ("key_term", "value_term", "cross_term", "total"):
        x = getattr(d, name)
        if lib == "torch":
            assert isinstance(x, torch.Tensor) and x.dtype == arrs[0].dtype
            x = x.numpy()
        else:
            assert isinstance(x, np.ndarray) and x.dtype == dtype
        assert x.shape == (2, 3, 4, 16)
        tol = 1e-13 if dtype == np.float64 else 2e-6
        np.testing.assert_allclose(x, ref[name], rtol=0, atol=tol * np.abs(ref["out"]).max(),
                                   err_msg=name)
    assert d.attn.shape == (2, 3, 4, 10)
    for n in QUERY_METRICS:
        assert d.metrics[n].shape == (2, 3, 4), n


def test_float32_terms_are_accurate_relative_to_themselves():
    """In float32 the key term is accurate relative to its own size, not just to ‖o‖."""
    rng = np.random.default_rng(4)
    q, k, v, kh, vh = make(rng, (4,), 8, 64, 32, ek=1e-3, ev=1e-3)
    d32 = decompose(*(x.astype(np.float32) for x in (q, k, v, kh, vh)))
    d64 = decompose(q, k, v, kh, vh)
    for name in ("key_term", "value_term", "cross_term"):
        a, b = getattr(d32, name), getattr(d64, name)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-4, (name, rel)


# ---------------------------------------------------------------------------------------------
# first order and metrics against their definitions
# ---------------------------------------------------------------------------------------------


def test_first_order_error_shrinks_quadratically():
    rng = np.random.default_rng(5)
    q, k, v, _, _ = make(rng, (3,), 6, 20, 16)
    direction = rng.normal(size=k.shape)
    errs = []
    for eps in (1e-1, 1e-2, 1e-3):
        kh = k + eps * direction
        d = decompose(q, k, v, kh, v)
        a, ds = d.attn, d.delta_logits
        lin = a * (ds - (a * ds).sum(-1, keepdims=True))  # (diag(a) − aaᵀ)δs
        exact = d.attn_hat - d.attn
        errs.append(np.abs(lin - exact).max())
        # the engine's own first-order metric: relative error ∝ eps
        assert np.nanmax(d.metrics["first_order_err"]) < 50 * eps
    # absolute error of the linearisation is O(eps²): a 10x smaller step, ~100x smaller error
    r1, r2 = errs[0] / errs[1], errs[1] / errs[2]
    assert 50 < r1 < 200 and 80 < r2 < 120, (r1, r2)


@given(shapes)
def test_metrics_match_definitions(p):
    b, Q, dT, D, seed, ek, ev, causal = p
    rng = np.random.default_rng(seed)
    q, k, v, kh, vh = make(rng, (b,), Q, Q + dT, D, ek=ek, ev=ev)
    d = decompose(q, k, v, kh, vh, causal=causal, topk=3)
    r = naive(q, k, v, kh, vh, causal)
    msk = r["mask"]
    a, a2 = r["attn"], r["attn_hat"]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(msk, a * (np.log(np.where(msk, a, 1)) - np.log(np.where(msk, a2, 1))), 0)
        ent = -np.where(msk & (a > 0), a * np.log(np.where(a > 0, a, 1)), 0).sum(-1)
    kl = kl.sum(-1)
    m = d.metrics
    # naive KL suffers cancellation; compare with an absolute floor
    np.testing.assert_allclose(m["kl"], kl, rtol=1e-6, atol=1e-13)
    assert np.all(m["kl"] >= 0)
    np.testing.assert_allclose(m["tv"], 0.5 * np.abs(a2 - a).sum(-1), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(m["entropy"], ent, rtol=1e-9, atol=1e-12)
    with np.errstate(invalid="ignore"):
        ds = np.where(msk, r["s2"] - r["s"], 0)
    nvis = msk.sum(-1)
    np.testing.assert_allclose(m["logit_max_abs"], np.abs(ds).max(-1), rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(m["logit_rms"], np.sqrt((ds**2).sum(-1) / nvis), rtol=1e-7,
                               atol=1e-12)
    srt = -np.sort(-np.where(msk, r["s"], -np.inf), axis=-1)
    margin = np.where(nvis >= 2, srt[..., 0] - srt[..., 1 if srt.shape[-1] > 1 else 0], np.nan)
    np.testing.assert_allclose(m["margin"], margin, rtol=1e-9, atol=1e-12)
    on = np.linalg.norm(r["out"], axis=-1)
    np.testing.assert_allclose(m["out_norm"], on, rtol=1e-9)
    np.testing.assert_allclose(m["total_rel"], np.linalg.norm(r["total"], axis=-1) / on,
                               rtol=1e-6, atol=1e-12)
    # top-1 flip against arg-max (ties are measure-zero with continuous data)
    flip = (np.argmax(r["s"], -1) != np.argmax(r["s2"], -1)).astype(float)
    np.testing.assert_array_equal(m["top1_flip"], flip)
    assert np.all((m["topk_overlap"] >= 0) & (m["topk_overlap"] <= 1))


def test_rank_flips_and_overlap_on_a_constructed_case():
    # one query, keys with logits 4, 3, 2, 1, 0 (D=1, q=1, scale=1); perturb to swap 3 and 2
    s = np.array([4.0, 3.0, 2.0, 1.0, 0.0])
    q = np.ones((1, 1))
    k = s[:, None]
    kh = k.copy()
    kh[1, 0], kh[2, 0] = 2.0, 3.0
    kh[4, 0] = 5.0  # the last key jumps to the top
    v = np.eye(5)
    d = decompose(q, k, v, kh, v, causal=False, scale=1.0, topk=3)
    m = d.metrics
    assert m["top1_flip"][0] == 1.0
    # top-3 clean: {0,1,2}; perturbed: {4,0,2}; overlap 2/3
    assert m["topk_overlap"][0] == pytest.approx(2 / 3)
    # among clean top-3 (0,1,2) under perturbed logits (4,2,3): pair (1,2) flips
    assert m["rank_flips"][0] == 1.0
    assert m["margin"][0] == pytest.approx(1.0)
    assert m["logit_max_abs"][0] == pytest.approx(5.0)
    assert m["sensitivity"][0] == pytest.approx(5.0)


# ---------------------------------------------------------------------------------------------
# invariances
# ---------------------------------------------------------------------------------------------


def test_invariant_to_logit_shift_per_query():
    """Adding the same vector to every key (both clean and reconstructed) shifts each query's
    logits uniformly: softmax and hence every term are unchanged."""
    rng = np.random.default_rng(6)
    q, k, v, kh, vh = make(rng, (2,), 5, 12, 8)
    c = rng.normal(size=(2, 1, 8))
    d0 = decompose(q, k, v, kh, vh)
    d1 = decompose(q, k + c, v, kh + c, vh)
    for name in ("key_term", "value_term", "cross_term", "total"):
        np.testing.assert_allclose(getattr(d1, name), getattr(d0, name), atol=1e-12)


def test_invariant_to_joint_rotation_of_channels():
    rng = np.random.default_rng(7)
    q, k, v, kh, vh = make(rng, (2,), 5, 12, 8)
    R, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    d0 = decompose(q, k, v, kh, vh)
    d1 = decompose(q @ R, k @ R, v, kh @ R, vh)
    for name in ("key_term", "value_term", "cross_term", "total"):
        np.testing.assert_allclose(getattr(d1, name), getattr(d0, name), atol=1e-12)
    # and rotating value channels rotates every output term
    d2 = decompose(q, k, v @ R, kh, vh @ R)
    for name in ("key_term", "value_term", "cross_term", "total"):
        np.testing.assert_allclose(getattr(d2, name), getattr(d0, name) @ R, atol=1e-12)


def test_key_permutation_invariance_without_mask():
    rng = np.random.default_rng(8)
    q, k, v, kh, vh = make(rng, (2,), 5, 12, 8)
    perm = rng.permutation(12)
    d0 = decompose(q, k, v, kh, vh, causal=False)
    d1 = decompose(q, k[:, perm], v[:, perm], kh[:, perm], vh[:, perm], causal=False)
    for name in ("key_term", "value_term", "cross_term", "total"):
        np.testing.assert_allclose(getattr(d1, name), getattr(d0, name), atol=1e-12)
    for n in ("kl", "tv", "entropy", "margin", "rank_flips", "topk_overlap"):
        np.testing.assert_allclose(d1.metrics[n], d0.metrics[n], atol=1e-12, err_msg=n)


def test_value_term_is_linear_in_value_error():
    rng = np.random.default_rng(9)
    q, k, v, kh, vh = make(rng, (2,), 5, 12, 8)
    d1 = decompose(q, k, v, kh, v + (vh - v))
    d2 = decompose(q, k, v, kh, v + 2 * (vh - v))
    np.testing.assert_allclose(d2.value_term, 2 * d1.value_term, atol=1e-13)
    np.testing.assert_allclose(d2.key_term, d1.key_term, atol=1e-13)


def test_scale_argument():
    rng = np.random.default_rng(10)
    q, k, v, kh, vh = make(rng, (2,), 5, 12, 8)
    d0 = decompose(q, k, v, kh, vh, scale=0.7)
    d1 = decompose(q * 0.7 * np.sqrt(8), k, v, kh, vh)
    np.testing.assert_allclose(d0.total, d1.total, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# batching, GQA, query positions
# ---------------------------------------------------------------------------------------------


def test_broadcast_batch_dims_fold_into_queries():
    rng = np.random.default_rng(11)
    q = rng.normal(size=(3, 4, 5, 8))  # [kv?, group, Q, D]
    k = rng.normal(size=(3, 1, 9, 8))
    v = rng.normal(size=(3, 1, 9, 8))
    kh, vh = k + 0.1 * rng.normal(size=k.shape), v + 0.1 * rng.normal(size=v.shape)
    d = decompose(q, k, v, kh, vh)
    assert d.total.shape == (3, 4, 5, 8)
    for i in range(3):
        for j in range(4):
            ref = naive(q[i, j], k[i, 0], v[i, 0], kh[i, 0], vh[i, 0])
            np.testing.assert_allclose(d.total[i, j], ref["total"], atol=1e-13)
            np.testing.assert_allclose(d.attn[i, j], ref["attn"], atol=1e-14)


@pytest.mark.parametrize("mapping", [[0, 0, 0, 1, 1, 1, 2, 2, 2], [2, 0, 1, 0, 2, 1, 1, 0, 2],
                                     [0, 0, 1, 2, 2, 2, 2, 1, 0, 0]])
def test_gqa_matches_per_head_loop(mapping):
    rng = np.random.default_rng(12)
    hq, hkv = len(mapping), 3
    q = rng.normal(size=(hq, 4, 8))
    k = rng.normal(size=(hkv, 10, 8))
    v = rng.normal(size=(hkv, 10, 8))
    kh, vh = k + 0.1 * rng.normal(size=k.shape), v + 0.1 * rng.normal(size=v.shape)
    d = decompose(q, k, v, kh, vh, kv_head_of_q=mapping)
    ds = decompose_stream(q, k, v, kh, vh, kv_head_of_q=mapping, block_size=3)
    assert d.total.shape == (hq, 4, 8)
    for h, g in enumerate(mapping):
        ref = naive(q[h], k[g], v[g], kh[g], vh[g])
        for name in ("key_term", "value_term", "cross_term", "total"):
            np.testing.assert_allclose(getattr(d, name)[h], ref[name], atol=1e-13)
            np.testing.assert_allclose(getattr(ds, name)[h], ref[name], atol=1e-13)
        np.testing.assert_allclose(d.attn[h], ref["attn"], atol=1e-14)


def test_q_positions():
    rng = np.random.default_rng(13)
    q, k, v, kh, vh = make(rng, (2,), 3, 10, 8)
    pos = [2, 5, 9]
    d = decompose(q, k, v, kh, vh, q_positions=pos)
    for i, p in enumerate(pos):
        ref = naive(q[:, i:i + 1], k[:, :p + 1], v[:, :p + 1], kh[:, :p + 1], vh[:, :p + 1])
        np.testing.assert_allclose(d.total[:, i:i + 1], ref["total"], atol=1e-13)
        assert np.all(d.attn[:, i, p + 1:] == 0)


@given(st.integers(1, 12), st.integers(1, 9), st.integers(0, 40), st.sampled_from([1, 3, 8, None]),
       st.integers(0, 2**31 - 1))
def test_sliding_window_matches_definitions(window, Q, dT, block, seed):
    """A window hides keys at or before p − window; blocks a row sees nothing of (as small
    blocks make them) and whole skipped blocks leave every field and metric as defined."""
    rng = np.random.default_rng(seed)
    q, k, v, kh, vh = make(rng, (2,), Q, Q + dT, 8, ek=0.3, ev=0.1)
    ref = naive(q, k, v, kh, vh, window=window)
    d = decompose(q, k, v, kh, vh, window=window, block_size=block, topk=3)
    ds = decompose_stream(q, k, v, kh, vh, window=window, block_size=block, topk=3)
    scale = np.abs(ref["out"]).max() + np.abs(vh).max()
    for name in ("attn", "attn_hat", "key_term", "value_term", "cross_term", "total", "out"):
        np.testing.assert_allclose(getattr(d, name), ref[name], rtol=0,
                                   atol=256 * np.finfo(np.float64).eps * scale, err_msg=name)
        if name not in ("attn", "attn_hat"):
            np.testing.assert_allclose(getattr(ds, name), ref[name], rtol=0,
                                       atol=256 * np.finfo(np.float64).eps * scale, err_msg=name)
    msk = ref["mask"]
    a, a2 = ref["attn"], ref["attn_hat"]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(msk, a * (np.log(np.where(msk, a, 1)) - np.log(np.where(msk, a2, 1))), 0)
    nvis = msk.sum(-1)
    srt = -np.sort(-np.where(msk, ref["s"], -np.inf), axis=-1)
    margin = np.where(nvis >= 2, srt[..., 0] - srt[..., min(1, srt.shape[-1] - 1)], np.nan)
    for m in (d.metrics, ds.metrics):
        np.testing.assert_allclose(m["kl"], kl.sum(-1), rtol=1e-6, atol=1e-13)
        np.testing.assert_allclose(m["margin"], margin, rtol=1e-9, atol=1e-12)
        with np.errstate(invalid="ignore"):
            dlog = np.where(msk, ref["s2"] - ref["s"], 0)
        np.testing.assert_allclose(m["logit_rms"], np.sqrt((dlog**2).sum(-1) / nvis), rtol=1e-7,
                                   atol=1e-12)
        flip = (np.argmax(ref["s"], -1) != np.argmax(ref["s2"], -1)).astype(float)
        np.testing.assert_array_equal(m["top1_flip"], flip)
        assert np.all(np.isfinite(m["entropy"]))
    # rows outside the window are zero, and a window as long as the context changes nothing
    assert np.all(d.attn[..., ~msk] == 0) and np.all(d.delta_logits[..., ~msk] == 0)
    full = decompose(q, k, v, kh, vh, window=Q + dT)
    plain = decompose(q, k, v, kh, vh)
    np.testing.assert_array_equal(full.total, plain.total)


@given(st.integers(0, 6), st.integers(1, 5), st.integers(0, 20), st.sampled_from([2, 5, None]),
       st.integers(0, 2**31 - 1))
def test_sinks_match_definitions(window, Q, dT, block, seed):
    """A learned sink logit per query head (gpt-oss): one more softmax column without a value
    and without error, under GQA, windows and small blocks; every field and the whole-row KL
    and TV as defined, the identity exact, and a sink far below every logit changes nothing."""
    rng = np.random.default_rng(seed)
    T = Q + dT
    q = rng.normal(size=(4, Q, 8))
    k, v = 1.5 * rng.normal(size=(2, T, 8)), rng.normal(size=(2, T, 8))
    kh, vh = k + 0.3 * rng.normal(size=k.shape), v + 0.1 * rng.normal(size=v.shape)
    sink = rng.normal(scale=3.0, size=4)
    kvh = [0, 0, 1, 1]
    d = decompose(q, k, v, kh, vh, kv_head_of_q=kvh, sink=sink, window=window, block_size=block, topk=3)
    ref = naive(q, k[kvh], v[kvh], kh[kvh], vh[kvh], sink=sink, window=window)
    scale = np.abs(ref["out"]).max() + np.abs(vh).max()
    for name in ("attn", "attn_hat", "key_term", "value_term", "cross_term", "total", "out"):
        np.testing.assert_allclose(getattr(d, name), ref[name], rtol=0,
                                   atol=256 * np.finfo(np.float64).eps * scale, err_msg=name)
    np.testing.assert_allclose(d.key_term + d.value_term + d.cross_term, d.total, rtol=0,
                               atol=64 * np.finfo(np.float64).eps * scale)
    np.testing.assert_allclose(d.metrics["kl"], ref["kl"], rtol=1e-6, atol=1e-13)
    # TV of the whole row: the sink's weight changes too (by −Σ δa over the keys)
    da = ref["attn_hat"] - ref["attn"]
    np.testing.assert_allclose(d.metrics["tv"], 0.5 * (np.abs(da).sum(-1) + np.abs(da.sum(-1))), rtol=1e-9,
                               atol=1e-15)
    assert np.all(d.attn.sum(-1) < 1)
    far = decompose(q, k, v, kh, vh, kv_head_of_q=kvh, sink=np.full(4, -1e4), window=window)
    plain = decompose(q, k, v, kh, vh, kv_head_of_q=kvh, window=window)
    np.testing.assert_array_equal(far.total, plain.total)
    with pytest.raises(ShapeError, match="sink has shape"):
        decompose(q, k, v, kh, vh, kv_head_of_q=kvh, sink=np.zeros(3))


def test_window_needs_causal_attention_and_a_count():
    q, k, v, kh, vh = make(np.random.default_rng(3))
    with pytest.raises(ShapeError, match="sliding window needs causal"):
        decompose(q, k, v, kh, vh, causal=False, window=4)
    with pytest.raises(ShapeError, match="window=-1"):
        decompose(q, k, v, kh, vh, window=-1)


def test_first_query_sees_one_key():
    rng = np.random.default_rng(14)
    q, k, v, kh, vh = make(rng, (1,), 4, 4, 8)
    d = decompose(q, k, v, kh, vh)
    assert np.isnan(d.metrics["margin"][0, 0])
    assert d.metrics["kl"][0, 0] == 0.0
    np.testing.assert_allclose(d.attn[0, 0], [1, 0, 0, 0])
    np.testing.assert_allclose(d.key_term[0, 0], 0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_bad_input_messages():
    rng = np.random.default_rng(15)
    q, k, v, kh, vh = make(rng)
    with pytest.raises(ShapeError, match="k_hat shape"):
        decompose(q, k, v, kh[:, :-1], vh)
    with pytest.raises(ShapeError, match="head dims"):
        decompose(q[..., :-1], k, v, kh, vh)
    with pytest.raises(ShapeError, match="Q <= T"):
        decompose(q, k[:, :2], v[:, :2], kh[:, :2], vh[:, :2])
    with pytest.raises(DTypeError, match="share one dtype"):
        decompose(q.astype(np.float32), k, v, kh, vh)
    with pytest.raises(DTypeError, match="float32 or float64"):
        decompose(q.astype(np.float16), k, v, kh, vh)
    with pytest.raises(DTypeError, match="numpy array or a torch tensor"):
        decompose(q.tolist(), k, v, kh, vh)
    bad = kh.copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(NonFiniteError, match="k_hat holds 1 NaN"):
        decompose(q, k, v, bad, vh)
    with pytest.raises(ShapeError, match="kv_head_of_q"):
        decompose(q, k, v, kh, vh, kv_head_of_q=[0, 5])
    with pytest.raises(ShapeError, match="do not broadcast"):
        decompose(np.concatenate([q, q, q]), k, v, kh, vh)


@pytest.mark.parametrize("ek,tol", [(1e-1, 1e-4), (1e-2, 1e-3), (1e-3, 1e-2)])
def test_float32_second_order_metrics_lose_about_ulp_over_delta_s(ek, tol):
    """KL and TV are second/first order in δs; in float32 their relative accuracy is about
    ulp/|δs| (documented in kverr.error.stream), checked here against float64."""
    rng = np.random.default_rng(16)
    arrs = make(rng, (4,), 8, 200, 64, ek=ek, ev=ek)
    d64 = decompose(*arrs)
    d32 = decompose(*(a.astype(np.float32) for a in arrs))
    for n in ("kl", "tv"):
        rel = np.nanmax(np.abs(d32.metrics[n] - d64.metrics[n]) / np.abs(d64.metrics[n]))
        assert rel < tol, (n, rel)
