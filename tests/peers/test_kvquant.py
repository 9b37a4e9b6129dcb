"""KVQuant, emulated: the offline fit, pre-RoPE keys against fixed thresholds, values per token
with their outliers, the first token and the bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kverr.engines.emulated import emulated_peers
from kverr.memory import ModelShape
from kverr.peers import kvquant
from tests.captures import synthetic_capture


def _nearest_everywhere(xn, back_n, levels):
    c = torch.tensor(levels)
    d_chosen = (xn - back_n).abs()
    return bool((d_chosen[..., None] <= (xn[..., None] - c).abs() + 1e-5).all())


@pytest.fixture(scope="module")
def fitted():
    cap = synthetic_capture(n_layers=1, n_q=4, n_kv=2, n_tokens=400, head_dim=16, seed=5, outlier_channel=3)
    return cap, kvquant.fit(cap, bits=2)


def test_the_fit_puts_one_percent_of_the_calibration_keys_outside_and_levels_in_range(fitted):
    cap, f = fitted
    k = torch.from_numpy(np.asarray(cap["k_pre"].values[0]))  # [H, N, D]
    up, lo = f[0]["k_upper"][:, None], f[0]["k_lower"][:, None]
    frac = float(((k > up) | (k < lo)).float().mean())
    assert 0.005 < frac < 0.015  # 0.5 % at each end, up to the fp16 rounding of the thresholds
    assert bool((f[0]["k_upper"][:, 3] > 3.0).all())  # the shifted channel's range follows it
    for side in ("k_levels", "v_levels"):
        c = f[0][side]
        assert len(c) == 4 and list(c) == sorted(c) and -1 <= c[0] and c[-1] <= 1


def test_keys_outside_their_thresholds_are_exact_and_the_rest_take_the_nearest_level(fitted):
    _, f = fitted
    g = torch.Generator().manual_seed(6)
    k = torch.randn(1, 2, 50, 16, generator=g) * 1.5
    back, out = kvquant.quantize_keys(k, f[0]["k_upper"], f[0]["k_lower"], f[0]["k_levels"])
    assert bool(out.any()) and torch.equal(back[out], k[out])
    up, lo = f[0]["k_upper"][None, :, None], f[0]["k_lower"][None, :, None]
    zero, scale = (up + lo) / 2, (up - lo) / 2
    assert _nearest_everywhere(((k - zero) / scale)[~out], ((back - zero) / scale)[~out], f[0]["k_levels"])


def test_values_per_token_keep_two_outliers_of_a_192_element_row_and_read_the_rest_from_its_range():
    levels = (-0.75, -0.25, 0.25, 0.75)
    g = torch.Generator().manual_seed(7)
    v = torch.randn(1, 3, 5, 64, generator=g)
    back, out = kvquant.quantize_values(v, levels)
    rows_out = out.permute(0, 2, 1, 3).reshape(5, 192)
    assert rows_out.sum(-1).tolist() == [2] * 5  # one at each end: 0.5 % of 192 is below one element
    assert torch.equal(back[out], v[out])
    rows, rb = v.permute(0, 2, 1, 3).reshape(5, 192), back.permute(0, 2, 1, 3).reshape(5, 192)
    for r, b, o in zip(rows, rb, rows_out):
        rest = r[~o]
        zero, scale = (rest.max() + rest.min()) / 2, (rest.max() - rest.min()) / 2
        assert _nearest_everywhere((rest - zero) / scale, (b[~o] - zero) / scale, levels)


def test_the_cache_quantizes_keys_before_rope_and_keeps_the_first_token():
    from kverr.rope import apply_rope

    cap = synthetic_capture(n_layers=1, n_q=4, n_kv=2, head_dim=64, n_tokens=200, seed=8)
    f = kvquant.fit(cap, bits=3)
    cache = kvquant.make_cache("kvquant-3bit-1pct", f)
    g = torch.Generator().manual_seed(9)
    k_pre = torch.randn(1, 2, 12, 64, generator=g)
    v = torch.randn(1, 2, 12, 64, generator=g)
    pos = torch.arange(12)
    k, vb = cache.update(apply_rope(k_pre, pos, f[0]["rope"]), v.clone(), 0)
    want_pre, _ = kvquant.quantize_keys(k_pre, f[0]["k_upper"], f[0]["k_lower"], f[0]["k_levels"])
    want = apply_rope(want_pre.half().float(), pos, f[0]["rope"])
    # un-rotating and rotating again moves a key by fp32 round-off only
    assert torch.allclose(k[:, :, 1:], want[:, :, 1:], atol=1e-5)
    assert torch.allclose(k[:, :, :1], apply_rope(k_pre[:, :, :1].half().float(), pos[:1], f[0]["rope"]), atol=1e-5)
    assert torch.equal(vb[:, :, :1], v[:, :, :1].half().float())
    assert not torch.allclose(k[:, :, 1:], apply_rope(k_pre, pos, f[0]["rope"])[:, :, 1:], atol=1e-3)  # quantized
    # the next token continues at position 12
    k2, _ = cache.update(apply_rope(k_pre[:, :, :1], torch.tensor([12]), f[0]["rope"]), v[:, :, :1], 0)
    w2, _ = kvquant.quantize_keys(k_pre[:, :, :1], f[0]["k_upper"], f[0]["k_lower"], f[0]["k_levels"])
    assert torch.allclose(k2[:, :, 12:], apply_rope(w2.half().float(), torch.tensor([12]), f[0]["rope"]), atol=1e-5)
    assert 0 < cache.outlier_fraction < 0.2


@pytest.mark.parametrize("name,bits", sorted(kvquant.VARIANTS.items()))
def test_bytes_are_the_papers_count(name, bits):
    L, H, D, T = 2, 3, 64, 1001
    rep = emulated_peers()[name].account(ModelShape(L, H, D), T)
    n = (T - 1) * H * D
    sparse = round(0.01 * n) * 4 + (T - 1) * 4
    k = n * bits // 8 + sparse + H * D * 2 + (2 * 2**bits + H * D * 4)
    v = n * bits // 8 + sparse + H * D * 2 + 2 * 2**bits + (T - 1) * 4
    assert rep.total_bytes == L * (k + v)
