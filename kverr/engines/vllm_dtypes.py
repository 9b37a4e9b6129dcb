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
  the query in the model's dtype.
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
  the one that encoded. (2) would be a general option (an integer zero point) and (3) a variant
  of ``encode_with="fp32"`` (the stored scale's low bits replaced, not rounded); (1) needs the
  rotation's arithmetic defined. :mod:`kverr.engines.vllm_int4` emulates it as an evaluation
  peer (``kverr evaluate --scheme vllm-int4-per-token-head``), not as a format.
* ``turboquant_3bit_nc``, ``turboquant_4bit_nc``, ``turboquant_k3v4_nc``
  (``model_executor/layers/quantization/turboquant/``). Keys at 3/4 bits are Lloyd-Max codebook
  indices of the rotated unit vector with an fp16 vector norm, the norm corrected on decode.
  kverr's codebook format with the ``"normal"`` levels and an rms scale is that quantizer (the
  ``turboquant-mse-*`` presets), but not bit for bit: vLLM's levels come from a trapezoid-rule
  Lloyd-Max solve for ``N(0, 1/d)``, not the exact normal centroids; the norm and the rotation
  are a torch norm and a cuBLAS product (``x_hat @ PiT``), whose summation order is the
  library's; and the norm correction rescales on decode, which no kverr format does. Their
  values are the ``turboquant_k8v4`` values below (3 bits for ``3bit_nc``).
  :mod:`kverr.engines.vllm_turboquant` emulates them as evaluation peers
  (``vllm-turboquant-4bit-nc``, ``-k3v4-nc``, ``-3bit-nc``), with vLLM's levels.

Expressed, with what the restatement cannot see:

* ``nvfp4_4over6`` (the trtllm-gen path on Blackwell only; vLLM's ``CacheConfig`` documents it as
  the NVFP4 layout choosing ``max / 6`` or ``max / 4`` scales per 16 values by least squared
  reconstruction error): ``vllm-nvfp4``'s arithmetic with kverr's four-over-six choice (the
  clip candidates 1.0 and 1.5 of :data:`kverr.config.FOUR_OVER_SIX`, each block's squared error
  summed in float64, a tie keeping ``max / 6``). The writer is CUDA code outside the wheel, so
  its tie rule and the order and precision of its error sum are not restated: a block whose two
  errors are within rounding of each other may choose the other scale there.

