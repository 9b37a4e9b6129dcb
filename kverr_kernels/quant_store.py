"""Quantize-and-store: new (or flushed) K/V tokens -> codes and scales in the pages of a paged cache.

``@triton.jit`` code only; the launcher is :mod:`kverr.gpu.launch`. Every number follows the
oracle, :mod:`kverr.quant.reference`, bit for bit:

* the codes' divisions are ``div_rn`` (IEEE round-to-nearest fp32; Triton's ``/`` is an
  approximate division on the GPU); the scales' ``div_ru``/``sub_ru`` (rounded toward +inf) go
  through float64 exactly as the oracle does (one float64 op per scale, not per element);
* scales are rounded *up* and zero points *down* to the scale dtype (``_ceil_cast`` /
  ``_floor_cast``: round-to-nearest, then one ulp step through the integer bit pattern);
* round-half-to-even is the add-and-subtract of 1.5 * 2**23 (exact for the clamped, small
  values it sees, and free of libdevice so the interpreter runs it too);
* fp8 and fp4 bit patterns, and the one-byte scales (fp8 e4m3, e8m0), are produced with integer
  arithmetic (round-to-nearest-even; :mod:`kernels.minifloat`), so the kernel needs no hardware
  fp8 conversion and compiles for sm_80 as well as sm_90;
* a Hadamard-rotated format rotates the tile with :func:`kernels.hadamard.fwht`, the oracle's
  butterflies in the oracle's order;
* an MSE clip (``CLIP_N`` ratios in ``RATIOS``, fp32, largest first) tries every ratio on every
  block as the oracle does -- the clip range ``[-hi r, hi r]`` or ``mid -+ half r``, the outward
  scale, the codes, their decoded values -- and keeps the first ratio of least squared error,
  summed in float64 over the block. The launch turns fp contraction off (``enable_fp_fusion``),
  so ``u * s + m`` rounds twice, as in the oracle;
* per-channel widths (``BITS`` 0, static channel scales) clamp each channel to its own levels
  and pack each byte of the row from the pieces its ``PACK`` words name (``tl.gather`` along the
  channels), the layout the oracle's ``pack_codes`` defines (:func:`kverr.gpu.spec.mixed_layout`);
* codebooks read their table from ``LAY`` (fp32 bit patterns: the ``2**BITS`` levels, the
  boundaries, the top level; :func:`kverr.gpu.spec.codebook_table`): a code is the number of
  boundaries below ``div_rn(x, s)``; an absmax scale is ``amax / top`` rounded up through
  float64, an rms scale the float64 root mean square (an IEEE float64 square root) rounded up to fp32 and to
  the scale dtype, the float64 sum's order being the one thing not the oracle's (a flip needs a
  root mean square within 1e-16 of an fp32 rounding boundary).
* keys rounded with compensation (``COMP``; integer formats, :mod:`kverr.quant.compensated`)
  keep the scales above and choose each row's codes by the sequential rule: the row gathered into
  its factor's channel order (``ORD``), then value by value encoded and decoded as the format
  does, its float64 error divided by ``U_kk`` times row ``k`` of the row's factor ``U``
  (``COMP_U``) subtracted from the values after it, the codes gathered back -- the oracle's
  operations in the oracle's order, a product and a difference each rounded (no contraction).

Constexpr format codes (shared with :mod:`kernels.decode` and :mod:`kverr.gpu.spec`):
``KIND`` 0 = int symmetric, 1 = int asymmetric, 2 = fp8 e4m3, 3 = fp8 e5m2, 4 = plain float,
5 = codebook with absmax scales, 6 = codebook with rms scales, 7 = fp4 e2m1;
``SDT`` (scale dtype) 0 = fp32, 1 = fp16, 2 = bf16, 3 = fp8 e4m3, 4 = e8m0 (3 and 4 are stored as
their bytes in uint8 pools); ``GRAN`` 0 = one scale per row (token,
token group), 1 = one scale over all rows of the job (channel groups of tokens, page),
2 = static (scales given).
"""

import triton
import triton.language as tl

from kverr_kernels.hadamard import fwht
from kverr_kernels.minifloat import (byte_scale_near, byte_scale_up, e4m3_value, fp4_value, minifloat_bits,
                                     scale_bits, scale_value)
from kverr_kernels.minifloat import rint as _rint
from kverr_kernels.packing import piece, top_code


