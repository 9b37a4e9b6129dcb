"""``CalibrationConfig``: every option of a calibration, typed, validated and versioned.

A calibration is fully described by its capture and one :class:`CalibrationConfig`: the budgets,
the candidate formats, the outer options (sinks, window, keys before or after RoPE), the
objective and its sampling. Where the work runs (local threads or a dask.distributed cluster)
does not change a single bit of the result, so it is an argument of
:func:`~kverr.calibration.search.calibrate`, not a field here.

The config serializes to a JSON object with a ``version`` field and round-trips exactly, as
:class:`kverr.config.CacheConfig` does; unknown fields are refused with the list of allowed ones::

    {"version": 1, "budgets": [3.0, 4.0], "context": 1280, "candidates": "auto", ...}
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kverr.config import SALIENT_SIDES
from kverr.exceptions import ConfigError
from kverr.quant.formats import QuantFormat

from .candidates import CALIBRATION_WINDOW_DTYPES, CANDIDATE_SETS, DEFAULT_WINDOW_DTYPE, OuterOption
from .objective import OBJECTIVES
from .sensitivity import NOISE_SITES

__all__ = ["CALIBRATION_CONFIG_VERSION", "CalibrationConfig", "DEFAULT_MAX_BITS", "KEY_ROPE_CHOICES"]

#: Version of the calibration config JSON this kverr reads and writes.
CALIBRATION_CONFIG_VERSION = 1
#: ``key_rope`` values: keys quantized after RoPE, before it, or both tried (None: ``pre`` when
#: the capture holds pre-RoPE keys and RoPE parameters, else ``post``).
KEY_ROPE_CHOICES = ("post", "pre", "both")
#: The frontier reaches at least this many effective bits (or the largest budget) by default.
DEFAULT_MAX_BITS = 8.0

def _fail(field_name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{field_name}={value!r} is not allowed; {allowed}")


def _int(value: Any, name: str, minimum: int, maximum: int = 1 << 30) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise _fail(name, value, f"an integer in [{minimum}, {maximum}]")
    return int(value)


def _positive_bits(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(name, value, "a finite positive number of effective bits")
    return float(value)


def _tuple(value: Any, name: str, what: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise _fail(name, value, f"a non-empty list of {what}")
    if len(set(value)) != len(value):
        raise _fail(name, value, f"a list of {what} without duplicates")
    return tuple(value)


@dataclass(frozen=True)
class CalibrationConfig:
    """What :func:`~kverr.calibration.search.calibrate` computes.

    Attributes
    ----------
    budgets : tuple of float
        Effective bits per cached element (metadata, sinks and window included) at ``context``
        tokens; one config is chosen per budget. A single number is accepted.
    context : int or None
        Tokens at which effective bits are counted (None: the capture's length).
    key_rope : {"post", "pre", "both"} or None
        Keys quantized after RoPE, before it, or both tried (None: ``pre`` when the capture holds
        pre-RoPE keys and RoPE parameters, else ``post``).
    sinks, windows : tuple of int or None
        Full-precision sink tokens and recent-token windows to try, crossed (a missing one is
        ``(0,)``); both None: the pairs of :data:`~.search.DEFAULT_SINKS_WINDOWS`.
    options : tuple of OuterOption or None
        The outer options to try, given one by one instead of ``key_rope``, ``sinks`` and
        ``windows`` (which must then be None).
    candidates : {"auto", "all", "dynamic", "fitted"}
        The named candidate set (:func:`~.candidates.candidate_set`): with static per-channel
        scales, without, with them and fitted per-channel widths, or ``auto``, per budget.
    codebooks : bool
        Add the codebook candidates (:func:`kverr.catalog.codebook_candidates`) to the named set.
    cands_k, cands_v : tuple of QuantFormat or None
        Explicit candidates for keys and values, replacing the named set for that side.
    salient : int
        Salient prompt tokens kept per (layer, kv head, K|V) (:mod:`kverr.error.salient`) in every
        option: their bytes count against the budget, and the objective scores every format with
        each query's salient tokens taken out (:func:`~.objective.salient_tokens`; 0: none).
    salient_sides : str
        The sides that keep them: ``"kv"`` (default), ``"k"`` or ``"v"`` (``CacheConfig.salient_sides``).
    salient_recent : int
        How many of them are the prompt's last tokens, whatever their saliency
        (``CacheConfig.salient_recent``; at most ``salient``; 0: all chosen by saliency).
    window_dtype : str
        What the sinks, window and pending tokens are kept in: ``auto`` (per budget,
        :func:`~.candidates.window_dtype_for_budget`), ``int8`` or a float dtype.
    queries : int
        Sampled query positions per layer for the objective.
    decode : int or None
        Decode steps after a prompt quantized whole, as ``kverr evaluate`` does (None: every
        query's window holds its most recent tokens).
    page_size, align : int
        The cache's page size (tokens) and alignment (bytes, a power of two).
    max_bits : float or None
        The frontier reaches this many effective bits, at least the largest budget (None:
        :data:`DEFAULT_MAX_BITS` or the largest budget, whichever is more).
    objective : {"kl", "rel"}
        ``kl``: predicted next-token KL (relative errors weighted by the layers' measured
        sensitivity); ``rel``: relative errors summed with equal weights.
    sensitivity_noise : {"o_proj", "kv"}
        ``kl`` only: where the sensitivity's noise is injected (:mod:`.sensitivity`).
    sensitivity_tokens : int
        ``kl`` only: calibration tokens the sensitivity is measured on.
    model : str or None
        ``kl`` only: the capture's model as a :func:`kverr.capturing.load_model` spec (None: the
        one the capture names).
    name : str or None
        Name of the written configs, ``{bits}`` replaced by the budget (None: ``calibrated-{bits}b``).
    max_groups_per_layer : int or None
        Most distinct (K format, V format) pairs among a layer's kv heads (None: no bound). The
        kernels launch decode attention once per pair and layer (:meth:`CacheConfig.launch_groups`),
        so this bounds the launches a config costs (:mod:`kverr.cost`).
    max_step_time : float or None
        The predicted decode step (:mod:`kverr.cost`, CUDA graphs) may take at most this
        fraction of fp16's: each budget's config gets the most format groups per layer (up to
        ``max_groups_per_layer``) that fits, and records its prediction in ``provenance``
        (``predicted_step``). None: no bound.
    batch : int
        Sequences whose caches the budget counts together: each holds its own pages, full-precision
        rows and per-token metadata, and they share the static bytes (static scales, codebooks,
        rotations), so effective bits are ``8 x bytes / (2 x layers x kv heads x head dim x
        context x batch)``, as :func:`kverr.memory.account` counts them at ``batch``. Formats with
        static bytes cost less per sequence as the batch grows.
    refit_widths : bool
        The configs will be served with their per-channel widths refit on each prompt
        (:mod:`kverr.calibration.refit`, ``kverr evaluate --refit-widths``): every sequence then
        stores its own width tables, and the budget counts them
        (:func:`~kverr.calibration.refit.width_row_nbytes` per sequence and per (layer, kv head,
        K|V) with per-channel widths), so the refit configs stay within it. The provenance
        records ``refit_widths``.
    compensated_keys : bool
        The configs will round their keys with compensation (``key_rounding``
        ``"compensated"``, :mod:`kverr.quant.compensated`): the objective scores every integer key
        candidate so, under the second moment of the capture's queries
        (:func:`~kverr.calibration.objective.key_cost`), and the written configs say
        ``key_rounding: compensated`` (served by the reference cache and the kernels, under each
        prefill's queries). Such a cache rounds the keys generated after the prompt to nearest,
        and with ``decode`` the objective scores them so. The provenance records
        ``compensated_keys``.
    static_moments : bool
        With ``compensated_keys``: the configs also carry the moment they were scored under as
        ``key_moments`` (static bytes, counted in the budget: ``L·H·D(D+1)`` bytes once for the
        ``batch``), under which caches round every key, prompt and decode, without waiting for
        queries. The provenance records ``static_moments``.
    window_per_head : bool
        Outer options that differ only in their window are searched as one: each (layer, kv
        head, K|V) picks its format and its window length among theirs, priced at its own bytes
        (window rows included), and the configs give the heads whose window differs from the
        most common one an override (:meth:`kverr.config.CacheConfig.window_for`). Needs two or
        more window lengths. Heads of one layer with other windows launch apart in the kernels,
        which the grouped search behind ``max_groups_per_layer`` and ``max_step_time`` does not
        count, so neither goes with it.
    step_tokens, step_batch, gpu
        Where ``max_step_time`` is predicted: cached tokens (None: ``context``), batch, and a
        GPU of :data:`kverr.cost.GPUS`.
    """

    budgets: tuple[float, ...]
    context: int | None = None
    key_rope: str | None = None
    sinks: tuple[int, ...] | None = None
    windows: tuple[int, ...] | None = None
    options: tuple[OuterOption, ...] | None = None
    candidates: str = "auto"
    codebooks: bool = False
    cands_k: tuple[QuantFormat, ...] | None = None
    cands_v: tuple[QuantFormat, ...] | None = None
    salient: int = 0
    salient_sides: str = "kv"
    salient_recent: int = 0
    window_dtype: str = DEFAULT_WINDOW_DTYPE
    queries: int = 32
    decode: int | None = None
    page_size: int = 64
    align: int = 16
    max_bits: float | None = None
    objective: str = "kl"
    sensitivity_noise: str = "o_proj"
    sensitivity_tokens: int = 640
    model: str | None = None
    name: str | None = None
    max_groups_per_layer: int | None = None
    max_step_time: float | None = None
    batch: int = 1
    refit_widths: bool = False
    compensated_keys: bool = False
    static_moments: bool = False
    window_per_head: bool = False
    step_tokens: int | None = None
    step_batch: int = 1
    gpu: str = "h200"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # normalise a field of the frozen instance
            object.__setattr__(self, name, value)

        budgets = self.budgets
        if isinstance(budgets, (int, float)) and not isinstance(budgets, bool):
            budgets = (budgets,)
        budgets = _tuple(budgets, "budgets", "budgets in effective bits")
        put("budgets", tuple(_positive_bits(b, "budgets") for b in budgets))
        if self.context is not None:
            _int(self.context, "context", 1)
        if self.key_rope is not None and self.key_rope not in KEY_ROPE_CHOICES:
            raise _fail("key_rope", self.key_rope, f"one of {', '.join(KEY_ROPE_CHOICES)}, or None (automatic)")
        for name, what in (("sinks", "sink token counts"), ("windows", "window lengths")):
            value = getattr(self, name)
            if value is not None:
                put(name, tuple(_int(x, name, 0) for x in _tuple(value, name, what)))
        if self.options is not None:
            opts = _tuple(self.options, "options", "OuterOption")
            if not all(isinstance(o, OuterOption) for o in opts):
                raise _fail("options", self.options, "a list of kverr.calibration.OuterOption")
            if (self.key_rope, self.sinks, self.windows) != (None, None, None):
                raise ConfigError("options is given one by one; leave key_rope, sinks and windows "
                                  "unset (they describe the options as a grid)")
            put("options", opts)
        if self.candidates not in CANDIDATE_SETS:
            raise _fail("candidates", self.candidates, f"one of {', '.join(CANDIDATE_SETS)}")
        for name in ("codebooks", "refit_widths", "compensated_keys", "static_moments", "window_per_head"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "true or false")
        if self.static_moments and not self.compensated_keys:
            raise ConfigError("static_moments are the moments compensated keys are rounded under; "
                              "set compensated_keys too")
        for name in ("cands_k", "cands_v"):
            value = getattr(self, name)
            if value is not None:
                cands = _tuple(value, name, "QuantFormat")
                if not all(isinstance(f, QuantFormat) for f in cands):
                    raise _fail(name, value, "a list of kverr.quant.QuantFormat")
                put(name, cands)
        if self.window_dtype not in CALIBRATION_WINDOW_DTYPES:
            raise _fail("window_dtype", self.window_dtype, f"one of {', '.join(CALIBRATION_WINDOW_DTYPES)}")
        _int(self.queries, "queries", 1)
        _int(self.salient, "salient", 0)
        if self.salient_sides not in SALIENT_SIDES:
            raise _fail("salient_sides", self.salient_sides, f"one of {', '.join(SALIENT_SIDES)}")
        _int(self.salient_recent, "salient_recent", 0)
        if self.salient_recent > self.salient:
            raise _fail("salient_recent", self.salient_recent, f"at most salient={self.salient}: the recent rows "
                        "are part of the salient ones")
        if self.decode is not None:
            _int(self.decode, "decode", 1)
        _int(self.page_size, "page_size", 1, 1 << 16)
        _int(self.align, "align", 1, 4096)
        if self.align & (self.align - 1):
            raise _fail("align", self.align, "a power of two number of bytes")
        if self.max_bits is not None:
            put("max_bits", _positive_bits(self.max_bits, "max_bits"))
            if self.max_bits < max(self.budgets):
                raise _fail("max_bits", self.max_bits,
                            f"the frontier must reach the largest budget, {max(self.budgets):g} bits: give "
                            "at least that, or None")
        if self.objective not in OBJECTIVES:
            raise _fail("objective", self.objective, f"one of {', '.join(OBJECTIVES)}")
        if self.sensitivity_noise not in NOISE_SITES:
            raise _fail("sensitivity_noise", self.sensitivity_noise, f"one of {', '.join(NOISE_SITES)}")
        _int(self.sensitivity_tokens, "sensitivity_tokens", 1)
        if self.max_groups_per_layer is not None:
            _int(self.max_groups_per_layer, "max_groups_per_layer", 1)
        if self.max_step_time is not None:
            v = self.max_step_time
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _fail("max_step_time", v, "a finite positive fraction of fp16's predicted step time")
            put("max_step_time", float(v))
        if self.step_tokens is not None:
            _int(self.step_tokens, "step_tokens", 1)
        _int(self.step_batch, "step_batch", 1)
        _int(self.batch, "batch", 1)
        from kverr.cost import GPUS

        if self.gpu not in GPUS:
            raise _fail("gpu", self.gpu, f"one of {', '.join(GPUS)}")
        if self.window_per_head:
            lengths = ({o.window for o in self.options} if self.options is not None
                       else None if self.windows is None else set(self.windows))
            if lengths is not None and len(lengths) < 2:
                raise ConfigError(f"window_per_head picks a window per head among the options' lengths; give two or "
                                  f"more (windows: {sorted(lengths)})")
            for name in ("max_step_time", "max_groups_per_layer"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"window_per_head and {name} do not go together: the grouped search counts "
                                      "(K, V) format pairs per layer, and heads with other windows launch apart")
        if self.max_step_time is None and (self.step_tokens is not None or self.step_batch != 1 or self.gpu != "h200"):
            raise ConfigError("step_tokens, step_batch and gpu say where max_step_time is predicted; give max_step_time")
        for name in ("model", "name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _fail(name, value, "a string or None")

    @property
    def frontier_bits(self) -> float:
        """Effective bits the frontier reaches: ``max_bits`` or the default, at least every budget."""
        return max(DEFAULT_MAX_BITS if self.max_bits is None else self.max_bits, *self.budgets)

    def with_(self, **changes: Any) -> CalibrationConfig:
        """A copy with fields replaced (validated again)."""
        return replace(self, **changes)

    # ---- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: ``version`` then every field (formats and options as objects)."""
        out: dict[str, Any] = {"version": CALIBRATION_CONFIG_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "options" and value is not None:
                value = [{"sinks": o.sinks, "window": o.window, "key_pre_rope": o.key_pre_rope} for o in value]
            elif f.name in ("cands_k", "cands_v") and value is not None:
                value = [c.to_dict() for c in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, obj: Any) -> CalibrationConfig:
        """Read :meth:`to_dict`'s output; unknown fields and other versions are refused."""
        from kverr.quant.formats import _check_keys

        names = {f.name for f in fields(cls)}
        _check_keys(obj, "calibration config", {"version", "budgets"}, names - {"budgets"})
        if obj["version"] != CALIBRATION_CONFIG_VERSION:
            raise _fail("version", obj["version"],
                        f"this kverr reads calibration config version {CALIBRATION_CONFIG_VERSION}")
        kwargs = {k: v for k, v in obj.items() if k != "version"}
        if kwargs.get("options") is not None:
            opts = kwargs["options"]
            if not isinstance(opts, list):
                raise _fail("options", opts, "a list of objects with sinks, window and key_pre_rope")
            parsed = []
            for i, o in enumerate(opts):
                _check_keys(o, f"options[{i}]", set(), {"sinks", "window", "key_pre_rope"})
                sinks, window = _int(o.get("sinks", 0), f"options[{i}].sinks", 0), _int(o.get("window", 0), f"options[{i}].window", 0)
                pre = o.get("key_pre_rope", False)
                if not isinstance(pre, bool):
                    raise _fail(f"options[{i}].key_pre_rope", pre, "true or false")
                parsed.append(OuterOption(window=window, sinks=sinks, key_pre_rope=pre))
            kwargs["options"] = tuple(parsed)
        for name in ("cands_k", "cands_v"):
            if kwargs.get(name) is not None:
                if not isinstance(kwargs[name], list):
                    raise _fail(name, kwargs[name], "a list of format objects")
                kwargs[name] = tuple(QuantFormat.from_dict(c, f"{name}[{i}]") for i, c in enumerate(kwargs[name]))
        for name in ("budgets", "sinks", "windows"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> CalibrationConfig:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise ConfigError(f"not a calibration config: {exc}") from None
        return cls.from_dict(obj)
