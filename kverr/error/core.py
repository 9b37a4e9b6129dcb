"""Exact decomposition of attention-output error into key, value and cross terms.

For one query q, keys K, values V and scale c (default 1/√D)::

    s = c·qKᵀ,  a = softmax(s),  o = aV
    K̂ = K + E_K,  V̂ = V + E_V,  δs = c·qE_Kᵀ,  a′ = softmax(s + δs),  o′ = a′V̂
    o′ − o = (a′ − a)V + aE_V + (a′ − a)E_V
             key term    value term   cross term

The key term enters before the softmax and depends on the query direction and the softmax
margins; the value term enters after the weights are formed. The terms are defined in
:mod:`kverr.error.terms`; this module is the array front end: it validates inputs, folds batch dims, query-head groups (GQA) and queries into the
canonical ``[B, M, ·]`` layout of the streaming engine (:mod:`kverr.error.stream`) and unfolds
the results. Inputs may be numpy arrays or torch tensors, float32 or float64; results come back
in the same library and dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kverr.exceptions import DTypeError, NonFiniteError, ShapeError
from kverr.error.metrics import QUERY_METRICS
from kverr.error.stream import choose_block, run_engine

log = logging.getLogger(__name__)

ArrayLike = Any  # numpy.ndarray | torch.Tensor

_FLOATS = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Decomposition:
    """Result of :func:`decompose` (numpy arrays or torch tensors, matching the inputs).

    Attributes
    ----------
    delta_logits : array ``[..., Q, T]``
        δs = q·(k̂ − k)ᵀ·scale; 0 at keys a query does not see (causal mask, sliding window).
    attn, attn_hat : array ``[..., Q, T]``
        Softmax weights with clean and reconstructed keys (0 where masked).
    key_term : array ``[..., Q, Dv]``
        (attn_hat − attn)·v.
    value_term : array ``[..., Q, Dv]``
        attn·(v_hat − v).
    cross_term : array ``[..., Q, Dv]``
        (attn_hat − attn)·(v_hat − v).
    total : array ``[..., Q, Dv]``
        attn_hat·v_hat − attn·v, evaluated as (attn_hat − attn)·v_hat + attn·(v_hat − v): the
        same quantity without the cancellation of two nearly equal outputs, and formed from
        other products than the three terms (so their sum is a check, not a tautology).
    out : array ``[..., Q, Dv]``
        The clean attention output attn·v.
    metrics : dict of str to array ``[..., Q]``
        Per-query metrics, see :data:`kverr.error.metrics.QUERY_METRICS`.
    """

    delta_logits: ArrayLike | None
    attn: ArrayLike | None
    attn_hat: ArrayLike | None
    key_term: ArrayLike
    value_term: ArrayLike
    cross_term: ArrayLike
    total: ArrayLike
    out: ArrayLike
    metrics: dict[str, ArrayLike] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# validation and layout
# --------------------------------------------------------------------------------------------


def _as_tensor(x: ArrayLike, name: str) -> tuple[torch.Tensor, bool]:
    """Tensor view of ``x`` (no copy for numpy) and whether it came from numpy."""
    if isinstance(x, torch.Tensor):
        return x.detach(), False
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.float32, np.float64):
            raise DTypeError(
                f"{name} has dtype {x.dtype}; decompose needs float32 or float64 "
                f"(cast with .astype(np.float32))"
            )
        return torch.from_numpy(np.ascontiguousarray(x)), True
    raise DTypeError(
        f"{name} is a {type(x).__name__}; decompose needs a numpy array or a torch tensor"
    )


def _check_finite(t: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        raise NonFiniteError(
            f"{name} holds {n_nan} NaN and {n_inf} Inf values among {t.numel()}; "
            "decompose needs finite inputs"
        )


@dataclass
class _Plan:
    """How the caller's arrays were folded, so results can be unfolded."""

    numpy_out: bool
    dtype: torch.dtype
    batch: tuple[int, ...]  # broadcast batch shape (after the GQA head dim is expanded)
    keep: list[int]  # batch dims shared by q and k (canonical B)
    fold: list[int]  # batch dims where only q varies (folded into M)
    n_query: int
    gqa_perm: torch.Tensor | None  # q-head permutation applied (uniform groups)
    gqa_groups: int  # G when uniform GQA grouping was used, else 0


