"""vLLM: which kverr configs it serves, how, and a model directory it loads.

How vLLM stores keys and values is one choice for the whole model, ``--kv-cache-dtype``, plus
``--kv-cache-dtype-skip-layers``: layers left in the model's dtype. So a kverr config is served
by vLLM when

- every layer either keeps keys and values in a 16-bit float (a *skip layer*), or uses one
  (key format, value format) pair, the same in every other layer and every kv head;
- that pair is a cache dtype vLLM has: ``fp8`` (e4m3) with *static* scales, one per layer
  (compressed-tensors strategy ``tensor``) or one per kv head (``attn_head``), for keys and
  values alike; or one of the dtypes of :mod:`kverr.engines.vllm_dtypes` (their scales are
  computed by vLLM as tokens are stored, nothing goes into the checkpoint);
- and it keeps nothing else in full precision: no sink tokens, no recent-token window, keys
  stored after RoPE.

:func:`serving` says how (a :class:`VllmServing`) or raises :class:`~kverr.exceptions.ConfigError`
listing everything vLLM cannot express.

Static fp8 scales are part of the checkpoint: vLLM reads ``model.layers.{i}.self_attn.k_scale``
and ``v_scale`` (float32, shape ``[1]`` per tensor or ``[num_kv_heads]`` per head, renamed to
the attention layer's ``attn.k_scale`` when it loads them) from the model's safetensors files,
when the model's ``config.json`` holds a compressed-tensors ``quantization_config`` with a
``kv_cache_scheme``; without them it uses a scale of 1.0. :func:`export_vllm` computes the scales
with the oracle from a capture (keys and values first rounded to the model's dtype, as the cache
receives them; the format's clip decides the scale: absmax, a percentile or the MSE-optimal
clip) and writes either

- a complete model directory (``model_dir`` given): every file of the model (hard-linked where
  the filesystem allows, else copied), ``config.json`` with the ``quantization_config`` added,
  the scales in ``kv_scales.safetensors``, listed in ``model.safetensors.index.json`` when the
  model has one (vLLM then loads only the files the index names); or
- an overlay (no ``model_dir``): ``quantization_config.json`` (the block to put into the model's
  ``config.json``) and ``kv_scales.safetensors``.

Both hold ``kverr-export.json``: the config exported, how vLLM serves it, and the ``vllm serve``
command line (:meth:`VllmServing.command`). The ``quantization_config`` is validated with
compressed-tensors' own ``QuantizationConfig`` before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kverr.config import WHICH, CacheConfig, check_model_matches
from kverr.engines.common import common_refusals, refuse, shape_of
from kverr.engines.vllm_dtypes import KV_CACHE_DTYPE as _DTYPE_OF_PRESET
from kverr.engines.vllm_dtypes import boundary_layers, has_boundary_skip
from kverr.engines.vllm_dtypes import PRESETS as _DTYPE_PRESETS
from kverr.exceptions import CaptureError, ConfigError, ModelError
from kverr.io import atomic_dir, check_output_path
from kverr.quant.formats import TORCH_DTYPES, AbsMax, PerHead, PerTensor, QuantFormat, fp8_format

#: This engine's cache formats as kverr configs, by name (see :func:`kverr.engines.engine_presets`).
PRESETS: dict[str, CacheConfig] = dict(_DTYPE_PRESETS)

#: The file every export writes: what was exported and how to serve it.
SUMMARY = "kverr-export.json"
#: The safetensors file holding static scales.
SCALES = "kv_scales.safetensors"
#: The overlay's quantization_config block (no model directory given).
OVERLAY_CONFIG = "quantization_config.json"
INDEX = "model.safetensors.index.json"

#: Plain-float storage vLLM can keep a skip layer in (the model's dtype, 16 bits).
_SKIP_DTYPES = ("fp16", "bf16")
#: ``config.json``'s dtype names (torch's) of the dtypes a model directory may hold.
_TORCH_DTYPE_NAMES = {str(TORCH_DTYPES[d]).removeprefix("torch."): d for d in (*_SKIP_DTYPES, "fp32")}
#: The names vLLM loads static kv-cache scales from, one per layer and side.
SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def scale_name(layer: int, which: str) -> str:
    """The checkpoint name of layer ``layer``'s static scale for ``which`` (``"k"`` or ``"v"``)."""
    return f"model.layers.{layer}.self_attn.{which}_scale"


