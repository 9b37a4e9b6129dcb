"""What a cache format does to the model's real output, side by side with today's formats.

Protocol (:func:`evaluate`), for every text segment and prefill length ``P``:

1. prefill ``P`` tokens of real text into the cache (their own attention uses fresh values, as
   in a serving engine); then, by default, quantize everything the cache holds
   (``prefill_policy="all"``: the window applies to decode tokens only, which is what
   transformers' quantized cache does); ``"window"`` keeps the config's window instead;
2. teacher-forced decode ``N`` tokens one at a time through the cache;
3. compare each step's next-token distribution with the same model and an unquantized cache:
   KL(p_ref ‖ p), top-1 agreement, negative log-likelihood of the true next token;
4. greedy generation of ``N`` tokens from the same prompt, with and without quantization: the
   first step at which the tokens differ (the number of greedy steps when they never do).

Schemes: every kverr config (presets or JSON files), and the peers — transformers'
``QuantizedCache`` with the quanto backend (``quanto-int4``, ``quanto-int2``: group 64,
residual 128) and the vLLM cache dtypes kverr's formats cannot express, emulated
(:data:`EMULATED`, :mod:`kverr.engines.emulated`) — each at its effective bits including metadata.

Static scales (per tensor or per kv head, over all tokens): by default the cache takes them from
the first chunk it quantizes, the prefill (``scales="prefill"``). A deployed engine uses scales
fixed beforehand instead: vLLM's ``--kv-cache-dtype fp8`` reads them from the checkpoint
(``model.layers.{i}.self_attn.{k,v}_scale``, float32 ``[1]`` per tensor or ``[n_kv_heads]`` per
kv head, as :func:`kverr.engines.vllm.export_vllm` writes them) and uses 1.0 without them. A
scheme's ``scales`` gives them (:func:`read_scales`): a vLLM export directory or a safetensors
file holding those names, or ``"unit"`` (every scale 1.0).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kverr.config import CacheConfig, named_presets, resolve
from kverr.engines.emulated import emulated_peers
from kverr.exceptions import ConfigError, NonFiniteError, ShapeError, TextError
from kverr.memory import MemoryReport, ModelShape, account
from kverr.quant import PerHead, PerTensor, PerTokenGroup, int_format

log = logging.getLogger(__name__)

PEERS = {"quanto-int4": 4, "quanto-int2": 2}
#: Peers kverr's formats cannot express, emulated by a cache of their own: vLLM's
#: ``int4_per_token_head`` and Lloyd-Max TurboQuant dtypes (:mod:`kverr.engines.emulated`).
EMULATED = tuple(emulated_peers())
QUANTO_GROUP, QUANTO_RESIDUAL = 64, 128

#: ``scales`` values that are not files: every static scale 1.0 (what vLLM uses when the
#: checkpoint has none), or the first chunk's (the prefill's) scales, the cache's default.
UNIT_SCALES, PREFILL_SCALES = "unit", "prefill"


@dataclass(frozen=True)
class Scheme:
    """A cache to evaluate: a kverr config, a quanto peer, or the unquantized reference."""

    name: str
    kind: str  # "kverr" | "quanto" | "emulated" | "reference"
    config: CacheConfig | None = None
    nbits: int | None = None
    #: static scales: None or "prefill" (the first chunk's), "unit", or a vLLM export directory
    #: or safetensors file (:func:`read_scales`)
    scales: str | None = None
    #: an emulated peer fitted offline: the calibration capture it fits to
    calibration: str | None = None
    #: a kverr config whose per-channel widths are refit on every prompt before it is quantized
    #: (:func:`kverr.calibration.refit.refit_widths`; the widths stored per sequence are counted)
    refit: bool = False

    def equivalent_config(self, model_dtype: torch.dtype, n_layers: int | None = None,
                          head_dim: int | None = None) -> CacheConfig | None:
        """A kverr config that stores what this scheme stores (for effective bits; an emulated
        peer needs the model's ``n_layers`` and ``head_dim``)."""
        if self.kind == "kverr":
            return self.config
        if self.kind == "quanto":
            # quanto keeps scale and shift in the model's dtype, per 64 channels of a token.
            sdt = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model_dtype, "fp32")
            fmt = int_format(self.nbits, PerTokenGroup(QUANTO_GROUP), scale_dtype=sdt)
            return CacheConfig(k=fmt, v=fmt, window=QUANTO_RESIDUAL, name=self.name)
        if self.kind == "emulated":
            peer = emulated_peers()[self.name]
            if peer.equivalent is None:
                return None  # it counts its own bytes: account
            if n_layers is None or head_dim is None:
                raise ConfigError(f"{self.name}: its bytes depend on the model's shape; give n_layers and head_dim")
            return peer.equivalent(n_layers, head_dim)
        return None

    def account(self, model_dtype: torch.dtype, shape: ModelShape, tokens: int, **kwargs: Any) -> MemoryReport:
        """The bytes this scheme stores for ``tokens`` tokens of a model of ``shape``
        (:func:`kverr.memory.account` of :meth:`equivalent_config`; an emulated peer's own
        static bytes included)."""
        if self.kind == "emulated":
            return emulated_peers()[self.name].account(shape, tokens, **kwargs)
        rep = account(self.equivalent_config(model_dtype, shape.n_layers, shape.head_dim), shape, tokens, **kwargs)
        if self.refit:
            from kverr.calibration.refit import add_width_tables

            add_width_tables(rep, self.config)
        return rep


