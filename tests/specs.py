"""Plain-torch restatements of number formats defined outside kverr, shared by the tests that
check the oracle against them (each is the specification, written from the definition, not from
kverr's code)."""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max, vLLM's FP8_MAX on CUDA

#: The eight fp4 e2m1 magnitudes (OCP MX, NVFP4), by code.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_rne(q: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes of fp32 ``q`` by definition: the nearest of the eight magnitudes after
    saturating at 6, a tie to the even code (the even mantissa); bit 3 is the IEEE sign bit."""
    d = (q.abs().clamp(max=6.0)[..., None] - E2M1).abs()
    lo = d.argmin(-1)  # the first of two equal distances: the lower code
    nxt = (lo + 1).clamp(max=7)
    tie = (torch.gather(d, -1, nxt[..., None])[..., 0] == torch.gather(d, -1, lo[..., None])[..., 0]) & (nxt != lo)
    code = torch.where(tie & (lo % 2 == 1), nxt, lo)
    return (code + torch.signbit(q).long() * 8).to(torch.uint8)


def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite fp8 e4m3fn values, ascending (bit patterns 0x00 to 0x7e)."""
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


@functools.lru_cache(maxsize=None)
def reciprocal_split_rows(cache_dtype: torch.dtype, model_dtype: torch.dtype, D: int) -> torch.Tensor:
    """Two rows (``[2, D]`` fp32, values of ``model_dtype``) in which ``x * (1 / s)`` and ``x / s``
    round some elements to different codes: the first maxima in ``[1, 2)`` (16-bit grid) for
    which such values exist, the row then scaled by 1 and by 64 (exact: ``s`` and ``1 / s``
    scale by the same power of two)."""
    quant_max = 127.0 if cache_dtype == torch.int8 else FP8_MAX
    if cache_dtype == torch.int8:
        code = lambda q: (q + 0.5).trunc()  # noqa: E731
        bounds = torch.arange(0, 127, dtype=torch.float32) + 0.5
    else:
        code = lambda q: q.to(torch.float8_e4m3fn).float()  # noqa: E731
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        bounds = (grid[:-1] + grid[1:]) / 2
    grid16 = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.bfloat16 if model_dtype == torch.bfloat16
                                                              else torch.float16).float()
    rows = []
    for amax in grid16[(grid16 >= 1) & (grid16 < 2)]:
        s = amax / quant_max
        if model_dtype == torch.float32:  # fp32 neighbours (up to 4 ulps) of the code boundaries
            x, step = [bounds * s], bounds * s
            for direction in (float("inf"), 0.0):
                step = bounds * s
                for _ in range(4):
                    step = torch.nextafter(step, torch.full_like(step, direction))
                    x.append(step)
            x = torch.cat(x)
        else:  # every 16-bit value
            x = grid16
        x = x[x < amax]
        split = x[code(x * (torch.tensor(1.0) / s)) != code(x / s)][: D - 1]
        if len(split):
            rows.append(torch.cat([amax.reshape(1), split, torch.zeros(D - 1 - len(split))]))
        if len(rows) == 2:
            return torch.stack([rows[0], rows[1] * 64])
    raise AssertionError("no maximum in [1, 2) separates division from the reciprocal")  # pragma: no cover
