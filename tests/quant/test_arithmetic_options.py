"""The formats' arithmetic options (rounding, scale_rounding, scale_floor, reciprocal).

Their defaults are kverr's own arithmetic and are not written to JSON, so every config written
before they existed reads and writes the same bytes; each option changes exactly the step it
names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kverr.config import PRESETS, CacheConfig
from kverr.exceptions import ConfigError
from kverr.quant import (
    MSEClip,
    PerChannel,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    dequantize,
    fake_quantize,
    fp8_format,
    int_format,
    quantize,
)
from kverr.quant.formats import ARITHMETIC_DEFAULTS, arithmetic_options

pytestmark = pytest.mark.float_order

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
OLD_KEYS = {"dtype", "bits", "symmetric", "granularity", "scale_dtype", "clip", "rotate"}


def _f32(v: float) -> float:
    return float(np.float32(v))


def test_defaults_are_not_written_and_committed_configs_keep_their_bytes():
    for cfg in PRESETS.values():
        for _, fmt in cfg._all_formats():
            # codebooks came later with two keys of their own; no other format writes them
            keys = OLD_KEYS | ({"codebook", "scale_stat"} if fmt.is_codebook else set())
            assert fmt.arithmetic_is_default and set(fmt.to_dict()) <= keys
    files = sorted(CONFIGS.glob("*.json"))
    assert files
    for path in files:
        assert CacheConfig.load(path).to_json() == path.read_text()


@pytest.mark.parametrize("option", [
    dict(rounding="half_away"), dict(scale_rounding="nearest"), dict(scale_floor=1e-6),
    dict(reciprocal=True),
    dict(rounding="half_away", scale_rounding="nearest", scale_floor=0.5, reciprocal=True),
    dict(scale_rounding="nearest", encode_with="fp32"),
])
def test_options_round_trip_through_json_and_show_in_the_label(option):
    base = int_format(8, PerToken(), symmetric=True, scale_dtype="fp32")
    fmt = dataclasses.replace(base, **option)
    d = fmt.to_dict()
    assert set(d) == OLD_KEYS | set(option) and arithmetic_options(fmt) == option
    assert QuantFormat.from_dict(d) == fmt and not fmt.arithmetic_is_default
    assert fmt.label() != base.label() and fmt.label().startswith(base.label() + "/")
    cfg = CacheConfig(k=fmt, v=base)
    assert CacheConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("bad,match", [
    (dict(rounding="up"), "rounding='up' is not allowed; one of half_even, half_away"),
    (dict(scale_rounding="down"), "scale_rounding='down' is not allowed"),
    (dict(scale_floor=-1.0), "scale_floor=-1.0 is not allowed; a finite number >= 0"),
    (dict(scale_floor=float("nan")), "scale_floor=nan"),
    (dict(scale_floor=True), "scale_floor=True"),
    (dict(reciprocal="yes"), "reciprocal='yes' is not allowed; true or false"),
    (dict(encode_with="exact"), "encode_with='exact' is not allowed; one of stored, fp32"),
    (dict(encode_with="fp32"), "encode_with='fp32' is not allowed; only for integers with scale_rounding 'nearest'"),
    (dict(fixed_scale=0.0), "fixed_scale=0.0 is not allowed; a finite number > 0"),
    (dict(fixed_scale=1.0), "fixed_scale=1.0 is not allowed; only for symmetric formats with granularity tensor"),
])
def test_bad_options_are_refused_naming_the_field(bad, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(int_format(4, PerToken()), **bad)
    with pytest.raises(ConfigError, match="format: " + match.split(" ")[0]):
        QuantFormat.from_dict({**int_format(4, PerToken()).to_dict(), **bad})


def test_fp8_codes_round_only_half_to_even_and_floats_drop_the_options():
    with pytest.raises(ConfigError, match="fp8_e4m3 codes are the cast's round-half-to-even"):
        dataclasses.replace(fp8_format(PerToken()), rounding="half_away")
    assert QuantFormat(dtype="fp16", reciprocal=True, scale_floor=1.0) == QuantFormat(dtype="fp16")


def test_half_away_rounds_ties_away_from_zero_after_an_fp32_half_addition():
    # amax 127 at 8 bits symmetric: the scale is exactly 1, so codes are the rounded inputs
    row = [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 0.49999997, -0.49999997, 2.4999998, 0.0]
    x = torch.tensor(row).reshape(1, 1, -1)
    away = dataclasses.replace(int_format(8, PerToken(), symmetric=True, scale_dtype="fp32"), rounding="half_away")
    even = dataclasses.replace(away, rounding="half_even")
    codes = lambda f: (quantize(x, f).unpacked_codes().to(torch.int16) - 128).flatten().tolist()  # noqa: E731
    assert quantize(x, away).scale.item() == 1.0
    # 0.49999997 + 0.5 rounds to 1.0 in fp32: the addition, not the exact value, decides
    assert codes(away) == [127, 3, -3, 1, -1, 2, -2, 1, -1, 2, 0]
    assert codes(even) == [127, 2, -2, 0, 0, 2, -2, 0, 0, 2, 0]


def test_nearest_scale_is_the_fp32_quotient_and_outward_covers_the_range():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 32, generator=g) * 3
    for base in (int_format(8, PerToken(), symmetric=True, scale_dtype="fp32"), int_format(4, PerToken(), scale_dtype="fp16"),
                 fp8_format(PerToken())):
        near = dataclasses.replace(base, scale_rounding="nearest")
        top = 448.0 if base.is_fp8 else base.levels
        s_near, s_out = quantize(x, near), quantize(x, base)
        if base.has_zero:
            lo = x.amin(-1, keepdim=True)
            m = lo.to(torch.float16)
            assert torch.equal(s_near.zero, m)
            want = ((x.amax(-1, keepdim=True) - m.float()) / top).to(torch.float16)
        else:
            want = x.abs().amax(-1, keepdim=True) / top
        assert torch.equal(s_near.scale, want.to(s_near.scale.dtype))
        assert bool((s_out.scale.float() >= s_near.scale.float()).all())
        assert bool((s_out.scale.float() > s_near.scale.float()).any())


def test_scale_floor_raises_small_scales_and_gives_zero_blocks_a_scale():
    x = torch.zeros(1, 4, 16)
    x[0, 1] = 1e-9  # constant tiny row: amax / 127 is under the floor
    x[0, 2] = torch.linspace(-3, 3, 16)
    floor = 1e-6
    for base in (int_format(8, PerToken(), symmetric=True, scale_dtype="fp32"), fp8_format(PerToken()),
                 int_format(4, PerToken(), scale_dtype="fp32")):
        for rounding in ("outward", "nearest"):
            fmt = dataclasses.replace(base, scale_floor=floor, scale_rounding=rounding)
            qt = quantize(x, fmt)
            s = qt.scale.flatten()
            assert s[0].item() == s[1].item() == s[3].item() == _f32(floor)
            assert s[2].item() > floor
            assert torch.equal(dequantize(qt)[0, 0], torch.zeros(16))
            plain = quantize(x, dataclasses.replace(fmt, scale_floor=0.0))
            assert plain.scale.flatten()[0].item() == 0.0
            assert torch.equal(plain.scale.flatten()[2], s[2])


def test_reciprocal_multiplies_by_the_fp32_inverse():
    base = int_format(8, PerToken(), symmetric=True, scale_dtype="fp32")
    rcp = dataclasses.replace(base, reciprocal=True)
    # a row of maximum 100 (scale 100/127, rounded up) and the fp32 neighbours of (k + 1/2) * s,
    # where the quotient x / s and the product x * (1 / s) can round to different codes
    g = torch.Generator().manual_seed(5)
    s = quantize(torch.tensor([[[100.0]]]), base).scale.reshape(())
    x = (torch.arange(0, 126, dtype=torch.float32) + 0.5) * s
    x = torch.cat([x, torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, torch.full_like(x, 200.0))])
    x = torch.cat([torch.tensor([100.0]), x, torch.randn(200, generator=g) * 30]).reshape(1, 1, -1)
    assert quantize(x, base).scale.reshape(()) == s
    inv = torch.ones_like(s) / s
    want = torch.round(x * inv).clamp(-127, 127)
    got = quantize(x, rcp).unpacked_codes().to(torch.float32) - 128
    assert torch.equal(got, want)
    divided = quantize(x, base).unpacked_codes().to(torch.float32) - 128
    assert torch.equal(divided, torch.round(x / s).clamp(-127, 127))
    assert not torch.equal(got, divided)


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 3, 4, 8]), st.booleans(), st.sampled_from(["fp32", "fp16"]),
       st.sampled_from(["half_even", "half_away"]), st.sampled_from(["outward", "nearest"]),
       st.sampled_from([0.0, 1e-6, 0.01]), st.booleans(), st.booleans(), st.booleans())
def test_every_option_keeps_fake_quantize_equal_to_dequantize_of_quantize(
        seed, bits, sym, sdt, rounding, scale_rounding, floor, reciprocal, mse, rotate):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 9, 32, generator=g) * torch.rand(1, 3, 9, 1, generator=g).mul(6).exp2()
    x[0, 1, 2] = 0.0
    gran = [PerToken(), PerTokenGroup(16), PerChannel(4)][seed % 3]
    fmt = QuantFormat("int", bits, sym, gran, sdt, MSEClip(grid=4) if mse else int_format(2, gran).clip,
                      "hadamard" if rotate else "none", rounding, scale_rounding, floor, reciprocal)
    qt = quantize(x, fmt)
    assert torch.equal(fake_quantize(x, fmt), dequantize(qt))
    codes = qt.unpacked_codes()
    assert int(codes.max()) <= (2 ** bits - 1)
    if sym:
        assert int(codes.min()) >= 1  # symmetric codes stay in [-L, L] (u = code + 2**(b-1))
    for key, value in ARITHMETIC_DEFAULTS.items():
        assert (getattr(fmt, key) == value) == (key not in fmt.to_dict())


def test_fixed_scale_is_the_formats_constant_and_stores_nothing():
    """``fixed_scale``: every value divided by the constant (vLLM's fp8 without checkpoint
    scales), whatever the data; JSON round trip; refused where it is not exact in the scale
    dtype or the granularity is not one static scale per tensor."""
    from kverr.memory import ModelShape, account
    from kverr.quant import PerHead, PerTensor

    fmt = dataclasses.replace(fp8_format(PerTensor()), fixed_scale=1.0)
    assert fmt.label().endswith("/s1") and QuantFormat.from_dict(fmt.to_dict()) == fmt
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 20, 16, generator=g) * 300
    qt = quantize(x, fmt)
    assert torch.equal(qt.scale.float().unique(), torch.tensor([1.0]))
    assert torch.equal(qt.unpacked_codes(), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    half = dataclasses.replace(fmt, fixed_scale=0.5)
    assert torch.equal(dequantize(quantize(x, half)), (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.5)
    with pytest.raises(ConfigError, match="a value exact in scale_dtype 'fp16'"):
        dataclasses.replace(fmt, scale_dtype="fp16", fixed_scale=0.1)
    with pytest.raises(ConfigError, match="granularity tensor"):
        dataclasses.replace(fp8_format(PerHead()), fixed_scale=1.0)
    cfg = CacheConfig(k=fmt, v=fp8_format(PerTensor()))
    rep = account(cfg, ModelShape(2, 3, 64), 256)
    assert rep.totals.static == 2 * 4  # one fp32 value scale per layer; the keys' fixed scale stores nothing


def test_encode_with_fp32_codes_from_the_unrounded_pair():
    """``encode_with="fp32"``: codes from ``(x - lo) / s32`` with ``s32 = (hi - lo) / L`` in fp32;
    stored: the pair rounded to nearest in the scale dtype. Codes differ from kverr's default
    (from the stored pair) somewhere on random rows; decoding reads the stored pair."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 64, 32, generator=g) * 3 + 5
    base = dataclasses.replace(int_format(4, PerToken(), scale_dtype="fp16"), scale_rounding="nearest")
    fmt = dataclasses.replace(base, encode_with="fp32")
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s32 = (hi - lo) / 15.0
    want = torch.round((x - lo) / s32).clamp(0, 15)
    qt = quantize(x, fmt)
    assert torch.equal(qt.unpacked_codes().float(), want)
    assert torch.equal(qt.scale, s32.to(torch.float16)) and torch.equal(qt.zero, lo.to(torch.float16))
    assert torch.equal(dequantize(qt), want * s32.to(torch.float16).float() + lo.to(torch.float16).float())
    assert not torch.equal(quantize(x, base).unpacked_codes(), qt.unpacked_codes())