def parse_schemes(schemes: Iterable[str] = (), configs: Iterable[str] = (), *,
                  config_option: str | None = "--config",
                  scales: dict[tuple[str, int], str] | None = None, required: bool = True,
                  calibration: str | None = None, refit: bool = False,
                  compensated_keys: bool = False) -> list[Scheme]:
    """``--scheme NAME`` (preset or peer) and ``--config PATH`` -> schemes, in order, no duplicates.

    ``config_option`` is the option that gives config files in the calling command, named in
    error messages; None when the command has none. ``scales`` maps ``("scheme", i)`` or
    ``("config", j)`` (the i-th scheme, the j-th config) to the static scales it is evaluated
    with (see :class:`Scheme`); such a scheme is named ``NAME@SOURCE`` (``SOURCE``: ``unit``,
    ``prefill``, or the file's or directory's name), so that one config with several scales is
    several schemes. ``required=False`` accepts no scheme at all (an empty list). ``calibration``
    is the capture emulated peers fitted offline fit to; naming one without it is an error.
    ``refit`` adds, after every kverr scheme with per-channel widths, the same config with its
    widths refit on each prompt (:attr:`Scheme.refit`), named ``NAME+refit``; it is an error when
    no scheme has per-channel widths. ``compensated_keys`` evaluates every kverr config with
    integer key formats with its keys rounded with compensation instead (``key_rounding``
    ``"compensated"``, :mod:`kverr.quant.compensated`), named ``NAME+ck`` (before any ``+refit``).
    """
    hint = f" (give a config file with {config_option})" if config_option else ""
    named = named_presets()
    out: list[Scheme] = []
    for s in schemes:
        if s in PEERS:
            out.append(Scheme(s, "quanto", nbits=PEERS[s]))
        elif s in EMULATED:
            fitted = emulated_peers()[s].fit is not None
            if fitted and calibration is None:
                raise ConfigError(f"--scheme {s}: it is fitted offline; give the capture to fit it to "
                                  "with --calibration (the one kverr's configs were calibrated on)")
            out.append(Scheme(s, "emulated", calibration=calibration if fitted else None))
        elif s in named:
            out.append(Scheme(s, "kverr", named[s]))
        else:
            raise ConfigError(
                f"--scheme {s!r} is not known; schemes: {', '.join([*named, *PEERS, *EMULATED])}{hint}"
            )
    n_named = len(out)
    for path in configs:
        cfg = resolve(path)
        out.append(Scheme(cfg.name or Path(path).stem, "kverr", cfg))
    for (what, i), source in (scales or {}).items():
        j = i if what == "scheme" else n_named + i
        if what not in ("scheme", "config") or not 0 <= j < len(out):
            raise ConfigError(f"--scales for {what} {i}: no such --{what}")
        s = out[j]
        if s.kind != "kverr":
            raise ConfigError(f"--scales {source}: {s.name} is a peer; scales are given to kverr configs")
        out[j] = replace(s, name=f"{s.name}@{scales_label(source)}", scales=str(source))
    if compensated_keys:
        from kverr.quant.compensated import compensable

        changed = [sch.kind == "kverr" and any(compensable(f) for w, f in sch.config._all_formats() if w.endswith("k"))
                   for sch in out]
        if not any(changed):
            raise ConfigError("--compensated-keys: no scheme stores keys in an integer format to round with compensation")
        out = [replace(sch, name=f"{sch.name}+ck", config=sch.config.with_(key_rounding="compensated")) if c else sch
               for sch, c in zip(out, changed)]
    if refit:
        from kverr.calibration.refit import has_channel_widths

        with_refit = []
        for sch in out:
            with_refit.append(sch)
            if sch.kind == "kverr" and has_channel_widths(sch.config):
                with_refit.append(replace(sch, name=f"{sch.name}+refit", refit=True))
        if len(with_refit) == len(out):
            raise ConfigError("--refit-widths: no scheme has per-channel widths (channel_bits) to refit")
        out = with_refit
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"scheme {sorted(dup)[0]!r} is given twice")
    if not out and required:
        raise ConfigError(f"give at least one --scheme{' or ' + config_option if config_option else ''}")
    return out


