"""vLLM's int4_per_token_head, emulated: the rotation, the integer zero point hidden in the scale's
low bits, the read, the bytes, and the peer in ``kverr evaluate``."""

from __future__ import annotations

import math

import pytest
import torch

from kverr.engines import vllm_int4 as v4
from kverr.evaluation import evaluate, parse_schemes
from kverr.memory import ModelShape, account


def test_signs_are_the_seeded_bernoulli_draws():
    s = v4.rht_signs(64)
    assert set(s.tolist()) == {-1.0, 1.0}
    gen = torch.Generator().manual_seed(0x9E3779B9)
    assert torch.equal(s, torch.bernoulli(torch.full((64,), 0.5), generator=gen) * 2 - 1)
    assert torch.equal(v4.rht_signs(80)[:64], s)  # the same stream, longer


@pytest.mark.parametrize("D,block", [(64, 64), (128, 128), (80, 16), (96, 32)])
def test_rotation_is_blockwise_and_inverts_up_to_its_bf16_rounding(D, block):
    assert v4.rht_block(D) == block
    g = torch.Generator().manual_seed(D)
    x = torch.randn(4, 7, D, generator=g) * 3
    y = v4.rotate(x)
    # every rotated value is sqrt(b) times a bf16 value
    scaled = y / math.sqrt(block)
    assert torch.allclose(scaled, scaled.to(torch.bfloat16).float(), rtol=2e-7, atol=0)
    # block-diagonal: a change in one block moves only that block
    x2 = x.clone()
    x2[..., 0] += 1.0
    moved = (v4.rotate(x2) != y).any(dim=(0, 1))
    assert moved[:block].all() and not moved[block:].any()
    # each of the two bf16 roundings (the signed input, the transform) is within 2**-9 relative;
    # the exact transform preserves the norm times sqrt(b), so the error is within that of the norm
    err = (v4.unrotate(y) - x).norm(dim=-1)
    assert bool((err <= 2 * 2.0**-8 * x.norm(dim=-1)).all())


def test_quantize_a_row_by_hand():
    # min -3, max 12: s = 1, zp = 3; y * 1 + 3 (one fp32 rounding: 1.4999999 + 3 is 4.5) rounded
    # half away from zero
    y = torch.tensor([[-3.0, 12.0, 0.5, -0.5, 1.4999999, 2.5, 0.0, 1.25]])
    y = torch.cat([y, torch.zeros(1, 56)], dim=1)
    q, word = v4.quantize_rows(y)
    assert q[0, :8].tolist() == [0, 15, 4, 3, 5, 6, 3, 4]
    assert int(word.view(torch.int32)) & 15 == 3
    back = v4.dequantize_rows(q, word)[0, :8].tolist()
    assert back == [-3.0, 12.0, 1.0, 0.0, 2.0, 3.0, 0.0, 1.0]
    # the zero point rounds half away too: min -2.5, max 12.5 -> zp = half_away(2.5) = 3
    q, word = v4.quantize_rows(torch.tensor([[-2.5, 12.5, 0.0, 0.0]]))
    assert int(word.view(torch.int32)) & 15 == 3 and q[0].tolist() == [1, 15, 3, 3]


def test_the_stored_scale_is_truncated_under_the_zero_point():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(500, 64, generator=g) * torch.rand(500, 1, generator=g).mul(10).exp2()
    q, word = v4.quantize_rows(y)
    s = torch.maximum((y.amax(-1) - y.amin(-1)) / 15.0, torch.tensor(1e-6))
    bits = word.view(torch.int32)
    read = (bits & -16).view(torch.float32)
    assert bool((read <= s).all()) and bool(((s - read) / s < 2.0**-19).all())
    assert bool(((s.view(torch.int32) & 15) != (bits & 15)).any())  # the low bits do hold the zero point
    # every value is within one step of the grid (the integer zero point can push the top half a step
    # past the last code, which clamps)
    err = (v4.dequantize_rows(q, word) - y).abs()
    assert bool((err <= read[:, None] * (1 + 2.0**-10)).all())
    assert bool((err <= read[:, None] / 2 * (1 + 2.0**-10)).float().mean() > 0.99)


def test_floor_and_constant_rows():
    q, word = v4.quantize_rows(torch.stack([torch.zeros(64), torch.full((64,), 2.0)]))
    read = (word.view(torch.int32) & -16).view(torch.float32)
    assert torch.allclose(read, torch.tensor(1e-6), rtol=2.0**-19)
    back = v4.dequantize_rows(q, word)
    assert torch.equal(back[0], torch.zeros(64))
    # a constant row of 2: -min / s is huge, zp clamps to 0, codes clamp to 15: 15 * 1e-6
    assert torch.allclose(back[1], torch.full((64,), 15 * float(read[1])))


def test_memory_is_vllms_slot():
    """``head_size // 2`` bytes of packed codes and one fp32 word per (token, kv head) and side."""
    L, H, D, T = 3, 2, 64, 256
    rep = account(v4.EQUIVALENT, ModelShape(L, H, D), T)
    assert rep.total_bytes == 2 * L * H * T * (D // 2 + 4)
    assert rep.effective_bits == pytest.approx(4 + 32 / D)


def test_the_peer_runs_in_evaluate(tiny_llama):
    from kverr.capturing.text import Text

    _, lm = tiny_llama
    text = Text(text=" ".join(["cache key value softmax token layer"] * 60), source="words", sha256="0" * 64)
    schemes = parse_schemes(["vllm-int4-per-token-head", "q4_0"])
    assert [s.kind for s in schemes] == ["emulated", "kverr"]
    df = evaluate(lm, text, schemes, prefill=[48], decode=16, segments=1, offset=0, progress=False)  # one page
    row = df[df.scheme == "vllm-int4-per-token-head"].iloc[0]
    assert row["effective_bits"] == pytest.approx(4 + 32 / lm.head_dim) and row["mean_kl"] > 0
