"""The oracle's reconstruction of one layer under many candidate formats, sharing the work.

Calibration asks :func:`kverr.quant.reconstruct` for the same tensor (a layer's keys and values
stacked on the head axis) under ~70 formats. Each call casts the input to ``window_dtype``
(:func:`kverr.quant.store.receive`),
checks it finite, rotates it (Hadamard formats), regroups it into scale blocks and takes the
clip range of every block, then encodes and decodes. :class:`SharedReconstruct` does the
format-independent part once per tensor (cast, check, rotation) and once per scale block shape
(:func:`~kverr.quant.to_blocks`, :func:`~kverr.quant.clip_range`), and the rest by the oracle's
own public stages (:func:`~kverr.quant.fake_quantize_blocks`, ``Blocks.ungroup``,
:func:`~kverr.quant.hadamard_rotate`), so its output equals ``reconstruct`` **bit for bit** (``tests/calibration/test_calibrate.py`` checks every default candidate, static scales
included: a static block is one more block shape). Percentile clips go through the oracle itself.

Only configs without sinks or window are served (calibration masks sinks and windows per query
instead): every token ``< end`` is quantized, ``end = T - T % token_block``.
"""

from __future__ import annotations

import torch

from kverr.config import CacheConfig
from kverr.exceptions import ShapeError
from kverr.quant import (
    AbsMax,
    Blocks,
    MSEClip,
    QuantFormat,
    block_shape,
    clip_range,
    fake_quantize_blocks,
    hadamard_rotate,
    reconstruct,
    to_blocks,
    token_block,
)
from kverr.quant.formats import TORCH_DTYPES
from kverr.quant.reference import as_float_tensor
from kverr.quant.store import receive


class SharedReconstruct:
    """``reconstruct(x, CacheConfig(k=f, v=f, page_size, window_dtype), layer=0, which="k")`` for
    many formats ``f`` of one tensor ``x [H, T, D]``, bit for bit, sharing the work.

    Parameters
    ----------
    x : Tensor ``[H, T, D]``
        The tensor (e.g. keys and values of one layer stacked on the head axis).
    page_size, window_dtype
        As in the config.
    """

    def __init__(self, x: torch.Tensor, *, page_size: int = 64, window_dtype: str = "fp16"):
        x32 = as_float_tensor(x, "x (one layer's keys and values, stacked on the head axis)")  # the oracle's check, once
        if x32.ndim != 3:
            raise ShapeError(f"x must be [H, T, D] (heads, tokens, channels), got shape {tuple(x32.shape)}")
        self.page_size, self.window_dtype = page_size, window_dtype
        self.x = x32
        # reconstruct: the cache receives the values in window_dtype
        self.x4 = receive(x32[None], window_dtype)
        self._rot: torch.Tensor | None = None
        self._blocks: dict = {}
        self._ranges: dict = {}

    def _rotated(self) -> torch.Tensor:
        if self._rot is None:
            self._rot = hadamard_rotate(self.x4)
        return self._rot

    def _region(self, fmt: QuantFormat) -> int:
        T = self.x4.shape[2]
        return T - T % token_block(fmt.granularity, self.page_size)

    def _grouped(self, rot: bool, block: tuple[int, int, int], end: int) -> Blocks:
        key = (rot, block, end)
        if key not in self._blocks:
            src = self._rotated() if rot else self.x4
            self._blocks[key] = to_blocks(src[:, :, :end, :], block)
        return self._blocks[key]

    def _range(self, fmt: QuantFormat, rot: bool, block, end: int, blocks: Blocks):
        key = (rot, block, end, fmt.symmetric)
        if key not in self._ranges:
            # clip_range depends on the format only through `symmetric` and a percentile clip
            # (never served here): absmax and MSE formats share it
            self._ranges[key] = clip_range(fmt, blocks)
        return self._ranges[key]

    def served(self, fmt: QuantFormat) -> bool:
        """Whether the shared path handles ``fmt`` (else the oracle is called)."""
        return fmt.is_float or isinstance(fmt.clip, (AbsMax, MSEClip))

    def __call__(self, fmt: QuantFormat) -> torch.Tensor:
        """``[H, T, D]`` float32, equal to the oracle's reconstruction under ``fmt``."""
        if not self.served(fmt):
            cfg = CacheConfig(k=fmt, v=fmt, page_size=self.page_size, window_dtype=self.window_dtype)
            return reconstruct(self.x, cfg, layer=0, which="k")
        fmt.check_head_dim(self.x4.shape[-1])
        end = self._region(fmt)
        out = self.x4.clone() if end < self.x4.shape[2] else None
        if fmt.is_float:
            vals = self.x4[:, :, :end].to(TORCH_DTYPES[fmt.dtype]).to(torch.float32)
        else:
            rot = fmt.rotate == "hadamard"
            _, H, _, D = self.x4.shape
            block = block_shape(fmt, H, end, D, self.page_size)
            blocks = self._grouped(rot, block, end)
            clip = self._range(fmt, rot, block, end, blocks)
            vals = blocks.ungroup(fake_quantize_blocks(fmt, blocks, clip=clip))
            if rot:
                vals = hadamard_rotate(vals)
        if out is None:
            return vals[0]
        out[:, :, :end] = vals
        return out[0]
