"""The oracle's reconstruction of one layer under many candidate formats, sharing the work.

Calibration asks :func:`kverr.quant.reconstruct` for the same tensor (a layer's keys and values
stacked on the head axis) under ~70 formats. Each call casts the input to ``window_dtype``,
checks it finite, rotates it (Hadamard formats), regroups it into scale blocks and takes the
clip range of every block, then encodes and decodes. :class:`SharedReconstruct` does the
format-independent part once per tensor (cast, check, rotation) and once per scale block shape
(grouping, clip range), and the rest by the oracle's own functions (``_params``, ``_encode``,
``_decode``, ``_from_groups``; the Hadamard butterfly with the same fp32 operations in the same
order), so its output equals ``reconstruct`` **bit for bit** (``tests/test_calibrate.py`` checks
every default candidate). Formats it does not specialise (static scales, percentile clips) go
through the oracle itself.

Only configs without sinks or window are served (calibration masks sinks and windows per query
instead): every token ``< end`` is quantized, ``end = T - T % token_block``.
"""

from __future__ import annotations

import torch

from kverr.config import CacheConfig
from kverr.quant.formats import TORCH_DTYPES, AbsMax, MSEClip, QuantFormat, is_static, token_block
from kverr.quant.reference import (
    _clip_range,
    _decode,
    _encode,
    _from_groups,
    _params,
    _to_groups,
    as_float_tensor,
    block_shape,
    hadamard_scale,
)
from kverr.quant.store import reconstruct


def fwht(x: torch.Tensor) -> torch.Tensor:
    """:func:`kverr.quant.reference.hadamard_rotate`, bit for bit: the same butterfly stages
    (``a + b``, ``a - b`` in fp32) and the same final multiply, written into preallocated
    buffers instead of stacking new tensors at every stage."""
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        return _reference_rotate(x)
    lead = x.shape[:-1]
    y = x.to(torch.float32).contiguous()
    if D == 1:
        return y * hadamard_scale(D)
    buf = torch.empty_like(y)
    h, first = 1, True
    while h < D:
        y4 = y.view(*lead, D // (2 * h), 2, h)
        o4 = buf.view(*lead, D // (2 * h), 2, h)
        a, b = y4[..., 0, :], y4[..., 1, :]
        torch.add(a, b, out=o4[..., 0, :])
        torch.sub(a, b, out=o4[..., 1, :])
        if first:  # never write into the caller's tensor
            y, buf, first = buf, torch.empty_like(buf), False
        else:
            y, buf = buf, y
        h *= 2
    return y.mul_(hadamard_scale(D))


def _reference_rotate(x: torch.Tensor) -> torch.Tensor:
    from kverr.quant.reference import hadamard_rotate

    return hadamard_rotate(x)


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
        x32 = as_float_tensor(x, "k")  # the oracle's check, once
        if x32.ndim != 3:
            raise ValueError(f"x must be [H, T, D], got {tuple(x32.shape)}")
        self.page_size, self.window_dtype = page_size, window_dtype
        self.x = x32
        # reconstruct: the cache receives the values in window_dtype
        self.x4 = x32[None].to(TORCH_DTYPES[window_dtype]).to(torch.float32)
        self._rot: torch.Tensor | None = None
        self._groups: dict = {}
        self._ranges: dict = {}
        self._masks: dict = {}

    def _rotated(self) -> torch.Tensor:
        if self._rot is None:
            self._rot = fwht(self.x4)
        return self._rot

    def _region(self, fmt: QuantFormat) -> int:
        T = self.x4.shape[2]
        return T - T % token_block(fmt.granularity, self.page_size)

    def _grouped(self, rot: bool, block: tuple[int, int, int], end: int):
        key = (rot, block, end)
        if key not in self._groups:
            src = self._rotated() if rot else self.x4
            x = src[:, :, :end, :]
            self._groups[key] = _to_groups(x, block)
            if end % block[1]:
                _, H, _, D = x.shape
                self._masks[key] = _to_groups(torch.ones((1, H, end, D), dtype=torch.bool), block, fill=False)
            else:
                self._masks[key] = None
        return self._groups[key], self._masks[key]

    def _range(self, fmt: QuantFormat, rot: bool, block, end: int, g, mask):
        key = (rot, block, end, fmt.symmetric)
        if key not in self._ranges:
            # _clip_range depends on the format only through `symmetric` and a percentile clip
            # (never served here): absmax and MSE formats share it
            self._ranges[key] = _clip_range(fmt, g, mask)
        return self._ranges[key]

    def served(self, fmt: QuantFormat) -> bool:
        """Whether the shared path handles ``fmt`` (else the oracle is called)."""
        return fmt.is_float or (not is_static(fmt.granularity) and isinstance(fmt.clip, (AbsMax, MSEClip)))

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
            g, mask = self._grouped(rot, block, end)
            lo, hi = self._range(fmt, rot, block, end, g, mask)
            vals = _from_groups(self._values(fmt, g, mask, lo, hi), block, (1, H, end, D))
            if rot:
                vals = fwht(vals)
        if out is None:
            return vals[0]
        out[:, :, :end] = vals
        return out[0]

    @staticmethod
    def _values(fmt: QuantFormat, g, mask, lo, hi) -> torch.Tensor:
        """Decoded values of the grouped ``g`` (the oracle's ``_choose_params``, then encode and
        decode; for an MSE clip the values of the best ratio are kept from the search)."""
        if not isinstance(fmt.clip, MSEClip):
            s, m = _params(fmt, lo, hi)
            return _decode(fmt, _encode(fmt, g, s, m), s, m)
        best_v = best_err = None
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        for r in fmt.clip.ratios():
            if fmt.symmetric or fmt.is_fp8:
                s, m = _params(fmt, -hi * r, hi * r)
            else:
                s, m = _params(fmt, mid - half * r, mid + half * r)
            v = _decode(fmt, _encode(fmt, g, s, m), s, m)
            sq = (v - g).double() ** 2
            err = (sq if mask is None else sq.masked_fill(~mask, 0.0)).sum(-1)
            if best_err is None:
                best_v, best_err = v, err
                continue
            better = err < best_err  # strict: ties keep the larger ratio, as the oracle
            best_err = torch.where(better, err, best_err)
            best_v = torch.where(better[..., None], v, best_v)
        return best_v
