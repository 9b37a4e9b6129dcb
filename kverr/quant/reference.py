"""The reference quantizer: the one definition of every stored number in kverr.

Kernels, the quantized cache, evaluation and validation all compare against :func:`quantize`
and :func:`dequantize`; nothing re-implements them.

The oracle runs in stages, each public, so that many candidate formats can share the work that
does not depend on them (:mod:`kverr.calibration.fastrecon` does)::

    blocks = to_blocks(x4, block_shape(fmt, H, T, D, page_size))  # scale-block layout, once per shape
    lo, hi = clip_range(fmt, blocks)            # statistics: per format only via `symmetric`
    scale, zero = fit_params(fmt, blocks, clip=(lo, hi))           # (MSE search included)
    codes = encode_blocks(fmt, blocks.values, scale, zero)
    values = blocks.ungroup(decode_blocks(fmt, codes, scale, zero))

:func:`quantize` and :func:`fake_quantize` are these stages in this order, so a caller that runs
them gets the oracle's numbers bit for bit.

Arithmetic (fp32 throughout, so that a kernel can reproduce every code bit for bit):

* statistics per block: ``amax = max|x|`` (symmetric, fp8) or ``lo = min x, hi = max x``
  (asymmetric), after clipping (:mod:`kverr.quant.formats`);
* symmetric integers: ``s = ceil(div_ru(amax, L))``, ``u = clamp(rint(x / s), -L, L) + 2**(b-1)``,
  ``x_hat = (u - 2**(b-1)) * s`` with ``L = 2**(b-1) - 1``;
* asymmetric integers: ``m = floor(lo)``, ``s = ceil(div_ru(sub_ru(hi, m), L))``,
  ``u = clamp(rint((x - m) / s), 0, L)``, ``x_hat = u * s + m`` with ``L = 2**b - 1``;
* fp8: ``s = ceil(div_ru(amax, fp8_max))``, ``u = bits(fp8(clamp(x / s, -fp8_max, fp8_max)))``,
  ``x_hat = float(u) * s``; fp4 e2m1 the same with ``fp4_max = 6`` (:func:`fp4_codes`: round to
  nearest, ties to even, as the hardware's ``cvt.rn.satfinite.e2m1`` does);
* codebooks (levels ``c``, cell boundaries ``t``, :mod:`kverr.quant.codebooks`): ``s =
  ceil(div_ru(amax, max|c|))`` (``scale_stat="absmax"``) or ``s = ceil(ceil32(sqrt(mean
  x**2)))`` (``"rms"``: the mean of the exact float64 squares, its square root in float64
  rounded up to fp32), ``u = #{i : t_i < x / s}``, ``x_hat = c[u] * s``.

``div_ru``/``sub_ru`` are fp32 operations rounded toward +inf (CUDA ``__fdiv_ru``,
``__fsub_ru``); ``ceil``/``floor`` round the fp32 value *up*/*down* to the scale dtype (fp16,
bf16, fp32, or the one-byte fp8 e4m3 and e8m0 of the microscaling formats). Every rounding on
the way to a scale goes outward, so the stored grid always covers the clipped range: inside
it, ``|x - x_hat| <= s / 2`` for integer codes. ``rint`` is round-half-to-even; divisions are IEEE fp32. A block whose scale is zero
(all-zero, or constant for asymmetric) divides by one instead, stores ``s = 0`` and reconstructs
exactly ``m`` (or zero).

Formats may change six of these steps (:class:`~kverr.quant.formats.QuantFormat`'s arithmetic
options, each defaulting to the above), as serving engines compute them: ``scale_rounding=
"nearest"`` (``s = amax / L`` in fp32, rounded to nearest), ``scale_floor`` (``s = max(s,
floor)`` in fp32 before the cast to the scale dtype), ``reciprocal`` (``x * (1 / s)`` instead of
``x / s``), ``rounding="half_away"`` (``trunc(q ± 0.5)`` instead of ``rint(q)``),
``encode_with="fp32"`` (codes from the fp32 ``s`` and ``m = lo`` before their casts, which only
storage rounds: :func:`encoding_params`) and ``fixed_scale`` (``s`` a constant, no statistic).

The Hadamard rotation is the fast Walsh-Hadamard transform in a fixed butterfly order
(:func:`hadamard_rotate`), not a matrix product, whose summation order would be the BLAS's: the
kernels repeat the same fp32 additions and get the same rotated values, hence the same codes.
The MSE clip search compares per-block squared errors summed in float64 (each fp32 difference
squares exactly), so a different summation order cannot flip the choice short of a tie to
about 1e-16; the ``rms`` scale likewise (a float64 sum of exact squares, one rounding to fp32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kverr.exceptions import ConfigError, DTypeError, NonFiniteError, ShapeError
from kverr.quant.formats import (
    CHANNEL_BITS,
    TORCH_DTYPES,
    AbsMax,
    MSEClip,
    Percentile,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    BYTE_SCALE_DTYPES,
    FP4_E2M1_VALUES,
    QuantFormat,
    minifloat_max,
)
from kverr.quant.codebooks import level_codes, top_level
from kverr.quant.packing import pack, packed_nbytes, unpack

ArrayLike = Any  # numpy array or torch tensor

_INF = float("inf")


# --------------------------------------------------------------------------------------------
# Small numerical helpers
# --------------------------------------------------------------------------------------------


def as_float_tensor(x: ArrayLike, name: str = "x") -> torch.Tensor:
    """``x`` as a float32 torch tensor on the CPU or its device, checked finite."""
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise DTypeError(f"{name} must be a floating-point array, got {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise DTypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    x = x.to(torch.float32)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        first = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise NonFiniteError(
            f"{name} holds {bad} NaN/Inf value(s), the first at index {first}; "
            "quantization needs finite input"
        )
    return x


def ceil_cast(v: torch.Tensor, dtype: str, what: str = "scale") -> torch.Tensor:
    """Round ``v`` (float32 or float64) up to the nearest value representable in ``dtype``."""
    if dtype in BYTE_SCALE_DTYPES:
        return _byte_scale_cast(v, dtype, up=True, what=what)
    target = TORCH_DTYPES[dtype]
    r = v.to(target)
    if target != v.dtype:
        r = torch.where(r.to(v.dtype) < v, torch.nextafter(r, torch.full_like(r, _INF)), r)
    _check_metadata_finite(r, dtype, what)
    return r


def floor_cast(v: torch.Tensor, dtype: str, what: str = "zero point") -> torch.Tensor:
    """Round ``v`` (float32 or float64) down to the nearest value representable in ``dtype``."""
    if dtype in BYTE_SCALE_DTYPES:  # pragma: no cover - QuantFormat never pairs them with a zero point
        raise ConfigError(f"a {what} cannot be stored in scale_dtype={dtype!r}")
    target = TORCH_DTYPES[dtype]
    r = v.to(target)
    if target != v.dtype:
        r = torch.where(r.to(v.dtype) > v, torch.nextafter(r, torch.full_like(r, -_INF)), r)
    _check_metadata_finite(r, dtype, what)
    return r


#: Largest value of each one-byte scale dtype.
_BYTE_SCALE_MAX = {"fp8_e4m3": 448.0, "e8m0": 2.0**127}


def _byte_scale_cast(v: torch.Tensor, dtype: str, *, up: bool, what: str) -> torch.Tensor:
    """Non-negative ``v`` (float32 or float64) as a one-byte scale, rounded up (``up``) or to
    nearest.

    ``fp8_e4m3``: the cast's round-to-nearest-even, then (``up``) one step of the bit pattern
    where that fell below ``v``; to nearest it saturates at 448 as the hardware's ``satfinite``
    conversion does (the block's top is then clamped to the largest code), rounded up it raises
    above 448 (no grid could cover the block). ``e8m0``: a power of two, the least one ``>= v``
    (``up``) or the nearest (ties, ``1.5 * 2**k``, upward), at least ``2**-127`` (the dtype has no
    zero); above ``2**127`` it raises."""
    if dtype == "fp8_e4m3" and not up:
        return v.clamp(max=_BYTE_SCALE_MAX[dtype]).to(torch.float8_e4m3fn)
    if bool((v > _BYTE_SCALE_MAX[dtype]).any()):
        raise ConfigError(
            f"a {what} overflows scale_dtype={dtype!r} (largest {_BYTE_SCALE_MAX[dtype]:g}; the data's "
            "range is too large for it); use scale_dtype='fp32'"
        )
    if dtype == "fp8_e4m3":
        r = v.to(torch.float8_e4m3fn)
        bits = r.view(torch.uint8)
        return torch.where(r.double() < v.double(), bits + 1, bits).view(torch.float8_e4m3fn)
    v64 = v.double()
    m, e = torch.frexp(v64)  # v = m * 2**e, m in [0.5, 1); m = 0 for v = 0
    step = (m > 0.5) if up else (m >= 0.75)
    p = torch.ldexp(torch.ones_like(v64), e - 1 + step.to(e.dtype))
    return torch.where(v64 > 0, p, 0.0).clamp(min=2.0**-127).to(torch.float8_e8m0fnu)


def _check_metadata_finite(r: torch.Tensor, dtype: str, what: str) -> None:
    # Metadata of finite input can only overflow to Inf (never NaN): one reduction suffices.
    if bool(torch.isinf(r).any()):
        raise ConfigError(
            f"a {what} overflows scale_dtype={dtype!r} (the data's range is too large for it); "
            "use scale_dtype='fp32'"
        )


@functools.lru_cache(maxsize=16)
def sylvester(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two) with ±1 entries, float64:
    symmetric, ``H @ H == n I``. Not to be modified (cached)."""
    if n < 1 or n & (n - 1):
        raise ShapeError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    return (sylvester(n) / math.sqrt(n)).to(torch.float32)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of order ``n`` (a power of two), float32.

    It is symmetric and orthogonal: ``H @ H == I``, so rotating ``x @ H`` is undone by ``@ H``
    and ``(q @ H) @ (k @ H).T == q @ k.T``.
    """
    if n < 1 or n & (n - 1):
        raise ShapeError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    return _hadamard_cpu(n).to(device)


def hadamard_scale(n: int) -> float:
    """The fp32 normalisation ``1/sqrt(n)`` that :func:`hadamard_rotate` applies last."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard(D)`` along the last axis, as the fast Walsh-Hadamard transform.

    Butterfly stages ``h = 1, 2, 4, ..., D/2``: within every block of ``2h`` channels, channel
    ``i`` and ``i + h`` become ``a + b`` and ``a - b`` (fp32, round-to-nearest); then one fp32
    multiply by :func:`hadamard_scale`. The order of the additions is part of the definition:
    the Triton kernels perform exactly these operations. Self-inverse up to rounding. The stages
    alternate between two buffers; ``x`` is never written.
    """
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        raise ShapeError(f"a Hadamard rotation needs a power-of-two size, got {D}")
    lead = x.shape[:-1]
    y = x.to(torch.float32).contiguous()
    if D == 1:
        return y * hadamard_scale(D)
    out = torch.empty_like(y)
    h, first = 1, True
    while h < D:
        y4 = y.view(*lead, D // (2 * h), 2, h)
        o4 = out.view(*lead, D // (2 * h), 2, h)
        a, b = y4[..., 0, :], y4[..., 1, :]
        torch.add(a, b, out=o4[..., 0, :])
        torch.sub(a, b, out=o4[..., 1, :])
        # ping-pong between two buffers; the first source may be x itself, never a destination
        y, out, first = out, (torch.empty_like(out) if first else y), False
        h *= 2
    return y.mul_(hadamard_scale(D))


# --------------------------------------------------------------------------------------------
# Block layout
# --------------------------------------------------------------------------------------------


def block_shape(fmt: QuantFormat, H: int, T: int, D: int, page_size: int | None) -> tuple[int, int, int]:
    """Extent ``(heads, tokens, channels)`` of the block of a ``[H, T, D]`` tensor that shares one scale."""
    g = fmt.granularity
    all_t = max(T, 1)
    if isinstance(g, PerTensor):
        return H, all_t, D
    if isinstance(g, PerHead):
        return 1, all_t, D
    if isinstance(g, PerToken):
        return 1, 1, D
    if isinstance(g, PerTokenGroup):
        if D % g.group:
            fmt.check_head_dim(D)
        return 1, 1, g.group
    if isinstance(g, PerChannel):
        return 1, (g.tokens or all_t), 1
    if isinstance(g, PerPage):
        if page_size is None:
            raise ConfigError("granularity 'page' needs a page_size (tokens per page)")
        return 1, page_size, D
    raise ConfigError(f"unknown granularity {g!r}")  # pragma: no cover


def scale_shape(fmt: QuantFormat, H: int, T: int, D: int, page_size: int | None) -> tuple[int, int, int]:
    """Shape ``[nH, nT, nD]`` of the scales (and zero points) of a ``[H, T, D]`` tensor."""
    bh, bt, bd = block_shape(fmt, H, T, D, page_size)
    return H // bh, -(-T // bt), D // bd


def _to_groups(x: torch.Tensor, block: tuple[int, int, int], fill: float = 0.0) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, nH, nT, nD, bh*bt*bd]``; tokens padded with ``fill``."""
    B, H, T, D = x.shape
    bh, bt, bd = block
    nT = -(-T // bt)
    if nT * bt != T:
        pad = torch.full((B, H, nT * bt - T, D), fill, dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=2)
    g = x.reshape(B, H // bh, bh, nT, bt, D // bd, bd).permute(0, 1, 3, 5, 2, 4, 6)
    return g.reshape(B, H // bh, nT, D // bd, bh * bt * bd)


def _from_groups(g: torch.Tensor, block: tuple[int, int, int], shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Inverse of :func:`_to_groups`, dropping token padding."""
    B, H, T, D = shape
    bh, bt, bd = block
    nT = g.shape[2]
    x = g.reshape(B, H // bh, nT, D // bd, bh, bt, bd).permute(0, 1, 4, 2, 5, 3, 6)
    return x.reshape(B, H, nT * bt, D)[:, :, :T, :]


@dataclass(frozen=True, eq=False)
class Blocks:
    """A ``[B, H, T, D]`` float32 tensor laid out in the scale blocks of one block shape.

    Attributes
    ----------
    values : torch.Tensor
        ``[B, nH, nT, nD, bh·bt·bd]``: the elements of every block (``nH = H // bh`` ...), the
        last token block padded with zeros.
    mask : torch.Tensor or None
        ``[1, nH, nT, nD, bh·bt·bd]`` bool, True on real (not padding) elements; None when no
        block is padded (``T`` a multiple of ``bt``).
    block : tuple of int
        ``(bh, bt, bd)``, see :func:`block_shape`.
    shape : tuple of int
        ``(B, H, T, D)`` of the tensor.
    """

    values: torch.Tensor
    mask: torch.Tensor | None
    block: tuple[int, int, int]
    shape: tuple[int, int, int, int]

    def ungroup(self, g: torch.Tensor) -> torch.Tensor:
        """``g [B, nH, nT, nD, bh·bt·bd]`` (e.g. decoded values) back to ``[B, H, T, D]``,
        dropping the padding."""
        return _from_groups(g, self.block, (g.shape[0], *self.shape[1:]))


def to_blocks(x: torch.Tensor, block: tuple[int, int, int]) -> Blocks:
    """Lay out ``x [B, H, T, D]`` in scale blocks of extent ``block = (bh, bt, bd)``.

    The block layout's statistics (:func:`clip_range`) and the formats' parameters are taken on
    it; formats with the same block shape can share one layout.

    Raises
    ------
    kverr.exceptions.ShapeError
        When ``x`` is not 4-d or the block does not tile its head and channel axes.
    """
    if x.ndim != 4:
        raise ShapeError(f"to_blocks needs x [B, H, T, D], got shape {tuple(x.shape)}")
    B, H, T, D = x.shape
    if len(block) != 3 or min(block) < 1 or H % block[0] or D % block[2]:
        raise ShapeError(
            f"block {tuple(block)} does not tile [H={H}, T, D={D}]: it must be (bh, bt, bd) with bh "
            "dividing H and bd dividing D (block_shape gives the one of a format)"
        )
    mask = None  # which grouped entries are real tokens; None when no block is padded
    if T % block[1]:
        mask = _to_groups(torch.ones((1, H, T, D), dtype=torch.bool, device=x.device), block, fill=False)
    return Blocks(_to_groups(x, block), mask, tuple(block), (B, H, T, D))


def _masked_quantile(v: torch.Tensor, mask: torch.Tensor | None, q: float) -> torch.Tensor:
    """Linear-interpolated quantile ``q`` of the valid (``mask``) entries along the last axis."""
    if mask is None:
        mask = torch.ones((1,) * v.ndim, dtype=torch.bool, device=v.device)
    mask = mask.expand_as(v)
    s, _ = torch.sort(v.masked_fill(~mask, _INF), dim=-1)
    n = mask.sum(-1).clamp(min=1).to(torch.float64)
    pos = (n - 1) * q
    lo_i = pos.floor().to(torch.int64)
    hi_i = torch.minimum(lo_i + 1, n.to(torch.int64) - 1)
    frac = (pos - lo_i).to(v.dtype)
    lo_v = torch.gather(s, -1, lo_i.unsqueeze(-1)).squeeze(-1)
    hi_v = torch.gather(s, -1, hi_i.unsqueeze(-1)).squeeze(-1)
    return lo_v + (hi_v - lo_v) * frac


# --------------------------------------------------------------------------------------------
# Scale computation, encoding and decoding on the grouped layout
# --------------------------------------------------------------------------------------------


def _div_up(num: torch.Tensor, den: float) -> torch.Tensor:
    """fp32 ``num / den`` rounded toward +inf (CUDA ``__fdiv_ru``), as float32.

    Emulated exactly through float64: the quotient of an fp32 number by a small integer is
    never within float64 rounding of an fp32 value it does not equal.
    """
    return ceil_cast(num.double() / den, "fp32")


def _sub_up(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a - b`` rounded toward +inf (CUDA ``__fsub_ru``); exact in float64 first."""
    return ceil_cast(a.double() - b.double(), "fp32")


def _floored(fmt: QuantFormat, v: torch.Tensor) -> torch.Tensor:
    """``max(v, fp32(fmt.scale_floor))`` in fp32 (``v`` unchanged without a floor)."""
    if not fmt.scale_floor:
        return v
    return torch.maximum(v, torch.tensor(fmt.scale_floor, dtype=torch.float32, device=v.device))


def near_cast(v: torch.Tensor, dtype: str, what: str = "scale") -> torch.Tensor:
    """``v`` (float32) rounded to the nearest value representable in ``dtype`` (ties to even;
    ``e8m0``: see :func:`_byte_scale_cast`)."""
    if dtype in BYTE_SCALE_DTYPES:
        return _byte_scale_cast(v, dtype, up=False, what=what)
    r = v.to(TORCH_DTYPES[dtype])
    _check_metadata_finite(r, dtype, what)
    return r


def range_params(fmt: QuantFormat, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stored (scale, zero) for clip range ``[lo, hi]`` of each block (``lo = -hi`` if symmetric).

    ``lo``, ``hi`` are float32 ``[...]`` (one per block); scale and zero come back in the format's
    scale dtype, same shape; zero is None unless the format is asymmetric.

    With ``scale_rounding="outward"`` (the default) every rounding on the way to the stored scale
    is upward and the zero point is rounded downward, so ``[m, m + L*s]`` (or ``[-L*s, L*s]``)
    covers ``[lo, hi]`` exactly. With ``"nearest"`` the scale is the fp32 quotient ``hi / L``
    (``(hi - m) / L``), each operation and cast rounded to nearest, so the top of the range may
    sit a rounding above the grid's and be clamped. A ``scale_floor`` raises the fp32 scale to
    it before the cast to the scale dtype.
    """
    if fmt.fixed_scale is not None:
        return torch.full_like(hi, fmt.fixed_scale).to(TORCH_DTYPES[fmt.scale_dtype]), None
    if fmt.encode_with == "fp32":
        return _stored_pair(fmt, *encoding_params(fmt, lo, hi))
    top = _range_top(fmt)
    sym = fmt.is_minifloat or fmt.symmetric
    if fmt.scale_rounding == "nearest":
        if sym:
            return near_cast(_floored(fmt, hi / top), fmt.scale_dtype), None
        m = near_cast(lo, fmt.scale_dtype, "zero point")
        return near_cast(_floored(fmt, (hi - m.float()) / top), fmt.scale_dtype), m
    if sym:
        return ceil_cast(_floored(fmt, _div_up(hi, top)), fmt.scale_dtype), None
    m = floor_cast(lo, fmt.scale_dtype)
    s = ceil_cast(_floored(fmt, _div_up(_sub_up(hi, m.float()), top)), fmt.scale_dtype)
    return s, m


def _range_top(fmt: QuantFormat) -> float:
    """The value the top of a block's range maps to: the largest code step count or level."""
    return (minifloat_max(fmt.dtype) if fmt.is_minifloat else top_level(fmt.codebook_levels) if fmt.is_codebook
            else fmt.levels)


def encoding_params(fmt: QuantFormat, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 (scale, zero) the codes are computed from, for clip range ``[lo, hi]``.

    With ``encode_with="stored"`` these are the stored values (:func:`range_params`) in fp32.
    With ``"fp32"``: ``s = max(hi / L, floor)`` (symmetric) or ``s = max((hi - lo) / L, floor)``
    and ``m = lo`` (asymmetric), fp32 operations rounded to nearest, before any cast; the stored
    ones are their casts to the scale dtype (nearest).
    """
    if fmt.encode_with == "stored":
        s, m = range_params(fmt, lo, hi)
        return s.float(), None if m is None else m.float()
    top = _range_top(fmt)
    if fmt.symmetric:
        return _floored(fmt, hi / top), None
    return _floored(fmt, (hi - lo) / top), lo.float()


def rms_params(fmt: QuantFormat, blocks: Blocks) -> torch.Tensor:
    """The stored scale of a codebook format with ``scale_stat="rms"``: the root mean square of
    each block's real elements, ``[B, nH, nT, nD]`` in the scale dtype.

    The squares are exact in float64 and summed there; the mean's square root (float64) is
    rounded to fp32 and then to the scale dtype, both upward (``scale_rounding="outward"``) or
    both to nearest; a ``scale_floor`` applies in fp32 between the two."""
    g = blocks.values.double()
    sq = g * g if blocks.mask is None else (g * g).masked_fill(~blocks.mask, 0.0)
    n = g.shape[-1] if blocks.mask is None else blocks.mask.sum(-1).clamp(min=1).double()
    r = torch.sqrt(sq.sum(-1) / n)
    if fmt.scale_rounding == "nearest":
        return near_cast(_floored(fmt, r.float()), fmt.scale_dtype)
    return ceil_cast(_floored(fmt, ceil_cast(r, "fp32")), fmt.scale_dtype)


@functools.lru_cache(maxsize=64)
def _codebook_levels(levels: tuple[float, ...], device: str) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.float32, device=device)


def fp4_codes(q: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes (uint8 in ``[0, 16)``, :data:`~kverr.quant.formats.FP4_E2M1_VALUES`) of
    fp32 ``q``: clamped to ``[-6, 6]`` and rounded to the nearest e2m1 value, ties to the even
    mantissa (the quantum is 0.5 below 2, 1 below 4, 2 up to 6; dividing by it is exact);
    the sign bit is ``q``'s (IEEE sign bit), so a small negative value, or -0, gives -0 (code 8)."""
    a = q.abs().clamp_(max=FP4_E2M1_VALUES[7])
    quantum = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    r = torch.round(a / quantum) * quantum
    mag = torch.where(r < 2.0, r * 2.0, torch.where(r < 4.0, r + 2.0, r * 0.5 + 4.0))
    return (mag + torch.where(torch.signbit(q), 8.0, 0.0)).to(torch.uint8)


def _stored_pair(fmt: QuantFormat, s32: torch.Tensor, m32: torch.Tensor | None):
    """The stored (scale, zero) of an ``encode_with="fp32"`` pair: each cast to nearest."""
    return near_cast(s32, fmt.scale_dtype), None if m32 is None else near_cast(m32, fmt.scale_dtype, "zero point")


def _fit_encoding(fmt: QuantFormat, lo: torch.Tensor, hi: torch.Tensor):
    """(stored scale, stored zero, encoding scale, encoding zero) for clip range ``[lo, hi]``,
    each computed once."""
    if fmt.encode_with == "fp32":
        es, em = encoding_params(fmt, lo, hi)
        return (*_stored_pair(fmt, es, em), es, em)
    s, m = range_params(fmt, lo, hi)
    return s, m, s, m


def half_away(q: torch.Tensor) -> torch.Tensor:
    """``trunc(q ± 0.5)``, the ``± 0.5`` an fp32 addition (``+`` for zero): ties away from zero."""
    return torch.where(q >= 0, q + 0.5, q - 0.5).trunc_()


def round_codes(fmt: QuantFormat, q: torch.Tensor) -> torch.Tensor:
    """Integer-valued fp32 ``q`` rounded by the format's :data:`~kverr.quant.formats.ROUNDINGS`:
    ``rint`` (half to even), or :func:`half_away`."""
    if fmt.rounding == "half_away":
        return half_away(q)
    return torch.round(q)


def encode_blocks(fmt: QuantFormat, g: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Codes (uint8, unpacked) of grouped values ``g`` ``[..., n]`` (e.g. :attr:`Blocks.values`)
    with per-group scale ``s`` and zero ``m`` ``[...]`` (:func:`fit_params`).

    The quotient is ``x / s`` in fp32, or with ``reciprocal`` ``x * (1 / s)`` (two fp32
    operations); a zero scale divides by one."""
    if fmt.channel_bits is not None:
        # each width's channels as the format with that width encodes them; width 0: no codes
        u = torch.zeros(g.shape, dtype=torch.uint8, device=g.device)
        for b, idx in fmt.channel_widths():
            if b:
                u[:, :, :, idx] = encode_blocks(fmt.with_bits(b), g[:, :, :, idx], s[:, :, :, idx], m[:, :, :, idx])
        return u
    s32 = s.float().unsqueeze(-1)
    scaled = _quotient(fmt, s32)
    if fmt.is_fp8:
        fmax = minifloat_max(fmt.dtype)
        return scaled(g).clamp(-fmax, fmax).to(TORCH_DTYPES[fmt.dtype]).view(torch.uint8)
    if fmt.is_fp4:
        return fp4_codes(scaled(g))
    if fmt.is_codebook:
        return level_codes(scaled(g), fmt.codebook_levels)
    L = fmt.levels
    if fmt.symmetric:
        u = round_codes(fmt, scaled(g)).clamp(-L, L) + 2 ** (fmt.bits - 1)
    else:
        u = round_codes(fmt, scaled(g - m.float().unsqueeze(-1))).clamp(0, L)
    return u.to(torch.uint8)


def _quotient(fmt: QuantFormat, s32: torch.Tensor):
    """``v -> v / s`` in fp32 for scales ``s32 [..., 1]`` (``v * (1 / s)`` with ``reciprocal``); a
    zero scale divides by one."""
    s_div = torch.where(s32 > 0, s32, torch.ones_like(s32))
    if fmt.reciprocal:
        inv = torch.div(torch.ones_like(s_div), s_div)
        return lambda v: v * inv
    return lambda v: v / s_div


def round_trip_blocks(fmt: QuantFormat, g: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """``decode_blocks(fmt, encode_blocks(fmt, g, s, m), s, m)``, bit for bit. For an integer
    format without ``channel_bits`` the codes are not formed: a code is the clamped rounded
    quotient ``r`` plus ``2**(bits-1)`` (symmetric) or ``r`` itself, an integer below 256, so the
    offset and the uint8 round trip are exact and decoding gives ``r · s (+ m)``; ``r + 0.0``
    turns a rounded ``-0.0`` into the ``+0.0`` a code decodes to. Other formats go through the
    codes."""
    if fmt.dtype != "int" or fmt.channel_bits is not None:
        return decode_blocks(fmt, encode_blocks(fmt, g, s, m), s, m)
    s32 = s.float().unsqueeze(-1)
    scaled = _quotient(fmt, s32)
    L = fmt.levels
    if fmt.symmetric:
        return (round_codes(fmt, scaled(g)).clamp(-L, L) + 0.0) * s32
    m32 = m.float().unsqueeze(-1)
    return (round_codes(fmt, scaled(g - m32)).clamp(0, L) + 0.0) * s32 + m32


def decode_blocks(fmt: QuantFormat, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Float32 values of codes ``u`` ``[..., n]`` with per-group scale ``s`` and zero ``m`` ``[...]``."""
    s32 = s.float().unsqueeze(-1)
    if fmt.is_fp8:
        return u.view(TORCH_DTYPES[fmt.dtype]).float() * s32
    if fmt.is_fp4:
        return _codebook_levels(FP4_E2M1_VALUES, str(u.device))[u.long()] * s32
    if fmt.is_codebook:
        c = _codebook_levels(fmt.codebook_levels, str(u.device))
        return c[u.long()] * s32
    if fmt.symmetric:
        return (u.float() - 2 ** (fmt.bits - 1)) * s32
    return u.float() * s32 + m.float().unsqueeze(-1)


def clip_range(fmt: QuantFormat, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip range ``(lo, hi)``, float32 ``[B, nH, nT, nD]``, of every block before any MSE search
    (``lo = -hi`` if symmetric).

    It depends on the format only through ``fmt.symmetric`` and a percentile clip: formats that
    share those and a block layout share it.
    """
    g, mask = blocks.values, blocks.mask
    sym = fmt.symmetric
    clip = fmt.clip
    if isinstance(clip, Percentile) and clip.percentile < 100.0:
        q = clip.percentile / 100.0
        if sym:
            hi = _masked_quantile(g.abs(), mask, q)
            return -hi, hi
        return _masked_quantile(g, mask, 1.0 - q), _masked_quantile(g, mask, q)
    if mask is None:  # no padded tokens: plain reductions
        if sym:
            hi = g.abs().amax(-1)
            return -hi, hi
        return g.amin(-1), g.amax(-1)
    if sym:
        hi = g.abs().masked_fill(~mask, 0.0).amax(-1)
        return -hi, hi
    return g.masked_fill(~mask, _INF).amin(-1), g.masked_fill(~mask, -_INF).amax(-1)


def _check_scaled(fmt: QuantFormat) -> None:
    if not isinstance(fmt, QuantFormat):
        raise ConfigError(f"fmt must be a QuantFormat, got {type(fmt).__name__}")
    if fmt.is_float:
        raise ConfigError(f"plain {fmt.dtype} storage has no scales to fit; cast the values instead")


def fit_params(fmt: QuantFormat, blocks: Blocks,
               clip: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stored (scale, zero) ``[B, nH, nT, nD]`` of every block, as :func:`quantize` chooses them.

    Parameters
    ----------
    fmt : QuantFormat
        An integer or fp8 format.
    blocks : Blocks
        The tensor in the format's block layout (:func:`to_blocks` with :func:`block_shape`).
    clip : tuple of torch.Tensor, optional
        ``(lo, hi)`` from :func:`clip_range`, when already taken (it is shared by formats with
        the same block layout and ``symmetric``); else taken here.

    Returns
    -------
    tuple
        Scale in the format's scale dtype; zero point likewise, or None for symmetric formats.
    """
    _check_scaled(fmt)
    if fmt.channel_bits is not None:
        return _fit_channel_widths(fmt, blocks)
    if fmt.scale_stat == "rms":
        return rms_params(fmt, blocks), None
    lo, hi = clip_range(fmt, blocks) if clip is None else clip
    if not isinstance(fmt.clip, MSEClip):
        return range_params(fmt, lo, hi)
    s, m, _ = mse_search(fmt, blocks.values, blocks.mask, lo, hi)
    return s, m


def _fit_channel_widths(fmt: QuantFormat, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_params` of a format with ``channel_bits``: each width's channels fitted as the
    format with that width fits them; width 0: scale 0, zero point the block mean (nearest)."""
    dt = TORCH_DTYPES[fmt.scale_dtype]
    s = torch.zeros(blocks.values.shape[:-1], dtype=dt, device=blocks.values.device)
    m = torch.zeros_like(s)
    for b, idx in fmt.channel_widths():
        sub = _channel_blocks(blocks, idx)
        if b == 0:
            m[:, :, :, idx] = _zero_width_point(fmt, sub)
            continue
        s[:, :, :, idx], m[:, :, :, idx] = fit_params(fmt.with_bits(b), sub)
    return s, m


def fake_quantize_blocks(fmt: QuantFormat, blocks: Blocks,
                         clip: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decoded values ``[B, nH, nT, nD, n]`` float32 of every block: :func:`fit_params`, then
    :func:`encode_blocks` and :func:`decode_blocks`, bit for bit (for an MSE clip the search
    decodes the chosen ratios' codes, :func:`mse_search`).
    ``blocks.ungroup`` turns them into ``[B, H, T, D]``."""
    _check_scaled(fmt)
    if fmt.channel_bits is not None:
        out = torch.empty_like(blocks.values)
        for b, idx in fmt.channel_widths():
            sub = _channel_blocks(blocks, idx)
            if b == 0:
                m = _zero_width_point(fmt, sub).float()
                out[:, :, :, idx] = m.unsqueeze(-1).expand(sub.values.shape)
            else:
                c = None if clip is None else (clip[0][:, :, :, idx], clip[1][:, :, :, idx])
                out[:, :, :, idx] = fake_quantize_blocks(fmt.with_bits(b), sub, clip=c)
        return out
    if fmt.scale_stat == "rms":
        s, _ = fit_params(fmt, blocks)
        return decode_blocks(fmt, encode_blocks(fmt, blocks.values, s, None), s, None)
    lo, hi = clip_range(fmt, blocks) if clip is None else clip
    if isinstance(fmt.clip, MSEClip):
        return mse_search(fmt, blocks.values, blocks.mask, lo, hi, values=True)[2]
    s, m, es, em = _fit_encoding(fmt, lo, hi)
    return decode_blocks(fmt, encode_blocks(fmt, blocks.values, es, em), s, m)


def mse_search(fmt: QuantFormat, g: torch.Tensor, mask: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
               *, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The MSE clip search on grouped ``g``: per block, the first ratio (or ``(low, high)`` ratio
    pair, :meth:`MSEClip.pairs`) of least squared error.

    Returns the stored scale and zero of the chosen ratio, and (``values=True``) the decoded
    values they give (each block encoded and decoded once more with its chosen pair, rather than
    every ratio's values carried through the search: for the calibrator).
    """
    best_s = best_m = best_err = None
    mid, half = (hi + lo) / 2, (hi - lo) / 2
    for rl, rh in fmt.clip.pairs():
        if fmt.symmetric or fmt.is_minifloat:
            s, m = range_params(fmt, -hi * rh, hi * rh)
        else:
            s, m = range_params(fmt, mid - half * rl, mid + half * rh)
        # float64 squares of fp32 differences are exact; the sums are order-insensitive to ~1e-16
        sq = (round_trip_blocks(fmt, g, s, m) - g).double()
        sq.mul_(sq)
        if mask is not None:
            sq.masked_fill_(~mask, 0.0)
        err = sq.sum(-1)
        if best_err is None:
            best_s, best_m, best_err = s, m, err
            continue
        better = err < best_err  # strict: ties keep the larger ratio
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        if m is not None:
            best_m = torch.where(better, m, best_m)
    # the chosen ratio's values: each block encoded with its chosen scale and zero, as in the loop
    best_v = round_trip_blocks(fmt, g, best_s, best_m) if values else None
    return best_s, best_m, best_v


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized ``[..., H, T, D]`` tensor as the reference store holds it.

    Attributes
    ----------
    codes
        Integer formats: ``[..., H, T, packed_nbytes(D, bits)]`` uint8 in the packed layout of
        :mod:`kverr.quant.packing`. fp8: ``[..., H, T, D]`` uint8 bit patterns. Plain floats:
        ``[..., H, T, D]`` in that dtype.
    scale, zero
        ``[..., nH, nT, nD]`` in the format's scale dtype (see :func:`scale_shape`); ``zero`` is
        ``None`` unless the format is asymmetric; both ``None`` for plain floats.
    fmt, shape, page_size
        The format, the original shape and the page size used by ``page`` granularity.
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    fmt: QuantFormat
    shape: tuple[int, ...]
    page_size: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zero points (no page rounding or alignment)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def unpacked_codes(self) -> torch.Tensor:
        """Codes as ``[..., H, T, D]`` uint8 (integer and fp8 formats)."""
        if self.fmt.is_float:
            raise ConfigError(f"plain {self.fmt.dtype} storage has no codes")
        if self.fmt.is_fp8:
            return self.codes
        return unpack_codes(self.codes, self.fmt, self.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.float32, *, unrotate: bool = True) -> torch.Tensor:
        """Reconstruct ``[..., H, T, D]``, see :func:`dequantize`."""
        return dequantize(self, dtype=dtype, unrotate=unrotate)

    def element_metadata(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero point of every element, float32 ``[..., H, T, D]`` (zero ``None`` if
        symmetric); in the rotated space if the format rotates."""
        if self.scale is None:
            raise ConfigError(f"plain {self.fmt.dtype} storage has no scales")
        *lead, H, T, D = self.shape
        block = block_shape(self.fmt, H, T, D, self.page_size)
        out = []
        for meta in (self.scale, self.zero):
            if meta is None:
                out.append(None)
                continue
            m = meta.float().reshape(math.prod(lead), *meta.shape[len(lead):])
            m = m.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2).repeat_interleave(block[2], 3)
            out.append(m[:, :, :T, :].reshape(self.shape))
        return out[0], out[1]


def quantize(
    x: ArrayLike,
    fmt: QuantFormat,
    *,
    page_size: int | None = None,
    scale: ArrayLike | None = None,
    zero: ArrayLike | None = None,
) -> QTensor:
    """Quantize ``x`` with ``fmt``.

    Parameters
    ----------
    x
        ``[..., H, T, D]`` (kv_head, token, channel) floating point, numpy or torch; computed in
        float32. Leading dims are independent tensors (e.g. batch).
    fmt
        The format.
    page_size
        Tokens per page, needed by ``page`` granularity.
    scale, zero
        Optional static metadata (``[..., nH, nT, nD]``, broadcastable), e.g. calibrated fp8
        scales; when given, no statistics are taken from ``x``. ``zero`` only for asymmetric.

    Returns
    -------
    QTensor
    """
    plan = _encode_grouped(x, fmt, page_size, scale, zero)
    if plan.float_values is not None:
        return QTensor(plan.float_values, None, None, fmt, plan.shape, page_size)
    *lead, H, T, D = plan.shape
    u = _from_groups(plan.codes, plan.block, (plan.codes.shape[0], H, T, D))
    codes = u if fmt.is_fp8 else pack_codes(u, fmt)
    s, m = plan.scale, plan.zero
    return QTensor(
        codes=codes.reshape(*lead, H, T, codes.shape[-1]),
        scale=s.reshape(*lead, *s.shape[1:]),
        zero=None if m is None else m.reshape(*lead, *m.shape[1:]),
        fmt=fmt,
        shape=plan.shape,
        page_size=page_size,
    )


@dataclass(frozen=True, eq=False)
class _Grouped:
    """Codes and metadata on the grouped layout ``[B, nH, nT, nD, block elements]``."""

    shape: tuple[int, ...]
    block: tuple[int, int, int]
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    float_values: torch.Tensor | None = None  # plain-float formats: the stored values


def _encode_grouped(x, fmt, page_size, scale, zero) -> _Grouped:
    if not isinstance(fmt, QuantFormat):
        raise ConfigError(f"fmt must be a QuantFormat, got {type(fmt).__name__}")
    x32 = as_float_tensor(x)
    if x32.ndim < 3:
        raise ShapeError(f"x must be [..., kv_head, token, channel], got shape {tuple(x32.shape)}")
    shape = tuple(x32.shape)
    *lead, H, T, D = shape
    fmt.check_head_dim(D)
    if fmt.is_float:
        return _Grouped(shape, (1, 1, 1), float_values=x32.to(TORCH_DTYPES[fmt.dtype]))
    if fmt.rotate == "hadamard":
        x32 = hadamard_rotate(x32)
    x4 = x32.reshape(math.prod(lead), H, T, D)  # explicit: -1 is ambiguous when T == 0
    blocks = to_blocks(x4, block_shape(fmt, H, T, D, page_size))
    if scale is not None:
        s, m = _static_params(fmt, scale, zero, blocks.values.shape[:-1], lead)
    else:
        if zero is not None:
            raise ConfigError("zero was given without scale; pass both or neither")
        if fmt.encode_with == "fp32":  # AbsMax, one width: the fit is the range's
            s, m, es, em = _fit_encoding(fmt, *clip_range(fmt, blocks))
            return _Grouped(shape, blocks.block, encode_blocks(fmt, blocks.values, es, em), s, m)
        s, m = fit_params(fmt, blocks)
    return _Grouped(shape, blocks.block, encode_blocks(fmt, blocks.values, s, m), s, m)


def _channel_blocks(blocks: Blocks, idx: list[int]) -> Blocks:
    """The blocks of the channels ``idx`` of a per-channel layout (``bd = 1``: channel = block column)."""
    i = torch.as_tensor(idx, device=blocks.values.device)
    mask = None if blocks.mask is None else blocks.mask[:, :, :, i]
    return Blocks(blocks.values[:, :, :, i], mask, blocks.block, (*blocks.shape[:3], len(idx)))


def _zero_width_point(fmt: QuantFormat, blocks: Blocks) -> torch.Tensor:
    """The zero point a width-0 channel stores and reads back: the mean of each block's real
    elements rounded to nearest in the scale dtype, ``[B, nH, nT, nD]``."""
    if blocks.mask is None:
        mean = blocks.values.mean(-1)
    else:
        mean = blocks.values.masked_fill(~blocks.mask, 0.0).sum(-1) / blocks.mask.sum(-1).clamp(min=1)
    return near_cast(mean, fmt.scale_dtype, "zero point")


def _static_params(fmt, scale, zero, group_shape, lead):
    want = tuple(group_shape)  # [B, nH, nT, nD]

    def prep(v, name):
        t = torch.as_tensor(v).to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"static {name} holds NaN/Inf")
        try:
            t = torch.broadcast_to(t, (*lead, *want[1:])).reshape(want)
        except RuntimeError:
            raise ShapeError(
                f"static {name} of shape {tuple(t.shape)} does not broadcast to the "
                f"{fmt.granularity.kind} metadata shape {(*lead, *want[1:])}"
            ) from None
        return near_cast(t, fmt.scale_dtype, f"static {name}")

    s = prep(scale, "scale")
    if bool((s.float() < 0).any()):
        raise ConfigError("static scale must be non-negative")
    if fmt.has_zero:
        if zero is None:
            raise ConfigError(f"{fmt.label()} is asymmetric: a static scale needs a zero too")
        return s, prep(zero, "zero")
    if zero is not None:
        raise ConfigError(f"{fmt.label()} is symmetric and takes no zero point")
    return s, None


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32, *, unrotate: bool = True) -> torch.Tensor:
    """Reconstruct the ``[..., H, T, D]`` tensor of ``qt``.

    With ``unrotate=False`` a Hadamard-rotated format stays in the rotated space (as a kernel
    that rotates the query instead would read it).
    """
    fmt = qt.fmt
    if fmt.is_float:
        return qt.codes.to(dtype)
    *lead, H, T, D = qt.shape
    u = qt.unpacked_codes().reshape(math.prod(lead), H, T, D)
    block = block_shape(fmt, H, T, D, qt.page_size)
    B = u.shape[0]
    s = qt.scale.reshape(B, *qt.scale.shape[len(lead):])
    m = None if qt.zero is None else qt.zero.reshape(B, *qt.zero.shape[len(lead):])
    x = _from_groups(decode_blocks(fmt, _to_groups(u, block), s, m), block, (B, H, T, D))
    if fmt.rotate == "hadamard" and unrotate:
        x = hadamard_rotate(x)
    return x.reshape(qt.shape).to(dtype)


def fake_quantize(
    x: ArrayLike,
    fmt: QuantFormat,
    *,
    page_size: int | None = None,
    scale: ArrayLike | None = None,
    zero: ArrayLike | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x, fmt))`` as float32 ``[..., H, T, D]``, bit for bit.

    Decodes the codes where they are computed, skipping the packing round trip (which is
    lossless), so analysis and calibration pay only for the arithmetic.
    """
    plan = _encode_grouped(x, fmt, page_size, scale, zero)
    if plan.float_values is not None:
        return plan.float_values.to(torch.float32)
    *lead, H, T, D = plan.shape
    values = decode_blocks(fmt, plan.codes, plan.scale, plan.zero)
    out = _from_groups(values, plan.block, (values.shape[0], H, T, D))
    if fmt.rotate == "hadamard":
        out = hadamard_rotate(out)
    return out.reshape(plan.shape)


def channel_reconstructions(x: ArrayLike, fmt: QuantFormat, widths: tuple[int, ...] = CHANNEL_BITS, *,
                            page_size: int | None = None) -> torch.Tensor:
    """What every channel of ``x [..., H, T, D]`` reads back at each of ``widths`` under the
    per-channel blocks of ``fmt`` (an asymmetric integer format with ``channel`` granularity):
    float32 ``[len(widths), ..., H, T, D]``, in the rotated space if ``fmt`` rotates.

    Channels are quantized independently, so entry ``[w, ..., i]`` is, bit for bit, what channel
    ``i`` of :func:`fake_quantize` ``(x, fmt with channel_bits)`` reads back (before any
    unrotation) when ``channel_bits[i] == widths[w]``: the building block of fitting widths.
    """
    probe = dataclasses.replace(fmt, channel_bits=None)
    if probe.dtype != "int" or probe.symmetric or not isinstance(probe.granularity, PerChannel):
        raise ConfigError(f"{fmt.label()}: per-channel widths need an asymmetric integer format with channel scales")
    bad = [b for b in widths if b not in CHANNEL_BITS]
    if bad:
        raise ConfigError(f"width {bad[0]} is not one of {', '.join(map(str, CHANNEL_BITS))}")
    x32 = as_float_tensor(x)
    if x32.ndim < 3:
        raise ShapeError(f"x must be [..., kv_head, token, channel], got shape {tuple(x32.shape)}")
    *lead, H, T, D = x32.shape
    probe.check_head_dim(D)
    if probe.rotate == "hadamard":
        x32 = hadamard_rotate(x32)
    blocks = to_blocks(x32.reshape(math.prod(lead), H, T, D), block_shape(probe, H, T, D, page_size))
    clip = clip_range(probe, blocks)
    out = []
    for b in widths:
        if b == 0:
            m = _zero_width_point(fmt, blocks).float()
            vals = m.unsqueeze(-1).expand(blocks.values.shape)
        else:
            vals = fake_quantize_blocks(probe.with_bits(b), blocks, clip=clip)
        out.append(blocks.ungroup(vals).reshape(x32.shape))
    return torch.stack(out)


def codes_nbytes(fmt: QuantFormat, D: int) -> int:
    """Bytes of one token's codes for one head (plain floats: the values themselves)."""
    if fmt.is_float:
        return D * torch.finfo(TORCH_DTYPES[fmt.dtype]).bits // 8
    if fmt.is_fp8:
        return D
    if fmt.channel_bits is not None:
        return sum(packed_nbytes(len(idx), b) for b, idx in fmt.channel_widths() if b)
    return packed_nbytes(D, fmt.bits)


def table_nbytes(fmt: QuantFormat) -> int:
    """Bytes of the table a format keeps once per head group: a codebook's levels, fp32 (else 0)."""
    return 4 * 2**fmt.bits if fmt.is_codebook else 0


def pack_codes(u: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Integer codes ``u [..., D]`` (uint8) packed as ``fmt`` stores a row: :func:`pack` at
    ``fmt.bits``, or with ``channel_bits`` each width's channels (ascending widths, channels in
    order) packed at that width, the widths' bytes one after another (width 0: none)."""
    if fmt.channel_bits is None:
        return pack(u, fmt.bits)
    return torch.cat([pack(u[..., idx].contiguous(), b) for b, idx in fmt.channel_widths() if b], dim=-1)


def unpack_codes(codes: torch.Tensor, fmt: QuantFormat, D: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., D]`` uint8 codes (0 on width-0 channels)."""
    if fmt.channel_bits is None:
        return unpack(codes, fmt.bits, D)
    u = torch.zeros((*codes.shape[:-1], D), dtype=torch.uint8, device=codes.device)
    at = 0
    for b, idx in fmt.channel_widths():
        if b:
            n = packed_nbytes(len(idx), b)
            u[..., idx] = unpack(codes[..., at:at + n], b, len(idx))
            at += n
    return u