* ``turboquant_k8v4`` (vLLM 0.34, ``v1/attention/ops/triton_turboquant_store.py``,
  ``_tq_fused_store_fp8``): keys cast to fp8 e4m3 with no scale (kverr's fp8 per tensor with
  ``fixed_scale=1.0``; Triton's conversion saturates at ±448), values asymmetric int4 per (token,
  kv head) with ``s = max((max - min) / 15, 1e-8)`` and codes ``trunc((x - min) / s + 0.5)``
  from the fp32 ``s`` and ``min`` (``encode_with="fp32"``), stored as an fp16 scale and an fp16
  zero, which the decode kernel reads (``code * s + zero``). The tests restate it in plain torch
  with IEEE division; Triton compiles the kernel's ``/`` to ``div.full.f32`` (within 2 ulp), so
  a GPU code can differ where a quotient lies within 2 ulp of a half step, and an fp16 scale
  where ``(max - min) / 15`` lies within 2 ulp of an fp16 rounding boundary. Keys are e4m3 on
  sm_89 and later; Ampere and Ada before sm_89 use ``e4b15``, which kverr lacks. vLLM also keeps
  the first and last ``min(2, num_layers // 2)`` layers of a dense model (none of a hybrid) in the
  model's dtype (``TurboQuantConfig.get_boundary_skip_layers``): that depends on the layer
  count, so the preset quantizes every layer, :func:`with_boundary_skip` gives the config vLLM
  runs on a model, and :func:`kverr.engines.vllm.serving` refuses a config that quantizes those
  layers with this dtype.
"""

from __future__ import annotations

from dataclasses import replace

from kverr.config import FOUR_OVER_SIX, CacheConfig, Override
from kverr.quant.formats import (PerTensor, PerToken, PerTokenGroup, QuantFormat, float_format, fp4_format, fp8_format,
                                 int_format)

#: ``tl.maximum(absmax / QUANT_MAX, 1e-6)`` in ``_reshape_cache_per_token_head``.
PER_TOKEN_HEAD_SCALE_FLOOR = 1e-6
#: ``tl.where(v_scale > 1e-8, v_scale, 1e-8)`` in TurboQuant's ``_store_quantized_value``.
TURBOQUANT_SCALE_FLOOR = 1e-8
#: Layers vLLM keeps in the model's dtype at each end of a dense model for the TurboQuant dtypes
#: (``TurboQuantConfig.get_boundary_skip_layers``, ``n=2``).
TURBOQUANT_EDGE_LAYERS = 2


def boundary_layers(n_layers: int) -> list[int]:
    """The layers vLLM keeps unquantized for a TurboQuant dtype on a dense model of ``n_layers``:
    the first and last ``min(2, n_layers // 2)``."""
    n = min(TURBOQUANT_EDGE_LAYERS, n_layers // 2)
    return sorted({*range(n), *range(n_layers - n, n_layers)})


def has_boundary_skip(kv_cache_dtype: str) -> bool:
    """Whether vLLM adds :func:`boundary_layers` to the skipped layers for this cache dtype."""
    return kv_cache_dtype.startswith("turboquant_")


def with_boundary_skip(config: CacheConfig, n_layers: int) -> CacheConfig:
    """``config`` with :func:`boundary_layers` kept in fp16 (the model's 16-bit dtype), as vLLM
    runs a TurboQuant dtype on a dense model of ``n_layers`` (a hybrid model keeps none: there
    the preset itself is what vLLM runs); other overrides of those layers are replaced, the
    rest kept."""
    fp16 = float_format("fp16")
    layers = dict(config.layers)
    for layer in boundary_layers(n_layers):
        layers[layer] = Override(k=fp16, v=fp16)
    heads = {key: o for key, o in config.heads.items() if key[0] not in set(boundary_layers(n_layers))}
    return replace(config, layers=layers, heads=heads,
                   name=f"{config.name}-edges" if config.name else config.name)


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
    # nvfp4_4over6 (vLLM's CacheConfig docs; the writer is CUDA code outside the wheel): the nvfp4
    # layout, each block's scale amax / 6 or amax / 4 by least squared reconstruction error
    four_over_six = replace(nvfp4, clip=FOUR_OVER_SIX)
    presets["vllm-nvfp4-4over6"] = ("nvfp4_4over6", dict(k=four_over_six, v=four_over_six))
    # _tq_fused_store_fp8: keys cast to fp8 e4m3 with no scale (saturating); values
    # (_store_quantized_value, VQB=4) asymmetric int4 per (token, kv head) from the fp32
    # s = max((max - min) / 15, 1e-8) and min, codes trunc((x - min) / s + 0.5), stored as fp16
    # scale and fp16 zero; vLLM also keeps the boundary layers (with_boundary_skip) unquantized.
    tq_key = replace(fp8_format(PerTensor()), fixed_scale=1.0)
    tq_value = replace(int_format(4, PerToken()), scale_rounding="nearest", scale_floor=TURBOQUANT_SCALE_FLOOR,
                       rounding="half_away", encode_with="fp32")
    presets["vllm-turboquant-k8v4"] = ("turboquant_k8v4", dict(k=tq_key, v=tq_value))
    return {name: (dtype, CacheConfig(name=name, **kw)) for name, (dtype, kw) in presets.items()}


_ALL = _presets()

#: vLLM's cache dtypes as kverr configs, by preset name (``vllm-...``).
PRESETS: dict[str, CacheConfig] = {name: cfg for name, (_, cfg) in _ALL.items()}

#: The ``--kv-cache-dtype`` value that serves each preset.
KV_CACHE_DTYPE: dict[str, str] = {name: dtype for name, (dtype, _) in _ALL.items()}
