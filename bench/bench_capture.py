"""Benchmark: capture throughput as a ratio to the model's plain forward on the same tokens.

The floor is the plain forward of the default model's base (no LM head, no cache, explicit
positions): exactly the call :func:`kverr.capturing.capture` makes, without the hooks. Both run on
the same token ids in the same process, interleaved (forward, capture, forward, capture, ...)
after one warm-up of each, so that machine noise hits both alike; the ratio of the medians is
the figure of merit (target: capture <= 1.5x forward, all layers, writing excluded).
Writing the capture to zarr (:func:`kverr.io.write_dataset`, atomic) is timed separately.

Usage::

    python bench/bench_capture.py                       # 2048 tokens, prints the report
    python bench/bench_capture.py --tokens 4096 --write # also writes bench/results/capture-<date>.txt

In the registry (``python -m bench.run capture``): 2048 tokens, 5 repeats, one torch thread;
``--quick`` 512 tokens, 2 repeats.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kverr.capturing import capture, load_model, load_text, tokenize  # noqa: E402
from kverr.capturing.hooks import _base_model  # noqa: E402
from kverr.io import write_dataset  # noqa: E402

from bench.common import cpu_name  # noqa: E402


def timings(tokens: int, repeats: int, dtype: str = "float32") -> dict:
    """Interleaved forward and capture seconds, zarr write seconds, and what was written."""
    loaded = load_model("default")
    text = load_text("pydoc")
    ids = tokenize(loaded.tokenizer, text, tokens)
    ids_t = torch.as_tensor(ids)[None]
    pos = torch.arange(tokens)[None]
    base = _base_model(loaded.model)

    def forward() -> None:
        with torch.inference_mode():
            base(input_ids=ids_t, position_ids=pos, use_cache=False)

    def hooked() -> object:
        return capture(loaded, ids, dtype=dtype, text=text)

    forward()
    ds = hooked()
    t_fwd, t_cap = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward()
        t_fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ds = hooked()
        t_cap.append(time.perf_counter() - t0)

    t_write = []
    nbytes = sum(ds[v].nbytes for v in ds.data_vars)
    tmp = Path(tempfile.mkdtemp(prefix="kverr-bench-"))
    try:
        for i in range(max(2, repeats // 2)):
            t0 = time.perf_counter()
            write_dataset(ds, tmp / f"c{i}.zarr")
            t_write.append(time.perf_counter() - t0)
        disk = sum(p.stat().st_size for p in (tmp / "c0.zarr").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dict(loaded=loaded, ds=ds, t_fwd=t_fwd, t_cap=t_cap, t_write=t_write, nbytes=nbytes, disk=disk)


def measure(quick: bool) -> list:
    """Registry entry: capture time as a ratio to the plain forward, and the zarr write."""
    from bench.common import Row

    torch.set_num_threads(1)
    tokens, repeats = (512, 2) if quick else (2048, 5)
    r = timings(tokens, repeats)
    fwd, cap, wr = (statistics.median(r[k]) for k in ("t_fwd", "t_cap", "t_write"))
    case = f"default model, {tokens} tokens, all layers"
    return [Row(case, "capture_vs_forward", cap / fwd, "ratio"), Row(case, "forward", fwd * 1e3, "ms"),
            Row(case, "capture", cap * 1e3, "ms"), Row(case, "zarr_write", r["nbytes"] / 2**20 / wr, "MiB/s")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--write", action="store_true", help="write bench/results/capture-<date>.txt")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = timings(args.tokens, args.repeats, args.dtype)
    loaded, ds, t_fwd, t_cap, t_write = r["loaded"], r["ds"], r["t_fwd"], r["t_cap"], r["t_write"]
    nbytes, disk = r["nbytes"], r["disk"]
    fwd, cap, wr = (statistics.median(t) for t in (t_fwd, t_cap, t_write))
    now = _dt.datetime.now(_dt.UTC)
    lines = [
        f"kverr capture benchmark, {now:%Y-%m-%d %H:%M} UTC",
        f"machine: {' '.join(platform.uname())}",
        f"cpu: {cpu_name()}, {os.cpu_count()} logical cpus, torch threads {torch.get_num_threads()}, "
        f"load average at start {os.getloadavg()[0]:.2f}",
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {ds.attrs['transformers_version']}",
        f"model: {loaded.model_id} ({loaded.n_layers} layers, {loaded.n_q_heads} q / "
        f"{loaded.n_kv_heads} kv heads, head dim {loaded.head_dim}), float32 compute",
        f"tokens: {args.tokens} of pydoc, all layers captured, storage {args.dtype}; "
        f"median of {args.repeats} interleaved runs after a warm-up",
        "",
        f"plain forward (base model, no hooks): {fwd * 1e3:9.1f} ms   ({args.tokens / fwd:8.0f} tokens/s)",
        f"capture (hooks + copies, no write):   {cap * 1e3:9.1f} ms   ({args.tokens / cap:8.0f} tokens/s)",
        f"ratio capture / forward:              {cap / fwd:9.3f}     (target <= 1.5)",
        f"write to zarr (atomic, separate):     {wr * 1e3:9.1f} ms   "
        f"({nbytes / 2**20:.0f} MiB in memory -> {disk / 2**20:.0f} MiB on disk, "
        f"{nbytes / 2**20 / wr:.0f} MiB/s)",
        f"runs (ms): forward {[round(t * 1e3) for t in t_fwd]}, capture {[round(t * 1e3) for t in t_cap]}, "
        f"write {[round(t * 1e3) for t in t_write]}",
    ]
    report = "\n".join(lines)
    print(report)
    if args.write:
        out = ROOT / "bench" / "results" / f"capture-{now:%Y-%m-%d}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python bench/bench_capture.py " + " ".join(sys.argv[1:])
        uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
        out.write_text(f"{report}\nuname -a: {uname}\ncommand: {cmd}\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
