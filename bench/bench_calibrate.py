"""Benchmark: whole-model calibration of the default model over a 4096-token capture.

Usage::

    kverr capture --model default --text pydoc --tokens 4096 --out /tmp/pydoc-4096.zarr
    python bench/bench_calibrate.py /tmp/pydoc-4096.zarr [--workers 2] [--context 1280]

Prints wall time, CPU time of this process and its workers, the machine's load average (the CI
machine is shared: wall time under load is not the code's speed), and the chosen configs.

In the registry (``python -m bench.run calibrate``): one budget (4 bits) over the 4096-token
capture, which the runner makes once under ``out/bench/``; ``--quick`` a 1024-token capture and 8
queries per layer. Layers are scored by local threads (``workers``), so the CPU time is this process's.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time


def measure(quick: bool) -> list:
    """Registry entry: wall and CPU seconds of a whole-model calibration at 4 bits."""
    import torch

    from bench.common import Row, pydoc_capture
    from kverr.calibration import CalibrationConfig, calibrate
    from kverr.io import open_capture

    tokens, queries = (1024, 8) if quick else (4096, 32)
    path = pydoc_capture(tokens)
    torch.set_num_threads(1)
    cap = open_capture(path)
    load0 = os.getloadavg()[0]
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    cal = calibrate(cap, CalibrationConfig(budgets=4.0, context=1280, queries=queries), workers=2)
    wall = time.perf_counter() - t0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((self0, self1), (kids0, kids1))
              for f in ("ru_utime", "ru_stime"))
    case = f"default model, {tokens}-token capture, 4 bits at 1280 tokens, {queries} queries, 2 workers"
    return [Row(case, "wall", wall, "s"), Row(case, "cpu", cpu, "s"),
            Row(case, "score", cal.seconds["score"], "s"), Row(case, "search", cal.seconds["search"], "s"),
            Row(case, "sensitivity", cal.seconds.get("sensitivity", float("nan")), "s"),
            Row(case, "load_average_before", load0, "load")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--objective", default="kl", choices=("kl", "rel"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from kverr.calibration import CalibrationConfig, calibrate
    from kverr.io import open_capture

    cap = open_capture(args.capture)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    cal = calibrate(cap, CalibrationConfig(budgets=4.0, context=args.context, queries=args.queries,
                                           objective=args.objective), workers=args.workers)
    wall = time.perf_counter() - t0
    ru_self = resource.getrusage(resource.RUSAGE_SELF)
    ru_kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru_self.ru_utime + ru_self.ru_stime + ru_kids.ru_utime + ru_kids.ru_stime
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"load average before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"capture: {cap.sizes['layer']} layers x {cap.sizes['token']} tokens, "
          f"{len(cal.scores.cands_k)} K and {len(cal.scores.cands_v)} V candidates, "
          f"{len(cal.scores.options)} outer options, {args.queries} queries/layer, {args.workers} workers")
    print(f"objective {args.objective}; model load {cal.seconds.get('model_load', 0.0):.1f} s (before scoring), "
          f"layer sensitivity {cal.seconds.get('sensitivity', 0.0):.1f} s (main process, while the workers score)")
    print(f"wall {wall:.1f} s (score {cal.seconds['score']:.1f} s, search {cal.seconds['search']:.1f} s), "
          f"CPU {cpu:.1f} s (of which scoring layers {cal.scores.cpu_seconds:.1f} s)")
    # On an idle machine the workers and the main process (measuring the sensitivity meanwhile)
    # share the cores: that part takes about (scoring CPU + sensitivity CPU) / cores; the rest
    # (imports, capture and model load, knapsack) is serial.
    sens_cpu = cal.seconds.get("sensitivity_cpu", 0.0)
    par = cal.scores.cpu_seconds + sens_cpu
    cores = max(1, min(args.workers, os.cpu_count() or 1))
    print(f"CPU: scoring layers {cal.scores.cpu_seconds:.1f} s, sensitivity {sens_cpu:.1f} s, rest {cpu - par:.1f} s")
    print(f"idle-machine estimate: {max(par / cores, sens_cpu) + (cpu - par):.1f} s "
          f"((scoring + sensitivity CPU) / {cores} cores + the rest of the CPU, which is serial)")
    for b in (2.5, 3.0, 4.0, 5.0):
        c = cal.config_at(b)
        print(f"  {b:g} bits -> {c.provenance['effective_bits']:.4f} eff. bits at {args.context} tokens, "
              f"predicted {c.provenance['predicted_damage']:.4g}, option {c.provenance['outer_option']}")


if __name__ == "__main__":
    main()
