"""Keys rounded with error compensation: the codes GPTQ's sequential rule chooses on a format's
own grid.

A key error ``e`` at token ``t`` costs a query ``q`` the score error ``q·e / √d`` (for keys stored
before RoPE, ``q·R_t e / √d``), so over the queries that read the token its expected squared
cost is ``eᵀ C_t e`` with ``C_t = R_tᵀ Σ_q R_t``, ``Σ_q`` the queries' second moment
(:func:`query_moment`, :func:`turned_cost`). Nearest rounding minimises ``‖e‖²`` element by
element. The sequential rule (GPTQ's, applied to one token's key vector as GPTQ applies it to
one weight row) rounds the channels one at a time and moves the channels not yet rounded so as
to cancel, under ``C_t``, the error just made. The grid -- the scales, zero points and channel
widths :func:`~kverr.quant.reference.quantize` fits -- stays the format's: only the codes change,
so the bytes, their layout and every decoder are those of the format.

Rules (:func:`compensated_quantize`):

* Integer formats whose codes are computed from the stored scale (``encode_with`` ``"stored"``);
  a Hadamard-rotated format is compensated in its rotated coordinates (``Aᵀ C_t A``).
* The cost is damped, ``C_t + λ·mean(diag C_t)·I`` with ``λ`` = :data:`DAMP` (``I`` when ``C_t``
  is zero), so that every token has a Cholesky factor.
* Per token, channels without bits come first (they read back their zero point, and the channels
  after them absorb their error), then by falling diagonal of ``C_t``; ties by channel index.
* Channel ``j`` in that order: the compensated value, cast to fp32, is encoded as the format
  encodes it (its quotient and rounding, clamped to its width's codes) and decoded as the format
  decodes it; its error divided by ``U_jj`` times row ``j`` of ``U`` -- the upper Cholesky factor
  of the damped ``C_t⁻¹`` in that order -- is subtracted from the channels after it. The
  compensation is computed in float64.
* With ``C_t`` a multiple of the identity nothing is compensated and the codes are
  :func:`~kverr.quant.reference.quantize`'s, bit for bit.
"""

from __future__ import annotations

import math

import torch

from kverr.exceptions import ConfigError, ShapeError
from kverr.quant.formats import QuantFormat
from kverr.quant.reference import (
    QTensor,
    _quotient,
    as_float_tensor,
    hadamard_rotate,
    pack_codes,
    quantize,
    round_codes,
)
from kverr.rope import rotate

__all__ = ["DAMP", "compensable", "compensated_quantize", "query_moment", "turned_cost"]

#: Damping of the cost, a fraction of its mean diagonal (GPTQ's default).
DAMP = 0.01


def compensable(fmt: QuantFormat) -> bool:
    """Whether :func:`compensated_quantize` takes ``fmt``: integer codes computed from the stored
    scale. Other formats keep nearest rounding."""
    return fmt.dtype == "int" and fmt.encode_with == "stored"


