"""Plain reference for the attention-error terms: one query at a time, float64, by definition.

This is the yardstick the tests hold :mod:`kverr.error.terms` and its users (the streaming
decomposition, the calibration objective) to. It is written to be read, not to be fast: one
query, its visible keys, every quantity formed exactly as the definitions in
:mod:`kverr.error.terms` state it (including the subtraction ``a′ − a``, whose cancellation the
fast paths avoid; for tiny key errors compare with :attr:`QueryTerms.first_order_key_term`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kverr.exceptions import ShapeError

__all__ = ["QueryTerms", "decompose_query", "log_softmax", "softmax"]


def softmax(s: np.ndarray) -> np.ndarray:
    """Softmax of one logit row ``s [T]`` (float64)."""
    e = np.exp(s - s.max())
    return e / e.sum()


def log_softmax(s: np.ndarray) -> np.ndarray:
    """``log softmax(s)`` of one logit row ``s [T]`` (finite where the softmax underflows)."""
    m = s.max()
    return s - m - np.log(np.exp(s - m).sum())


@dataclass(frozen=True)
class QueryTerms:
    """Every quantity of one query's attention error (numpy float64).

    Attributes
    ----------
    logits, delta_logits, attn, attn_hat : numpy.ndarray
        ``[n_visible]`` s = c·q·Kᵀ, δs = c·q·E_Kᵀ, a = softmax(s), a′ = softmax(s + δs) over the
        visible keys.
    key_term, value_term, cross_term, total, out : numpy.ndarray
        ``[Dv]`` (a′ − a)V, aE_V, (a′ − a)E_V, a′V̂ − aV and aV.
    first_order_weight_change : numpy.ndarray
        ``[T]`` (diag(a) − aaᵀ)·δs.
    first_order_key_term : numpy.ndarray
        ``[Dv]`` its product with V.
    kl : float
        KL(a‖a′) = Σ a·log(a/a′).
    """

    logits: np.ndarray
    delta_logits: np.ndarray
    attn: np.ndarray
    attn_hat: np.ndarray
    key_term: np.ndarray
    value_term: np.ndarray
    cross_term: np.ndarray
    total: np.ndarray
    out: np.ndarray
    first_order_weight_change: np.ndarray
    first_order_key_term: np.ndarray
    kl: float


def decompose_query(
    q, k, v, k_hat, v_hat, scale: float, n_visible: int | None = None, window: int = 0,
    sink: float | None = None,
) -> QueryTerms:
    """The attention error of one query, by definition, in float64.

    Parameters
    ----------
    q : array_like
        ``[D]`` the query.
    k, k_hat : array_like
        ``[T, D]`` clean and reconstructed keys.
    v, v_hat : array_like
        ``[T, Dv]`` clean and reconstructed values.
    scale : float
        Logit scale c.
    n_visible : int, optional
        The query sees keys ``0 .. n_visible − 1`` (causal attention at position
        ``n_visible − 1``); default all ``T``.
    window : int
        Sliding window: of those, the query sees only the last ``window`` keys (0: all).
    sink : float, optional
        A learned sink logit: one more softmax column, without a value, that key errors do not
        change; ``attn`` and ``attn_hat`` are the keys' weights (they sum to less than one) and
        ``kl`` is over the whole row, sink included.

    Returns
    -------
    QueryTerms
    """
    q, k, v, k_hat, v_hat = (np.asarray(x, dtype=np.float64) for x in (q, k, v, k_hat, v_hat))
    if q.ndim != 1 or k.ndim != 2 or k.shape != k_hat.shape or v.shape != v_hat.shape \
            or k.shape[0] != v.shape[0] or k.shape[1] != q.shape[0]:
        raise ShapeError(
            f"decompose_query needs q [D], k, k_hat [T, D], v, v_hat [T, Dv]; got q {q.shape}, "
            f"k {k.shape}, k_hat {k_hat.shape}, v {v.shape}, v_hat {v_hat.shape}"
        )
    n = k.shape[0] if n_visible is None else int(n_visible)
    if not 1 <= n <= k.shape[0]:
        raise ShapeError(f"n_visible must lie in [1, {k.shape[0]}], got {n_visible}")
    if window < 0:
        raise ShapeError(f"window must be >= 0, got {window}")
    first = max(0, n - window) if window else 0
    k, k_hat, v, v_hat = k[first:n], k_hat[first:n], v[first:n], v_hat[first:n]
    e_v = v_hat - v

    s = scale * (k @ q)
    ds = scale * ((k_hat - k) @ q)
    extra = [] if sink is None else [float(sink)]
    a_row, a_hat_row = softmax(np.r_[s, extra]), softmax(np.r_[s + ds, extra])
    a, a_hat = a_row[: s.shape[0]], a_hat_row[: s.shape[0]]
    da = a_hat - a

    jacobian = np.diag(a) - np.outer(a, a)
    lin = jacobian @ ds
    return QueryTerms(
        logits=s,
        delta_logits=ds,
        attn=a,
        attn_hat=a_hat,
        key_term=da @ v,
        value_term=a @ e_v,
        cross_term=da @ e_v,
        total=a_hat @ v_hat - a @ v,
        out=a @ v,
        first_order_weight_change=lin,
        first_order_key_term=lin @ v,
        kl=float(np.sum(a_row * (log_softmax(np.r_[s, extra]) - log_softmax(np.r_[s + ds, extra])))),
    )
