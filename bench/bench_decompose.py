"""Benchmark: error decomposition vs plain attention on the default model's shapes.

Shapes (SmolLM2-135M): 30 layers, 9 query heads sharing 3 kv heads, head dim 64, a 4096-token
context and the last 256 positions as queries. Synthetic data (timing does not depend on values).

Two floors are timed in the same run, on the same tensors, with the same GQA grouping:

* ``matmuls``: the two attention matmuls alone (q·Kᵀ and a·V), no softmax;
* ``attention``: plain causal attention (scale, mask, softmax, a·V), what a model computes.

The decomposition is :func:`kverr.error.decompose_stream` exactly as the capture layer calls
it: all four terms, the total and every per-query metric. Each timing is the minimum of
``--repeats`` interleaved full passes over the 30 layers after one warm-up pass.

Usage::

    python bench/bench_decompose.py                 # prints the report
    python bench/bench_decompose.py --write         # also appends to bench/results/decompose-<date>.txt
    python bench/bench_decompose.py --memory        # peak RSS of a 32k-token, 512-query run

In the registry (``python -m bench.run decompose``): these shapes, 3 repeats, one torch thread, and
the memory run; ``--quick`` 1024 tokens, 64 queries, 1 repeat, no memory run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from kverr.error import decompose_stream  # noqa: E402

LAYERS, HQ, HKV, D, T, Q = 30, 9, 3, 64, 4096, 256


def _data(dtype: torch.dtype, T: int = T, Q: int = Q):
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        q = torch.randn(HQ, Q, D, generator=g, dtype=dtype)
        k = 2 * torch.randn(HKV, T, D, generator=g, dtype=dtype)
        v = torch.randn(HKV, T, D, generator=g, dtype=dtype)
        kh = k + 0.05 * torch.randn(k.shape, generator=g, dtype=dtype)
        vh = v + 0.05 * torch.randn(v.shape, generator=g, dtype=dtype)
        layers.append((q, k, v, kh, vh))
    return layers


KV_OF_Q = [h // (HQ // HKV) for h in range(HQ)]


def _grouped(q: torch.Tensor) -> torch.Tensor:
    # [HQ, Q, D] -> [HKV, G·Q, D]: the layout any efficient GQA attention uses
    return q.reshape(HKV, -1, D)


def floor_matmuls(layers, mask):
    for q, k, v, _, _ in layers:
        s = _grouped(q) @ k.mT
        _ = s @ v


def floor_attention(layers, mask):
    scale = D**-0.5
    for q, k, v, _, _ in layers:
        s = (_grouped(q) * scale) @ k.mT
        s = s.masked_fill(mask, float("-inf"))
        a = torch.softmax(s, dim=-1)
        _ = a @ v


def decomposition(layers, mask):
    for q, k, v, kh, vh in layers:
        decompose_stream(q, k, v, kh, vh, causal=True, kv_head_of_q=KV_OF_Q)


def timing(repeats: int, dtype: torch.dtype, T: int = T, Q: int = Q) -> dict:
    """Minimum over ``repeats`` interleaved rounds (the machine is shared: the minimum is the
    least disturbed run, and interleaving exposes all three to the same background load)."""
    layers = _data(dtype, T, Q)
    qpos = torch.arange(T - Q, T).repeat(HQ // HKV)
    mask = torch.arange(T)[None, :] > qpos[:, None]  # [G·Q, T], True where hidden
    fns = {"matmuls_s": floor_matmuls, "attention_s": floor_attention,
           "decompose_s": decomposition}
    ts: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(layers, mask)  # warm-up
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(layers, mask)
                ts[name].append(time.perf_counter() - t0)
    res = {k: min(v) for k, v in ts.items()}
    res["spread"] = {k: (statistics.median(v) / min(v)) for k, v in ts.items()}
    res["ratio_vs_attention"] = res["decompose_s"] / res["attention_s"]
    res["ratio_vs_matmuls"] = res["decompose_s"] / res["matmuls_s"]
    return res


_MEM = """
import json, resource, time, torch
from kverr.error import decompose_stream
T, Q, D = 32768, 512, 64
g = torch.Generator().manual_seed(0)
q = torch.randn(1, Q, D, generator=g); k = torch.randn(1, T, D, generator=g)
v = torch.randn(1, T, D, generator=g)
kh = k + 0.05 * torch.randn(k.shape, generator=g); vh = v + 0.05 * torch.randn(v.shape, generator=g)
def hwm():
    # VmHWM is this process's own peak; ru_maxrss would inherit the parent's RSS across exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = hwm()
