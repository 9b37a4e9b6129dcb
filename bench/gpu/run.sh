#!/usr/bin/env bash
# One call on a GPU machine (at most 8 minutes): AOT resource check on the real device's compiler,
# a kernel-vs-reference validation on the bundled capture, then the decode benchmark beside
# kverr plan's predictions (bench/gpu/bench_decode.py --smoke checks that script on a CPU).
# Runs from the working tree (no install): the GPU machine has torch, triton, numpy, scipy,
# xarray but no zarr/dask, so only the steps that need those are skipped when they are missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p bench/results
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee bench/results/gpu-device.txt
python - <<'PY'
import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
PY
# correctness on the device first (small, ~10 s): the interpreter tests' decode cases on CUDA
timeout 120 python - <<'PY' || echo "device check FAILED"
import torch
from kverr.config import CacheConfig
from kverr.quant import int_format, MSEClip, PerChannel, PerTokenGroup
from kverr.validation import validate_arrays
torch.manual_seed(0)
L, B, Hq, H, T, D = 2, 3, 32, 8, 300, 128
q = torch.randn(L, B, Hq, T, D) * 2; k = torch.randn(L, B, H, T, D).half().float(); v = torch.randn(L, B, H, T, D).half().float()
for name, cfg in {"kivi-2": CacheConfig(k=int_format(2, PerChannel(32)), v=int_format(2, PerTokenGroup(32)), window=20, sinks=4),
                  "int8": CacheConfig(k=int_format(8, PerTokenGroup(64)), v=int_format(8, PerTokenGroup(64))),
                  # Hadamard rotation + MSE clip search: bit-exact codes on the device too (no fp contraction)
                  "rot-mse": CacheConfig(k=int_format(4, PerChannel(32), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6)),
                                         v=int_format(3, PerTokenGroup(32), rotate="hadamard", clip=MSEClip(grid=5, min_ratio=0.6)),
                                         window=20, sinks=4),
                  # salient prompt tokens: rows after the window ring, masked in the main launch, read in the tail
                  "salient": CacheConfig(k=int_format(2, PerChannel(32)), v=int_format(2, PerTokenGroup(32)), window=20,
                                         sinks=4, window_dtype="int8", salient=8)}.items():
    rep = validate_arrays(cfg, q, k, v, [h // 4 for h in range(Hq)], steps=3, device="cuda")
    print(name, "AGREE" if rep.ok else "DISAGREE", max(r.rel_rms for r in rep.layers), sum(r.mismatched for r in rep.layers))
PY
timeout 420 python bench/gpu/bench_decode.py