def scales_label(source: str | os.PathLike[str]) -> str:
    """How a scale source names a scheme: ``unit``, ``prefill``, or the file's or directory's
    name (a file in a directory named by the directory: an export's ``kv_scales.safetensors``)."""
    s = str(source)
    if s in (UNIT_SCALES, PREFILL_SCALES):
        return s
    p = Path(s)
    from kverr.engines.vllm import SCALES

    if p.name == SCALES and p.parent.name:
        return p.parent.name
    return p.name if p.is_dir() else p.stem  # a directory's name may hold dots (vllm-8.05b)


def _static_layers(config: CacheConfig, n_layers: int, n_kv: int, what: str) -> dict[tuple[int, str], tuple[int, ...]]:
    """``(layer, side) -> the scale shape vLLM loads`` for every layer and side that ``config``
    stores with static scales; refuses what a per-tensor/per-head scale file cannot give."""
    from kverr.config import WHICH

    need = {}
    for layer in range(n_layers):
        for w in WHICH:
            groups = [(f, h) for f, h in config.head_groups(layer, n_kv, w) if not f.is_float]
            static = [f for f, _ in groups if f.takes_static_scales]
            if not static:
                continue
            side = "keys" if w == "k" else "values"
            if len(groups) > 1:
                raise ConfigError(f"{what}: layer {layer} stores {side} in {len(groups)} head groups (formats or window "
                                  "lengths) across its kv heads; given scales are one per layer or per kv head of one group")
            f = static[0]
            if not isinstance(f.granularity, (PerTensor, PerHead)):
                raise ConfigError(f"{what}: layer {layer} {side} use {f.granularity.kind} static scales; given "
                                  "scales are per tensor or per kv head")
            if f.has_zero:
                raise ConfigError(f"{what}: layer {layer} {side} use the asymmetric {f.label()}; given scales "
                                  "are for symmetric formats (no zero point)")
            need[(layer, w)] = (1,) if isinstance(f.granularity, PerTensor) else (n_kv,)
    if not need:
        raise ConfigError(f"{what}: {config.name or 'the config'} has no static per-tensor or per-head scales "
                          "to give")
    return need


