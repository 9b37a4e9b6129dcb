"""Triton kernels of kverr (``@triton.jit`` code only), importable as ``kverr_kernels``.

Launchers that check inputs, allocate and choose grids live in :mod:`kverr.gpu`.
"""
