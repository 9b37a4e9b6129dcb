"""vLLM's KV cache: which kverr configs it runs, and the export it reads.

vLLM's quantized KV cache is fp8 (e4m3) with *static* scales, per tensor (one ``k_scale`` /
``v_scale`` per layer) or per kv head (llm-compressor's ``attn_head`` strategy), one scheme for the
whole model and for keys and values alike, nothing kept in full precision. The export writes
``config.json`` holding the ``quantization_config.kv_cache_scheme`` fragment as llm-compressor
writes it, and the per-layer scales ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (fp32,
shape ``[1]`` or ``[num_kv_heads]``) to ``kv_scales.safetensors`` (and ``kv_scales.json`` for
reading). The scales come from the oracle (:func:`kverr.quant.quantize` on the capture's keys and
values), so a capture is required.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kverr.config import WHICH, CacheConfig, check_model_matches
from kverr.engines.vllm_dtypes import PRESETS as _DTYPE_PRESETS
from kverr.engines.common import common_refusals, formats_of, refuse, shape_of, uniform, write_folder
from kverr.exceptions import CaptureError, ConfigError
from kverr.io import check_output_path
from kverr.quant.formats import PerHead, PerTensor, QuantFormat, fp8_format

#: The files the export writes (an existing folder holding only these may be overwritten).
FILES = ("config.json", "kv_scales.json", "kv_scales.safetensors")

#: This engine's cache formats as kverr configs, by name (see :func:`kverr.engines.engine_presets`).
PRESETS: dict[str, CacheConfig] = dict(_DTYPE_PRESETS)


def check_vllm(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None) -> QuantFormat | None:
    """The single fp8 format vLLM would use (None: unquantized ``auto``), or raise ConfigError."""
    n_layers, n_kv = shape_of(config, n_layers, n_kv)
    fk, fv, p = uniform(formats_of(config, n_layers, n_kv), "vLLM")
    p += common_refusals(config, "vLLM")
    if config.window:
        p.append(f"window={config.window} full-precision recent tokens (vLLM's cache has no such window)")
    if fk != fv:
        p.append(f"keys ({fk.label()}) and values ({fv.label()}) differ; vLLM's kv_cache_scheme is one for both")
    for f in {fk, fv}:
        if f.is_float:
            if f.dtype not in ("fp16", "bf16"):
                p.append(f"{f.dtype} storage (vLLM's unquantized cache is the model dtype)")
            continue
        if f.dtype != "fp8_e4m3":
            p.append(f"{f.label()}: vLLM's quantized KV cache is fp8 e4m3 with static scales "
                     "(no integer codes, no e5m2 scheme)")
        elif not isinstance(f.granularity, (PerTensor, PerHead)):
            p.append(f"{f.label()}: '{f.granularity.kind}' scales are dynamic; vLLM takes static "
                     "scales per tensor or per kv head")
        if f.rotate != "none":
            p.append(f"{f.label()}: Hadamard rotation (vLLM does not rotate the cache)")
    refuse("vLLM", p)
    return None if fk.is_float else fk


def _static_scales(capture: Any, fmt: QuantFormat, which: str, page_size: int) -> list[np.ndarray]:
    """Oracle scales of every layer: ``[1]`` (tensor) or ``[kv_head]`` (head) float32 arrays."""
    import torch

    from kverr.quant import quantize

    var = {"k": "k", "v": "v"}[which]
    out = []
    for layer in [int(x) for x in capture["layer"].values]:
        x = torch.as_tensor(np.asarray(capture[var].sel(layer=layer).values, dtype=np.float32))
        x = x.to(torch.float16).to(torch.float32)  # the cache receives model-dtype values
        qt = quantize(x, fmt, page_size=page_size)
        s = qt.scale.to(torch.float32).reshape(-1).numpy()
        out.append(s)  # [1] (tensor) or [kv_head] (attn_head)
    return out


def export_vllm(config: CacheConfig, out: str | Path, *, capture: Any = None,
                n_layers: int | None = None, n_kv: int | None = None, overwrite: bool = False) -> list[Path]:
    """Write the vLLM / llm-compressor export (see the module docs); returns the files written.

    Raises
    ------
    ConfigError
        vLLM cannot express ``config``, or it was calibrated on another model than the capture's.
    CaptureError
        Static scales are needed and ``capture`` is missing, lacks layers or is damaged.
    OutputExistsError, OutputError
        ``out`` exists (without ``overwrite``) or cannot be written; nothing is left behind.
    """
    out = Path(out)
    if capture is not None:
        import kverr.accessor  # noqa: F401  (registers ds.kv)

        n_layers, n_kv = capture.kv.n_layers, capture.kv.n_kv_heads
    fmt = check_vllm(config, n_layers, n_kv)
    if fmt is None:
        frag = {"kv_cache_dtype": "auto"}
        return write_folder(out, {"config.json": json.dumps(frag, indent=2) + "\n"}, overwrite=overwrite,
                             own_files=FILES)
    if capture is None:
        raise CaptureError("the vLLM export needs static fp8 scales; pass the capture they are "
                           "computed from (--capture PATH)")
    layers = capture.kv.layers
    if layers != list(range(n_layers)):
        raise CaptureError(f"the capture has layers {layers}; scales are needed for all {n_layers}")
    check_model_matches(config, capture=capture)
    check_output_path(out, overwrite=overwrite, kind="folder", own_files=FILES)  # before the work
    strategy = "tensor" if isinstance(fmt.granularity, PerTensor) else "attn_head"
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    frag = {
        "kv_cache_dtype": "fp8_e4m3",
        "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme},
        "kverr": {"config": config.name, "clip": fmt.clip.kind,
                  "capture_weights_sha256": capture.kv.provenance["weights_sha256"]},
    }
    # Every scale is computed before anything is written.
    tensors, listing = {}, {}
    for w in WHICH:
        for layer, s in enumerate(_static_scales(capture, fmt, w, config.page_size)):
            name = f"model.layers.{layer}.self_attn.{w}_scale"
            tensors[name] = s.astype(np.float32)
            listing[name] = s.astype(float).tolist()
    texts = {"config.json": json.dumps(frag, indent=2) + "\n",
             "kv_scales.json": json.dumps(listing, indent=1) + "\n"}
    return write_folder(out, texts, overwrite=overwrite, own_files=FILES, tensors=tensors)


def import_vllm(path: str | Path) -> CacheConfig:
    """A kverr config from a vLLM export's ``config.json`` (scales are not part of a config)."""
    p = Path(path)
    obj = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    if obj.get("kv_cache_dtype") == "auto":
        from kverr.quant.formats import float_format

        return CacheConfig(k=float_format("fp16"), v=float_format("fp16"))
    sch = obj.get("quantization_config", {}).get("kv_cache_scheme")
    if not sch or sch.get("type") != "float" or sch.get("num_bits") != 8 or sch.get("dynamic"):
        raise ConfigError(f"{p}: kv_cache_scheme {sch!r} is not a static fp8 scheme kverr reads")
    strat = {"tensor": PerTensor(), "attn_head": PerHead()}.get(sch.get("strategy"))
    if strat is None:
        raise ConfigError(f"{p}: strategy {sch.get('strategy')!r} is not allowed; 'tensor' or 'attn_head'")
    f = fp8_format(strat)
    return CacheConfig(k=f, v=f)
