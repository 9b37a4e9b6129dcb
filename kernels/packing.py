"""Packed codes of per-channel widths: one piece of a code, shared by the store and decode kernels.

``@triton.jit`` code only. A layout word (:func:`kverr.gpu.spec.mixed_layout`, which derives the
words from the oracle's packing) is ``index | shift << 16 | mask << 20 | lshift << 28``.
"""

import triton
import triton.language as tl  # noqa: F401  (the interpreter requires it in a jit function's module)


@triton.jit
def piece(w, x):
    """``((x >> shift) & mask) << lshift`` of the int32 tile ``x [N, M]`` with the fields of the
    layout words ``w [M]`` (one per column)."""
    return ((x >> ((w >> 16) & 15)[None, :]) & ((w >> 20) & 255)[None, :]) << ((w >> 28) & 15)[None, :]


@triton.jit
def top_code(wa, wb):
    """Largest code ``2**width - 1`` of each channel from its two layout words (0 for width 0)."""
    return (((wa >> 20) & 255) << ((wa >> 28) & 15)) | (((wb >> 20) & 255) << ((wb >> 28) & 15))

