"""Data and sentinels shared by the paged-cache kernel tests (tests/gpu)."""

from __future__ import annotations

import torch

from kverr.gpu import PagedKVCache

H, D, P = 2, 32, 16


def data(B: int, T: int, seed: int) -> torch.Tensor:
    """[B, H, T, D] in fp16-representable float32, with the corner cases the oracle documents:
    an all-zero token, a constant token, a tiny-range token (subnormal fp16 scales), a large one,
    an all-zero channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.3, 3.0, D)
    if T > 12:
        x[:, :, 5] = 0.0
        x[:, :, 9] = 1.5
        x[:, :, 11] *= 1e-6
        x[:, :, 12] *= 300.0
    x[:, :, :, 3] = 0.0
    return x.half().float()


def sentinel(cache: PagedKVCache) -> None:
    for per in cache.pools:
        for pools in per.values():
            for p in pools:
                if p.codes.dtype == torch.uint8:
                    p.codes.fill_(0xA5)
                else:
                    p.codes.fill_(float("nan"))
                for t in (p.scale, p.zero):
                    if t is not None and not p.spec.static:
                        t.fill_(0xFF if t.dtype == torch.uint8 else float("nan"))  # e4m3 0xff: NaN
                if p.fp_scale is None:
                    p.fp.fill_(float("nan"))
                else:  # int8 window
                    p.fp.fill_(0xA5)
                    p.fp_scale.fill_(float("nan"))
