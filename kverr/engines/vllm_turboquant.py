"""vLLM's TurboQuant cache dtypes with Lloyd-Max keys, emulated as peers (not kverr formats).

``turboquant_4bit_nc``, ``turboquant_k3v4_nc`` and ``turboquant_3bit_nc`` (vLLM 0.34,
``model_executor/layers/quantization/turboquant/`` and the default, non-FlyDSL path of
``v1/attention/backends/turboquant_attn.py`` with ``v1/attention/ops/triton_turboquant_store.py``
and ``triton_turboquant_decode.py``) store per (token, kv head):

* **keys** (3 or 4 bits): the row's norm ``n = ||k||`` (fp32, kept as fp16), the unit row
  ``k / (n + 1e-8)`` rotated by the orthonormal Sylvester Hadamard matrix ``H / sqrt(D)`` (a
  cuBLAS product; no random signs), each coordinate the index of its Lloyd-Max level for
  ``N(0, 1/D)`` (:func:`lloyd_max_levels`; a coordinate on a midpoint takes the upper level);
  decoding takes the levels ``c``, divides them by ``sqrt(sum c**2 + 1e-16)`` (the ``_nc`` norm
  correction) and multiplies by the fp16 norm, in the rotated space (the query is rotated
  instead; the emulation rotates the key back, the same product in exact arithmetic);
* **values** (4 or 3 bits): exactly the ``turboquant_k8v4`` values, kverr's
  :func:`value_format` (``kverr.engines.vllm_dtypes``);
* the first and last ``min(2, num_layers // 2)`` layers of a dense model are not quantized.

What is emulated and what is exact: the values bit for bit (IEEE division where Triton uses
``div.full.f32``); the keys up to the summation order of the norm and of the rotation product
(cuBLAS's there, torch's CPU order here), which moves a coordinate across a midpoint only where it
lies within a few ulp of it. The prefill's own attention, which vLLM computes on the unquantized
rows, goes through the cache here as for every scheme ``kverr evaluate`` compares.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kverr.config import CacheConfig
from kverr.quant.formats import PerToken, codebook_format

#: ``--kv-cache-dtype`` -> (key bits, value bits), all with the norm correction.
DTYPES = {"turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}


def peer_name(dtype: str) -> str:
    """``turboquant_k3v4_nc`` -> ``vllm-turboquant-k3v4-nc``."""
    return "vllm-" + dtype.replace("_", "-")


@functools.lru_cache(maxsize=16)
def lloyd_max_levels(d: int, bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max levels of ``N(0, 1/d)`` as vLLM's ``solve_lloyd_max`` finds them
    (its numerical procedure restated, so that the levels agree): levels start at the cell
    midpoints of ``[-3.5 s, 3.5 s]`` split evenly (``s = 1/sqrt(d)``); each iteration takes the
    boundaries halfway between levels, the outer edges at ``±10.5 s``, and moves each level to
    its cell's centroid, both integrals by the trapezoid rule on 200 intervals (a cell whose mass
    is below 1e-15 keeps its level); it stops when no level moves by 1e-10 or after 200
    iterations. Returned as fp32 values, ascending."""
    n = 2**bits
    var = 1.0 / d
    s = math.sqrt(var)
    lo, hi = -3.5 * s, 3.5 * s
    c = lo + (hi - lo) * (np.arange(n) + 0.5) / n

    def trapz(f, a, b):
        x = a + (b - a) * np.arange(201) / 200
        y = f(x)
        return ((y[0] + y[-1]) * 0.5 + y[1:-1].sum()) * ((b - a) / 200)

    pdf = lambda x: np.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)  # noqa: E731
    for _ in range(200):
        edges = np.concatenate([[lo * 3], (c[:-1] + c[1:]) / 2, [hi * 3]])
        new = c.copy()
        for i in range(n):
            den = trapz(pdf, edges[i], edges[i + 1])
            if den > 1e-15:
                new[i] = trapz(lambda x: x * pdf(x), edges[i], edges[i + 1]) / den
        done = np.abs(new - c).max() < 1e-10
        c = new
        if done:
            break
    return tuple(float(v) for v in np.asarray(c, dtype=np.float32))


def value_format(bits: int):
    """The TurboQuant values: kverr's format of ``vllm-turboquant-k8v4``'s values at ``bits``."""
    from kverr.engines.vllm_dtypes import PRESETS

    return replace(PRESETS["vllm-turboquant-k8v4"].v, bits=bits)


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    """vLLM's ``_build_hadamard``: the Sylvester matrix over ``sqrt(d)``, fp32."""
    from kverr.quant.reference import sylvester

    return (sylvester(d) / math.sqrt(d)).float()


def key_codes(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Level indices of rotated unit coordinates ``y [..., D]``: the number of midpoints between
    consecutive levels (fp32) at or below each coordinate, so a midpoint takes the upper level."""
    levels = torch.tensor(lloyd_max_levels(y.shape[-1], bits), dtype=torch.float32)
    mid = (levels[:-1] + levels[1:]) / 2
    return (y[..., None] >= mid).sum(-1)


def fake_quantize_keys(k: torch.Tensor, bits: int) -> torch.Tensor:
    """What the cache gives back for key rows ``k [..., D]`` (un-rotated, fp32)."""
    d = k.shape[-1]
    x = k.float()
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    h = _hadamard(d)
    y = (x / (norm + 1e-8)) @ h
    c = torch.tensor(lloyd_max_levels(d, bits), dtype=torch.float32)[key_codes(y, bits)]
    c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)  # the norm correction
    return (norm.to(torch.float16).float() * c) @ h


def equivalent(dtype: str, n_layers: int) -> CacheConfig:
    """A kverr config storing the same bytes as ``dtype`` on a dense model of ``n_layers``: keys
    as a ``bits``-bit codebook with one fp16 scale per token and kv head (the codes and the fp16
    norm), the values' format, the boundary layers in fp16."""
    from kverr.engines.vllm_dtypes import with_boundary_skip

    kb, vb = DTYPES[dtype]
    keys = codebook_format(kb, PerToken(), rotate="hadamard", scale_stat="rms")
    return with_boundary_skip(CacheConfig(k=keys, v=value_format(vb), name=peer_name(dtype)), n_layers)


def make_cache(dtype: str, n_layers: int) -> Any:
    """A transformers cache holding what vLLM's ``dtype`` cache holds on a dense model of
    ``n_layers`` (boundary layers as they come)."""
    from transformers import DynamicCache

    from kverr.engines.vllm_dtypes import boundary_layers
    from kverr.quant import fake_quantize

    kb, vb = DTYPES[dtype]
    vfmt = value_format(vb)
    keep = set(boundary_layers(n_layers))

    class TurboQuantCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in keep:
                key_states = fake_quantize_keys(key_states, kb).to(key_states.dtype)
                value_states = fake_quantize(value_states, vfmt).to(value_states.dtype)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return TurboQuantCache()
