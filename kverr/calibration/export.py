"""Exports of a :class:`~kverr.config.CacheConfig` for serving engines, and what they cannot say.

``vllm``
    vLLM's quantized KV cache is fp8 (e4m3) with *static* scales, per tensor (one ``k_scale`` /
    ``v_scale`` per layer) or per kv head (llm-compressor's ``attn_head`` strategy), one
    scheme for the whole model and for keys and values alike, nothing kept in full precision.
    The export writes ``config.json`` holding the ``quantization_config.kv_cache_scheme``
    fragment as llm-compressor writes it, and the per-layer scales
    ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (fp32, shape ``[1]`` or
    ``[num_kv_heads]``) to ``kv_scales.safetensors`` (and ``kv_scales.json`` for reading).
    The scales come from the oracle (:func:`kverr.quant.quantize` on the capture's keys and
    values), so a capture is required.
``hf``
    transformers' ``QuantizedCache``: integer codes with a zero point, groups of
    ``q_group_size`` channels of one token (``axis 0``), ``residual_length`` recent tokens in
    full precision, the same ``nbits`` for keys and values, the same for every layer and head;
    backend ``quanto`` (2 or 4 bits) or ``HQQ`` (other bits). Scales are kept in the model's
    dtype. The export writes ``generation_config.json`` with ``cache_implementation`` and
    ``cache_config``.

Anything else raises :class:`~kverr.exceptions.ExportError`-like :class:`ConfigError` listing what
the target cannot express. :func:`import_vllm` and :func:`import_hf` read the exports back.

An export is written all or nothing (:func:`kverr.io.atomic_dir`): into a temporary folder
beside ``out``, renamed to ``out`` once every file is complete, so a refusal or a failure leaves
no folder and no ``config.json`` naming scales that were never written. An existing ``out`` is
replaced only with ``overwrite`` and only when it holds nothing but an export's own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kverr.config import WHICH, CacheConfig, check_model_matches
from kverr.exceptions import CaptureError, ConfigError
from kverr.io import atomic_dir, check_output_path
from kverr.quant.formats import (
    AbsMax,
    PerHead,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    fp8_format,
    int_format,
)

FORMATS = ("vllm", "hf")

#: The files each export writes (an existing folder holding only these may be overwritten).
VLLM_FILES = ("config.json", "kv_scales.json", "kv_scales.safetensors")
HF_FILES = ("generation_config.json",)


def _formats(config: CacheConfig, n_layers: int, n_kv: int) -> dict[tuple[int, int, str], QuantFormat]:
    return {(l, h, w): config.format_for(l, h, w) for l in range(n_layers) for h in range(n_kv) for w in WHICH}


def _refuse(target: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise ConfigError(f"{target} cannot express this config: " + "; ".join(problems[:6]) + more)


def _shape_of(config: CacheConfig, n_layers: int | None, n_kv: int | None) -> tuple[int, int]:
    if n_layers is None or n_kv is None:
        n_layers = max([*config.layers, *(l for l, _ in config.heads), -1]) + 1 if n_layers is None else n_layers
        n_kv = max([*(h for _, h in config.heads), -1]) + 1 if n_kv is None else n_kv
    return max(1, n_layers), max(1, n_kv)


def _common_refusals(config: CacheConfig, target: str) -> list[str]:
    p = []
    if config.sinks:
        p.append(f"sinks={config.sinks} full-precision sink tokens ({target} keeps none)")
    if config.key_pre_rope:
        p.append(f"key_pre_rope=true ({target} stores keys after RoPE)")
    if config.window_dtype == "int8":
        p.append(f"window_dtype=int8 ({target} keeps the tokens it does not quantize in the model's dtype)")
    return p


def _uniform(fmts: dict, target: str) -> tuple[QuantFormat, QuantFormat, list[str]]:
    p = []
    by = {w: sorted({f for (_, _, ww), f in fmts.items() if ww == w}, key=lambda f: f.label()) for w in WHICH}
    for w in WHICH:
        if len(by[w]) > 1:
            where = [f"{l}:{h}" for (l, h, ww), f in sorted(fmts.items()) if ww == w and f != by[w][0]]
            p.append(
                f"{'keys' if w == 'k' else 'values'} use {len(by[w])} formats "
                f"({', '.join(f.label() for f in by[w][:4])}; e.g. heads {', '.join(where[:3])}); "
                f"{target} uses one format for the whole model"
            )
    return by["k"][0], by["v"][0], p


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


def check_vllm(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None) -> QuantFormat | None:
    """The single fp8 format vLLM would use (None: unquantized ``auto``), or raise ConfigError."""
    n_layers, n_kv = _shape_of(config, n_layers, n_kv)
    fk, fv, p = _uniform(_formats(config, n_layers, n_kv), "vLLM")
    p += _common_refusals(config, "vLLM")
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
    _refuse("vLLM", p)
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


def _write_folder(out: Path, texts: dict[str, str], *, overwrite: bool, own_files: tuple[str, ...],
                  tensors: dict[str, np.ndarray] | None = None) -> list[Path]:
    """Write ``texts`` (and ``tensors`` as ``kv_scales.safetensors``) into ``out``, all or nothing."""
    names = list(texts)
    with atomic_dir(out, overwrite=overwrite, own_files=own_files) as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if tensors is not None:
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "kv_scales.safetensors"))
            names.append("kv_scales.safetensors")
    return [out / name for name in names]


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
        return _write_folder(out, {"config.json": json.dumps(frag, indent=2) + "\n"}, overwrite=overwrite,
                             own_files=VLLM_FILES)
    if capture is None:
        raise CaptureError("the vLLM export needs static fp8 scales; pass the capture they are "
                           "computed from (--capture PATH)")
    layers = capture.kv.layers
    if layers != list(range(n_layers)):
        raise CaptureError(f"the capture has layers {layers}; scales are needed for all {n_layers}")
    check_model_matches(config, capture=capture)
    check_output_path(out, overwrite=overwrite, kind="folder", own_files=VLLM_FILES)  # before the work
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
    return _write_folder(out, texts, overwrite=overwrite, own_files=VLLM_FILES, tensors=tensors)


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


# --------------------------------------------------------------------------------------------
# transformers QuantizedCache
# --------------------------------------------------------------------------------------------


def check_hf(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None,
             head_dim: int | None = None) -> dict[str, Any]:
    """The ``cache_config`` of transformers' QuantizedCache for ``config``, or raise ConfigError."""
    n_layers, n_kv = _shape_of(config, n_layers, n_kv)
    fk, fv, p = _uniform(_formats(config, n_layers, n_kv), "transformers' QuantizedCache")
    p += _common_refusals(config, "QuantizedCache")
    groups = {}
    for w, f in (("keys", fk), ("values", fv)):
        if f.dtype != "int":
            p.append(f"{w} {f.label()}: QuantizedCache stores integer codes only")
            continue
        if f.symmetric:
            p.append(f"{w} {f.label()}: symmetric codes (QuantizedCache uses a zero point)")
        if isinstance(f.granularity, PerTokenGroup):
            groups[w] = f.granularity.group
        elif isinstance(f.granularity, PerToken) and head_dim:
            groups[w] = head_dim
        elif isinstance(f.granularity, PerToken):
            p.append(f"{w} {f.label()}: per-token scales need the head dim (pass head_dim)")
        else:
            p.append(f"{w} {f.label()}: '{f.granularity.kind}' scales (QuantizedCache groups "
                     "channels of one token, axis 0)")
        if f.rotate != "none":
            p.append(f"{w} {f.label()}: Hadamard rotation")
        if not isinstance(f.clip, AbsMax):
            p.append(f"{w} {f.label()}: '{f.clip.kind}' clipping (QuantizedCache uses min/max)")
    if fk.dtype == "int" and fv.dtype == "int" and fk.bits != fv.bits:
        p.append(f"keys at {fk.bits} bits and values at {fv.bits} bits (one nbits for both)")
    if len(set(groups.values())) > 1:
        p.append(f"key group {groups.get('keys')} and value group {groups.get('values')} differ (one q_group_size)")
    _refuse("transformers' QuantizedCache", p)
    nbits = fk.bits
    backend = "quanto" if nbits in (2, 4) else "HQQ"
    return {"backend": backend, "nbits": nbits, "axis_key": 0, "axis_value": 0,
            "q_group_size": next(iter(groups.values())), "residual_length": config.window}


