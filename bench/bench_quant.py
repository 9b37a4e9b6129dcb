"""Reference quantize+dequantize throughput as a ratio to a plain copy of the same tensor.

For every preset, K and V of one layer of the default model at T tokens ([3, T, 64] float32
each) go through ``quantize`` then ``dequantize`` with the preset's formats; the floor is
``torch.clone`` of the same tensors, timed in the same run, interleaved, best of N. The ratio
is what the machine's noise cannot move much; absolute times are printed for context.

    .venv/bin/python bench/bench_quant.py [--tokens 4096] [--repeats 7] [--out FILE]

In the registry (``python -m bench.run quant``): 4096 tokens, 7 repeats; ``--quick`` 1024, 3.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from kverr.config import PRESETS  # noqa: E402
from kverr.quant import dequantize, quantize  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timings(tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Best quantize+dequantize and copy seconds per preset, interleaved."""
    torch.manual_seed(0)
    k = torch.randn(3, tokens, 64)
    v = torch.randn(3, tokens, 64)
    out = {}
    for name, cfg in PRESETS.items():
        def qdq():
            for x, fmt in ((k, cfg.k), (v, cfg.v)):
                dequantize(quantize(x, fmt, page_size=cfg.page_size))

        def copy():
            k.clone()
            v.clone()

        qdq(), copy()  # warm up
        tq, tc = [], []
        for _ in range(repeats):  # interleave so that noise hits both alike
            tq.append(best(qdq, 1))
            tc.append(best(copy, 1))
        out[name] = (min(tq), min(tc))
    return out


def measure(quick: bool) -> list:
    """Registry entry: ratio to a copy and milliseconds per preset, one torch thread."""
    from bench.common import Row

    torch.set_num_threads(1)
    tokens, repeats = (1024, 3) if quick else (4096, 7)
    rows = []
    for name, (q, c) in timings(tokens, repeats).items():
        case = f"{name}, [3, {tokens}, 64] K and V"
        rows += [Row(case, "quant_dequant_vs_copy", q / c, "ratio"), Row(case, "quant_dequant", q * 1e3, "ms")]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: on a shared 2-core machine the thread pool's "
        "synchronisation, not the work, dominates small ops)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    nbytes = 2 * 3 * args.tokens * 64 * 4
    lines = [
        f"# bench_quant: reference quantize+dequantize vs copy, K and V of one layer [3, {args.tokens}, 64] fp32",
        f"# date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# machine {machine()}",
        f"# command: .venv/bin/python bench/bench_quant.py --tokens {args.tokens} --repeats {args.repeats} --threads {args.threads}",
        f"{'preset':18s} {'quant+dequant ms':>17s} {'copy ms':>9s} {'ratio':>8s} {'GB/s':>7s}",
    ]
    for name, (q, c) in timings(args.tokens, args.repeats).items():
        lines.append(f"{name:18s} {q * 1e3:17.2f} {c * 1e3:9.3f} {q / c:8.1f} {nbytes / q / 1e9:7.2f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
