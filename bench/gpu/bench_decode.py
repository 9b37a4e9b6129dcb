"""Decode-attention speed on a GPU: kverr's paged quantized kernels beside fp16 torch SDPA and
beside what ``kverr plan`` predicts (:mod:`kverr.cost`).

Measures in one process (under 8 minutes on an H200):

1. copy bandwidth (device-to-device copy of 2 GiB; read + write bytes over time);
2. one layer of the Llama-3-8B attention shape (32 query heads, 8 kv heads, head dim 128): fp16
   SDPA and the kernels at fp16, int8, int4, kivi-2 and a mixed per-head config, at 4k, 32k and
   128k tokens x batch 1 and 16: decode launched eagerly and replayed from a CUDA graph;
3. every layer of the bundled model's shape (30 layers, 9 query heads, 3 kv heads, head dim 64):
   the committed calibrated configs at 3 and 4.5 bits and their one-group variants
   (``--max-groups-per-layer 1``), ``salient-2.5b`` beside the same formats without salient
   tokens (what the 8 salient rows cost a decode step), the fp16 and int8-token presets, at 4k and
   32k tokens x batch 1 and 16: the decode of all layers from one CUDA graph, and one eager step
   (store + decode).

Each case prints measured and predicted time (the plan's decode launches, with the measured copy
bandwidth) and their ratio; the per-launch device cost is then fitted by least squares over the
graph cases (measured minus the plan's roofline = launches x cost). Writes
``bench/results/gpu-decode-<date>.json`` and ``.txt``. Run through ``bench/gpu/run.sh``;
``--smoke`` runs tiny shapes on the CPU interpreter (no graphs) to check the script itself.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kverr.config import PRESETS, CacheConfig, Override  # noqa: E402
from kverr.cost import DECODE_KINDS, GPUS, OVERHEADS, fp16_step, step_cost  # noqa: E402
from kverr.gpu import PagedKVCache, calibrate_static_scales  # noqa: E402
from kverr.memory import DEFAULT_SHAPE, ModelShape  # noqa: E402
from kverr.quant import PerToken, PerTokenGroup, int_format  # noqa: E402
from kverr.quant.store import salient_candidates  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results"
LLAMA = ModelShape(1, 8, 128, name="Llama-3-8B attention (one layer)", n_q_heads=32)
CONTEXTS, BATCHES, MODEL_CONTEXTS = [4096, 32768, 131072], [1, 16], [4096, 32768]
DEADLINE_S = 330  # no new case after this many seconds (the call has 8 minutes in all)
if SMOKE:
    LLAMA = ModelShape(1, 2, 32, name="smoke", n_q_heads=4)
    CONTEXTS, BATCHES, MODEL_CONTEXTS = [40], [2], [40]


def llama_configs() -> dict[str, CacheConfig]:
    int4 = int_format(4, PerTokenGroup(64 if not SMOKE else 32))
    i8 = int_format(8, PerToken())
    return {
        "fp16": PRESETS["fp16"],
        "int8": CacheConfig(name="int8", k=i8, v=i8, window=0),
        "int4": CacheConfig(name="int4", k=int4, v=int4, window=128),
        "int2-kivi": PRESETS["kivi-2"],
        "mixed": CacheConfig(name="mixed", k=int4, v=int4, window=128,
                             heads={(0, h): Override(k=i8, v=i8) for h in (0, 1)}),
    }


def model_configs() -> dict[str, CacheConfig]:
    cfgs = {n: PRESETS[n] for n in ("fp16", "int8-token")}
    for b in ("3", "4.5"):
        for suffix in ("", "-g1"):
            c = CacheConfig.load(ROOT / "data" / "configs" / f"calibrated-{b}b{suffix}.json")
            cfgs[c.name] = c
    sal = CacheConfig.load(ROOT / "data" / "configs" / "salient-2.5b.json")
    cfgs[sal.name] = sal
    cfgs[f"{sal.name} without salient"] = sal.with_(salient=0)
    return cfgs


def timed(fn, iters=20, warmup=3) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def graph_timed(fn, iters=50) -> tuple[float | None, str]:
    """Mean time of ``fn`` replayed from a CUDA graph (None and why, when capture fails)."""
    if SMOKE:
        return None, "no graphs on the interpreter"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return timed(g.replay, iters=iters), ""
    except Exception as exc:  # report, do not stop the benchmark
        return None, f"{type(exc).__name__}: {exc}"[:200]


def copy_bandwidth(dev) -> float:
    if SMOKE:
        return GPUS["h200"].bandwidth
    n = 1 << 30  # 2 GiB of fp16
    a = torch.randn(n, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), iters=10)
    return 2 * n * 2 / t


def filled(cfg, shape: ModelShape, T: int, B: int, dev, k, v) -> tuple[PagedKVCache, object]:
    """A cache holding ``T`` tokens per sequence in every layer, its last step planned and stored."""
    H, D, L = shape.n_kv_heads, shape.head_dim, shape.n_layers
    # static scales (calibrated configs at low bits) from the first tokens, the same for every layer
    n = min(T, 1024)
    static = calibrate_static_scales(cfg, [k[:, :, :n].float()] * L, [v[:, :, :n].float()] * L)
    cache = PagedKVCache(cfg, n_layers=L, n_kv_heads=H, n_q_heads=shape.n_q_heads, head_dim=D,
                         max_batch=B, max_tokens=T, device=dev, dot_fp16=True, static_scales=static,
                         rope=_rope(T, D, dev) if cfg.key_pre_rope else None)
    rows = lambda x: x.permute(0, 2, 1, 3).reshape(-1, H, D)  # noqa: E731
    step = cache.plan([T - 1] * B)
    salient = None
    if cfg.salient:  # evenly spread over the tokens the prefill quantizes (no queries here)
        spans = [salient_candidates(T - 1, cfg, layer, h) for layer in range(L) for h in range(H)]
        lo, hi = max(s[0] for s in spans), min(s[1] for s in spans)
        pos = torch.linspace(lo, hi - 1, min(cfg.salient, hi - lo)).long().unique()
        salient = pos.expand(B, H, pos.numel())
    for layer in range(shape.n_layers):
        cache.store(step, layer, rows(k[:, :, : T - 1]), rows(v[:, :, : T - 1]), salient=salient)
    step = cache.plan([1] * B)
    for layer in range(shape.n_layers):
        cache.store(step, layer, rows(k[:, :, T - 1:]), rows(v[:, :, T - 1:]))
    return cache, step


def _rope(T: int, D: int, dev):
    inv = 1.0 / (1e5 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=1)
    return ang.cos().to(dev), ang.sin().to(dev)


def gpu_of(name: str, bw: float):
    key = "h100" if "H100" in name else "a100" if "A100" in name else "h200"
    return dataclasses.replace(GPUS[key], bandwidth=bw, source=f"{GPUS[key].source}; bandwidth measured here")


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke on the CPU interpreter)")
    name = "interpreter (smoke)" if SMOKE else torch.cuda.get_device_properties(dev).name
    t0 = time.time()
    bw = copy_bandwidth(dev)
    gpu = gpu_of(name, bw)
    print(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)

    def case(part, shape, cfg_name, cfg, T, B, q, k, v, t_sdpa):
        cache, step = filled(cfg, shape, T, B, dev, k, v)
        out = torch.empty_like(q)

        def decode_all():
            for layer in range(shape.n_layers):
                cache.decode(step, layer, q, out=out)

        t_eager = timed(decode_all)
        t_graph, why = graph_timed(decode_all)
        plan = step_cost(cfg, shape, T, B, gpu)
        pred = plan.decode_seconds()
        n_dec = sum(ln.count for lc in plan.layers for ln in lc.launches if ln.kind in DECODE_KINDS)
        row = dict(part=part, config=cfg_name, T=T, B=B, eager_s=t_eager, graph_s=t_graph, graph_error=why,
                   predicted_s=pred, decode_launches=n_dec, bytes=plan.total_bytes,
                   roofline_s=pred - n_dec * OVERHEADS.launch_device, splits=step.num_splits,
                   speedup_vs_sdpa=None if t_sdpa is None else t_sdpa / (t_graph or t_eager))
        rows.append(row)
        meas = t_graph or t_eager
        print(f"[{part}] T={T} B={B} {cfg_name:>18}: eager {t_eager * 1e6:8.1f} us, graph "
              f"{'-' if t_graph is None else f'{t_graph * 1e6:8.1f}'} us, predicted {pred * 1e6:8.1f} us "
              f"(x{meas / pred:.2f}), {plan.total_bytes / meas / 1e9:6.0f} GB/s"
              + ("" if t_sdpa is None else f", x{t_sdpa / meas:.2f} vs SDPA") + (f"  [{why}]" if why else ""),
              flush=True)

    # part 2: one layer of the Llama-3-8B attention shape, beside SDPA
    H, Hq, D = LLAMA.n_kv_heads, LLAMA.n_q_heads, LLAMA.head_dim
    for T in CONTEXTS:
        for B in BATCHES:
            if time.time() - t0 > DEADLINE_S / 2:
                print("part 2: time budget reached; stopping", flush=True)
                break
            q = torch.randn(B, Hq, D, device=dev, dtype=torch.float16, generator=gen)
            k = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            v = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
            ref = fp16_step(LLAMA, T, B, gpu).decode_seconds()
            rows.append(dict(part="llama", config="torch-sdpa-fp16", T=T, B=B, eager_s=t_sdpa, graph_s=None,
                             predicted_s=ref, decode_launches=1, bytes=2 * B * H * T * D * 2))
            print(f"[llama] T={T} B={B} sdpa {t_sdpa * 1e6:.1f} us (predicted {ref * 1e6:.1f} us)", flush=True)
            for cname, cfg in llama_configs().items():
                case("llama", LLAMA, cname, cfg, T, B, q, k, v, t_sdpa)
            q = k = v = None  # free the inputs before the next case allocates
            if not SMOKE:
                torch.cuda.empty_cache()
    # part 3: every layer of the bundled model's shape, the calibrated configs and their one-group variants
    shape = DEFAULT_SHAPE
    H, Hq, D = shape.n_kv_heads, shape.n_q_heads, shape.head_dim
    for T in MODEL_CONTEXTS:
        for B in BATCHES:
            if time.time() - t0 > DEADLINE_S:
                print("part 3: time budget reached; stopping", flush=True)
                break
            q = torch.randn(B, Hq, D, device=dev, dtype=torch.float16, generator=gen)
            k = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            v = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            for cname, cfg in model_configs().items():
                case("model", shape, cname, cfg, T, B, q, k, v, None)
            q = k = v = None  # free the inputs before the next case allocates
            if not SMOKE:
                torch.cuda.empty_cache()
    # the per-launch device cost, fitted over the graph cases: measured - roofline = launches x c
    pts = [(r["decode_launches"], r["graph_s"] - r["roofline_s"]) for r in rows if r.get("graph_s") and "roofline_s" in r]
    fit = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts) if pts else None
    OUT.mkdir(parents=True, exist_ok=True)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    meta = dict(date=date, device=name, torch=torch.__version__, triton=__import__("triton").__version__,
                copy_bandwidth_Bps=bw, launch_device_fit_s=fit, launch_device_assumed_s=OVERHEADS.launch_device,
                smoke=SMOKE)
    stem = f"gpu-decode-{date}" + ("-smoke" if SMOKE else "")
    (OUT / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [f"# {name}, {date}, torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s; per-launch device "
             f"cost fitted {'-' if fit is None else f'{fit * 1e6:.2f} us'} (assumed {OVERHEADS.launch_device * 1e6:.2f} us)",
             f"{'part':<6} {'config':<18} {'T':>7} {'B':>3} {'eager us':>9} {'graph us':>9} {'pred us':>9} "
             f"{'meas/pred':>9} {'vs SDPA':>8}"]
    for r in rows:
        meas = r.get("graph_s") or r["eager_s"]
        g = "-" if not r.get("graph_s") else f"{r['graph_s'] * 1e6:.1f}"
        sp = "-" if r.get("speedup_vs_sdpa") is None else f"{r['speedup_vs_sdpa']:.2f}"
        lines.append(f"{r['part']:<6} {r['config']:<18} {r['T']:>7} {r['B']:>3} {r['eager_s'] * 1e6:>9.1f} {g:>9} "
                     f"{r['predicted_s'] * 1e6:>9.1f} {meas / r['predicted_s']:>9.2f} {sp:>8}")
    (OUT / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
