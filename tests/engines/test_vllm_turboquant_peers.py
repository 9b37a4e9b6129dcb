"""vLLM's Lloyd-Max TurboQuant dtypes, emulated: the levels, the keys, the bytes, the boundary
layers, and the peers in ``kverr evaluate``."""

from __future__ import annotations

import pytest
import torch

from kverr.engines import vllm_turboquant as tq
from kverr.engines.emulated import emulated_peers
from kverr.evaluation import EMULATED, evaluate, parse_schemes
from kverr.memory import ModelShape, account

#: vLLM 0.34's ``solve_lloyd_max(64, 3)`` (its source run on 2026-12-02), as fp32.
VLLM_LEVELS_64_3 = (-0.2687937021255493, -0.16789750754833221, -0.09445568919181824, -0.030622949823737144,
                    0.030622949823737144, 0.09445568919181824, 0.16789750754833221, 0.2687937021255493)


def test_levels_are_vllms():
    assert tq.lloyd_max_levels(64, 3) == VLLM_LEVELS_64_3
    for d, b in ((64, 4), (128, 3), (128, 4)):
        c = torch.tensor(tq.lloyd_max_levels(d, b))
        assert len(c) == 2**b and bool((c[1:] > c[:-1]).all()) and torch.equal(c, -c.flip(0))
        # close to, but not, the normal's exact Lloyd-Max levels over sqrt(d) (0.1284 at 4 bits)
        assert abs(float(c[8]) * d**0.5 - 0.1284) < 2e-3 if b == 4 else True


def test_key_codes_take_the_upper_level_on_a_midpoint():
    c = torch.tensor(VLLM_LEVELS_64_3)
    mid = (c[:-1] + c[1:]) / 2
    y = torch.zeros(64)
    y[:7] = mid
    y[7:14] = torch.nextafter(mid, torch.full_like(mid, -1.0))
    codes = tq.key_codes(y, 3)
    assert codes[:7].tolist() == list(range(1, 8)) and codes[7:14].tolist() == list(range(0, 7))


def test_keys_keep_their_fp16_norm_and_lose_only_the_levels_error():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 40, 64, generator=g) * torch.rand(2, 3, 40, 1, generator=g).mul(8).exp2()
    for bits, bound in ((4, 0.02), (3, 0.05)):
        kh = tq.fake_quantize_keys(k, bits)
        n16 = torch.linalg.vector_norm(k, dim=-1).to(torch.float16).float()
        assert torch.allclose(torch.linalg.vector_norm(kh, dim=-1), n16, rtol=1e-5)
        rel = ((kh - k) ** 2).sum() / (k**2).sum()
        assert 0 < rel < bound


def test_bytes_are_vllms_slot_and_the_boundary_layers_16_bits():
    L, H, D, T = 7, 2, 64, 256
    for dtype, (kb, vb) in tq.DTYPES.items():
        cfg = tq.equivalent(dtype, L)
        assert [cfg.format_for(layer, 0, "k").is_float for layer in range(L)] == \
            [True, True, False, False, False, True, True]  # min(2, 7 // 2) at each end
        rep = account(cfg, ModelShape(L, H, D), T)
        slot = (D * kb // 8 + 2) + (D * vb // 8 + 4)  # TurboQuantConfig.slot_size (even here)
        for layer in range(L):
            b = rep.layer_total(layer)
            want = H * T * slot if layer in (2, 3, 4) else H * T * 2 * D * 2
            assert b.payload + b.scales + b.zeros + b.padding + b.page_rounding == want
            # the only other bytes: the key levels, 2**kb fp32 values per quantized layer
            assert b.static == (4 * 2**kb if layer in (2, 3, 4) else 0)


def test_the_cache_leaves_the_boundary_layers_alone():
    cache = tq.make_cache("turboquant_k3v4_nc", 7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 64, generator=g)
    for layer in range(7):
        k, v = cache.update(x.clone(), x.clone(), layer)
        kept = layer in (0, 1, 5, 6)
        assert torch.equal(k, x) == kept and torch.equal(v, x) == kept


def test_every_emulated_peer_is_registered_and_runs_in_evaluate(tiny_llama):
    from kverr.capturing.text import Text

    assert set(EMULATED) == set(emulated_peers()) >= {"vllm-int4-per-token-head", "vllm-turboquant-3bit-nc"}
    _, lm = tiny_llama
    text = Text(text=" ".join(["cache key value softmax token layer"] * 60), source="words", sha256="0" * 64)
    df = evaluate(lm, text, parse_schemes(["vllm-turboquant-k3v4-nc"]), prefill=[48], decode=16, segments=1,
                  offset=0, progress=False)
    row = df.iloc[0]
    assert row["kind"] == "emulated" and row["mean_kl"] > 0
    eq = tq.equivalent("turboquant_k3v4_nc", lm.n_layers)
    assert row["effective_bits"] == pytest.approx(account(eq, lm.shape, 64).effective_bits)
