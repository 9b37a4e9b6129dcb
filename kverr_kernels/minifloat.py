"""Small floats as integer bit patterns: fp8/fp4 codes and the one-byte scales (``@triton.jit`` only).

Shared by the store and decode kernels. Everything is integer arithmetic and exact fp32
products by powers of two, so no hardware fp8/fp4 conversion is needed (sm_80 compiles them) and
the interpreter runs them:

* :func:`minifloat_bits`: the bit pattern of an fp32 value in a small float format, rounded to
  nearest even (fp8 e4m3, e5m2, fp4 e2m1), the oracle's casts;
* :func:`e4m3_value`, :func:`fp4_value`: a pattern's fp32 value;
* :func:`scale_value`, :func:`scale_bits`: a stored scale's fp32 value from its pool entry, and
  the pool entry of an fp32 scale: the float dtypes as they are, fp8 e4m3 and e8m0 scales as
  their bytes (``SDT`` 3 and 4 of :mod:`kernels.quant_store`);
* :func:`byte_scale_up`, :func:`byte_scale_near`: an fp32 value rounded up or to nearest to an
  e4m3 or e8m0 scale, as the oracle's ``ceil_cast`` and ``near_cast`` do.
"""

import triton
import triton.language as tl

# 2**-127, e8m0's smallest value (its byte 0); an fp32 subnormal
_E8M0_MIN = tl.constexpr(5.877471754111438e-39)


@triton.jit
def rint(y):
    """fp32 ``|y| < 2**22`` rounded to an integer, ties to even: adding and subtracting 1.5 * 2**23."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def minifloat_bits(y, MBITS: tl.constexpr, EMIN: tl.constexpr, SIGN: tl.constexpr):
    """Bit pattern (int32) of fp32 ``y`` (finite, within the format's range) in a float format
    with ``MBITS`` mantissa bits and smallest normal exponent ``EMIN``, sign bit ``SIGN``; RNE.
    The IEEE sign of ``y`` is kept, so -0 has its sign bit, as the casts give it."""
    ybits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = ((ybits >> 23) & 0xFF) - 127  # floor(log2 |y|) for normal fp32; <= -127 otherwise
    E = tl.maximum(e, EMIN)
    # |y| / quantum, quantum = 2**(E - MBITS): a power-of-two scaling, exact in fp32.
    inv_q = ((MBITS - E + 127) << 23).to(tl.float32, bitcast=True)
    n = rint(a * inv_q).to(tl.int32)
    code = ((E - EMIN) << MBITS) + n  # also right when rounding carries into the next binade
    return tl.where(ybits < 0, code | SIGN, code)


@triton.jit
def e4m3_value(u):
    """fp32 value of the e4m3 byte ``u`` (int32): its fp16 bit pattern (exponent rebased by
    2**-8) times 256, exact."""
    h = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * 256.0


@triton.jit
def fp4_value(u):
    """fp32 value of the e2m1 code ``u`` (int32 in [0, 16)): its sign, exponent and mantissa bits
    placed in an fp16 pattern (exponent rebased by 2**-14; e2m1's subnormal 0.5 is fp16's
    subnormal 2**-15), times 2**14, exact; code 8 is -0."""
    h = (((u & 8) << 12) | ((u & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * 16384.0


@triton.jit
def scale_value(raw, SDT: tl.constexpr):
    """fp32 value of scales loaded from a pool of scale dtype ``SDT``."""
    if SDT == 3:
        return e4m3_value(raw.to(tl.int32))
    elif SDT == 4:
        b = raw.to(tl.int32)
        return tl.where(b == 0, _E8M0_MIN, (b << 23).to(tl.float32, bitcast=True))
    else:
        return raw.to(tl.float32)


@triton.jit
def scale_bits(s, SDT: tl.constexpr):
    """What a pool of scale dtype ``SDT`` stores for the fp32 scale ``s`` (a value of that dtype):
    the value itself, or the e4m3 / e8m0 byte."""
    if SDT == 3:
        return minifloat_bits(s, 3, -6, 0x80).to(tl.uint8)
    elif SDT == 4:
        return ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)  # 2**-127 (subnormal): 0
    else:
        return s


@triton.jit
def byte_scale_up(v, SDT: tl.constexpr):
    """Non-negative fp32 ``v`` rounded up to an e4m3 (``SDT`` 3) or e8m0 (4) scale, as fp32 (the
    oracle's ``ceil_cast``). Above the dtype's largest value the result is undefined (the oracle
    raises there)."""
    if SDT == 3:
        u = minifloat_bits(v, 3, -6, 0x80)
        r = e4m3_value(u)
        return tl.where(r < v, e4m3_value(u + 1), r)
    else:
        bits = v.to(tl.int32, bitcast=True)
        ex = (bits >> 23) & 0xFF
        # normal v: its binade's power of two if v is one, else the next; subnormal or zero v:
        # 2**-127 (byte 0) up to it, else 2**-126
        b = tl.where(ex > 0, ex + ((bits & 0x7FFFFF) != 0).to(tl.int32), (bits > 0x400000).to(tl.int32))
        return scale_value(b, 4)


@triton.jit
def byte_scale_near(v, SDT: tl.constexpr):
    """Non-negative fp32 ``v`` rounded to nearest as an e4m3 (``SDT`` 3) or e8m0 (4) scale, as fp32
    (the oracle's ``near_cast``): e4m3 ties to even and saturates at 448; e8m0 is the power of two
    nearest by the significand (``1.5 * 2**k`` and up go up), at least 2**-127."""
    if SDT == 3:
        return e4m3_value(minifloat_bits(tl.minimum(v, 448.0), 3, -6, 0x80))
    else:
        bits = v.to(tl.int32, bitcast=True)
        ex = (bits >> 23) & 0xFF
        b = tl.where(ex > 0, ex + ((bits & 0x7FFFFF) >= 0x400000).to(tl.int32), (bits >= 0x600000).to(tl.int32))
        return scale_value(b, 4)
