"""Rounding bounds for the tests' float32 claims, derived from the arithmetic.

Where a claim compares float32 results of library code (a model's attention, its forward) with
kverr's own computation, the summation order belongs to the library and the CPU, so the claim is
a bound, not equality. The bounds here are worst-case forward-error bounds (Higham, *Accuracy and
Stability of Numerical Algorithms*, ch. 3): a length-``n`` float32 dot product is off by at most
``gamma(n) * sum |x_i y_i|``, ``gamma(n) = n u / (1 - n u)``, ``u = 2**-24``.
"""

from __future__ import annotations

import numpy as np

U32 = float(np.finfo(np.float32).eps) / 2


def gamma(n: int, u: float = U32) -> float:
    """``n u / (1 - n u)``: the worst-case relative error of a sum or dot product of ``n`` terms."""
    return n * u / (1 - n * u)


def attention_rounding_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                             kv_head_of_q: np.ndarray) -> np.ndarray:
    """Per query head, the largest difference float32 rounding can make to causal attention.

    Scores: each ``s_ij = scale q_i . k_j`` is off by at most ``gamma(D) scale |q_i| . |k_j|``
    (Cauchy-Schwarz: at most ``gamma(D) scale ||q_i|| ||k_j||``), plus a rounding of ``s`` itself.
    Softmax: to first order ``da_j = a_j (ds_j - sum_l a_l ds_l)``, so ``|da_j| <= 2 a_j max|ds|``
    (exp's own rounding, a few ulps, is well inside the factor 2). Output: ``sum_j |da_j| |v_j|
    <= 2 max|ds| max|v|``, plus ``gamma(T)`` for the weighted sum and ``gamma(T)`` for the
    normalisation, each times ``max|v|``.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_head, token, channel]``.
    k, v : numpy.ndarray
        ``[kv_head, token, channel]``.
    scale : float
        The softmax scale.
    kv_head_of_q : numpy.ndarray
        ``[q_head]`` kv head of each query head.

    Returns
    -------
    numpy.ndarray
        ``[q_head, 1, 1]`` absolute bounds, broadcastable against ``[q_head, token, channel]``.
    """
    D, T = q.shape[-1], k.shape[-2]
    qn = np.linalg.norm(q.astype(np.float64), axis=-1).max(axis=-1)  # [q_head]
    kn = np.linalg.norm(k.astype(np.float64), axis=-1).max(axis=-1)[kv_head_of_q]
    vmax = np.abs(v.astype(np.float64)).max(axis=(-2, -1))[kv_head_of_q]
    smax = abs(scale) * qn * kn
    ds = gamma(D) * smax + U32 * smax
    return ((2 * ds + 2 * gamma(T)) * vmax)[:, None, None]
