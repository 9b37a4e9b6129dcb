"""Bit packing of integer codes into bytes: the layout the reference store and the Triton
kernels share.

Codes are unsigned integers in ``[0, 2**bits)`` along the last axis (channels), ``n`` of them.

*Planar layout* for ``bits`` in {1, 2, 4}: ``k = 8 // bits`` codes share a byte and the row has
``P = ceil(n / k)`` bytes. Code ``i`` lives in byte ``i % P`` at bit offset ``bits * (i // P)``;
padding codes (``i >= n``) are zero. Unpacking bit slice ``j`` of the whole row therefore gives
the *contiguous* channels ``[j*P, (j+1)*P)``, so a kernel that loads a ``[tokens, P]`` tile of
bytes gets ``k`` contiguous channel slices with one shift and mask each, and multiplies them
with the matching slices of the query: no interleaving.

*3-bit* codes are bit-sliced: a 2-bit plane holding the low two bits (``ceil(n/4)`` bytes, planar
as above) followed by a 1-bit plane holding the high bit (``ceil(n/8)`` bytes). For ``n = 64``
that is 16 + 8 = 24 bytes, exactly 3 bits per code.

*8-bit* codes are one byte each.
"""

from __future__ import annotations

import torch

from kverr.exceptions import ConfigError, DTypeError, ShapeError

PACKED_BITS = (1, 2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in PACKED_BITS:
        raise ConfigError(f"bits={bits!r} cannot be packed; allowed: 1, 2, 3, 4, 8")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy in the packed layout."""
    _check_bits(bits)
    if n < 0:
        raise ShapeError(f"n={n} codes: must be non-negative")
    if bits == 8:
        return n
    if bits == 3:
        return -(-n // 4) + -(-n // 8)
    per_byte = 8 // bits
    return -(-n // per_byte)


def _pack_planar(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.shape[-1]
    per_byte = 8 // bits
    nbytes = -(-n // per_byte)
    padded = torch.zeros((*codes.shape[:-1], per_byte * nbytes), dtype=torch.uint8)
    padded[..., :n] = codes
    planes = padded.reshape(*codes.shape[:-1], per_byte, nbytes)
    out = torch.zeros((*codes.shape[:-1], nbytes), dtype=torch.uint8)
    for j in range(per_byte):
        # contiguous() first: shifts of strided uint8 views are ~100x slower on the CPU
        out |= planes[..., j, :].contiguous() << (bits * j)
    return out


def _unpack_planar(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    slices = [(packed >> (bits * j)) & mask for j in range(per_byte)]
    return torch.cat(slices, dim=-1)[..., :n]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes along the last axis.

    Parameters
    ----------
    codes
        ``[..., n]`` uint8 codes, each in ``[0, 2**bits)``.
    bits
        1, 2, 3, 4 or 8.

    Returns
    -------
    torch.Tensor
        ``[..., packed_nbytes(n, bits)]`` uint8.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise DTypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.ndim == 0:
        raise ShapeError("codes must have at least one axis (the packed one)")
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise ShapeError(f"a code {int(codes.max())} does not fit in {bits} bits")
    if bits == 8:
        return codes.clone()
    if bits == 3:
        return torch.cat([_pack_planar(codes & 3, 2), _pack_planar(codes >> 2, 1)], dim=-1)
    return _pack_planar(codes, bits)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., packed_nbytes(n, bits)]`` uint8 -> ``[..., n]`` uint8."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed codes must be uint8, got {packed.dtype}")
    expected = packed_nbytes(n, bits)
    if packed.shape[-1] != expected:
        raise ShapeError(
            f"packed codes have {packed.shape[-1]} bytes on the last axis; {n} codes of "
            f"{bits} bits take {expected}"
        )
    if bits == 8:
        return packed.clone()
    if bits == 3:
        lo_bytes = -(-n // 4)
        lo = _unpack_planar(packed[..., :lo_bytes], 2, n)
        hi = _unpack_planar(packed[..., lo_bytes:], 1, n)
        return lo | (hi << 2)
    return _unpack_planar(packed, bits, n)
