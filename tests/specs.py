"""Plain-torch restatements of number formats defined outside kverr, shared by the tests that
check the oracle against them (each is the specification, written from the definition, not from
kverr's code)."""

from __future__ import annotations

import torch

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
