"""Ahead-of-time compilation of every kernel specialisation for sm_90 / sm_80, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole compiler
(TTIR -> TTGIR -> LLVM -> PTX -> ptxas) on the CPU; ``cuobjdump --dump-resource-usage`` (bundled
with triton's wheel) then reads registers, shared memory, stack and local (spill) bytes from the
cubin. The interpreter accepts code the GPU compiler rejects, so this is the test that the
kernels really compile.

Compilation must not run with ``TRITON_INTERPRET=1`` (the kernels would be interpreter objects);
:func:`compile_in_subprocess` runs ``python -m kverr.gpu.aot`` with it unset.

Command line::

    python -m kverr.gpu.aot --arch 90 [--arch 80] [--full | --cover] [--head-dim 128] [--json] [--out FILE]

``--full`` is every element format x every granularity (the committed tables); the default is the
test set (each element format at per-token scales, each granularity with int4, the rotated/MSE
branches on each scale layout); ``--cover`` a subset of either in which every value of every
constexpr of each kernel occurs at least once (what ``make test`` compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kverr.exceptions import KernelError
from kverr.gpu.interpreter import interpreting
from kverr.gpu.launch import (
    DECODE_MAXNREG,
    DECODE_WARPS,
    STORE_OPTIONS,
    decode_block_n,
    decode_constexprs,
    prefill_queries_per_program,
    store_constexprs,
    store_warps,
)
from kverr.gpu.spec import KIND_FLOAT, KernelSpec, kernel_spec
from kverr.quant.formats import (
    BYTE_SCALE_DTYPES,
    CHANNEL_BITS,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    float_format,
    codebook_format,
    fp4_format,
    fp8_format,
    int_format,
    window_format,
)

_PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "u8": "*u8", "i32": "*i32"}


@dataclass
class Resource:
    """Resource usage of one compiled specialisation."""

    kernel: str
    spec: str
    arch: int
    registers: int
    shared: int
    stack: int
    local: int
    num_warps: int

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0


def _granularities(P: int):
    return [("tok", PerToken()), ("tg32", PerTokenGroup(32)), ("ch32", PerChannel(32)), ("page", PerPage()),
            ("tensor", PerTensor()), ("head", PerHead()), ("chall", PerChannel(None))]


def _elements():
    out = []
    for bits in (2, 3, 4, 8):
        for sym in (True, False):
            out.append(lambda g, b=bits, s=sym: int_format(b, g, symmetric=s))
    out.append(lambda g: fp8_format(g))
    out.append(lambda g: fp8_format(g, variant="e5m2"))
    for bits in (2, 3, 4):
        for stat in ("absmax", "rms"):
            out.append(lambda g, b=bits, s=stat: codebook_format(b, g, scale_stat=s))
    for sdt in ("fp8_e4m3", "e8m0"):
        out.append(lambda g, s=sdt: fp4_format(g, scale_dtype=s))
    return out


def _rotated_mse(f: QuantFormat) -> QuantFormat:
    """``f`` with a Hadamard rotation and the calibrator's MSE clip (the other constexpr branches;
    an rms codebook takes no clip: rotated only)."""
    from kverr.catalog import CALIBRATION_MSE_CLIP

    if f.scale_stat == "rms":
        return dataclasses.replace(f, rotate="hadamard")
    return dataclasses.replace(f, rotate="hadamard", clip=CALIBRATION_MSE_CLIP)


def _mixed_widths(D: int) -> list[QuantFormat]:
    """Per-channel widths with every width of :data:`CHANNEL_BITS` in turn, plain and rotated."""
    widths = tuple(CHANNEL_BITS[i % len(CHANNEL_BITS)] for i in range(D))
    f = QuantFormat("int", max(widths), False, PerChannel(None), "fp16", channel_bits=widths)
    return [f, dataclasses.replace(f, rotate="hadamard")]


def formats(full: bool, P: int = 64, D: int = 128) -> list[QuantFormat]:
    """With ``full``: every format of the catalog (:func:`kverr.catalog.catalog`: presets,
    calibration candidates, window formats), the serving engines' presets, and every element
    format x every granularity, each also rotated with an MSE clip. Otherwise each element format at per-token scales plus each
    granularity with int4, and the rotated/MSE branches on each scale layout (the test set)."""
    from kverr.catalog import catalog

    fmts: list[QuantFormat] = [float_format("fp16")]
    grans = _granularities(P)
    elems = _elements()
    if full:
        from kverr.config import named_presets

        plain = [e(g) for e in elems for _, g in grans]
        # the engines' presets too: their arithmetic options (nearest scales, floors, reciprocals)
        engines = [f for cfg in named_presets().values() for _, f in cfg._all_formats()]
        fmts += [*catalog(D), *plain, *(_rotated_mse(f) for f in plain), *_mixed_widths(D), *engines]
    else:
        fmts += [e(PerToken()) for e in elems]
        fmts += [int_format(4, g) for name, g in grans if name != "tok"]
        fmts += [int_format(2, PerChannel(32)), int_format(2, PerTokenGroup(32)), fp8_format(PerTensor())]
        fmts += [_rotated_mse(f) for f in (int_format(4, PerToken()), int_format(2, PerChannel(32)),
                                           int_format(3, PerTokenGroup(32), symmetric=True), fp8_format(PerToken()),
                                           int_format(8, PerPage()), int_format(4, PerHead()))]
        fmts += _mixed_widths(D)
    seen, out = set(), []
    for f in fmts:
        if f not in seen:
            seen.add(f)
            out.append(f)
    return out


def _sdt_ptr(spec: KernelSpec) -> str:
    return "*u8" if spec.kind == 4 or spec.fmt.scale_dtype in BYTE_SCALE_DTYPES else _PTR[spec.fmt.scale_dtype]


def _codes_ptr(spec: KernelSpec) -> str:
    return _PTR["fp16"] if spec.kind == 4 else "*u8"


def store_signature(spec: KernelSpec, fp_q: bool = False) -> dict:
    """``fp_q``: an int8 window (uint8 rows in ``FP``; the received new rows as uint8 codes in
    ``X`` and fp16 scales in ``XS``)."""
    sig = {"X": "*u8" if fp_q else "*fp16", "sx_n": "i32", "sx_h": "i32", "FP": "*u8" if fp_q else "*fp16", "sf_b": "i32", "sf_h": "i32", "sf_t": "i32",
           "FPS": "*fp16", "sfs_b": "i32", "sfs_h": "i32", "XS": "*fp16", "sxs_n": "i32", "sxs_h": "i32",
           "HEADS": "*i32", "JOB_PAGE": "*i32", "JOB_ROW0": "*i32", "JOB_NROWS": "*i32", "JOB_B": "*i32",
           "SRC_NEW": "*i32", "SRC_SLOT": "*i32", "CODES": _codes_ptr(spec), "sc_p": "i32", "sc_h": "i32",
           "SCALE": _sdt_ptr(spec), "ZERO": _sdt_ptr(spec), "ss_p": "i32", "ss_h": "i32", "RATIOS": "*fp32",
           "LAY": "*i32", "PACK": "*i32", "cb": "i32", "SFLOOR": "fp32",
           "COMP_U": "*fp64", "cu_j": "i32", "cu_r": "i32", "cu_b": "i32", "cu_h": "i32", "cu_k": "i32", "cu_p": "i32",
           "COMP_ORD": "*i32", "co_j": "i32", "co_r": "i32", "co_b": "i32", "co_h": "i32"}
    return sig


def decode_signature(ks: KernelSpec, vs: KernelSpec, fp_q: bool = False) -> dict:
    sig = {"Q": "*fp16", "sq_b": "i32", "sq_h": "i32", "QSTART": "*i32", "QN": "*i32", "SEQ_LENS": "*i32", "BT": "*i32", "sbt_b": "i32",
           "HEADS": "*i32", "KMAP": "*i32", "VMAP": "*i32"}
    for p, s in (("K", ks), ("V", vs)):
        low = p.lower()
        sig.update({f"{p}C": _codes_ptr(s), f"s{low}c_p": "i32", f"s{low}c_h": "i32", f"{p}S": _sdt_ptr(s),
                    f"{p}Z": _sdt_ptr(s), f"s{low}s_p": "i32", f"s{low}s_h": "i32"})
    sig.update({"KL": "*i32", "VL": "*i32", "kcb": "i32", "vcb": "i32"})
    for p in ("K", "V"):
        low = p.lower()
        sig.update({f"{p}F": "*u8" if fp_q else "*fp16", f"s{low}f_b": "i32", f"s{low}f_h": "i32", f"s{low}f_t": "i32"})
    for p in ("K", "V"):
        low = p.lower()
        sig.update({f"{p}FS": "*fp16", f"s{low}fs_b": "i32", f"s{low}fs_h": "i32"})
    for p in ("K", "V"):
        low = p.lower()
        sig.update({f"{p}SP": "*i32", f"s{low}sp_b": "i32", f"s{low}sp_h": "i32"})
    sig.update({"PO": "*fp32", "PM": "*fp32", "PL": "*fp32", "COS": "*fp32", "SIN": "*fp32", "qk_scale": "fp32"})
    for n in ("SINKS", "WIN_K", "WIN_V", "TB_K", "TB_V", "CAP_K", "CAP_V", "CHUNK", "NSP", "SPLIT0", "LWIN", "NSAL"):
        sig[n] = "i32"
    return sig


def _compile(fn, sig: dict, constexprs: dict, arch: int, num_warps: int, maxnreg: int | None = None,
             extra: dict | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = dict(sig)
    for name in constexprs:
        full[name] = "constexpr"
    src = ASTSource(fn=fn, signature=full, constexprs=constexprs)
    opts = {"num_warps": num_warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    opts.update(extra or {})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def _cuobjdump() -> str:
    import triton

    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.exists() else "cuobjdump"


def resource_usage(compiled) -> dict:
    """Registers, shared, stack and local bytes of a compiled kernel, from its cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
    vals = {k: int(v) for k, v in re.findall(r"(REG|SHARED|STACK|LOCAL):(\d+)", out)}
    return dict(registers=vals.get("REG", 0), shared=vals.get("SHARED", 0), stack=vals.get("STACK", 0), local=vals.get("LOCAL", 0))


