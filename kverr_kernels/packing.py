"""Packed codes of per-channel widths, as the layout words of :func:`kverr.gpu.spec.mixed_layout`
(derived from the oracle's packing) describe them; shared by the store and decode kernels.

``@triton.jit`` code only. A channel's *unpack word* is ``a_byte | b_byte << 8 | a_shift << 16 |
b_shift << 19 | a_mask << 22 | b_mask << 30`` (piece B: the third bit of a 3-bit code); a byte's
*pack words* are ``channel | shift << 16 | mask << 20 | lshift << 28``, one per piece it holds.
"""

import triton
import triton.language as tl  # noqa: F401  (the interpreter requires it in a jit function's module)


@triton.jit
def piece(w, x):
    """``((x >> shift) & mask) << lshift`` of the int32 tile ``x [N, M]`` with the fields of the
    layout words ``w [M]`` (one per column)."""
    return ((x >> ((w >> 16) & 15)[None, :]) & ((w >> 20) & 255)[None, :]) << ((w >> 28) & 15)[None, :]


@triton.jit
def byte_a(w):
    """The byte of the row holding piece A of each channel (unpack words ``w``)."""
    return w & 255


@triton.jit
def byte_b(w):
    """The byte holding piece B (the third bit of a 3-bit code; any byte when absent)."""
    return (w >> 8) & 255


@triton.jit
def code_of(w, ba, bb):
    """Codes (int32 ``[N, D]``) from the bytes ``ba = row[byte_a]`` and ``bb = row[byte_b]``."""
    return (((ba >> ((w >> 16) & 7)[None, :]) & ((w >> 22) & 255)[None, :])
            | (((bb >> ((w >> 19) & 7)[None, :]) & ((w >> 30) & 1)[None, :]) << 2))


@triton.jit
def top_code(w):
    """Largest code ``2**width - 1`` of each channel from its unpack word (0 for width 0)."""
    return ((w >> 22) & 255) | (((w >> 30) & 1) << 2)