@triton.jit
def _cast_step(v, SDT: tl.constexpr, UP: tl.constexpr):
    """fp32 ``v`` rounded up (``UP``) or down to the scale dtype, returned as fp32 (exact); the
    one-byte dtypes (``SDT`` 3, 4) only up (they hold scales, never a zero point)."""
    if SDT == 0:
        return v
    if SDT >= 3:
        tl.static_assert(UP, "one-byte scale dtypes round up only")
        return byte_scale_up(v, SDT)
    if SDT == 1:
        r = v.to(tl.float16)
    else:
        r = v.to(tl.bfloat16)
    rf = r.to(tl.float32)
    bits = r.to(tl.int16, bitcast=True).to(tl.int32)
    if UP:
        wrong = rf < v
        # one ulp towards +inf: magnitude up for positives, down for negatives, +0 -> +tiny.
        nb = tl.where(rf > 0, bits + 1, tl.where(rf == 0, 1, bits - 1))
    else:
        wrong = rf > v
        nb = tl.where(rf > 0, bits - 1, tl.where(rf == 0, 0x8001, bits + 1))
    if SDT == 1:
        stepped = nb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        stepped = nb.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return tl.where(wrong, stepped, rf)


@triton.jit
def _round_to(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in dtype ``DT`` (fp16, bf16 or fp32), as fp32."""
    if DT == tl.bfloat16:
        # by hand: the interpreter's fp32 -> bf16 cast truncates
        xb = x.to(tl.int32, bitcast=True)
        r = ((xb + 0x7FFF + ((xb >> 16) & 1)) >> 16) << 16
        return r.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _cast_near(v, SDT: tl.constexpr):
    """fp32 ``v`` (>= 0 for the one-byte dtypes) rounded to nearest in the scale dtype, as fp32
    (the oracle's ``near_cast``): ties to even; the one-byte dtypes as :func:`byte_scale_near`."""
    if SDT == 0:
        return v
    elif SDT == 1:
        return _round_to(v, tl.float16)
    elif SDT == 2:
        return _round_to(v, tl.bfloat16)
    else:
        return byte_scale_near(v, SDT)


@triton.jit
def _lut(LUT, i):
    """Entry ``i`` of a codebook table (fp32 stored as its int32 bit pattern)."""
    return tl.load(LUT + i).to(tl.float32, bitcast=True)


@triton.jit
def _quot(x, s_div, ARITH: tl.constexpr):
    """``x / s`` in fp32 (IEEE division), or with the reciprocal option (``ARITH & 2``)
    ``x * (1 / s)``, two roundings, as the oracle's ``reciprocal``."""
    if ARITH & 2:
        return x * tl.math.div_rn(tl.full(s_div.shape, 1.0, tl.float32), s_div)
    else:
        return tl.math.div_rn(x, s_div)


@triton.jit
def _round_int(y, ARITH: tl.constexpr):
    """Integer codes (int32) of the clamped fp32 ``y``: half to even, or half away from zero
    (``ARITH & 4``: ``trunc(y ± 0.5)``, the addition in fp32)."""
    if ARITH & 4:
        return (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int32)  # the conversion truncates
    else:
        return _rint(y).to(tl.int32)


@triton.jit
def _encode(x, s, m, LUT, KIND: tl.constexpr, BITS: tl.constexpr, ARITH: tl.constexpr):
    """Codes (int32) of fp32 ``x`` with stored scale ``s`` and zero ``m`` (fp32, broadcast);
    codebooks: their table ``LUT``."""
    s_div = tl.where(s > 0, s, 1.0)
    if KIND == 5 or KIND == 6:
        NLEV: tl.constexpr = 1 << BITS
        y = _quot(x, s_div, ARITH)
        u = (y > _lut(LUT, NLEV)).to(tl.int32)
        for i in tl.static_range(1, NLEV - 1):
            u += (y > _lut(LUT, NLEV + i)).to(tl.int32)
        return u
    elif KIND == 0:
        L: tl.constexpr = (1 << (BITS - 1)) - 1
        y = _quot(x, s_div, ARITH)
        y = tl.minimum(tl.maximum(y, -L), L)
        return _round_int(y, ARITH) + (1 << (BITS - 1))
    elif KIND == 1:
        L2: tl.constexpr = (1 << BITS) - 1
        y = _quot(x - m, s_div, ARITH)
        y = tl.minimum(tl.maximum(y, 0.0), L2)
        return _round_int(y, ARITH)
    elif KIND == 2:
        y = _quot(x, s_div, ARITH)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        return minifloat_bits(y, 3, -6, 0x80)
    elif KIND == 7:
        y = _quot(x, s_div, ARITH)
        y = tl.minimum(tl.maximum(y, -6.0), 6.0)
        return minifloat_bits(y, 1, 0, 0x8)
    else:
        y = _quot(x, s_div, ARITH)
        y = tl.minimum(tl.maximum(y, -57344.0), 57344.0)
        return minifloat_bits(y, 2, -14, 0x80)


@triton.jit
def _ceil_f32(v64):
    """float64 ``v64`` rounded up to fp32 (exact: one ulp step through the bit pattern)."""
    r = v64.to(tl.float32)
    bits = r.to(tl.int32, bitcast=True)
    nb = tl.where(r > 0, bits + 1, tl.where(r == 0, 1, bits - 1))
    return tl.where(r.to(tl.float64) < v64, nb.to(tl.float32, bitcast=True), r)


@triton.jit
def _div_ru(a, den):
    """fp32 ``a / den`` rounded toward +inf (CUDA ``__fdiv_ru``), through float64 as the oracle
    does: the float64 quotient of two fp32 numbers is never within float64 rounding of an fp32
    value it does not equal."""
    return _ceil_f32(a.to(tl.float64) / den)


@triton.jit
def _sub_ru(a, b):
    """fp32 ``a - b`` rounded toward +inf (``__fsub_ru``); the float64 difference is exact."""
    return _ceil_f32(a.to(tl.float64) - b.to(tl.float64))


@triton.jit
def _top(LUT, KIND: tl.constexpr, BITS: tl.constexpr):
    """The fp32 value the range's top maps to: the largest code or level magnitude."""
    if KIND == 5:
        return _lut(LUT, 2 * (1 << BITS) - 1)
    elif KIND == 0:
        return ((1 << (BITS - 1)) - 1) * 1.0
    elif KIND == 1:
        return ((1 << BITS) - 1) * 1.0
    elif KIND == 2:
        return 448.0
    elif KIND == 7:
        return 6.0
    else:
        return 57344.0


@triton.jit
def _params(lo, hi, LUT, KIND: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr, ARITH: tl.constexpr,
            SFLOOR):
    """Stored (scale, zero) as fp32 for the block range ``[lo, hi]`` (``hi`` = amax if symmetric).

    ``top`` is the largest code or level magnitude (:func:`_top`). Every rounding on the way to a
    scale goes up and the zero point goes down (the oracle's ``ceil(div_ru(sub_ru(hi, m), top))``),
    so the grid covers the block. With nearest scales (``ARITH & 1``) the zero point is ``lo`` and the scale ``(hi - m) / top``,
    fp32 operations and the casts to nearest. ``SFLOOR`` (fp32, 0 for none) raises the fp32
    scale before its cast. With ``ARITH & 8`` (codes from the fp32 metadata) the pair is
    ``((hi - lo) / top, lo)`` before any cast: the codes' pair, which :func:`_stored` rounds
    for the pools."""
    top = _top(LUT, KIND, BITS)
    if ARITH & 8:
        if KIND == 1:
            m = lo
            span = hi - lo
        else:
            m = hi * 0.0
            span = hi
        s = tl.maximum(tl.math.div_rn(span, top), SFLOOR)
    elif ARITH & 1:
        if KIND == 1:
            m = _cast_near(lo, SDT)
            span = hi - m
        else:
            m = hi * 0.0
            span = hi
        s = _cast_near(tl.maximum(tl.math.div_rn(span, top), SFLOOR), SDT)
    else:
        if KIND == 1:
            m = _cast_step(lo, SDT, False)
            span = _sub_ru(hi, m)
        else:
            m = hi * 0.0
            span = hi
        s = _cast_step(tl.maximum(_div_ru(span, top), SFLOOR), SDT, True)
    return s, m


@triton.jit
def _stored(v, SDT: tl.constexpr, ARITH: tl.constexpr):
    """The scale or zero point a pool holds for the pair :func:`_params` gave: ``v`` itself, or
    with codes from the fp32 metadata (``ARITH & 8``) ``v`` rounded to nearest in the scale dtype."""
    if ARITH & 8:
        return _cast_near(v, SDT)
    else:
        return v


@triton.jit
def _decode(u, s, m, LUT, KIND: tl.constexpr, BITS: tl.constexpr):
    """fp32 values of int32 codes ``u`` (the oracle's ``decode_blocks``: one rounding per multiply and
    per add)."""
    if KIND == 5 or KIND == 6:
        return _lut(LUT, u) * s
    elif KIND == 0:
        return (u - (1 << (BITS - 1))).to(tl.float32) * s
    elif KIND == 1:
        return u.to(tl.float32) * s + m
    elif KIND == 2:
        return e4m3_value(u) * s
    elif KIND == 7:
        return fp4_value(u) * s
    else:
        h = (u << 8).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32) * s


@triton.jit
def _sq_err(x3, s, m, LUT, KIND: tl.constexpr, BITS: tl.constexpr, ARITH: tl.constexpr):
    """float64 squared reconstruction error of every element (exact squares of fp32 differences)."""
    d = (_decode(_encode(x3, s, m, LUT, KIND, BITS, ARITH), s, m, LUT, KIND, BITS) - x3).to(tl.float64)
    return d * d


@triton.jit
def _rms_scale(x3, r3, SDT: tl.constexpr, PER_ROW: tl.constexpr, ARITH: tl.constexpr, SFLOOR):
    """The rms scale of every block of the ``[R, NG, BD]`` tile, rounded up to fp32 and to the scale
    dtype: per (row, group) (``PER_ROW``), or per group over the valid rows ``r3``; float64 sums of
    the exact squares, as the oracle's ``rms_params``."""
    x64 = x3.to(tl.float64)
    sq = x64 * x64
    BD: tl.constexpr = x3.shape[2]
    if PER_ROW:
        ms = tl.sum(sq, axis=2) / BD
    else:
        n = tl.maximum(tl.sum(tl.where(r3, 1.0, 0.0)), 1.0).to(tl.float64) * BD  # the block's real elements
        ms = tl.sum(tl.sum(tl.where(r3, sq, 0.0), axis=2), axis=0) / n
    # float64 square roots are IEEE round-to-nearest on the GPU (PTX has no approximate one)
    if ARITH & 1:
        s = _cast_near(tl.maximum(tl.sqrt(ms).to(tl.float32), SFLOOR), SDT)
    else:
        s = _cast_step(tl.maximum(_ceil_f32(tl.sqrt(ms)), SFLOOR), SDT, True)
    return s


@triton.jit
def _clip_params(lo, hi, r, LUT, KIND: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr,
                 ARITH: tl.constexpr, SFLOOR):
    """(scale, zero) of the block range shrunk by ratio ``r`` (the oracle's MSE candidates)."""
    if KIND == 1:
        mid = (hi + lo) * 0.5
        half = (hi - lo) * 0.5
        return _params(mid - half * r, mid + half * r, LUT, KIND, BITS, SDT, ARITH, SFLOOR)
    return _params(-(hi * r), hi * r, LUT, KIND, BITS, SDT, ARITH, SFLOOR)



@triton.jit
def _block_err(x3, s, m, r3, LUT, KIND: tl.constexpr, BITS: tl.constexpr, PER_ROW: tl.constexpr,
               ARITH: tl.constexpr):
    """float64 squared error of each block of the ``[R, NG, BD]`` tile: per (row, group) with
    ``s, m [R, NG]`` (``PER_ROW``), or per group over the valid rows ``r3`` with ``s, m [NG]``."""
    # one return: the compiler types every return of a function, constexpr branches included
    if PER_ROW:
        err = tl.sum(_sq_err(x3, s[:, :, None], m[:, :, None], LUT, KIND, BITS, ARITH), axis=2)
    else:
        err = tl.sum(tl.sum(tl.where(r3, _sq_err(x3, s[None, :, None], m[None, :, None], LUT, KIND, BITS, ARITH), 0.0),
                            axis=2), axis=0)
    return err


@triton.jit
def _choose_params(x3, lo, hi, r3, RATIOS, LUT, CLIP_N: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                   SDT: tl.constexpr, PER_ROW: tl.constexpr, ARITH: tl.constexpr, SFLOOR):
    """Stored (scale, zero) of every block: the range ``[lo, hi]`` (absmax), the root mean square
    (rms codebooks), or with an MSE clip the first of the ``CLIP_N`` ratios of least squared error
    (the oracle's ``mse_search``)."""
    if KIND == 6:
        s = _rms_scale(x3, r3, SDT, PER_ROW, ARITH, SFLOOR)
        m = s * 0.0
    elif CLIP_N == 0:
        s, m = _params(lo, hi, LUT, KIND, BITS, SDT, ARITH, SFLOOR)
    else:
        s, m = _clip_params(lo, hi, tl.load(RATIOS), LUT, KIND, BITS, SDT, ARITH, SFLOOR)
        err = _block_err(x3, s, m, r3, LUT, KIND, BITS, PER_ROW, ARITH)
        for i in range(1, CLIP_N):
            s_i, m_i = _clip_params(lo, hi, tl.load(RATIOS + i), LUT, KIND, BITS, SDT, ARITH, SFLOOR)
            e_i = _block_err(x3, s_i, m_i, r3, LUT, KIND, BITS, PER_ROW, ARITH)
            better = e_i < err  # strict: ties keep the larger ratio
            err = tl.where(better, e_i, err)
            s = tl.where(better, s_i, s)
            m = tl.where(better, m_i, m)
    return s, m


@triton.jit
def quant_store_kernel(
    X, sx_n, sx_h,  # new tokens [N, H, D] (any float dtype)
    FP, sf_b, sf_h, sf_t,  # full-precision buffer [slots, h, sinks + cap, D] of this head group
    FPS, sfs_b, sfs_h,  # FP_Q: the fp16 scale of each int8 row of FP [slots, h, sinks + cap]
    XS, sxs_n, sxs_h,  # FP_Q: the fp16 scale of each new row [N, H] (X then holds its int8 codes)
    HEADS,  # [h] int32: global kv head of each local head
    JOB_PAGE, JOB_ROW0, JOB_NROWS, JOB_B,  # [J] int32
    SRC_NEW, SRC_SLOT,  # [J, BLOCK_R] int32: row of X, or slot of FP, or -1
    CODES, sc_p, sc_h,  # code pool [pages, h, P, CB] (uint8, or the float dtype)
    SCALE, ZERO, ss_p, ss_h,  # scale pools [pages, h, P // BT_S, NSD] or static [h, NSD]
    RATIOS,  # [CLIP_N] fp32 clip ratios of an MSE clip, largest first (unused if CLIP_N == 0)
    LAY, PACK, cb,  # BITS == 0: the layout words of per-channel widths, [D] and [8, D] int32, and
    # the bytes of a code row (CB is 0 then: one specialisation serves every layout of widths);
    # codebooks (KIND 5, 6): LAY is their table (int32 bit patterns of fp32), PACK unread
    SFLOOR,  # fp32 scale floor (0: none)
    # COMP: the factor U of each job row (fp64, element (k, p) at k * cu_k + p * cu_p from the
    # row's offset j * cu_j + r * cu_r + b * cu_b + hl * cu_h) and its channel order and inverse
    # (int32, [2D] at j * co_j + r * co_r + b * co_b + hl * co_h: the order, then the position of
    # each channel in it); unread otherwise
    COMP_U, cu_j, cu_r, cu_b, cu_h, cu_k, cu_p,
    COMP_ORD, co_j, co_r, co_b, co_h,
    D: tl.constexpr, CB: tl.constexpr, BLOCK_R: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr,
    GRAN: tl.constexpr, BD: tl.constexpr, BT_S: tl.constexpr,
    ROT: tl.constexpr, LOG2D: tl.constexpr, RSCALE: tl.constexpr, CLIP_N: tl.constexpr,
    FP_Q: tl.constexpr, ARITH: tl.constexpr, COMP: tl.constexpr,
):
    """One program quantizes the rows of one job (consecutive tokens of one page) for one head.

    ``FP_Q``: the window is int8 (one biased int8 row per slot, its fp16 scale in ``FPS``), and
    the new rows arrive as the cache receives them (:func:`kverr.quant.store.receive`): ``X``
    holds their biased int8 codes and ``XS`` their fp16 scales, as a launch of this kernel with
    the window's int8 format wrote them.

    Grid ``(J, h)``.
    """
    j = tl.program_id(0)
    hl = tl.program_id(1)
    hg = tl.load(HEADS + hl)
    page = tl.load(JOB_PAGE + j).to(tl.int64)
    row0 = tl.load(JOB_ROW0 + j)
    nrows = tl.load(JOB_NROWS + j)
    b = tl.load(JOB_B + j).to(tl.int64)

    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, D)
    rmask = r < nrows
    src_new = tl.load(SRC_NEW + j * BLOCK_R + r, mask=rmask, other=-1)
    src_slot = tl.load(SRC_SLOT + j * BLOCK_R + r, mask=rmask, other=-1)
    from_x = src_new >= 0
    from_fp = src_slot >= 0
    xa = tl.load(
        X + src_new.to(tl.int64)[:, None] * sx_n + hg * sx_h + c[None, :],
        mask=from_x[:, None], other=0.0,
    ).to(tl.float32)
    xb = tl.load(
        FP + b * sf_b + hl * sf_h + src_slot.to(tl.int64)[:, None] * sf_t + c[None, :],
        mask=from_fp[:, None], other=0,
    ).to(tl.float32)
    if FP_Q:
        # int8 rows, new or from the window: the oracle's decode, (u - 128) * s, exact in fp32
        sa = tl.load(XS + src_new.to(tl.int64) * sxs_n + hg * sxs_h, mask=from_x, other=0.0)
        sb = tl.load(FPS + b * sfs_b + hl * sfs_h + src_slot.to(tl.int64), mask=from_fp, other=0.0)
        x = tl.where(from_x[:, None], (xa - 128.0) * sa.to(tl.float32)[:, None],
                     (xb - 128.0) * sb.to(tl.float32)[:, None])
    else:
        # the cache receives K/V in its own dtype (the window dtype of FP), as the oracle does
        x = tl.where(from_x[:, None], _round_to(xa, FP.dtype.element_ty), xb)

    rows = (row0 + r).to(tl.int64)
    # COMP: each row's factor and order
    r64 = r.to(tl.int64)
    u_off = j.to(tl.int64) * cu_j + r64 * cu_r + b * cu_b + hl.to(tl.int64) * cu_h
    o_off = j.to(tl.int64) * co_j + r64 * co_r + b * co_b + hl.to(tl.int64) * co_h
    code_base = CODES + page * sc_p + hl * sc_h + rows[:, None] * CB
    if KIND == 4:
        if CODES.dtype.element_ty == tl.bfloat16:
            # round-to-nearest-even by hand: the interpreter's fp32 -> bf16 cast truncates
            xb32 = x.to(tl.int32, bitcast=True)
            rne = (xb32 + 0x7FFF + ((xb32 >> 16) & 1)) >> 16
            tl.store(code_base + c[None, :], rne.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=rmask[:, None])
        else:
            tl.store(code_base + c[None, :], x.to(CODES.dtype.element_ty), mask=rmask[:, None])
    else:
        if ROT:
            x = fwht(x, BLOCK_R, D, LOG2D, RSCALE)
        if BITS == 0:
            _quant_rows_mixed(x, rmask, rows, CODES + page * sc_p + hl * sc_h, c, SCALE + hl * ss_h,
                              ZERO + hl * ss_h, LAY, PACK, cb, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off,
                              D, BLOCK_R, COMP)
        else:
            _quant_rows(x, rmask, rows, code_base, c, SCALE + page * ss_p + hl * ss_h, ZERO + page * ss_p + hl * ss_h,
                        SCALE + hl * ss_h, ZERO + hl * ss_h, row0, RATIOS, LAY, SFLOOR,
                        COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off,
                        D, BLOCK_R, KIND, BITS, SDT, GRAN, BD, BT_S, CLIP_N, ARITH, COMP)


