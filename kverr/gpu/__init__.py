"""Launchers of the Triton kernels: the paged quantized KV cache (plan once per step, run per
layer), input checks, grids and ahead-of-time compilation helpers.

Importing this package needs only numpy, torch and triton; the kernels themselves
(:mod:`kverr_kernels`) are imported on first launch, so ``TRITON_INTERPRET=1`` may be set any
time before that to run them on the CPU.
"""

from kverr.gpu.cache import PagedKVCache, StepPlan, calibrate_static_scales
from kverr.gpu.spec import KernelSpec, check_head_dim, kernel_spec

__all__ = ["KernelSpec", "PagedKVCache", "StepPlan", "calibrate_static_scales", "check_head_dim", "kernel_spec"]