@dataclass(frozen=True)
class VllmServing:
    """How vLLM serves a config.

    Attributes
    ----------
    kv_cache_dtype : str
        ``--kv-cache-dtype``: ``"auto"`` (the model's dtype), ``"fp8"``, or a dtype of
        :mod:`kverr.engines.vllm_dtypes`.
    skip_layers : tuple of int
        ``--kv-cache-dtype-skip-layers``: layers kept in the model's dtype.
    strategy : str or None
        Static fp8 only: the compressed-tensors scale strategy, ``"tensor"`` or ``"attn_head"``.
    k, v : QuantFormat or None
        The formats of the quantized layers (None when nothing is quantized).
    """

    kv_cache_dtype: str
    skip_layers: tuple[int, ...] = ()
    strategy: str | None = None
    k: QuantFormat | None = None
    v: QuantFormat | None = None

    @property
    def needs_scales(self) -> bool:
        """Static scales must be in the checkpoint (else vLLM uses 1.0)."""
        return self.strategy is not None

    def kv_cache_scheme(self) -> dict[str, Any] | None:
        """The compressed-tensors ``kv_cache_scheme`` (static fp8 only)."""
        if self.strategy is None:
            return None
        return {"num_bits": 8, "type": "float", "strategy": self.strategy, "dynamic": False,
                "symmetric": True}

    def command(self, model: str | os.PathLike[str], dtype: str | None = None) -> str:
        """The ``vllm serve`` command line for ``model`` (a directory or a model id)."""
        parts = ["vllm", "serve", str(model)]
        if dtype:
            parts += ["--dtype", dtype]
        parts += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.skip_layers and self.kv_cache_dtype != "auto":
            parts += ["--kv-cache-dtype-skip-layers", *map(str, self.skip_layers)]
        return " ".join(parts)


def _layer_formats(config: CacheConfig, layer: int, n_kv: int) -> dict[str, set[QuantFormat]]:
    return {w: {config.format_for(layer, h, w) for h in range(n_kv)} for w in WHICH}


def _served_as(fmt: QuantFormat) -> QuantFormat:
    """What vLLM stores ``fmt`` as: a static fp8 scale's clip only decides the scale's value (it
    is data in the checkpoint, one per layer or head), so static fp8 formats differing only in
    clip are one cache dtype."""
    if fmt.dtype == "fp8_e4m3" and isinstance(fmt.granularity, (PerTensor, PerHead)):
        return replace(fmt, clip=AbsMax())
    return fmt


def _dtype_pairs() -> dict[tuple[QuantFormat, QuantFormat], str]:
    """(key format, value format) of each vLLM cache dtype without checkpoint scales."""
    out = {}
    for name, cfg in _DTYPE_PRESETS.items():
        dtype = _DTYPE_OF_PRESET[name]
        for layer in [*cfg.layers, None]:  # the quantized layers' formats; skip layers are float
            k, v = (cfg.k, cfg.v) if layer is None else (cfg.format_for(layer, 0, "k"), cfg.format_for(layer, 0, "v"))
            if not k.is_float:
                out.setdefault((k, v), dtype)
    return out


def _same_layout(fmt: QuantFormat) -> tuple[str, str, dict] | None:
    """``(preset, kv_cache_dtype, options)`` of a vLLM dtype whose format is ``fmt`` but for the
    arithmetic options (``options``: vLLM's values of those that differ), else None."""
    from kverr.quant.formats import ARITHMETIC_DEFAULTS

    plain = replace(fmt, **ARITHMETIC_DEFAULTS)
    for name, cfg in _DTYPE_PRESETS.items():
        for f in (cfg.k, cfg.v):
            if not f.is_float and replace(f, **ARITHMETIC_DEFAULTS) == plain:
                return name, _DTYPE_OF_PRESET[name], {o: getattr(f, o) for o in sorted(ARITHMETIC_DEFAULTS)
                                                       if getattr(f, o) != getattr(fmt, o)}
    return None