def specialisations(*, full: bool = False, D: int = 128, P: int = 64, rep: int = 4) -> list[tuple]:
    """The kernel specialisations to compile: the store kernel for every format, the decode
    kernel (main and tail) for every format as both K and V, mixed K/V pairs, pre-RoPE keys,
    chunked prefill, sliding-window layers and int8 windows. Each is ``(kernel, label, jit function, signature,
    constexprs)``."""
    from kverr_kernels import decode, quant_store

    specs = [kernel_spec(f, D, P) for f in formats(full, P, D)]
    block_n = 32 if D <= 64 else 16  # as PagedKVCache chooses
    jobs = []
    for s in specs:
        block_r = 16 if s.tb == 1 else s.tb
        jobs.append(("quant_store", s.fmt.label(), quant_store.quant_store_kernel, store_signature(s),
                     store_constexprs(s, D, block_r)))
    # int8 windows: the new rows received (the store kernel in the window's int8 format, 16 rows
    # a job), the store kernel's int8 reads for each token-block size, the decode tail
    recv = kernel_spec(window_format("int8"), D, 16)
    jobs.append(("quant_store", "int8 window receive", quant_store.quant_store_kernel, store_signature(recv),
                 store_constexprs(recv, D, 16)))
    int8_window = ("int2a/ch32/fp16", "int4a/tok/fp16/mse/had")
    for s in specs:
        if s.fmt.label() in int8_window:
            block_r = 16 if s.tb == 1 else s.tb
            jobs.append(("quant_store", f"{s.fmt.label()} int8 window", quant_store.quant_store_kernel,
                         store_signature(s, True), store_constexprs(s, D, block_r, True)))
    # keys rounded with compensation: every integer format compensation takes (the sequential rule
    # per row after the scales), and the int8-window reads of the calibrator's formats
    from kverr.quant.compensated import compensable

    for s in specs:
        if compensable(s.fmt):
            block_r = 16 if s.tb == 1 else s.tb
            jobs.append(("quant_store", f"{s.fmt.label()} compensated", quant_store.quant_store_kernel,
                         store_signature(s), store_constexprs(s, D, block_r, comp=True)))
            if s.fmt.label() in int8_window or s.bits == 0:
                jobs.append(("quant_store", f"{s.fmt.label()} compensated int8 window", quant_store.quant_store_kernel,
                             store_signature(s, True), store_constexprs(s, D, block_r, True, comp=True)))
    pairs = [(s, s, False) for s in specs]
    by = {s.fmt.label(): s for s in specs}
    for a, b in (("int2a/ch32/fp16", "int2a/tg32/fp16"), ("int4a/ch32/fp16", "int4a/tg32/fp16"),
                 ("int2a/ch32/fp16/mse/had", "int4a/tok/fp16/mse/had"), ("int4a/tok/fp16/mse/had", "int4a/tok/fp16"),
                 ("int8a/tok/fp16", "int4a/tok/fp16"), ("fp16", "int4a/tok/fp16")):
        if a in by and b in by:
            pairs.append((by[a], by[b], False))
    # pre-RoPE keys (RoPE fused after dequantization): every key format in the full sweep, a few here
    # (RoPE sits after dequantization, whatever the format: a few key formats of each kind suffice)
    pre = [by[n] for n in ("fp16", "int4a/tok/fp16", "int2a/ch32/fp16", "int4a/tok/fp16/mse/had", "int3a/tok/fp16",
                           "int2a/ch32/fp16/mse/had", "fp8_e4m3/tok/fp32", "int8a/page/fp16/mse/had",
                           "int3s/tg32/fp16/mse/had", "int3a/ch32/fp16/mse/had", "int4a/head/fp16/mse/had") if n in by]
    pre += [s for s in specs if s.bits == 0][:2]  # per-channel widths
    pairs += [(s, by.get("int4a/tok/fp16", s), True) for s in pre]
    # chunked prefill (QM queries per program, causal): the same key formats, plus a kivi-like pair
    qm = prefill_queries_per_program(rep)
    chunked = [(s, s, False, qm) for s in pre]
    if "int2a/ch32/fp16" in by and "int2a/tg32/fp16" in by:
        chunked.append((by["int2a/ch32/fp16"], by["int2a/tg32/fp16"], False, qm))
    chunked.append((by["int4a/tok/fp16/mse/had"], by["int4a/tok/fp16"], True, qm))
    for ks, vs, kpre, m in [(a, b, c, 1) for a, b, c in pairs] + chunked:
        for tail in (False, True):
            jobs.append((("decode" if m == 1 else "prefill") + ("_tail" if tail else ""),
                         f"K {ks.fmt.label()}{' pre-RoPE' if kpre else ''} V {vs.fmt.label()}",
                         decode.paged_decode_kernel, decode_signature(ks, vs),
                         decode_constexprs(ks, vs, Hq=rep * 8, D=D, rep=rep, block_n=decode_block_n(ks, vs, block_n), P=P, tail=tail,
                                            dot_fp16=True, key_pre_rope=kpre, qm=m, qb=4 if m > 1 else 1)))
    # sliding-window layers: decode and chunked prefill, a kivi-like pair and a rotated pre-RoPE one
    for ks, vs, kpre, m in ((by["int2a/ch32/fp16"], by["int2a/tg32/fp16"], False, 1),
                            (by["int4a/tok/fp16/mse/had"], by["int4a/tok/fp16"], True, 1),
                            (by["int4a/tok/fp16/mse/had"], by["int4a/tok/fp16"], True, qm)):
        for tail in (False, True):
            jobs.append((("decode" if m == 1 else "prefill") + ("_tail" if tail else ""),
                         f"K {ks.fmt.label()}{' pre-RoPE' if kpre else ''} V {vs.fmt.label()} sliding window",
                         decode.paged_decode_kernel, decode_signature(ks, vs),
                         decode_constexprs(ks, vs, Hq=rep * 8, D=D, rep=rep, block_n=decode_block_n(ks, vs, block_n), P=P,
                                           tail=tail, dot_fp16=True, key_pre_rope=kpre, qm=m, qb=4 if m > 1 else 1,
                                           slide=True)))
    for ks, vs, kpre, m in ((by["int2a/ch32/fp16"], by["int4a/tok/fp16/mse/had"], True, 1),
                            (by["int2a/ch32/fp16"], by["int4a/tok/fp16/mse/had"], True, qm)):
        name = "decode_tail" if m == 1 else "prefill_tail"
        jobs.append((name, f"K {ks.fmt.label()} pre-RoPE V {vs.fmt.label()} int8 window", decode.paged_decode_kernel,
                     decode_signature(ks, vs, True),
                     decode_constexprs(ks, vs, Hq=rep * 8, D=D, rep=rep, block_n=decode_block_n(ks, vs, block_n), P=P,
                                       tail=True, dot_fp16=True, key_pre_rope=kpre, qm=m, qb=4 if m > 1 else 1,
                                       fp_q=True)))
    # salient tokens (8 rows, int8 window as the calibrator emits them; FP_Q matters to the tail
    # only): masked in the main launch, read from their rows in the tail; fp16 keys keep none
    for ks, vs, kpre, m in ((by["int2a/ch32/fp16"], by["int4a/tok/fp16/mse/had"], True, 1),
                            (by["int2a/ch32/fp16"], by["int4a/tok/fp16/mse/had"], True, qm),
                            (by["fp16"], by["int4a/tok/fp16"], False, 1)):
        for tail in (False, True):
            jobs.append((("decode" if m == 1 else "prefill") + ("_tail" if tail else ""),
                         f"K {ks.fmt.label()}{' pre-RoPE' if kpre else ''} V {vs.fmt.label()} int8 window salient",
                         decode.paged_decode_kernel, decode_signature(ks, vs, tail),
                         decode_constexprs(ks, vs, Hq=rep * 8, D=D, rep=rep, block_n=decode_block_n(ks, vs, block_n), P=P,
                                           tail=tail, dot_fp16=True, key_pre_rope=kpre, qm=m, qb=4 if m > 1 else 1,
                                           fp_q=tail, k_sal=0 if ks.kind == KIND_FLOAT else 8, v_sal=8)))
    return jobs


