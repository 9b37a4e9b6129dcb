"""Decode-step time at a 2k context: KverrCache vs the unquantized cache vs quanto, as ratios.

Every cache is prefilled with the same ``--context`` tokens of pydoc text on the bundled model;
then decode steps are timed interleaved (one step of each cache in turn, ``--steps`` rounds),
so that machine noise hits all alike; medians are reported with their ratio to the unquantized
cache measured in the same run. The CPU reference path dequantizes the whole quantized history
at every step, as transformers' quantized cache does; the kernel path (kverr.gpu) fuses that
into attention on a GPU.

    .venv/bin/python bench/bench_cache.py [--context 2048] [--steps 24] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from bench_quant import machine
from kverr.capturing import load_model, load_text, tokenize
from kverr.evaluation import Scheme, _cache_kwarg, make_cache, parse_schemes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schemes", default="int4-token-g64,kivi-4,kivi-2,q8_0,fp8-e4m3-head,quanto-int4,quanto-int2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("default")
    model = lm.model
    ids = torch.as_tensor(tokenize(lm.tokenizer, load_text("pydoc"), args.context + args.steps, offset=5000))
    schemes = [Scheme("unquantized", "reference"), *parse_schemes(args.schemes.split(","))]
    kw = _cache_kwarg(model)
    caches = {}
    with torch.no_grad():
        for s in schemes:
            caches[s.name] = make_cache(s, model)
            model(ids[None, : args.context], use_cache=True, **{kw: caches[s.name]})
            if hasattr(caches[s.name], "flush"):
                caches[s.name].flush()
        times = {s.name: [] for s in schemes}
        for t in range(args.context, args.context + args.steps):
            for s in schemes:
                t0 = time.perf_counter()
                model(ids[None, t : t + 1], use_cache=True, **{kw: caches[s.name]})
                times[s.name].append(time.perf_counter() - t0)
    base = statistics.median(times["unquantized"])
    lines = [
        f"# bench_cache: decode-step time at {args.context} tokens of context, default model, CPU reference path",
        f"# date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# machine {machine()}",
        f"# command: .venv/bin/python bench/bench_cache.py --context {args.context} --steps {args.steps} --threads {args.threads}",
        f"{'cache':18s} {'median ms/step':>15s} {'ratio to unquantized':>21s}",
    ]
    for s in schemes:
        m = statistics.median(times[s.name])
        lines.append(f"{s.name:18s} {m * 1e3:15.1f} {m / base:21.2f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
