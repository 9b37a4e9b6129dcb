"""vLLM's ``int4_per_token_head`` KV cache, emulated as a peer (not a kverr format).

vLLM 0.34 (``v1/attention/ops/int4_per_token_head.py``) stores each (token, kv head) row of
keys and of values as 4-bit codes with one fp32 word, after a randomized Hadamard transform
(RHT). kverr's formats cannot express it (:mod:`kverr.engines.vllm_dtypes` says why), so it is
evaluated as the quanto peers are: a transformers cache (:class:`Int4PerTokenHeadCache`) that
stores what vLLM's cache would hold, read back as vLLM's attention reads it. The steps, per row
``x`` of ``D`` channels (keys after RoPE, as vLLM receives them):

1. **Rotate.** ``y = H_b (d ⊙ x)``: ``d`` the ±1 signs ``2 * bernoulli(0.5) - 1`` drawn from
   torch's CPU generator seeded with ``0x9E3779B9`` (:func:`rht_signs`), ``H_b`` the
   *unnormalised* Sylvester Hadamard matrix of order ``b``, the largest power of two dividing
   ``D``, applied block-diagonally (so ``H_b H_b = b I``). On CUDA vLLM computes it with the
   hadacore tensor-core kernel in bf16: ``bf16(H_b bf16(d ⊙ x) / sqrt(b)) * sqrt(b)``, then
   casts to the model's dtype. The emulation computes the transform exactly (float64) and rounds
   it once to bf16 as written; hadacore's internal rounding is not restated, so rotated values,
   and codes, can differ from a GPU's where its kernel rounds otherwise.
2. **Quantize** (``_reshape_cache_int4_kernel``, fp32): ``s = max((max y - min y) / 15, 1e-6)``,
   an integer zero point ``zp = clamp(half_away(-min y / s), 0, 15)``, codes
   ``q = clamp(half_away(y * (1 / s) + zp), 0, 15)`` (``half_away(v) = trunc(v ± 0.5)``; the
   product and the sum one fused rounding, as Triton's default contraction makes them). The
   stored word is ``s``'s bits with the low four replaced by ``zp``. Divisions are IEEE here;
   Triton's ``/`` is ``div.full.f32`` (within 2 ulp).
3. **Read.** The attention kernel uses ``(q - zp) * s'`` with ``s'`` the stored word's low four
   bits cleared (the scale truncated to 19 mantissa bits), dots in the rotated space, and rotates
   the output back; the emulation returns ``d ⊙ H_b ((q - zp) s') / b`` in fp32 (the same product
   in exact arithmetic; vLLM's rounding of the rotated query and output is the attention's, not the
   cache's, and is not emulated).

Memory: ``D / 2`` code bytes and one fp32 word per (token, kv head) and side, as
:data:`EQUIVALENT` (symmetric int4 with one fp32 scale per token, the same bytes) counts them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from kverr.config import CacheConfig
from kverr.quant.formats import PerToken, int_format
from kverr.quant.reference import half_away, sylvester

#: The peer's name in ``kverr evaluate --scheme``.
NAME = "vllm-int4-per-token-head"
#: ``_get_rht_signs``: the seed of torch's CPU generator for round 0.
RHT_SEED = 0x9E3779B9
#: ``tl.maximum((max - min) / 15.0, 1e-6)``.
SCALE_FLOOR = 1e-6
#: A kverr config storing the same bytes (4-bit codes, one fp32 word per token and kv head).
EQUIVALENT = CacheConfig(k=int_format(4, PerToken(), symmetric=True, scale_dtype="fp32"),
                         v=int_format(4, PerToken(), symmetric=True, scale_dtype="fp32"), name=NAME)


def rht_block(d: int) -> int:
    """The order of the Hadamard blocks for head size ``d``: its largest power-of-two divisor."""
    return d & -d


@functools.lru_cache(maxsize=8)
def rht_signs(d: int) -> torch.Tensor:
    """The ±1 float32 signs of the transform for head size ``d`` (the first ``d`` Bernoulli(0.5)
    draws of torch's CPU generator seeded with :data:`RHT_SEED`, mapped 1 -> +1, 0 -> -1)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return torch.bernoulli(torch.full((d,), 0.5), generator=gen) * 2.0 - 1.0


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Step 1 on ``x [..., D]`` in the model's ``dtype`` (``x``'s by default): the rotated rows,
    cast to that dtype, as fp32 (see the module docs)."""
    d = x.shape[-1]
    b = rht_block(d)
    signed = (x.float() * rht_signs(d)).to(torch.bfloat16).double()
    h = sylvester(b)  # the unnormalised matrix: exact ±1
    exact = _blocks(signed, b) @ h / math.sqrt(b)
    y = exact.to(torch.bfloat16).float() * torch.tensor(math.sqrt(b), dtype=torch.float32)
    return y.to(dtype or x.dtype).float().reshape(x.shape)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse of the transform, ``d ⊙ H_b y / b``, in fp32 (``[..., D]``)."""
    d = y.shape[-1]
    b = rht_block(d)
    h = sylvester(b)
    back = (_blocks(y.double(), b) @ h / b).reshape(y.shape)
    return (back * rht_signs(d).double()).float()


def quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 on rotated rows ``y [..., D]`` (fp32): (codes uint8 ``[..., D]``, stored fp32 word
    ``[...]``, whose low four bits are the zero point)."""
    y = y.float()
    lo, hi = y.amin(-1), y.amax(-1)
    s = torch.maximum((hi - lo) / 15.0, torch.tensor(SCALE_FLOOR, dtype=torch.float32))
    zp = half_away(-lo / s).clamp(0.0, 15.0)
    inv = torch.ones_like(s) / s
    # y * inv + zp with one rounding: the product of two fp32 numbers is exact in float64
    v = (y.double() * inv.double()[..., None] + zp.double()[..., None]).float()
    q = half_away(v).clamp(0.0, 15.0).to(torch.uint8)
    word = (s.view(torch.int32) & -16) | zp.to(torch.int32)
    return q, word.view(torch.float32)


def dequantize_rows(q: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """Step 3's values in the rotated space: ``(q - zp) * s'`` in fp32."""
    bits = word.view(torch.int32)
    zp = (bits & 15).float()
    s = (bits & -16).view(torch.float32)
    return (q.float() - zp[..., None]) * s[..., None]


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's int4 cache gives back for rows ``x [..., D]`` of a model in ``x``'s dtype,
    un-rotated, fp32."""
    return unrotate(dequantize_rows(*quantize_rows(rotate(x))))


def _cache_class():
    from transformers import DynamicCache

    class Int4PerTokenHeadCache(DynamicCache):
        """A transformers cache holding what vLLM's ``int4_per_token_head`` cache holds (every
        token quantized as it arrives, per token and kv head: :func:`fake_quantize`), in the
        model's dtype."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = fake_quantize(key_states).to(key_states.dtype)
            v = fake_quantize(value_states).to(value_states.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return Int4PerTokenHeadCache


def make_cache() -> Any:
    """A fresh :class:`Int4PerTokenHeadCache`."""
    return _cache_class()()
