"""fp4 e2m1 codes and the one-byte scales (fp8 e4m3, e8m0): the oracle against their definitions."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kverr.config import PRESETS, CacheConfig
from kverr.exceptions import ConfigError
from kverr.memory import ModelShape, account
from kverr.quant import PerPage, PerToken, PerTokenGroup, QuantFormat, dequantize, fp4_format, int_format, quantize
from kverr.quant.formats import FP4_E2M1_VALUES
from kverr.quant.reference import ceil_cast, fp4_codes, near_cast
from specs import E2M1, e2m1_rne, e4m3_values


def _near_midpoints() -> torch.Tensor:
    """Every e2m1 value and midpoint, four fp32 neighbours each side, both signs, and beyond 6."""
    pts = torch.cat([E2M1, (E2M1[:-1] + E2M1[1:]) / 2, torch.tensor([6.5, 7.0, 1e30])])
    out = [pts]
    for direction in (float("inf"), 0.0):
        step = pts
        for _ in range(4):
            step = torch.nextafter(step, torch.full_like(step, direction))
            out.append(step)
    x = torch.cat(out)
    return torch.cat([x, -x])


def test_fp4_codes_are_e2m1_round_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    q = torch.cat([_near_midpoints(), torch.randn(20000, generator=g) * 3, torch.tensor([-0.0, 0.0])])
    assert torch.equal(fp4_codes(q), e2m1_rne(q))
    # the table is the codes' values; saturation at 6; -0 keeps its sign bit
    table = torch.tensor(FP4_E2M1_VALUES)
    assert torch.equal(table[fp4_codes(table).long()], table)
    assert fp4_codes(torch.tensor([100.0, -100.0])).tolist() == [7, 15]
    assert fp4_codes(torch.tensor([-0.0, -0.2])).tolist() == [8, 8]


def test_fp8_e4m3_scales_round_up_or_to_nearest():
    grid = e4m3_values().double()
    g = torch.Generator().manual_seed(1)
    v = torch.cat([grid.float(), ((grid[:-1] + grid[1:]) / 2).float(), torch.rand(5000, generator=g) * 448,
                   torch.rand(5000, generator=g) * 2.0**-6, torch.tensor([2.0**-10, 2.0**-11, 1e-30])])
    up = ceil_cast(v, "fp8_e4m3").float().double()
    want_up = grid[torch.searchsorted(grid, v.double(), side="left")]  # the least value >= v
    assert torch.equal(up, want_up)
    near = near_cast(v, "fp8_e4m3").float().double()
    d = (v.double()[:, None] - grid).abs()
    lo = d.argmin(1)
    hi = (lo + 1).clamp(max=len(grid) - 1)
    tie = d.gather(1, hi[:, None])[:, 0] == d.gather(1, lo[:, None])[:, 0]
    want_near = grid[torch.where(tie & (lo % 2 == 1), hi, lo)]  # ties to the even bit pattern
    assert torch.equal(near, want_near)


def test_e8m0_scales_are_powers_of_two():
    v = torch.tensor([0.0, 1e-45, 2.0**-127, 0.3, 0.375, 0.374, 1.0, 1.0000001, 1.5, 1.49, 3.0, 2.0**127])
    up = ceil_cast(v, "e8m0").float().double()
    assert up.tolist() == [2.0**-127, 2.0**-127, 2.0**-127, 0.5, 0.5, 0.5, 1.0, 2.0, 2.0, 2.0, 4.0, 2.0**127]
    near = near_cast(v, "e8m0").float().double()
    assert near.tolist() == [2.0**-127, 2.0**-127, 2.0**-127, 0.25, 0.5, 0.25, 1.0, 1.0, 2.0, 1.0, 4.0, 2.0**127]


def test_one_byte_scales_that_overflow_raise():
    x = torch.zeros(1, 2, 32)
    x[0, 0, 0] = 3000.0  # amax / 6 = 500 > 448
    with pytest.raises(ConfigError, match="overflows scale_dtype='fp8_e4m3'.*largest 448"):
        quantize(x, fp4_format(PerTokenGroup(16)))
    y = quantize(x, fp4_format(PerTokenGroup(16), scale_dtype="e8m0"))  # 512: fine
    assert y.scale.float().max().item() == 512.0


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_presets_stay_within_half_a_step(name):
    """With outward scales nothing saturates: every element is within half its quantum
    (0.25 s below 2 s, 0.5 s below 4 s, s up to 6 s) of what was stored."""
    cfg = PRESETS[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 50, 64, generator=g) * torch.rand(2, 3, 50, 1, generator=g).mul(12).sub(6).exp2()
    for fmt in (cfg.k, cfg.v):
        qt = quantize(x, fmt)
        s, _ = qt.element_metadata()
        a = (x / torch.where(s > 0, s, 1.0)).abs()
        assert bool((a <= 6.0).all())
        quantum = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)) * s
        assert bool(((dequantize(qt) - x).abs() <= quantum / 2).all())


def test_fp4_formats_json_labels_and_memory():
    nv, mx = PRESETS["nvfp4"], PRESETS["mxfp4"]
    assert nv.k.label() == "fp4_e2m1/tg16/fp8_e4m3" and mx.k.label() == "fp4_e2m1/tg32/e8m0"
    for cfg in (nv, mx):
        assert CacheConfig.from_json(cfg.to_json()) == cfg
    d = json.loads(nv.to_json())["k"]
    assert d["dtype"] == "fp4_e2m1" and d["scale_dtype"] == "fp8_e4m3" and d["symmetric"] is True
    # a row of D channels: D / 2 bytes of codes and one byte per group of scales
    L, H, D, T = 2, 3, 64, 256
    for cfg, group in ((nv, 16), (mx, 32)):
        rep = account(cfg, ModelShape(L, H, D), T, batch=1)
        assert rep.total_bytes == 2 * L * H * T * (D // 2 + D // group)
    assert fp4_format(PerToken(), scale_dtype="fp16").scale_bytes == 2
    assert QuantFormat.from_dict({"dtype": "fp4_e2m1", "scale_dtype": "e8m0"}).symmetric


@pytest.mark.parametrize("kw,message", [
    (dict(dtype="fp4_e2m1", symmetric=False), "symmetric"),
    (dict(dtype="fp4_e2m1", symmetric=True, rounding="half_away"), "round-half-to-even"),
    (dict(dtype="fp4_e2m1", symmetric=True, scale_dtype="fp4"), "scale_dtype='fp4' is not allowed"),
    (dict(dtype="int", bits=4, scale_dtype="fp8_e4m3"), "too coarse"),
    (dict(dtype="int", bits=2, symmetric=False, scale_dtype="e8m0"), "too coarse"),
    (dict(dtype="codebook", bits=4, symmetric=True, scale_dtype="fp8_e4m3"), "too coarse"),
])
def test_bad_microscaling_formats(kw, message):
    with pytest.raises(ConfigError, match=message):
        QuantFormat(**kw)


def test_page_scales_and_the_kernel_pools():
    fmt = fp4_format(PerPage(), scale_dtype="e8m0")
    x = torch.randn(1, 2, 40, 32)
    qt = quantize(x, fmt, page_size=16)
    assert qt.scale.shape == (1, 2, 3, 1) and qt.scale.dtype == torch.float8_e8m0fnu
    from kverr.gpu.spec import KIND_FP4, KIND_INT_SYM, SDT, kernel_spec

    for f, kind in ((fmt, KIND_FP4), (int_format(2, PerToken(), symmetric=True, scale_dtype="fp8_e4m3"), KIND_INT_SYM)):
        spec = kernel_spec(f, 64, 16)
        assert (spec.kind, spec.sdt, spec.scale_dtype) == (kind, SDT[f.scale_dtype], torch.uint8)
    # the pools hold the scales' bytes, and give the oracle's tensor back
    spec = kernel_spec(fmt, 64, 16)
    pool = spec.pool_scales(qt.scale)
    assert pool.dtype == torch.uint8 and torch.equal(spec.oracle_scales(pool).view(torch.uint8), qt.scale.view(torch.uint8))
    # vLLM's arithmetic on the same layout: the store kernel's ARITH bits (nearest, reciprocal)
    assert kernel_spec(dataclasses.replace(PRESETS["nvfp4"].k, scale_rounding="nearest", reciprocal=True), 64, 16).arith == 3


def test_static_one_byte_scales_are_cast_as_the_oracle_casts():
    """A static scale given as an fp32 value is rounded to nearest in its dtype by the oracle's own
    cast (e4m3: ties to even, saturating at 448; e8m0: by the significand, raising above 2**127),
    and a kernel pool holds the same bytes."""
    from kverr.gpu.spec import kernel_spec
    from kverr.quant import PerHead

    x = torch.randn(1, 2, 8, 32)
    for sdt, given, want in (("fp8_e4m3", [0.3, 1000.0], [0.3125, 448.0]), ("e8m0", [0.74, 0.75], [0.5, 1.0])):
        fmt = fp4_format(PerHead(), scale_dtype=sdt)
        qt = quantize(x, fmt, scale=torch.tensor(given).reshape(2, 1, 1))
        assert qt.scale.float().flatten().tolist() == want
        pool = kernel_spec(fmt, 32, 16).pool_scales(torch.tensor(given))
        assert torch.equal(pool, qt.scale.flatten().view(torch.uint8))
    with pytest.raises(ConfigError, match="static scale overflows scale_dtype='e8m0'"):
        quantize(x, fp4_format(PerHead(), scale_dtype="e8m0"), scale=torch.tensor(2.0**127 * 1.5))
