"""Codebook element formats: the named levels, the encoding rule restated, fitting, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError
from kverr.memory import ModelShape, account
from kverr.quant import (
    MSEClip,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    codebook_format,
    dequantize,
    fake_quantize,
    int_format,
    quantize,
)
from kverr.quant.codebooks import boundaries, lloyd_max, lloyd_max_normal, normal_float

#: J. Max, "Quantizing for minimum distortion" (1960), Table I: the positive output levels of
#: the minimum-MSE quantizer of N(0, 1), to the table's four decimals.
MAX_1960 = {
    2: (0.4528, 1.510),
    3: (0.2451, 0.7560, 1.344, 2.152),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733),
}
#: NF4 as QLoRA publishes it (Dettmers et al. 2023, appendix; bitsandbytes' table), 8 decimals.
NF4 = (-1.0, -0.69619280, -0.52507305, -0.39491749, -0.28444138, -0.18477343, -0.09105004, 0.0,
       0.07958030, 0.16093020, 0.24611230, 0.33791524, 0.44070983, 0.56261700, 0.72295684, 1.0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_normal_codebook_is_the_lloyd_max_quantizer_of_the_standard_normal(bits):
    c = np.array(lloyd_max_normal(bits), dtype=np.float64)
    half = c[len(c) // 2:]
    # Max's table has four significant decimals: within half a unit of its last digit
    np.testing.assert_allclose(half, MAX_1960[bits], atol=0.0006)
    assert np.array_equal(c, -c[::-1])
    # a fixed point: every level is the centroid of its cell (to fp32 rounding)
    t = np.concatenate(([-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]))
    centroid = (norm.pdf(t[:-1]) - norm.pdf(t[1:])) / (norm.cdf(t[1:]) - norm.cdf(t[:-1]))
    np.testing.assert_allclose(c, centroid, atol=4e-7)


def test_nf4_is_qlora_normal_float():
    np.testing.assert_allclose(normal_float(4), NF4, atol=2e-7)
    for bits in (2, 3):
        c = normal_float(bits)
        assert len(c) == 2**bits and c[0] == -1.0 and c[-1] == 1.0 and 0.0 in c
        assert sum(v > 0 for v in c) == 2 ** (bits - 1)


def _restated(x, levels, s):
    """The encoding rule in plain float64 where it is exact: the code of ``q = fp32(x / s)``
    is the number of fp32 boundaries (exact midpoints rounded once) strictly below it."""
    c = torch.tensor(levels, dtype=torch.float64)
    t = ((c[:-1] + c[1:]) / 2).float()
    q = (x / s).float()
    u = (q.unsqueeze(-1) > t).sum(-1)
    return u, (c.float()[u] * s.float())


@pytest.mark.parametrize("book", ["normal", "nf", (-2.0, -0.5, 0.25, 3.0)])
@pytest.mark.parametrize("stat", ["absmax", "rms"])
def test_codes_and_values_restated(book, stat):
    """Per-token scales (fp16): absmax rounds ``amax / top`` up (through float64, then to fp16);
    rms rounds ``sqrt(mean x**2)`` (float64) up to fp32 and to fp16. Codes and values bit for bit."""
    bits = 2 if not isinstance(book, str) else 3
    fmt = codebook_format(bits, PerToken(), codebook=book, scale_stat=stat)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 40, 32, generator=g) * torch.linspace(0.1, 4.0, 32)
    x[0, 0, 0] = 0.0  # a zero block: scale 0, the code of the level nearest 0, value 0
    qt = quantize(x, fmt)
    levels = fmt.codebook_levels
    x64 = x.double()
    if stat == "absmax":
        top = max(abs(levels[0]), abs(levels[-1]))
        r = x64.abs().amax(-1, keepdim=True) / top
    else:
        r = (x64 * x64).mean(-1, keepdim=True).sqrt()
    r32 = r.float()
    r32 = torch.where(r32.double() < r, torch.nextafter(r32, torch.tensor(math.inf)), r32)
    s16 = r32.half()
    s = torch.where(s16.float() < r32, torch.nextafter(s16, torch.tensor(math.inf, dtype=torch.float16)), s16)
    assert torch.equal(qt.scale, s)
    u, vals = _restated(x, levels, torch.where(s.float() > 0, s.float(), torch.ones_like(s.float())))
    assert torch.equal(qt.unpacked_codes().long(), u)
    assert torch.equal(dequantize(qt), torch.where(s.float() > 0, vals, vals * 0))
    assert torch.equal(fake_quantize(x, fmt), dequantize(qt))
    # every code is a nearest level of its scaled value (up to the fp32 rounding of x / s)
    q = (x / torch.where(s.float() > 0, s.float(), torch.ones_like(s.float()))).double().unsqueeze(-1)
    dist = (q - torch.tensor(levels, dtype=torch.float64)).abs()
    chosen = dist.gather(-1, u.unsqueeze(-1))
    assert bool((chosen <= dist.amin(-1, keepdim=True) + 1e-6 * (1 + q.abs())).all())


def test_boundaries_are_rounded_midpoints_and_ties_go_down():
    levels = (-1.0, 0.0, 0.5, 1.0)
    assert boundaries(levels) == (-0.5, 0.25, 0.75)
    fmt = codebook_format(2, PerToken(), codebook=levels)
    x = torch.tensor([[[-1.0, -0.5, 0.25, 0.75, 1.0, 0.0]]])  # amax 1: scale 1, q = x
    assert quantize(x, fmt).unpacked_codes().tolist() == [[[0, 0, 1, 2, 3, 1]]]


def test_rotated_normal_codebook_is_the_turboquant_quantizer():
    """Hadamard rotation, rms scale, Lloyd-Max levels: the values are ``H(c[u] * rms)`` where
    ``u`` quantizes the rotated row; at 3 bits its error is near the Lloyd-Max distortion of a
    unit normal (0.03455 of the variance, Max 1960) on Gaussian rows."""
    fmt = codebook_format(3, PerToken(), rotate="hadamard", scale_stat="rms", scale_dtype="fp32")
    x = torch.randn(1, 4, 512, 128, generator=torch.Generator().manual_seed(1))
    y = fake_quantize(x, fmt)
    rel = float(((y - x) ** 2).sum() / (x**2).sum())
    assert 0.030 < rel < 0.040


def test_lloyd_max_fits_samples_and_weights():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200_000, generator=g, dtype=torch.float64)
    fit = lloyd_max(x, 3, iters=200)
    np.testing.assert_allclose(fit, lloyd_max_normal(3), atol=0.03)
    # weighting the positive half moves levels there
    w = torch.where(x > 0, 10.0, 1.0).double()
    wfit = lloyd_max(x, 3, w, iters=100)
    assert sum(v > 0 for v in wfit) > sum(v > 0 for v in fit)

    def err(levels, weights):
        c = torch.tensor(levels, dtype=torch.float64)
        u = torch.searchsorted((c[:-1] + c[1:]) / 2, x)
        return float((weights * (x - c[u]) ** 2).sum())

    assert err(wfit, w) < err(fit, w)
    with pytest.raises(ConfigError, match="non-negative weights"):
        lloyd_max(x, 2, -w)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(codebook=(1.0, 2.0, 3.0, 4.0)), "both signs"),
        (dict(codebook=(-1.0, 0.0, 0.0, 1.0)), "increase strictly"),
        (dict(codebook=(-1.0, 0.0, 1.0)), "list of 4 numbers"),
        (dict(codebook=(-1.0, 0.0, float("nan"), 1.0)), "finite"),
        (dict(codebook="uniform"), "codebook='uniform' is not allowed; one of normal, nf"),
        (dict(scale_stat="max"), "scale_stat='max' is not allowed; one of absmax, rms"),
        (dict(scale_stat="rms", clip=MSEClip()), "absmax only with scale_stat 'rms'"),
    ],
)
def test_bad_codebook_formats(kw, message):
    with pytest.raises(ConfigError, match=message):
        codebook_format(2, PerToken(), **kw)


def test_codebook_fields_belong_to_codebooks_and_round_trip():
    with pytest.raises(ConfigError, match="codebook=.normal. is not allowed; only for dtype 'codebook'"):
        QuantFormat("int", 4, codebook="normal")
    with pytest.raises(ConfigError, match="scale_stat='rms' is not allowed; only for dtype 'codebook'"):
        QuantFormat("int", 4, scale_stat="rms")
    with pytest.raises(ConfigError, match="bits=8 is not allowed; codebook allows 2, 3, 4"):
        codebook_format(8, PerToken())
    with pytest.raises(ConfigError, match="codebook is symmetric"):
        QuantFormat("codebook", 3, symmetric=False)
    with pytest.raises(ConfigError, match="missing field format.bits; codebook formats need 2, 3, 4"):
        QuantFormat.from_dict({"dtype": "codebook"})
    fmt = codebook_format(2, PerTokenGroup(32), codebook=(-1.5, -0.1, 0.3, 2.0), scale_stat="rms")
    d = fmt.to_dict()
    assert d["codebook"] == [-1.5, float(np.float32(-0.1)), float(np.float32(0.3)), 2.0]
    assert QuantFormat.from_dict(d) == fmt and fmt.label() == "lut2/tg32/fp16/rms"
    assert QuantFormat.from_dict({"dtype": "codebook", "bits": 3}) == codebook_format(3, PerToken())


def test_memory_counts_the_levels_once_per_head_group():
    """Codes as an integer format of the same width; one scale and no zero point per token
    (an asymmetric integer also stores a zero); the levels, fp32, once per (layer, K|V)."""
    shape = ModelShape(2, 3, 64)
    cb = CacheConfig(k=codebook_format(3, PerToken()), v=codebook_format(3, PerToken()), page_size=16, align=1)
    it = CacheConfig(k=int_format(3, PerToken()), v=int_format(3, PerToken()), page_size=16, align=1)
    a, b = account(cb, shape, 64, batch=2), account(it, shape, 64, batch=2)
    n_groups = 2 * 2  # layers x (K, V), one format per layer
    ta, tb = a.totals, b.totals
    assert (ta.payload, ta.scales, ta.zeros) == (tb.payload, tb.scales, 0) and tb.zeros == tb.scales > 0
    assert ta.static == n_groups * 8 * 4 and tb.static == 0
    assert a.total_bytes == b.total_bytes - tb.zeros + n_groups * 8 * 4
