"""Property tests of the quantization oracle (kverr.quant)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kverr.exceptions import ConfigError, DTypeError, NonFiniteError, ShapeError
from kverr.quant import (
    AbsMax,
    MSEClip,
    Percentile,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    dequantize,
    fake_quantize,
    fp8_format,
    hadamard,
    hadamard_rotate,
    hadamard_scale,
    int_format,
    pack,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)
from kverr.quant.reference import ceil_cast, floor_cast
from kverr.quant.formats import minifloat_max

from strategies import data, formats

# The oracle's codes must not depend on the kernels torch picks: run again under ATen's
# baseline kernels in `make test`.
pytestmark = pytest.mark.float_order

EPS32 = float(np.finfo(np.float32).eps)
PAGE = 16


def ulp32(t: torch.Tensor) -> torch.Tensor:
    t = t.float().abs()
    return torch.nextafter(t, torch.full_like(t, math.inf)) - t


def rotated(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return hadamard_rotate(x) if fmt.rotate == "hadamard" else x


# ---------------------------------------------------------------------------------------------
# Reconstruction error
# ---------------------------------------------------------------------------------------------


@given(st.data())
def test_integer_error_within_half_a_step_inside_the_grid(draw):
    x = draw.draw(data())
    fmt = draw.draw(formats(x.shape[-1], PAGE, kinds=("int",)))
    qt = quantize(x, fmt, page_size=PAGE)
    xr = rotated(x, fmt)
    xh = dequantize(qt, unrotate=False)
    s, m = qt.element_metadata()
    L = fmt.levels
    # Grid extent in float64, so that the check itself does not round.
    x64, s64 = xr.double(), s.double()
    if fmt.symmetric:
        inside = x64.abs() <= L * s64
        m_abs = torch.zeros_like(s)
    else:
        inside = (x64 >= m.double()) & (x64 <= m.double() + L * s64)
        m_abs = m.abs()
    # Half a step, plus a few fp32 roundings of the magnitudes involved.
    bound = s / 2 + 4 * EPS32 * (xr.abs() + m_abs + L * s)
    err = (xr - xh).abs()
    assert bool((err[inside] <= bound[inside]).all()), float((err - bound)[inside].max())
    if isinstance(fmt.clip, AbsMax):
        # Without clipping, the grid covers every element: this is what rounding scales up buys.
        assert bool(inside.all())


@given(st.data())
def test_fp8_error_within_half_an_fp8_ulp(draw):
    x = draw.draw(data())
    fmt = draw.draw(formats(x.shape[-1], PAGE, kinds=("fp8_e4m3", "fp8_e5m2"), clip=False))
    qt = quantize(x, fmt, page_size=PAGE)
    xr = rotated(x, fmt)
    xh = dequantize(qt, unrotate=False)
    s, _ = qt.element_metadata()
    mbits, emin = (3, -6) if fmt.dtype == "fp8_e4m3" else (2, -14)
    v = xr / torch.where(s > 0, s, torch.ones_like(s))
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**emin)))
    half_ulp = torch.exp2(exp - mbits) / 2
    bound = s * half_ulp + 4 * EPS32 * (xr.abs() + s)
    assert bool(((xr - xh).abs() <= bound).all())


@pytest.mark.parametrize("fmt", [
    int_format(4, PerTokenGroup(8)),
    int_format(2, PerChannel(4)),
    int_format(8, PerToken(), symmetric=True),
    fp8_format(PerHead()),
    int_format(3, PerPage(), clip=MSEClip()),
    int_format(4, PerTensor(), clip=Percentile(99.0), rotate="hadamard"),
])
@pytest.mark.parametrize("value", [0.0, 3.25, -1e-3, 1234.5])
def test_constant_and_zero_blocks_are_finite_and_within_bounds(fmt, value):
    x = torch.full((2, 3, 9, 16), value)
    qt = quantize(x, fmt, page_size=4)
    xh = qt.dequantize()
    assert bool(torch.isfinite(xh).all())
    assert bool(torch.isfinite(qt.scale.float()).all())
    if value == 0.0:
        assert bool((xh == 0).all())
        return
    # Constant blocks obey the general bound: half a step of their (tiny) scale.
    s, _ = qt.element_metadata()
    s_orig = s if fmt.rotate == "none" else s.amax()  # a rotation mixes a token's channels
    assert bool(((xh - value).abs() <= s_orig / 2 + 64 * EPS32 * abs(value)).all())
    if fmt.has_zero and fmt.rotate == "none" and float(torch.tensor(value).half()) == value:
        assert bool((xh == value).all())  # offset representable: reconstructed exactly


# ---------------------------------------------------------------------------------------------
# Grid round trip and idempotence
# ---------------------------------------------------------------------------------------------


@given(st.data())
def test_values_on_the_grid_round_trip_exactly(draw):
    """Codes drawn at random with a static scale: dequantize, quantize again with the same
    metadata, and get the same codes and bit-identical values."""
    x = draw.draw(data())
    fmt = draw.draw(formats(x.shape[-1], PAGE, clip=False, rotate=False))
    ref = quantize(x, fmt, page_size=PAGE)  # real metadata of the right shape and dtype
    rng = np.random.default_rng(draw.draw(st.integers(0, 2**32 - 1)))
    codes = ref.unpacked_codes().clone()
    if fmt.is_fp8:
        # random finite fp8 bit patterns (e4m3fn: 0x7f/0xff are NaN; e5m2: exponent 31 is Inf/NaN)
        vals = torch.from_numpy(rng.integers(0, 256, size=codes.shape, dtype=np.uint8))
        f = vals.view(torch.float8_e4m3fn if fmt.dtype == "fp8_e4m3" else torch.float8_e5m2).float()
        vals[~torch.isfinite(f)] = 0
    else:
        lo = 1 if fmt.symmetric else 0
        vals = torch.from_numpy(rng.integers(lo, 2**fmt.bits, size=codes.shape).astype(np.uint8))
    q_codes = vals if fmt.is_fp8 else pack(vals, fmt.bits)
    grid = type(ref)(q_codes, ref.scale, ref.zero, fmt, ref.shape, PAGE)
    y = grid.dequantize()
    again = quantize(y, fmt, page_size=PAGE, scale=ref.scale, zero=ref.zero)
    s, _ = ref.element_metadata()
    nonzero_scale = s > 0  # a zero scale maps every code to the same value
    assert torch.equal(again.unpacked_codes()[nonzero_scale], vals[nonzero_scale])
    assert torch.equal(again.dequantize(), y)


@given(st.data())
def test_quantize_dequantize_quantize_is_idempotent(draw):
    """Q(D(Q(x))) == Q(x) for every format without clipping (clipping re-clips by design).

    Codes are identical. fp16 and bf16 metadata are bit-identical. fp32 metadata agree to the
    rounding that dequantization itself commits: ``code * s + m`` is not exact in fp32 when
    ``s`` has 24 significant bits, so the new range is off by up to an ulp of ``|m| + L*s``,
    which moves the new scale by that over ``L``, plus the scale's own ulp.

    Codebooks (absmax scales) keep their codes; the top level times the scale is rounded once
    in fp32 (a level has 24 significant bits), so the new scale, that product over the level
    rounded up, may be one step of the scale dtype above the first. That needs outer levels
    ``±top`` (a block's largest magnitude maps back to itself whatever its sign); an rms scale is
    not a range at all (the levels' rms is not one). Both are left out.
    """
    x = draw.draw(data())
    fmt = draw.draw(formats(x.shape[-1], PAGE, clip=False))
    assume(not fmt.is_codebook or (fmt.scale_stat == "absmax"
                                   and fmt.codebook_levels[0] == -fmt.codebook_levels[-1]))
    # an e8m0 scale is the least power of two covering the block: the block's largest code can
    # land a binade below the top value (fp4: 3 of 6), and the requantized block then takes the
    # next lower power of two, a different but equally valid grid
    assume(fmt.scale_dtype != "e8m0")
    q1 = quantize(x, fmt, page_size=PAGE)
    # Precondition: scales are normal numbers of their dtype. A subnormal fp16 scale has too
    # few significant bits to place the top code (see QuantFormat's scale_dtype check).
    tiny = torch.finfo(q1.scale.dtype).tiny
    assume(bool(((q1.scale.float() == 0) | (q1.scale.float() >= tiny)).all()))
    y = q1.dequantize(unrotate=False)
    fmt_norot = dataclasses.replace(fmt, rotate="none")
    q2 = quantize(y, fmt_norot, page_size=PAGE)
    assert torch.equal(q2.unpacked_codes(), q1.unpacked_codes())
    for a, b in ((q1.scale, q2.scale), (q1.zero, q2.zero)):
        if a is None:
            assert b is None
            continue
        if fmt.is_codebook:
            step = torch.nextafter(a, torch.full_like(a, math.inf))
            assert bool(((b == a) | (b == step)).all())
        elif fmt.scale_dtype == "fp32":
            s1 = q1.scale.float()
            m1 = q1.zero.float() if q1.zero is not None else torch.zeros_like(s1)
            top = fmt.levels if fmt.dtype == "int" else minifloat_max(fmt.dtype)
            span = m1.abs() + top * s1
            tol = ulp32(a) + 2 * ulp32(span) / top + ulp32(m1)
            assert bool(((a - b).abs() <= tol).all())
        else:
            assert torch.equal(a, b)
    assert torch.equal(quantize(q2.dequantize(), fmt_norot, page_size=PAGE).unpacked_codes(), q2.unpacked_codes())


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


@given(bits=st.sampled_from([1, 2, 3, 4, 8]), n=st.integers(0, 131), rows=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip_at_any_length(bits, n, rows, seed):
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 2**bits, size=(rows, n)).astype(np.uint8))
    packed = pack(codes, bits)
    assert packed.shape == (rows, packed_nbytes(n, bits))
    assert packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, n), codes)


def test_packed_layout_is_planar():
    """Bit slice j of byte i holds channel j*P + i: the layout the kernels rely on."""
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16) % 16
    packed = pack(codes, 4)  # P = 8 bytes
    assert packed[0, 0] == codes[0, 0] | (codes[0, 8] << 4)
    assert packed[0, 7] == codes[0, 7] | (codes[0, 15] << 4)
    codes2 = torch.tensor([[3, 2, 1, 0, 1, 2, 3, 0, 1]], dtype=torch.uint8)  # n=9, P=3
    p2 = pack(codes2, 2)
    assert p2.shape[-1] == 3
    assert int(p2[0, 0]) == 3 | (0 << 2) | (3 << 4)  # channels 0, 3, 6; channel 9 is padding
    three = pack(torch.full((1, 64), 7, dtype=torch.uint8), 3)
    assert three.shape[-1] == 24  # 16 bytes of low bits + 8 bytes of high bits


def test_pack_rejects_bad_input():
    with pytest.raises(ShapeError, match="does not fit in 2 bits"):
        pack(torch.tensor([[4]], dtype=torch.uint8), 2)
    with pytest.raises(DTypeError):
        pack(torch.tensor([[1]], dtype=torch.int32), 2)
    with pytest.raises(ConfigError, match="allowed: 1, 2, 3, 4, 8"):
        pack(torch.tensor([[1]], dtype=torch.uint8), 5)
    with pytest.raises(ShapeError, match="take 2"):
        unpack(torch.zeros((1, 3), dtype=torch.uint8), 4, 4)


# ---------------------------------------------------------------------------------------------
# Scales, shapes, rotation, bad input
# ---------------------------------------------------------------------------------------------


@given(v=st.floats(1e-30, 1e4).map(lambda f: float(np.float32(f))), dtype=st.sampled_from(["fp16", "bf16", "fp32"]))
def test_metadata_casts_round_outward(v, dtype):
    t = torch.tensor([v], dtype=torch.float32)
    assert float(ceil_cast(t, dtype).float()) >= float(t)
    assert float(floor_cast(t, dtype).float()) <= float(t)
    assert float(floor_cast(-t, dtype).float()) <= -float(t)


@pytest.mark.parametrize(
    "gran, expect",
    [
        (PerTensor(), (1, 1, 1)),
        (PerHead(), (3, 1, 1)),
        (PerToken(), (3, 63, 1)),
        (PerTokenGroup(16), (3, 63, 4)),
        (PerChannel(32), (3, 2, 64)),
        (PerChannel(None), (3, 1, 64)),
        (PerPage(), (3, 4, 1)),
    ],
)
def test_scale_shapes(gran, expect):
    fmt = int_format(4, gran)
    assert scale_shape(fmt, 3, 63, 64, 16) == expect
    qt = quantize(torch.randn(2, 3, 63, 64), fmt, page_size=16)
    assert tuple(qt.scale.shape) == (2, *expect)
    assert qt.scale.dtype == torch.float16


def test_hadamard_is_orthogonal_and_preserves_attention_products():
    H = hadamard(64).double()
    assert torch.allclose(H @ H, torch.eye(64, dtype=torch.float64), atol=1e-6)
    q, k = torch.randn(5, 64, dtype=torch.float64), torch.randn(7, 64, dtype=torch.float64)
    assert torch.allclose((q @ H) @ (k @ H).T, q @ k.T, atol=1e-5)
    with pytest.raises(ShapeError, match="power-of-two"):
        hadamard(48)


@given(n=st.sampled_from([1, 2, 4, 16, 32, 64, 128, 256]), rows=st.integers(1, 5), seed=st.integers(0, 2**31),
       mag=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
def test_fast_hadamard_equals_the_matrix_product(n, rows, seed, mag):
    """The butterfly rotation is ``x @ H`` up to fp32 rounding: each of the log2(n) stages adds one
    rounding of at most half an ulp of the running magnitude, bounded by ``sqrt(n) * max|x|``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * mag).float()
    got = hadamard_rotate(x).double()
    want = x.double() @ hadamard(n).double()
    stages = max(n.bit_length() - 1, 1)
    bound = (stages + 1) * EPS32 * math.sqrt(n) * float(x.abs().max()) + 1e-45
    assert float((got - want).abs().max()) <= bound
    # self-inverse up to the same rounding, and the scale is the fp32 1/sqrt(n)
    back = hadamard_rotate(hadamard_rotate(x)).double()
    assert float((back - x.double()).abs().max()) <= 2 * bound
    assert hadamard_scale(n) == float(np.float32(1 / math.sqrt(n)))


@given(st.integers(0, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_fast_hadamard_is_the_butterfly_definition_bit_for_bit(log_d, rows, seed):
    """The buffered implementation performs the defined butterflies (stacked afresh at every stage
    here) bit for bit, and never writes its input."""
    def stacked(x):
        D, lead, y, h = x.shape[-1], x.shape[:-1], x.float(), 1
        while h < D:
            y4 = y.reshape(*lead, D // (2 * h), 2, h)
            y = torch.stack((y4[..., 0, :] + y4[..., 1, :], y4[..., 0, :] - y4[..., 1, :]), dim=-2).reshape(*lead, D)
            h *= 2
        return y * hadamard_scale(D)

    g = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, 3, 2 ** log_d), generator=g) * torch.exp(torch.randn((rows, 3, 1), generator=g) * 3)
    x0 = x.clone()
    assert torch.equal(hadamard_rotate(x), stacked(x))
    assert torch.equal(x, x0)  # the input is not written


def test_fast_hadamard_is_exact_on_integers_and_rejects_bad_sizes():
    # small integers: every butterfly is exact, so the result is exactly x @ H (H = +-1/sqrt(n))
    x = torch.arange(-32, 32, dtype=torch.float32).reshape(2, 32)
    assert torch.equal(hadamard_rotate(x), ((x.double() @ torch.sign(hadamard(32)).double()).float()
                                            * hadamard_scale(32)))
    with pytest.raises(ShapeError, match="power-of-two"):
        hadamard_rotate(torch.zeros(3, 48))


def test_hadamard_rotation_spreads_an_outlier_channel():
    torch.manual_seed(0)
    x = torch.randn(1, 1, 256, 64)
    x[..., 5] *= 50.0
    plain = int_format(4, PerToken())
    rot = int_format(4, PerToken(), rotate="hadamard")
    err_plain = float(((quantize(x, plain).dequantize() - x) ** 2).mean())
    err_rot = float(((quantize(x, rot).dequantize() - x) ** 2).mean())
    assert err_rot < 0.5 * err_plain


def test_mse_clip_never_worse_than_absmax():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64) ** 3  # heavy tails
    for bits in (2, 3, 4):
        base = int_format(bits, PerTokenGroup(32))
        mse = int_format(bits, PerTokenGroup(32), clip=MSEClip(grid=16))
        e0 = ((quantize(x, base).dequantize() - x) ** 2).sum()
        e1 = ((quantize(x, mse).dequantize() - x) ** 2).sum()
        assert float(e1) <= float(e0)


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 3, 4]), st.integers(2, 6), st.booleans())
def test_asymmetric_mse_clip_never_worse_than_symmetric_per_block(seed, bits, grid, static):
    """Searching the two ends separately tries every symmetric ratio too (the pairs (r, r)), so
    per block its squared error is never larger; and it is the first pair of least error."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, 8, generator=g) ** 3 + torch.randn(1, 1, 8, generator=g)  # skewed, heavy tails
    gran = PerChannel(None) if static else PerToken()
    sym = int_format(bits, gran, clip=MSEClip(grid=grid, min_ratio=0.2))
    asym = int_format(bits, gran, clip=MSEClip(grid=grid, min_ratio=0.2, asymmetric=True))
    dims = (1,) if static else (2,)
    e_sym = ((fake_quantize(x, sym) - x) ** 2).double().sum(dims)
    e_asym = ((fake_quantize(x, asym) - x) ** 2).double().sum(dims)
    assert bool((e_asym <= e_sym * (1 + 1e-12) + 1e-12).all())
    # brute force over the pairs (static case): the oracle reaches the least error of any pair
    if static:
        from kverr.quant import range_params

        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        best = None
        rs = asym.clip.ratios()
        for rl, rh in [(a, b) for a in rs for b in rs]:  # every pair, independently of pairs()
            sc, z = range_params(asym, mid - half * rl, mid + half * rh)
            e = ((fake_quantize(x, int_format(bits, gran), scale=sc, zero=z) - x) ** 2).double().sum(1)
            best = e if best is None else torch.minimum(best, e)
        assert len(asym.clip.pairs()) == grid * grid and asym.clip.pairs()[0] == (1.0, 1.0)
        torch.testing.assert_close(e_asym, best, rtol=1e-12, atol=1e-12)


def test_asymmetric_mse_clip_config_and_refusals():
    from kverr.config import CacheConfig
    from kverr.exceptions import KernelError
    from kverr.gpu.spec import kernel_spec

    a = int_format(2, PerChannel(None), clip=MSEClip(grid=5, min_ratio=0.2, asymmetric=True))
    cfg = CacheConfig(k=a, v=int_format(2, PerToken(), clip=MSEClip(grid=5, min_ratio=0.2)))
    d = cfg.to_dict()
    assert d["k"]["clip"]["asymmetric"] is True and "asymmetric" not in d["v"]["clip"]  # old JSON unchanged
    assert CacheConfig.from_dict(d) == cfg and a.label() == "int2a/chall/fp16/amse"
    with pytest.raises(ConfigError, match="zero point"):
        int_format(4, PerToken(), symmetric=True, clip=MSEClip(asymmetric=True))
    with pytest.raises(KernelError, match="static scales"):
        kernel_spec(int_format(2, PerToken(), clip=MSEClip(asymmetric=True)), 64, 64)
    assert kernel_spec(a, 64, 64).clip_ratios == ()  # static: the scales come calibrated


def test_percentile_clip_matches_numpy_on_a_single_block():
    torch.manual_seed(2)
    x = torch.randn(1, 1, 1, 64)
    fmt = int_format(8, PerToken(), symmetric=True, scale_dtype="fp32", clip=Percentile(90.0))
    qt = quantize(x, fmt)
    expect = np.percentile(np.abs(x.numpy().ravel()), 90.0) / 127
    assert float(qt.scale) == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(1, 2, 5, 8)
    x[0, 1, 3, 2] = bad
    with pytest.raises(NonFiniteError, match=r"1 NaN/Inf value\(s\), the first at index \(0, 1, 3, 2\)"):
        quantize(x, int_format(4, PerToken()))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ShapeError, match="kv_head, token, channel"):
        quantize(torch.randn(4, 8), int_format(4, PerToken()))
    with pytest.raises(DTypeError, match="floating"):
        quantize(np.ones((1, 2, 3), dtype=np.int32), int_format(4, PerToken()))
    with pytest.raises(ConfigError, match="does not divide the head dimension 48"):
        quantize(torch.randn(1, 1, 4, 48), int_format(4, PerTokenGroup(32)))
    with pytest.raises(ConfigError, match="page_size"):
        quantize(torch.randn(1, 1, 4, 8), int_format(4, PerPage()))
    with pytest.raises(ConfigError, match="overflows scale_dtype='fp16'"):
        quantize(torch.full((1, 1, 2, 8), 1e9), int_format(8, PerToken(), symmetric=True))
    with pytest.raises(ShapeError, match="does not broadcast"):
        quantize(torch.randn(1, 2, 4, 8), fp8_format(PerHead()), scale=torch.ones(3))


def test_numpy_input_and_float64_are_accepted():
    x = np.random.default_rng(0).standard_normal((3, 10, 16))
    qt = quantize(x, int_format(4, PerTokenGroup(8)))
    assert qt.dequantize().shape == (3, 10, 16)
    assert qt.dequantize().dtype == torch.float32


def test_quantize_static_scale_is_used_as_given():
    x = torch.randn(1, 2, 9, 8)
    s = torch.tensor([0.5, 0.25]).reshape(2, 1, 1)
    qt = quantize(x, fp8_format(PerHead()), scale=s)
    assert torch.equal(qt.scale.reshape(-1), torch.tensor([0.5, 0.25]))


def test_asymmetric_grid_of_two_bits_has_four_levels():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0]).reshape(1, 1, 1, 4)
    qt = quantize(x, int_format(2, PerToken(), scale_dtype="fp32"))
    assert torch.equal(qt.dequantize(), x)


@given(st.data())
def test_fake_quantize_is_dequantize_of_quantize_bit_for_bit(draw):
    x = draw.draw(data())
    fmt = draw.draw(formats(x.shape[-1], PAGE, floats=True))
    assert torch.equal(fake_quantize(x, fmt, page_size=PAGE), dequantize(quantize(x, fmt, page_size=PAGE)))


@given(st.data())
def test_zero_tokens_quantize_to_zero_tokens(draw):
    """A tensor with no token yet (an empty window, a cache before its first step) goes through
    quantize, dequantize and fake_quantize as an empty tensor of its shape, for every format."""
    x = torch.zeros(2, 3, 0, 16)
    fmt = draw.draw(formats(16, PAGE, floats=True))
    qt = quantize(x, fmt, page_size=PAGE)
    assert qt.codes.shape[:-1] == (2, 3, 0)
    assert dequantize(qt).shape == x.shape and fake_quantize(x, fmt, page_size=PAGE).shape == x.shape
    if qt.scale is not None:  # per-element metadata, as the error decomposition reads it
        assert qt.element_metadata()[0].shape == x.shape


@pytest.mark.parametrize("fmt", [
    int_format(4, PerToken()),
    int_format(2, PerTokenGroup(16), symmetric=True),
    int_format(3, PerChannel(None), clip=MSEClip(grid=4, min_ratio=0.5, asymmetric=True)),
    int_format(4, PerPage(), clip=Percentile(99.0)),
    int_format(4, PerHead(), rotate="hadamard"),
    fp8_format(PerToken()),
], ids=lambda f: f.label())
def test_staged_api_is_the_oracle_bit_for_bit(fmt):
    """to_blocks -> clip_range -> fit_params -> encode_blocks -> decode_blocks -> ungroup gives
    quantize's codes and metadata and fake_quantize's values exactly (T = 37: a padded last
    block), with the clip range taken once and passed in, as a caller sharing it would."""
    from kverr.quant import (block_shape, clip_range, decode_blocks, encode_blocks, fake_quantize_blocks,
                             fit_params, to_blocks)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 37, 32, generator=g) * torch.linspace(0.5, 4, 32)
    B, H, T, D = x.shape
    xr = hadamard_rotate(x) if fmt.rotate == "hadamard" else x
    blocks = to_blocks(xr, block_shape(fmt, H, T, D, 16))
    clip = clip_range(fmt, blocks)
    s, m = fit_params(fmt, blocks, clip=clip)
    codes = encode_blocks(fmt, blocks.values, s, m)
    values = blocks.ungroup(decode_blocks(fmt, codes, s, m))
    shared = blocks.ungroup(fake_quantize_blocks(fmt, blocks, clip=clip))
    if fmt.rotate == "hadamard":
        values, shared = hadamard_rotate(values), hadamard_rotate(shared)
    qt = quantize(x, fmt, page_size=16)
    assert torch.equal(s, qt.scale) and (m is None) == (qt.zero is None)
    assert m is None or torch.equal(m, qt.zero)
    assert torch.equal(blocks.ungroup(codes), qt.unpacked_codes())
    want = fake_quantize(x, fmt, page_size=16)
    assert torch.equal(values, want) and torch.equal(shared, want)
    assert torch.equal(dequantize(qt), want)


def test_staged_api_refuses_bad_input():
    from kverr.quant import fit_params, float_format, to_blocks

    with pytest.raises(ShapeError, match=r"\[B, H, T, D\]"):
        to_blocks(torch.zeros(3, 4, 8), (1, 1, 8))
    with pytest.raises(ShapeError, match="does not tile"):
        to_blocks(torch.zeros(1, 3, 4, 8), (2, 1, 8))
    blocks = to_blocks(torch.zeros(1, 2, 4, 8), (1, 1, 8))
    with pytest.raises(ConfigError, match="no scales"):
        fit_params(float_format("bf16"), blocks)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("variant", [{}, {"rounding": "half_away"}, {"reciprocal": True}])
def test_round_trip_without_codes_is_the_codes_round_trip_bit_for_bit(bits, symmetric, variant):
    """round_trip_blocks (the MSE clip search's inner step) leaves out the codes of integer
    formats; its values are decode_blocks(encode_blocks(...)) bit for bit, zeros' signs included:
    values that round to -0, exact halves, values far outside the range (clamped), a zero scale."""
    from kverr.quant import decode_blocks, encode_blocks
    from kverr.quant.reference import round_trip_blocks

    fmt = dataclasses.replace(int_format(bits, PerTokenGroup(16), symmetric=symmetric), **variant)
    g = torch.Generator().manual_seed(bits)
    s = (torch.rand(5, 2, 7, 4, generator=g) * 0.5).to(torch.float16)
    s[0, 0, 0, 0] = 0.0
    x = torch.randn(5, 2, 7, 4, 16, generator=g) * 3
    x[..., :4] = (torch.randint(-9, 10, (5, 2, 7, 4, 4), generator=g) + 0.5) * s.float().unsqueeze(-1)  # halves
    x[..., 4] = -1e-6  # rounds to -0
    x[..., 5] = 0.0
    x[..., 6] = -1e4
    m = None if symmetric else (torch.randn(5, 2, 7, 4, generator=g) * 0.1).to(torch.float16)
    want = decode_blocks(fmt, encode_blocks(fmt, x, s, m), s, m)
    got = round_trip_blocks(fmt, x, s, m)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_static_scales_fit_a_ragged_batch_as_one_run_of_its_tokens():
    """fit_static_scales pools the tokens of sequences of different lengths per head and channel:
    the same scales and zeros as one sequence holding all of them, and each head keeps its own."""
    from kverr.quant.store import fit_static_scales

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 3, 5, 16, generator=g), torch.randn(2, 3, 4, 16, generator=g) * 3
    fmt = int_format(3, PerChannel(None), clip=MSEClip())
    pooled = torch.cat([a[0], b[0], b[1]], dim=1)[None]  # [1, h, 13, D]
    scale, zero = fit_static_scales([a, b], fmt, PAGE)
    want = quantize(pooled, fmt, page_size=PAGE)
    assert torch.equal(scale, want.scale[0]) and torch.equal(zero, want.zero[0])
    assert not torch.equal(scale[0], scale[1])  # a head's scales come from its own tokens
    for bad in ([a, b[:, :2]], [a[0]]):
        with pytest.raises(ShapeError, match="want"):
            fit_static_scales(bad, fmt, PAGE)
    with pytest.raises(ShapeError, match="no tokens"):
        fit_static_scales([], fmt, PAGE)