def read_scales(source: str | os.PathLike[str], config: CacheConfig, n_layers: int,
                n_kv: int) -> dict[int, dict[str, tuple[torch.Tensor, None]]] | None:
    """The static scales ``source`` gives ``config``, as :class:`kverr.hf.KverrCache` takes them
    (``{layer: {"k": (scale, None), "v": ...}}``, per tensor ``[1, 1, 1]``, per kv head
    ``[n_kv, 1, 1]``), or None for ``"prefill"`` (the cache's default).

    ``source``: ``"unit"`` (every scale 1.0), or a vLLM export directory (its
    ``kv_scales.safetensors``) or a safetensors file holding ``model.layers.{i}.self_attn.k_scale``
    and ``v_scale`` for every layer and side ``config`` stores with static scales, of shape ``[1]``
    (per tensor) or ``[n_kv]`` (per kv head), positive and finite, as vLLM loads them. Scales of
    layers the config keeps in a float format are not used; other tensors are ignored.

    Raises
    ------
    ConfigError
        The config has no static per-tensor/per-head scales, or uses per-channel or asymmetric
        static scales; the file is missing or not safetensors; a scale is missing, for a layer
        the model does not have, or not positive.
    ShapeError
        A scale's shape is not ``[1]`` or ``[n_kv]`` as the config's granularity needs.
    NonFiniteError
        A scale is NaN or infinite.
    """
    src = str(source)
    what = f"--scales {src}"
    need = _static_layers(config, n_layers, n_kv, what)
    if src == PREFILL_SCALES:
        return None
    if src == UNIT_SCALES:
        got = {key: torch.ones(shape) for key, shape in need.items()}
    else:
        got = _read_scale_file(Path(src).expanduser(), what, n_layers)
    from kverr.engines.vllm import scale_name

    out: dict[int, dict[str, tuple[torch.Tensor, None]]] = {}
    for (layer, w), shape in need.items():
        name = scale_name(layer, w)
        if (layer, w) not in got:
            raise ConfigError(f"{what}: no {name} (layer {layer} stores {'keys' if w == 'k' else 'values'} "
                              f"with static scales; expected shape {list(shape)})")
        t = got[(layer, w)]
        if tuple(t.shape) != shape:
            kind = "per tensor" if shape == (1,) else "per kv head"
            raise ShapeError(f"{what}: {name} has shape {list(t.shape)}, expected {list(shape)} ({kind})")
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{what}: {name} holds NaN or Inf; scales must be positive and finite")
        if bool((t <= 0).any()):
            raise ConfigError(f"{what}: {name} holds {float(t.min()):g}; scales must be positive and finite")
        out.setdefault(layer, {})[w] = (t.reshape(-1, 1, 1).clone(), None)
    return out


def _read_scale_file(path: Path, what: str, n_layers: int) -> dict[tuple[int, str], torch.Tensor]:
    """``(layer, side) -> float32 scale`` of every vLLM kv-scale name in a safetensors file."""
    from kverr.engines.vllm import SCALE_NAME, SCALES

    file = path / SCALES if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{what}: no such file" + (f" (a directory without {SCALES})" if path.is_dir() else "")
                          + "; give 'unit', 'prefill', a vLLM export directory or a safetensors file")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{what}: {file} is not a readable safetensors file ({exc})") from None
    got = {}
    for name, t in tensors.items():
        m = SCALE_NAME.fullmatch(name)
        if m is None:
            continue
        layer = int(m.group(1))
        if layer >= n_layers:
            raise ConfigError(f"{what}: {name} is for layer {layer}; the model has {n_layers} layers")
        if not t.is_floating_point():
            raise ConfigError(f"{what}: {name} is {t.dtype}, not a float")
        got[(layer, m.group(2))] = t.to(torch.float32)
    return got


def _scales_column(scheme: Scheme) -> str:
    """Where a scheme's static scales came from (empty when it has none)."""
    if scheme.scales is not None:
        return scheme.scales
    static = scheme.config is not None and any(
        f.takes_static_scales for _, f in scheme.config._all_formats())
    return PREFILL_SCALES if static else ""


def make_cache(scheme: Scheme, model: Any, static_scales: dict | None = None) -> Any:
    """A fresh cache object for ``scheme``; ``static_scales`` as :func:`read_scales` gives them."""
    if scheme.kind == "kverr":
        from kverr.hf import cache_for

        if static_scales is not None:  # given scales: the reference cache, which takes them per layer
            return cache_for(model, scheme.config, backend="reference", static_scales=static_scales)
        return cache_for(model, scheme.config)  # the kernel path on a GPU, the reference on a CPU
    from transformers import DynamicCache

    if scheme.kind == "reference":
        return DynamicCache()
    if scheme.kind == "emulated":
        return emulated_peers()[scheme.name].cache(model, scheme.calibration)
    from transformers import QuantizedCache

    return QuantizedCache(
        backend="quanto",
        config=model.config,
        nbits=scheme.nbits,
        axis_key=0,
        axis_value=0,
        q_group_size=QUANTO_GROUP,
        residual_length=QUANTO_RESIDUAL,
    )


