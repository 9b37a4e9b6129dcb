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

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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

__all__ = [
    "DAMP", "CompensationFactor", "KeyCost", "KeyMoments", "compensable", "compensated_quantize", "compensation_factor",
    "query_moment", "reads_in_groups", "stored_moment", "turned_cost",
]

#: Damping of the cost, a fraction of its mean diagonal (GPTQ's default).
DAMP = 0.01


def compensable(fmt: QuantFormat) -> bool:
    """Whether :func:`compensated_quantize` takes ``fmt``: integer codes computed from the stored
    scale. Other formats keep nearest rounding."""
    return fmt.dtype == "int" and fmt.encode_with == "stored"


def reads_in_groups(kv_map: Any, n_kv_heads: int) -> bool:
    """Whether ``kv_map`` (the kv head each query head reads) is the grouping :func:`query_moment`
    and the salient-token rule (:mod:`kverr.error.salient`) take: query head ``i`` reads kv head
    ``i // (q_heads / kv_heads)``."""
    m = torch.as_tensor(kv_map).long().flatten().cpu()
    n = m.numel()
    return n_kv_heads > 0 and n % n_kv_heads == 0 and torch.equal(m, torch.arange(n) // (n // n_kv_heads))


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


#: The dtype a static query moment is stored in (:class:`KeyMoments`).
MOMENT_DTYPE = "fp16"


def stored_moment(moment: torch.Tensor) -> torch.Tensor:
    """The second moment ``moment [..., D, D]`` as :class:`KeyMoments` stores it and every cache
    reads it back, float64: divided by its mean diagonal (the rule's codes do not change with the
    moment's scale, and the quotient's entries lie within ``±D``, inside fp16's range), each entry
    of the upper triangle rounded to fp16, the lower triangle its mirror. A zero moment stays zero."""
    M = torch.as_tensor(moment, dtype=torch.float64)
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ShapeError(f"a moment must be [..., D, D], got shape {tuple(M.shape)}")
    mean = M.diagonal(dim1=-2, dim2=-1).mean(-1)
    M = M / torch.where(mean > 0, mean, torch.ones_like(mean))[..., None, None]
    up = torch.triu(M.half().double())
    return up + torch.triu(up, diagonal=1).transpose(-1, -2)


@dataclass(frozen=True, eq=False)
class KeyMoments:
    """Static query moments: for every layer and kv head the second moment of a calibration
    capture's queries, under which a config with ``key_rounding`` ``"compensated"`` rounds every
    key it quantizes -- prompt and decode alike, the same moment for every sequence -- instead of
    waiting for each prefill's queries.

    ``packed`` ``[layer, kv_head, D·(D+1)/2]`` float16 holds the upper triangle, row by row, of
    :func:`stored_moment`; it is a model's static bytes (``nbytes``, counted by
    :func:`kverr.memory.account`). In a config's JSON: ``{"dtype": "fp16", "shape": [L, H, D],
    "data": <base64 of the little-endian fp16 values>}``.
    """

    packed: np.ndarray
    head_dim: int

    def __post_init__(self) -> None:
        D = self.head_dim
        a = self.packed
        if not (isinstance(a, np.ndarray) and a.dtype == np.float16 and a.ndim == 3 and a.shape[-1] == D * (D + 1) // 2):
            raise ShapeError(f"packed moments must be float16 [layer, kv_head, D(D+1)/2] for head dim {D}, got "
                             f"{getattr(a, 'dtype', type(a).__name__)} of shape {tuple(getattr(a, 'shape', ()))}")
        if not np.isfinite(a).all():
            raise ConfigError("key_moments holds NaN/Inf")
        rows, cols = np.triu_indices(D)
        if (a[..., rows == cols] < 0).any():
            raise ConfigError("key_moments has a negative diagonal entry: not a second moment")
        a = a.copy()
        a.setflags(write=False)
        object.__setattr__(self, "packed", a)

    @classmethod
    def of(cls, moments: Any) -> KeyMoments:
        """From second moments ``[layer, kv_head, D, D]`` (:func:`query_moment` of each layer)."""
        M = stored_moment(moments)
        if M.ndim != 4:
            raise ShapeError(f"moments must be [layer, kv_head, D, D], got shape {tuple(M.shape)}")
        D = M.shape[-1]
        rows, cols = np.triu_indices(D)
        return cls(M.numpy()[..., rows, cols].astype(np.float16), D)

    @property
    def n_layers(self) -> int:
        return self.packed.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.packed.shape[1]

    @staticmethod
    def bytes_for(n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of the moments of a model of that shape: an fp16 upper triangle per layer and kv head."""
        return n_layers * n_kv_heads * (head_dim * (head_dim + 1) // 2) * 2

    @property
    def nbytes(self) -> int:
        """Bytes stored, all layers (:meth:`bytes_for` of their shape)."""
        return int(self.packed.nbytes)

    def layer_nbytes(self) -> int:
        """Bytes stored for one layer."""
        return self.nbytes // self.n_layers

    def layer(self, layer: int) -> torch.Tensor:
        """The moments of ``layer``, ``[kv_head, D, D]`` float64 (:func:`stored_moment`'s values)."""
        D = self.head_dim
        rows, cols = np.triu_indices(D)
        M = torch.zeros((self.n_kv_heads, D, D), dtype=torch.float64)
        M[:, rows, cols] = torch.from_numpy(self.packed[layer].astype(np.float64))
        return M + torch.triu(M, diagonal=1).transpose(-1, -2)

    def select_layers(self, layers: Sequence[int]) -> KeyMoments:
        """The moments of ``layers``, in that order."""
        return KeyMoments(self.packed[list(layers)], self.head_dim)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyMoments):
            return NotImplemented
        return self.head_dim == other.head_dim and self.packed.shape == other.packed.shape and \
            self.packed.tobytes() == other.packed.tobytes()

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        L, H, _ = self.packed.shape
        data = base64.b64encode(self.packed.astype("<f2").tobytes()).decode("ascii")
        return {"dtype": MOMENT_DTYPE, "shape": [L, H, self.head_dim], "data": data}

    @classmethod
    def from_dict(cls, obj: Any, where: str = "key_moments") -> KeyMoments:
        if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
            raise ConfigError(f"{where} must be an object with exactly 'dtype', 'shape' and 'data', got "
                              f"{sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
        if obj["dtype"] != MOMENT_DTYPE:
            raise ConfigError(f"{where}.dtype={obj['dtype']!r} is not allowed; {MOMENT_DTYPE!r}")
        shape = obj["shape"]
        if not (isinstance(shape, list) and len(shape) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1 << 16 for n in shape)):
            raise ConfigError(f"{where}.shape={shape!r} is not allowed; [layers, kv_heads, head_dim] of positive integers")
        L, H, D = shape
        try:
            raw = base64.b64decode(obj["data"], validate=True) if isinstance(obj["data"], str) else None
        except (ValueError, binascii.Error):
            raw = None
        want = L * H * (D * (D + 1) // 2) * 2
        if raw is None or len(raw) != want:
            raise ConfigError(f"{where}.data is not base64 of {want} bytes (fp16 upper triangles of "
                              f"{L} x {H} moments of head dim {D})")
        return cls(np.frombuffer(raw, dtype="<f2").astype(np.float16).reshape(L, H, -1), D)


#: Tokens :func:`turned_cost` turns at once on a CPU: the intermediates of a few dozen stay in
#: its cache.
TURN_CHUNK = 32


def turned_cost(moment: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``C_t = R_tᵀ Σ R_t``, ``[..., T, D, D]`` float64: the cost of an error in a key stored
    before RoPE at each of the ``T`` positions whose RoPE tables ``cos, sin [T, D]`` are given
    (:func:`kverr.rope.rotate`), for the second moment ``moment [..., D, D]`` of post-RoPE
    queries."""
    T, D = cos.shape
    if D % 2:
        raise ShapeError(f"RoPE tables of {D} channels: the half-rotation pairs an even number")
    dev, h = cos.device, D // 2
    # Row j of P_t = R_tᵀ is R_t e_j (:func:`kverr.rope.rotate`, in float32 as it applies it):
    # cos_t[j] at channel j and ± sin_t[p(j)] at its partner p(j) = j ± D/2 (+ for j < D/2).
    # Two terms per row, so C_t = P_t Σ P_tᵀ is formed elementwise in O(D²) per token rather than
    # by two D³ products -- each sum of two rounded products, the same on every device.
    partner = torch.cat([torch.arange(h, D, device=dev), torch.arange(h, device=dev)])
    sign = torch.cat([torch.ones(h, dtype=torch.float64, device=dev), -torch.ones(h, dtype=torch.float64, device=dev)])
    c = cos.float().double()
    off = sign * sin.float().double()[:, partner]  # [T, D]: P_t[j, p(j)]
    m = moment.double()[..., None, :, :]
    mp = m[..., partner, :]
    out = torch.empty((*m.shape[:-3], T, D, D), dtype=torch.float64, device=dev)
    step = TURN_CHUNK if dev.type == "cpu" else max(T, 1)
    for a in range(0, T, step):
        ca, oa = c[a:a + step], off[a:a + step]
        ps = ca[:, :, None] * m + oa[:, :, None] * mp  # P_t Σ
        out[..., a:a + step, :, :] = ps * ca[:, None, :] + ps[..., partner] * oa[:, None, :]
    return out


@dataclass(frozen=True, eq=False)
class CompensationFactor:
    """What the sequential rule fixes before it rounds, per token: the channel order and the upper
    Cholesky factor ``U`` of the damped ``C_t⁻¹`` in that order (:func:`compensation_factor`).

    ``order`` ``[..., D]`` int64 and ``U`` ``[..., D, D]`` float64 share the cost's leading shape,
    which broadcasts to the ``[..., H, T]`` of the keys it rounds; ``U`` is stored channel-major
    (``channel_major`` ``[D, D, ...]``, as the sequential pass reads it: one contiguous row of
    every token's ``U`` per step). It depends on the format only through its rotation and its
    channels without bits (``rotate``, ``zeros``), so every format alike in those -- other
    widths, scales, clips -- rounds with one factor.
    """

    order: torch.Tensor
    channel_major: torch.Tensor
    rotate: str
    zeros: tuple[bool, ...]

    @property
    def U(self) -> torch.Tensor:
        """``[..., D, D]`` (a view of ``channel_major``)."""
        return self.channel_major.movedim((0, 1), (-2, -1))

    def fits(self, fmt: QuantFormat) -> bool:
        """Whether ``fmt`` rounds with this factor (same rotation, same channels without bits)."""
        return (fmt.rotate, _zeros(fmt, self.order.shape[-1])) == (self.rotate, self.zeros)

    def select(self, heads: Any = slice(None), tokens: slice = slice(None)) -> CompensationFactor:
        """The factor of some kv heads and tokens (the last two leading axes, ``[..., H, T]``); an
        axis of size 1 broadcasts and is kept whole."""
        lead = self.order.shape[:-1]
        if len(lead) < 2:
            raise ShapeError(f"a factor of leading shape {tuple(lead)} has no [..., H, T] axes to select from")
        h = slice(None) if lead[-2] == 1 else heads
        t = slice(None) if lead[-1] == 1 else tokens
        return CompensationFactor(self.order[..., h, t, :], self.channel_major[..., h, t], self.rotate, self.zeros)


def _zeros(fmt: QuantFormat, D: int) -> tuple[bool, ...]:
    return tuple(b == 0 for b in fmt.channel_bits) if fmt.channel_bits is not None else (False,) * D


def _damp(damp: float) -> float:
    if not damp >= 0 or not math.isfinite(damp):
        raise ConfigError(f"damp={damp} must be a finite fraction >= 0")
    return damp


def _as_cost(cost: Any) -> torch.Tensor:
    C = torch.as_tensor(cost, dtype=torch.float64)
    if C.ndim < 2 or C.shape[-1] != C.shape[-2]:
        raise ShapeError(f"a cost must be [..., D, D], got shape {tuple(C.shape)}")
    if not bool(torch.isfinite(C).all()):
        raise ConfigError("the cost holds NaN/Inf")
    return C


def compensation_factor(cost: Any, fmt: QuantFormat, *, damp: float = DAMP) -> CompensationFactor:
    """The channel order and Cholesky factor the module's rules give ``fmt`` under ``cost``
    ``[..., D, D]`` (one cost per token, or one that broadcasts over tokens), computed in float64:
    channels without bits first, then by falling diagonal of the cost in the format's
    coordinates, ties by channel index; ``U`` of ``(C + λ·mean(diag C)·I)⁻¹`` in that order."""
    return _factor(_as_cost(cost), fmt, _damp(damp))


#: Matrices a host factor computes at once: a hundred or so keep each pass's working set (128 of
#: 64 x 64 float64 matrices: 4 MiB) in the CPU's cache rather than streaming every token's cost
#: through memory once per pass.
FACTOR_CHUNK = 128


def _factor(C: torch.Tensor, fmt: QuantFormat, damp: float) -> CompensationFactor:
    """:func:`compensation_factor` of a checked float64 cost, on the cost's device.

    The damped cost ``C_d`` is factored with its channels in *reverse* order, ``J C_d J = L Lᵀ``;
    then ``C_d = (J L J)(J L J)ᵀ`` with ``J L J`` upper triangular, so ``C_d⁻¹ = Uᵀ U`` with
    ``U = J L⁻¹ J`` (upper, positive diagonal): the upper Cholesky factor of ``C_d⁻¹`` from one
    factorization and one triangular inverse, without forming ``C_d⁻¹``."""
    D = C.shape[-1]
    fmt.check_head_dim(D, "k")
    dev = C.device
    A = hadamard_rotate(torch.eye(D)).double().to(dev) if fmt.rotate == "hadamard" else None  # x A: rotated
    zeros = _zeros(fmt, D)
    no_bits = torch.tensor(zeros, device=dev)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=dev)
    eye = torch.eye(D, dtype=torch.float64, device=dev)
    lead = C.shape[:-2]
    flat = C.reshape(-1, D, D)
    n = flat.shape[0]
    order = torch.empty((n, D), dtype=torch.int64, device=dev)
    # channel-major [D, D, n]: one contiguous row of every token's U per step of the sequential pass
    major = torch.empty((D, D, n), dtype=torch.float64, device=dev)
    step = FACTOR_CHUNK if dev.type == "cpu" else max(n, 1)
    for a in range(0, n, step):
        c = flat[a:a + step]
        if A is not None:
            c = A.T @ c @ A
        diag = c.diagonal(dim1=-2, dim2=-1)
        # channels without bits first, then by falling diagonal, ties by channel index
        o = torch.argsort(torch.where(no_bits, inf, diag), dim=-1, descending=True, stable=True)
        r = o.flip(-1)
        c = c.gather(-2, r[:, :, None].expand(-1, D, D)).gather(-1, r[:, None, :].expand(-1, D, D))  # a copy
        mean = diag.mean(-1)
        c.diagonal(dim1=-2, dim2=-1).add_(torch.where(mean > 0, damp * mean, torch.ones_like(mean))[:, None])
        L = torch.linalg.cholesky(c)
        U = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False).flip(-2, -1)
        order[a:a + step] = o
        major[:, :, a:a + step] = U.permute(1, 2, 0)
    return CompensationFactor(order.reshape(*lead, D), major.reshape(D, D, *lead), fmt.rotate, zeros)


def _index(heads: Sequence[int]) -> list[int] | slice:
    """An index of the kv-head axis that takes ``heads`` in order: a slice (a view, no copy of
    every token's cost) where they are consecutive, else the list."""
    h = [int(i) for i in heads]
    return slice(h[0], h[-1] + 1) if h and h[0] >= 0 and h == list(range(h[0], h[-1] + 1)) else h


class KeyCost:
    """A cost ``[..., H, T, D, D]`` (``T`` may be 1: one cost for every token) with the factors of
    all its heads, each computed once per rotation and set of channels without bits and shared by
    the formats a calibration scores and by every subset of heads taken from it (:meth:`heads`)."""

    def __init__(self, cost: Any, *, damp: float = DAMP):
        self.cost = _as_cost(cost)
        if self.cost.ndim < 4:
            raise ShapeError(f"a key cost must be [..., H, T, D, D], got shape {tuple(self.cost.shape)}")
        self.damp = _damp(damp)
        # Shared with every subset: the cost they were taken from (None: this one; a subset holds
        # its root, never the reverse, so no cycle keeps a cost alive) and its factors of all
        # heads per (rotation, channels without bits).
        self._root: KeyCost | None = None
        self._factors: dict = {}
        self._of: list[int] | None = None  # the root's heads this cost holds (None: all)

    @classmethod
    def of_moment(cls, moment: Any, *, positions: Any = None, rope: Any = None, damp: float = DAMP) -> KeyCost:
        """The cost of keys read by queries of second moment ``moment [..., H, D, D]``
        (:func:`query_moment`): for post-RoPE keys (no ``positions``) the moment itself, one for
        every token (``[..., H, 1, D, D]``); for keys stored before RoPE, turned to each of the
        ``positions [T]`` under the layer's RoPE parameters ``rope`` (:func:`turned_cost`,
        ``[..., H, T, D, D]``), which must rotate all ``D`` channels."""
        moment = _as_cost(moment)
        if moment.ndim < 3:
            raise ShapeError(f"a query moment must be [..., H, D, D], got shape {tuple(moment.shape)}")
        if (positions is None) != (rope is None):
            raise ShapeError("turning a moment to the keys' positions needs both positions and rope")
        if positions is None:
            return cls(moment[..., None, :, :], damp=damp)
        from kverr.rope import parse_rope, rope_cos_sin

        cos, sin = rope_cos_sin(positions, *parse_rope(rope))
        if cos.shape[-1] != moment.shape[-1]:
            raise ConfigError(f"compensated rounding of pre-RoPE keys needs RoPE over all {moment.shape[-1]} "
                              f"channels; this layer rotates {cos.shape[-1]}")
        return cls(turned_cost(moment, cos, sin), damp=damp)

    @property
    def n_heads(self) -> int:
        return self.cost.shape[-4]

    @property
    def root(self) -> KeyCost:
        """The cost this one was taken from (:meth:`heads`), or itself."""
        return self if self._root is None else self._root

    def _root_heads(self, heads: Sequence[int] | None) -> list[int] | None:
        """``heads`` of this cost (None: all) as the root's head indices; None: all the root's,
        or a cost that broadcasts over heads."""
        if self.root.n_heads == 1:
            return None
        mine = list(range(self.n_heads)) if heads is None else [int(h) for h in heads]
        if any(not 0 <= h < self.n_heads for h in mine):
            raise ShapeError(f"kv heads {mine} of a cost of {self.n_heads}")
        got = mine if self._of is None else [self._of[h] for h in mine]
        return None if got == list(range(self.root.n_heads)) else got

    def heads(self, heads: Sequence[int]) -> KeyCost:
        """The cost of some kv heads, sharing the factors made, and to be made, for any of them."""
        out = KeyCost.__new__(KeyCost)
        broadcast = self.root.n_heads == 1
        out._of = None if broadcast else self._root_heads(heads)  # checks them
        out.cost = self.cost if broadcast else self.cost[..., _index(heads), :, :, :]
        out.damp, out._root, out._factors = self.damp, self.root, self._factors
        return out

    def factor(self, fmt: QuantFormat, heads: Sequence[int] | None = None) -> CompensationFactor:
        """The factor of ``fmt`` for all kv heads, or for ``heads`` (leading shape ``[..., len(heads), T]``).

        The factor of all heads is kept, and the heads asked for later are views of it, from this
        cost or any subset of it; that of some heads, asked for before, is computed for them and
        not kept (a fitted template's channels without bits are its head's alone: kept, their
        factors would hold the memory of many whole ones)."""
        heads = self._root_heads(heads)
        root = self.root
        ident = (fmt.rotate, _zeros(fmt, self.cost.shape[-1]))
        whole = root._factors.get(ident)
        if whole is None and heads is None:
            whole = root._factors[ident] = _factor(root.cost, fmt, root.damp)
        if whole is not None:
            return whole if heads is None else whole.select(_index(heads))  # consecutive heads: a view
        return _factor(root.cost[..., _index(heads), :, :, :], fmt, root.damp)


def compensated_quantize(
    x: torch.Tensor,
    fmt: QuantFormat,
    cost: Any,
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
        Or its :class:`CompensationFactor` for ``fmt`` (:func:`compensation_factor`,
        :meth:`KeyCost.factor`), leading shape broadcastable to ``[..., H, T]``.
    page_size, scale, zero
        As for ``quantize``.
    damp
        The damping fraction (default :data:`DAMP`; a factor carries its own).

    Returns
    -------
    QTensor
        ``quantize``'s scales and zero points, the compensated codes.
    """
    if not compensable(fmt):
        raise ConfigError(f"{fmt.label()}: compensated rounding takes integer formats that encode with the stored "
                          "scale; this one keeps nearest rounding")
    if isinstance(cost, CompensationFactor):
        if not cost.fits(fmt):
            raise ConfigError(f"{fmt.label()}: the factor was made for another rotation ({cost.rotate!r}) or other "
                              "channels without bits")
        factor = cost
    else:
        factor = compensation_factor(cost, fmt, damp=damp)
    qt = quantize(x, fmt, page_size=page_size, scale=scale, zero=zero)
    x32 = as_float_tensor(x)
    shape = tuple(x32.shape)
    D = shape[-1]
    lead = shape[:-1]
    try:
        order = factor.order.expand(*lead, D)
        cm = factor.channel_major
        Ut = cm.reshape(D, D, *(1,) * (len(lead) - cm.ndim + 2), *cm.shape[2:]).expand(D, D, *lead)
    except RuntimeError:
        raise ShapeError(f"cost of leading shape {tuple(factor.order.shape[:-1])} does not broadcast to "
                         f"{lead} ([..., H, T, D, D] for x of shape {shape})") from None
    if fmt.rotate == "hadamard":
        x32 = hadamard_rotate(x32)
    s, m = qt.element_metadata()
    w = x32.double()
    m = torch.zeros_like(s) if m is None else m
    widths = torch.tensor(fmt.channel_bits if fmt.channel_bits is not None else [fmt.bits] * D)
    # channel-major ([D, ..., H, T]): each step reads one contiguous row of every token's U
    w, s, m, b = (t.gather(-1, order).movedim(-1, 0).contiguous()
                  for t in (w, s.expand(shape), m.expand(shape), widths.expand(shape)))
    top = torch.where(b > 0, 2 ** b - 1, 0) if fmt.has_zero else torch.full_like(b, fmt.levels)
    codes = torch.zeros((D, *lead), dtype=torch.uint8)
    for j in range(D):
        sj, mj = s[j], m[j]
        quot = _quotient(fmt, sj)
        v = w[j].float()
        if fmt.has_zero:
            r = torch.minimum(round_codes(fmt, quot(v - mj)).clamp(min=0), top[j].float())
            r = torch.where(b[j] > 0, r, torch.zeros_like(r))
            codes[j] = r.to(torch.uint8)
            back = r * sj + mj
        else:
            L = float(fmt.levels)
            r = round_codes(fmt, quot(v)).clamp(-L, L)
            codes[j] = (r + 2 ** (fmt.bits - 1)).to(torch.uint8)
            back = r * sj
        err = (w[j] - back.double()) / Ut[j, j]
        w[j + 1:] -= err[None] * Ut[j, j + 1:]
    u = torch.empty(shape, dtype=torch.uint8).scatter_(-1, order, codes.movedim(0, -1))
    return QTensor(pack_codes(u, fmt).reshape(qt.codes.shape), qt.scale, qt.zero, fmt, qt.shape, qt.page_size)