@triton.jit
def _quant_rows(x, rmask, rows, code_base, c, scale_base, zero_base, static_s, static_z, row0, RATIOS, LUT,
                SFLOOR, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off, D: tl.constexpr, BLOCK_R: tl.constexpr,
                KIND: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr, GRAN: tl.constexpr, BD: tl.constexpr,
                BT_S: tl.constexpr, CLIP_N: tl.constexpr, ARITH: tl.constexpr, COMP: tl.constexpr):
    """Scales, codes and packing of a ``[BLOCK_R, D]`` tile (integer, fp8 and codebook formats)."""

    NG: tl.constexpr = D // BD
    g = tl.arange(0, NG)
    x3 = tl.reshape(x, (BLOCK_R, NG, BD))
    SYM: tl.constexpr = KIND != 1
    if GRAN == 0:
        # one scale per (row, channel group)
        if SYM:
            hi = tl.max(tl.abs(x3), axis=2)
            lo = -hi
        else:
            lo = tl.min(x3, axis=2)
            hi = tl.max(x3, axis=2)
        s, m = _choose_params(x3, lo, hi, rmask[:, None, None], RATIOS, LUT, CLIP_N, KIND, BITS, SDT, True,
                              ARITH, SFLOOR)
        u3 = _encode(x3, s[:, :, None], m[:, :, None], LUT, KIND, BITS, ARITH)
        soff = rows[:, None] * NG + g[None, :]
        tl.store(scale_base + soff, scale_bits(_stored(s, SDT, ARITH), SDT), mask=rmask[:, None])
        if KIND == 1:
            tl.store(zero_base + soff, _stored(m, SDT, ARITH), mask=rmask[:, None])
    else:
        if GRAN == 1:
            # one scale per channel group over all rows of the job (a whole token block)
            r3 = rmask[:, None, None]
            if SYM:
                hi = tl.max(tl.max(tl.where(r3, tl.abs(x3), 0.0), axis=2), axis=0)
                lo = -hi
            else:
                lo = tl.min(tl.min(tl.where(r3, x3, float("inf")), axis=2), axis=0)
                hi = tl.max(tl.max(tl.where(r3, x3, float("-inf")), axis=2), axis=0)
            s, m = _choose_params(x3, lo, hi, r3, RATIOS, LUT, CLIP_N, KIND, BITS, SDT, False, ARITH, SFLOOR)
            soff = (row0 // BT_S) * NG + g
            tl.store(scale_base + soff, scale_bits(_stored(s, SDT, ARITH), SDT))
            if KIND == 1:
                tl.store(zero_base + soff, _stored(m, SDT, ARITH))
        else:
            # static: calibrated scales [h, NG]
            s = scale_value(tl.load(static_s + g), SDT)
            if KIND == 1:
                m = tl.load(static_z + g).to(tl.float32)
            else:
                m = s * 0.0
        u3 = _encode(x3, s[None, :, None], m[None, :, None], LUT, KIND, BITS, ARITH)
    if COMP:
        # the scales stay; the codes are the sequential rule's (``top``, for per-channel widths
        # only, is passed the group indices, unread)
        if GRAN == 0:
            u = _compensate(x, s, m, g, g, rmask, c, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off, LUT,
                            D, BD, BLOCK_R, KIND, BITS, ARITH, False)
        else:
            u = _compensate(x, s[None, :], m[None, :], g, g, rmask, c, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off,
                            LUT, D, BD, BLOCK_R, KIND, BITS, ARITH, False)
    else:
        u = tl.reshape(u3, (BLOCK_R, D))

    if BITS == 8:
        tl.store(code_base + c[None, :], u.to(tl.uint8), mask=rmask[:, None])
    elif BITS == 3:
        # bit-sliced: a planar 2-bit plane of D // 4 bytes, then a planar 1-bit plane of D // 8
        lo3 = tl.reshape(u & 3, (BLOCK_R, 4, D // 4))
        lo_b = tl.sum(lo3 << (tl.arange(0, 4) * 2)[None, :, None], axis=1)
        tl.store(code_base + tl.arange(0, D // 4)[None, :], lo_b.to(tl.uint8), mask=rmask[:, None])
        hi3 = tl.reshape(u >> 2, (BLOCK_R, 8, D // 8))
        hi_b = tl.sum(hi3 << tl.arange(0, 8)[None, :, None], axis=1)
        tl.store(code_base + D // 4 + tl.arange(0, D // 8)[None, :], hi_b.to(tl.uint8), mask=rmask[:, None])
    else:
        # planar: bit slice j of byte i holds channel j * PB + i
        K: tl.constexpr = 8 // BITS
        PB: tl.constexpr = D // K
        u3p = tl.reshape(u, (BLOCK_R, K, PB))
        packed = tl.sum(u3p << (tl.arange(0, K) * BITS)[None, :, None], axis=1)
        tl.store(code_base + tl.arange(0, PB)[None, :], packed.to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _quant_rows_mixed(x, rmask, rows, code_rows, c, static_s, static_z, LAY, PACK, cb, COMP_U, u_off, cu_k, cu_p,
                      COMP_ORD, o_off, D: tl.constexpr, BLOCK_R: tl.constexpr, COMP: tl.constexpr):
    """Codes and packing of a ``[BLOCK_R, D]`` tile of an asymmetric integer format with a width per
    channel and static channel scales: each channel clamps to its own ``2**width - 1`` (0 for a
    width-0 channel, whose scale is 0 and whose zero point is what it reads back), then each byte
    of the row gathers its pieces of codes from the tile (``PACK``, up to eight per byte)."""
    top = top_code(tl.load(LAY + c))
    s = tl.load(static_s + c).to(tl.float32)[None, :]
    m = tl.load(static_z + c).to(tl.float32)[None, :]
    if COMP:
        u = _compensate(x, s, m, top[None, :], c, rmask, c, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off, LAY,
                        D, 1, BLOCK_R, 1, 0, 0, True)
    else:
        u = _encode_mixed(x, s, m, top[None, :])
    packed = tl.zeros([BLOCK_R, D], dtype=tl.int32)  # byte c of the row in column c (a row has <= D bytes)
    for t in tl.static_range(8):
        w = tl.load(PACK + t * D + c)
        g = tl.gather(u, tl.broadcast_to((w & 0xFFFF)[None, :], (BLOCK_R, D)), 1)
        packed = packed | piece(w, g)
    tl.store(code_rows + rows[:, None] * cb + c[None, :], packed.to(tl.uint8), mask=rmask[:, None] & (c < cb)[None, :])


@triton.jit
def _encode_mixed(x, s, m, top):
    """Codes (int32) of an asymmetric format with a width per channel: ``x`` clamped to the
    channel's codes ``[0, top]`` (``top`` 0 for a width-0 channel: its scale is 0 and its zero
    point is what it reads back)."""
    y = tl.math.div_rn(x - m, tl.where(s > 0, s, 1.0))
    y = tl.minimum(tl.maximum(y, 0.0), top.to(tl.float32))
    return _rint(y).to(tl.int32)


@triton.jit
def _compensate(x, s, m, top, gi, rmask, c, COMP_U, u_off, cu_k, cu_p, COMP_ORD, o_off, LUT,
                D: tl.constexpr, BD: tl.constexpr, BLOCK_R: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                ARITH: tl.constexpr, MIXED: tl.constexpr):
    """Codes (int32 ``[BLOCK_R, D]``) of the tile ``x`` with the stored scales and zero points
    ``s, m`` ``[BLOCK_R or 1, D // BD]`` of its channel groups ``gi`` (and, ``MIXED``, the top
    codes ``top`` ``[1, D]``, ``BD`` 1), chosen by the sequential rule of
    :mod:`kverr.quant.compensated`: the row's compensated values are float64, held in the row's
    channel order (``ORD``: one gather); step ``k`` encodes the ``k``-th, channel ``ORD[k]``, from
    its value cast to fp32 and subtracts its error ``(w - decoded) / U[k, k]`` times row ``k`` of
    ``U`` from the values after it; the codes go back to channel order (one gather by the
    inverse). Selecting one value of each row sums one element with zeros: exact."""
    order = tl.load(COMP_ORD + o_off[:, None] + c[None, :], mask=rmask[:, None], other=0)
    w = tl.gather(x, order, 1).to(tl.float64)
    u = tl.zeros([BLOCK_R, D], dtype=tl.int32)
    for k in range(D):
        ch = tl.load(COMP_ORD + o_off + k, mask=rmask, other=0)
        sel = c[None, :] == k
        wk = tl.sum(tl.where(sel, w, 0.0), axis=1)
        gsel = gi[None, :] == (ch // BD)[:, None]
        sk = tl.sum(tl.where(gsel, s, 0.0), axis=1)
        mk = tl.sum(tl.where(gsel, m, 0.0), axis=1)
        v = wk.to(tl.float32)
        if MIXED:
            tk = tl.sum(tl.where(gsel, top, 0), axis=1)
            uk = _encode_mixed(v, sk, mk, tk)
            back = uk.to(tl.float32) * sk + mk
        else:
            uk = _encode(v, sk, mk, LUT, KIND, BITS, ARITH)
            back = _decode(uk, sk, mk, LUT, KIND, BITS)
        ukk = tl.load(COMP_U + u_off + k * cu_k + k * cu_p, mask=rmask, other=1.0)
        err = (wk - back.to(tl.float64)) / ukk
        urow = tl.load(COMP_U + u_off[:, None] + k * cu_k + c[None, :] * cu_p, mask=rmask[:, None] & (c > k)[None, :],
                       other=0.0)
        w = tl.where((c > k)[None, :], w - err[:, None] * urow, w)
        u = tl.where(sel, uk[:, None], u)
    inv = tl.load(COMP_ORD + o_off[:, None] + D + c[None, :], mask=rmask[:, None], other=0)
    return tl.gather(u, inv, 1)