@torch.no_grad()
def teacher_forced(model: Any, cache: Any, ids: torch.Tensor, prefill: int, *, flush: bool) -> torch.Tensor:
    """Log-probabilities of the decode steps: ``[N, vocab]`` float64 for ``ids [prefill + N + 1]``.

    Decode step ``t`` feeds ``ids[prefill + t]`` and predicts ``ids[prefill + t + 1]``. The
    prefill's own prediction is not a decode step (its attention used fresh values) and is left out.
    """
    from kverr.hf import cache_kwarg

    kw = cache_kwarg(model)
    model(ids[None, :prefill], use_cache=True, **{kw: cache})
    if flush and hasattr(cache, "flush"):
        cache.flush()
    rows = []
    for t in range(prefill, ids.shape[0] - 1):
        out = model(ids[None, t : t + 1], use_cache=True, **{kw: cache})
        rows.append(torch.log_softmax(out.logits[0, -1].double(), -1))
    return torch.stack(rows)


@torch.no_grad()
def greedy(model: Any, cache: Any, prompt: torch.Tensor, steps: int, *, flush: bool) -> list[int]:
    """Greedy continuation of ``prompt`` for ``steps`` tokens through ``cache``."""
    from kverr.hf import cache_kwarg

    kw = cache_kwarg(model)
    out = model(prompt[None], use_cache=True, **{kw: cache})
    if flush and hasattr(cache, "flush"):
        cache.flush()
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]], device=prompt.device), use_cache=True, **{kw: cache})
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def next_token_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``KL(reference || logp)`` of every decode step, ``[N]``, from log-probs ``[N, vocab]``
    (clamped at 0: a float sum of a distribution against itself can round below it)."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0.0)


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Metrics of decode log-probs ``logp`` against the reference, ``[N, vocab]`` each."""
    kl = next_token_kl(ref_logp, logp).numpy()
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1).numpy()
    ref_nll = -ref_logp.gather(-1, targets[:, None]).squeeze(-1).numpy()
    return {
        "mean_kl": float(kl.mean()),
        "p50_kl": float(np.percentile(kl, 50)),
        "p99_kl": float(np.percentile(kl, 99)),
        "max_kl": float(kl.max()),
        "top1": float((logp.argmax(-1) == ref_logp.argmax(-1)).double().mean()),
        "ppl": float(math.exp(nll.mean())),
        "ppl_ref": float(math.exp(ref_nll.mean())),
    }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token, or -1 if the sequences agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1


def segment_offsets(start: int, n_segments: int, length: int) -> list[int]:
    """Token offsets of ``n_segments`` disjoint segments of ``length`` tokens from ``start``."""
    return [start + i * length for i in range(n_segments)]


def segment_jobs(loaded: Any, text: Any, *, prefill: Sequence[int], decode: int, segments: int,
                 offset: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """The token ids of every (prefill, segment) run of :func:`evaluate`, checked first.

    The text is tokenized once per prefill length and every segment is checked against the
    model's context and the text's length, so that a request that cannot be met fails in
    seconds, before any model work.

    Parameters
    ----------
    loaded
        A :class:`kverr.capturing.LoadedModel` (its tokenizer and context length).
    text
        A :class:`kverr.capturing.Text`.
    prefill, decode, segments, offset
        As in :func:`evaluate`.

    Returns
    -------
    list of tuple
        ``(prefill, segment, offset, ids [prefill + decode + 1])`` per run.

    Raises
    ------
    ConfigError
        ``prefill + decode`` exceeds the model's context.
    TextError
        The text is too short for ``segments`` segments from ``offset``.
    """
    from kverr.capturing.text import tokenize_windows

    for p in prefill:
        if loaded.max_context and p + decode > loaded.max_context:
            raise ConfigError(f"prefill {p} + decode {decode} exceeds the model's context of {loaded.max_context}")
    jobs = []
    for p in prefill:
        length = p + decode + 1
        offsets = segment_offsets(offset, segments, length)
        try:
            windows = tokenize_windows(loaded.tokenizer, text, length, offsets, what="segment")
        except TextError as exc:
            raise TextError(
                f"{segments} segment(s) of prefill {p} + decode {decode} + 1 tokens from offset {offset} "
                f"need {offset + segments * length} tokens: {exc}"
            ) from None
        jobs += [(p, i, off, torch.as_tensor(ids)) for i, (off, ids) in enumerate(zip(offsets, windows))]
    return jobs


def evaluate(
    loaded: Any,
    text: Any,
    schemes: Sequence[Scheme],
    *,
    prefill: Sequence[int] = (1024,),
    decode: int = 128,
    segments: int = 1,
    offset: int = 5000,
    prefill_policy: str = "all",
    greedy_steps: int | None = None,
    progress: bool = True,
    on_row: Any = None,
):
    """Run the protocol; returns a pandas DataFrame, one row per (scheme, prefill, segment).

    Parameters
    ----------
    loaded
        A :class:`kverr.capturing.LoadedModel`.
    text
        A :class:`kverr.capturing.Text`.
    schemes
        What to evaluate (:func:`parse_schemes`).
    prefill
        Prefill lengths ``P`` (context lengths).
    decode
        Teacher-forced decode steps ``N``.
    segments
        Disjoint text segments per prefill length, starting at token ``offset``.
    prefill_policy
        ``"all"`` quantizes everything after prefill; ``"window"`` keeps the config's window.
    greedy_steps
        Greedy steps for the first-divergence metric (default ``decode``; 0 skips it).
    on_row
        Called with the list of rows so far after every (scheme, prefill, segment), so that a
        long run can save what it has measured (the CLI rewrites its per-segment CSV each time).
    """
    import pandas as pd

    from kverr.progress import progress as progress_bar

    if prefill_policy not in ("all", "window"):
        raise ConfigError(f"prefill_policy={prefill_policy!r} is not allowed; 'all' or 'window'")
    if decode < 1 or segments < 1 or any(p < 1 for p in prefill):
        raise ConfigError("prefill, decode and segments must be at least 1")
    model = loaded.model
    shape = loaded.shape
    given: dict[str, dict | None] = {}
    for s in schemes:
        if s.config is not None:
            s.config.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
            if (dict(s.config.provenance).get("capture") or {}).get("weights_sha256"):
                from kverr.config import check_model_matches

                check_model_matches(s.config, loaded.weights_sha256, loaded.model_id)
        if s.calibration is not None:
            _check_calibration(s, loaded)
        if s.scales is not None:
            if s.config is None:
                raise ConfigError(f"{s.name}: scales are given to kverr configs only")
            given[s.name] = read_scales(s.scales, s.config, shape.n_layers, shape.n_kv_heads)
    g_steps = decode if greedy_steps is None else greedy_steps
    jobs = segment_jobs(loaded, text, prefill=prefill, decode=decode, segments=segments, offset=offset)
    flush = prefill_policy == "all"
    reference = Scheme("reference", "reference")
    rows = []
    bar = progress_bar(total=len(jobs) * (len(schemes) + 1), desc="evaluate", enabled=progress, unit="run")
    for p, seg, off, ids in jobs:
        prompt = None  # the prompt's capture, taken once for the schemes that refit on it
        bar.set_postfix_str(f"P={p} seg={seg} reference")
        ref_logp = teacher_forced(model, make_cache(reference, model), ids, p, flush=False)
        ref_greedy = greedy(model, make_cache(reference, model), ids[:p], g_steps, flush=False) if g_steps else []
        bar.update()
        targets = ids[p + 1 :]
        for s in schemes:
            bar.set_postfix_str(f"P={p} seg={seg} {s.name}")
            if s.refit:
                from kverr.calibration.refit import refit_widths
                from kverr.capturing import capture

                if prompt is None:
                    prompt = capture(loaded, ids[:p])
                s = replace(s, config=refit_widths(s.config, prompt))
            cache = make_cache(s, model, given.get(s.name))
            logp = teacher_forced(model, cache, ids, p, flush=flush)
            row = {"scheme": s.name, "kind": s.kind, "prefill": p, "decode": decode, "segment": seg, "offset": off,
                   "scales": _scales_column(s)}
            # What the cache held at the end of this run: the P + N tokens fed, the prefill
            # quantized whole when the run flushed it (teacher_forced flushes caches that can;
            # quanto always quantizes its prefill whole).
            whole = (flush and hasattr(cache, "flush")) or s.kind == "quanto"
            rep = s.account(model.dtype, shape, p + decode, prefill_quantized=p if whole else 0)
            row["effective_bits"] = rep.effective_bits
            row["cache_bytes"] = rep.total_bytes
            if s.kind == "kverr":
                row["measured_cache_bytes"] = cache.nbytes()
            row.update(compare(ref_logp, logp, targets))
            row["ppl_delta"] = row["ppl"] - row["ppl_ref"]
            if g_steps:
                # No divergence within the greedy steps counts as g_steps (a lower bound), so
                # that means over segments stay meaningful.
                div = first_divergence(ref_greedy, greedy(model, make_cache(s, model, given.get(s.name)), ids[:p],
                                                          g_steps, flush=flush))
                row["first_divergence"] = g_steps if div < 0 else div
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            bar.update()
            log.info("%s P=%d seg=%d: mean KL %.4g top-1 %.3f", s.name, p, seg, row["mean_kl"], row["top1"])
    bar.close()
    return pd.DataFrame(rows)


def _check_calibration(scheme: Scheme, loaded: Any) -> None:
    """Refuse a peer fitted to a capture of another model (weights, or layers, kv heads and head
    dim) than the one evaluated."""
    from kverr.io import open_capture

    cap = open_capture(scheme.calibration)
    sha = cap.attrs.get("weights_sha256")
    if sha and loaded.weights_sha256 and sha != loaded.weights_sha256:
        raise ConfigError(f"{scheme.name}: --calibration {scheme.calibration} is a capture of another model "
                          f"({cap.attrs.get('model_id', '?')}) than the one evaluated ({loaded.model_id})")
    shape = loaded.shape
    got = (cap.sizes.get("layer"), cap.sizes.get("kv_head"), cap.sizes.get("channel"))
    if got != (shape.n_layers, shape.n_kv_heads, shape.head_dim):
        raise ConfigError(f"{scheme.name}: --calibration {scheme.calibration} has (layers, kv heads, head dim) "
                          f"{got}; the model evaluated has {(shape.n_layers, shape.n_kv_heads, shape.head_dim)} "
                          "(a peer fits every layer)")


def summarize_schemes(df: Any) -> Any:
    """Mean (and spread over segments: the standard deviation, ``_std``, and the standard error of
    the mean, ``_se``) per (scheme, prefill), ordered by effective bits."""
    metrics = ["effective_bits", "mean_kl", "p50_kl", "p99_kl", "top1", "ppl", "ppl_ref", "ppl_delta"]
    if "first_divergence" in df:
        metrics.append("first_divergence")
    g = df.groupby(["scheme", "prefill"], sort=False)
    out = g[metrics].mean()
    spread = g[["mean_kl", "top1", "ppl_delta"]].std(ddof=0).add_suffix("_std")
    out = out.join(spread)
    out["segments"] = g.size()
    # the standard error of the mean over segments (NaN for one segment)
    se = g[["mean_kl", "top1"]].std(ddof=1).div(np.sqrt(out["segments"]), axis=0).add_suffix("_se")
    out = out.join(se)
    if "scales" in df:
        out["scales"] = g["scales"].first()
    out = out.reset_index()
    out["ppl_fp16"] = out["ppl_ref"]  # the unquantized cache of the model's own dtype
    return out.sort_values(["prefill", "effective_bits"]).reset_index(drop=True)


def plot_kl_vs_bits(summary: Any, path: str | Path) -> Path:
    """Mean next-token KL against effective bits (log scale), one marker per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    data = summary.copy()
    data["context"] = data["prefill"].astype(str)
    sns.scatterplot(data=data, x="effective_bits", y="mean_kl", hue="scheme", style="context", s=70, ax=ax)
    for _, r in data.iterrows():
        ax.annotate(r["scheme"], (r["effective_bits"], r["mean_kl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (metadata, window and pages included)")
    ax.set_ylabel("mean next-token KL vs unquantized cache")
    ax.set_title("KV-cache formats: damage against memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    from kverr.io import atomic_write

    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    finally:
        plt.close(fig)
