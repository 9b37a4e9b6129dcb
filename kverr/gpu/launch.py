"""Kernel launches: argument marshalling and grids (inputs are checked by :mod:`kverr.gpu.cache`)."""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from kverr.gpu.spec import KernelSpec
from kverr.quant.reference import hadamard_scale


@cache
def _kernels():
    # imported lazily, once: TRITON_INTERPRET must be set before the kernel modules are imported
    # (and with it, the interpreter's patch step is wrapped; a launch then pays neither again)
    from kverr.gpu.interpreter import install, interpreting
    from kverr_kernels import decode, quant_store

    if interpreting():
        install()

    return quant_store, decode


#: Warps of the decode kernel: with 8, no specialisation spills at head dim 64 or 128 (AOT table).
DECODE_WARPS = 8
#: Register cap handed to ptxas (decode and store): with 8 warps it otherwise caps some specialisations at 128
#: registers and spills to the stack.
DECODE_MAXNREG = 255


def decode_block_n(kspec: KernelSpec, vspec: KernelSpec, block_n: int) -> int:
    """Tokens per decode tile: halved for 3-bit codes (two gathered planes per tile), which
    otherwise spill at head dim 128. (Per-channel widths gather their pieces from a whole-row
    tile in registers and need no halving: no spill at 32 tokens, head dim 64, AOT.)"""
    return max(16, block_n // 2) if 3 in (kspec.bits, vspec.bits) else block_n


def store_warps(block_r: int, D: int, comp: bool = False) -> int:
    """Warps of the store kernel: 8 for tiles of 4096+ elements (whole pages), else 4; twice that
    for keys rounded with compensation (a float64 tile and a float64 row of factors carried
    through the sequential rule: with fewer, rows of 16 tokens and 32-token channel groups spill
    at head dim 128; with these, only 64-token blocks still do, AOT)."""
    return (2 if comp else 1) * (8 if block_r * D >= 4096 else 4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rotation_constexprs(D: int) -> dict:
    """``LOG2D`` and ``RSCALE`` (the fp32 ``1/sqrt(D)``) of :func:`kernels.hadamard.fwht`."""
    return dict(LOG2D=D.bit_length() - 1, RSCALE=hadamard_scale(D))


def store_constexprs(spec: KernelSpec, D: int, block_r: int, fp_q: bool = False, comp: bool = False) -> dict:
    """``comp``: keys rounded with compensation (the job rows' factors given, :class:`CompensationArgs`)."""
    return dict(D=D, CB=spec.cb_const, BLOCK_R=block_r, KIND=spec.kind, BITS=spec.bits, SDT=spec.sdt,
                GRAN=spec.gran, BD=spec.bd, BT_S=spec.bts, ROT=spec.rot, CLIP_N=spec.clip_n,
                **rotation_constexprs(D), FP_Q=fp_q, ARITH=spec.arith, COMP=comp)


class CompensationArgs(NamedTuple):
    """The factors a store launch rounds keys with (:mod:`kverr.quant.compensated`): ``U`` float64
    holding each job row's factor, element ``(k, p)`` at ``k * strides[4] + p * strides[5]`` from
    the row's offset ``j * strides[0] + r * strides[1] + b * strides[2] + head * strides[3]`` (job
    ``j``, its row ``r``, sequence ``b``, local head); ``order`` int32 holding at ``j * ostrides[0]
    + r * ostrides[1] + b * ostrides[2] + head * ostrides[3]`` the row's channel order (``D``) and
    then each channel's position in it (``D``)."""

    U: torch.Tensor
    strides: tuple[int, int, int, int, int, int]
    order: torch.Tensor
    ostrides: tuple[int, int, int, int]


def _fp_scale_args(pool) -> tuple:
    """The fp16 scales of an int8 window (``pool.fp_scale`` ``[slots, h, sinks + cap]``) and
    their batch and head strides; a float window passes its buffer, unread."""
    fs = pool.fp_scale
    return (pool.fp, 0, 0) if fs is None else (fs, fs.stride(0), fs.stride(1))


#: The store kernel is launched without fp contraction: ``u * s + m`` in the MSE clip search
#: must round twice, as the oracle's does (a fused multiply-add would round once).
STORE_OPTIONS = dict(enable_fp_fusion=False)


def launch_store(pool, jobs, x: torch.Tensor, D: int, P: int, xs: torch.Tensor | None = None,
                 comp: CompensationArgs | None = None) -> None:
    """Quantize-and-store ``jobs`` of ``pool`` from the new rows ``x [N, H, D]``; an int8 window
    passes them as received, ``x`` their uint8 codes and ``xs [N, H]`` their fp16 scales;
    ``comp``: the factors of keys rounded with compensation."""
    qs, _ = _kernels()
    spec = pool.spec
    scale = pool.scale if pool.scale is not None else pool.codes
    zero = pool.zero if pool.zero is not None else scale
    if spec.static or pool.scale is None:
        ss_p, ss_h = 0, scale.stride(0) if pool.scale is not None else 0
    else:
        ss_p, ss_h = scale.stride(0), scale.stride(1)
    grid = (jobs.n_jobs, len(pool.heads))
    qs.quant_store_kernel[grid](
        x, x.stride(0), x.stride(1),
        pool.fp, pool.fp.stride(0), pool.fp.stride(1), pool.fp.stride(2),
        *_fp_scale_args(pool),
        *((x, 0, 0) if xs is None else (xs, xs.stride(0), xs.stride(1))),
        pool.heads_t,
        jobs.page, jobs.row0, jobs.nrows, jobs.seq, jobs.src_new, jobs.src_slot,
        pool.codes, pool.codes.stride(0), pool.codes.stride(1),
        scale, zero, ss_p, ss_h, pool.ratios, *_layout_args(pool), spec.cb, spec.scale_floor,
        *((pool.ratios, 0, 0, 0, 0, 0, 0, pool.heads_t, 0, 0, 0, 0) if comp is None
          else (comp.U, *comp.strides, comp.order, *comp.ostrides)),
        **store_constexprs(spec, D, jobs.block_r, pool.fp_scale is not None, comp is not None),
        num_warps=store_warps(jobs.block_r, D, comp is not None), maxnreg=DECODE_MAXNREG, **STORE_OPTIONS,
    )


def _salient_args(pool) -> tuple:
    """The salient positions (``pool.sal_pos`` ``[slots, h, nsal]`` int32) and their batch and head
    strides; a pool without salient rows passes its head list, unread."""
    sp = pool.sal_pos
    return (pool.heads_t, 0, 0) if sp is None else (sp, sp.stride(0), sp.stride(1))


def _layout_args(pool) -> tuple:
    """The format's tables: the layout words of per-channel widths (unpack, pack), or a codebook's
    table (and an unread int32 tensor); other formats pass an int32 tensor, unread."""
    if pool.layout is None:
        return pool.heads_t, pool.heads_t
    return pool.layout, pool.heads_t if pool.packing is None else pool.packing


def _unpack_words(pool) -> torch.Tensor:
    return _layout_args(pool)[0]


def _fmt_args(pool):
    spec = pool.spec
    scale = pool.scale if pool.scale is not None else pool.codes
    zero = pool.zero if pool.zero is not None else scale
    if pool.scale is None:
        sp, sh = 0, 0
    elif spec.static:
        sp, sh = 0, scale.stride(0)
    else:
        sp, sh = scale.stride(0), scale.stride(1)
    return (pool.codes, pool.codes.stride(0), pool.codes.stride(1), scale, zero, sp, sh)


def decode_constexprs(kspec: KernelSpec, vspec: KernelSpec, *, Hq: int, D: int, rep: int, block_n: int,
                      P: int, tail: bool, dot_fp16: bool, key_pre_rope: bool = False, qm: int = 1,
                      qb: int = 1, fp_q: bool = False, slide: bool = False, k_sal: int = 0,
                      v_sal: int = 0) -> dict:
    """``k_sal``/``v_sal``: salient rows the K/V pool keeps per sequence and head (0: none)."""
    return dict(
        HQ=Hq, D=D, REP=rep, BLOCK_H=max(16, _next_pow2(rep * qm)), BLOCK_N=block_n, P=P,
        K_KIND=kspec.kind, K_BITS=kspec.bits, K_BD=kspec.bd, K_BTS=kspec.bts, K_STATIC=kspec.static, K_CB=kspec.cb_const,
        K_SDT=kspec.sdt,
        V_KIND=vspec.kind, V_BITS=vspec.bits, V_BD=vspec.bd, V_BTS=vspec.bts, V_STATIC=vspec.static, V_CB=vspec.cb_const,
        V_SDT=vspec.sdt,
        K_ROT=kspec.rot, V_ROT=vspec.rot, **rotation_constexprs(D), K_PRE=key_pre_rope,
        TAIL=tail, USE_DOT=True, DOT_FP16=dot_fp16, QM=qm, QB=qb, FP_Q=fp_q, SLIDE=slide,
        K_SAL=k_sal > 0, V_SAL=v_sal > 0, SAL_P2=_next_pow2(max(k_sal, v_sal, 1)),
    )


#: Tile rows (query x query head) a prefill program aims for: QM = max(1, PREFILL_ROWS // rep) queries.
#: 16, the decode tile's height: with 32 rows the rotated pre-RoPE tail spills at head dim 128 (AOT table).
PREFILL_ROWS = 16


def prefill_queries_per_program(rep: int) -> int:
    return max(1, PREFILL_ROWS // rep)


class QueryRows(NamedTuple):
    """Which query rows an attention launch serves: query ``m`` of sequence ``b`` is row
    ``start[b] + m`` of ``q``, ``count[b]`` of them; ``qm`` per program, ``qb`` programs per
    sequence; ``partials`` = (o, m, l) sized for those rows."""

    start: torch.Tensor
    count: torch.Tensor
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qm: int
    qb: int


def launch_decode(cache, step, ln, q: torch.Tensor, sm_scale: float, *, tail: bool,
                  rows: QueryRows | None = None, window: int = 0,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Decode (``rows=None``: one query per sequence, ``q [B, Hq, D]``) or a prefill chunk
    (``q [rows, Hq, D]`` packed per sequence, as ``rows`` says); ``window`` > 0: the layer's
    sliding window; ``rope``: the layer's ``[T, D/2]`` (cos, sin) tables of pre-RoPE keys."""
    _, dk = _kernels()
    kp, vp = ln.kpool, ln.vpool
    ns = step.num_splits
    if rows is None:
        rows = QueryRows(cache.decode_rows, cache.decode_count, (step.partial_o, step.partial_m, step.partial_l), 1, 1)
    qstart, qn, (po, pm, pl), qm, qb = rows
    grid = (cache.B * qb, len(ln.heads), 1 if tail else ns)
    kf, vf = kp.fp, vp.fp
    dk.paged_decode_kernel[grid](
        q, q.stride(0), q.stride(1), qstart, qn,
        step.seq_lens, cache.block_table_t, cache.block_table_t.stride(0),
        ln.heads_t, ln.kmap, ln.vmap,
        *_fmt_args(kp), *_fmt_args(vp), _unpack_words(kp), _unpack_words(vp), kp.spec.cb, vp.spec.cb,
        kf, kf.stride(0), kf.stride(1), kf.stride(2),
        vf, vf.stride(0), vf.stride(1), vf.stride(2),
        *_fp_scale_args(kp), *_fp_scale_args(vp),
        *_salient_args(kp), *_salient_args(vp),
        po, pm, pl,
        rope[0] if rope is not None else po,
        rope[1] if rope is not None else po,
        sm_scale * 1.4426950408889634,
        cache.S, kp.window, vp.window, kp.spec.tb, vp.spec.tb, kp.cap, vp.cap, max(step.chunk, 1), ns + 1,
        ns if tail else 0, int(window), max(kp.nsal, vp.nsal),
        **decode_constexprs(kp.spec, vp.spec, Hq=cache.Hq, D=cache.D, rep=cache.rep, block_n=decode_block_n(kp.spec, vp.spec, cache.block_n),
                            P=cache.P, tail=tail, dot_fp16=cache.dot_fp16, key_pre_rope=cache.key_pre_rope, qm=qm, qb=qb,
                            fp_q=kp.fp_scale is not None, slide=window > 0, k_sal=kp.nsal, v_sal=vp.nsal),
        num_warps=DECODE_WARPS, maxnreg=DECODE_MAXNREG,
    )


def launch_merge(step, out: torch.Tensor, Hq: int, D: int, partials=None, sinks: torch.Tensor | None = None) -> None:
    """Combine the partials into ``out``; ``sinks [Hq]`` fp32: the layer's learned sink logits."""
    _, dk = _kernels()
    nsp = step.num_splits + 1
    po, pm, pl = partials if partials is not None else (step.partial_o, step.partial_m, step.partial_l)
    rows = out.shape[0]
    dk.merge_kernel[(rows, Hq)](po, pm, pl, out, out.stride(0), out.stride(1),
                                nsp, pm if sinks is None else sinks, 1.4426950408889634,
                                HQ=Hq, D=D, BLOCK_S=_next_pow2(nsp), HAS_SINK=sinks is not None)