def _pair_problems(k: QuantFormat, v: QuantFormat) -> tuple[str | None, str | None, list[str]]:
    """(kv_cache_dtype, strategy, problems) for the formats of the quantized layers."""
    dtype = _dtype_pairs().get((k, v))
    if dtype is not None:
        return dtype, None, []
    p = []
    if k != v:
        p.append(f"keys ({k.label()}) and values ({v.label()}) differ, and no vLLM cache dtype "
                 "stores that pair")
    for f in dict.fromkeys((k, v)):
        if f.dtype != "fp8_e4m3":
            near = _same_layout(f)
            hint = (f"; the preset {near[0]} (--kv-cache-dtype {near[1]}) is this layout with vLLM's arithmetic "
                    f"({', '.join(f'{o}={val!r}' for o, val in near[2].items())})" if near else "")
            p.append(f"{f.label()}: not a vLLM cache dtype (fp8 e4m3 with static scales per tensor or "
                     f"per kv head, or one of {', '.join(sorted(set(_DTYPE_OF_PRESET.values()))) or 'none'}){hint}")
        elif not isinstance(f.granularity, (PerTensor, PerHead)):
            p.append(f"{f.label()}: '{f.granularity.kind}' scales are dynamic; vLLM's fp8 takes static "
                     "scales per tensor or per kv head")
        elif f.rotate != "none":
            p.append(f"{f.label()}: Hadamard rotation (vLLM's fp8 cache does not rotate)")
    if p:
        return None, None, p
    return "fp8", "tensor" if isinstance(k.granularity, PerTensor) else "attn_head", []


def serving(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None) -> VllmServing:
    """How vLLM serves ``config`` (see the module docs), or raise ConfigError listing why not.

    Examples
    --------
    >>> from kverr.config import PRESETS
    >>> serving(PRESETS["fp8-e4m3-head"], 30, 3).command("./model", "bfloat16")
    'vllm serve ./model --dtype bfloat16 --kv-cache-dtype fp8'
    """
    n_layers, n_kv = shape_of(config, n_layers, n_kv)
    p = common_refusals(config, "vLLM")
    if config.window:
        p.append(f"window={config.window} full-precision recent tokens (vLLM's cache has no such window)")
    skip, pairs = [], {}
    for layer in range(n_layers):
        fmts = _layer_formats(config, layer, n_kv)
        if all(f.is_float for w in WHICH for f in fmts[w]):
            odd = sorted({f.dtype for w in WHICH for f in fmts[w]} - set(_SKIP_DTYPES))
            if odd:
                p.append(f"layer {layer}: {odd[0]} storage (vLLM keeps a skipped layer in the model's "
                         "16-bit dtype)")
            skip.append(layer)
            continue
        if len(fmts["k"]) > 1 or len(fmts["v"]) > 1:
            p.append(f"layer {layer}: its kv heads use {len(fmts['k'] | fmts['v'])} formats "
                     "(vLLM uses one per layer)")
            continue
        pairs.setdefault((_served_as(next(iter(fmts["k"]))), _served_as(next(iter(fmts["v"])))), []).append(layer)
    if len(pairs) > 1:
        shown = "; ".join(f"{k.label()}/{v.label()} in layers {_ranges(ls)}" for (k, v), ls in list(pairs.items())[:3])
        p.append(f"the quantized layers use {len(pairs)} format pairs ({shown}); vLLM's "
                 "--kv-cache-dtype is one for the model")
    dtype, strategy, k, v = "auto", None, None, None
    if len(pairs) == 1:
        (k, v), = pairs
        dtype, strategy, more = _pair_problems(k, v)
        p += more
        if dtype is not None and has_boundary_skip(dtype):
            quantized = [l for l in boundary_layers(n_layers) if l not in skip]
            if quantized:
                p.append(f"layers {_ranges(quantized)}: vLLM keeps layers {_ranges(boundary_layers(n_layers))} in the "
                         f"model's dtype with {dtype} (its boundary skip), so they cannot be quantized "
                         "(kverr.engines.vllm_dtypes.with_boundary_skip gives the config vLLM runs)")
    refuse("vLLM", p, "`kverr project CONFIG --target vllm --capture CAPTURE` finds the nearest config vLLM "
                      "serves and its predicted cost")
    return VllmServing(dtype, tuple(skip) if pairs else (), strategy, k, v)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# Model directories
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDir:
    """A transformers model directory as vLLM loads it: ``config.json`` and safetensors weights."""

    path: Path
    config: dict[str, Any]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # "fp16" | "bf16" | "fp32"
    index: dict[str, Any] | None


