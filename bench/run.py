"""Run benchmarks from the registry and write their measurements into the long table.

    .venv/bin/python -m bench.run                    # every benchmark, full mode
    .venv/bin/python -m bench.run quant cache        # only these
    .venv/bin/python -m bench.run --quick            # smaller sizes, minutes (what `make bench` runs)
    .venv/bin/python -m bench.run heldout --from-results   # remake rows from committed raw results
    .venv/bin/python -m bench.run --list

Each benchmark's rows (one per measurement: benchmark, mode, case, metric, value, unit, machine,
date, command) replace that benchmark's earlier rows of the same mode in
``bench/results/benchmarks.csv``; the other rows are kept. The README's results table is rendered
from it by ``python -m bench.table``. Benchmarks run one after the other in this process, so
they never compete with one another for the cores.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass

from bench.common import COLUMNS, TABLE, machine, now


@dataclass(frozen=True)
class Benchmark:
    module: str
    what: str
    #: Why ``--quick`` skips it, if it does.
    quick_skips: str | None = None


REGISTRY: dict[str, Benchmark] = {
    "quant": Benchmark("bench.bench_quant", "reference quantize+dequantize of every preset vs a copy"),
    "decompose": Benchmark("bench.bench_decompose", "error decomposition vs plain attention; peak memory at 32k tokens"),
    "capture": Benchmark("bench.bench_capture", "capture hooks vs the plain forward; zarr write"),
    "cache": Benchmark("bench.bench_cache", "decode step of the quantized caches vs the unquantized cache (CPU)"),
    "calibrate": Benchmark("bench.bench_calibrate", "whole-model calibration at one budget"),
    "compensation": Benchmark("bench.bench_compensation",
                              "compensated key rounding's per-token factors vs the textbook formula"),
    "query_blocks": Benchmark("bench.bench_query_blocks",
                              "a layer's calibration scoring with its queries in causal blocks vs one block"),
    "interpreter": Benchmark("bench.bench_interpreter",
                             "kernel launches in Triton's interpreter: language patched once per launch vs per helper call"),
    "heldout": Benchmark("bench.heldout", "calibrated configs vs presets and peers held out (the README table)",
                         quick_skips="one to two hours on two cores"),
}


def write(rows: list[dict], names: set[str], mode: str) -> None:
    """Replace the rows of ``names`` in ``mode`` by ``rows``; keep every other row."""
    import pandas as pd

    from kverr.config import atomic_write_text

    new = pd.DataFrame(rows, columns=COLUMNS)
    if TABLE.exists():
        old = pd.read_csv(TABLE, dtype=str, keep_default_na=False)
        old = old[~(old.benchmark.isin(names) & (old["mode"] == mode))]
        new = pd.concat([old, new.astype(str)], ignore_index=True)
    order = {n: i for i, n in enumerate(REGISTRY)}
    new = new.sort_values(["benchmark", "mode"], key=lambda c: c.map(order) if c.name == "benchmark" else c,
                          kind="stable")
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(TABLE, new.to_csv(index=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): {', '.join(REGISTRY)}")
    ap.add_argument("--quick", action="store_true", help="smaller sizes; skips the benchmarks that take hours")
    ap.add_argument("--from-results", action="store_true",
                    help="summarise the committed raw results instead of measuring (heldout only)")
    ap.add_argument("--list", action="store_true", help="list the registry and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, b in REGISTRY.items():
            print(f"{name:10s} {b.what}" + (f" (--quick skips it: {b.quick_skips})" if b.quick_skips else ""))
        return 0
    unknown = [n for n in args.names if n not in REGISTRY]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(REGISTRY)}")
    names = args.names or list(REGISTRY)
    mode = "quick" if args.quick else "full"
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    rows, done = [], set()
    for name in names:
        b = REGISTRY[name]
        mod = importlib.import_module(b.module)
        if args.from_results:
            if not hasattr(mod, "summarise"):
                print(f"{name}: has no raw results to summarise; skipped", file=sys.stderr)
                continue
            measured = mod.summarise()
        elif args.quick and b.quick_skips:
            print(f"{name}: skipped in quick mode ({b.quick_skips})", file=sys.stderr)
            continue
        else:
            t0 = time.perf_counter()
            print(f"{name}: {b.what} ({mode}) ...", file=sys.stderr, flush=True)
            measured = mod.measure(args.quick)
            print(f"{name}: {len(measured)} rows in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        here, date = machine(), now()
        for r in measured:
            rows.append(dict(benchmark=name, mode=mode, case=r.case, metric=r.metric, value=r.value, unit=r.unit,
                             machine=r.machine or here, date=r.date or date, command=command))
        done.add(name)
    write(rows, done, mode)
    print(f"wrote {len(rows)} rows of {', '.join(sorted(done)) or 'nothing'} into {TABLE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
