"""OSCAR, emulated: the rotation's parts, the attention-aware covariances, the INT2 rows, the
cache's regions and the bytes."""

from __future__ import annotations

import pytest
import torch

from kverr.engines.emulated import emulated_peers
from kverr.exceptions import ConfigError
from kverr.memory import ModelShape
from kverr.peers import oscar


def test_bit_reversal_puts_the_largest_eigenvalue_first():
    assert oscar.bit_reversal_columns(8) == [7, 3, 5, 1, 6, 2, 4, 0]
    assert oscar.bit_reversal_columns(128)[:6] == [127, 63, 95, 31, 111, 47]
    assert sorted(oscar.bit_reversal_columns(64)) == list(range(64))


def test_the_rotation_is_orthogonal_and_spreads_the_importance_evenly():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g, dtype=torch.float64)
    c = a @ a.T * torch.logspace(0, 3, 64, dtype=torch.float64)  # a peaky spectrum
    c = (c + c.T) / 2
    r = oscar.rotation(c)
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    # after U, every channel has one eigenvalue; the Hadamard gives each the mean of them all
    imp = torch.diagonal(r.T @ c @ r)
    assert torch.allclose(imp, torch.full_like(imp, float(torch.trace(c)) / 64), rtol=1e-9)
    with pytest.raises(ConfigError, match="power-of-two"):
        oscar.rotation(torch.eye(48, dtype=torch.float64))


def test_covariances_are_the_query_moment_and_the_logit_weighted_values():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(h, 10, 4, generator=g) for h in (4, 2, 2))
    kv_of_q = [0, 0, 1, 1]
    ck, cs = oscar.covariances(q, k, v, kv_of_q)
    want_k, want_s = torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64)
    for h in range(2):
        qs = [q[i].double() for i in range(4) if kv_of_q[i] == h]
        m = sum(qi.T @ qi for qi in qs) / (10 * len(qs))
        want_k += m / 2
        w = [sum(float(qi[n].double() @ k[h, t].double()) ** 2 for qi in qs for n in range(10)) for t in range(10)]
        want_s += sum(w[t] * torch.outer(v[h, t].double(), v[h, t].double()) for t in range(10)) / sum(w) / 2
    assert torch.allclose(ck, want_k, rtol=1e-10) and torch.allclose(cs, want_s, rtol=1e-10)


def test_int2_rows_clip_the_largest_magnitudes_and_keep_four_levels():
    g = torch.Generator().manual_seed(2)
    y = torch.randn(50, 64, generator=g)
    back = oscar.int2_rows(y, 0.96)  # index int(61.44) = 61: the two largest magnitudes clipped
    tau = y.abs().sort(-1).values[:, 61:62]
    x = y.clamp(-tau, tau)
    assert int((x != y).sum(-1).max()) == 2
    for row, xr in zip(back, x):
        assert len(torch.unique(row)) <= 4
        # codes 0 and 3 read back the clipped row's minimum and maximum (to bf16, and fp32 round-off)
        assert float(row.min()) == pytest.approx(float(xr.min()), rel=2**-8, abs=1e-6)
        assert float(row.max()) == pytest.approx(float(xr.max()), rel=2**-8, abs=1e-6)
    # nearest of the four levels: no element is more than half a step from what it reads back
    step = (x.amax(-1) - x.amin(-1)) / 3
    assert bool(((back - x).abs() <= step[:, None] / 2 * (1 + 2**-7) + 1e-6).all())


def test_fp16_metadata_is_rounded_before_it_encodes():
    g = torch.Generator().manual_seed(5)
    y = torch.randn(40, 64, generator=g) * 3
    back = oscar.int2_rows(y, 0.92, "fp16")
    tau = y.abs().sort(-1).values[:, 58:59]
    x = y.clamp(-tau, tau)
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s16 = ((mx - mn) / 3).half().float()
    z16 = (-mn / ((mx - mn) / 3)).half().float()
    # every value read back is (code - zero) * scale with the fp16 pair and a code in 0..3
    code = back.float() / s16 + z16
    assert torch.allclose(code, code.round(), atol=0.02) and bool(((code.round() >= 0) & (code.round() <= 3)).all())
    assert not torch.equal(back, oscar.int2_rows(y, 0.92))


def _fitted(d=64, layers=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    rs = []
    for _ in range(layers):
        a = torch.randn(d, d, generator=g, dtype=torch.float64)
        rs.append((oscar.rotation(a @ a.T).float(), oscar.rotation(a.T @ a).float()))
    return dict(enumerate(rs))


def test_the_cache_keeps_sinks_and_recent_rows_in_bf16_and_demotes_eight_at_a_time():
    fitted = _fitted()
    cache = oscar.make_cache("oscar-int2-s4r32", 2, fitted)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 100, 64, generator=g)
    k, v = cache.update(x.clone(), x.clone(), 0)
    rk = fitted[0][0]
    bf = oscar.rotate(x, rk) @ rk.bfloat16().float().T
    q2 = oscar.int2_rows(oscar.rotate(x, rk), 0.96) @ rk.bfloat16().float().T
    assert torch.equal(k[:, :, :4], bf[:, :, :4]) and torch.equal(k[:, :, 68:], bf[:, :, 68:])
    assert torch.equal(k[:, :, 4:68], q2[:, :, 4:68])
    recent = []
    for _ in range(17):
        k, _ = cache.update(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g), 0)
        recent.append(cache._recent[0])
    assert recent == [33, 34, 35, 36, 37, 38, 39, 32, 33, 34, 35, 36, 37, 38, 39, 32, 33]
    assert k.shape[-2] == 117


@pytest.mark.parametrize("name,sinks,recent,meta", [("oscar-int2", 64, 256, 8), ("oscar-int2-s4r32-fp16", 4, 32, 4)])
def test_bytes_are_codes_scale_and_zero_bf16_regions_and_two_rotations(name, sinks, recent, meta):
    peer = emulated_peers()[name]
    L, H, D, T = 3, 2, 64, 1004
    rep = peer.account(ModelShape(L, H, D), T)
    q_rows = -(-(T - sinks - recent) // 8) * 8  # INT2 rows in whole pages of 8 tokens
    per_side = H * (q_rows * (D * 2 // 8 + meta) + (sinks + recent) * D * 2) + D * D * 2
    assert rep.total_bytes == L * 2 * per_side
    assert rep.effective_bits == pytest.approx(8 * L * 2 * per_side / (2 * L * H * D * T))
    rep8 = peer.account(ModelShape(L, H, D), T, batch=8)  # the rotations once, the rest per sequence
    assert rep8.total_bytes == L * 2 * (8 * (per_side - D * D * 2) + D * D * 2)