def export_hf(config: CacheConfig, out: str | Path, *, n_layers: int | None = None,
              n_kv: int | None = None, head_dim: int | None = None, overwrite: bool = False) -> list[Path]:
    """Write ``generation_config.json`` for ``model.generate(..., cache_implementation='quantized')``
    into the folder ``out``, all or nothing (as :func:`export_vllm`)."""
    cc = check_hf(config, n_layers, n_kv, head_dim)
    body = {"cache_implementation": "quantized", "cache_config": cc,
            "kverr": {"config": config.name, "scale_dtype": config.k.scale_dtype,
                      "note": "QuantizedCache keeps scales in the model's dtype"}}
    return _write_folder(out, {"generation_config.json": json.dumps(body, indent=2) + "\n"},
                         overwrite=overwrite, own_files=HF_FILES)


def import_hf(path: str | Path, *, scale_dtype: str = "fp16") -> CacheConfig:
    """A kverr config from an hf export (or any dict with ``cache_config``)."""
    p = Path(path)
    obj = json.loads((p / "generation_config.json" if p.is_dir() else p).read_text())
    cc = obj.get("cache_config", obj)
    try:
        nbits, g, r = int(cc["nbits"]), int(cc["q_group_size"]), int(cc.get("residual_length", 0))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{p}: cache_config needs nbits, q_group_size (and residual_length)") from None
    if cc.get("axis_key", 0) != 0 or cc.get("axis_value", 0) != 0:
        raise ConfigError(f"{p}: only axis 0 (groups of channels of one token) is read")
    f = int_format(nbits, PerTokenGroup(g), scale_dtype=scale_dtype)
    return CacheConfig(k=f, v=f, window=r)


def export(config: CacheConfig, fmt: str, out: str | Path, *, capture: Any = None,
           n_layers: int | None = None, n_kv: int | None = None, head_dim: int | None = None,
           overwrite: bool = False) -> list[Path]:
    """Dispatch to :func:`export_vllm` or :func:`export_hf`."""
    if fmt == "vllm":
        return export_vllm(config, out, capture=capture, n_layers=n_layers, n_kv=n_kv, overwrite=overwrite)
    if fmt == "hf":
        return export_hf(config, out, n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, overwrite=overwrite)
    raise ConfigError(f"--format {fmt!r} is not allowed; one of {', '.join(FORMATS)}")
