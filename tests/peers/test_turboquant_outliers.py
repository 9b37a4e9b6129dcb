"""TurboQuant with outlier channels, emulated: the sphere's Lloyd-Max levels, one instance's
distortion, the outlier split, the bytes, and the peer in ``kverr evaluate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import integrate
from scipy.special import beta as beta_fn

from kverr.memory import ModelShape, account
from kverr.peers import turboquant as tqo
from kverr.quant.codebooks import lloyd_max_normal, lloyd_max_sphere


def _density(dim):
    return lambda x: (1 - x * x) ** ((dim - 3) / 2) / beta_fn(0.5, (dim - 1) / 2)


def test_sphere_levels_in_three_dimensions_are_the_uniform_grid():
    # a coordinate of a uniform point on the 2-sphere is uniform on [-1, 1] (Archimedes)
    for bits in (2, 3):
        n = 2**bits
        assert lloyd_max_sphere(3, bits) == tuple(np.float32(-1 + (2 * i + 1) / n) for i in range(n))


@pytest.mark.parametrize("dim,bits", [(32, 2), (32, 3), (64, 4), (8, 2)])
def test_sphere_levels_are_the_centroids_of_their_cells(dim, bits):
    c = np.array(lloyd_max_sphere(dim, bits), dtype=np.float64)
    t = np.concatenate(([-1.0], (c[:-1] + c[1:]) / 2, [1.0]))
    f = _density(dim)
    for i in range(len(c)):  # quadrature, independent of the closed forms the fit uses
        mass = integrate.quad(f, t[i], t[i + 1], epsabs=1e-13)[0]
        moment = integrate.quad(lambda x: x * f(x), t[i], t[i + 1], epsabs=1e-13)[0]
        assert abs(moment / mass - c[i]) < 2e-6 * max(1.0, abs(c[i]))


def test_sphere_levels_approach_the_normals_in_high_dimension():
    for bits in (2, 3):
        got = np.array(lloyd_max_sphere(4096, bits)) * 64
        np.testing.assert_allclose(got, lloyd_max_normal(bits), rtol=2e-3)


def test_one_instance_has_the_distortion_its_levels_predict():
    # E||u - Q(u)||^2 for a unit vector is m times one coordinate's quantizer error, from the density
    g = torch.Generator().manual_seed(1)
    m = 32
    x = torch.randn(20000, m, generator=g, dtype=torch.float64) * torch.linspace(0.1, 5, m, dtype=torch.float64)
    x = x.float()
    f = _density(m)
    for bits in (2, 3):
        c = np.array(lloyd_max_sphere(m, bits), dtype=np.float64)
        t = np.concatenate(([-1.0], (c[:-1] + c[1:]) / 2, [1.0]))
        per_coord = sum(integrate.quad(lambda v, ci=ci: (v - ci) ** 2 * f(v), a, b)[0]
                        for ci, a, b in zip(c, t[:-1], t[1:]))
        xh = tqo.fake_quantize_set(x, bits)
        norm = torch.linalg.vector_norm(x.double(), dim=-1)
        rel = (((xh.double() - x.double()) ** 2).sum(-1) / norm**2).mean()
        # the rotation makes any input's unit vector uniform on the sphere; sampling error of the
        # mean over 20000 rows ~1 %, the fp16 norm adds ~1e-7
        assert float(rel) == pytest.approx(m * per_coord, rel=0.03)


def test_a_zero_set_reads_back_zero_and_the_norm_is_fp16():
    x = torch.zeros(2, 32)
    x[1] = torch.linspace(-3, 7, 32)
    xh = tqo.fake_quantize_set(x, 3)
    assert torch.equal(xh[0], torch.zeros(32))
    n16 = torch.linalg.vector_norm(x[1]).to(torch.float16).double()
    levels_norm = torch.linalg.vector_norm(xh[1].double()) / n16  # |levels| of one unit row
    assert 0.8 < float(levels_norm) < 1.05


def test_outliers_are_the_loud_half_and_get_one_bit_more():
    g = torch.Generator().manual_seed(2)
    scale = torch.ones(64)
    loud = torch.randperm(64, generator=g)[:32]
    scale[loud] = 6.0
    x = torch.randn(1, 2, 300, 64, generator=g) * scale
    mask = tqo.outlier_channels(x)
    assert mask.shape == (2, 64) and bool(mask[:, loud].all()) and int(mask.sum()) == 64
    xh = tqo.fake_quantize(x, mask, 2)
    for h in range(2):  # each set is one instance: the outliers at 3 bits, the rest at 2
        assert torch.equal(xh[:, h][..., mask[h]], tqo.fake_quantize_set(x[:, h][..., mask[h]], 3))
        assert torch.equal(xh[:, h][..., ~mask[h]], tqo.fake_quantize_set(x[:, h][..., ~mask[h]], 2))


@pytest.mark.parametrize("name,bits", sorted(tqo.VARIANTS.items()))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_are_the_codes_and_two_fp16_norms_per_row(name, bits, head_dim):
    L, H, T = 3, 2, 1000
    rep = account(tqo.equivalent(name, L, head_dim), ModelShape(L, H, head_dim), T)
    row_bits = head_dim * (bits + 0.5) + 32
    for layer in range(L):
        b = rep.layer_total(layer)
        assert (b.payload + b.padding) * 8 == 2 * H * T * row_bits  # keys and values
        assert b.static == 2 * H * head_dim * 4  # the equivalent's per-channel fp16 scale and zero


def test_the_cache_fixes_its_split_on_the_first_rows():
    cache = tqo.make_cache("turboquant-2.5", 2)
    g = torch.Generator().manual_seed(4)
    first = torch.randn(1, 2, 40, 64, generator=g) * torch.linspace(0.1, 4, 64)
    k, v = cache.update(first.clone(), first.clone(), 0)
    mask = tqo.outlier_channels(first)
    assert torch.equal(k, tqo.fake_quantize(first, mask, 2))
    later = torch.randn(1, 2, 1, 64, generator=g) * torch.linspace(4, 0.1, 64)  # loud channels swapped
    k2, _ = cache.update(later.clone(), later.clone(), 0)
    assert torch.equal(k2[:, :, -1:], tqo.fake_quantize(later, mask, 2))
