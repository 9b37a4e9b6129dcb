"""vLLM's cache dtypes as kverr presets: the oracle gives vLLM's numbers bit for bit.

Each test restates, in plain torch, the arithmetic of the vLLM 0.33 kernel a preset follows (the
restatement is the specification) and compares kverr's oracle with it: codes, scales and
dequantized values, bit for bit, on random tensors and on adversarial rows (ties at .5, all-zero
rows, rows under the scale floor, rows whose scaled maximum rounds above the largest code).
"""

from __future__ import annotations

import pytest
import torch

from kverr.config import PRESETS as KVERR_PRESETS
from kverr.config import CacheConfig, resolve
from kverr.engines.vllm import PRESETS as VLLM_PRESETS
from kverr.engines.vllm_dtypes import KV_CACHE_DTYPE, PRESETS
from kverr.exceptions import ConfigError
from kverr.memory import ModelShape, account
from kverr.quant import dequantize, fake_quantize, quantize
from specs import E2M1, FP8_MAX, e2m1_rne, reciprocal_split_rows

# --------------------------------------------------------------------------------------------
# vLLM's arithmetic, restated
# --------------------------------------------------------------------------------------------


def vllm_per_token_head(x: torch.Tensor, cache_dtype: torch.dtype):
    """``_reshape_cache_per_token_head`` for one of K or V: ``x [tokens, kv_heads, head_size]``
    in the model dtype -> (codes in ``cache_dtype``, fp32 scales ``[tokens, kv_heads]``).

    Per (token, head): the row as fp32, ``scale = max(max|row| / QUANT_MAX, 1e-6)`` (an fp32
    division, the constant 1e-6 as fp32), ``q = row * (1.0 / scale)``; int8 moves ``q`` half a
    unit away from zero (``q >= 0``: +0.5, else -0.5) before the store truncates; both clamp to
    ``[QUANT_MIN, QUANT_MAX]`` and the store converts (int8: toward zero; fp8: to nearest even).
    """
    quant_max, quant_min = {torch.int8: (127.0, -128.0), torch.float8_e4m3fn: (FP8_MAX, -FP8_MAX)}[cache_dtype]
    rows = x.to(torch.float32)
    absmax = rows.abs().amax(dim=-1)
    scale = torch.maximum(absmax / quant_max, torch.tensor(1e-6, dtype=torch.float32))
    inverse = torch.tensor(1.0, dtype=torch.float32) / scale
    q = rows * inverse[..., None]
    if cache_dtype == torch.int8:
        q = torch.where(q >= 0, q + 0.5, q - 0.5)
    q = torch.clamp(q, quant_min, quant_max)
    return q.to(cache_dtype), scale


