"""Block-streamed decomposition engine: two passes over key blocks with an online softmax.

The engine works on canonical 3-d tensors ``q [B, M, D]``, ``k, k̂ [B, T, D]``, ``v, v̂ [B, T, Dv]``
(the front end in :mod:`kverr.error.core` folds batch dims, query heads of a group and queries
into ``B`` and ``M``). It never holds more than one ``[B, M, block]`` slab of logits at a time,
unless the caller asks for the full rows.

Why two passes. The key term needs δa = a′ − a exactly. Forming a′ and a separately and
subtracting loses the small difference to cancellation; instead, with δs = q·E_Kᵀ·scale computed
directly from E_K = K̂ − K,

    δlse = log Σ_j a_j e^{δs_j} = log1p(Σ_j a_j expm1(δs_j))
    δa_j = a_j · expm1(δs_j − δlse)

which has no cancellation at all. Pass 1 streams the online-softmax statistics (running max,
Σe^{s−m}, Σe^{s−m}expm1(δs), Σe^{s−m}δs, entropy, top-k); pass 2 forms a, δa per block and
accumulates the output terms. With a single block pass 2 reuses pass 1's tensors.

KL(a‖a′) = log Σ_j a_j e^{δs_j − μ} with μ = Σ_j a_j δs_j is second order in δs; it is
computed as log1p(Σ_j a_j g(δs_j − μ)) with g(x) = eˣ − 1 − x evaluated without cancellation
(:func:`kverr.error.metrics.expm1_minus_x`), using Σ_j a_j (δs_j − μ) = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kverr.error.metrics import expm1_minus_x, merge_topk, rank_flips, topk_overlap

#: Default number of logit elements per slab (B·M·block); ~12 live slabs of this size at once.
DEFAULT_SLAB_ELEMENTS = 1 << 22


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
    """Key-block length: the caller's, or one that keeps a logit slab near the element budget."""
    if block_size is not None:
        return max(1, min(int(block_size), T))
    blk = DEFAULT_SLAB_ELEMENTS // max(1, B * M)
    blk = max(256, (blk // 256) * 256)
    return min(T, blk)


def _visible(qpos: torch.Tensor | None, t0: int, t1: int) -> torch.Tensor | None:
    """``[M, n]`` bool mask of keys t0..t1-1 each query row may see, or None when all may."""
    if qpos is None or int(qpos.min()) >= t1 - 1:
        return None
    t = torch.arange(t0, t1, device=qpos.device)
    return t.unsqueeze(0) <= qpos.unsqueeze(1)


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
        Keys per block.
    keep_rows : bool
        Also return the ``[B, M, T]`` rows (δs, a, a′).
    topk : int
        k of the top-k overlap and rank-flip metrics.

    Returns
    -------
    EngineOut
    """
    B, M, _ = q.shape
    T = k.shape[1]
    Dv = v.shape[2]
    dt = q.dtype
    dev = q.device
    qs = q * scale
    neg_inf = torch.tensor(-math.inf, dtype=dt, device=dev)

    bounds = [(t0, min(T, t0 + block)) for t0 in range(0, T, block)]
    single = len(bounds) == 1

    # ---- pass 1: online softmax statistics -------------------------------------------------
    m = torch.full((B, M), -math.inf, dtype=dt, device=dev)
    Z = torch.zeros((B, M), dtype=dt, device=dev)
    ent = torch.zeros_like(Z)  # Σ p (s − m)
    zd = torch.zeros_like(Z)  # Σ p δs
    w = torch.zeros_like(Z)  # Σ p expm1(δs)
    ds_max = torch.zeros_like(Z)
    ds_sq = torch.zeros_like(Z)
    empty_v = torch.empty((B, M, 0), dtype=dt, device=dev)
    empty_i = torch.empty((B, M, 0), dtype=torch.long, device=dev)
    top_s, top_i, top_s2 = empty_v, empty_i, empty_v
    top2_s, top2_i = empty_v, empty_i
    cached = None
    for t0, t1 in bounds:
        vis = _visible(qpos, t0, t1)
        kb = k[:, t0:t1]
        s = qs @ kb.mT
        ds = qs @ (k_hat[:, t0:t1] - kb).mT
        if vis is not None:
            s = s.masked_fill(~vis, -math.inf)
            ds = ds.masked_fill(~vis, 0.0)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        shift = torch.where(torch.isfinite(m), m - m_safe, torch.zeros_like(m))
        sc = s - m_safe.unsqueeze(-1)
        p = torch.exp(sc)
        psc = p * sc
        if vis is not None:
            psc = psc.masked_fill(~vis, 0.0)
        ent = alpha * (ent + shift * Z) + psc.sum(dim=-1)
        Z = alpha * Z + p.sum(dim=-1)
        zd = alpha * zd + (p * ds).sum(dim=-1)
        w = alpha * w + (p * torch.expm1(ds)).sum(dim=-1)
        m = m_new
        ds_max = torch.maximum(ds_max, ds.abs().amax(dim=-1))
        ds_sq = ds_sq + (ds * ds).sum(dim=-1)
        s2 = s + ds
        kk = min(topk, t1 - t0)
        bv, bi = s.topk(kk, dim=-1)
        top_s, top_i, top_s2 = merge_topk(
            top_s, top_i, top_s2, bv, bi + t0, s2.gather(-1, bi), topk
        )
        bv2, bi2 = s2.topk(kk, dim=-1)
        top2_s, top2_i, _ = merge_topk(top2_s, top2_i, None, bv2, bi2 + t0, None, topk)
        if single:
            cached = (s, ds, p)

    lse = m + torch.log(Z)
    mu = zd / Z
    dlse = torch.log1p(w / Z)

    # ---- pass 2: exact weight change and output terms ---------------------------------------
    out = torch.zeros((B, M, Dv), dtype=dt, device=dev)
    value = torch.zeros_like(out)
    key = torch.zeros_like(out)
    cross = torch.zeros_like(out)
    out_hat = torch.zeros_like(out)
    key_lin = torch.zeros_like(out)
    tv = torch.zeros_like(Z)
    fo_num = torch.zeros_like(Z)
    fo_den = torch.zeros_like(Z)
    kl_acc = torch.zeros_like(Z)
    var_acc = torch.zeros_like(Z)
    rows = None
    if keep_rows:
        rows = (
            torch.empty((B, M, T), dtype=dt, device=dev),
            torch.empty((B, M, T), dtype=dt, device=dev),
            torch.empty((B, M, T), dtype=dt, device=dev),
        )
    for t0, t1 in bounds:
        if cached is not None:
            s, ds, p = cached
            a = p / Z.unsqueeze(-1)
        else:
            vis = _visible(qpos, t0, t1)
            kb = k[:, t0:t1]
            s = qs @ kb.mT
            ds = qs @ (k_hat[:, t0:t1] - kb).mT
            if vis is not None:
                s = s.masked_fill(~vis, -math.inf)
                ds = ds.masked_fill(~vis, 0.0)
            a = torch.exp(s - lse.unsqueeze(-1))
        da = a * torch.expm1(ds - dlse.unsqueeze(-1))
        x = ds - mu.unsqueeze(-1)
        dlin = a * x
        a_hat = a + da
        vb = v[:, t0:t1]
        evb = v_hat[:, t0:t1] - vb
        vcat = torch.cat([vb, evb], dim=-1)
        r = a @ vcat
        out += r[..., :Dv]
        value += r[..., Dv:]
        r = da @ vcat
        key += r[..., :Dv]
        cross += r[..., Dv:]
        out_hat += a_hat @ v_hat[:, t0:t1]
        key_lin += dlin @ vb
        tv += da.abs().sum(dim=-1)
        diff = da - dlin
        fo_num += (diff * diff).sum(dim=-1)
        fo_den += (da * da).sum(dim=-1)
        kl_acc += (a * expm1_minus_x(x)).sum(dim=-1)
        var_acc += (dlin * x).sum(dim=-1)
        if rows is not None:
            rows[0][..., t0:t1] = ds
            rows[1][..., t0:t1] = a
            rows[2][..., t0:t1] = a_hat
        del s, ds, a, da, x, dlin, a_hat

    total = out_hat - out

    # ---- per-query metrics --------------------------------------------------------------------
    if qpos is None:
        n_vis = torch.full((M,), T, dtype=dt, device=dev)
    else:
        n_vis = (torch.clamp(qpos, max=T - 1) + 1).to(dt)
    n_vis = n_vis.expand(B, M)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, dim=-1)

    o_norm = norm(out)
    key_norm = norm(key)
    margin = top_s[..., 0] - top_s[..., 1] if top_s.shape[-1] > 1 else None
    if margin is None or qpos is not None:
        # Fewer than two visible keys: no margin.
        m2 = torch.full((B, M), math.nan, dtype=dt, device=dev)
        if margin is not None:
            margin = torch.where(n_vis >= 2, margin, m2)
        else:
            margin = m2
    k_eff = torch.clamp(n_vis, max=float(min(topk, T)))
    pad_a = torch.where(torch.isfinite(top_s), top_i, torch.full_like(top_i, -1))
    pad_b = torch.where(torch.isfinite(top2_s), top2_i, torch.full_like(top2_i, -2))
    metrics = {
        "logit_max_abs": ds_max,
        "logit_rms": torch.sqrt(ds_sq / n_vis),
        "logit_std": torch.sqrt(torch.clamp(var_acc, min=0.0)),
        "margin": margin,
        "entropy": torch.log(Z) - ent / Z,
        "sensitivity": ds_max / margin,
        "kl": torch.log1p(kl_acc),
        "tv": 0.5 * tv,
        "first_order_err": torch.sqrt(fo_num / fo_den),
        "first_order_key_err": norm(key_lin - key) / key_norm,
        "top1_flip": (top_i[..., 0] != top2_i[..., 0]).to(dt),
        "topk_overlap": topk_overlap(pad_a, pad_b, k_eff).to(dt),
        "rank_flips": rank_flips(top_s, top_s2),
        "out_norm": o_norm,
        "key_rel": key_norm / o_norm,
        "value_rel": norm(value) / o_norm,
        "cross_rel": norm(cross) / o_norm,
        "total_rel": norm(total) / o_norm,
    }
    res = EngineOut(
        key_term=key,
        value_term=value,
        cross_term=cross,
        total=total,
        out=out,
        metrics=metrics,
    )
    if rows is not None:
        res.delta_logits, res.attn, res.attn_hat = rows
    return res
