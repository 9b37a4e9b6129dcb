"""Benchmark: kernel launches in Triton's interpreter, its language patched once per launch.

On the CPU, ``kverr validate`` and the tests run the kernels in Triton's interpreter
(``TRITON_INTERPRET=1``). The interpreter patches the whole ``triton.language`` at every call of a
``@triton.jit`` helper inside a kernel; :mod:`kverr.gpu.interpreter` skips the calls whose
language is already patched for the launch. This validates one config against the reference
(keys rounded with compensation, whose store kernel calls its helpers channel by channel; a
16-token window so the decode steps quantize keys too) in fresh processes, alternately with the
interpreter as shipped and as kverr runs it, and prints both times, their ratio, and whether the
two validations reported the same numbers to the last bit (they compute the same).

Usage::

    python -m bench.run interpreter            # 120 tokens, two runs each
    python -m bench.run interpreter --quick    # 64 tokens, one run each
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = """
import json, sys, time
import kverr.gpu.interpreter as interpreter
if sys.argv[1] == "shipped":
    interpreter.install = lambda: False
from kverr.config import named_presets
from kverr.validation import validate
cfg = named_presets()["kivi-2"].with_(key_rounding="compensated", window=16)
t = time.perf_counter()
rep = validate(cfg, sys.argv[2], tokens=int(sys.argv[3]), batch=2, steps=3, layers=[15])
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "ok": rep.ok,
                  "numbers": [[r.rel_rms, r.max_abs, r.mismatched] for r in rep.layers]}))
"""


def _run(mode: str, capture, tokens: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(capture), str(tokens)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(quick: bool) -> list:
    """Registry entry: the same validation, the interpreter as shipped and as kverr runs it."""
    from bench.common import ROOT, Row, machine

    capture = ROOT / "data" / "smollm2-pydoc-512.zarr"
    tokens, repeats = (64, 1) if quick else (120, 2)
    times: dict[str, list[float]] = {"shipped": [], "once": []}
    numbers: dict[str, list] = {}
    for _ in range(repeats):
        for mode in times:  # alternating, so that a busy spell on the machine hits both
            r = _run(mode, capture, tokens)
            if not r["ok"]:
                raise RuntimeError(f"validation failed with the interpreter {mode}: {r}")
            times[mode].append(r["seconds"])
            numbers.setdefault(mode, r["numbers"])
    shipped, once = min(times["shipped"]), min(times["once"])
    same = numbers["shipped"] == numbers["once"]
    case = f"validate kivi-2 + compensated keys, layer 15, 2 x {tokens} tokens, 3 steps"
    print(f"{case}: interpreter as shipped {shipped:.1f} s, patched once per launch {once:.1f} s "
          f"({shipped / once:.2f}x); same numbers: {same}", flush=True)
    if not same:
        raise RuntimeError(f"the two interpreters reported different numbers: {numbers}")
    where = machine(threads=1)  # the children's (OMP_NUM_THREADS=1)
    return [Row(case, "shipped_s", shipped, "s", where), Row(case, "once_per_launch_s", once, "s", where),
            Row(case, "speedup", shipped / once, "x", where)]


if __name__ == "__main__":
    measure(quick=False)
