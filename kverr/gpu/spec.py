"""A :class:`~kverr.quant.QuantFormat` as the constexprs of the Triton kernels.

The kernels are specialised at launch on the format of each (layer, K|V, head group); this
module is the one place that maps a format to those compile-time constants and to the shapes of
the pools that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kverr.exceptions import KernelError
from kverr.quant.formats import (
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
from kverr.quant.reference import codes_nbytes

KIND_INT_SYM, KIND_INT_ASYM, KIND_FP8_E4M3, KIND_FP8_E5M2, KIND_FLOAT = range(5)
SDT = {"fp32": 0, "fp16": 1, "bf16": 2}
GRAN_ROW, GRAN_BLOCK, GRAN_STATIC = range(3)


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of one format at head dim ``D`` and page size ``P``.

    Attributes
    ----------
    kind, bits, sdt
        Element kind (``KIND_*``), bits per code, scale dtype code.
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
        fp32 clip ratios of an MSE clip, largest first (empty for absmax).
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

    @property
    def clip_n(self) -> int:
        return len(self.clip_ratios)

    def scale_cols(self, D: int) -> int:
        return D // self.bd

    def scale_rows(self, P: int) -> int:
        return max(P // self.bts, 1)

    @property
    def codes_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.fmt.dtype] if self.fmt.is_float else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.fmt.scale_dtype]


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
    if opts:
        raise KernelError(
            f"{fmt.label()}: {', '.join(f'{k}={v!r}' for k, v in opts.items())} is not implemented by the "
            "kernels (they round scales outward, divide, and round codes half to even); use the reference "
            "path (kverr.quant)"
        )
    if fmt.channel_bits is not None:
        raise KernelError(
            f"{fmt.label()}: per-channel bit widths (channel_bits) are not implemented by the kernels; "
            "use the reference path (kverr.quant, kverr.hf.KverrCache)"
        )
    g = fmt.granularity
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
    return KernelSpec(kind, fmt.bits, SDT[fmt.scale_dtype], gran, bd, bts, tb, codes_nbytes(fmt, D), static, fmt,
                      rot=fmt.rotate == "hadamard", clip_ratios=ratios)