def vllm_read(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the unified attention kernel multiplies out: ``float(code) * scale`` per (token, head)."""
    return codes.to(torch.float32) * scale[..., None]


def vllm_static_fp8(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """``reshape_and_cache_kernel_flash`` with an fp8 cache: ``x / k_scale`` in fp32, stored as
    e4m3 (the conversion saturates at ±448 and rounds to nearest even)."""
    q = x.to(torch.float32) / torch.tensor(k_scale, dtype=torch.float32)
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

TIE_ROW_INT8 = [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 3.5, -3.5,
                # the largest floats below 0.5: +0.5 rounds to 1.0 in fp32, so vLLM stores ±1
                0.49999997, -0.49999997, 1.4999999, -1.4999999, 0.0, -0.0, 1e-30]
# amax 448 -> scale 1: e4m3 midpoints (1.0625 between 1 and 1.125, 17 between 16 and 18, ...)
TIE_ROW_FP8 = [448.0, -448.0, 1.0625, -1.0625, 1.1875, 17.0, -17.0, 0.0009765625, 0.0029296875,
               0.0, -0.0, 232.0, 240.0, -208.0, 0.4375 + 0.03125, 2e-30, 1.0, -1.0]


def adversarial(D: int, cache_dtype: torch.dtype, seed: int, model_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[tokens, 3 heads, D]`` fp32: tie rows, zero rows, rows under the scale floor, tiny and
    huge rows, and random rows (about a fifth of which scale their maximum above the top code)."""
    g = torch.Generator().manual_seed(seed)
    tie = TIE_ROW_INT8 if cache_dtype == torch.int8 else TIE_ROW_FP8
    rows = []
    r = torch.zeros(D)
    r[: len(tie)] = torch.tensor(tie)
    rows += [r, r[torch.randperm(D, generator=g)], -r]
    rows += [torch.zeros(D), torch.full((D,), -0.0)]
    rows += [torch.randn(D, generator=g) * 1e-9, torch.randn(D, generator=g) * 3e-5]  # the floor
    rows += [torch.randn(D, generator=g).clamp(-6, 6) * 1e4, torch.randn(D, generator=g) * 1e-3]
    spike = torch.randn(D, generator=g) * 1e-2
    spike[int(torch.randint(D, (1,), generator=g))] = 37.0
    rows.append(spike)
    rows.append(torch.full((D,), 5.25))  # constant row: every element is the maximum
    rows += list(reciprocal_split_rows(cache_dtype, model_dtype, D))  # division != reciprocal
    n = len(rows)
    rand = torch.randn(3 * 40 - n, D, generator=g) * torch.rand(3 * 40 - n, 1, generator=g).mul(8).exp2()
    return torch.cat([torch.stack(rows), rand]).reshape(40, 3, D).to(model_dtype)


def cases():
    for name, cache_dtype in (("vllm-int8-per-token-head", torch.int8),
                              ("vllm-fp8-per-token-head", torch.float8_e4m3fn)):
        for D in (64, 128, 80):
            for model_dtype in (torch.float32, torch.bfloat16, torch.float16):
                yield pytest.param(name, cache_dtype, D, model_dtype, id=f"{name}-D{D}-{str(model_dtype)[6:]}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# --------------------------------------------------------------------------------------------
# The per-token-head dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,cache_dtype,D,model_dtype", list(cases()))
@pytest.mark.parametrize("which", ["k", "v"])
def test_per_token_head_is_vllms_arithmetic_bit_for_bit(name, cache_dtype, D, model_dtype, which):
    fmt = getattr(PRESETS[name], which)
    for seed in range(3):
        x = adversarial(D, cache_dtype, seed, model_dtype)  # vLLM receives the model dtype
        codes, scale = vllm_per_token_head(x, cache_dtype)
        ref = vllm_read(codes, scale)

        kx = x.permute(1, 0, 2)  # kverr's [kv_head, token, channel]
        qt = quantize(kx, fmt)
        assert qt.scale.dtype == torch.float32 and qt.scale.shape == (3, 40, 1)
        assert torch.equal(bits(qt.scale[..., 0]), bits(scale.T))
        u = qt.unpacked_codes()
        if cache_dtype == torch.int8:
            mine = u.to(torch.int16) - 128
            assert torch.equal(mine, codes.permute(1, 0, 2).to(torch.int16))
        else:
            assert torch.equal(u, codes.view(torch.uint8).permute(1, 0, 2))
        assert torch.equal(bits(dequantize(qt)), bits(ref.permute(1, 0, 2)))
        assert torch.equal(bits(fake_quantize(kx, fmt)), bits(ref.permute(1, 0, 2)))


def test_the_adversarial_rows_reach_every_branch():
    """The inputs above exercise what the tests claim: ties, the floor, the clamp."""
    x = adversarial(64, torch.int8, 0)
    rows = x.to(torch.float32)
    scale = torch.maximum(rows.abs().amax(-1) / 127.0, torch.tensor(1e-6))
    q = rows * (1.0 / scale)[..., None]
    assert bool((q.abs() > 127).any())  # the clamp decides some codes
    assert bool((rows.abs().amax(-1) / 127.0 < 1e-6).any())  # the floor decides some scales
    assert bool(((q - q.trunc()).abs() == 0.5).any())  # exact ties
    for dtype in (torch.int8, torch.float8_e4m3fn):  # division and the reciprocal disagree
        for model_dtype in (torch.float32, torch.bfloat16, torch.float16):
            rows = reciprocal_split_rows(dtype, model_dtype, 64)
            assert torch.equal(rows.to(model_dtype).float(), rows)
            s = rows.amax(-1, keepdim=True) / (127.0 if dtype == torch.int8 else FP8_MAX)
            codes, _ = vllm_per_token_head(rows[None], dtype)
            divided = torch.where(rows / s >= 0, rows / s + 0.5, rows / s - 0.5) if dtype == torch.int8 else rows / s
            assert not torch.equal(codes[0].float(), divided.clamp(-FP8_MAX, FP8_MAX).to(dtype).float())
    codes, _ = vllm_per_token_head(x, torch.int8)
    assert int(codes.min()) >= -127  # QUANT_MIN=-128 is never reached with these scales
    x8 = adversarial(64, torch.float8_e4m3fn, 0)
    s8 = torch.maximum(x8.abs().amax(-1) / FP8_MAX, torch.tensor(1e-6))
    assert bool(((x8 * (1.0 / s8)[..., None]).abs() > FP8_MAX).any())


def test_half_away_rounding_is_what_makes_int8_agree():
    """The same format with kverr's default rounding (half to even) gives other codes on ties."""
    import dataclasses

    fmt = PRESETS["vllm-int8-per-token-head"].k
    x = adversarial(64, torch.int8, 0)
    codes, _ = vllm_per_token_head(x, torch.int8)
    even = dataclasses.replace(fmt, rounding="half_even")
    u = quantize(x.permute(1, 0, 2), even).unpacked_codes().to(torch.int16) - 128
    assert not torch.equal(u, codes.permute(1, 0, 2).to(torch.int16))


def test_static_fp8_is_kverrs_fp8_tensor_preset():
    """``--kv-cache-dtype fp8``: x / k_scale cast to e4m3 is kverr's fp8-e4m3-tensor with the
    static scale given, saturating values included; so no vllm- preset of its own."""
    fmt = KVERR_PRESETS["fp8-e4m3-tensor"].k
    assert "vllm-fp8" not in PRESETS
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 64, generator=g) * 4
    x[0, 3, :5] = torch.tensor([1e4, -1e4, 0.0, 17.0 * 0.0625, 1.0625 * 0.0625])  # saturate, ties
    for k_scale in (0.0625, 0.012345, 1.0):
        codes = vllm_static_fp8(x, k_scale)
        qt = quantize(x, fmt, scale=torch.tensor(k_scale))
        assert torch.equal(qt.unpacked_codes(), codes.view(torch.uint8))
        want = codes.to(torch.float32) * torch.tensor(k_scale, dtype=torch.float32)
        assert torch.equal(bits(qt.dequantize()), bits(want))


# --------------------------------------------------------------------------------------------
# Presets: names, dtype strings, memory, kernels
# --------------------------------------------------------------------------------------------


def test_presets_are_named_served_and_resolvable():
    assert set(KV_CACHE_DTYPE) == set(PRESETS)
    assert KV_CACHE_DTYPE == {"vllm-int8-per-token-head": "int8_per_token_head",
                              "vllm-fp8-per-token-head": "fp8_per_token_head",
                              "vllm-nvfp4": "nvfp4", "vllm-nvfp4-4over6": "nvfp4_4over6",
                              "vllm-turboquant-k8v4": "turboquant_k8v4"}
    for name, cfg in PRESETS.items():
        assert name.startswith("vllm-") and cfg.name == name
        assert VLLM_PRESETS[name] is cfg and resolve(name) is cfg
        assert cfg.window == 0 and cfg.sinks == 0 and not cfg.layers and not cfg.heads  # all quantized
        assert CacheConfig.from_json(cfg.to_json()) == cfg


def test_memory_is_vllms_per_slot_bytes():
    """``TritonAttentionBackend.customize_spec``: per (token, kv head) a slot holds
    ``(head_size_k + head_size_v) * 1`` bytes of codes and two fp32 scales."""
    L, H, D = 3, 2, 128
    for name in ("vllm-int8-per-token-head", "vllm-fp8-per-token-head"):
        cfg = PRESETS[name]
        T = 4 * cfg.page_size
        slot = (D + D) * 1 + 2 * 4
        rep = account(cfg, ModelShape(L, H, D), T, batch=2)
        assert rep.total_bytes == 2 * L * T * H * slot
        totals = rep.totals
        assert totals.scales == 2 * L * T * H * 2 * 4 and totals.zeros == 0


def test_nvfp4_memory_is_the_packed_head_size():
    """``nvfp4_kv_cache_full_dim``: per (token, kv head) and side ``head_size // 2`` bytes of fp4
    data and ``head_size // 16`` fp8 block scales, 4.5 bits per element."""
    L, H, D = 3, 2, 128
    cfg = PRESETS["vllm-nvfp4"]
    T = 4 * cfg.page_size
    rep = account(cfg, ModelShape(L, H, D), T, batch=2)
    assert rep.total_bytes == 2 * L * T * H * 2 * (D // 2 + D // 16)
    assert rep.totals.scales == 2 * L * T * H * 2 * (D // 16) and rep.totals.zeros == 0


def test_the_kernels_take_the_engines_arithmetic():
    """The store kernel runs vLLM's arithmetic (``tests/gpu/test_kernels_store.py`` checks its
    codes against the oracle's): the options become its ``ARITH`` bits and scale floor."""
    import numpy as np

    from kverr.gpu.spec import ARITH_FP32_ENCODE, ARITH_HALF_AWAY, ARITH_NEAREST, ARITH_RECIPROCAL, kernel_spec

    want = {"vllm-int8-per-token-head": (ARITH_NEAREST | ARITH_RECIPROCAL | ARITH_HALF_AWAY, 1e-6),
            "vllm-fp8-per-token-head": (ARITH_NEAREST | ARITH_RECIPROCAL, 1e-6),
            "vllm-nvfp4": (ARITH_NEAREST | ARITH_RECIPROCAL, 0.0),
            "vllm-nvfp4-4over6": (ARITH_NEAREST | ARITH_RECIPROCAL, 0.0),
            "vllm-turboquant-k8v4": (ARITH_NEAREST | ARITH_HALF_AWAY | ARITH_FP32_ENCODE, 1e-8)}
    for name, cfg in PRESETS.items():
        spec = kernel_spec(cfg.v if cfg.v.dtype == "int" and cfg.k.dtype != "int" else cfg.k, 128, 64)
        assert (spec.arith, spec.scale_floor) == (want[name][0], float(np.float32(want[name][1])))


# --------------------------------------------------------------------------------------------
# nvfp4
# --------------------------------------------------------------------------------------------

def flashinfer_nvfp4(x: torch.Tensor):
    """FlashInfer's NVFP4 cache write with vLLM's unit global scale, for one of K or V:
    ``x [tokens, kv_heads, head_size]`` -> (codes ``[tokens, kv_heads, head_size]`` uint8,
    e4m3 block scales ``[tokens, kv_heads, head_size // 16]``). Per 16 channels:
    ``sf = e4m3(amax / 6)`` (fp32 division, cast to nearest), codes ``e2m1(x * (1 / sf))``, and
    ``x * 0`` where ``sf`` is 0; a value reads back as ``e2m1 * sf``."""
    T, H, D = x.shape
    g = x.to(torch.float32).reshape(T, H, D // 16, 16)
    sf = (g.abs().amax(-1) / 6.0).to(torch.float8_e4m3fn)
    sfv = sf.float()
    inv = torch.where(sfv > 0, torch.tensor(1.0) / sfv, torch.zeros_like(sfv))
    return e2m1_rne(g * inv[..., None]).reshape(T, H, D), sf


def nvfp4_read(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    signed = torch.cat([E2M1, -E2M1])
    T, H, D = codes.shape
    return (signed[codes.long()].reshape(T, H, D // 16, 16) * sf.float()[..., None]).reshape(T, H, D)


def nvfp4_rows(D: int, seed: int, model_dtype: torch.dtype) -> torch.Tensor:
    """``[40, 3, D]``: blocks of e2m1 midpoints at scale 1 (ties), saturating blocks (``amax / 6``
    rounds down in e4m3), all-zero and -0 blocks, blocks whose scale is 0 or an e4m3 subnormal,
    large blocks and one whose scale saturates at 448, and random rows over 16 binades."""
    g = torch.Generator().manual_seed(seed)
    mid = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.0, -0.0,
                        0.2499, 4.999])
    blocks = [mid, mid[torch.randperm(16, generator=g)], -mid,
              torch.tensor([6.375, 6.2, -6.1, 5.9, *([1.0] * 12)]),  # amax/6 = 1.0625 -> sf 1: clamp
              torch.zeros(16), torch.full((16,), -0.0),
              torch.randn(16, generator=g) * 1e-3,  # amax / 6 < 2**-10: sf = 0
              torch.randn(16, generator=g) * 2e-2,  # subnormal e4m3 scales
              torch.randn(16, generator=g) * 300.0,
              torch.randn(16, generator=g) * 3000.0]  # amax / 6 above 448: the scale saturates
    rows = torch.cat(blocks)
    rows = torch.cat([rows, torch.randn(D - len(rows) % D, generator=g)]) if len(rows) % D else rows
    rows = rows.reshape(-1, D)
    n = 120 - len(rows)
    rand = torch.randn(n, D, generator=g) * torch.rand(n, D // 16, generator=g).mul(16).sub(8).exp2().repeat_interleave(16, 1)
    return torch.cat([rows, rand]).reshape(40, 3, D).to(model_dtype)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_is_flashinfers_definition_bit_for_bit(D, model_dtype):
    fmt = PRESETS["vllm-nvfp4"].k
    assert PRESETS["vllm-nvfp4"].v == fmt
    for seed in range(3):
        x = nvfp4_rows(D, seed, model_dtype)
        codes, sf = flashinfer_nvfp4(x)
        kx = x.permute(1, 0, 2)
        qt = quantize(kx, fmt)
        assert qt.scale.dtype == torch.float8_e4m3fn and qt.scale.shape == (3, 40, D // 16)
        assert torch.equal(qt.scale.view(torch.uint8), sf.view(torch.uint8).permute(1, 0, 2))
        assert torch.equal(qt.unpacked_codes(), codes.permute(1, 0, 2))
        ref = nvfp4_read(codes, sf).permute(1, 0, 2)
        assert torch.equal(bits(dequantize(qt)), bits(ref))
        assert torch.equal(bits(fake_quantize(kx, fmt)), bits(ref))


def test_the_nvfp4_rows_reach_every_branch():
    x = nvfp4_rows(64, 0, torch.float32)
    g = x.reshape(-1, 16)
    sf = (g.abs().amax(-1) / 6.0).to(torch.float8_e4m3fn).float()
    q = g * torch.where(sf > 0, 1.0 / sf, 0.0)[:, None]
    assert bool((q.abs() > 6).any())  # saturation
    assert bool((sf == 0).any() & (g.abs().amax(-1)[sf == 0] > 0).any())  # zero scales of nonzero blocks
    assert bool(((sf > 0) & (sf < 2.0**-6)).any())  # subnormal scales
    assert bool((g.abs().amax(-1) / 6.0 > 448).any())  # saturated scales
    a = q.abs()
    assert bool(torch.isin(a, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).any())  # ties
    # kverr's own nvfp4 preset rounds its scales up instead: it refuses a block no e4m3 scale
    # covers, and elsewhere never saturates, with other scales
    with pytest.raises(ConfigError, match="overflows scale_dtype='fp8_e4m3'"):
        quantize(x.permute(1, 0, 2), KVERR_PRESETS["nvfp4"].k)
    x = x.clamp(-2000.0, 2000.0)
    own = quantize(x.permute(1, 0, 2), KVERR_PRESETS["nvfp4"].k)
    codes, sf8 = flashinfer_nvfp4(x)
    assert not torch.equal(own.scale.view(torch.uint8), sf8.view(torch.uint8).permute(1, 0, 2))


# --------------------------------------------------------------------------------------------
# turboquant_k8v4
# --------------------------------------------------------------------------------------------


def turboquant_k8v4(k: torch.Tensor, v: torch.Tensor):
    """``_tq_fused_store_fp8`` for ``k, v [tokens, kv_heads, head_size]`` in the model dtype.

    Keys: the fp32 row cast to e4m3 (Triton's conversion saturates at ±448, nearest even), no
    scale. Values (``_store_quantized_value``, ``VQB=4``): per (token, head) ``lo = min``,
    ``hi = max`` of the fp32 row, ``s = (hi - lo) / 15`` then ``s if s > 1e-8 else 1e-8``,
    codes ``int32((x - lo) / s + 0.5)`` (truncation) clamped to ``[0, 15]``, all fp32 with
    IEEE division; the slot stores ``fp16(s)`` and ``fp16(lo)``, and the decode kernel reads
    ``code * fp16(s) + fp16(lo)`` in fp32. Returns (key codes uint8, value codes, fp16 scale,
    fp16 zero)."""
    key = k.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    rows = v.to(torch.float32)
    lo, hi = rows.amin(-1), rows.amax(-1)
    s = (hi - lo) / 15.0
    s = torch.where(s > 1e-8, s, torch.tensor(1e-8, dtype=torch.float32))
    q = ((rows - lo[..., None]) / s[..., None] + 0.5).to(torch.int32).clamp(0, 15)
    return key, q.to(torch.uint8), s.to(torch.float16), lo.to(torch.float16)


def turboquant_rows(D: int, seed: int, model_dtype: torch.dtype) -> torch.Tensor:
    """``[40, 3, D]``: keys past ±448 (saturation) and on e4m3 midpoints; value rows that are
    constant (the 1e-8 floor), zero, tiny, on half-step ties, and random over 16 binades (whose
    fp32 ``lo`` and ``s`` round in fp16, so codes from the stored pair would differ)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(D), torch.full((D,), 3.0), torch.randn(D, generator=g) * 1e-9,
            torch.linspace(-1.0, 1.0, D), torch.arange(D, dtype=torch.float32) * 0.5 % 7.5]
    sat = torch.randn(D, generator=g) * 100.0
    sat[:4] = torch.tensor([1000.0, -1000.0, 1.0625, 17.0])
    rows.append(sat)
    n = 120 - len(rows)
    rand = torch.randn(n, D, generator=g) * torch.rand(n, 1, generator=g).mul(16).sub(8).exp2()
    rand[::3] += torch.randn(len(rand[::3]), 1, generator=g) * 10.0  # offset rows: lo far from 0
    return torch.cat([torch.stack(rows), rand]).reshape(40, 3, D).to(model_dtype)


@pytest.mark.parametrize("D", [64, 128, 80])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_turboquant_k8v4_is_vllms_arithmetic_bit_for_bit(D, model_dtype):
    cfg = PRESETS["vllm-turboquant-k8v4"]
    for seed in range(3):
        k = turboquant_rows(D, seed, model_dtype)
        v = turboquant_rows(D, seed + 7, model_dtype)
        key, codes, s16, z16 = turboquant_k8v4(k, v)
        qk = quantize(k.permute(1, 0, 2), cfg.k)
        assert torch.equal(qk.unpacked_codes(), key.permute(1, 0, 2)) and float(qk.scale.flatten()[0]) == 1.0
        assert torch.equal(bits(qk.dequantize()), bits(key.view(torch.float8_e4m3fn).float().permute(1, 0, 2)))
        qv = quantize(v.permute(1, 0, 2), cfg.v)
        assert qv.scale.dtype == qv.zero.dtype == torch.float16
        assert torch.equal(qv.scale[..., 0].view(torch.int16), s16.T.contiguous().view(torch.int16))
        assert torch.equal(qv.zero[..., 0].view(torch.int16), z16.T.contiguous().view(torch.int16))
        assert torch.equal(qv.unpacked_codes(), codes.permute(1, 0, 2))
        ref = (codes.float() * s16.float()[..., None] + z16.float()[..., None]).permute(1, 0, 2)
        assert torch.equal(bits(dequantize(qv)), bits(ref))
        assert torch.equal(bits(fake_quantize(v.permute(1, 0, 2), cfg.v)), bits(ref))


def test_turboquant_rows_tell_the_encodings_apart():
    """On these rows, codes from the stored fp16 pair (kverr's default) differ from vLLM's, and
    keys saturate: the bit-for-bit test checks what it says."""
    import dataclasses

    cfg = PRESETS["vllm-turboquant-k8v4"]
    v = turboquant_rows(64, 7, torch.float32).permute(1, 0, 2)
    stored = dataclasses.replace(cfg.v, encode_with="stored")
    assert not torch.equal(quantize(v, stored).unpacked_codes(), quantize(v, cfg.v).unpacked_codes())
    assert bool((turboquant_rows(64, 0, torch.float32).abs() > FP8_MAX).any())
    s = (v.amax(-1) - v.amin(-1)) / 15.0
    assert bool((s <= 1e-8).any())  # the floor


def test_turboquant_memory_is_vllms_slot():
    """``TurboQuantConfig.slot_size``: per (token, kv head) ``head_dim`` fp8 key bytes, then
    ``head_dim / 2`` bytes of int4 values and an fp16 scale and zero (even, so no padding)."""
    L, H, D = 4, 2, 128
    cfg = PRESETS["vllm-turboquant-k8v4"]
    T = 4 * cfg.page_size
    rep = account(cfg, ModelShape(L, H, D), T, batch=2)
    assert rep.total_bytes == 2 * L * T * H * (D + D // 2 + 4)
    assert rep.totals.static == 0  # the unit key scale is not stored


def test_turboquant_boundary_layers_are_vllms():
    """``get_boundary_skip_layers``: the first and last min(2, n // 2) layers of a dense model;
    vLLM serves the preset only with them kept, and with_boundary_skip gives that config."""
    from kverr.engines.vllm import serving
    from kverr.engines.vllm_dtypes import boundary_layers, with_boundary_skip

    assert boundary_layers(30) == [0, 1, 28, 29] and boundary_layers(3) == [0, 2] and boundary_layers(1) == []
    cfg = PRESETS["vllm-turboquant-k8v4"]
    with pytest.raises(ConfigError, match="boundary skip"):
        serving(cfg, 30, 3)
    run = with_boundary_skip(cfg, 30)
    plan = serving(run, 30, 3)
    assert plan.kv_cache_dtype == "turboquant_k8v4" and plan.skip_layers == (0, 1, 28, 29)
    assert "--kv-cache-dtype turboquant_k8v4" in plan.command("./m")
    assert all(run.format_for(layer, 0, w).is_float == (layer in (0, 1, 28, 29)) for layer in range(30) for w in "kv")


def test_turboquant_export_reads_back(tmp_path):
    """The config vLLM runs exports as a dtype and its skip layers, and reads back the same."""
    from kverr.engines.vllm import export_vllm, import_vllm
    from kverr.engines.vllm_dtypes import with_boundary_skip

    cfg = with_boundary_skip(PRESETS["vllm-turboquant-k8v4"], 6)
    res = export_vllm(cfg, tmp_path / "v", n_layers=6, n_kv=2)
    assert res.command.endswith("--kv-cache-dtype turboquant_k8v4 --kv-cache-dtype-skip-layers 0 1 4 5")
    assert import_vllm(tmp_path / "v") == cfg.with_(name=None)


def test_nvfp4_4over6_is_nvfp4_choosing_the_better_of_two_scales_per_block():
    """Each block: ``vllm-nvfp4``'s codes with ``e4m3(amax / 6)`` or with ``e4m3(amax / 4)``, whichever
    reconstructs the block with less squared error (a tie keeps amax / 6)."""
    D = 64
    x = nvfp4_rows(D, 0, torch.float32).clamp(-2000.0, 2000.0)
    kx = x.permute(1, 0, 2)
    both = []
    for widen in (1.0, 1.5):
        g = x.reshape(40, 3, D // 16, 16)
        sf = (g.abs().amax(-1) * widen / 6.0).to(torch.float8_e4m3fn)
        sfv = sf.float()
        inv = torch.where(sfv > 0, torch.tensor(1.0) / sfv, torch.zeros_like(sfv))
        codes = e2m1_rne(g * inv[..., None])
        back = nvfp4_read(codes.reshape(40, 3, D), sf)
        err = ((back.double() - x.double()) ** 2).reshape(40, 3, D // 16, 16).sum(-1)
        both.append((back, err))
    (b6, e6), (b4, e4) = both
    pick4 = (e4 < e6).repeat_interleave(16, dim=-1).reshape(40, 3, D)
    want = torch.where(pick4, b4, b6).permute(1, 0, 2)
    assert bool(pick4.any()) and not bool(pick4.all())
    got = fake_quantize(kx, PRESETS["vllm-nvfp4-4over6"].k)
    assert torch.equal(bits(got), bits(want))
