"""Keys rounded with error compensation (:mod:`kverr.quant.compensated`): the grid and bytes are
the format's, the codes are the nearest ones where nothing can be compensated, the cost they were
chosen under falls, and the cost matrices are the queries' moments turned by RoPE."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kverr.exceptions import ConfigError, ShapeError
from kverr.quant import (
    MSEClip, PerChannel, PerToken, PerTokenGroup, fp8_format, hadamard_rotate, int_format, quantize,
)
from kverr.quant.compensated import (
    KeyCost, compensable, compensated_quantize, compensation_factor, query_moment, reads_in_groups, turned_cost,
)
from kverr.rope import default_inv_freq, rope_cos_sin, rotate

D = 32
STATIC = int_format(2, PerChannel())
FORMATS = {
    "int2 asymmetric, static per channel": STATIC,
    "int3 symmetric, per token": int_format(3, PerToken(), symmetric=True),
    "int4 asymmetric, token groups, Hadamard": int_format(4, PerTokenGroup(16), rotate="hadamard"),
    "widths 0/2/3/4 per channel, MSE clip": dataclasses.replace(
        int_format(4, PerChannel(), clip=MSEClip(grid=5, min_ratio=0.6)), channel_bits=(0, 2, 3, 4) * (D // 4)),
}


def _x(T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, T, D, generator=g) * torch.linspace(0.3, 2.5, D)


def _cost(seed=1, n=400):
    """The second moment of correlated, anisotropic queries ``[D, D]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, D, generator=g) @ torch.randn(D, D, generator=g)
    return (q.T @ q / n).double()


def _score_cost(x, q, C):
    e = (x - q.dequantize()).double()
    return float(torch.einsum("...d,...de,...e->", e, C, e))


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_diagonal_cost_compensates_nothing_so_the_codes_are_nearest(name):
    # With C diagonal (in the coordinates the format rounds in: a rotated format's cost is
    # A diag A^T) its inverse is, so its Cholesky factor has nothing above the diagonal and no
    # channel moves another: every code is the format's own, bit for bit (a scalar multiple of the
    # identity, and a diagonal that orders the channels otherwise).
    fmt, x = FORMATS[name], _x()
    want = quantize(x, fmt, page_size=64)
    A = hadamard_rotate(torch.eye(D)).double() if fmt.rotate == "hadamard" else torch.eye(D, dtype=torch.float64)
    for C in (torch.eye(D) * 3.0, A @ torch.diag(torch.linspace(5.0, 0.1, D, dtype=torch.float64)) @ A.T):
        got = compensated_quantize(x, fmt, C, page_size=64)
        assert torch.equal(got.codes, want.codes)
        assert torch.equal(got.scale, want.scale)
        assert (got.zero is None) == (want.zero is None) and (got.zero is None or torch.equal(got.zero, want.zero))


@pytest.mark.parametrize("name", list(FORMATS))
def test_under_a_correlated_cost_the_codes_change_and_the_cost_falls(name):
    # Same scales and zero points, other codes; under the cost they were chosen for, the error
    # costs much less than nearest rounding's (random keys: 0.45-0.55 of it at these widths),
    # though its plain squared error is larger.
    fmt, x, C = FORMATS[name], _x(), _cost()
    near = quantize(x, fmt, page_size=64)
    got = compensated_quantize(x, fmt, C, page_size=64)
    assert torch.equal(got.scale, near.scale) and not torch.equal(got.codes, near.codes)
    assert got.codes.shape == near.codes.shape and got.codes.dtype == near.codes.dtype
    assert _score_cost(x, got, C) < 0.7 * _score_cost(x, near, C)
    assert float(((x - got.dequantize()) ** 2).sum()) > float(((x - near.dequantize()) ** 2).sum())