def query_moment(query: torch.Tensor, n_kv_heads: int, last: int) -> torch.Tensor:
    """Second moment ``Σ_q = mean q qᵀ``, ``[B, kv_head, D, D]`` float64, of the last ``last``
    queries ``query [B, q_head, n, D]`` (post-RoPE) of each sequence, over the query heads that
    read each kv head (query head ``i`` reads kv head ``i // (q_heads / kv_heads)``)."""
    if query.ndim != 4:
        raise ShapeError(f"query must be [batch, q_head, token, channel], got shape {tuple(query.shape)}")
    B, Hq, n, D = query.shape
    if n_kv_heads <= 0 or Hq % n_kv_heads:
        raise ShapeError(f"{Hq} query heads cannot be shared by {n_kv_heads} kv heads")
    if last <= 0 or n == 0:
        raise ShapeError(f"the second moment needs at least one query (last={last}, {n} positions)")
    q = query[:, :, -last:].double()
    m = q.shape[2]
    q = q.reshape(B, n_kv_heads, Hq // n_kv_heads * m, D)
    return torch.einsum("bgnd,bgne->bgde", q, q) / q.shape[2]


def turned_cost(moment: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``C_t = R_tᵀ Σ R_t``, ``[..., T, D, D]`` float64: the cost of an error in a key stored
    before RoPE at each of the ``T`` positions whose RoPE tables ``cos, sin [T, D]`` are given
    (:func:`kverr.rope.rotate`), for the second moment ``moment [..., D, D]`` of post-RoPE
    queries."""
    T, D = cos.shape
    eye = torch.eye(D, dtype=torch.float32, device=cos.device).expand(T, D, D)
    # rows of P_t = R_tᵀ: row j is R_t e_j
    P = rotate(eye, cos.float()[:, None, :], sin.float()[:, None, :]).double()
    return P @ moment.double()[..., None, :, :] @ P.transpose(-1, -2)


def compensated_quantize(
    x: torch.Tensor,
    fmt: QuantFormat,
    cost: torch.Tensor,
    *,
    page_size: int | None = None,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    damp: float = DAMP,
) -> QTensor:
    """Quantize ``x`` as :func:`~kverr.quant.reference.quantize` does -- the same scales and
    zero points -- with codes chosen by the module's sequential rule.

    Parameters
    ----------
    x
        ``[..., H, T, D]`` floating point (computed in float32, as ``quantize`` does).
    fmt
        A format :func:`compensable` takes.
    cost
        The cost of an error in each token, broadcastable to ``[..., H, T, D, D]``, in the
        coordinates of ``x`` (before the format's rotation); symmetric positive semi-definite.
    page_size, scale, zero
        As for ``quantize``.
    damp
        The damping fraction (default :data:`DAMP`).

    Returns
    -------
    QTensor
        ``quantize``'s scales and zero points, the compensated codes.
    """
    if not compensable(fmt):
        raise ConfigError(f"{fmt.label()}: compensated rounding takes integer formats that encode with the stored "
                          "scale; this one keeps nearest rounding")
    if not damp >= 0 or not math.isfinite(damp):
        raise ConfigError(f"damp={damp} must be a finite fraction >= 0")
    qt = quantize(x, fmt, page_size=page_size, scale=scale, zero=zero)
    x32 = as_float_tensor(x)
    shape = tuple(x32.shape)
    D = shape[-1]
    try:
        C = torch.broadcast_to(torch.as_tensor(cost, dtype=torch.float64), (*shape, D))
    except RuntimeError:
        raise ShapeError(f"cost of shape {tuple(torch.as_tensor(cost).shape)} does not broadcast to "
                         f"{(*shape, D)} ([..., H, T, D, D] for x of shape {shape})") from None
    if not bool(torch.isfinite(C).all()):
        raise ConfigError("the cost holds NaN/Inf")
    if fmt.rotate == "hadamard":
        x32 = hadamard_rotate(x32)
        A = hadamard_rotate(torch.eye(D)).double()  # x A: the rotated coordinates
        C = A.T @ C @ A
    s, m = qt.element_metadata()
    N = math.prod(shape[:-1])
    w = x32.reshape(N, D).double()
    s, m = s.reshape(N, D), (torch.zeros_like(s) if m is None else m).reshape(N, D)
    C = C.reshape(N, D, D)
    widths = torch.tensor(fmt.channel_bits if fmt.channel_bits is not None else [fmt.bits] * D)

    diag = C.diagonal(dim1=1, dim2=2)
    key = torch.where(widths == 0, torch.tensor(math.inf, dtype=torch.float64), diag)
    order = torch.argsort(key, dim=1, descending=True, stable=True)  # [N, D]
    w, s, m, b = (t.gather(1, order) for t in (w, s, m, widths.expand(N, D)))
    C = C.gather(1, order[:, :, None].expand(N, D, D)).gather(2, order[:, None, :].expand(N, D, D))
    mean = diag.mean(1)
    lam = torch.where(mean > 0, damp * mean, torch.ones_like(mean))
    Cd = C + lam[:, None, None] * torch.eye(D, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Cd)), upper=True)

    top = torch.where(b > 0, 2 ** b - 1, 0) if fmt.has_zero else torch.full_like(b, fmt.levels)
    codes = torch.zeros((N, D), dtype=torch.uint8)
    for j in range(D):
        sj, mj = s[:, j], m[:, j]
        quot = _quotient(fmt, sj)
        v = w[:, j].float()
        if fmt.has_zero:
            r = torch.minimum(round_codes(fmt, quot(v - mj)).clamp(min=0), top[:, j].float())
            r = torch.where(b[:, j] > 0, r, torch.zeros_like(r))
            codes[:, j] = r.to(torch.uint8)
            back = r * sj + mj
        else:
            L = float(fmt.levels)
            r = round_codes(fmt, quot(v)).clamp(-L, L)
            codes[:, j] = (r + 2 ** (fmt.bits - 1)).to(torch.uint8)
            back = r * sj
        err = (w[:, j] - back.double()) / U[:, j, j]
        w[:, j + 1:] -= err[:, None] * U[:, j, j + 1:]
    u = torch.empty_like(codes).scatter_(1, order, codes).reshape(shape)
    return QTensor(pack_codes(u, fmt).reshape(qt.codes.shape), qt.scale, qt.zero, fmt, qt.shape, qt.page_size)
