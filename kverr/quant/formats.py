"""Format specifications: small frozen dataclasses that serialize to strict JSON.

A :class:`QuantFormat` says how one tensor (keys or values of one layer, or of one kv head) is
stored: the element format (integers at 2/3/4/8 bits, symmetric or with a zero point; fp8
e4m3/e5m2 or fp4 e2m1 with a scale; codebooks; or plain fp16/bf16/fp32), which elements share a scale
(:data:`Granularity`), the dtype of scales and zero points, the clipping rule and an optional
Hadamard rotation of the head dimension.

Granularities name the block of a ``[kv_head, token, channel]`` tensor that shares one scale:

==================  ==========================================  =================================
kind                block                                       scale shape for ``[H, T, D]``
==================  ==========================================  =================================
``tensor``          all heads, all tokens, all channels         ``[1, 1, 1]``  (static)
``head``            one head, all tokens, all channels          ``[H, 1, 1]``  (static)
``token``           one head, one token, all channels           ``[H, T, 1]``
``token_group``     one head, one token, ``group`` channels     ``[H, T, D/group]``
``channel``         one head, ``tokens`` tokens, one channel    ``[H, ceil(T/tokens), D]``
                    (``tokens=None``: all tokens; static)       (``[H, 1, D]``)
``page``            one head, one page of tokens, all channels  ``[H, ceil(T/page), 1]``
==================  ==========================================  =================================

*Static* granularities span every token, so a streaming cache cannot compute them from the
data it stores: they are calibrated once (vLLM's fp8 ``k_scale``/``v_scale`` are of this kind)
and counted once per model, not per sequence, by :mod:`kverr.memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import torch

from kverr.exceptions import ConfigError
from kverr.quant import codebooks
from kverr.quant.codebooks import CODEBOOK_BITS, CODEBOOK_NAMES

# --------------------------------------------------------------------------------------------
# Element formats
# --------------------------------------------------------------------------------------------

#: Element formats kverr knows, with their stored bits per element.
ELEMENT_BITS: dict[str, tuple[int, ...]] = {
    "int": (2, 3, 4, 8),
    "fp8_e4m3": (8,),
    "fp8_e5m2": (8,),
    "fp4_e2m1": (4,),
    "codebook": CODEBOOK_BITS,
    "fp16": (16,),
    "bf16": (16,),
    "fp32": (32,),
}
#: Element formats stored as plain floating point (no scale, no codes).
FLOAT_DTYPES = ("fp16", "bf16", "fp32")
#: Scale / zero-point dtypes: the floats, and the one-byte scales of the microscaling formats:
#: ``fp8_e4m3`` (NVFP4's block scales; largest 448, subnormals down to 2**-9, no infinity) and
#: ``e8m0`` (the OCP MX shared exponent: a power of two from 2**-127 to 2**127, no zero, so a
#: zero scale is stored as 2**-127). The one-byte dtypes are too coarse for integer codes of
#: more than two levels (see the quarter-step rule in :class:`QuantFormat`).
SCALE_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "e8m0")
#: Scale dtypes of one byte (no zero point is ever stored in them).
BYTE_SCALE_DTYPES = ("fp8_e4m3", "e8m0")
#: Dtypes of the tokens a cache keeps outside its pages (sinks, window, a pending token block):
#: the plain floats, or ``int8`` -- one symmetric absmax int8 row per (token, kv head) with an
#: fp16 scale (:func:`window_format`): D + 2 bytes a row instead of 2 D, each element within half
#: a step (at most 1/254 of its row's largest magnitude) of what the cache received.
WINDOW_DTYPES = (*FLOAT_DTYPES, "int8")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "e8m0": torch.float8_e8m0fnu,
}

#: The 16 values of an fp4 e2m1 code (OCP MX / NVFP4 element): bit 3 the sign, bits 2..1 the
#: exponent (bias 1), bit 0 the mantissa; code 8 is -0.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

#: Widths a channel may have in a format with per-channel bit widths (``channel_bits``): the
#: integer widths, and 0 (no codes: the channel reads back its block mean).
CHANNEL_BITS = (0, 2, 3, 4, 8)

#: What a codebook format's scale is taken from: ``absmax`` (the block's largest magnitude lands
#: on the codebook's largest level; clips apply) or ``rms`` (the scale is the block's root mean
#: square, so a level is a multiple of the block's standard deviation about zero).
SCALE_STATS = ("absmax", "rms")

#: Significand bits (implicit bit included) of each scale dtype.
SIGNIFICAND_BITS = {"fp32": 24, "fp16": 11, "bf16": 8, "fp8_e4m3": 4, "e8m0": 1}


def _fail(field_name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{field_name}={value!r} is not allowed; {allowed}")


def _check_keys(obj: Any, where: str, required: set[str], optional: set[str]) -> None:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - required - optional
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        raise ConfigError(f"unknown field {where}.{sorted(unknown)[0]}; allowed fields: {allowed}")
    missing = required - set(obj)
    if missing:
        raise ConfigError(f"missing field {where}.{sorted(missing)[0]}")


def _int_field(obj: dict, key: str, where: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}.{key}={value!r} must be an integer")
    return value


# --------------------------------------------------------------------------------------------
# Granularities
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PerTensor:
    """One scale for all heads, tokens and channels of a layer (static)."""

    kind: ClassVar[str] = "tensor"


@dataclass(frozen=True)
class PerHead:
    """One scale per kv head (static)."""

    kind: ClassVar[str] = "head"


@dataclass(frozen=True)
class PerToken:
    """One scale per token and head, over all channels."""

    kind: ClassVar[str] = "token"


@dataclass(frozen=True)
class PerTokenGroup:
    """One scale per token and head for each group of ``group`` consecutive channels."""

    group: int
    kind: ClassVar[str] = "token_group"

    def __post_init__(self) -> None:
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise _fail("granularity.group", self.group, "a positive number of channels")


@dataclass(frozen=True)
class PerChannel:
    """One scale per channel and head over ``tokens`` consecutive tokens (KIVI-style keys).

    ``tokens=None`` spans every token (static, calibrated once).
    """

    tokens: int | None = None
    kind: ClassVar[str] = "channel"

    def __post_init__(self) -> None:
        t = self.tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise _fail("granularity.tokens", t, "a positive number of tokens, or null for all")


@dataclass(frozen=True)
class PerPage:
    """One scale per head and page of the paged cache (the config's ``page_size`` tokens)."""

    kind: ClassVar[str] = "page"


Granularity = Union[PerTensor, PerHead, PerToken, PerTokenGroup, PerChannel, PerPage]
GRANULARITIES: dict[str, type] = {
    g.kind: g for g in (PerTensor, PerHead, PerToken, PerTokenGroup, PerChannel, PerPage)
}


def is_static(g: Granularity) -> bool:
    """Whether the granularity spans every token (scales calibrated once, not per sequence)."""
    return isinstance(g, (PerTensor, PerHead)) or (isinstance(g, PerChannel) and g.tokens is None)


def token_block(g: Granularity, page_size: int) -> int:
    """Tokens that must arrive together before they can be quantized (1 for per-token scales)."""
    if isinstance(g, PerChannel) and g.tokens is not None:
        return g.tokens
    if isinstance(g, PerPage):
        return page_size
    return 1


def granularity_to_dict(g: Granularity) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": g.kind}
    out.update(dataclasses.asdict(g))
    return out


def granularity_from_dict(obj: Any, where: str = "granularity") -> Granularity:
    if isinstance(obj, dict) and "kind" in obj:
        kind = obj["kind"]
        if kind not in GRANULARITIES:
            raise _fail(f"{where}.kind", kind, f"one of {', '.join(GRANULARITIES)}")
        cls = GRANULARITIES[kind]
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {"tokens"} if cls is PerChannel else set()
        _check_keys(obj, where, {"kind"} | (names - optional), optional)
        kwargs = {k: v for k, v in obj.items() if k != "kind"}
        return cls(**kwargs)
    _check_keys(obj, where, {"kind"}, set())
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# Clipping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AbsMax:
    """The scale covers the full range of each block (no clipping)."""

    kind: ClassVar[str] = "absmax"


@dataclass(frozen=True)
class Percentile:
    """Clip each block to its ``percentile``-th percentile (of |x| if symmetric; of x and of
    ``100 - percentile`` for the low end if asymmetric), linear interpolation."""

    percentile: float = 99.9
    kind: ClassVar[str] = "percentile"

    def __post_init__(self) -> None:
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 50.0 < p <= 100.0:
            raise _fail("clip.percentile", p, "a number in (50, 100]")


@dataclass(frozen=True)
class MSEClip:
    """Per block, pick the clip ratio in ``linspace(1, min_ratio, grid)`` that minimises the
    block's squared reconstruction error (ties go to the larger ratio). The range shrinks about
    its midpoint.

    ``candidates``: the ratios to try instead of the grid, in the order given (a tie keeps the
    earlier one), each in (0, 4]; a ratio above 1 widens the range, so that the block's largest
    magnitude lands below the top code: ``(1.0, 1.5)`` on fp4 codes is NVFP4's "four over six",
    each block's scale ``amax / 6`` or ``amax / 4``. ``grid`` and ``min_ratio`` are then unused
    (and must keep their defaults).

    ``asymmetric`` (formats with a zero point only): the low and the high end shrink by their
    own ratios, ``grid²`` pairs ``(r_low, r_high)`` tried in :meth:`pairs` order, the first of
    least error kept. The kernels run it with static scales only (calibrated by the reference).
    """

    grid: int = 20
    min_ratio: float = 0.5
    asymmetric: bool = False
    candidates: tuple[float, ...] | None = None
    kind: ClassVar[str] = "mse"

    def __post_init__(self) -> None:
        if isinstance(self.grid, bool) or not isinstance(self.grid, int) or not 2 <= self.grid <= 256:
            raise _fail("clip.grid", self.grid, "an integer in [2, 256]")
        r = self.min_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < 1.0:
            raise _fail("clip.min_ratio", r, "a number in (0, 1)")
        if not isinstance(self.asymmetric, bool):
            raise _fail("clip.asymmetric", self.asymmetric, "true or false")
        if self.candidates is not None:
            c = self.candidates
            ok = (not isinstance(c, (str, bytes)) and hasattr(c, "__iter__")
                  and all(not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 < v <= 4.0 for v in c))
            if not ok or len(tuple(c)) < 2 or len(set(c)) != len(tuple(c)):
                raise _fail("clip.candidates", c, "a list of at least two distinct ratios, each in (0, 4]")
            if (self.grid, self.min_ratio) != (20, 0.5):
                raise _fail("clip.grid", self.grid, "left at its default with candidates (they replace the grid)")
            object.__setattr__(self, "candidates", tuple(float(v) for v in c))

    def ratios(self) -> list[float]:
        """Candidate clip ratios in search order: the grid, largest first, or the given candidates."""
        if self.candidates is not None:
            return list(self.candidates)
        step = (1.0 - self.min_ratio) / (self.grid - 1)
        return [1.0 - i * step for i in range(self.grid)]

    def pairs(self) -> list[tuple[float, float]]:
        """``(r_low, r_high)`` in search order: ``(r, r)`` for each ratio, or, asymmetric, every
        pair, the low ratio varying slowest."""
        rs = self.ratios()
        return [(a, b) for a in rs for b in rs] if self.asymmetric else [(r, r) for r in rs]


Clip = Union[AbsMax, Percentile, MSEClip]
CLIPS: dict[str, type] = {c.kind: c for c in (AbsMax, Percentile, MSEClip)}


def clip_to_dict(c: Clip) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": c.kind}
    out.update(dataclasses.asdict(c))
    if isinstance(c, MSEClip) and not c.asymmetric:
        del out["asymmetric"]  # the symmetric search, as written before the field existed
    if isinstance(c, MSEClip):
        if c.candidates is None:
            del out["candidates"]
        else:
            out["candidates"] = list(c.candidates)
            del out["grid"], out["min_ratio"]
    return out


def clip_from_dict(obj: Any, where: str = "clip") -> Clip:
    if not isinstance(obj, dict) or "kind" not in obj:
        _check_keys(obj, where, {"kind"}, set())
    kind = obj["kind"]
    if kind not in CLIPS:
        raise _fail(f"{where}.kind", kind, f"one of {', '.join(CLIPS)}")
    cls = CLIPS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    _check_keys(obj, where, {"kind"}, names)
    return cls(**{k: v for k, v in obj.items() if k != "kind"})


# --------------------------------------------------------------------------------------------
# The format
# --------------------------------------------------------------------------------------------

ROTATIONS = ("none", "hadamard")
#: How integer codes round: ``half_even`` is ``rint`` of the fp32 quotient; ``half_away`` adds
#: ``±0.5`` in fp32 (the sign of the quotient; ``+`` for zero) and truncates toward zero, as an
#: int8 store that truncates does after the ``+0.5`` (so a quotient of ``0.5 - 2**-25`` gives 1).
ROUNDINGS = ("half_even", "half_away")
#: How a scale is derived from its clipped range: ``outward`` rounds every step up (the zero point
#: down) so that the grid covers the range; ``nearest`` is the plain fp32 quotient
#: ``amax / L`` (``(hi - m) / L``), each operation and the cast to the scale dtype to nearest.
SCALE_ROUNDINGS = ("outward", "nearest")
#: Which scale and zero point the codes are computed from: ``stored`` (the values in the scale
#: dtype, which the decoder reads back) or ``fp32`` (the fp32 values before their cast to the
#: scale dtype, which only storage rounds: a code then sits on the stored grid up to that
#: rounding, as vLLM's TurboQuant values are written).
ENCODE_WITH = ("stored", "fp32")


@dataclass(frozen=True)
class QuantFormat:
    """How one K or V tensor is stored.

    Parameters
    ----------
    dtype
        Element format: ``"int"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"fp4_e2m1"`` (the 4-bit
        float of NVFP4 and MXFP4, :data:`FP4_E2M1_VALUES`), ``"codebook"`` (the index of
        one of ``2**bits`` scalar levels, :mod:`kverr.quant.codebooks`), or a plain float
        (``"fp16"``, ``"bf16"``, ``"fp32"``) which stores values as they are.
    bits
        Bits per stored element. For ``"int"`` one of 2, 3, 4, 8; for ``"codebook"`` 2, 3 or 4;
        implied by other dtypes.
    symmetric
        Integers only: symmetric codes in ``[-(2**(b-1)-1), 2**(b-1)-1]`` with no zero point,
        or asymmetric codes in ``[0, 2**b - 1]`` with a per-block offset (the block minimum,
        stored in ``scale_dtype``), as KIVI and quanto do. fp8, fp4 and codebooks are always
        symmetric (a scale, no zero point).
    granularity
        Which elements share a scale, see the module docs.
    scale_dtype
        dtype of stored scales and zero points: :data:`SCALE_DTYPES` (``"fp16"`` by default;
        ``"fp8_e4m3"`` and ``"e8m0"`` are the one-byte scales of NVFP4 and MXFP4).
    clip
        Clipping rule: :class:`AbsMax`, :class:`Percentile` or :class:`MSEClip`.
    rotate
        ``"hadamard"`` multiplies the head dimension by a normalised Hadamard matrix before
        quantizing (dequantization rotates back); spreads outlier channels. ``"none"``.
    rounding
        Integers only: ``"half_even"`` (default) or ``"half_away"``, see :data:`ROUNDINGS`.
    scale_rounding
        ``"outward"`` (default) or ``"nearest"``, see :data:`SCALE_ROUNDINGS`.
    scale_floor
        Scales below it (fp32) are raised to it before the cast to the scale dtype, so no block
        has a zero scale (``0``, the default: no floor; a zero scale then stores ``s = 0``).
    reciprocal
        Encode by multiplying by the fp32 reciprocal ``1 / s`` instead of dividing by ``s``.
    channel_bits
        Asymmetric integers with per-channel scales only: the width of every channel of the
        (rotated) head dimension, each in :data:`CHANNEL_BITS`; ``bits`` is their largest. A
        channel of width ``b >= 2`` is stored exactly as the same format with ``bits=b`` would
        store it (its scale blocks hold that channel only); a channel of width 0 stores no codes,
        a zero scale and, as its zero point, the mean of its block rounded to nearest in
        ``scale_dtype``, which it reads back. None (default): every channel has ``bits``.
    codebook
        Codebooks only: a name in :data:`~kverr.quant.codebooks.CODEBOOK_NAMES` (default
        ``"normal"``) or the ``2**bits`` levels, ascending (stored as fp32).
    scale_stat
        Codebooks only: :data:`SCALE_STATS` (default ``"absmax"``); ``"rms"`` takes no clip.
    encode_with
        :data:`ENCODE_WITH` (default ``"stored"``). ``"fp32"`` only for integers with
        ``scale_rounding="nearest"``, the absmax clip and one width for every channel.
    fixed_scale
        A scale that is not a statistic of the data: every value is divided by this constant (as
        vLLM's fp8 cache does without checkpoint scales, 1.0). Only for symmetric formats with one
        static scale per tensor (granularity ``tensor``), the absmax clip, and a value exact in
        ``scale_dtype``; nothing is stored for it. None (default): the scale is computed.

    ``rounding``, ``scale_rounding``, ``scale_floor``, ``reciprocal``, ``encode_with``,
    ``fixed_scale`` and ``channel_bits`` default to kverr's own arithmetic and are written to
    JSON only when they differ from it, so configs written before they existed read (and hash)
    the same; ``codebook`` and ``scale_stat`` are written for codebook formats only.
    """

    dtype: str = "int"
    bits: int = 4
    symmetric: bool = False
    granularity: Granularity = field(default_factory=PerToken)
    scale_dtype: str = "fp16"
    clip: Clip = field(default_factory=AbsMax)
    rotate: str = "none"
    rounding: str = "half_even"
    scale_rounding: str = "outward"
    scale_floor: float = 0.0
    reciprocal: bool = False
    channel_bits: tuple[int, ...] | None = None
    codebook: str | tuple[float, ...] | None = None
    scale_stat: str = "absmax"
    encode_with: str = "stored"
    fixed_scale: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_BITS:
            raise _fail("dtype", self.dtype, f"one of {', '.join(ELEMENT_BITS)}")
        if self.channel_bits is not None:
            self._check_channel_bits()
        self._check_codebook()
        allowed_bits = ELEMENT_BITS[self.dtype]
        if len(allowed_bits) == 1:
            # bits are implied; normalise so that equal formats compare equal.
            object.__setattr__(self, "bits", allowed_bits[0])
        if isinstance(self.bits, bool) or self.bits not in allowed_bits:
            raise _fail("bits", self.bits, f"{self.dtype} allows {', '.join(map(str, allowed_bits))}")
        if not isinstance(self.symmetric, bool):
            raise _fail("symmetric", self.symmetric, "true or false")
        if not isinstance(self.granularity, tuple(GRANULARITIES.values())):
            raise _fail("granularity", self.granularity, f"one of {', '.join(GRANULARITIES)}")
        if not isinstance(self.clip, tuple(CLIPS.values())):
            raise _fail("clip", self.clip, f"one of {', '.join(CLIPS)}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise _fail("scale_dtype", self.scale_dtype, f"one of {', '.join(SCALE_DTYPES)}")
        if self.rotate not in ROTATIONS:
            raise _fail("rotate", self.rotate, f"one of {', '.join(ROTATIONS)}")
        if self.rounding not in ROUNDINGS:
            raise _fail("rounding", self.rounding, f"one of {', '.join(ROUNDINGS)}")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise _fail("scale_rounding", self.scale_rounding, f"one of {', '.join(SCALE_ROUNDINGS)}")
        f = self.scale_floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < float("inf"):
            raise _fail("scale_floor", f, "a finite number >= 0 (0: no floor)")
        object.__setattr__(self, "scale_floor", float(f))
        if not isinstance(self.reciprocal, bool):
            raise _fail("reciprocal", self.reciprocal, "true or false")
        if self.encode_with not in ENCODE_WITH:
            raise _fail("encode_with", self.encode_with, f"one of {', '.join(ENCODE_WITH)}")
        fs = self.fixed_scale
        if fs is not None and (isinstance(fs, bool) or not isinstance(fs, (int, float))
                               or not 0.0 < fs < float("inf")):
            raise _fail("fixed_scale", fs, "a finite number > 0, or null (a computed scale)")
        if self.is_float:
            # Plain floats carry no scale: normalise the unused fields so equality is meaningful.
            for name, default in (
                ("symmetric", True),
                ("granularity", PerTensor()),
                ("scale_dtype", "fp32"),
                ("clip", AbsMax()),
                ("rotate", "none"),
                ("rounding", "half_even"),
                ("scale_rounding", "outward"),
                ("scale_floor", 0.0),
                ("reciprocal", False),
                ("encode_with", "stored"),
                ("fixed_scale", None),
            ):
                object.__setattr__(self, name, default)
            return
        if self.is_minifloat and self.rounding != "half_even":
            raise _fail("rounding", self.rounding, f"{self.dtype} codes are the cast's round-half-to-even")
        if (self.is_minifloat or self.is_codebook) and not self.symmetric:
            raise _fail("symmetric", False, f"{self.dtype} is symmetric (a scale, no zero point)")
        if self.encode_with == "fp32" and (self.dtype != "int" or self.scale_rounding != "nearest"
                                           or not isinstance(self.clip, AbsMax) or self.channel_bits is not None):
            raise _fail("encode_with", "fp32", "only for integers with scale_rounding 'nearest' and clip absmax "
                        "(codes from the fp32 scale of the block's range)")
        if self.fixed_scale is not None:
            self._check_fixed_scale()
        if isinstance(self.clip, MSEClip) and self.clip.asymmetric and not self.has_zero:
            raise _fail("clip.asymmetric", True, "only for integer formats with a zero point (symmetric: false)")
        if self.dtype == "int":
            levels = self.levels
            # Rounding a scale up to its stored dtype moves the top level by at most
            # levels * (relative spacing) steps; keep that under a quarter step so that the
            # range maximum still maps to the top code (and quantize o dequantize is idempotent).
            spacing = 2.0 ** (1 - SIGNIFICAND_BITS[self.scale_dtype])
            if levels * spacing > 0.25:
                raise ConfigError(
                    f"scale_dtype={self.scale_dtype!r} is too coarse for {self.bits}-bit "
                    f"{'symmetric' if self.symmetric else 'asymmetric'} codes: its "
                    f"{SIGNIFICAND_BITS[self.scale_dtype]} significant bits cannot place the top "
                    f"of {levels} levels within a quarter step; use 'fp16' or 'fp32'"
                )
        if self.is_codebook and self.scale_stat == "absmax":
            # the same quarter-step rule, for the top cell of the codebook
            c = self.codebook_levels
            spacing = 2.0 ** (1 - SIGNIFICAND_BITS[self.scale_dtype])
            if codebooks.top_level(c) * spacing > 0.25 * min(c[1] - c[0], c[-1] - c[-2]):
                raise ConfigError(
                    f"scale_dtype={self.scale_dtype!r} is too coarse for this codebook: its "
                    f"{SIGNIFICAND_BITS[self.scale_dtype]} significant bits cannot place the top level "
                    "within a quarter of the outer cells; use 'fp16' or 'fp32'"
                )

    def _check_codebook(self) -> None:
        if self.dtype != "codebook":
            if self.codebook is not None:
                raise _fail("codebook", self.codebook, "only for dtype 'codebook'")
            if self.scale_stat != "absmax":
                raise _fail("scale_stat", self.scale_stat, "only for dtype 'codebook' (other formats: absmax)")
            return
        if self.scale_stat not in SCALE_STATS:
            raise _fail("scale_stat", self.scale_stat, f"one of {', '.join(SCALE_STATS)}")
        if self.bits not in CODEBOOK_BITS or isinstance(self.bits, bool):
            raise _fail("bits", self.bits, f"codebook allows {', '.join(map(str, CODEBOOK_BITS))}")
        cb = "normal" if self.codebook is None else self.codebook
        if not isinstance(cb, str):
            cb = codebooks.check_levels(cb, self.bits)
        elif cb not in CODEBOOK_NAMES:
            raise _fail("codebook", cb, f"one of {', '.join(CODEBOOK_NAMES)}, or a list of {2**self.bits} levels")
        object.__setattr__(self, "codebook", cb)
        if self.scale_stat == "rms" and not isinstance(self.clip, AbsMax):
            raise _fail("clip", self.clip.kind, "absmax only with scale_stat 'rms' (the scale is not a range)")

    def _check_fixed_scale(self) -> None:
        fs = float(self.fixed_scale)
        if not isinstance(self.granularity, PerTensor) or self.has_zero or not isinstance(self.clip, AbsMax):
            raise _fail("fixed_scale", fs, "only for symmetric formats with granularity tensor and clip absmax")
        if float(torch.tensor(fs, dtype=torch.float64).to(TORCH_DTYPES[self.scale_dtype]).double()) != fs:
            raise _fail("fixed_scale", fs, f"a value exact in scale_dtype {self.scale_dtype!r}")
        object.__setattr__(self, "fixed_scale", fs)

    def _check_channel_bits(self) -> None:
        cb = self.channel_bits
        if isinstance(cb, (str, bytes)) or not hasattr(cb, "__iter__"):
            raise _fail("channel_bits", cb, "a list with one width per channel")
        cb = tuple(cb)
        if not cb or any(isinstance(b, bool) or not isinstance(b, int) or b not in CHANNEL_BITS for b in cb):
            raise _fail("channel_bits", list(cb), f"one width per channel, each one of {', '.join(map(str, CHANNEL_BITS))}")
        if max(cb) < 2:
            raise _fail("channel_bits", list(cb), "at least one channel with codes (a width of 2 or more)")
        if self.dtype != "int" or self.symmetric:
            raise _fail("channel_bits", list(cb), "only for asymmetric integers (dtype int, symmetric false)")
        if not isinstance(self.granularity, PerChannel):
            raise _fail("channel_bits", list(cb), "only with per-channel scales (granularity channel)")
        object.__setattr__(self, "channel_bits", cb)
        object.__setattr__(self, "bits", max(cb))

    # ---- derived properties -----------------------------------------------------------------

    @property
    def element_bits(self) -> float:
        """Code bits per element: ``bits``, or the mean of ``channel_bits`` (plain floats: their width)."""
        if self.channel_bits is not None:
            return sum(self.channel_bits) / len(self.channel_bits)
        return float(self.bits)

    def channel_widths(self) -> list[tuple[int, list[int]]]:
        """``(width, channels)`` for each width of ``channel_bits``, ascending; the channels in
        order. The codes of a row are stored width by width in this order (:mod:`.packing`)."""
        if self.channel_bits is None:
            raise ConfigError(f"{self.label()} has one width for every channel")
        widths = sorted(set(self.channel_bits))
        return [(b, [i for i, x in enumerate(self.channel_bits) if x == b]) for b in widths]

    def with_bits(self, bits: int) -> QuantFormat:
        """This format with every channel at ``bits`` (no ``channel_bits``): how a channel of
        that width is stored."""
        return dataclasses.replace(self, bits=bits, channel_bits=None)

    @property
    def is_float(self) -> bool:
        """Stored as plain floating point (no codes, no scales)."""
        return self.dtype in FLOAT_DTYPES

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("fp8")

    @property
    def is_fp4(self) -> bool:
        return self.dtype == "fp4_e2m1"

    @property
    def is_minifloat(self) -> bool:
        """A scaled floating-point element (fp8 or fp4): codes are the element's bit patterns."""
        return self.is_fp8 or self.is_fp4

    @property
    def is_codebook(self) -> bool:
        return self.dtype == "codebook"

    @property
    def codebook_levels(self) -> tuple[float, ...]:
        """Codebooks: the ``2**bits`` fp32 levels, ascending (a named codebook resolved)."""
        if not self.is_codebook:
            raise ConfigError(f"{self.label()} is not a codebook format")
        if isinstance(self.codebook, tuple):  # given levels, checked and made fp32 on construction
            return self.codebook
        return codebooks.resolve(self.codebook, self.bits)

    @property
    def takes_static_scales(self) -> bool:
        """Whether its scales are static data given from outside (calibrated, or a checkpoint's):
        static granularity, not a plain float, no :attr:`fixed_scale` (the format's own)."""
        return not self.is_float and is_static(self.granularity) and self.fixed_scale is None

    @property
    def has_zero(self) -> bool:
        """Whether a zero point (block offset) is stored."""
        return self.dtype == "int" and not self.symmetric

    @property
    def levels(self) -> int:
        """Integer formats: the largest code step count (``qmax`` if symmetric, ``2**b-1`` if not)."""
        if self.dtype != "int":
            raise ConfigError(f"levels is defined for integer formats, not {self.dtype}")
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    @property
    def arithmetic_is_default(self) -> bool:
        """Whether rounding, scale rounding, scale floor and reciprocal are kverr's defaults."""
        return not arithmetic_options(self)

    @property
    def scale_bytes(self) -> int:
        return 1 if self.scale_dtype in BYTE_SCALE_DTYPES else 4 if self.scale_dtype == "fp32" else 2

    def check_head_dim(self, head_dim: int, where: str = "format") -> None:
        """Raise :class:`ConfigError` unless this format can store a head dimension of ``head_dim``."""
        g = self.granularity
        if isinstance(g, PerTokenGroup) and head_dim % g.group:
            divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
            raise ConfigError(
                f"{where}.granularity.group={g.group} does not divide the head dimension "
                f"{head_dim}; allowed groups: {', '.join(map(str, divisors))}"
            )
        if self.channel_bits is not None and len(self.channel_bits) != head_dim:
            raise ConfigError(
                f"{where}.channel_bits has {len(self.channel_bits)} widths for a head dimension of {head_dim}"
            )
        if self.rotate == "hadamard" and (head_dim & (head_dim - 1)):
            raise ConfigError(
                f"{where}.rotate='hadamard' needs a power-of-two head dimension, got {head_dim}"
            )

    def label(self) -> str:
        """A short human-readable name, e.g. ``int4a/tg64/fp16``."""
        if self.is_float:
            return self.dtype
        g = self.granularity
        gname = {
            "tensor": "tensor",
            "head": "head",
            "token": "tok",
            "token_group": f"tg{getattr(g, 'group', '')}",
            "channel": f"ch{getattr(g, 'tokens', None) or 'all'}",
            "page": "page",
        }[g.kind]
        if self.is_minifloat:
            elem = self.dtype
        elif self.is_codebook:
            elem = f"{self.codebook if isinstance(self.codebook, str) else 'lut'}{self.bits}"
        else:
            elem = f"int{self.element_bits:.4g}{'s' if self.symmetric else 'a'}"
        parts = [elem, gname, self.scale_dtype]
        if self.scale_stat != "absmax":
            parts.append(self.scale_stat)
        if not isinstance(self.clip, AbsMax):
            parts.append(
                f"p{self.clip.percentile:g}" if isinstance(self.clip, Percentile)
                else ("amse" if self.clip.asymmetric else "mse")
                + ("" if self.clip.candidates is None else ",".join(f"{r:g}" for r in self.clip.candidates))
            )
        if self.rotate != "none":
            parts.append("had")
        if self.channel_bits is not None:
            parts.append("cb" + "".join(str(b) for b, _ in self.channel_widths()))
        opts = arithmetic_options(self)
        if opts:
            parts.append("".join((
                "ha" if "rounding" in opts else "",
                "rn" if "scale_rounding" in opts else "",
                f"f{self.scale_floor:g}" if "scale_floor" in opts else "",
                "rcp" if "reciprocal" in opts else "",
                "e32" if "encode_with" in opts else "",
                f"s{self.fixed_scale:g}" if "fixed_scale" in opts else "",
            )))
        return "/".join(parts)

    # ---- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        if self.is_float:
            return {"dtype": self.dtype}
        return {
            "dtype": self.dtype,
            "bits": self.bits,
            "symmetric": self.symmetric,
            "granularity": granularity_to_dict(self.granularity),
            "scale_dtype": self.scale_dtype,
            "clip": clip_to_dict(self.clip),
            "rotate": self.rotate,
            **arithmetic_options(self),
            **({} if self.channel_bits is None else {"channel_bits": list(self.channel_bits)}),
            **({} if not self.is_codebook else {
                "codebook": self.codebook if isinstance(self.codebook, str) else list(self.codebook),
                "scale_stat": self.scale_stat,
            }),
        }

    @classmethod
    def from_dict(cls, obj: Any, where: str = "format") -> QuantFormat:
        fields = {"dtype", "bits", "symmetric", "granularity", "scale_dtype", "clip", "rotate", "channel_bits",
                  "codebook", "scale_stat", *ARITHMETIC_DEFAULTS}
        _check_keys(obj, where, {"dtype"}, fields - {"dtype"})
        dtype = obj["dtype"]
        if dtype not in ELEMENT_BITS:
            raise _fail(f"{where}.dtype", dtype, f"one of {', '.join(ELEMENT_BITS)}")
        if dtype in FLOAT_DTYPES:
            extra = set(obj) - {"dtype"}
            if extra:
                raise ConfigError(
                    f"field {where}.{sorted(extra)[0]} has no meaning for plain {dtype} storage; "
                    f"allowed fields: dtype"
                )
            return cls(dtype=dtype)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if "channel_bits" in obj:
            cb = obj["channel_bits"]
            if not isinstance(cb, list):
                raise ConfigError(f"{where}.channel_bits={cb!r} must be a list with one width per channel")
            kwargs["channel_bits"] = tuple(cb)
        if "bits" in obj:
            kwargs["bits"] = _int_field(obj, "bits", where)
            cb = kwargs.get("channel_bits")
            if cb and all(isinstance(b, int) for b in cb) and kwargs["bits"] != max(cb):
                raise ConfigError(f"{where}.bits={kwargs['bits']} must be the largest of channel_bits ({max(cb)})")
        elif "channel_bits" in obj:
            pass  # implied by channel_bits
        elif dtype in ("int", "codebook"):
            raise ConfigError(f"missing field {where}.bits; {dtype} formats need "
                              f"{', '.join(map(str, ELEMENT_BITS[dtype]))}")
        if "symmetric" in obj:
            kwargs["symmetric"] = obj["symmetric"]
        elif dtype.startswith(("fp8", "fp4")) or dtype == "codebook":
            kwargs["symmetric"] = True
        if "codebook" in obj:
            cb = obj["codebook"]
            kwargs["codebook"] = tuple(cb) if isinstance(cb, list) else cb
        if "scale_stat" in obj:
            kwargs["scale_stat"] = obj["scale_stat"]
        if "granularity" in obj:
            kwargs["granularity"] = granularity_from_dict(obj["granularity"], f"{where}.granularity")
        if "scale_dtype" in obj:
            kwargs["scale_dtype"] = obj["scale_dtype"]
        if "clip" in obj:
            kwargs["clip"] = clip_from_dict(obj["clip"], f"{where}.clip")
        if "rotate" in obj:
            kwargs["rotate"] = obj["rotate"]
        for name in ARITHMETIC_DEFAULTS:
            if name in obj:
                kwargs[name] = obj[name]
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


#: The arithmetic options and their defaults (kverr's own arithmetic); JSON holds only those
#: that differ.
ARITHMETIC_DEFAULTS: dict[str, Any] = {
    "rounding": "half_even",
    "scale_rounding": "outward",
    "scale_floor": 0.0,
    "reciprocal": False,
    "encode_with": "stored",
    "fixed_scale": None,
}


def arithmetic_options(fmt: QuantFormat) -> dict[str, Any]:
    """The arithmetic options of ``fmt`` that differ from :data:`ARITHMETIC_DEFAULTS`."""
    return {k: getattr(fmt, k) for k, d in ARITHMETIC_DEFAULTS.items() if getattr(fmt, k) != d}


def float_format(dtype: str = "fp16") -> QuantFormat:
    """Plain floating-point storage (no quantization)."""
    return QuantFormat(dtype=dtype)


def int_format(
    bits: int,
    granularity: Granularity,
    *,
    symmetric: bool = False,
    scale_dtype: str = "fp16",
    clip: Clip | None = None,
    rotate: str = "none",
) -> QuantFormat:
    """An integer format (convenience constructor)."""
    return QuantFormat(
        dtype="int",
        bits=bits,
        symmetric=symmetric,
        granularity=granularity,
        scale_dtype=scale_dtype,
        clip=clip or AbsMax(),
        rotate=rotate,
    )


def fp8_format(
    granularity: Granularity,
    *,
    variant: Literal["e4m3", "e5m2"] = "e4m3",
    scale_dtype: str = "fp32",
    clip: Clip | None = None,
    rotate: str = "none",
) -> QuantFormat:
    """An fp8 format with a scale (convenience constructor)."""
    return QuantFormat(
        dtype=f"fp8_{variant}",
        bits=8,
        symmetric=True,
        granularity=granularity,
        scale_dtype=scale_dtype,
        clip=clip or AbsMax(),
        rotate=rotate,
    )


def codebook_format(
    bits: int,
    granularity: Granularity,
    *,
    codebook: str | tuple[float, ...] = "normal",
    scale_stat: str = "absmax",
    scale_dtype: str = "fp16",
    clip: Clip | None = None,
    rotate: str = "none",
) -> QuantFormat:
    """A codebook format (convenience constructor), see :mod:`kverr.quant.codebooks`."""
    return QuantFormat(
        dtype="codebook",
        bits=bits,
        symmetric=True,
        granularity=granularity,
        scale_dtype=scale_dtype,
        clip=clip or AbsMax(),
        rotate=rotate,
        codebook=codebook,
        scale_stat=scale_stat,
    )


def fp4_format(
    granularity: Granularity,
    *,
    scale_dtype: str = "fp8_e4m3",
    clip: Clip | None = None,
    rotate: str = "none",
) -> QuantFormat:
    """An fp4 e2m1 format with a scale (convenience constructor): with ``PerTokenGroup(16)`` and
    the default fp8 e4m3 scales NVFP4's layout, with ``PerTokenGroup(32)`` and ``"e8m0"`` MXFP4's."""
    return QuantFormat(
        dtype="fp4_e2m1",
        bits=4,
        symmetric=True,
        granularity=granularity,
        scale_dtype=scale_dtype,
        clip=clip or AbsMax(),
        rotate=rotate,
    )


def minifloat_max(dtype: str) -> float:
    """Largest finite value of a scaled floating-point element format (fp8, fp4)."""
    if dtype == "fp4_e2m1":
        return FP4_E2M1_VALUES[7]
    return float(torch.finfo(TORCH_DTYPES[dtype]).max)



def window_format(window_dtype: str) -> QuantFormat:
    """The format a cache stores its full-precision tokens in (sinks, window, pending block).

    A plain float dtype, or for ``"int8"`` symmetric int8 with one absmax fp16 scale per
    (token, kv head): ``D + 2`` bytes a row instead of ``2 D``.
    """
    if window_dtype == "int8":
        return int_format(8, PerToken(), symmetric=True, scale_dtype="fp16")
    if window_dtype in FLOAT_DTYPES:
        return float_format(window_dtype)
    raise _fail("window_dtype", window_dtype, f"one of {', '.join(WINDOW_DTYPES)}")
