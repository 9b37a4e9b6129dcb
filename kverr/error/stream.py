"""Block-streamed decomposition engine: two passes over key blocks with an online softmax.

The engine works on canonical 3-d tensors ``q [B, M, D]``, ``k, k̂ [B, T, D]``, ``v, v̂ [B, T, Dv]``
(the front end in :mod:`kverr.error.core` folds batch dims, query heads of a group and queries
into ``B`` and ``M``). It never holds more than one ``[B, M, block]`` slab of logits at a time,
unless the caller asks for the full rows.

Why two passes. The key term needs δa = a′ − a exactly. Forming a′ and a separately and
subtracting loses the small difference to cancellation; instead, with δs = q·E_Kᵀ·scale computed
directly from E_K = K̂ − K, the weight change is taken in the streaming form of
:mod:`kverr.error.terms` (which defines every term this engine computes)

    δlse = log Σ_j a_j e^{δs_j} = log1p(Σ_j a_j expm1(δs_j))
    δa_j = a_j · expm1(δs_j − δlse)

which has no cancellation at all. Pass 1 streams the online-softmax statistics (running max,
Σe^{s−m}, Σe^{s−m}expm1(δs), Σe^{s−m}δs, entropy, top-k); pass 2 forms a, δa per block and
accumulates the output terms. With a single block pass 2 reuses pass 1's tensors.

Speed. At head dim 64 one elementwise pass over a [rows, keys] slab costs about as much as
one of the attention matmuls, so the engine (i) works on row chunks small enough to stay in
cache, (ii) gets s and δs from one matmul against [K; E_K] and every output from two matmuls
against [V, E_V, V̂], folding the 1/Z normalisation into the small results, (iii) uses fused
row dot products for the sums, and (iv) reuses buffers in place. With a single block (contexts
up to 8192 keys) there is no second pass over the logits.

KL(a‖a′) = δlse − μ with μ = Σ_j a_j δs_j. It is second order in δs, so its relative accuracy
is about ulp/|δs| (1e-13 in float64; 1e-4 in float32 for |δs| ~ 1e-3, i.e. int8 keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kverr.error import terms as _terms
from kverr.error.metrics import merge_topk, rank_flips, topk_overlap

#: Target number of logit elements per [rows, keys] slab: 2^18 float32 = 1 MiB stays in cache.
DEFAULT_SLAB_ELEMENTS = 1 << 18
#: Longest key block processed in one pass; longer contexts stream in blocks of this length.
MAX_SINGLE_BLOCK = 8192
STREAM_BLOCK = 4096


@dataclass
class EngineOut:
    """Raw engine results on canonical axes (``[B, M, ...]``)."""

    key_term: torch.Tensor
    value_term: torch.Tensor
    cross_term: torch.Tensor
    total: torch.Tensor
    out: torch.Tensor
    metrics: dict[str, torch.Tensor]
    delta_logits: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    attn_hat: torch.Tensor | None = None


def choose_block(B: int, M: int, T: int, block_size: int | None) -> int:
    """Key-block length: the caller's, the whole context up to 8192 keys, else 4096."""
    if block_size is not None:
        return max(1, min(int(block_size), T))
    return T if T <= MAX_SINGLE_BLOCK else STREAM_BLOCK


