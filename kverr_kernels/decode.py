"""Decode attention over a paged, quantized KV cache, dequantizing inside the loads.

``@triton.jit`` code only; the launcher is :mod:`kverr.gpu.launch`.

Flash-decoding: the quantized tokens of each sequence are split into ``NS`` chunks; program
``(b, kv_head, split)`` runs an online softmax over its chunk for every query head that reads
``kv_head`` (grouped-query attention: the ``REP`` query heads of one kv head form the rows of one
tile, so K/V bytes are read once per kv head) and writes a partial ``(max, sum, acc)``. A second
launch (``TAIL``) covers the tokens held in full precision -- sinks and the window -- plus the
tokens that are quantized for one of K/V but not yet for the other (their token blocks or their
windows, ``WIN_K``/``WIN_V``, differ: each side's quantized region ends at its own ``end_k``/``end_v``),
choosing per row between the paged codes and the full-precision buffer (a side's ring of
``CAP = window + token block`` slots holds every token past its region's end). :func:`merge_kernel`
combines the ``NS + 1`` partials of each query head, and a learned sink logit per query head
(gpt-oss) where the model has them: one more softmax term without a value.

Sliding-window layers (``SLIDE``, window ``LWIN``): a query at position ``p`` sees the tokens
``p − LWIN < t ≤ p`` (transformers' rule). The main launch starts each split at the first token
its queries can see; the masks handle the rest, and a row that has seen no token yet keeps a
finite running maximum, as in the causal prefill.

Salient tokens (``K_SAL``/``V_SAL``: the pool keeps salient rows, ``NSAL`` of them per sequence
and kv head, positions in ``KSP``/``VSP``, -1 where none): the main launch masks them out of its
chunks and the tail attends to them from their rows (slot ``SINKS + CAP + j`` of the full-precision
buffer, after the window's ring), or from the pages for the side (K or V) whose format keeps
none (a float format: its pages hold the value itself); one not yet quantized (the prompt's
newest tokens, ``salient_recent``) is read from the window's ring instead, once.

Format constexprs (``K_*`` for keys, ``V_*`` for values) follow :mod:`kernels.quant_store`:
``KIND`` 0 int sym, 1 int asym, 2 fp8 e4m3, 3 fp8 e5m2, 4 plain float, 5 and 6 codebook (its
levels read from ``KL``/``VL``), 7 fp4 e2m1; ``SDT`` the scale dtype (3, 4: fp8 e4m3 and e8m0
bytes); ``BITS``; ``BD`` channels
per scale column; ``BTS`` token rows per scale row; ``STATIC`` scales are ``[h, D // BD]``;
``ROT`` codes of the Hadamard-rotated head dimension; ``BITS`` 0 a width per channel, where each
channel's code sits given by one unpack word per channel (``KL``/``VL``, loaded once per program;
a row's bytes are loaded in a tile of ``D``, which no row of widths up to 8 bits exceeds).

Rotated formats cost no per-row work in the main launch: ``q·k = (qH)·(kH)``, so the query tile
is rotated once for rotated keys, and ``Σ p (vH) = (Σ p v) H``, so the value accumulator is
rotated back once at the end for rotated values (``H`` is symmetric and orthogonal; online-softmax
rescaling commutes with it). The tail, which mixes full-precision rows with quantized ones,
rotates its dequantized rows back instead.

Keys stored before RoPE (``K_PRE``) are rotated to their positions after dequantization, per row:
``k cos_t + rotate_half(k) sin_t`` with the ``[T, D/2]`` tables ``COS``/``SIN`` (transformers'
half-rotation convention, full rotary dimension: a row's two halves share their frequencies, so the
tables hold one half and channel ``c`` reads column ``c mod D/2``). A Hadamard rotation cannot then move to the
query (RoPE sits between), so rotated pre-RoPE keys are rotated back row by row.
"""

import triton
import triton.language as tl

from kverr_kernels.hadamard import fwht
from kverr_kernels.minifloat import e4m3_value, fp4_value, scale_value
from kverr_kernels.packing import byte_a, byte_b, code_of