def _prepare(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    k_hat: ArrayLike,
    v_hat: ArrayLike,
    *,
    causal: bool,
    scale: float | None,
    kv_head_of_q: Sequence[int] | np.ndarray | torch.Tensor | None,
    q_positions: Sequence[int] | np.ndarray | torch.Tensor | None,
    check_finite: bool,
    window: int = 0,
    sink: ArrayLike | None = None,
):
    names = ("q", "k", "v", "k_hat", "v_hat")
    pairs = [_as_tensor(x, n) for x, n in zip((q, k, v, k_hat, v_hat), names)]
    tq, tk, tv, tkh, tvh = (p[0] for p in pairs)
    numpy_out = all(p[1] for p in pairs)
    dtypes = {n: t.dtype for n, t in zip(names, (tq, tk, tv, tkh, tvh))}
    for n, d in dtypes.items():
        if d not in _FLOATS:
            raise DTypeError(f"{n} has dtype {d}; decompose needs float32 or float64")
    if len(set(dtypes.values())) != 1:
        listing = ", ".join(f"{n}={str(d).replace('torch.', '')}" for n, d in dtypes.items())
        raise DTypeError(f"inputs must share one dtype, got {listing}")
    devices = {t.device for t in (tq, tk, tv, tkh, tvh)}
    if len(devices) != 1:
        raise ShapeError(f"inputs live on different devices: {sorted(map(str, devices))}")
    for n, t in zip(names, (tq, tk, tv, tkh, tvh)):
        if t.ndim < 2:
            raise ShapeError(f"{n} has shape {tuple(t.shape)}; expected [..., tokens, channels]")
    if tkh.shape != tk.shape:
        raise ShapeError(f"k_hat shape {tuple(tkh.shape)} differs from k shape {tuple(tk.shape)}")
    if tvh.shape != tv.shape:
        raise ShapeError(f"v_hat shape {tuple(tvh.shape)} differs from v shape {tuple(tv.shape)}")
    if tv.shape[:-1] != tk.shape[:-1]:
        raise ShapeError(
            f"v shape {tuple(tv.shape)} and k shape {tuple(tk.shape)} must agree on all but "
            "the last (channel) dim"
        )
    if tq.shape[-1] != tk.shape[-1]:
        raise ShapeError(
            f"q has {tq.shape[-1]} channels but k has {tk.shape[-1]}; head dims must match"
        )
    if sink is not None:
        # the sink logits ride along as one more channel of q, so that every fold and
        # permutation q goes through below places them with their rows
        ts, _ = _as_tensor(sink, "sink")
        if ts.dtype not in _FLOATS:
            raise DTypeError(f"sink has dtype {ts.dtype}; decompose needs float32 or float64")
        if check_finite:
            _check_finite(ts, "sink")
        try:
            ts = torch.broadcast_to(ts.to(tq.dtype)[..., None, None], (*tq.shape[:-1], 1))
        except RuntimeError:
            raise ShapeError(f"sink has shape {tuple(ts.shape)}; it must broadcast to q's batch dims "
                             f"{tuple(tq.shape[:-2])} (one logit per query head)") from None
        tq = torch.cat([tq, ts.to(tq.device)], dim=-1)
    Q, D = tq.shape[-2], tk.shape[-1]
    T = tk.shape[-2]
    if Q == 0 or T == 0 or D == 0:
        raise ShapeError(f"empty input: Q={Q}, T={T}, D={D}")
    if check_finite:
        for n, t in zip(names, (tq, tk, tv, tkh, tvh)):
            _check_finite(t, n)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ShapeError(f"scale must be a positive finite number, got {scale}")

    # ---- query positions on the key axis -------------------------------------------------------
    qpos = None
    if q_positions is not None:
        qp = torch.as_tensor(np.asarray(q_positions), dtype=torch.long, device=tq.device)
        if qp.shape != (Q,):
            raise ShapeError(f"q_positions has shape {tuple(qp.shape)}; expected ({Q},)")
        if int(qp.min()) < 0 or int(qp.max()) >= T:
            raise ShapeError(f"q_positions must lie in [0, {T}), got [{int(qp.min())}, {int(qp.max())}]")
        if causal:
            qpos = qp
    elif causal:
        if Q > T:
            raise ShapeError(
                f"causal decomposition needs Q <= T (the queries are the last Q of the T "
                f"positions), got Q={Q}, T={T}"
            )
        qpos = torch.arange(T - Q, T, device=tq.device)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ShapeError(f"window={window!r} must be a non-negative integer (0: no sliding window)")
    window = int(window)
    if window and qpos is None:
        raise ShapeError("a sliding window needs causal attention (the window ends at each query)")
    if qpos is not None and int(qpos.min()) >= T - 1 and not window:
        qpos = None  # every query sees every key

    # ---- grouped-query attention ---------------------------------------------------------------
    gqa_perm = None
    groups = 0
    if kv_head_of_q is not None:
        if tq.ndim < 3 or tk.ndim < 3:
            raise ShapeError("kv_head_of_q needs q [..., q_head, Q, D] and k [..., kv_head, T, D]")
        hq, hkv = tq.shape[-3], tk.shape[-3]
        mapping = torch.as_tensor(np.asarray(kv_head_of_q), dtype=torch.long)
        if mapping.shape != (hq,):
            raise ShapeError(
                f"kv_head_of_q has shape {tuple(mapping.shape)}; expected ({hq},), one kv head "
                "per query head"
            )
        if int(mapping.min()) < 0 or int(mapping.max()) >= hkv:
            raise ShapeError(f"kv_head_of_q values must lie in [0, {hkv}), got {mapping.tolist()}")
        counts = torch.bincount(mapping, minlength=hkv)
        if bool((counts == counts[0]).all()) and int(counts[0]) > 0:
            groups = int(counts[0])
            gqa_perm = torch.argsort(mapping, stable=True).to(tq.device)
            tq = tq.index_select(-3, gqa_perm)
            tq = tq.reshape(*tq.shape[:-3], hkv, groups, Q, tq.shape[-1])

            def grp(t: torch.Tensor) -> torch.Tensor:
                return t.unsqueeze(-3)

            tk, tv, tkh, tvh = (grp(t) for t in (tk, tv, tkh, tvh))
        else:
            idx = mapping.to(tk.device)
            tk, tv, tkh, tvh = (t.index_select(-3, idx) for t in (tk, tv, tkh, tvh))

    bq, bk = tuple(tq.shape[:-2]), tuple(tk.shape[:-2])
    try:
        batch = tuple(torch.broadcast_shapes(bq, bk))
    except RuntimeError as exc:
        raise ShapeError(
            f"batch dims of q {bq} and k {bk} do not broadcast (q is [..., Q, D], k is "
            f"[..., T, D])"
        ) from exc
    nb = len(batch)
    bq_p = (1,) * (nb - len(bq)) + bq
    bk_p = (1,) * (nb - len(bk)) + bk
    fold = [i for i in range(nb) if bk_p[i] == 1 and batch[i] > 1]
    keep = [i for i in range(nb) if i not in fold]

    def canon_q(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(*bq_p, Q, t.shape[-1]).expand(*batch, Q, t.shape[-1])
        t = t.permute(*keep, *fold, nb, nb + 1)
        n_keep = int(np.prod([batch[i] for i in keep])) if keep else 1
        return t.reshape(n_keep, -1, t.shape[-1])

    def canon_kv(t: torch.Tensor) -> torch.Tensor:
        c = t.shape[-1]
        t = t.reshape(*bk_p, T, c)
        idx = tuple(0 if i in fold else slice(None) for i in range(nb))
        t = t[idx]
        shape_keep = [batch[i] for i in keep]
        t = t.expand(*shape_keep, T, c)
        return t.reshape(-1, T, c)

    cq = canon_q(tq)
    ck, cv, ckh, cvh = (canon_kv(t) for t in (tk, tv, tkh, tvh))
    n_fold = int(np.prod([batch[i] for i in fold])) if fold else 1
    if qpos is not None:
        qpos = qpos.repeat(n_fold)
    plan = _Plan(
        numpy_out=numpy_out,
        dtype=tq.dtype,
        batch=batch,
        keep=keep,
        fold=fold,
        n_query=Q,
        gqa_perm=gqa_perm,
        gqa_groups=groups,
    )
    csink = None
    if sink is not None:
        cq, csink = cq[..., :D], cq[..., D]
    return plan, (cq, ck, cv, ckh, cvh, qpos, scale, window, csink)


def _unfold(plan: _Plan, t: torch.Tensor) -> torch.Tensor:
    """``[B, M, *tail]`` -> caller layout ``[*batch, Q, *tail]`` (undoing GQA grouping)."""
    tail = tuple(t.shape[2:])
    b = plan.batch
    nb = len(b)
    shape = [b[i] for i in plan.keep] + [b[i] for i in plan.fold] + [plan.n_query, *tail]
    t = t.reshape(shape)
    order = plan.keep + plan.fold
    inv = [order.index(i) for i in range(nb)]
    t = t.permute(*inv, *range(nb, t.ndim))
    if plan.gqa_perm is not None:
        # [..., hkv, G, Q, *tail] -> [..., hq, Q, *tail] in the caller's head order
        t = t.reshape(*b[:-2], b[-2] * b[-1], plan.n_query, *tail)
        inv_perm = torch.argsort(plan.gqa_perm).to(t.device)
        t = t.index_select(nb - 2, inv_perm)
    return t.contiguous()


def _out(plan: _Plan, t: torch.Tensor | None):
    if t is None:
        return None
    u = _unfold(plan, t)
    return u.cpu().numpy() if plan.numpy_out else u


def _run(q, k, v, k_hat, v_hat, *, causal, scale, kv_head_of_q, q_positions, topk,
         block_size, keep_rows, check_finite, window, sink) -> Decomposition:
    if int(topk) < 1:
        raise ShapeError(f"topk must be >= 1, got {topk}")
    plan, (cq, ck, cv, ckh, cvh, qpos, sc, window, csink) = _prepare(
        q, k, v, k_hat, v_hat, causal=causal, scale=scale, kv_head_of_q=kv_head_of_q,
        q_positions=q_positions, check_finite=check_finite, window=window, sink=sink,
    )
    B, M, _ = cq.shape
    T = ck.shape[1]
    block = T if keep_rows and block_size is None else choose_block(B, M, T, block_size)
    log.debug("decompose: B=%d M=%d T=%d block=%d dtype=%s", B, M, T, block, cq.dtype)
    with torch.no_grad():
        res = run_engine(cq, ck, cv, ckh, cvh, qpos, sc, block=block, keep_rows=keep_rows,
                         topk=int(topk), window=window, sink=csink)
    return Decomposition(
        delta_logits=_out(plan, res.delta_logits),
        attn=_out(plan, res.attn),
        attn_hat=_out(plan, res.attn_hat),
        key_term=_out(plan, res.key_term),
        value_term=_out(plan, res.value_term),
        cross_term=_out(plan, res.cross_term),
        total=_out(plan, res.total),
        out=_out(plan, res.out),
        metrics={n: _out(plan, res.metrics[n].unsqueeze(-1))[..., 0] for n in QUERY_METRICS},
    )


def decompose(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    k_hat: ArrayLike,
    v_hat: ArrayLike,
    causal: bool = True,
    scale: float | None = None,
    *,
    kv_head_of_q: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    q_positions: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    topk: int = 8,
    block_size: int | None = None,
    check_finite: bool = True,
    window: int = 0,
    sink: ArrayLike | None = None,
) -> Decomposition:
    """Decompose the attention-output error caused by reconstructed keys and values.

    Parameters
    ----------
    q : numpy.ndarray or torch.Tensor
        ``[..., Q, D]`` queries (post-RoPE when keys are post-RoPE).
    k, k_hat : numpy.ndarray or torch.Tensor
        ``[..., T, D]`` clean and reconstructed keys.
    v, v_hat : numpy.ndarray or torch.Tensor
        ``[..., T, Dv]`` clean and reconstructed values.
    causal : bool
        When true the Q queries are the last Q of the T positions and query i sees keys
        ``0 .. T − Q + i``. When false every query sees every key.
    scale : float, optional
        Logit scale; defaults to ``1/sqrt(D)``.
    kv_head_of_q : sequence of int, optional
        Grouped-query attention: ``q`` is ``[..., q_head, Q, D]``, the keys and values are
        ``[..., kv_head, T, ·]`` and query head h reads kv head ``kv_head_of_q[h]``.
    q_positions : sequence of int, optional
        ``[Q]`` explicit positions of the queries on the key axis (with ``causal``), instead of
        the last Q.
    window : int
        Sliding-window attention (with ``causal``): a query at position p sees keys
        ``p − window < t ≤ p``, the rule of transformers' sliding-window masks. 0 (default):
        every key up to its position.
    sink : numpy.ndarray or torch.Tensor, optional
        Learned attention-sink logits (gpt-oss), broadcast against q's batch dims (``[q_head]``
        with ``kv_head_of_q``): each softmax row gets one more column, ``sink`` itself (the
        logit scale does not apply), without a value and unchanged by key errors. The weights
        then sum to less than one; KL, TV and entropy are those of the whole row.
    topk : int
        k of the top-k overlap and rank-flip metrics.
    block_size : int, optional
        Keys per block. The rows (``delta_logits``, ``attn``, ``attn_hat``) are always returned
        whole; blocking only bounds the temporaries. Use :func:`decompose_stream` to avoid the
        ``[..., Q, T]`` rows altogether.
    check_finite : bool
        Reject NaN/Inf inputs (costs one pass over the inputs).

    Returns
    -------
    Decomposition
        Arrays of the inputs' library and dtype; batch dims are the broadcast of q's and k's.

    Raises
    ------
    kverr.exceptions.ShapeError, kverr.exceptions.DTypeError, kverr.exceptions.NonFiniteError
        On mismatched shapes, unsupported or mixed dtypes, or NaN/Inf inputs.

    Notes
    -----
    ``key_term + value_term + cross_term == total`` holds to round-off. The weight change
    ``attn_hat − attn`` inside the key and cross terms is formed without cancellation (see
    :mod:`kverr.error.terms`), so those terms are accurate even when tiny.
    """
    return _run(q, k, v, k_hat, v_hat, causal=causal, scale=scale, kv_head_of_q=kv_head_of_q,
                q_positions=q_positions, topk=topk, block_size=block_size, keep_rows=True,
                check_finite=check_finite, window=window, sink=sink)


def decompose_stream(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    k_hat: ArrayLike,
    v_hat: ArrayLike,
    causal: bool = True,
    scale: float | None = None,
    *,
    kv_head_of_q: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    q_positions: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    topk: int = 8,
    block_size: int | None = None,
    check_finite: bool = True,
    window: int = 0,
    sink: ArrayLike | None = None,
) -> Decomposition:
    """Like :func:`decompose` but streamed over key blocks, without the ``[..., Q, T]`` rows.

    Memory is bounded by the inputs plus about a dozen ``[B·M, block]`` slabs, where the block
    length is chosen to keep each slab near 4M elements (or ``block_size``). The returned
    :class:`Decomposition` has ``delta_logits``, ``attn`` and ``attn_hat`` set to None; every
    other field and every metric is the same as :func:`decompose` gives, up to round-off.

    Parameters and raised errors are those of :func:`decompose`.
    """
    return _run(q, k, v, k_hat, v_hat, causal=causal, scale=scale, kv_head_of_q=kv_head_of_q,
                q_positions=q_positions, topk=topk, block_size=block_size, keep_rows=False,
                check_finite=check_finite, window=window, sink=sink)