def read_model_dir(path: str | os.PathLike[str]) -> ModelDir:
    """Read a model directory's config and weight listing, without loading weights.

    Raises
    ------
    ModelError
        Not a directory, no ``config.json``, no safetensors weights (vLLM reads k/v scales
        from safetensors only), an index naming missing files, or a config without attention
        heads.
    """
    from kverr.memory import model_shape

    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(f"--model-dir {p}: not a directory")
    if not (p / "config.json").is_file():
        raise ModelError(f"--model-dir {p}: no config.json (not a transformers model directory)")
    if not list(p.glob("*.safetensors")):
        found = sorted(x.name for x in p.glob("*.bin"))[:2]
        raise ModelError(f"--model-dir {p}: no safetensors weights"
                         + (f" (found {', '.join(found)}; vLLM reads k/v scales from safetensors files)" if found else ""))
    shape = model_shape(str(p))
    config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    raw = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float32")
    if raw not in _TORCH_DTYPE_NAMES:
        raise ModelError(f"--model-dir {p}: config.json dtype {raw!r} is not one of {', '.join(_TORCH_DTYPE_NAMES)}")
    index = None
    if (p / INDEX).is_file():
        index = json.loads((p / INDEX).read_text(encoding="utf-8"))
        missing = sorted({f for f in index.get("weight_map", {}).values() if not (p / f).is_file()})
        if missing:
            raise ModelError(f"--model-dir {p}: {INDEX} names missing files: {', '.join(missing[:3])}")
    return ModelDir(p, config, shape.n_layers, shape.n_kv_heads, shape.head_dim, _TORCH_DTYPE_NAMES[raw], index)


