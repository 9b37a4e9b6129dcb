"""A :class:`~kverr.quant.QuantFormat` as the constexprs of the Triton kernels.

The kernels are specialised at launch on the format of each (layer, K|V, head group); this
module is the one place that maps a format to those compile-time constants and to the shapes of
the pools that hold it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kverr.exceptions import KernelError
from kverr.quant.formats import (
    BYTE_SCALE_DTYPES,
    TORCH_DTYPES,
    AbsMax,
    MSEClip,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    arithmetic_options,
    is_static,
    token_block,
)
from kverr.quant.codebooks import boundaries, top_level
from kverr.quant.reference import codes_nbytes, near_cast, pack_codes

(KIND_INT_SYM, KIND_INT_ASYM, KIND_FP8_E4M3, KIND_FP8_E5M2, KIND_FLOAT, KIND_CODEBOOK, KIND_CODEBOOK_RMS,
 KIND_FP4) = range(8)
#: The store kernel's ``ARITH`` bits: scales rounded to nearest, codes from the reciprocal,
#: integer codes rounded half away from zero, codes from the fp32 scale and zero point.
ARITH_NEAREST, ARITH_RECIPROCAL, ARITH_HALF_AWAY, ARITH_FP32_ENCODE = 1, 2, 4, 8
#: Scale dtype codes; the one-byte dtypes (3, 4) live in uint8 pools as their bytes.
SDT = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3, "e8m0": 4}
GRAN_ROW, GRAN_BLOCK, GRAN_STATIC = range(3)


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of one format at head dim ``D`` and page size ``P``.

    Attributes
    ----------
    kind, bits, sdt
        Element kind (``KIND_*``), bits per code (0: per-channel widths, where each channel's
        code sits is in the tables of :func:`mixed_layout`), scale dtype code.
    gran
        Store-kernel granularity: one scale per row, per block of rows, or static.
    bd
        Channels that share a scale column (``D`` for token/page/tensor/head, the group size
        for token groups, 1 for channel granularity).
    bts
        Token rows per scale row inside a page (1 per token, ``G`` for channel groups, ``P`` per
        page); irrelevant when static.
    tb
        Tokens that must arrive together before they are quantized (see ``token_block``).
    cb
        Stored elements per token row (bytes of codes; ``D`` for plain floats).
    static
        Scales are given (calibrated), not computed by the store kernel.
    rot
        Codes hold the Hadamard-rotated head dimension (the store kernel rotates; the decode
        kernel rotates the query and un-rotates the value accumulator instead of every row).
    clip_ratios
        fp32 clip ratios of an MSE clip, in search order (empty for absmax).
    arith, scale_floor
        The format's arithmetic options (:func:`~kverr.quant.formats.arithmetic_options`) as the
        store kernel's ``ARITH`` bits (:data:`ARITH_NEAREST`, :data:`ARITH_RECIPROCAL`,
        :data:`ARITH_HALF_AWAY`, :data:`ARITH_FP32_ENCODE`) and its fp32 scale floor (0: none).
    """

    kind: int
    bits: int
    sdt: int
    gran: int
    bd: int
    bts: int
    tb: int
    cb: int
    static: bool
    fmt: QuantFormat
    rot: bool = False
    clip_ratios: tuple[float, ...] = ()
    arith: int = 0
    scale_floor: float = 0.0

    @property
    def clip_n(self) -> int:
        return len(self.clip_ratios)

    @property
    def cb_const(self) -> int:
        """``cb`` as a kernel's compile-time constant: 0 for per-channel widths, whose row bytes the
        kernels take at run time (every layout of widths shares one specialisation)."""
        return self.cb if self.bits else 0

    def scale_cols(self, D: int) -> int:
        return D // self.bd

    def scale_rows(self, P: int) -> int:
        return max(P // self.bts, 1)

    @property
    def codes_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.fmt.dtype] if self.fmt.is_float else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of the scale pools: the scale dtype, or uint8 (bytes) for fp8 e4m3 and e8m0."""
        return torch.uint8 if self.fmt.scale_dtype in BYTE_SCALE_DTYPES else TORCH_DTYPES[self.fmt.scale_dtype]

    def pool_scales(self, s: torch.Tensor) -> torch.Tensor:
        """Scales (the oracle's tensor, or fp32 values cast to nearest as the oracle's static
        scales are) as a scale pool holds them."""
        r = near_cast(s.float(), self.fmt.scale_dtype, "static scale")
        return r.view(torch.uint8) if self.fmt.scale_dtype in BYTE_SCALE_DTYPES else r

    def oracle_scales(self, pool: torch.Tensor) -> torch.Tensor:
        """A scale pool's entries as the oracle's scale tensor (its dtype)."""
        if self.fmt.scale_dtype in BYTE_SCALE_DTYPES:
            return pool.view(TORCH_DTYPES[self.fmt.scale_dtype])
        return pool


def check_head_dim(D: int) -> None:
    """The kernels tile the head dimension whole: a power of two from 16 to 256."""
    if D < 16 or D > 256 or D & (D - 1):
        raise KernelError(
            f"the Triton kernels need a power-of-two head dimension in [16, 256], got {D}; "
            "use the reference path (kverr.quant) for this model"
        )


def kernel_spec(fmt: QuantFormat, D: int, P: int) -> KernelSpec:
    """Constexprs of ``fmt``; raises :class:`KernelError` for what the kernels do not implement."""
    check_head_dim(D)
    if fmt.is_float:
        return KernelSpec(KIND_FLOAT, 16, 0, GRAN_ROW, D, 1, 1, D, False, fmt)
    opts = arithmetic_options(fmt)
    if opts and fmt.channel_bits is not None:
        raise KernelError(
            f"{fmt.label()}: {', '.join(f'{k}={v!r}' for k, v in opts.items())} with per-channel widths is not "
            "implemented by the kernels (their channel codes round half to even); use the reference path (kverr.quant)"
        )
    arith = ((ARITH_NEAREST if fmt.scale_rounding == "nearest" else 0)
             | (ARITH_RECIPROCAL if fmt.reciprocal else 0) | (ARITH_HALF_AWAY if fmt.rounding == "half_away" else 0)
             | (ARITH_FP32_ENCODE if fmt.encode_with == "fp32" else 0))
    sfloor = float(np.float32(fmt.scale_floor))
    g = fmt.granularity
    if fmt.channel_bits is not None and not is_static(g):
        raise KernelError(
            f"{fmt.label()}: per-channel bit widths (channel_bits) with scales per block of {g.tokens} tokens are "
            "not implemented by the kernels (a width-0 channel stores its block's mean, and the kernel's sum "
            "would not follow the oracle's order); use static channel scales (tokens null), or the reference path"
        )
    ratios: tuple[float, ...] = ()
    if isinstance(fmt.clip, MSEClip):
        if fmt.clip.asymmetric and not is_static(g):
            raise KernelError(
                f"{fmt.label()}: the asymmetric MSE clip search ({fmt.clip.grid}² pairs per block) is not "
                "implemented by the kernels; use it with static scales calibrated with the reference"
            )
        if not is_static(g):  # static scales are given: the clip was applied when calibrating them
            ratios = tuple(float(np.float32(r)) for r in fmt.clip.ratios())
    elif not isinstance(fmt.clip, AbsMax) and not is_static(g):
        raise KernelError(
            f"{fmt.label()}: clip={fmt.clip.kind!r} is not implemented by the kernels (a percentile "
            "needs a sort per block); use clip absmax or mse, or static scales calibrated with the reference"
        )
    if fmt.is_fp8:
        kind = KIND_FP8_E4M3 if fmt.dtype == "fp8_e4m3" else KIND_FP8_E5M2
    elif fmt.is_fp4:
        kind = KIND_FP4
    elif fmt.is_codebook:
        kind = KIND_CODEBOOK_RMS if fmt.scale_stat == "rms" else KIND_CODEBOOK
    else:
        kind = KIND_INT_SYM if fmt.symmetric else KIND_INT_ASYM
    static = is_static(g)
    tb = token_block(g, P)
    if isinstance(g, PerToken):
        gran, bd, bts = GRAN_ROW, D, 1
    elif isinstance(g, PerTokenGroup):
        fmt.check_head_dim(D)
        gran, bd, bts = GRAN_ROW, g.group, 1
    elif isinstance(g, PerPage):
        gran, bd, bts = GRAN_BLOCK, D, P
    elif isinstance(g, PerChannel) and g.tokens is not None:
        if P % g.tokens:
            raise KernelError(f"{fmt.label()}: channel groups of {g.tokens} tokens must divide the page size {P}")
        gran, bd, bts = GRAN_BLOCK, 1, g.tokens
    elif isinstance(g, (PerTensor, PerHead)):
        gran, bd, bts = GRAN_STATIC, D, 1
    elif isinstance(g, PerChannel):
        gran, bd, bts = GRAN_STATIC, 1, 1
    else:  # pragma: no cover
        raise KernelError(f"unknown granularity {g!r}")
    if gran == GRAN_BLOCK and tb & (tb - 1):
        raise KernelError(
            f"{fmt.label()}: a token block of {tb} tokens is not a power of two; the store kernel "
            "reduces a whole block in one tile"
        )
    bits = 0 if fmt.channel_bits is not None else fmt.bits  # 0: each channel's width in the layout tables
    return KernelSpec(kind, bits, SDT[fmt.scale_dtype], gran, bd, bts, tb, codes_nbytes(fmt, D), static, fmt,
                      rot=fmt.rotate == "hadamard", clip_ratios=ratios, arith=arith, scale_floor=sfloor)


def codebook_table(fmt: QuantFormat) -> np.ndarray:
    """The table a codebook format's kernels read: int32 ``[2 * 2**bits]``, the fp32 bit patterns of
    the levels, the cell boundaries and the largest level magnitude, in that order (the oracle's
    :func:`kverr.quant.codebooks.boundaries` and ``top_level``)."""
    levels = fmt.codebook_levels
    vals = np.array([*levels, *boundaries(levels), top_level(levels)], dtype=np.float32)
    return vals.view(np.int32)


#: Bit fields of a pack word (:func:`mixed_layout`): channel index, right shift, mask, left
#: shift; the store kernel reads them with ``kernels.packing.piece``.
WORD_SHIFT_AT, WORD_MASK_AT, WORD_LSHIFT_AT = 16, 20, 28
#: Most pieces of codes one byte holds (eight one-bit pieces).
PIECES_PER_BYTE = 8


def _word(index: int, shift: int, mask: int, lshift: int) -> int:
    return index | shift << WORD_SHIFT_AT | mask << WORD_MASK_AT | lshift << WORD_LSHIFT_AT


def _code_word(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
    """The unpack word of a channel from its pieces ``(byte, shift, mask)``: A holds the low bits,
    B (3-bit codes only) the third bit; read by ``kernels.packing.code_of``."""
    return a[0] | b[0] << 8 | a[1] << 16 | b[1] << 19 | a[2] << 22 | b[2] << 30


@functools.lru_cache(maxsize=256)
def mixed_layout(fmt: QuantFormat, D: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each bit of each channel's code lives in a stored row of a format with per-channel
    widths (``channel_bits``), as the kernels read and write it.

    Derived from the oracle's packing (:func:`kverr.quant.reference.pack_codes`) bit by bit --
    one probe row per (channel, code bit) -- so the kernels' layout cannot drift from the
    reference store's. A *piece* is a run of a code's bits that sit in consecutive bits of one
    byte: one per code in a planar plane of 2, 4 or 8 bits, two for a 3-bit code (its 2-bit and
    1-bit planes), none for width 0.

    Returns
    -------
    unpack : numpy.ndarray
        int32 ``[D]``, one word per channel: ``a_byte | b_byte << 8 | a_shift << 16 | b_shift << 19
        | a_mask << 22 | b_mask << 30``; the code is ``((row[a_byte] >> a_shift) & a_mask) |
        (((row[b_byte] >> b_shift) & b_mask) << 2)`` (piece B: the third bit of a 3-bit code; an
        absent piece has mask 0). One word, not one per piece, keeps the decode kernel's
        registers within bounds at head dim 128.
    pack : numpy.ndarray
        int32 ``[PIECES_PER_BYTE, D]`` (a row has at most ``D`` bytes; the columns past it are
        empty): the pieces of each byte, each ``channel | shift << 16 | mask << 20 | lshift << 28``;
        byte ``i`` is ``Σ ((code[channel] >> shift) & mask) << lshift`` over its column.
    """
    widths = fmt.channel_bits
    if widths is None or len(widths) != D:
        raise KernelError(f"{fmt.label()}: a layout of per-channel widths needs channel_bits for {D} channels")
    probes = [(c, j) for c in range(D) for j in range(widths[c])]
    u = torch.zeros((len(probes), D), dtype=torch.uint8)
    for i, (c, j) in enumerate(probes):
        u[i, c] = 1 << j
    packed = pack_codes(u, fmt).numpy()
    where = {}  # (channel, bit) -> (byte, bit position)
    for i, probe in enumerate(probes):
        nz = np.flatnonzero(packed[i])
        if len(nz) != 1 or packed[i, nz[0]] & (packed[i, nz[0]] - 1):
            raise KernelError(f"{fmt.label()}: the packing does not move each code bit to one stored bit")
        where[probe] = (int(nz[0]), int(packed[i, nz[0]]).bit_length() - 1)
    unpack = np.zeros(D, dtype=np.int32)
    pack = np.zeros((PIECES_PER_BYTE, D), dtype=np.int32)
    filled = np.zeros(D, dtype=np.int64)
    for c in range(D):
        pieces: list[list[int]] = []  # [byte, position, first bit, length]
        for j in range(widths[c]):
            byte, pos = where[(c, j)]
            last = pieces[-1] if pieces else None
            if last and last[0] == byte and last[1] + last[3] == pos:
                last[3] += 1
            else:
                pieces.append([byte, pos, j, 1])
        if len(pieces) > 2 or (len(pieces) == 2 and (pieces[0][3], pieces[1][3]) != (2, 1)):
            raise KernelError(f"{fmt.label()}: channel {c}'s code is split as {pieces}; the kernels read its low "
                              "bits from one byte and at most a third bit from another")
        ab = [(byte, pos, (1 << n) - 1) for byte, pos, _, n in pieces] + [(0, 0, 0)] * (2 - len(pieces))
        unpack[c] = _code_word(*ab)
        for byte, pos, first, n in pieces:
            pack[filled[byte], byte] = _word(c, first, (1 << n) - 1, pos)
            filled[byte] += 1
    return unpack, pack
