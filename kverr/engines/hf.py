"""transformers' ``QuantizedCache``: its backends as kverr configs, and the export it runs.

``model.generate(..., cache_implementation="quantized", cache_config={...})`` builds
``transformers.cache_utils.QuantizedCache`` (transformers 5.24) with one of three backends,
lowercase: ``"quanto"``, ``"hqq"`` or ``"fp8"``. What each stores, read from the code it runs
(optimum-quanto 0.2.7, hqq 0.2.8) and pinned by ``tests/engines/test_hf.py``:

``quanto`` (``QuantoQuantizedLayer``: ``optimum.quanto.MaxOptimizer`` + ``quantize_weight``), 2 or 4 bits
    ``axis 0`` groups ``q_group_size`` consecutive elements of the flattened ``[batch, head,
    token, channel]`` tensor: channels of one token when the group divides the head dim, i.e.
    kverr's ``PerTokenGroup(q_group_size)``. Per group ``s = (max - min) / (2**b - 1)`` and a
    shift ``-min``, both in the model's dtype, round to nearest; codes
    ``clamp(rint((x + shift) / s), 0, 2**b - 1)`` (half to even), ``x_hat = s * u - shift``.
    In an fp32 model this is kverr's asymmetric min/max format with fp32 scales and
    ``scale_rounding="nearest"``, operation for operation: the presets reproduce quanto's codes,
    scales, zero points and values bit for bit. With kverr's default ``"outward"`` scale rounding
    (``int4-token-g64``) the scale is rounded up instead, within 3·2⁻²³ of quanto's (codes
    identical on the bundled model's keys and values). In an fp16 or
    bf16 model quanto does ``x - min`` and the division in that dtype, kverr in fp32: codes can
    differ next to rounding ties. ``axis -1`` groups ``q_group_size`` consecutive rows of the
    flattened ``[batch · head · token]`` axis, one channel: across heads unless the token count
    is a multiple of the group, and it raises unless ``batch · head · tokens`` is one at every
    quantization; kverr's ``PerChannel(tokens)`` (blocks from the first token of each head, a
    partial block kept in full precision) is not that, and is refused.
``hqq`` (``HQQQuantizedLayer``: ``hqq.core.quantize.Quantizer.quantize``), 1, 2, 3, 4 or 8 bits
    ``axis 1`` groups ``q_group_size`` consecutive elements (channels of one token, like quanto's
    axis 0); ``axis 0`` reshapes the flattened tensor to ``[q_group_size, N / q_group_size]`` and
    groups its *columns*: elements ``N / q_group_size`` apart in memory, one channel of tokens
    spread over the whole cache, regrouped whenever the cache grows. kverr has no such block and
    never exports to it. The step is ``(max - min) / L`` (through its inverse, fp32) but the zero
    point is not ``-min``: transformers calls ``Quantizer.quantize`` with ``optimize=True``, whose
    proximal solver (``optimize_weights_proximal_legacy``: up to 20 iterations, l_0.7 shrinkage,
    stopping when the mean |error| of the *whole* tensor stops falling) moves every group's
    zero point to a real number, so a group's codes depend on the other groups too; scale and
    zero are then cast to the model's dtype, ``x_hat = (u - zero) * scale``. kverr's nearest
    config is min/max with the same groups: on the bundled model's keys and values its values
    stay within one step of HQQ's and HQQ's squared error is 0.8-1.0 of kverr's at 8 bits
    (measured by ``tests/engines/test_hf.py::test_hqq_is_min_max_step_with_an_optimized_zero``).
    In transformers 5.24, 3-bit HQQ fails with axis 1 (``Quantizer.dequantize`` keeps
    ``shape[0] * shape[1] // group`` rows of the unpacked codes, too few for a 4-d cache) and
    kverr has no 1-bit codes, so only 8 bits is listed: at 2 and 4 bits the nearest kverr config
    is quanto's, exact where HQQ's is not.
``fp8`` (``Fp8QuantizedLayer``), no options
    e4m3 with one fp32 scale per layer over batch, heads, tokens and channels,
    ``max(amax / 448, 2⁻¹²⁶)`` (fp32, round to nearest: kverr's ``scale_rounding="nearest"`` with
    ``scale_floor=2⁻¹²⁶``) of the *first* update, the prefill, frozen: later tokens are
    cast with it (``(x / s).to(float8_e4m3fn)``, no clamp; torch's CPU cast saturates values
    beyond ±448 to ±448, so a decode token larger than the prefill's amax is clipped to
    ``±448 s``). No residual buffer: every token is stored in fp8, the current one included.
    ``QuantizedCache`` refuses any group-wise option with this backend. kverr's ``PerTensor`` fp8
    with a static scale is this format; given the prefill's scale the oracle reproduces every
    stored value bit for bit. A kverr config cannot say "the scale of the prefill": its static
    scale is taken over every token it quantizes (the calibrated scale of vLLM's cache), so it
    never clips a decode token. The difference is measured by
    ``tests/engines/test_hf.py::test_fp8_frozen_prefill_scale_against_kverr``.

The residual buffer is not kverr's window. ``QuantizedLayer.update`` quantizes the whole prefill
at once (no token kept in full precision; kverr's ``evaluate`` mirrors this with
``prefill_policy="all"``), then appends decode tokens to a full-precision buffer; when the buffer
and the new token reach ``residual_length = R`` tokens, it quantizes the *whole* cache again,
the already quantized tokens from their dequantized values, and empties the buffer. So decode
step ``n`` (``n = 1, 2, ...``) attends over ``(n - 1) mod R`` buffered tokens plus the current
one in full precision, between 1 and ``R``, ``(R + 1) / 2`` on average, and everything older
quantized. kverr's ``window = W`` keeps the ``W`` most recent tokens in full precision at every
step. The presets and the export take ``window = R``, the buffer's largest extent: the memory a
cache must hold room for, and what an export round-trips; kverr's quality is then that of the
buffer just before a flush. Re-quantizing quanto's own values keeps every code (min/max of a
dequantized group is that group's grid again) and moves values by a few fp32 ulps.

All three keep one format for keys and values of every layer and head, no sink tokens, keys after
RoPE, and their full-precision tokens and integer scales in the model's dtype. The presets assume
the fp32 model kverr runs by default (``scale_dtype`` and ``window_dtype`` ``"fp32"``); for a
half-precision model use ``config.with_`` with its dtype.

The export writes ``generation_config.json`` with ``cache_implementation="quantized"`` and the
``cache_config`` transformers passes to ``QuantizedCache``, all or nothing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kverr.config import CacheConfig
from kverr.engines.common import common_refusals, formats_of, refuse, shape_of, uniform, write_folder
from kverr.exceptions import ConfigError
from kverr.quant.formats import AbsMax, PerTensor, PerToken, PerTokenGroup, QuantFormat, fp8_format, int_format

#: The files the export writes (an existing folder holding only these may be overwritten).
FILES = ("generation_config.json",)

TARGET = "transformers' QuantizedCache"

#: ``QuantizedLayer``'s defaults (transformers 5.24), which the presets follow.
DEFAULT_GROUP, DEFAULT_RESIDUAL = 64, 128

#: Integer bit widths each integer backend runs, and the axis that groups channels of one token.
QUANTO_BITS, HQQ_BITS = (2, 4), (8,)
TOKEN_AXIS = {"quanto": 0, "hqq": 1}


#: ``Fp8QuantizedLayer``'s scale floor, ``torch.finfo(torch.float32).tiny``.
FP8_SCALE_FLOOR = 2.0**-126


def _int_preset(name: str, bits: int) -> CacheConfig:
    f = replace(int_format(bits, PerTokenGroup(DEFAULT_GROUP), scale_dtype="fp32"), scale_rounding="nearest")
    return CacheConfig(k=f, v=f, window=DEFAULT_RESIDUAL, window_dtype="fp32", name=name)


def _fp8_preset(name: str) -> CacheConfig:
    f = replace(fp8_format(PerTensor(), scale_dtype="fp32"), scale_rounding="nearest", scale_floor=FP8_SCALE_FLOOR)
    return CacheConfig(k=f, v=f, window=0, window_dtype="fp32", name=name)


#: This engine's cache formats as kverr configs, by name (see :func:`kverr.engines.engine_presets`).
PRESETS: dict[str, CacheConfig] = {
    # QuantizedCache(backend="quanto", nbits=4): QuantoQuantizedLayer, optimum.quanto MaxOptimizer
    # (min/max per 64 channels of a token, axis 0) + quantize_weight (qint4, shift -min); scale
    # (max - min) / 15 rounded to nearest. Bit for bit in an fp32 model; the residual buffer of
    # 128 tokens as window=128 (see the module docs).
    "hf-quanto-int4": _int_preset("hf-quanto-int4", 4),
    # The same at nbits=2 (qint2).
    "hf-quanto-int2": _int_preset("hf-quanto-int2", 2),
    # QuantizedCache(backend="hqq", nbits=8, axis_key=1, axis_value=1): HQQQuantizedLayer,
    # hqq.core.quantize.Quantizer.quantize with optimize=True. Same groups and step as min/max
    # (to a few fp32 roundings); HQQ's proximal zero-point search is not a kverr format, so this
    # is the nearest config.
    "hf-hqq-int8": _int_preset("hf-hqq-int8", 8),
    # QuantizedCache(backend="fp8"): Fp8QuantizedLayer, e4m3, one fp32 max(amax/448, tiny) scale
    # per layer, rounded to nearest. transformers freezes the prefill's scale (clipping larger
    # decode tokens); kverr's static scale spans every token. No residual buffer: window=0.
    "hf-fp8": _fp8_preset("hf-fp8"),
}


def _fp8_problems(config: CacheConfig, fk: QuantFormat, fv: QuantFormat) -> list[str]:
    p = []
    for w, f in (("keys", fk), ("values", fv)):
        if not f.is_fp8:
            p.append(f"{w} {f.label()}: the fp8 backend stores both keys and values in fp8")
            continue
        if f.dtype != "fp8_e4m3":
            p.append(f"{w} {f.label()}: the fp8 backend stores e4m3")
        if not isinstance(f.granularity, PerTensor):
            p.append(f"{w} {f.label()}: '{f.granularity.kind}' scales (the fp8 backend keeps one scale "
                     "per layer over all heads and tokens, 'tensor')")
        if f.scale_dtype != "fp32":
            p.append(f"{w} {f.label()}: scale_dtype={f.scale_dtype} (the fp8 backend's scale is fp32)")
        if not isinstance(f.clip, AbsMax):
            p.append(f"{w} {f.label()}: '{f.clip.kind}' clipping (the fp8 backend scales by amax)")
        if f.rotate != "none":
            p.append(f"{w} {f.label()}: Hadamard rotation")
        if f.scale_floor not in (0.0, FP8_SCALE_FLOOR):
            p.append(f"{w} {f.label()}: scale_floor={f.scale_floor:g} (the fp8 backend's floor is 2^-126)")
        if f.reciprocal:
            p.append(f"{w} {f.label()}: reciprocal encoding (the fp8 backend divides by the scale)")
    if config.window:
        p.append(f"window={config.window} (the fp8 backend keeps no token in full precision)")
    return p


def _int_problems(config: CacheConfig, fk: QuantFormat, fv: QuantFormat,
                  head_dim: int | None) -> tuple[list[str], dict[str, int]]:
    p, groups = [], {}
    for w, f in (("keys", fk), ("values", fv)):
        if f.dtype != "int":
            p.append(f"{w} {f.label()}: QuantizedCache stores integer codes, or fp8 for keys and values both")
            continue
        if f.symmetric:
            p.append(f"{w} {f.label()}: symmetric codes (QuantizedCache uses a zero point)")
        g = f.granularity
        if isinstance(g, PerTokenGroup):
            groups[w] = g.group
            if head_dim and head_dim % g.group:
                p.append(f"{w} {f.label()}: group {g.group} does not divide the head dim {head_dim}")
        elif isinstance(g, PerToken) and head_dim:
            groups[w] = head_dim
        elif isinstance(g, PerToken):
            p.append(f"{w} {f.label()}: per-token scales need the head dim (pass head_dim)")
        else:
            p.append(f"{w} {f.label()}: '{g.kind}' scales (QuantizedCache groups channels of one token "
                     "exactly only: quanto's axis -1 groups rows across heads, hqq's axis 0 strided elements)")
        if f.rotate != "none":
            p.append(f"{w} {f.label()}: Hadamard rotation")
        if not isinstance(f.clip, AbsMax):
            p.append(f"{w} {f.label()}: '{f.clip.kind}' clipping (QuantizedCache uses min/max)")
        if f.rounding != "half_even":
            p.append(f"{w} {f.label()}: rounding={f.rounding} (QuantizedCache rounds half to even)")
        if f.scale_floor:
            p.append(f"{w} {f.label()}: scale_floor={f.scale_floor:g} (quanto and hqq have none)")
        if f.reciprocal:
            p.append(f"{w} {f.label()}: reciprocal encoding (quanto divides by the scale)")
        if f.scale_dtype != config.window_dtype:
            p.append(f"{w} {f.label()}: scale_dtype={f.scale_dtype} but window_dtype={config.window_dtype} "
                     "(QuantizedCache keeps both its scales and its residual tokens in the model's dtype)")
    if fk.dtype == "int" and fv.dtype == "int":
        if fk.bits != fv.bits:
            p.append(f"keys at {fk.bits} bits and values at {fv.bits} bits (one nbits for both)")
        elif fk.bits not in QUANTO_BITS + HQQ_BITS:
            p.append(f"{fk.bits}-bit codes (quanto stores 2 or 4 bits; transformers 5.24's hqq backend fails "
                     "to dequantize 3-bit codes grouped per token, axis 1)")
    if len(set(groups.values())) > 1:
        p.append(f"key group {groups.get('keys')} and value group {groups.get('values')} differ (one q_group_size)")
    return p, groups


def check_hf(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None,
             head_dim: int | None = None) -> dict[str, Any]:
    """The ``cache_config`` of transformers' ``QuantizedCache`` for ``config``, or raise ConfigError.

    fp8 e4m3 ``tensor`` scales in fp32 and no window: backend ``"fp8"`` (no other option: the
    backend refuses them). Asymmetric min/max integers per token (or group of channels of a
    token): 2 or 4 bits to ``"quanto"`` axis 0, 8 bits to ``"hqq"`` axis 1, with
    ``residual_length = window``. Anything else is refused with the list of what cannot be expressed.

    Both scale roundings are accepted: the backends round to nearest (``scale_rounding="nearest"``,
    bit for bit for quanto and fp8); kverr's default rounds outward, a few fp32 ulps apart.
    """
    n_layers, n_kv = shape_of(config, n_layers, n_kv)
    fk, fv, p = uniform(formats_of(config, n_layers, n_kv), TARGET)
    p += common_refusals(config, "QuantizedCache")
    if fk.is_fp8 or fv.is_fp8:
        refuse(TARGET, p + _fp8_problems(config, fk, fv))
        return {"backend": "fp8"}
    problems, groups = _int_problems(config, fk, fv, head_dim)
    refuse(TARGET, p + problems)
    backend = "quanto" if fk.bits in QUANTO_BITS else "hqq"
    axis = TOKEN_AXIS[backend]
    return {"backend": backend, "nbits": fk.bits, "axis_key": axis, "axis_value": axis,
            "q_group_size": next(iter(groups.values())), "residual_length": config.window}


def export_hf(config: CacheConfig, out: str | Path, *, n_layers: int | None = None,
              n_kv: int | None = None, head_dim: int | None = None, overwrite: bool = False) -> list[Path]:
    """Write ``generation_config.json`` for ``model.generate(..., cache_implementation='quantized')``
    into the folder ``out``, all or nothing (as :func:`export_vllm`).

    Beside ``cache_config`` a ``kverr`` entry records the config's name, the dtypes the model must
    run in for the numbers to match (``scale_dtype``, ``window_dtype``; :func:`import_hf` reads
    them back) and how the backend's numbers differ from kverr's oracle.
    """
    cc = check_hf(config, n_layers, n_kv, head_dim)
    note = {
        "quanto": "min/max as kverr's oracle (quanto rounds the scale to nearest, kverr up); scales in "
                  "the model's dtype; the residual buffer flushes every residual_length tokens",
        "hqq": "min/max step, but HQQ optimizes each zero point (kverr's is the group minimum); scales in "
               "the model's dtype; the residual buffer flushes every residual_length tokens",
        "fp8": "the scale is frozen at the prefill's amax/448 and larger decode tokens are clipped; "
               "kverr's static scale spans every token",
    }[cc["backend"]]
    body = {"cache_implementation": "quantized", "cache_config": cc,
            "kverr": {"config": config.name, "scale_dtype": config.k.scale_dtype,
                      "scale_rounding": config.k.scale_rounding, "scale_floor": config.k.scale_floor,
                      "window_dtype": config.window_dtype,
                      "note": note}}
    return write_folder(out, {"generation_config.json": json.dumps(body, indent=2) + "\n"},
                         overwrite=overwrite, own_files=FILES)


def import_hf(path: str | Path, *, scale_dtype: str = "fp16") -> CacheConfig:
    """A kverr config from an hf export (or any JSON object with ``cache_config``).

    ``scale_dtype``: the model's dtype, for integer scales and the residual tokens, unless the
    file's ``kverr`` entry (written by :func:`export_hf`) records them. Scales round to nearest,
    as the backends do, unless that entry says otherwise.
    """
    p = Path(path)
    obj = json.loads((p / "generation_config.json" if p.is_dir() else p).read_text())
    cc = obj.get("cache_config", obj)
    meta = obj.get("kverr") or {}
    sdt = meta.get("scale_dtype", scale_dtype)
    wdt = meta.get("window_dtype", sdt)
    rounding = meta.get("scale_rounding", "nearest")
    backend = cc.get("backend", "quanto")  # generate's default
    if backend == "fp8":
        extra = sorted(set(cc) - {"backend"})
        if extra:
            raise ConfigError(f"{p}: the fp8 backend takes no {', '.join(extra)}")
        f = fp8_format(PerTensor(), scale_dtype="fp32")
        floor = meta.get("scale_floor", FP8_SCALE_FLOOR if rounding == "nearest" else 0.0)
        f = replace(f, scale_rounding=rounding, scale_floor=floor)
        return CacheConfig(k=f, v=f, window=0, window_dtype=wdt)
    if backend not in TOKEN_AXIS:
        raise ConfigError(f"{p}: backend {backend!r} is not one of 'quanto', 'hqq', 'fp8' (lowercase)")
    try:
        nbits, g = int(cc.get("nbits", 4)), int(cc.get("q_group_size", DEFAULT_GROUP))
        r = int(cc.get("residual_length", DEFAULT_RESIDUAL))
    except (TypeError, ValueError):
        raise ConfigError(f"{p}: cache_config's nbits, q_group_size and residual_length must be integers") from None
    axis = TOKEN_AXIS[backend]
    if cc.get("axis_key", 0) != axis or cc.get("axis_value", 0) != axis:
        raise ConfigError(f"{p}: only {backend}'s axis {axis} (groups of channels of one token) is a kverr "
                          "format; quanto's axis -1 and hqq's axis 0 group across heads and tokens")
    try:
        f = replace(int_format(nbits, PerTokenGroup(g), scale_dtype=sdt), scale_rounding=rounding)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    return CacheConfig(k=f, v=f, window=r, window_dtype=wdt)
