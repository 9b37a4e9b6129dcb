"""Decode-attention speed on a GPU: kverr's paged quantized kernels vs fp16 torch SDPA.

Measures (one process, well under 8 minutes on an H200):
  * copy bandwidth (device-to-device copy of 2 GiB; read + write bytes / time);
  * decode time per layer for fp16 SDPA and for the kernel at fp16, int8, int4, int2 (KIVI) and
    a mixed per-head config, at 4k, 32k and 128k tokens, batch 1 and 16
    (Llama-3-8B attention shape: 32 query heads, 8 kv heads, head dim 128);
  * bytes the kernel reads (codes + scales + zeros + window) / time as a fraction of the copy
    bandwidth, and the speedup over fp16 SDPA.
Writes bench/results/gpu-decode-<date>.json and .txt. Run through bench/gpu/run.sh.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kverr.config import PRESETS, CacheConfig, Override
from kverr.gpu import PagedKVCache
from kverr.quant import PerChannel, PerToken, PerTokenGroup, float_format, int_format

HQ, H, D = 32, 8, 128
CONTEXTS = [4096, 32768, 131072]
BATCHES = [1, 16]
OUT = Path(__file__).resolve().parents[1] / "results"


def configs() -> dict[str, CacheConfig]:
    int4 = int_format(4, PerTokenGroup(64))
    return {
        "fp16": PRESETS["fp16"],
        "int8": CacheConfig(k=int_format(8, PerToken()), v=int_format(8, PerToken()), window=0),
        "int4": CacheConfig(k=int4, v=int4, window=128),
        "int2-kivi": PRESETS["kivi-2"],
        "mixed": CacheConfig(k=int4, v=int4, window=128,
                             heads={(0, h): Override(k=int_format(8, PerToken()), v=int_format(8, PerToken())) for h in (0, 1)}),
    }


def timed(fn, iters=20, warmup=3) -> float:
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


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of fp16
    a = torch.empty(n, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), iters=10)
    return 2 * a.numel() * 2 / t


def kernel_bytes(cache: PagedKVCache, T: int, B: int) -> int:
    """Bytes a decode step reads: the codes, scales and zeros of the quantized tokens and the
    full-precision tokens, every kv head, both K and V."""
    total = 0
    for which in ("k", "v"):
        for pool in cache.pools[0][which]:
            s = pool.spec
            end = int(cache.region_end(T, s.tb))
            n_q, n_fp = end - min(cache.S, T), T - (end - min(cache.S, T))
            h = len(pool.heads)
            total += B * h * n_q * s.cb * pool.codes.element_size()
            if pool.scale is not None and not s.static:
                per_tok = pool.scale.shape[-1] * pool.scale.element_size() / s.bts
                total += int(B * h * n_q * per_tok * (2 if pool.zero is not None else 1))
            total += B * h * n_fp * D * pool.fp.element_size()
    return total


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    t_start = time.time()
    bw = copy_bandwidth()
    print(f"{props.name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for T in CONTEXTS:
        for B in BATCHES:
            if time.time() - t_start > 400:
                print("time budget reached; stopping", flush=True)
                break
            q = torch.randn(B, HQ, D, device=dev, dtype=torch.float16, generator=gen)
            k = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            v = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=gen)
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
            sdpa_bytes = 2 * B * H * T * D * 2
            rows.append(dict(impl="torch-sdpa-fp16", config="fp16", T=T, B=B, seconds=t_sdpa, bytes=sdpa_bytes,
                             frac_bw=sdpa_bytes / t_sdpa / bw, speedup=1.0))
            print(f"T={T} B={B} sdpa {t_sdpa * 1e6:.0f} us", flush=True)
            for name, cfg in configs().items():
                cache = PagedKVCache(cfg, n_layers=1, n_kv_heads=H, n_q_heads=HQ, head_dim=D, max_batch=B,
                                     max_tokens=T, device=dev, dot_fp16=True)
                step = cache.plan([T - 1] * B)
                cache.store(step, 0, k[:, :, : T - 1].permute(0, 2, 1, 3).reshape(-1, H, D),
                            v[:, :, : T - 1].permute(0, 2, 1, 3).reshape(-1, H, D))
                step = cache.plan([1] * B)
                t_store = timed(lambda: cache.store(step, 0, k[:, :, T - 1:].permute(0, 2, 1, 3).reshape(-1, H, D),
                                                     v[:, :, T - 1:].permute(0, 2, 1, 3).reshape(-1, H, D)), iters=5, warmup=1)
                out = torch.empty_like(q)
                t_dec = timed(lambda: cache.decode(step, 0, q, out=out))
                nbytes = kernel_bytes(cache, T, B)
                rows.append(dict(impl="kverr-triton", config=name, T=T, B=B, seconds=t_dec, bytes=nbytes,
                                 frac_bw=nbytes / t_dec / bw, speedup=t_sdpa / t_dec, store_seconds=t_store,
                                 splits=step.num_splits))
                print(f"T={T} B={B} {name:>10}: {t_dec * 1e6:8.0f} us  {nbytes / t_dec / 1e9:6.0f} GB/s "
                      f"({nbytes / t_dec / bw:5.1%} of copy)  x{t_sdpa / t_dec:.2f} vs SDPA  splits {step.num_splits}", flush=True)
                del cache, step
                torch.cuda.empty_cache()
            del k, v
            torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    meta = dict(date=date, device=props.name, torch=torch.__version__, triton=__import__("triton").__version__,
                copy_bandwidth_Bps=bw, shape=dict(q_heads=HQ, kv_heads=H, head_dim=D))
    (OUT / f"gpu-decode-{date}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [f"# {props.name}, {date}, torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s",
             f"{'impl':<16} {'config':<10} {'T':>7} {'B':>3} {'us':>9} {'GB/s':>7} {'of copy':>8} {'vs SDPA':>8}"]
    for r in rows:
        lines.append(f"{r['impl']:<16} {r['config']:<10} {r['T']:>7} {r['B']:>3} {r['seconds'] * 1e6:>9.0f} "
                     f"{r['bytes'] / r['seconds'] / 1e9:>7.0f} {r['frac_bw']:>8.1%} {r['speedup']:>8.2f}")
    (OUT / f"gpu-decode-{date}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