@triton.jit
def _deq_tile(C, row_base, nmask, SC, ZP, srow, c, w, LUT,
              KIND: tl.constexpr, BITS: tl.constexpr, BD: tl.constexpr, D: tl.constexpr,
              CB, SDT: tl.constexpr):
    """Dequantized ``[N, D]`` fp32 tile; ``row_base``/``srow`` are per-row element offsets of the
    codes and of the scale row; the planar bytes are gathered per channel (the DRAM traffic is
    the packed bytes; the repeated addresses hit L1)."""
    m2 = nmask[:, None]
    if KIND == 4:
        x = tl.load(C + row_base[:, None] + c[None, :], mask=m2, other=0.0).to(tl.float32)
    else:
        x = _deq_codes(C, row_base, nmask, m2, SC, ZP, srow, c, w, LUT, KIND, BITS, BD, D, CB, SDT)
    return x


@triton.jit
def _deq_codes(C, row_base, nmask, m2, SC, ZP, srow, c, w, LUT,
               KIND: tl.constexpr, BITS: tl.constexpr, BD: tl.constexpr, D: tl.constexpr,
               CB, SDT: tl.constexpr):
    if BITS == 0:
        # per-channel widths: the row's bytes are loaded whole (``CB <= D`` of them), and
        # each channel's pieces A and B (its unpack word w) gathered from them in registers
        # (loading each channel's bytes by its own address spilled at head dim 128). An absent
        # piece has mask 0, so a width-0 channel reads code 0 (its scale is 0).
        row = tl.load(C + row_base[:, None] + c[None, :], mask=m2 & (c < CB)[None, :], other=0).to(tl.int32)
        N: tl.constexpr = row.shape[0]
        ba = tl.gather(row, tl.broadcast_to(byte_a(w)[None, :], (N, D)), 1)
        bb = tl.gather(row, tl.broadcast_to(byte_b(w)[None, :], (N, D)), 1)
        u = code_of(w, ba, bb)
    elif BITS == 3:
        P2: tl.constexpr = D // 4
        P1: tl.constexpr = D // 8
        b2 = tl.load(C + row_base[:, None] + (c % P2)[None, :], mask=m2, other=0).to(tl.int32)
        b1 = tl.load(C + row_base[:, None] + P2 + (c % P1)[None, :], mask=m2, other=0).to(tl.int32)
        u = ((b2 >> ((c // P2) * 2)[None, :]) & 3) | (((b1 >> (c // P1)[None, :]) & 1) << 2)
    else:
        PB: tl.constexpr = D * BITS // 8
        bb = tl.load(C + row_base[:, None] + (c % PB)[None, :], mask=m2, other=0).to(tl.int32)
        u = (bb >> ((c // PB) * BITS)[None, :]) & ((1 << BITS) - 1)
    if BD == D:
        # one scale per row: a vector load, broadcast over the channels
        s = scale_value(tl.load(SC + srow, mask=nmask, other=0), SDT)[:, None]
    else:
        s = scale_value(tl.load(SC + srow[:, None] + (c // BD)[None, :], mask=m2, other=0), SDT)
    if KIND == 5 or KIND == 6:
        # codebooks: the level of each code, from the format's table (fp32 bit patterns; 2**BITS
        # entries, L1-resident), times the scale
        x = tl.load(LUT + u).to(tl.float32, bitcast=True) * s
    elif KIND == 0:
        x = (u - (1 << (BITS - 1))).to(tl.float32) * s
    elif KIND == 1:
        if BD == D:
            z = tl.load(ZP + srow, mask=nmask, other=0.0).to(tl.float32)[:, None]
        else:
            z = tl.load(ZP + srow[:, None] + (c // BD)[None, :], mask=m2, other=0.0).to(tl.float32)
        x = u.to(tl.float32) * s + z
    elif KIND == 2:
        x = e4m3_value(u) * s
    elif KIND == 7:
        x = fp4_value(u) * s
    else:
        # e5m2 is the top byte of fp16
        h = (u << 8).to(tl.int16).to(tl.float16, bitcast=True)
        x = h.to(tl.float32) * s
    return x


@triton.jit
def _row_layout(LW, c, cb, BITS: tl.constexpr, CB: tl.constexpr):
    """``(unpack words, bytes of a code row)``: for per-channel widths (``BITS`` 0) the words
    ``LW [D]``, loaded once per program, and the run-time ``cb``; otherwise ``c`` (unread) and
    the constexpr ``CB``."""
    if BITS == 0:
        w = tl.load(LW + c)
        n = cb
    else:
        w = c
        n = CB
    return w, n


@triton.jit
def _offsets(t, start, b, BT, sbt_b, P: tl.constexpr, hloc, s_cp, s_ch, s_sp, s_sh,
             CB, NSD: tl.constexpr, BTS: tl.constexpr, STATIC: tl.constexpr, nmask):
    """Element offsets of the code row and of the scale row of quantized tokens ``t``."""
    i = t - start
    lp = i // P
    row = (i % P).to(tl.int64)
    page = tl.load(BT + b * sbt_b + lp, mask=nmask, other=0).to(tl.int64)
    row_base = page * s_cp + hloc * s_ch + row * CB
    if STATIC:
        srow = row_base * 0 + hloc * s_sh
    else:
        srow = page * s_sp + hloc * s_sh + (row // BTS) * NSD
    return row_base, srow


@triton.jit
def _rope_rows(k, t, nmask, COS, SIN, N: tl.constexpr, D: tl.constexpr):
    """``k cos_t + rotate_half(k) sin_t`` for the fp32 ``[N, D]`` tile ``k`` at positions ``t``
    (tables ``[T, D/2]``: channel ``c`` uses column ``c mod D/2``);
    ``rotate_half([x1, x2]) = [-x2, x1]``, the halves picked out of a ``[N, 2, D/2]`` view."""
    c = tl.arange(0, D) % (D // 2)
    off = t.to(tl.int64)[:, None] * (D // 2) + c[None, :]
    cos = tl.load(COS + off, mask=nmask[:, None], other=0.0)
    sin = tl.load(SIN + off, mask=nmask[:, None], other=0.0)
    j = tl.arange(0, 2)[None, :, None]
    k3 = tl.reshape(k, (N, 2, D // 2))
    x1 = tl.sum(tl.where(j == 0, k3, 0.0), axis=1)
    x2 = tl.sum(tl.where(j == 1, k3, 0.0), axis=1)
    rh = tl.reshape(tl.where(j == 0, -x2[:, None, :], x1[:, None, :]), (N, D))
    return k * cos + rh * sin


@triton.jit
def _fp_rows(base, sbase, st, slot, mask, c, FP_Q: tl.constexpr):
    """fp32 ``[N, D]`` rows ``slot`` of a full-precision buffer (``FP_Q``: int8 codes biased by 128,
    times the row's fp16 scale -- the oracle's decode, exact in fp32)."""
    x = tl.load(base + slot[:, None] * st + c[None, :], mask=mask[:, None], other=0).to(tl.float32)
    if FP_Q:
        s = tl.load(sbase + slot, mask=mask, other=0.0).to(tl.float32)
        x = (x - 128.0) * s[:, None]
    return x


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, DOT_FP16: tl.constexpr):
    if USE_DOT:
        if DOT_FP16:
            return tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.sum(q[:, None, :] * k[None, :, :], axis=2)


@triton.jit
def _pv(p, v, USE_DOT: tl.constexpr, DOT_FP16: tl.constexpr):
    if USE_DOT:
        if DOT_FP16:
            return tl.dot(p.to(tl.float16), v.to(tl.float16))
        return tl.dot(p, v, input_precision="ieee")
    return tl.sum(p[:, :, None] * v[None, :, :], axis=1)


@triton.jit
def paged_decode_kernel(
    Q, sq_b, sq_h,  # [rows, Hq, D] queries (post-RoPE); row QSTART[b] + m is query m of sequence b
    QSTART, QN,  # [B] int32: first query row and number of queries of each sequence
    SEQ_LENS,  # [B] int32 tokens in each sequence (including this step's)
    BT, sbt_b,  # [B, max_pages] int32 block table
    HEADS, KMAP, VMAP,  # [n] int32: global kv head, its index in the K group and in the V group
    KC, skc_p, skc_h, KS, KZ, sks_p, sks_h,  # key code pool, scale pool, zero pool
    VC, svc_p, svc_h, VS, VZ, svs_p, svs_h,  # value pools
    KL, VL, kcb, vcb,  # K_BITS / V_BITS == 0: [D] int32 unpack words of per-channel widths, and the
    # bytes of a code row (K_CB / V_CB are 0 then: one specialisation serves every layout of widths);
    # codebooks (kind 5, 6): KL / VL are their tables (levels first, int32 bit patterns of fp32)
    KF, skf_b, skf_h, skf_t,  # key full-precision buffer [slots, hK, sinks + cap_k, D]
    VF, svf_b, svf_h, svf_t,
    KFS, skfs_b, skfs_h, VFS, svfs_b, svfs_h,  # FP_Q: their int8 rows' fp16 scales [slots, h, sinks + cap]
    KSP, sksp_b, sksp_h, VSP, svsp_b, svsp_h,  # salient positions [slots, h, NSAL] int32 (-1: none)
    PO, PM, PL,  # partials [B, Hq, NSP, D], [B, Hq, NSP], [B, Hq, NSP] fp32
    COS, SIN,  # [max_tokens, D/2] fp32 RoPE tables of the positions (used when K_PRE)
    qk_scale,  # softmax scale * log2(e)
    SINKS, WIN_K, WIN_V, TB_K, TB_V, CAP_K, CAP_V, CHUNK, NSP, SPLIT0, LWIN, NSAL,
    HQ: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, P: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_BD: tl.constexpr, K_BTS: tl.constexpr,
    K_STATIC: tl.constexpr, K_CB: tl.constexpr, K_SDT: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_BD: tl.constexpr, V_BTS: tl.constexpr,
    V_STATIC: tl.constexpr, V_CB: tl.constexpr, V_SDT: tl.constexpr,
    K_ROT: tl.constexpr, V_ROT: tl.constexpr, LOG2D: tl.constexpr, RSCALE: tl.constexpr, K_PRE: tl.constexpr,
    TAIL: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP16: tl.constexpr,
    QM: tl.constexpr, QB: tl.constexpr, FP_Q: tl.constexpr, SLIDE: tl.constexpr,
    K_SAL: tl.constexpr, V_SAL: tl.constexpr, SAL_P2: tl.constexpr,
):
    """Grid ``(B * QB, n, NS)`` (main: quantized tokens, split ``pid2``) or ``(B * QB, n, 1)`` (``TAIL``).

    Program ``pid0 = b * QB + j`` serves queries ``j*QM .. j*QM + QM - 1`` of sequence ``b``: the
    tile rows are (query, query head) pairs, ``QM * REP`` of them. Decode is ``QM = QB = 1``
    (the last token); a prefill chunk of ``n`` queries at positions ``T - n .. T - 1`` uses
    ``QM > 1`` and a causal mask (query at ``p`` sees tokens ``t <= p``).
    """
    b = tl.program_id(0) // QB
    qblk = tl.program_id(0) % QB
    hi = tl.program_id(1)
    sp = tl.program_id(2)
    T = tl.load(SEQ_LENS + b)
    qs = tl.load(QSTART + b)
    nq = tl.load(QN + b)
    hg = tl.load(HEADS + hi)
    hk = tl.load(KMAP + hi).to(tl.int64)
    hv = tl.load(VMAP + hi).to(tl.int64)
    start = tl.minimum(SINKS, T)
    # each side's quantized region: past its own window (WIN_K, WIN_V), in whole token blocks
    avail_k = tl.maximum(T - start - WIN_K, 0)
    avail_v = tl.maximum(T - start - WIN_V, 0)
    end_k = start + avail_k - avail_k % TB_K
    end_v = start + avail_v - avail_v % TB_V
    e0 = tl.minimum(end_k, end_v)

    c = tl.arange(0, D)
    hr = tl.arange(0, BLOCK_H)
    qm = qblk * QM + hr // REP  # query index within the sequence's chunk
    hmask = (hr < QM * REP) & (qm < nq)
    qh = hg * REP + hr % REP
    qrow = (qs + qm).to(tl.int64)
    pos = T - nq + qm  # the query's position
    q = tl.load(Q + qrow[:, None] * sq_b + qh[:, None] * sq_h + c[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale
    # rotated keys: rotate the query once, unless the rows must be un-rotated anyway (tail, RoPE)
    ROT_Q: tl.constexpr = K_ROT and not TAIL and not K_PRE
    if ROT_Q:
        q = fwht(q, BLOCK_H, D, LOG2D, RSCALE)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    NSD_K: tl.constexpr = D // K_BD
    NSD_V: tl.constexpr = D // V_BD
    b64 = b.to(tl.int64)
    k_w, k_cb = _row_layout(KL, c, kcb, K_BITS, K_CB)
    v_w, v_cb = _row_layout(VL, c, vcb, V_BITS, V_CB)
    # salient tokens: positions from the pool that keeps their rows (K's and V's lists are equal)
    HAS_SAL: tl.constexpr = K_SAL or V_SAL
    if K_SAL:
        SP = KSP + b64 * sksp_b + hk * sksp_h
    else:
        SP = VSP + b64 * svsp_b + hv * svsp_h
    if HAS_SAL and not TAIL:
        jsal = tl.arange(0, SAL_P2)
        salp = tl.load(SP + jsal, mask=jsal < NSAL, other=-1)

    if TAIL:
        lo = 0
        hi_ = start + NSAL + (T - e0)
    else:
        lo = start + sp * CHUNK
        hi_ = tl.minimum(lo + CHUNK, e0)
        if QM > 1:  # no query of this block sees past its last position
            hi_ = tl.minimum(hi_, T - nq + tl.minimum(qblk * QM + QM, nq))
        if SLIDE:  # nor before its first query's window
            lo = tl.maximum(lo, T - nq + qblk * QM - LWIN + 1)
    for v0 in range(lo, hi_, BLOCK_N):
        vi = v0 + tl.arange(0, BLOCK_N)
        nmask = vi < hi_
        live = nmask
        if TAIL:
            # sinks, then the NSAL salient entries (their positions; -1 none), then e0 .. T-1
            js = vi - start
            is_s = (vi >= start) & (js < NSAL)
            if HAS_SAL:
                ts = tl.load(SP + js, mask=nmask & is_s, other=-1)
                t = tl.where(vi < start, vi, tl.where(is_s, ts, e0 + vi - start - NSAL))
                # an entry still at e0 or later (one of the prompt's newest tokens, in the window)
                # is read there, once
                nmask = nmask & (~is_s | ((ts >= 0) & (ts < e0)))
                live = nmask
            else:
                t = tl.where(vi < start, vi, e0 + vi - start)
            k_pg = nmask & (t >= start) & (t < end_k)
            v_pg = nmask & (t >= start) & (t < end_v)
            # a salient row of a quantized pool sits after its ring, in slot SINKS + CAP + j
            k_slot = tl.where(t < SINKS, t, SINKS + (t - SINKS) % CAP_K)
            v_slot = tl.where(t < SINKS, t, SINKS + (t - SINKS) % CAP_V)
            if K_SAL:
                k_pg = k_pg & ~is_s
                k_slot = tl.where(is_s, SINKS + CAP_K + js, k_slot)
            if V_SAL:
                v_pg = v_pg & ~is_s
                v_slot = tl.where(is_s, SINKS + CAP_V + js, v_slot)
            k_slot = k_slot.to(tl.int64)
            v_slot = v_slot.to(tl.int64)
        else:
            t = vi
            k_pg = nmask
            v_pg = nmask
            if HAS_SAL:  # salient tokens are read from their rows, in the tail
                live = nmask & (tl.sum((t[:, None] == salp[None, :]).to(tl.int32), axis=1) == 0)
        krow, ksrow = _offsets(t, start, b64, BT, sbt_b, P, hk, skc_p, skc_h, sks_p, sks_h,
                               k_cb, NSD_K, K_BTS, K_STATIC, k_pg)
        k = _deq_tile(KC, krow, k_pg, KS, KZ, ksrow, c, k_w, KL, K_KIND, K_BITS, K_BD, D, k_cb, K_SDT)
        if K_ROT and not ROT_Q:
            k = fwht(k, BLOCK_N, D, LOG2D, RSCALE)
        if TAIL:
            kf = _fp_rows(KF + b64 * skf_b + hk * skf_h, KFS + b64 * skfs_b + hk * skfs_h, skf_t, k_slot,
                          nmask & ~k_pg, c, FP_Q)
            k = tl.where(k_pg[:, None], k, kf)
        if K_PRE:
            k = _rope_rows(k, t, nmask, COS, SIN, BLOCK_N, D)
        s = _scores(q, k, USE_DOT, DOT_FP16)
        if QM > 1 or SLIDE or HAS_SAL:
            seen = live[None, :]
            if QM > 1:
                seen = seen & (t[None, :] <= pos[:, None])
            if SLIDE:
                seen = seen & (t[None, :] > pos[:, None] - LWIN)
            s = tl.where(seen, s, float("-inf"))
            # a row may have seen no token yet: keep its running max finite for the exponentials
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
        else:
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        vrow, vsrow = _offsets(t, start, b64, BT, sbt_b, P, hv, svc_p, svc_h, svs_p, svs_h,
                               v_cb, NSD_V, V_BTS, V_STATIC, v_pg)
        v = _deq_tile(VC, vrow, v_pg, VS, VZ, vsrow, c, v_w, VL, V_KIND, V_BITS, V_BD, D, v_cb, V_SDT)
        if TAIL:
            if V_ROT:
                v = fwht(v, BLOCK_N, D, LOG2D, RSCALE)
            vf = _fp_rows(VF + b64 * svf_b + hv * svf_h, VFS + b64 * svfs_b + hv * svfs_h, svf_t, v_slot,
                          nmask & ~v_pg, c, FP_Q)
            v = tl.where(v_pg[:, None], v, vf)
        acc = acc * alpha[:, None] + _pv(p, v, USE_DOT, DOT_FP16)
        m_i = m_new

    if V_ROT and not TAIL:
        acc = fwht(acc, BLOCK_H, D, LOG2D, RSCALE)
    split = SPLIT0 + sp
    prow = (qrow * HQ + qh) * NSP + split
    tl.store(PO + prow[:, None] * D + c[None, :], acc, mask=hmask[:, None])
    tl.store(PM + prow, m_i, mask=hmask)
    tl.store(PL + prow, l_i, mask=hmask)


@triton.jit
def merge_kernel(PO, PM, PL, OUT, so_b, so_h, NSP, SINK, sink_scale, HQ: tl.constexpr, D: tl.constexpr,
                 BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr):
    """Combine the ``NSP`` partials of query head ``pid1`` of query row ``pid0``. Grid ``(rows, Hq)``.

    ``HAS_SINK``: ``SINK [Hq]`` fp32 sink logits, times ``sink_scale`` (log2 e) into the partials'
    base-2 units, join the normaliser as a term of weight ``e^sink`` and no value."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < NSP
    c = tl.arange(0, D)
    base = (b * HQ + h) * NSP
    m = tl.load(PM + base + sidx, mask=smask, other=float("-inf"))
    l = tl.load(PL + base + sidx, mask=smask, other=0.0)
    M = tl.max(m, axis=0)
    if HAS_SINK:
        ms = tl.load(SINK + h) * sink_scale
        M = tl.maximum(M, ms)
    w = tl.where(m > float("-inf"), tl.exp2(m - M), 0.0)
    acc = tl.load(PO + (base + sidx)[:, None] * D + c[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(w[:, None] * acc, axis=0)
    den = tl.sum(w * l, axis=0)
    if HAS_SINK:
        den += tl.exp2(ms - M)
    tl.store(OUT + b * so_b + h * so_h + c, (num / den).to(OUT.dtype.element_ty))