def quantization_config(plan: VllmServing, existing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` holding ``plan``'s kv_cache_scheme,
    merged into a model's ``existing`` one (compressed-tensors only) and validated with
    compressed-tensors' own ``QuantizationConfig``."""
    scheme = plan.kv_cache_scheme()
    if scheme is None:
        raise ConfigError(f"--kv-cache-dtype {plan.kv_cache_dtype} takes no checkpoint scales")
    if existing is not None and existing.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"the model is already quantized with {existing.get('quant_method')!r}; "
                          "vLLM reads kv cache scales from compressed-tensors configs only")
    block = dict(existing or {"quant_method": "compressed-tensors", "config_groups": {},
                              "format": "dense", "quantization_status": "compressed", "ignore": []})
    block["kv_cache_scheme"] = scheme
    from compressed_tensors.quantization import QuantizationConfig

    QuantizationConfig.model_validate(block)  # raises pydantic's ValidationError naming the field
    return block


# --------------------------------------------------------------------------------------------
# Scales and the export
# --------------------------------------------------------------------------------------------


def static_scale(capture: Any, layer: int, fmt: QuantFormat, which: str, *, page_size: int,
                 model_dtype: str = "fp16") -> np.ndarray:
    """The oracle's static scale of ``fmt`` for one layer of ``capture``: float32 ``[1]`` (per
    tensor) or ``[n_kv_heads]`` (per head), from the keys (post-RoPE) or values rounded to
    ``model_dtype`` first, as the cache receives them."""
    import torch

    from kverr.quant import quantize

    x = torch.as_tensor(np.asarray(capture[which].sel(layer=layer).values, dtype=np.float32))
    x = x.to(TORCH_DTYPES[model_dtype]).to(torch.float32)
    return quantize(x, fmt, page_size=page_size).scale.to(torch.float32).reshape(-1).numpy()


def static_scales(capture: Any, fmt: QuantFormat, which: str, *, page_size: int,
                  model_dtype: str = "fp16") -> list[np.ndarray]:
    """:func:`static_scale` of every layer of ``capture``, in its order."""
    return [static_scale(capture, layer, fmt, which, page_size=page_size, model_dtype=model_dtype)
            for layer in capture.kv.layers]


@dataclass(frozen=True)
class VllmExport:
    """What :func:`export_vllm` wrote, and how to serve it."""

    out: Path
    files: tuple[Path, ...]  # written by kverr
    linked: tuple[Path, ...]  # the model's own files, hard-linked or copied
    serving: VllmServing
    command: str


def export_vllm(config: CacheConfig, out: str | os.PathLike[str], *, capture: Any = None,
                model_dir: str | os.PathLike[str] | None = None, n_layers: int | None = None,
                n_kv: int | None = None, overwrite: bool = False, model_dtype: str | None = None) -> VllmExport:
    """Write what vLLM needs to serve ``config`` (see the module docs).

    Parameters
    ----------
    config : CacheConfig
    out : path
        The folder to write: a complete model directory when ``model_dir`` is given, else an
        overlay. Written all or nothing.
    capture : xarray.Dataset, optional
        The capture static fp8 scales are computed from (every layer of the model); needed when
        the config uses static fp8 scales.
    model_dir : path, optional
        The model's transformers directory (``config.json``, safetensors weights).
    n_layers, n_kv : int, optional
        The model's shape when neither ``model_dir`` nor ``capture`` gives it.
    overwrite : bool
        Replace a previous export at ``out``.
    model_dtype : {"fp16", "bf16"}, optional
        The dtype the model serves in (default: the model directory's, fp16 for a float32 one
        or without a directory): keys and
        values are rounded to it before the scales are computed, and it is passed to ``vllm
        serve --dtype``.

    Raises
    ------
    ConfigError
        vLLM cannot express ``config``; it was calibrated on another model than the capture's or
        the model directory's; the model directory is quantized by another method.
    ModelError
        ``model_dir`` is not a model directory with safetensors weights, or its shape differs
        from the capture's.
    CaptureError
        Static scales are needed and ``capture`` is missing or lacks layers.
    OutputExistsError, OutputError
        ``out`` exists (without ``overwrite``) or cannot be written; nothing is left behind.
    """
    out = Path(out).expanduser()
    model = read_model_dir(model_dir) if model_dir is not None else None
    if capture is not None:
        import kverr.accessor  # noqa: F401  (registers ds.kv)
    if model is not None:
        shape = (model.n_layers, model.n_kv_heads, model.head_dim)
        config.check_model(*shape)
        check_model_matches(config, shape=shape)
        if capture is not None:
            got = (capture.kv.shape.n_layers, capture.kv.shape.n_kv_heads, capture.kv.shape.head_dim)
            if got != shape:
                raise ModelError(f"--model-dir {model.path} has {shape[0]} layers x {shape[1]} kv heads x head "
                                 f"dim {shape[2]}, the capture {got[0]} x {got[1]} x {got[2]}: another model")
        n_layers, n_kv = model.n_layers, model.n_kv_heads
    elif capture is not None:
        n_layers, n_kv = capture.kv.n_layers, capture.kv.n_kv_heads
    plan = serving(config, n_layers, n_kv)
    # a float32 checkpoint is served in fp16 unless told otherwise (vllm serve --dtype says so)
    dtype = model_dtype or (model.dtype if model is not None and model.dtype != "fp32" else "fp16")
    if dtype not in _SKIP_DTYPES:
        raise ConfigError(f"model dtype {dtype!r}: vLLM's fp8 and quantized caches serve fp16 or bf16 models")
    serve_dtype = str(TORCH_DTYPES[dtype]).removeprefix("torch.")
    # the written directory when it holds the model; else the model as it is (nothing to add to
    # it for dynamic dtypes), or a placeholder for an overlay's model
    target = out if model is not None and plan.needs_scales else (model.path if model is not None else "MODEL")
    command = plan.command(target, serve_dtype)
    summary = {"config": config.name, "kv_cache_dtype": plan.kv_cache_dtype,
               "kv_cache_dtype_skip_layers": list(plan.skip_layers), "strategy": plan.strategy,
               "dtype": serve_dtype, "command": command}

    texts: dict[str, str] = {}
    tensors: dict[str, np.ndarray] = {}
    if plan.needs_scales:
        if capture is None:
            raise CaptureError("the vLLM export needs static fp8 scales; pass the capture they are "
                               "computed from (--capture PATH)")
        if capture.kv.layers != list(range(n_layers)):
            raise CaptureError(f"the capture has layers {capture.kv.layers}; scales are needed for all {n_layers}")
        check_model_matches(config, capture=capture)
        qc = quantization_config(plan, None if model is None else model.config.get("quantization_config"))
        check_output_path(out, overwrite=overwrite, kind="folder", own_files=_own_files(model))  # before the work
        for w in WHICH:
            for layer in range(n_layers):
                if layer in plan.skip_layers:
                    continue
                fmt = config.format_for(layer, 0, w)  # its clip decides this layer's scale
                tensors[scale_name(layer, w)] = static_scale(capture, layer, fmt, w, page_size=config.page_size,
                                                             model_dtype=dtype)
        summary.update(scales=SCALES, scales_from={"capture": capture.kv.provenance.get("text_source"),
                                                  "weights_sha256": capture.kv.provenance.get("weights_sha256"),
                                                  "clips": sorted({config.format_for(l, 0, w).clip.kind
                                                                   for l in range(n_layers) for w in WHICH
                                                                   if l not in plan.skip_layers})})
        if model is None:
            texts[OVERLAY_CONFIG] = json.dumps(qc, indent=2) + "\n"
        else:
            cfg = dict(model.config)
            cfg["quantization_config"] = qc
            texts["config.json"] = json.dumps(cfg, indent=2) + "\n"
            if model.index is not None:
                index = json.loads(json.dumps(model.index))
                index["weight_map"].update({name: SCALES for name in tensors})
                texts[INDEX] = json.dumps(index, indent=2) + "\n"
    texts[SUMMARY] = json.dumps(summary, indent=2) + "\n"

    written, linked = [], []
    with atomic_dir(out, overwrite=overwrite, own_files=_own_files(model)) as tmp:
        if model is not None and plan.needs_scales:
            for src in sorted(model.path.iterdir()):
                if src.name not in texts and src.is_file():
                    _link_or_copy(src, tmp / src.name)
                    linked.append(out / src.name)
        for name, text in texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
            written.append(out / name)
        if tensors:
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / SCALES),
                      metadata={"format": "pt"})
            written.append(out / SCALES)
    return VllmExport(out, tuple(sorted(written)), tuple(sorted(linked)), plan, command)


def _own_files(model: ModelDir | None) -> tuple[str, ...]:
    names = [SUMMARY, SCALES, OVERLAY_CONFIG, "config.json", INDEX]
    if model is not None:
        names += [x.name for x in model.path.iterdir() if x.is_file()]
    return tuple(dict.fromkeys(names))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def import_vllm(path: str | os.PathLike[str]) -> CacheConfig:
    """The kverr config a vLLM export serves (a model directory, an overlay, or a ``config.json``
    holding a compressed-tensors ``kv_cache_scheme``); scales are not part of a config."""
    from kverr.quant.formats import float_format

    p = Path(path)
    summary = json.loads((p / SUMMARY).read_text()) if p.is_dir() and (p / SUMMARY).is_file() else {}
    dtype = summary.get("kv_cache_dtype")
    skip = [int(x) for x in summary.get("kv_cache_dtype_skip_layers", [])]
    fp16 = float_format("fp16")
    if dtype == "auto":
        return CacheConfig(k=fp16, v=fp16)
    if dtype is not None and dtype != "fp8":
        names = [n for n, d in _DTYPE_OF_PRESET.items() if d == dtype]
        if not names:
            raise ConfigError(f"{p}: --kv-cache-dtype {dtype!r} is not one kverr models")
        base = PRESETS[names[0]]
        return base.with_(name=None, layers={**base.layers, **{l: base.layers.get(l, _float_override(fp16)) for l in skip}})
    if p.is_dir():
        cfg_file = p / OVERLAY_CONFIG if (p / OVERLAY_CONFIG).is_file() else p / "config.json"
    else:
        cfg_file = p
    obj = json.loads(cfg_file.read_text())
    qc = obj if "kv_cache_scheme" in obj else obj.get("quantization_config", {})
    sch = qc.get("kv_cache_scheme")
    if not sch or sch.get("type") != "float" or sch.get("num_bits") != 8 or sch.get("dynamic"):
        raise ConfigError(f"{p}: kv_cache_scheme {sch!r} is not a static fp8 scheme kverr reads")
    strat = {"tensor": PerTensor(), "attn_head": PerHead()}.get(sch.get("strategy"))
    if strat is None:
        raise ConfigError(f"{p}: strategy {sch.get('strategy')!r} is not allowed; 'tensor' or 'attn_head'")
    f = fp8_format(strat)
    return CacheConfig(k=f, v=f, layers={l: _float_override(fp16) for l in skip})


def _float_override(fmt: QuantFormat):
    from kverr.config import Override

    return Override(k=fmt, v=fmt)