def covering(jobs: list[tuple]) -> list[tuple]:
    """A subset of ``jobs`` in which every value each constexpr of each kernel takes in ``jobs``
    occurs at least once (greedy set cover: the specialisation with the most values not yet
    covered first, so the heaviest combinations -- rotated, pre-RoPE, int8-window tails -- come
    in early). Not every combination, but every code path of every kernel is compiled."""
    feats = [{(kname, key, value) for key, value in cx.items()} for kname, _, _, _, cx in jobs]
    todo = set().union(*feats)
    chosen: set[int] = set()
    while todo:
        best = max(range(len(jobs)), key=lambda i: len(feats[i] & todo))
        chosen.add(best)
        todo -= feats[best]
    return [j for i, j in enumerate(jobs) if i in chosen]  # in the original order


def compile_all(arch: int, *, full: bool = False, cover: bool = False, D: int = 128, P: int = 64, rep: int = 4,
                num_warps: int = 4, progress=None) -> list[Resource]:
    """Compile the kernel :func:`specialisations` (only a :func:`covering` subset of them with
    ``cover``) for ``sm_{arch}``; return the resource usage of each."""
    if interpreting():
        raise KernelError("AOT compilation needs TRITON_INTERPRET unset; use compile_in_subprocess()")
    jobs = specialisations(full=full, D=D, P=P, rep=rep)
    if cover:
        jobs = covering(jobs)
    out: list[Resource] = []
    for i, (kname, label, fn, sig, cx) in enumerate(jobs):
        attn = kname.startswith(("decode", "prefill"))
        warps = DECODE_WARPS if attn else store_warps(cx["BLOCK_R"], D, cx.get("COMP", False))
        c = _compile(fn, sig, cx, arch, warps, DECODE_MAXNREG, None if attn else STORE_OPTIONS)
        out.append(Resource(kname, label, arch, num_warps=warps, **resource_usage(c)))
        if progress:
            progress(i + 1, len(jobs))
    return out


