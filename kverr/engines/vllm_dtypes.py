"""vLLM's ``--kv-cache-dtype`` values as kverr configs: the numbers each follows, pinned by tests.

Each preset names the vLLM 0.33 code whose arithmetic it reproduces; ``tests/engines/
test_vllm_dtypes.py`` restates that arithmetic in plain torch and checks that the oracle
(:func:`kverr.quant.quantize`) gives the same codes, scales and dequantized values bit for bit.
fp8 is the CUDA ``float8_e4m3fn`` (largest finite 448); ROCm's ``e4m3fnuz`` is not modelled.

Expressed exactly:

* ``int8_per_token_head`` / ``fp8_per_token_head`` (``_reshape_cache_per_token_head`` in
  ``v1/attention/ops/triton_reshape_and_cache_flash.py``): one fp32 scale per (token, kv head),
  ``max(amax / QUANT_MAX, 1e-6)`` with a round-to-nearest division, codes from ``x * (1 / s)``;
  int8 adds ``±0.5`` and truncates, then clamps to ``[-128, 127]`` (with these scales
  ``|x * (1/s)| < 127.5``, so ``-128`` never occurs and kverr's ``[-127, 127]`` is the same set);
  fp8 clamps to ``±448`` and casts (round to nearest even). The attention kernel reads
  ``code * s`` (``triton_unified_attention``: the scale multiplies ``Q·K`` and ``P`` after the
  dot), which is :func:`kverr.quant.dequantize`. Memory: ``D`` bytes of codes and one fp32 scale per
  (token, kv head) for keys and again for values (``TritonAttentionBackend.customize_spec``), as
  :func:`kverr.memory.account` counts it. Every layer and token is quantized.
* ``fp8`` / ``fp8_e4m3`` (``reshape_and_cache_kernel_flash``): static per-tensor fp32 scales
  ``k_scale``/``v_scale`` and ``x / k_scale`` cast with saturation. That is kverr's own
  ``fp8-e4m3-tensor`` preset (the oracle with ``scale=`` given the scale vLLM loads; a test pins
  it), so it has no ``vllm-`` preset of its own; :func:`kverr.engines.vllm.export_vllm` writes its
  scales.

Not expressed (left out of :data:`PRESETS` rather than approximated):

* ``int4_per_token_head`` (``v1/attention/ops/int4_per_token_head.py``) needs three things the
  oracle lacks: a randomized Hadamard transform (a fixed random sign vector before the
  transform), an asymmetric grid whose zero point is an integer code (``zp = round(-min / s)``
  clamped to ``[0, 15]``, codes ``round(x / s + zp)``) instead of kverr's real-valued block
  minimum, and the scale the decoder reads differing from the one that encoded (the zero point
  overwrites the low four mantissa bits of the fp32 scale).
* ``turboquant_*`` (``model_executor/layers/quantization/turboquant/``): codebook (Lloyd-Max
  centroid) codes for keys with an fp16 vector norm and norm correction, and vLLM's rule for
  which layers stay unquantized; the oracle has no codebook element format.
"""

from __future__ import annotations

from kverr.config import CacheConfig
from kverr.quant.formats import PerToken, QuantFormat

#: ``tl.maximum(absmax / QUANT_MAX, 1e-6)`` in ``_reshape_cache_per_token_head``.
PER_TOKEN_HEAD_SCALE_FLOOR = 1e-6


def _per_token_head(dtype: str) -> QuantFormat:
    """One fp32 scale per (token, kv head) as ``_reshape_cache_per_token_head`` computes it."""
    is_int = dtype == "int"
    return QuantFormat(
        dtype=dtype,
        bits=8,
        symmetric=True,
        granularity=PerToken(),
        scale_dtype="fp32",
        rounding="half_away" if is_int else "half_even",
        scale_rounding="nearest",
        scale_floor=PER_TOKEN_HEAD_SCALE_FLOOR,
        reciprocal=True,
    )


def _presets() -> dict[str, tuple[str, CacheConfig]]:
    int8 = _per_token_head("int")
    fp8 = _per_token_head("fp8_e4m3")
    presets = {
        # vLLM 0.33 _reshape_cache_per_token_head (IS_INT_QUANT, QUANT_MAX=127, QUANT_MIN=-128):
        # fp32 scale max(amax/127, 1e-6) per (token, kv head), codes trunc(x*(1/s) ± 0.5).
        "vllm-int8-per-token-head": ("int8_per_token_head", dict(k=int8, v=int8)),
        # vLLM 0.33 _reshape_cache_per_token_head (fp8 e4m3, QUANT_MAX=448): fp32 scale
        # max(amax/448, 1e-6) per (token, kv head), codes fp8(clamp(x*(1/s), -448, 448)).
        "vllm-fp8-per-token-head": ("fp8_per_token_head", dict(k=fp8, v=fp8)),
    }
    return {name: (dtype, CacheConfig(name=name, **kw)) for name, (dtype, kw) in presets.items()}


_ALL = _presets()

#: vLLM's cache dtypes as kverr configs, by preset name (``vllm-...``).
PRESETS: dict[str, CacheConfig] = {name: cfg for name, (_, cfg) in _ALL.items()}

#: The ``--kv-cache-dtype`` value that serves each preset.
KV_CACHE_DTYPE: dict[str, str] = {name: dtype for name, (dtype, _) in _ALL.items()}
