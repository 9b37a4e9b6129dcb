"""Exact byte accounting of a KV cache for a config and a model shape.

The seed formula ``2 * L * H_kv * D * T * b`` counts only the payload at a nominal element
width. A real cache also holds scales and zero points (in their own dtype), pads sections to an
alignment, rounds every sequence up to whole pages of a block allocator, keeps sink and window
tokens in full precision and stores static scales (and a codebook format's levels, and the
query moments compensated keys are rounded under, ``config.key_moments``) once per model.
:func:`account` counts all of it, with the layout of :class:`kverr.quant.store.ReferenceStore` (whose allocated bytes it must
equal, and a test checks that it does), and reports effective bits per element including
everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kverr.config import WHICH, CacheConfig
from kverr.exceptions import ConfigError, ModelError, ShapeError
from kverr.quant.formats import QuantFormat, is_static, window_format
from kverr.quant.reference import block_shape, codes_nbytes, scale_shape, table_nbytes
from kverr.quant.store import SALIENT_INDEX_BYTES, align_up, held_tokens, live_start, token_regions

#: Shape of the bundled default model, SmolLM2-135M-Instruct (Llama: 30 layers, 9 query heads,
#: 3 kv heads, head dim 64, 8k context).
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelShape:
    """What the cache size depends on: layers, kv heads, head dim, the sliding window of each
    layer (empty: none has one) and the context limit; the query heads, where known, for what
    decoding costs (:mod:`kverr.cost`), not for bytes."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    name: str = "custom"
    max_context: int | None = None
    n_q_heads: int | None = field(default=None, compare=False)
    sliding_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in ("n_layers", "n_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShapeError(f"{f}={v!r}: must be a positive integer")
        sw = tuple(int(w) for w in self.sliding_windows)
        if sw and (len(sw) != self.n_layers or min(sw) < 0):
            raise ShapeError(f"sliding_windows={list(sw)}: give one non-negative window per layer "
                             f"({self.n_layers}), 0 for full attention")
        object.__setattr__(self, "sliding_windows", sw if any(sw) else ())
        q = self.n_q_heads
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1 or q % self.n_kv_heads):
            raise ShapeError(f"n_q_heads={q!r}: must be a positive multiple of n_kv_heads={self.n_kv_heads}")

    def sliding_window(self, layer: int) -> int:
        """Sliding window of ``layer`` (0: full causal attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0


DEFAULT_SHAPE = ModelShape(30, 3, 64, name=DEFAULT_MODEL_ID, max_context=8192, n_q_heads=9)


def model_shape(spec: str = "default") -> ModelShape:
    """Shape of ``"default"`` (the bundled model) or of a local transformers model directory,
    read from its ``config.json`` without loading weights."""
    if spec == "default":
        return DEFAULT_SHAPE
    path = Path(spec)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.exists():
        raise ModelError(
            f"model {spec!r} not found: give 'default' or a transformers model directory "
            "holding config.json"
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ModelError(f"cannot read {cfg_path}: its JSON is nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {cfg_path}: {exc}") from None
    cfg = cfg.get("text_config", cfg)
    try:
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{cfg_path} does not describe a decoder with attention heads ({exc!r})") from None
    return ModelShape(n_layers, n_kv, head_dim, name=str(path), max_context=cfg.get("max_position_embeddings"),
                      n_q_heads=n_heads, sliding_windows=sliding_windows_of(cfg, n_layers, cfg_path))


def sliding_windows_of(cfg: dict[str, Any], n_layers: int, where: Any = "config") -> tuple[int, ...]:
    """Per-layer sliding windows of a transformers ``config.json`` (0: full attention).

    ``layer_types`` names each layer (``sliding_attention`` or ``full_attention``); without it,
    ``sliding_window_pattern`` N makes every layer but each N-th sliding (older Gemma configs),
    and a bare ``sliding_window`` applies to every layer unless ``use_sliding_window`` is false
    (Mistral; Qwen2 carries a window it does not use).
    """
    w = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise ModelError(f"{where}: layer_types names {len(types)} layers, the model has {n_layers}")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelError(f"{where}: layer types {unknown} are not supported; kverr knows "
                             "sliding_attention and full_attention")
        if "sliding_attention" in types and not w:
            raise ModelError(f"{where}: sliding_attention layers but no sliding_window")
        out = tuple(int(w) if t == "sliding_attention" else 0 for t in types)
        return out if any(out) else ()
    if not w or cfg.get("use_sliding_window") is False:
        return ()
    pattern = cfg.get("sliding_window_pattern")
    if pattern:
        return tuple(0 if (i + 1) % int(pattern) == 0 else int(w) for i in range(n_layers))
    return (int(w),) * n_layers


@dataclass
class Bytes:
    """Bytes of one part of the cache, by kind."""

    payload: int = 0  # codes of the quantized tokens (plain-float formats: their values)
    scales: int = 0  # scales of the quantized tokens
    zeros: int = 0  # zero points of the quantized tokens
    static: int = 0  # static scales and zero points, codebook levels, key moments: once per model
    sinks: int = 0  # full-precision sink tokens
    window: int = 0  # full-precision recent tokens
    salient: int = 0  # the salient prompt tokens' window-dtype rows and their positions
    page_rounding: int = 0  # unused slots of held pages: the last; in a sliding layer, the first's dead ones
    padding: int = 0  # alignment of page sections and full-precision rows

    KINDS = ("payload", "scales", "zeros", "static", "sinks", "window", "salient", "page_rounding", "padding")

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in self.KINDS)

    def add(self, other: Bytes) -> None:
        for k in self.KINDS:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class MemoryReport:
    """Exact cache bytes for one config, model shape, token count, batch and page size."""

    config_name: str
    shape: ModelShape
    tokens: int
    batch: int
    page_size: int
    per_layer: list[dict[str, Bytes]] = field(default_factory=list)  # [layer]["k"|"v"]
    seed_bytes: int = 0

    @property
    def elements(self) -> int:
        """K and V elements of the context: ``2 * L * H_kv * D * T * batch``, sliding layers
        included at ``T`` (so the tokens they free lower the effective bits: bits per element of
        context)."""
        s = self.shape
        return 2 * s.n_layers * s.n_kv_heads * s.head_dim * self.tokens * self.batch

    def layer_total(self, layer: int) -> Bytes:
        b = Bytes()
        for w in WHICH:
            b.add(self.per_layer[layer][w])
        return b

    @property
    def totals(self) -> Bytes:
        b = Bytes()
        for layer in range(len(self.per_layer)):
            b.add(self.layer_total(layer))
        return b

    @property
    def total_bytes(self) -> int:
        return self.totals.total

    @property
    def effective_bits(self) -> float:
        """Stored bits per cached element, everything included."""
        return 8.0 * self.total_bytes / self.elements if self.elements else float("nan")

    def layer_effective_bits(self, layer: int) -> float:
        s = self.shape
        n = 2 * s.n_kv_heads * s.head_dim * self.tokens * self.batch
        return 8.0 * self.layer_total(layer).total / n if n else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config_name,
            "model": asdict(self.shape),
            "tokens": self.tokens,
            "batch": self.batch,
            "page_size": self.page_size,
            "elements": self.elements,
            "total_bytes": self.total_bytes,
            "effective_bits": self.effective_bits,
            "seed_formula_bytes": self.seed_bytes,
            "totals": {k: getattr(self.totals, k) for k in Bytes.KINDS},
            "layers": [
                {
                    "layer": i,
                    "effective_bits": self.layer_effective_bits(i),
                    **{w: {k: getattr(d[w], k) for k in Bytes.KINDS} | {"total": d[w].total} for w in WHICH},
                }
                for i, d in enumerate(self.per_layer)
            ],
        }

    def to_table(self, per_layer: bool = True) -> str:
        """A plain-text table: per layer (optional) and total, by kind, plus effective bits."""
        # the salient column only for a config that keeps salient tokens
        kinds = [k for k in Bytes.KINDS if k != "salient" or self.totals.salient]
        head = ["layer", *kinds, "total", "eff.bits"]
        rows = []
        if per_layer:
            for i in range(len(self.per_layer)):
                b = self.layer_total(i)
                rows.append([str(i), *(f"{getattr(b, k):,}" for k in kinds), f"{b.total:,}", f"{self.layer_effective_bits(i):.3f}"])
        t = self.totals
        rows.append(["all", *(f"{getattr(t, k):,}" for k in kinds), f"{t.total:,}", f"{self.effective_bits:.3f}"])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        s = self.shape
        formula = (f"2*L*H_kv*D*T*b = 2*{s.n_layers}*{s.n_kv_heads}*{s.head_dim}*{self.tokens}*b" if not s.sliding_windows
                   else f"2*H_kv*D*b per token each layer holds (a sliding layer its last W: {_windows(s)})")
        lines.append(
            f"seed formula {formula} (x batch {self.batch}) at nominal b: {self.seed_bytes:,} bytes; "
            f"counted: {t.total:,} bytes ({t.total / self.seed_bytes:.3f}x)"
            if self.seed_bytes
            else "seed formula: 0 bytes"
        )
        return "\n".join(lines)


def _windows(shape: ModelShape) -> str:
    """``W=512 in 22 of 26 layers``-style summary of a shape's sliding windows."""
    from collections import Counter

    counts = Counter(w for w in shape.sliding_windows if w)
    return ", ".join(f"W={w} in {n} of {shape.n_layers} layers" for w, n in sorted(counts.items()))