t0 = time.perf_counter(); d = decompose_stream(q, k, v, kh, vh, causal=True)
dt = time.perf_counter() - t0
peak = hwm()
print(json.dumps({"peak_rss_mib": round(peak / 1024, 1), "rss_before_mib": round(base / 1024, 1),
                  "seconds": round(dt, 2)}))
"""


def memory() -> dict:
    out = subprocess.run([sys.executable, "-c", _MEM], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(quick: bool) -> list:
    """Registry entry: decomposition time as a ratio to plain attention (and to the two matmuls);
    in full mode also the peak RSS of the streamed 32k-token, 512-query run."""
    from bench.common import Row

    torch.set_num_threads(1)
    t, q, repeats = (1024, 64, 1) if quick else (T, Q, 3)
    r = timing(repeats, torch.float32, t, q)
    case = f"{LAYERS} layers, {t} tokens, {q} queries, float32"
    rows = [Row(case, "decompose_vs_attention", r["ratio_vs_attention"], "ratio"),
            Row(case, "decompose_vs_matmuls", r["ratio_vs_matmuls"], "ratio"),
            Row(case, "decompose", r["decompose_s"], "s"), Row(case, "attention", r["attention_s"], "s")]
    if not quick:
        m = memory()
        rows.append(Row("1 layer, 32768 tokens, 512 queries, streamed", "peak_rss", m["peak_rss_mib"], "MiB"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's own choice)")
    ap.add_argument("--memory", action="store_true", help="also measure the 32k/512 peak RSS")
    ap.add_argument("--write", action="store_true", help="append to bench/results/decompose-DATE.txt")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    now = _dt.datetime.now(_dt.timezone.utc)
    lines = [
        f"# kverr decomposition benchmark, {now:%Y-%m-%d %H:%M} UTC",
        f"# machine: {machine()}",
        f"# command: python bench/bench_decompose.py {' '.join(argv or sys.argv[1:])}",
        f"# shape: {LAYERS} layers, {HQ} q heads / {HKV} kv heads, head dim {D}, "
        f"{T} tokens, {Q} queries per head (causal, last {Q} positions), {args.dtype}",
    ]
    r = timing(args.repeats, dtype)
    lines += [
        f"floor_matmuls_s      {r['matmuls_s']:.3f}   (q·Kᵀ and a·V only)",
        f"floor_attention_s    {r['attention_s']:.3f}   (scale, causal mask, softmax, a·V)",
        f"decompose_s          {r['decompose_s']:.3f}   (four terms, total, all per-query metrics)",
        f"ratio_vs_attention   {r['ratio_vs_attention']:.2f}x   (target <= 3x)",
        f"ratio_vs_matmuls     {r['ratio_vs_matmuls']:.2f}x",
        "median/min per timing: " + ", ".join(f"{k} {v:.2f}" for k, v in r["spread"].items()),
    ]
    if args.memory:
        m = memory()
        lines.append(
            f"memory_32k_512q      peak RSS {m['peak_rss_mib']} MiB (process, incl. "
            f"{m['rss_before_mib']} MiB before the call), {m['seconds']} s, float32, streamed"
        )
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.write:
        out = Path(__file__).parent / "results" / f"decompose-{now:%Y-%m-%d}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        # several runs on one day (e.g. thread counts) accumulate in that day's file
        prev = out.read_text() + "\n" if out.exists() else ""
        tmp = out.with_suffix(".tmp")
        tmp.write_text(prev + text)
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