def test_channels_without_bits_read_back_their_zero_point_and_the_first_channel_rounds_to_nearest():
    fmt, x, C = FORMATS["widths 0/2/3/4 per channel, MSE clip"], _x(), _cost()
    near, got = quantize(x, fmt, page_size=64), compensated_quantize(x, fmt, C, page_size=64)
    zero = [i for i, b in enumerate(fmt.channel_bits) if b == 0]
    assert torch.equal(got.dequantize()[..., zero], near.dequantize()[..., zero])
    # every channel has bits: they go by falling diagonal, and the largest is rounded first,
    # before any error reached it (with channels without bits, their error reaches it)
    fmt = STATIC
    near, got = quantize(x, fmt, page_size=64), compensated_quantize(x, fmt, C, page_size=64)
    first = int(torch.argmax(C.diagonal()))
    assert torch.equal(got.unpacked_codes()[..., first], near.unpacked_codes()[..., first])
    second = int(torch.argsort(C.diagonal(), descending=True)[1])
    assert not torch.equal(got.unpacked_codes()[..., second], near.unpacked_codes()[..., second])


def test_a_cost_per_token_weighs_each_token_on_its_own():
    # Token t under the cost of token t: the same codes as that token quantized alone with its cost
    # (static scales given, so the tokens share the grid).
    fmt, x = STATIC, _x(T=6)
    ref = quantize(x, fmt)
    C = torch.stack([_cost(seed=s) for s in range(6)])  # [T, D, D]
    got = compensated_quantize(x, fmt, C, scale=ref.scale, zero=ref.zero)
    for t in range(6):
        one = compensated_quantize(x[:, :, t:t + 1], fmt, C[t], scale=ref.scale, zero=ref.zero)
        assert torch.equal(got.unpacked_codes()[:, :, t:t + 1], one.unpacked_codes())


def test_the_moment_is_that_of_the_last_queries_of_the_heads_that_read_each_kv_head():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 10, D, generator=g)  # 6 query heads read 3 kv heads
    m = query_moment(q, 3, last=4)
    assert m.shape == (2, 3, D, D) and m.dtype == torch.float64
    for b in range(2):
        for h in range(3):
            rows = q[b, 2 * h:2 * h + 2, -4:].reshape(8, D).double()
            torch.testing.assert_close(m[b, h], rows.T @ rows / 8, rtol=1e-12, atol=1e-12)
    with pytest.raises(ShapeError, match="cannot be shared"):
        query_moment(q, 4, last=4)


def test_the_grouping_it_takes_is_query_head_i_reading_kv_head_i_over_the_group_size():
    assert reads_in_groups([0, 0, 1, 1], 2) and reads_in_groups(torch.arange(6), 6)
    assert not reads_in_groups([0, 1, 0, 1], 2)  # interleaved
    assert not reads_in_groups([0, 0, 1], 2)  # 3 query heads cannot share 2 kv heads evenly
    assert not reads_in_groups([0, 0], 0)


def test_the_turned_cost_is_the_mean_squared_score_error_after_rope():
    # e^T C_t e = mean over the queries of (q . R_t e)^2: the score error a pre-RoPE key error
    # makes at position t, to float64 round-off (the rotation itself is computed in float32, so
    # the tolerance is float32's).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 50, D, generator=g)
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 300, 4097]), default_inv_freq(D, 10000.0))
    C = turned_cost(query_moment(q, 1, last=50)[0, 0], cos, sin)  # [4, D, D]
    e = torch.randn(4, D, generator=g)
    scores = q[0, 0] @ rotate(e, cos, sin).T  # [query, position]
    want = (scores.double() ** 2).mean(0)
    got = torch.einsum("td,tde,te->t", e.double(), C, e.double())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_the_turned_cost_is_p_sigma_p_transposed_whatever_the_chunking():
    # C_t = P_t Σ P_tᵀ with P_t's rows R_t e_j: formed elementwise (two terms per row), it equals
    # the two products to float64 round-off -- each entry a sum of at most four products of
    # float64 numbers, so a few ulps of the largest entry -- for heads and a token count that
    # leaves a partial chunk; tokens do not depend on the chunk they fall in.
    import kverr.quant.compensated as comp

    g = torch.Generator().manual_seed(8)
    m = query_moment(torch.randn(1, 4, 40, D, generator=g), 2, last=40)[0].double()  # [H=2, D, D]
    T = 2 * comp.TURN_CHUNK + 5
    cos, sin = rope_cos_sin(torch.arange(T) * 37, default_inv_freq(D, 10000.0))
    P = rotate(torch.eye(D).expand(T, D, D), cos.float()[:, None, :], sin.float()[:, None, :]).double()
    want = P @ m[:, None] @ P.transpose(-1, -2)  # [H, T, D, D]
    got = turned_cost(m, cos, sin)
    assert got.shape == want.shape == (2, T, D, D)
    assert float((got - want).abs().max()) <= 8 * torch.finfo(torch.float64).eps * float(want.abs().max())
    assert torch.equal(turned_cost(m, cos[T - 3:], sin[T - 3:]), got[:, T - 3:])
    with pytest.raises(ShapeError, match="even"):
        turned_cost(m[..., :3, :3], cos[:, :3], sin[:, :3])