def window_row_sections(window_dtype: str, D: int) -> list[int]:
    """Bytes of one full-precision row (a sink, window or pending token of one head), section by
    section as the cache aligns them: the values, and for an int8 window its fp16 scale."""
    wf = window_format(window_dtype)
    return [codes_nbytes(wf, D)] + ([] if wf.is_float else [wf.scale_bytes])


def group_bytes(
    config: CacheConfig,
    fmt: QuantFormat,
    h: int,
    T: int,
    D: int,
    batch: int,
    prefill_quantized: int = 0,
    sliding_window: int = 0,
    *,
    which: str,
    window: int | None = None,
) -> tuple[Bytes, int]:
    """Bytes of one (layer, K|V) head group of ``h`` heads (side ``which``), and its seed-formula bytes.

    A sliding-window layer holds only its last ``sliding_window`` tokens: the pages wholly
    behind them are freed (:func:`kverr.quant.store.live_start`), the page the window starts in
    is held whole (its dead slots count as page rounding).
    """
    P, A = config.page_size, config.align
    b = Bytes()
    start, end = token_regions(T, config, fmt, prefill_quantized, window=window)
    live = live_start(T, sliding_window)
    n_q = end - start
    first_page = max(0, live - start) // P if live < end else -(-n_q // P)
    q0 = start + first_page * P  # first token of the first held page
    n_sink, n_held, n_win = held_tokens(T, start, end, live)
    rows = batch * h
    pages = -(-n_q // P) - first_page
    # Full-precision tokens, one aligned row per (sequence, head); int8: a row of codes and a
    # row of scales (one per token), each aligned.
    n_fp = n_sink + n_win
    sections = window_row_sections(config.window_dtype, D)
    per_token = sum(sections)
    b.sinks = rows * n_sink * per_token
    b.window = rows * n_win * per_token
    b.padding += rows * sum(align_up(n_fp * e, A) - n_fp * e for e in sections)
    # Salient prompt tokens: a window-dtype row and a position each, beside their codes.
    n_sal = min(config.salient, n_held) if config.keeps_salient(which, fmt) else 0
    b.salient = rows * n_sal * (per_token + SALIENT_INDEX_BYTES)
    b.padding += rows * sum(align_up(n_sal * e, A) - n_sal * e for e in [*sections, SALIENT_INDEX_BYTES])
    # Codes, in pages.
    cb = codes_nbytes(fmt, D)
    b.payload = rows * n_held * cb
    b.page_rounding += rows * (pages * P - n_held) * cb
    b.padding += rows * pages * (align_up(P * cb, A) - P * cb)
    # Scales and zero points.
    if not fmt.is_float and pages:
        sb = fmt.scale_bytes
        n_meta = 2 if fmt.has_zero else 1
        if is_static(fmt.granularity):
            nH, nT, nD = scale_shape(fmt, h, n_q, D, P)
            # a fixed scale is a constant of the format: nothing is stored
            b.static = 0 if fmt.fixed_scale is not None else nH * nT * nD * sb * n_meta
        else:
            _, bt, bd = block_shape(fmt, h, n_q, D, P)
            nD = D // bd
            # the blocks of the held pages, less those wholly behind the window in the first
            used = (-(-n_q // bt) - (max(live, q0) - start) // bt) * nD
            per_page = (P // bt) * nD
            b.scales = rows * used * sb
            b.zeros = b.scales if fmt.has_zero else 0
            b.page_rounding += rows * (pages * per_page - used) * sb * n_meta
            b.padding += rows * pages * (align_up(per_page * sb, A) - per_page * sb) * n_meta
        b.static += table_nbytes(fmt)  # a codebook's levels, once per head group
    seed = rows * (T - live) * round(D * fmt.element_bits) // 8
    return b, seed


def account(
    config: CacheConfig,
    shape: ModelShape,
    tokens: int,
    *,
    batch: int = 1,
    page_size: int | None = None,
    prefill_quantized: int = 0,
) -> MemoryReport:
    """Exact cache bytes.

    Parameters
    ----------
    config
        The cache config (its ``page_size`` unless ``page_size`` is given).
    shape
        Layers, kv heads and head dim of the model.
    tokens
        Cached tokens per sequence (``T``).
    batch
        Number of sequences, each with its own pages and full-precision rows.
    page_size
        Tokens per page, overriding the config's.
    prefill_quantized
        The first this many tokens arrived as a prefill that was quantized whole, window
        ignored (``kverr evaluate``'s default policy; :func:`kverr.quant.token_regions`); 0:
        the window always holds the most recent tokens.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ShapeError(f"tokens={tokens!r}: must be a non-negative integer")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ShapeError(f"batch={batch!r}: must be a positive integer")
    if page_size is not None:
        config = config.with_(page_size=page_size)
    config.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
    report = MemoryReport(config.name or "config", shape, tokens, batch, config.page_size)
    for layer in range(shape.n_layers):
        entry: dict[str, Bytes] = {}
        for w in WHICH:
            total = Bytes()
            for fmt, window, heads in config.window_groups(layer, shape.n_kv_heads, w):
                b, seed = group_bytes(config, fmt, len(heads), tokens, shape.head_dim, batch, prefill_quantized,
                                      shape.sliding_window(layer), which=w, window=window)
                total.add(b)
                report.seed_bytes += seed
            entry[w] = total
        if config.key_moments is not None:  # the layer's share of the static query moments
            entry["k"].static += config.key_moments.layer_nbytes()
        report.per_layer.append(entry)
    return report


def parse_shape(text: str) -> ModelShape:
    """``"L,H,D"`` or ``"L,H,D,HQ"`` (query heads last) -> :class:`ModelShape`."""
    try:
        parts = [int(p) for p in text.split(",")]
        if len(parts) not in (3, 4):
            raise ValueError
    except ValueError:
        raise ConfigError(f"shape {text!r} is not allowed; give LAYERS,KV_HEADS,HEAD_DIM[,Q_HEADS] e.g. 30,3,64 "
                          "or 30,3,64,9") from None
    return ModelShape(*parts[:3], n_q_heads=parts[3] if len(parts) == 4 else None)