def choose_rows(block: int, rows_per_chunk: int | None = None) -> int:
    """Query rows per chunk so that one [rows, block] slab stays near the cache budget."""
    if rows_per_chunk is not None:
        return max(1, int(rows_per_chunk))
    return max(8, DEFAULT_SLAB_ELEMENTS // max(1, block))


def _logits(qs, kk, qpos, t0, t1, T, window=0):
    """Masked clean logits s and perturbation δs for keys t0..t1-1: ``[B, m, n]`` views.

    ``kk`` is ``[B, 2T, D]`` = [K; E_K], so both come out of one matmul. A row at position p
    sees keys ``p − window < t ≤ p`` (``t ≤ p`` when ``window`` is 0). Hidden logits are set to
    the dtype's most negative finite value rather than −inf, so that p·(s − m) stays
    0·finite = 0 there. Every row sees the key at its own position, so its maximum over all
    blocks is never the sentinel; a block may be hidden whole from a row only under a window
    (see :func:`_chunk`).
    """
    n = t1 - t0
    if n == T:
        both = qs @ kk.mT
    else:
        both = qs @ torch.cat([kk[:, t0:t1], kk[:, T + t0:T + t1]], dim=1).mT
    s, ds = both[..., :n], both[..., n:]
    if qpos is not None:
        # only the columns at or after the earliest query position can be hidden
        c0 = max(t0, int(qpos.min()) + 1)
        if c0 < t1:
            t = torch.arange(c0, t1, device=qpos.device)
            hidden = t.unsqueeze(0) > qpos.unsqueeze(1)  # [m, n']
            s[..., c0 - t0:].masked_fill_(hidden, torch.finfo(s.dtype).min)
            ds[..., c0 - t0:].masked_fill_(hidden, 0.0)
        # the window hides the columns at or before p − window
        c1 = min(t1, int(qpos.max()) - window + 1) if window else t0
        if c1 > t0:
            t = torch.arange(t0, c1, device=qpos.device)
            hidden = t.unsqueeze(0) <= (qpos - window).unsqueeze(1)  # [m, n'']
            s[..., : c1 - t0].masked_fill_(hidden, torch.finfo(s.dtype).min)
            ds[..., : c1 - t0].masked_fill_(hidden, 0.0)
    return s, ds


def _chunk(qs, kk, rhs, qpos, block, keep_rows, topk, Dv, first_order_out, window=0, sink=None):
    """The engine on one row chunk ``qs [B, m, D]``; returns raw per-row results.

    ``rhs`` is ``[B, T, 3·Dv]`` = [V, E_V, V̂]: one matmul per weight matrix gives every
    output quantity. Under a ``window`` the blocks no row of the chunk sees are skipped, and a
    row that has seen no key yet keeps zero weight on the block (its running maximum is still
    the hidden sentinel, so e^{s−m} would be 1 there). A ``sink [B, m]`` logit starts the
    online softmax as a column of weight e^{sink−m}, no value and no error (δs = 0).
    """
    B, m, D = qs.shape
    T = kk.shape[1] // 2
    dt, dev = qs.dtype, qs.device
    neg = torch.finfo(dt).min
    lo = max(0, int(qpos.min()) - window + 1) if window and qpos is not None else 0
    bounds = [(t0, min(T, t0 + block)) for t0 in range(0, T, block) if min(T, t0 + block) > lo]
    single = len(bounds) == 1

    # ---- pass 1: online softmax statistics -------------------------------------------------
    mx = torch.full((B, m), -math.inf, dtype=dt, device=dev) if sink is None else sink.to(dt).clone()
    Z = torch.zeros((B, m), dtype=dt, device=dev) if sink is None else torch.ones((B, m), dtype=dt, device=dev)
    W = torch.zeros_like(Z)  # Σ p expm1(δs)
    PD = torch.zeros_like(Z)  # Σ p δs
    PS = torch.zeros_like(Z)  # Σ p (s − m)
    ds_max = torch.zeros_like(Z)
    ds_sq = torch.zeros_like(Z)
    ev = torch.empty((B, m, 0), dtype=dt, device=dev)
    ei = torch.empty((B, m, 0), dtype=torch.long, device=dev)
    top_s, top_i, top_s2, top2_s, top2_i = ev, ei, ev, ev, ei
    kept = None
    for t0, t1 in bounds:
        s, ds = _logits(qs, kk, qpos, t0, t1, T, window)
        m_new = torch.maximum(mx, s.amax(dim=-1))
        alpha = torch.exp(mx - m_new)  # 0 on the first block (mx = −inf, m_new finite)
        shift = torch.where(torch.isfinite(mx), mx - m_new, torch.zeros_like(mx))
        mx = m_new
        ds_max = torch.maximum(ds_max, torch.maximum(ds.amax(dim=-1), -ds.amin(dim=-1)))
        ds_sq += torch.linalg.vector_norm(ds, 2, dim=-1) ** 2
        sc = s.sub_(m_new.unsqueeze(-1))  # s − m, in place
        nk = min(topk, t1 - t0)
        s2 = torch.add(sc, ds)  # same order as s + δs
        bv2, bi2 = s2.topk(nk, dim=-1)
        bv, bi = sc.topk(nk, dim=-1)
        # running top-k values are kept relative to the running max: shift the old ones
        top_s = top_s + shift.unsqueeze(-1)
        top_s2 = top_s2 + shift.unsqueeze(-1)
        top2_s = top2_s + shift.unsqueeze(-1)
        top_s, top_i, top_s2 = merge_topk(top_s, top_i, top_s2, bv, bi + t0,
                                          s2.gather(-1, bi), topk)
        top2_s, top2_i, _ = merge_topk(top2_s, top2_i, None, bv2, bi2 + t0, None, topk)
        del s2
        buf = torch.empty((B, 2 * m, t1 - t0), dtype=dt, device=dev)
        p = torch.exp(sc, out=buf[:, :m])
        if window:
            p.masked_fill_((m_new <= neg / 2).unsqueeze(-1), 0.0)
        PS = alpha * (PS + shift * Z) + torch.linalg.vecdot(p, sc)
        Z = alpha * Z + p.sum(dim=-1)
        e1 = torch.expm1(ds, out=buf[:, m:2 * m])
        W = alpha * W + torch.linalg.vecdot(p, e1)
        PD = alpha * PD + torch.linalg.vecdot(p, ds)
        if single:
            kept = (buf, ds)
        del p, ds, s, sc, e1

    lse_rel = torch.log(Z)  # lse − m
    dlse = _terms.delta_lse(W, Z)
    mu = PD / Z
    entropy = lse_rel - PS / Z
    # expm1(δs − δlse) = expm1(δs)·e^{−δlse} + expm1(−δlse): one fused op instead of an expm1
    c_mul, c_add = _terms.weight_change_factors(dlse)

    # ---- pass 2: exact weight change and output terms ---------------------------------------
    R = torch.zeros((B, m, 2 * Dv), dtype=dt, device=dev)  # p·[V, E_V]
    R2 = torch.zeros((B, m, 3 * Dv), dtype=dt, device=dev)  # Z·δa·[V, E_V, V̂]
    lin_v = torch.zeros((B, m, Dv), dtype=dt, device=dev) if first_order_out else None
    tv, fo_num, fo_den = torch.zeros_like(Z), torch.zeros_like(Z), torch.zeros_like(Z)
    rows = None
    if keep_rows:
        rows = tuple(torch.zeros((B, m, T), dtype=dt, device=dev) for _ in range(3))
    for t0, t1 in bounds:
        if kept is not None:
            buf, ds = kept
            kept = None
            p, e1 = buf[:, :m], buf[:, m:2 * m]
        else:
            s, ds = _logits(qs, kk, qpos, t0, t1, T, window)
            buf = torch.empty((B, 2 * m, t1 - t0), dtype=dt, device=dev)
            p = torch.exp(s.sub_(mx.unsqueeze(-1)), out=buf[:, :m])
            e1 = torch.expm1(ds, out=buf[:, m:2 * m])
            del s
        dp = _terms.weight_change_from_expm1(p, e1, c_mul, c_add)  # Z·δa, in place of e1
        tv += dp.abs().sum(dim=-1)
        fo_den += torch.linalg.vector_norm(dp, 2, dim=-1) ** 2
        if rows is not None:
            rows[0][..., t0:t1] = ds
            a = p / Z.unsqueeze(-1)
            rows[1][..., t0:t1] = a
            rows[2][..., t0:t1] = a + dp / Z.unsqueeze(-1)
        rb = rhs[:, t0:t1]
        R += p @ rb[..., : 2 * Dv]
        R2 += dp @ rb
        lin = _terms.first_order_weight_change(p, ds, mu)  # Z·Jδs, in place of ds (dead now)
        if lin_v is not None:
            lin_v += lin @ rb[..., :Dv]
        fo_num += torch.linalg.vector_norm(torch.sub(lin, dp), 2, dim=-1) ** 2
        del p, ds, e1, dp, lin, buf

    if sink is not None:
        # the sink's own weight change, Z·δa = e^{sink−m}·expm1(−δlse) (δs = 0): TV is the row's
        tv += (torch.exp(sink.to(dt) - mx) * torch.expm1(-dlse)).abs()
    inv = (1.0 / Z).unsqueeze(-1)
    t = _terms.output_terms(R * inv, R2 * inv)

    def real(x):  # the hidden-key sentinel back to −inf (padding for the top-k metrics)
        return torch.where(x > neg / 2, x, torch.full_like(x, -math.inf))

    return dict(
        out=t["out"], value=t["value"], key=t["key"], cross=t["cross"], total=t["total"],
        key_lin=None if lin_v is None else lin_v * inv,
        Z=Z, mu=mu, dlse=dlse, entropy=entropy, ds_max=ds_max, ds_sq=ds_sq,
        tv=tv / Z, fo_num=fo_num, fo_den=fo_den,
        top_s=real(top_s), top_i=top_i, top_s2=real(top_s2), top2_s=real(top2_s), top2_i=top2_i,
        rows=rows,
    )


def run_engine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    qpos: torch.Tensor | None,
    scale: float,
    *,
    block: int,
    keep_rows: bool,
    topk: int,
    rows_per_chunk: int | None = None,
    first_order_out: bool = True,
    window: int = 0,
    sink: torch.Tensor | None = None,
) -> EngineOut:
    """Decompose attention-output error for canonical tensors.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, M, D]`` queries.
    k, k_hat : torch.Tensor
        ``[B, T, D]`` clean and reconstructed keys.
    v, v_hat : torch.Tensor
        ``[B, T, Dv]`` clean and reconstructed values.
    qpos : torch.Tensor or None
        ``[M]`` int64 position of each query row on the key axis (a row sees keys ≤ its
        position); None means every row sees every key.
    scale : float
        Logit scale.
    block : int
        Keys per block (the whole context when ``block >= T``: one pass, no recomputation).
    keep_rows : bool
        Also return the ``[B, M, T]`` rows (δs, a, a′).
    topk : int
        k of the top-k overlap and rank-flip metrics.
    rows_per_chunk : int, optional
        Query rows per chunk (default: a cache-sized slab).
    first_order_out : bool
        Also push the first-order weight change through V (one more [M, T]·[T, Dv] matmul)
        for the ``first_order_key_err`` metric; NaN when false.
    window : int
        Sliding window: a row at position p sees keys ``p − window < t ≤ p`` (needs ``qpos``);
        0 for plain causal attention.
    sink : torch.Tensor, optional
        ``[B, M]`` learned sink logits (in the units of the scaled logits): a softmax column per
        row that no key error changes and that carries no value. Its weight counts in every
        quantity defined on the whole softmax row (KL, TV, entropy); the top-k metrics rank keys.

    Returns
    -------
    EngineOut
    """
    B, M, _ = q.shape
    T = k.shape[1]
    dt, dev = q.dtype, q.device
    qs = q * scale
    Dv = v.shape[2]
    rhs = _terms.value_stack(v, v_hat)
    kk = torch.cat([k, k_hat - k], dim=1)
    mc = choose_rows(min(block, T), rows_per_chunk)
    parts = []
    for m0 in range(0, M, mc):
        m1 = min(M, m0 + mc)
        qp = None if qpos is None else qpos[m0:m1]
        if qp is not None and int(qp.min()) >= T - 1 and not window:
            qp = None
        parts.append(_chunk(qs[:, m0:m1], kk, rhs, qp, block, keep_rows, topk, Dv, first_order_out,
                            window, None if sink is None else sink[:, m0:m1]))

    def cat(name):
        return torch.cat([p[name] for p in parts], dim=1)

    r = {n: cat(n) for n in parts[0] if n != "rows" and parts[0][n] is not None}
    rows = None
    if keep_rows:
        rows = tuple(torch.cat([p["rows"][i] for p in parts], dim=1) for i in range(3))

    # ---- per-query metrics --------------------------------------------------------------------
    if qpos is None:
        n_vis = torch.full((M,), T, dtype=dt, device=dev)
    else:
        n_vis = torch.clamp(qpos, max=T - 1) + 1
        n_vis = (torch.clamp(n_vis, max=window) if window else n_vis).to(dt)
    n_vis = n_vis.expand(B, M)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, dim=-1)

    top_s, top_i, top_s2 = r["top_s"], r["top_i"], r["top_s2"]
    top2_s, top2_i = r["top2_s"], r["top2_i"]
    nan = torch.full((B, M), math.nan, dtype=dt, device=dev)
    if top_s.shape[-1] > 1:
        margin = torch.where(n_vis >= 2, top_s[..., 0] - top_s[..., 1], nan)
    else:
        margin = nan
    k_eff = torch.clamp(n_vis, max=float(min(topk, T)))
    pad_a = torch.where(torch.isfinite(top_s), top_i, torch.full_like(top_i, -1))
    pad_b = torch.where(torch.isfinite(top2_s), top2_i, torch.full_like(top2_i, -2))
    o_norm = norm(r["out"])
    key_norm = norm(r["key"])
    kl = _terms.kl_divergence(r["dlse"], r["mu"])
    metrics = {
        "logit_max_abs": r["ds_max"],
        "logit_rms": torch.sqrt(r["ds_sq"] / n_vis),
        "margin": margin,
        "entropy": r["entropy"],
        "sensitivity": r["ds_max"] / margin,
        "kl": kl,
        "tv": 0.5 * r["tv"],
        "first_order_err": torch.sqrt(r["fo_num"] / r["fo_den"]),
        "first_order_key_err": (norm(r["key_lin"] - r["key"]) / key_norm if "key_lin" in r
                                else torch.full((B, M), math.nan, dtype=dt, device=dev)),
        "top1_flip": (top_i[..., 0] != top2_i[..., 0]).to(dt),
        "topk_overlap": topk_overlap(pad_a, pad_b, k_eff).to(dt),
        "rank_flips": rank_flips(top_s, top_s2),
        "out_norm": o_norm,
        "key_rel": key_norm / o_norm,
        "value_rel": norm(r["value"]) / o_norm,
        "cross_rel": norm(r["cross"]) / o_norm,
        "total_rel": norm(r["total"]) / o_norm,
    }
    res = EngineOut(
        key_term=r["key"], value_term=r["value"], cross_term=r["cross"], total=r["total"],
        out=r["out"], metrics=metrics,
    )
    if rows is not None:
        res.delta_logits, res.attn, res.attn_hat = rows
    return res
