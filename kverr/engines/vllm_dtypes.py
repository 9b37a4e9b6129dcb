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
* ``nvfp4`` (``v1/attention/backends/flashinfer.py``: FlashInfer's
  ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``, with the layer's ``k_scale`` /
  ``v_scale`` as NVFP4's global scale, 1.0 when the checkpoint has none). FlashInfer defines a
  stored value as ``e2m1 * block_scale * global_scale``, one fp8 e4m3 block scale per 16
  channels of a (token, kv head): with the unit global scale, ``block_scale = e4m3(amax / 6)``
  rounded to nearest (fp32 division, then the cast; a block below ``2**-10 * 6`` gets scale 0)
  and codes ``e2m1(x * (1 / block_scale))`` rounded to nearest even with saturation. That is
  kverr's fp4 format with fp8 e4m3 scales, ``scale_rounding="nearest"`` and ``reciprocal``; the
  tests restate it in plain torch. Not checked: the CUDA kernel's own reciprocal (a
  ``rcp.approx`` would differ from the IEEE one in the last bit, moving a code only where
  ``x / block_scale`` sits within that bit of a rounding boundary), and the fp8 query that the
  trtllm-gen decode path (Blackwell) adds; the FlashInfer FA2 path (sm_80/sm_90/sm_120) keeps
  the query in the model's dtype. ``nvfp4_4over6`` (each block's scale ``amax / 6`` or
  ``amax / 4``, whichever reconstructs it with less squared error) is not expressed: its tie rule
  and scale rounding are FlashInfer's CUDA code, not pinned here; kverr's ``nvfp4-4over6`` preset
  is the rule with kverr's scales.
* ``fp8`` / ``fp8_e4m3`` (``reshape_and_cache_kernel_flash``): static per-tensor fp32 scales
  ``k_scale``/``v_scale`` and ``x / k_scale`` cast with saturation. That is kverr's own
  ``fp8-e4m3-tensor`` preset (the oracle with ``scale=`` given the scale vLLM loads; a test pins
  it), so it has no ``vllm-`` preset of its own; :func:`kverr.engines.vllm.export_vllm` writes its
  scales.

Not expressed (left out of :data:`PRESETS` rather than approximated):

* ``int4_per_token_head`` (``v1/attention/ops/int4_per_token_head.py``). (1) The rotation is
  ``single_rht``: a fixed ±1 sign vector (``torch.bernoulli`` from seed ``0x9E3779B9``) then an
  *unnormalised* Hadamard transform (norm ``sqrt(b)``, block-diagonal for a head size that is not a
  power of two), computed on CUDA by the hadacore tensor-core kernel in bf16 (fp32 input goes
  through bf16) and cast back to the model dtype before quantizing; its rounding is that kernel's,
  not a butterfly the oracle can restate, so the rotated values, hence the codes, cannot be
  matched bit for bit. (2) The grid is asymmetric with an *integer* zero point
  (``zp = clamp(round(-min / s), 0, 15)``, codes ``clamp(round(x * (1/s) + zp), 0, 15)``,
  ``s = max((max - min) / 15, 1e-6)``), not kverr's real-valued block minimum. (3) The stored fp32
  scale carries ``zp`` in its low four mantissa bits, so the scale the reader multiplies by is not
  the one that encoded. (2) and (3) would be general options (an integer zero point; a scale
  stored after encoding with its own rounding); (1) needs the rotation's arithmetic defined.
* ``turboquant_*`` (``model_executor/layers/quantization/turboquant/``,
  ``v1/attention/ops/triton_turboquant_store.py``). Keys at 3/4 bits are Lloyd-Max codebook
  indices of the Hadamard-rotated unit vector with an fp16 vector norm (and, ``_nc``, the norm
  corrected on decode). kverr's codebook format with the ``"normal"`` levels and an rms scale is
  that quantizer (the ``turboquant-mse-*`` presets), but not bit for bit: vLLM's levels come
  from a trapezoid-rule Lloyd-Max solve for ``N(0, 1/d)``, not the exact normal centroids, its
  rotation rounds as its kernel's product does, and the norm correction rescales on decode,
  which no kverr format does. Values (all four dtypes) are
  uniform 3/4-bit with ``s = (max - min) / L`` floored at 1e-8 and codes
  ``trunc((x - min) / s + 0.5)`` computed with the fp32 ``s`` and ``min``, but stored as fp16
  scale and fp16 zero, which the reader uses: again a stored scale that differs from the encoding
  one. ``turboquant_k8v4`` keys are a plain fp8 cast (no scale: kverr's fp8 with a static scale
  of 1; e4m3 on Hopper, ``e4b15`` on Ampere/Ada, which kverr lacks). And ``arg_utils`` adds
  ``TurboQuantConfig.get_boundary_skip_layers`` to the skipped layers: the first and last
  ``min(2, num_layers // 2)`` layers of a dense model stay in the model dtype (none in a hybrid
  one), which depends on the model's layer count, so a model-independent preset cannot hold it
  (a config built for a known layer count can, with ``layers`` overrides).
"""

from __future__ import annotations

from dataclasses import replace

from kverr.config import CacheConfig
from kverr.quant.formats import PerToken, PerTokenGroup, QuantFormat, fp4_format

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
    # FlashInfer's nvfp4 writer with vLLM's unit global scale: e4m3(amax / 6) per 16 channels,
    # codes e2m1(x * (1 / s)) (see the module docs)
    nvfp4 = replace(fp4_format(PerTokenGroup(16)), scale_rounding="nearest", reciprocal=True)
    presets["vllm-nvfp4"] = ("nvfp4", dict(k=nvfp4, v=nvfp4))
    return {name: (dtype, CacheConfig(name=name, **kw)) for name, (dtype, kw) in presets.items()}


_ALL = _presets()

#: vLLM's cache dtypes as kverr configs, by preset name (``vllm-...``).
PRESETS: dict[str, CacheConfig] = {name: cfg for name, (_, cfg) in _ALL.items()}

#: The ``--kv-cache-dtype`` value that serves each preset.
KV_CACHE_DTYPE: dict[str, str] = {name: dtype for name, (dtype, _) in _ALL.items()}
