"""Triton kernels of kverr (``@triton.jit`` code only), in their own top-level package.

Launchers that check inputs, allocate and choose grids live in :mod:`kverr.gpu`.
"""
