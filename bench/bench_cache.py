"""Decode-step time at a 2k context: KverrCache vs the unquantized cache vs quanto, as ratios.

Every cache is prefilled with the same ``--context`` tokens of pydoc text on the bundled model;
then decode steps are timed interleaved (one step of each cache in turn, ``--steps`` rounds),
so that machine noise hits all alike; medians are reported with their ratio to the unquantized
cache measured in the same run. The CPU reference path dequantizes the whole quantized history
at every step, as transformers' quantized cache does; the kernel path (kverr.gpu) fuses that
into attention on a GPU.

    .venv/bin/python bench/bench_cache.py [--context 2048] [--steps 24] [--threads 1] [--out FILE]

In the registry (``python -m bench.run cache``): these defaults; ``--quick`` 512 tokens, 8 steps and
no quanto peer (its first use builds a C++ extension).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from kverr.capturing import load_model, load_text, tokenize  # noqa: E402
from kverr.evaluation import Scheme, make_cache, parse_schemes  # noqa: E402
from kverr.hf import cache_kwarg  # noqa: E402


FULL_SCHEMES = "int4-token-g64,kivi-4,kivi-2,q8_0,fp8-e4m3-head,quanto-int4,quanto-int2"


def step_times(context: int, steps: int, schemes: str) -> dict[str, float]:
    """Median seconds per decode step of every cache, the unquantized one first."""
    lm = load_model("default")
    model = lm.model
    ids = torch.as_tensor(tokenize(lm.tokenizer, load_text("pydoc"), context + steps, offset=5000))
    all_schemes = [Scheme("unquantized", "reference"), *parse_schemes(schemes.split(","))]
    kw = cache_kwarg(model)
    caches = {}
    with torch.no_grad():
        for s in all_schemes:
            caches[s.name] = make_cache(s, model)
            model(ids[None, :context], use_cache=True, **{kw: caches[s.name]})
            if hasattr(caches[s.name], "flush"):
                caches[s.name].flush()
        times = {s.name: [] for s in all_schemes}
        for t in range(context, context + steps):
            for s in all_schemes:
                t0 = time.perf_counter()
                model(ids[None, t : t + 1], use_cache=True, **{kw: caches[s.name]})
                times[s.name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(quick: bool) -> list:
    """Registry entry: each cache's decode step as a ratio to the unquantized cache's, one thread."""
    from bench.common import Row

    torch.set_num_threads(1)
    context, steps = (512, 8) if quick else (2048, 24)
    schemes = "int4-token-g64,kivi-4,q8_0" if quick else FULL_SCHEMES
    med = step_times(context, steps, schemes)
    rows = []
    for name, m in med.items():
        case = f"{name}, decode step at {context} tokens"
        rows += [Row(case, "step_vs_unquantized", m / med["unquantized"], "ratio"), Row(case, "step", m * 1e3, "ms")]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schemes", default=FULL_SCHEMES)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    med = step_times(args.context, args.steps, args.schemes)
    base = med["unquantized"]
    lines = [
        f"# bench_cache: decode-step time at {args.context} tokens of context, default model, CPU reference path",
        f"# date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# machine {machine()}",
        f"# command: .venv/bin/python bench/bench_cache.py --context {args.context} --steps {args.steps} --threads {args.threads}",
        f"{'cache':18s} {'median ms/step':>15s} {'ratio to unquantized':>21s}",
    ]
    for name, m in med.items():
        lines.append(f"{name:18s} {m * 1e3:15.1f} {m / base:21.2f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