def compile_in_subprocess(arch: int, *, full: bool = False, cover: bool = False, D: int = 128,
                          timeout: float = 1800) -> list[Resource]:
    """:func:`compile_all` in a fresh interpreter with ``TRITON_INTERPRET`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kverr.gpu.aot", "--arch", str(arch), "--head-dim", str(D), "--json"]
    if full:
        cmd.append("--full")
    if cover:
        cmd.append("--cover")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode:
        raise KernelError(f"AOT compilation for sm_{arch} failed:\n{res.stderr[-4000:]}")
    return [Resource(**r) for r in json.loads(res.stdout)]


def table(rows: list[Resource]) -> str:
    lines = [f"{'kernel':<12} {'sm':>3} {'warps':>5} {'regs':>4} {'smem':>6} {'stack':>5} {'local':>5}  specialisation"]
    for r in rows:
        lines.append(f"{r.kernel:<12} {r.arch:>3} {r.num_warps:>5} {r.registers:>4} {r.shared:>6} {r.stack:>5} {r.local:>5}  {r.spec}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kverr.gpu.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 or 80 (repeatable)")
    ap.add_argument("--full", action="store_true", help="every element format x every granularity")
    ap.add_argument("--cover", action="store_true",
                    help="only a covering subset: every value of every constexpr of each kernel at least once")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args(argv)
    rows = []
    for arch in a.arch or [90]:
        rows += compile_all(arch, full=a.full, cover=a.cover, D=a.head_dim,
                            progress=(lambda i, n: print(f"\r{i}/{n}", end="", file=sys.stderr)) if not a.json else None)
    if a.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print(table(rows))
    if a.out:
        Path(a.out).write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
