"""Cache configs: which format stores K and V of every layer and kv head.

A :class:`CacheConfig` holds a model-wide default format for keys and for values, optional
overrides per layer and per ``(layer, kv_head)``, and the model-wide token policy: the first
``sinks`` tokens and the ``window`` most recent tokens stay in full precision
(``window_dtype``: a plain float, or ``int8`` rows with a scale each, see
:func:`kverr.quant.formats.window_format`); keys are quantized before RoPE when
``key_pre_rope``; a layer or head override may give a side its own window length
(:meth:`CacheConfig.window_for`); the quantized tokens live in pages of ``page_size`` tokens whose sections are
aligned to ``align`` bytes. With ``salient`` = N > 0, each (layer, kv head) also keeps the N prompt
tokens its prompt's last queries attend to most as ``window_dtype`` rows with their positions,
beside their codes (:mod:`kverr.error.salient`), for the sides ``salient_sides`` names (``"kv"``,
``"k"`` or ``"v"``; formats that quantize); ``salient_recent`` = R <= N of those rows hold the
prompt's last R tokens wherever the window is, the ones the first decode steps read most. With
``key_rounding`` = ``"compensated"`` the integer key formats choose their codes by error
compensation under the prefill's queries (:mod:`kverr.quant.compensated`): the same grid and
bytes, other codes; with ``key_moments`` (:class:`~kverr.quant.compensated.KeyMoments`, a
calibration capture's query moments, static bytes) they round every key under those instead,
and the cache need not wait for queries.

Configs serialize to versioned JSON (``"version": 1``) that round-trips exactly; unknown fields,
formats or values raise :class:`kverr.exceptions.ConfigError` naming the field, the value and what is
allowed. The presets of today's formats are in :data:`PRESETS`.

JSON layout::

    {
      "version": 1,
      "name": "kivi-2",
      "k": {"dtype": "int", "bits": 2, "symmetric": false,
            "granularity": {"kind": "channel", "tokens": 32}, "scale_dtype": "fp16",
            "clip": {"kind": "absmax"}, "rotate": "none"},
      "v": {...},
      "window": 128, "sinks": 0, "key_pre_rope": false,
      "salient": 16,                          # optional (0 when absent)
      "salient_sides": "k",                   # optional ("kv" when absent)
      "salient_recent": 8,                    # optional (0 when absent; at most salient)
      "key_rounding": "compensated",          # optional ("nearest" when absent)
      "key_moments": {"dtype": "fp16", "shape": [L, H, D], "data": "..."},  # optional
      "page_size": 64, "window_dtype": "fp16", "align": 16,
      "layers": {"3": {"k": {...}}},          # optional overrides for a whole layer
      "heads": {"3:1": {"v": {...}}},         # optional overrides for (layer, kv_head)
      "heads": {"3:2": {"window": {"k": 16}}},  # ... formats and/or window lengths per side
      "provenance": {...}                     # optional, free-form (calibration records)
    }
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kverr.exceptions import ConfigError
from kverr.quant.compensated import KeyMoments
from kverr.quant.formats import (
    WINDOW_DTYPES,
    MSEClip,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    _check_keys,
    codebook_format,
    float_format,
    fp4_format,
    fp8_format,
    int_format,
    token_block,
)

#: Version of the config JSON this kverr reads and writes.
CONFIG_VERSION = 1

Which = Literal["k", "v"]
WHICH = ("k", "v")
#: Which sides keep salient rows (``CacheConfig.salient_sides``).
SALIENT_SIDES = ("kv", "k", "v")
#: How integer key formats choose their codes (``CacheConfig.key_rounding``): ``nearest`` (the
#: format's own rounding) or ``compensated`` (:mod:`kverr.quant.compensated`, weighed by the
#: second moment of the prefill's last :data:`kverr.error.salient.OBSERVED_QUERIES` queries).
KEY_ROUNDINGS = ("nearest", "compensated")


@dataclass(frozen=True)
class Override:
    """Formats and window lengths replacing the default for keys and/or values (``None`` keeps
    the default): ``k_window``/``v_window`` recent tokens of the side stay unquantized instead
    of the config's ``window``. JSON: ``{"k": {...}, "v": {...}, "window": {"k": 16, "v": 64}}``,
    each part optional."""

    k: QuantFormat | None = None
    v: QuantFormat | None = None
    k_window: int | None = None
    v_window: int | None = None

    def __post_init__(self) -> None:
        for w in WHICH:
            if getattr(self, f"{w}_window") is not None:
                _positive_int(getattr(self, f"{w}_window"), f"{w}_window", minimum=0)

    def window(self, which: Which) -> int | None:
        """The window length this override gives side ``which`` (None: not overridden)."""
        return getattr(self, f"{which}_window")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {w: getattr(self, w).to_dict() for w in WHICH if getattr(self, w) is not None}
        windows = {w: self.window(w) for w in WHICH if self.window(w) is not None}
        if windows:
            out["window"] = windows
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> Override:
        _check_keys(obj, where, set(), {*WHICH, "window"})
        if not obj:
            raise ConfigError(f"{where} is empty; give 'k', 'v' and/or 'window'")
        windows = obj.get("window", {})
        _check_keys(windows, f"{where}.window", set(), set(WHICH))
        if "window" in obj and not windows:
            raise ConfigError(f"{where}.window is empty; give 'k' and/or 'v' window lengths")
        for w, n in windows.items():
            _positive_int(n, f"{where}.window.{w}", minimum=0)
        return cls(**{w: QuantFormat.from_dict(obj[w], f"{where}.{w}") for w in WHICH if w in obj},
                   **{f"{w}_window": n for w, n in windows.items()})


def _positive_int(value: Any, name: str, *, minimum: int = 1, maximum: int = 1 << 20) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(f"{name}={value!r} is not allowed; an integer in [{minimum}, {maximum}]")
    return value


def _parse_head_key(key: str, where: str) -> tuple[int, int]:
    parts = str(key).split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{where} key {key!r} is not allowed; use 'LAYER:KV_HEAD', e.g. '3:1'")
    return int(parts[0]), int(parts[1])


def _parse_layer_key(key: str, where: str) -> int:
    if not str(key).isdigit():
        raise ConfigError(f"{where} key {key!r} is not allowed; use a layer index, e.g. '3'")
    return int(key)


@dataclass(frozen=True)
class CacheConfig:
    """A complete KV-cache storage config (see the module docs for the JSON layout)."""

    k: QuantFormat
    v: QuantFormat
    window: int = 0
    sinks: int = 0
    key_pre_rope: bool = False
    page_size: int = 64
    window_dtype: str = "fp16"
    align: int = 16
    layers: Mapping[int, Override] = field(default_factory=dict)
    heads: Mapping[tuple[int, int], Override] = field(default_factory=dict)
    name: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)
    salient: int = 0
    salient_sides: str = "kv"
    salient_recent: int = 0
    key_rounding: str = "nearest"
    key_moments: KeyMoments | None = None

    def __post_init__(self) -> None:
        for w in WHICH:
            if not isinstance(getattr(self, w), QuantFormat):
                raise ConfigError(f"{w} must be a QuantFormat, got {type(getattr(self, w)).__name__}")
        _positive_int(self.window, "window", minimum=0)
        _positive_int(self.sinks, "sinks", minimum=0)
        _positive_int(self.salient, "salient", minimum=0)
        if self.salient_sides not in SALIENT_SIDES:
            raise ConfigError(f"salient_sides={self.salient_sides!r} is not allowed; one of {', '.join(SALIENT_SIDES)}")
        _positive_int(self.salient_recent, "salient_recent", minimum=0)
        if self.salient_recent > self.salient:
            raise ConfigError(f"salient_recent={self.salient_recent} is not allowed: the recent rows are part of the "
                              f"salient ones, at most salient={self.salient}")
        if self.key_rounding not in KEY_ROUNDINGS:
            raise ConfigError(f"key_rounding={self.key_rounding!r} is not allowed; one of {', '.join(KEY_ROUNDINGS)}")
        if self.key_moments is not None:
            if not isinstance(self.key_moments, KeyMoments):
                raise ConfigError(f"key_moments must be KeyMoments, got {type(self.key_moments).__name__}")
            if self.key_rounding != "compensated":
                raise ConfigError(f"key_moments weigh compensated rounding; key_rounding={self.key_rounding!r} does "
                                  "not use them (set key_rounding 'compensated', or drop key_moments)")
        _positive_int(self.page_size, "page_size", maximum=1 << 16)
        _positive_int(self.align, "align", maximum=4096)
        if self.align & (self.align - 1):
            raise ConfigError(f"align={self.align} is not allowed; a power of two number of bytes")
        if not isinstance(self.key_pre_rope, bool):
            raise ConfigError(f"key_pre_rope={self.key_pre_rope!r} is not allowed; true or false")
        if self.window_dtype not in WINDOW_DTYPES:
            raise ConfigError(
                f"window_dtype={self.window_dtype!r} is not allowed; one of {', '.join(WINDOW_DTYPES)}"
            )
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(f"name={self.name!r} must be a string")
        for layer, ov in self.layers.items():
            _positive_int(layer, f"layers key {layer!r}", minimum=0)
            if not isinstance(ov, Override):
                raise ConfigError(f"layers[{layer}] must be an Override")
        for key, ov in self.heads.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ConfigError(f"heads key {key!r} must be (layer, kv_head)")
            _positive_int(key[0], f"heads key {key!r} layer", minimum=0)
            _positive_int(key[1], f"heads key {key!r} kv_head", minimum=0)
            if not isinstance(ov, Override):
                raise ConfigError(f"heads[{key}] must be an Override")
        for where, fmt in self._all_formats():
            g = fmt.granularity
            tb = token_block(g, self.page_size)
            if not fmt.is_float and (isinstance(g, PerChannel) and g.tokens is not None) and self.page_size % tb:
                raise ConfigError(
                    f"{where}.granularity.tokens={tb} does not fit whole pages of "
                    f"page_size={self.page_size} tokens (a scale group would straddle two pages); "
                    f"use a page_size that is a multiple of {tb}"
                )
        try:
            json.dumps(dict(self.provenance))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"provenance must be JSON-serializable: {exc}") from None

    # ---- lookup -----------------------------------------------------------------------------

    def _all_formats(self) -> Iterator[tuple[str, QuantFormat]]:
        yield "k", self.k
        yield "v", self.v
        for layer, ov in self.layers.items():
            for w in WHICH:
                if getattr(ov, w) is not None:
                    yield f"layers.{layer}.{w}", getattr(ov, w)
        for (layer, head), ov in self.heads.items():
            for w in WHICH:
                if getattr(ov, w) is not None:
                    yield f"heads.{layer}:{head}.{w}", getattr(ov, w)

    def format_for(self, layer: int, kv_head: int, which: Which) -> QuantFormat:
        """The format storing ``which`` ("k" or "v") of ``(layer, kv_head)``."""
        return self._resolve(layer, kv_head, which, lambda ov: getattr(ov, which), lambda: getattr(self, which))

    def window_for(self, layer: int, kv_head: int, which: Which) -> int:
        """How many of the most recent tokens of ``which`` of ``(layer, kv_head)`` stay
        unquantized: the head's override, else the layer's, else the config's ``window``."""
        return self._resolve(layer, kv_head, which, lambda ov: ov.window(which), lambda: self.window)

    def _resolve(self, layer: int, kv_head: int, which: Which, get, default):
        """What the head's override gives (``get``), else the layer's, else ``default()``."""
        if which not in WHICH:
            raise ConfigError(f"which={which!r} is not allowed; 'k' or 'v'")
        for ov in (self.heads.get((layer, kv_head)), self.layers.get(layer)):
            if ov is not None and get(ov) is not None:
                return get(ov)
        return default()

    def _override_windows(self) -> list[int]:
        """Every window length a layer or head override gives."""
        return [ov.window(w) for ov in (*self.layers.values(), *self.heads.values()) for w in WHICH
                if ov.window(w) is not None]

    @property
    def windows_vary(self) -> bool:
        """Whether an override gives some layer or head a window other than ``window``."""
        return any(n != self.window for n in self._override_windows())

    def without_windows(self) -> CacheConfig:
        """This config with no window: ``window`` 0 and no override giving one."""
        strip = lambda ovs: {key: replace(ov, k_window=None, v_window=None)  # noqa: E731
                             for key, ov in ovs.items() if ov.k is not None or ov.v is not None}
        return self.with_(window=0, layers=strip(self.layers), heads=strip(self.heads))

    def max_window(self) -> int:
        """The longest window any layer or head keeps."""
        return max([self.window, *self._override_windows()])

    def keeps_salient(self, which: Which, fmt: QuantFormat) -> bool:
        """Whether the heads of side ``which`` stored with ``fmt`` keep salient rows: the config
        keeps salient tokens on that side and ``fmt`` quantizes."""
        return bool(self.salient) and which in self.salient_sides and not fmt.is_float

    @property
    def compensates_keys(self) -> bool:
        """Whether integer key formats choose their codes by error compensation
        (``key_rounding`` ``"compensated"``) rather than their own rounding."""
        return self.key_rounding == "compensated"

    @property
    def needs_queries(self) -> bool:
        """Whether a cache must see the prefill's queries before it quantizes the prefill: the
        config keeps salient tokens, or rounds keys with compensation under the prefill's queries
        (no ``key_moments``)."""
        return bool(self.salient) or (self.compensates_keys and self.key_moments is None)

    def window_groups(self, layer: int, n_kv_heads: int, which: Which) -> list[tuple[QuantFormat, int, list[int]]]:
        """kv heads of ``layer`` grouped by format and window length (:meth:`window_for`), in
        order of first appearance: ``[(format, window, heads)]``.

        Heads that share a format and a window are quantized together, so a ``tensor``
        granularity spans exactly the heads that use it.
        """
        groups: dict[tuple[QuantFormat, int], list[int]] = {}
        for h in range(n_kv_heads):
            groups.setdefault((self.format_for(layer, h, which), self.window_for(layer, h, which)), []).append(h)
        return [(fmt, window, heads) for (fmt, window), heads in groups.items()]

    def head_groups(self, layer: int, n_kv_heads: int, which: Which) -> list[tuple[QuantFormat, list[int]]]:
        """:meth:`window_groups` without the windows: ``[(format, heads)]``."""
        return [(fmt, heads) for fmt, _, heads in self.window_groups(layer, n_kv_heads, which)]

    def launch_groups(self, layer: int, n_kv_heads: int) -> list[tuple[QuantFormat, QuantFormat, list[int]]]:
        """kv heads of ``layer`` grouped by their (K format, V format) pair and their K and V
        window lengths (:meth:`window_for`), in order of first appearance:
        ``[(k_format, v_format, heads)]``; a group's windows are :meth:`window_for` of any of its
        heads.

        The kernels' decode attention launches once per such group (main and tail launches, then
        one merge per layer): its heads share one K head group and one V head group
        (:meth:`head_groups`). So the number of groups is what a config's per-layer heterogeneity
        costs in launches (:mod:`kverr.cost`); calibration can bound it
        (``max_groups_per_layer``).
        """
        groups: dict[tuple[QuantFormat, QuantFormat, int, int], list[int]] = {}
        for h in range(n_kv_heads):
            key = (self.format_for(layer, h, "k"), self.format_for(layer, h, "v"),
                   self.window_for(layer, h, "k"), self.window_for(layer, h, "v"))
            groups.setdefault(key, []).append(h)
        return [(k, v, heads) for (k, v, _, _), heads in groups.items()]

    def check_model(self, n_layers: int, n_kv_heads: int, head_dim: int, max_context: int | None = None) -> None:
        """Raise :class:`ConfigError` unless this config fits a model of the given shape."""
        for layer in self.layers:
            if layer >= n_layers:
                raise ConfigError(
                    f"layers.{layer} overrides a layer the model does not have "
                    f"(it has {n_layers} layers: 0..{n_layers - 1})"
                )
        for layer, head in self.heads:
            if layer >= n_layers or head >= n_kv_heads:
                raise ConfigError(
                    f"heads.{layer}:{head} names a head the model does not have "
                    f"({n_layers} layers x {n_kv_heads} kv heads)"
                )
        for where, fmt in self._all_formats():
            fmt.check_head_dim(head_dim, where)
        km = self.key_moments
        if km is not None and (km.n_layers, km.n_kv_heads, km.head_dim) != (n_layers, n_kv_heads, head_dim):
            raise ConfigError(
                f"key_moments are for {km.n_layers} layers x {km.n_kv_heads} kv heads x head dim {km.head_dim}; "
                f"the model has {n_layers} x {n_kv_heads} x {head_dim}"
            )
        if max_context is not None and self.sinks + self.max_window() > max_context:
            which = "window" if not self.windows_vary else "the longest window a layer or head keeps"
            raise ConfigError(
                f"sinks + {which} = {self.sinks + self.max_window()} tokens exceeds the model's context "
                f"of {max_context}; nothing it holds would ever be quantized"
            )

    def select_layers(self, model_layers: list[int]) -> CacheConfig:
        """The config of a model made of ``model_layers`` only: layer ``i`` of the result is layer
        ``model_layers[i]`` of this config (e.g. for a capture that holds a subset of layers)."""
        pos = {int(l): i for i, l in enumerate(model_layers)}
        if len(pos) != len(model_layers):
            raise ConfigError(f"model_layers {list(model_layers)} repeats a layer")
        km = self.key_moments
        if km is not None and max(pos, default=-1) >= km.n_layers:
            raise ConfigError(f"model_layers {list(model_layers)} name a layer the key_moments do not have "
                              f"({km.n_layers} layers)")
        return self.with_(
            key_moments=None if km is None else km.select_layers(list(model_layers)),
            layers={pos[l]: ov for l, ov in self.layers.items() if l in pos},
            heads={(pos[l], h): ov for (l, h), ov in self.heads.items() if l in pos},
        )

    # ---- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": CONFIG_VERSION}
        if self.name is not None:
            out["name"] = self.name
        out.update(
            k=self.k.to_dict(),
            v=self.v.to_dict(),
            window=self.window,
            sinks=self.sinks,
            key_pre_rope=self.key_pre_rope,
            page_size=self.page_size,
            window_dtype=self.window_dtype,
            align=self.align,
        )
        if self.salient:
            out["salient"] = self.salient
        if self.salient_sides != "kv":
            out["salient_sides"] = self.salient_sides
        if self.salient_recent:
            out["salient_recent"] = self.salient_recent
        if self.key_rounding != "nearest":
            out["key_rounding"] = self.key_rounding
        if self.key_moments is not None:
            out["key_moments"] = self.key_moments.to_dict()
        if self.layers:
            out["layers"] = {str(k): ov.to_dict() for k, ov in sorted(self.layers.items())}
        if self.heads:
            out["heads"] = {f"{l}:{h}": ov.to_dict() for (l, h), ov in sorted(self.heads.items())}
        if self.provenance:
            out["provenance"] = json.loads(json.dumps(dict(self.provenance)))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, obj: Any) -> CacheConfig:
        required = {"version", "k", "v"}
        optional = {
            "name", "window", "sinks", "key_pre_rope", "page_size", "window_dtype", "align", "salient",
            "salient_sides", "salient_recent", "key_rounding", "key_moments", "layers", "heads", "provenance",
        }
        _check_keys(obj, "config", required, optional)
        version = obj["version"]
        if version != CONFIG_VERSION:
            raise ConfigError(
                f"version={version!r} is not allowed; this kverr reads config version {CONFIG_VERSION}"
            )
        kwargs: dict[str, Any] = {
            "k": QuantFormat.from_dict(obj["k"], "k"),
            "v": QuantFormat.from_dict(obj["v"], "v"),
        }
        for key in ("name", "window", "sinks", "key_pre_rope", "page_size", "window_dtype", "align", "salient",
                    "salient_sides", "salient_recent", "key_rounding", "provenance"):
            if key in obj:
                kwargs[key] = obj[key]
        if "key_moments" in obj:
            kwargs["key_moments"] = KeyMoments.from_dict(obj["key_moments"])
        if "provenance" in kwargs and not isinstance(kwargs["provenance"], dict):
            raise ConfigError("provenance must be a JSON object")
        layers = obj.get("layers", {})
        if not isinstance(layers, dict):
            raise ConfigError("layers must be a JSON object keyed by layer index")
        kwargs["layers"] = {
            _parse_layer_key(k, "layers"): Override.from_dict(v, f"layers.{k}") for k, v in layers.items()
        }
        heads = obj.get("heads", {})
        if not isinstance(heads, dict):
            raise ConfigError("heads must be a JSON object keyed by 'LAYER:KV_HEAD'")
        kwargs["heads"] = {
            _parse_head_key(k, "heads"): Override.from_dict(v, f"heads.{k}") for k, v in heads.items()
        }
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> CacheConfig:
        too_deep = "not a config: its JSON is nested too deeply to read (a config is a few levels deep)"
        try:
            obj = json.loads(text)
        except RecursionError:
            raise ConfigError(too_deep) from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not valid JSON: {exc}") from None
        except ValueError as exc:  # an integer of more digits than Python converts
            raise ConfigError(
                f"not a config: a number in it is too long to read ({str(exc).split(';')[0]})"
            ) from None
        try:
            return cls.from_dict(obj)
        except RecursionError:  # e.g. a provenance nested just below json's own limit
            raise ConfigError(too_deep) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> CacheConfig:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {str(p)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from None
        try:
            return cls.from_json(text)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON atomically (temporary file in the same folder, then rename)."""
        return atomic_write_text(Path(path), self.to_json())

    def with_(self, **changes: Any) -> CacheConfig:
        """A copy with fields replaced (validated again)."""
        return replace(self, **changes)


# The one atomic file writer lives with the other writers in kverr.io; re-exported here.
from kverr.io import atomic_write_text  # noqa: E402


_SHAPE_KEYS = ("n_layers", "n_kv_heads", "head_dim")


def _recorded_shape(provenance: Mapping[str, Any]) -> dict[str, int]:
    """The model shape a calibrated config records: ``provenance["capture"]``'s ``n_layers``,
    ``n_kv_heads`` and ``head_dim``; configs calibrated before those were recorded give their
    layer count through their per-layer sensitivity weights."""
    cap = provenance.get("capture")
    cap = cap if isinstance(cap, Mapping) else {}
    shape = {k: cap[k] for k in _SHAPE_KEYS if isinstance(cap.get(k), int) and not isinstance(cap.get(k), bool)}
    sens = provenance.get("sensitivity")
    weights = sens.get("weights_k") if isinstance(sens, Mapping) else None
    if "n_layers" not in shape and isinstance(weights, list) and weights:
        shape["n_layers"] = len(weights)
    return shape


def _describe_shape(shape: Mapping[str, int]) -> str:
    names = {"n_layers": "layers", "n_kv_heads": "kv heads", "head_dim": "head dim"}
    return " x ".join(f"{names[k]} {shape[k]}" if k == "head_dim" else f"{shape[k]} {names[k]}"
                      for k in _SHAPE_KEYS if k in shape)


def check_model_matches(
    config: CacheConfig,
    weights_sha256: str | None = None,
    model_id: str = "",
    *,
    shape: tuple[int, int, int] | None = None,
    capture: Any = None,
) -> None:
    """Refuse a calibrated config used with another model than the one it was calibrated on.

    A config made by ``kverr calibrate`` records the model of its calibration capture in
    ``provenance["capture"]``: ``model_id``, ``weights_sha256`` and its shape (``n_layers``,
    ``n_kv_heads``, ``head_dim``). Whatever is known on both sides is compared; a config that
    records nothing (a preset, a hand-written config) is not refused here (its fit to a model's
    shape is :meth:`CacheConfig.check_model`'s business).

    Parameters
    ----------
    config : CacheConfig
        The config about to be used.
    weights_sha256, model_id : str, optional
        The model it is used with.
    shape : tuple of int, optional
        That model's ``(n_layers, n_kv_heads, head_dim)``.
    capture : xarray.Dataset, optional
        A capture it is used on: its attributes and sizes give the model's weights, id and shape.

    Raises
    ------
    ConfigError
        Naming the model the config was calibrated on and the one it is used with.
    """
    prov = dict(config.provenance)
    cap = prov.get("capture")
    cap = cap if isinstance(cap, Mapping) else {}
    used: dict[str, int] = {}
    if capture is not None:
        a = capture.attrs
        weights_sha256 = weights_sha256 or str(a.get("weights_sha256", "")) or None
        model_id = model_id or str(a.get("model_id", ""))
        if "model_n_layers" in a:  # a capture may hold a subset of the model's layers
            used["n_layers"] = int(a["model_n_layers"])
        used.update(n_kv_heads=int(capture.sizes["kv_head"]), head_dim=int(capture.sizes["channel"]))
    if shape is not None:
        used.update(zip(_SHAPE_KEYS, (int(x) for x in shape)))
    want = cap.get("weights_sha256")
    if want and weights_sha256 and want != weights_sha256:
        raise ConfigError(
            f"config {config.name!r} was calibrated on a capture of {cap.get('model_id')!r} "
            f"(weights sha256 {want[:12]}...), not of the model used here ({model_id!r}, "
            f"{weights_sha256[:12]}...); calibrate on a capture of this model"
        )
    recorded = _recorded_shape(prov)
    if any(k in used and used[k] != v for k, v in recorded.items()):
        raise ConfigError(
            f"config {config.name!r} was calibrated on a capture of {cap.get('model_id')!r} "
            f"({_describe_shape(recorded)}), not of the model used here "
            f"({(model_id + ': ') if model_id else ''}{_describe_shape(used)}); "
            "calibrate on a capture of this model"
        )


# --------------------------------------------------------------------------------------------
# Presets: today's formats
# --------------------------------------------------------------------------------------------


#: NVFP4's "four over six" scale choice as clip candidates: the range as it is (the block's
#: largest magnitude on fp4's 6) or widened by 1.5 (on 4).
FOUR_OVER_SIX = MSEClip(candidates=(1.0, 1.5))


def _presets() -> dict[str, CacheConfig]:
    fp16 = float_format("fp16")
    kivi = lambda bits: dict(  # noqa: E731
        k=int_format(bits, PerChannel(32)), v=int_format(bits, PerTokenGroup(32)), window=128
    )
    tq = lambda bits: codebook_format(bits, PerToken(), rotate="hadamard", scale_stat="rms")  # noqa: E731
    presets = {
        # Unquantized half precision: the baseline every serving engine starts from.
        "fp16": dict(k=fp16, v=fp16),
        # Per-token asymmetric int8 (one scale and zero point per token and head).
        "int8-token": dict(k=int_format(8, PerToken()), v=int_format(8, PerToken())),
        # transformers QuantizedCache / quanto default: int4, groups of 64 channels, 128-token window.
        "int4-token-g64": dict(
            k=int_format(4, PerTokenGroup(64)), v=int_format(4, PerTokenGroup(64)), window=128
        ),
        # KIVI: keys per channel over groups of 32 tokens, values per token in groups of 32 channels.
        "kivi-4": kivi(4),
        "kivi-2": kivi(2),
        # llama.cpp q8_0 / q4_0: symmetric blocks of 32 channels with an fp16 scale.
        "q8_0": dict(
            k=int_format(8, PerTokenGroup(32), symmetric=True),
            v=int_format(8, PerTokenGroup(32), symmetric=True),
        ),
        "q4_0": dict(
            k=int_format(4, PerTokenGroup(32), symmetric=True),
            v=int_format(4, PerTokenGroup(32), symmetric=True),
        ),
        # TurboQuant's MSE quantizer (Zandieh et al., ICLR 2026): each token's head vector rotated
        # (here the Hadamard rotation, as vLLM's TurboQuant path does, for the paper's random one),
        # every coordinate the Lloyd-Max level of N(0, 1) nearest to it over the vector's rms
        # (the paper's unit vector over sqrt(D)), the norm kept as an fp16 scale.
        **{f"turboquant-mse-{b}": dict(k=tq(b), v=tq(b)) for b in (2, 3, 4)},
        # The microscaling layouts, with kverr's outward scales (the least scale whose grid covers
        # the block, so nothing saturates): NVFP4 (fp4 e2m1 codes, one fp8 e4m3 scale per 16
        # channels: 4.5 bits; vLLM's nvfp4 cache, which rounds its scales to nearest, is the
        # vllm-nvfp4 preset) and MXFP4 (one e8m0 power-of-two scale per 32 channels: 4.25 bits;
        # the OCP MX specification takes 2**(floor(log2 amax) - 2) instead, which clips a block's
        # top into 6).
        "nvfp4": dict(k=fp4_format(PerTokenGroup(16)), v=fp4_format(PerTokenGroup(16))),
        "mxfp4": dict(k=fp4_format(PerTokenGroup(32), scale_dtype="e8m0"),
                      v=fp4_format(PerTokenGroup(32), scale_dtype="e8m0")),
        # NVFP4 with "four over six" (Cook et al., 2025): each block's scale amax / 6 or amax / 4,
        # whichever reconstructs the block with less squared error (a tie keeps amax / 6).
        "nvfp4-4over6": dict(k=fp4_format(PerTokenGroup(16), clip=FOUR_OVER_SIX),
                             v=fp4_format(PerTokenGroup(16), clip=FOUR_OVER_SIX)),
        # vLLM fp8 KV cache with static fp32 scales, per tensor (per layer) or per kv head.
        "fp8-e4m3-tensor": dict(k=fp8_format(PerTensor()), v=fp8_format(PerTensor())),
        "fp8-e4m3-head": dict(k=fp8_format(PerHead()), v=fp8_format(PerHead())),
    }
    return {name: CacheConfig(name=name, **kw) for name, kw in presets.items()}


#: Today's formats as configs, by name.
PRESETS: dict[str, CacheConfig] = _presets()


def named_presets() -> dict[str, CacheConfig]:
    """Every config that has a name: kverr's :data:`PRESETS`, then the serving engines' own formats
    (:func:`kverr.engines.engine_presets`, named after the engine)."""
    from kverr.engines import engine_presets

    engines = engine_presets()
    clash = sorted(set(PRESETS) & set(engines))
    if clash:
        raise AssertionError(f"preset {clash[0]!r} is defined by kverr and by an engine")
    return {**PRESETS, **engines}


def resolve(spec: str | os.PathLike | CacheConfig) -> CacheConfig:
    """A preset name (:func:`named_presets`), a path to a config JSON, or a config itself ->
    :class:`CacheConfig`."""
    if isinstance(spec, CacheConfig):
        return spec
    s = str(spec)
    if s in PRESETS:
        return PRESETS[s]
    named = named_presets()
    if s in named:
        return named[s]
    if Path(s).exists() or s.endswith(".json") or os.sep in s:
        return CacheConfig.load(s)
    raise ConfigError(f"{s!r} is neither a preset nor a config file; presets: {', '.join(named)}")


__all__ = [
    "CONFIG_VERSION", "CacheConfig", "Override", "PRESETS", "PerChannel", "PerHead", "PerPage",
    "PerTensor", "PerToken", "PerTokenGroup", "QuantFormat", "WHICH", "atomic_write_text",
    "check_model_matches", "named_presets", "resolve",
]