def test_a_key_cost_of_a_moment_is_the_moment_after_rope_and_turned_to_each_position_before():
    g = torch.Generator().manual_seed(4)
    m = query_moment(torch.randn(1, 4, 30, D, generator=g), 2, last=30)[0]  # [H=2, D, D]
    post = KeyCost.of_moment(m)
    assert post.cost.shape == (2, 1, D, D) and torch.equal(post.cost[:, 0], m)
    pos = torch.tensor([0, 5, 900])
    rope = {"rope_theta": 1e4, "inv_freq": default_inv_freq(D, 1e4).tolist()}
    pre = KeyCost.of_moment(m, positions=pos, rope=rope)
    assert torch.equal(pre.cost, turned_cost(m, *rope_cos_sin(pos, default_inv_freq(D, 1e4))))
    with pytest.raises(ShapeError, match="both"):
        KeyCost.of_moment(m, positions=pos)
    with pytest.raises(ConfigError, match=f"all {D} channels"):  # partial rotary: channels left unturned
        KeyCost.of_moment(m, positions=pos, rope={"rope_theta": 1e4, "inv_freq": default_inv_freq(D // 2, 1e4).tolist()})
    with pytest.raises(ShapeError, match="moment"):
        KeyCost.of_moment(m[0])  # one [D, D] matrix: no head axis


def test_what_it_refuses():
    x = _x()
    assert not compensable(fp8_format(PerToken())) and compensable(STATIC)
    with pytest.raises(ConfigError, match="nearest rounding"):
        compensated_quantize(x, fp8_format(PerToken()), torch.eye(D))
    with pytest.raises(ShapeError, match="does not broadcast"):
        compensated_quantize(x, STATIC, torch.eye(D + 1))
    with pytest.raises(ConfigError, match="NaN"):
        compensated_quantize(x, STATIC, torch.full((D, D), math.nan))
    with pytest.raises(ConfigError, match="damp"):
        compensated_quantize(x, STATIC, torch.eye(D), damp=-1.0)


def _costs(T, heads=3):
    """Per-token costs ``[heads, T, D, D]``: each head's own queries' moment, turned by RoPE."""
    cos, sin = rope_cos_sin(torch.arange(T), default_inv_freq(D, 10000.0))
    return torch.stack([turned_cost(_cost(seed=10 + h), cos, sin) for h in range(heads)])


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_factor_made_once_rounds_as_its_cost_does_for_any_heads_and_tokens(name):
    # KeyCost factors each (rotation, channels without bits) once; the codes it gives, for all
    # heads or some, all tokens or a range, are those of the cost itself, bit for bit
    fmt, x = FORMATS[name], _x(T=40)
    C = _costs(40)
    kc = KeyCost(C)
    want = compensated_quantize(x, fmt, C, page_size=64)
    assert torch.equal(compensated_quantize(x, fmt, kc.factor(fmt), page_size=64).codes, want.codes)
    for hs in ([1, 2], [0, 2], [2]):  # consecutive heads are taken as a view, others as a copy
        sub, Csub = x[:, hs, 5:30], C[hs, 5:30]
        want = compensated_quantize(sub, fmt, Csub, page_size=64).codes
        for fac in (kc.factor(fmt, hs).select(tokens=slice(5, 30)), kc.heads(hs).factor(fmt).select(tokens=slice(5, 30)),
                    KeyCost(C).heads(hs).factor(fmt).select(tokens=slice(5, 30))):
            assert torch.equal(compensated_quantize(sub, fmt, fac, page_size=64).codes, want)
    sub = x[:, 1:, 5:30]
    # one cost for all tokens of a head broadcasts, and a token range keeps it whole
    one = C[:, :1]
    got = compensated_quantize(sub, fmt, KeyCost(one).factor(fmt, [1, 2]).select(tokens=slice(5, 30)), page_size=64)
    assert torch.equal(got.codes, compensated_quantize(sub, fmt, one[1:], page_size=64).codes)


def test_subsets_of_heads_share_the_factor_of_all_heads(monkeypatch):
    # formats rounded head by head (templates) and on all heads at once share the factor of all
    # heads, once made, whichever subset of the cost they take it from; a subset asked for before
    # gets its own, the same bits
    import kverr.quant.compensated as comp

    fmt = STATIC
    C = _costs(30)
    direct = compensation_factor(C, fmt)
    calls = []
    real = comp._factor
    monkeypatch.setattr(comp, "_factor", lambda c, f, d: calls.append(c.shape[-4]) or real(c, f, d))
    kc = KeyCost(C)
    early = kc.heads([2, 1]).factor(fmt)
    assert torch.equal(early.channel_major, direct.channel_major[:, :, [2, 1]])
    assert torch.equal(early.order, direct.order[[2, 1]])
    sub = kc.heads([0, 2])
    whole = kc.factor(fmt)
    assert calls == [2, 3]
    assert torch.equal(whole.order, direct.order) and torch.equal(whole.channel_major, direct.channel_major)
    for got, hs in ((sub.factor(fmt), [0, 2]), (sub.heads([1]).factor(fmt), [2]), (kc.heads([1]).factor(fmt), [1]),
                    (kc.factor(fmt, [2, 0]), [2, 0])):
        assert torch.equal(got.channel_major, direct.channel_major[:, :, hs])
    assert calls == [2, 3]  # each a view of the factor of all heads
    with pytest.raises(ShapeError, match="kv heads"):
        KeyCost(C).heads([0, 1]).factor(fmt, [2])


def test_a_key_cost_and_its_factors_are_freed_with_their_last_reference():
    # a layer's cost and factors hold hundreds of MB; a reference cycle would keep them until the
    # cyclic collector happened to run (a calibration grew by a layer's worth at each layer)
    import gc
    import weakref

    gc.disable()
    try:
        kc = KeyCost(_costs(8))
        sub = kc.heads([1, 2])
        sub.factor(STATIC)
        kc.factor(STATIC)
        refs = [weakref.ref(kc), weakref.ref(sub), weakref.ref(kc.cost)]
        del kc, sub
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_factor_is_the_upper_cholesky_factor_of_the_damped_inverse_in_the_order(name, monkeypatch):
    # U upper with a positive diagonal and U^T U = (C_o + lam I)^-1, C_o the cost in the format's
    # coordinates with rows and columns in the factor's order, lam = DAMP * mean(diag C). The
    # factor never forms the inverse; the reference does (torch.linalg.inv, then cholesky), so the
    # two agree to float64 rounding scaled by the damped cost's condition number, at most
    # 1 + trace(C) / lam = 1 + D / DAMP = 3201: with D-fold accumulation, about 3201 * 32 * eps
    # = 2e-11 relative; 1e-9 leaves room.
    from kverr.quant.compensated import DAMP

    fmt = FORMATS[name]
    C = _costs(21, heads=2)
    fac = compensation_factor(C, fmt)
    A = hadamard_rotate(torch.eye(D)).double() if fmt.rotate == "hadamard" else torch.eye(D, dtype=torch.float64)
    Cr = A.T @ C @ A
    o = fac.order
    Co = Cr.gather(-2, o[..., :, None].expand(*o.shape, D)).gather(-1, o[..., None, :].expand(*o.shape, D))
    lam = DAMP * Cr.diagonal(dim1=-2, dim2=-1).mean(-1)
    want = torch.linalg.cholesky(torch.linalg.inv(Co + lam[..., None, None] * torch.eye(D, dtype=torch.float64)),
                                 upper=True)
    U = fac.U
    assert torch.equal(U, U.triu()) and bool((U.diagonal(dim1=-2, dim2=-1) > 0).all())
    torch.testing.assert_close(U, want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
    # channels without bits come first, the rest by falling diagonal
    zeros = torch.tensor([b == 0 for b in fmt.channel_bits]) if fmt.channel_bits is not None else torch.zeros(D, dtype=torch.bool)
    d = Cr.diagonal(dim1=-2, dim2=-1).gather(-1, o)
    n0 = int(zeros.sum())
    assert bool(zeros[o[..., :n0]].all()) and bool((d[..., n0 + 1:] <= d[..., n0:-1]).all())
    # computed a few matrices at a time, it is the same, bit for bit
    monkeypatch.setattr("kverr.quant.compensated.FACTOR_CHUNK", 4)
    small = compensation_factor(C, fmt)
    assert torch.equal(small.order, fac.order) and torch.equal(small.channel_major, fac.channel_major)


def test_the_factor_is_made_on_the_cost_s_device():
    # the paged cache factors on its device (a GPU's); the meta device checks, without one, that no
    # tensor of the computation (rotation, channel mask, damping) is made on the host instead
    # (past compensation_factor's finiteness check, which reads a value a meta tensor has not)
    from kverr.quant.compensated import DAMP, _factor

    fmt = FORMATS["widths 0/2/3/4 per channel, MSE clip"]
    for f in (fmt, dataclasses.replace(fmt, rotate="hadamard")):
        fac = _factor(_costs(5, heads=2).to("meta"), f, DAMP)
        assert fac.order.device.type == "meta" and fac.channel_major.device.type == "meta"
        assert fac.order.shape == (2, 5, D) and fac.channel_major.shape == (D, D, 2, 5)


def test_a_factor_refuses_a_format_it_was_not_made_for():
    C = _costs(8, heads=1)
    fac = compensation_factor(C, STATIC)
    x = _x(T=8)[:, :1]
    with pytest.raises(ConfigError, match="factor"):
        compensated_quantize(x, dataclasses.replace(STATIC, rotate="hadamard"), fac)
    with pytest.raises(ConfigError, match="factor"):
        compensated_quantize(x, FORMATS["widths 0/2/3/4 per channel, MSE clip"], fac)
    # other widths with the same channels without bits share it
    assert fac.fits(int_format(3, PerChannel()))
    with pytest.raises(ConfigError, match="NaN"):
        KeyCost(torch.full((1, 2, D, D), math.nan))
    with pytest.raises(ShapeError, match=r"\[\.\.\., H, T, D, D\]"):
        KeyCost(torch.eye(D))


def test_reconstruct_rounds_keys_with_compensation_under_the_cost_it_is_given():
    # store.reconstruct of a config with key_rounding "compensated": sinks and window as received,
    # the quantized tokens compensated_quantize's codes (static scales fitted on them), values and
    # keys of a nearest config as before; a key cost exactly where it is used
    from kverr.config import CacheConfig
    from kverr.quant import dequantize
    from kverr.quant.store import receive, reconstruct, token_regions

    T = 150
    x = _x(T=T)[0]  # [H, T, D]
    C = _costs(T)
    cfg = CacheConfig(k=STATIC, v=STATIC, sinks=4, window=20, page_size=64, key_rounding="compensated")
    got = reconstruct(x, cfg, layer=0, which="k", key_cost=KeyCost(C))
    lo, hi = token_regions(T, cfg, STATIC)
    got_in = receive(x[None], cfg.window_dtype)[0]
    want = got_in.clone()
    want[:, lo:hi] = dequantize(compensated_quantize(got_in[None, :, lo:hi], STATIC, C[:, lo:hi], page_size=64))[0]
    assert torch.equal(got, want)
    near = cfg.with_(key_rounding="nearest")
    assert not torch.equal(got, reconstruct(x, near, layer=0, which="k"))
    assert torch.equal(reconstruct(x, cfg, layer=0, which="v"), reconstruct(x, near, layer=0, which="v"))
    with pytest.raises(ConfigError, match="key_cost"):
        reconstruct(x, cfg, layer=0, which="k")
    with pytest.raises(ConfigError, match="key_cost"):
        reconstruct(x, near, layer=0, which="k", key_cost=KeyCost(C))
