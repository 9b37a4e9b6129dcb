"""Does a capture of the bundled model depend on the CPU kernels torch and MKL pick?

Captures the first 512 pydoc tokens (layers 0, 15, 29) in fresh processes under several
settings of ATEN_CPU_CAPABILITY, MKL_CBWR and the thread count (each read when torch starts),
then prints the largest absolute difference of every pair per tensor ("==" when bit-equal).
Usage: python experiments/capture-float-reproducibility/compare.py
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {
    "native": ({}, None),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, None),
    "mkl-compatible": ({"MKL_CBWR": "COMPATIBLE"}, None),
    "both, 1 thread": ({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}, 1),
    "both, 2 threads": ({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}, 2),
    "aten-default, mkl-avx": ({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX"}, 1),
}
VARS = ("q", "k_pre", "k", "v")

CHILD = """
import sys, numpy as np, torch
if sys.argv[2] != "None":
    torch.set_num_threads(int(sys.argv[2]))
from kverr.capturing import capture, float_environment, load_model, load_text, tokenize
m = load_model("default"); text = load_text("pydoc")
ds = capture(m, tokenize(m.tokenizer, text, 512), layers=[0, 15, 29], text=text)
np.savez(sys.argv[1], **{v: ds[v].values for v in %r})
print(float_environment(), torch.get_num_threads())
""" % (VARS,)


def main() -> None:
    import numpy as np

    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (env, threads) in SETTINGS.items():
            path = Path(tmp) / f"{len(out)}.npz"
            res = subprocess.run([sys.executable, "-c", CHILD, str(path), str(threads)], env=base | env,
                                 capture_output=True, text=True, check=True)
            print(f"{name:<22} {res.stdout.strip()}")
            out[name] = dict(np.load(path))
    print("largest |difference| per tensor (q, k_pre, k, v); the tensors' largest magnitudes:",
          ", ".join(f"{float(np.abs(out['native'][v]).max()):.1f}" for v in VARS))
    for a, b in itertools.combinations(out, 2):
        cells = ["==" if np.array_equal(out[a][v], out[b][v]) else f"{float(np.abs(out[a][v] - out[b][v]).max()):.1e}"
                 for v in VARS]
        print(f"  {a:<22} vs {b:<22} " + "  ".join(f"{c:>7}" for c in cells))


if __name__ == "__main__":
    main()
