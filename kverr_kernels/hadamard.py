"""The Hadamard rotation of a tile's channels, as the oracle defines it (``@triton.jit`` only).

:func:`fwht` is :func:`kverr.quant.reference.hadamard_rotate` operation for operation: butterfly
stages ``h = 1, 2, ..., D/2`` (channels ``i`` and ``i + h`` of every block of ``2h`` become
``a + b`` and ``a - b``), then one multiply by the fp32 ``1/sqrt(D)``. Same fp32 additions in the
same order, so the store kernel's rotated values -- and therefore its codes -- equal the oracle's
bit for bit. The pairs are picked out of a ``[R, D/2h, 2, h]`` view with masked sums of two terms
(``0 + a`` and ``0 + b`` are exact), which needs no permutes or shared-memory shuffles beyond what
the reshapes imply.
"""

import triton
import triton.language as tl


@triton.jit
def fwht(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, SCALE: tl.constexpr):
    """Rotate the ``D`` channels of every row of the fp32 ``[R, D]`` tile ``x``."""
    j = tl.arange(0, 2)[None, None, :, None]
    for i in tl.static_range(LOG2D):
        x4 = tl.reshape(x, (R, D // (2 << i), 2, 1 << i))
        a = tl.sum(tl.where(j == 0, x4, 0.0), axis=2)
        b = tl.sum(tl.where(j == 1, x4, 0.0), axis=2)
        x = tl.reshape(tl.where(j == 0, (a + b)[:, :, None, :], (a - b)[:, :, None, :]), (R, D))
    return x * SCALE
