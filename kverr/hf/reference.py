"""A transformers ``Cache`` that stores K and V quantized per a :class:`~kverr.config.CacheConfig`.

Each layer keeps, per group of kv heads sharing a format, the sink tokens and the pending
(most recent) tokens in ``window_dtype`` (:class:`kverr.quant.store.WindowRows`) and the tokens
between as packed codes + scales (:class:`kverr.quant.QTensor` chunks). Memory is really saved:
codes are packed bytes; the cache reports the bytes it holds (:meth:`KverrCache.nbytes`).

Token policy (the same as :func:`kverr.quant.reconstruct`): after every update, pending tokens
beyond the ``window`` most recent are quantized in whole token blocks of the format (one token
for per-token scales; ``G`` tokens for KIVI-style per-channel key groups; a page for per-page
scales), so a token moves into quantized storage when its block fills. :meth:`KverrCache.flush`
quantizes every whole block regardless of the window (the "quantize the prefill" protocol of
:mod:`kverr.evaluation`). The prefill (the first update) attends to its own fresh values; every
later step stores its tokens first and attends to everything as stored, the new tokens included
-- what a serving engine's decode does, and what the kernel path (:class:`kverr.hf.kernel.KernelKVCache`) does.

Static granularities (``tensor``, ``head``, ``channel`` over all tokens) take their scales from
the first chunk they quantize (the prefill) unless ``static_scales`` were given (calibrated), and
keep them: later tokens beyond that range saturate, as they would in a deployed cache.

Keys can be stored before RoPE (``key_pre_rope``): the cache undoes the rotation with the
model's own rotary embedding and applies it again when it reads keys back.

On a CUDA device the paged Triton path (:class:`kverr.hf.kernel.KernelKVCache`) runs the same
config; this class is the CPU reference path that evaluation runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kverr.config import WHICH, CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.quant import QTensor, QuantFormat, dequantize, is_static, quantize, token_block
from kverr.quant.store import WindowRows
from kverr.rope import rotate, unrotate

log = logging.getLogger(__name__)

try:  # transformers >= 4.56 has layer-based caches
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("kverr.hf needs transformers >= 4.56 (layer-based caches)") from exc

Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def model_rotary(model: Any) -> Rotary:
    """``positions [T] -> (cos, sin) [T, D]`` from a transformers model's own rotary embedding."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise ConfigError("key_pre_rope needs the model's rotary embedding (model.model.rotary_emb); none found")
    param = next(model.parameters())

    def fn(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.zeros(1, device=param.device, dtype=torch.float32)
        cos, sin = rotary(dummy, positions.reshape(1, -1).to(param.device))
        return cos[0].float(), sin[0].float()

    return fn


@dataclass
class _Group:
    """Storage of one (K|V, head group) of one layer."""

    fmt: QuantFormat
    heads: list[int]
    sinks: WindowRows | None = None  # [B, h, s, D] window_dtype
    chunks: list[QTensor] = field(default_factory=list)  # quantized, in token order
    # dequantize(chunk) of chunks[i], kept because a stored chunk never changes: a decode step
    # then reads the cache without dequantizing all of it again (a compute cache, not storage:
    # not counted by nbytes)
    decoded: list[torch.Tensor] = field(default_factory=list)
    pending: WindowRows | None = None  # [B, h, p, D] window_dtype
    static_scale: torch.Tensor | None = None
    static_zero: torch.Tensor | None = None

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.n

    @property
    def n_quantized(self) -> int:
        return sum(c.shape[-2] for c in self.chunks)

    @property
    def n_pending(self) -> int:
        return 0 if self.pending is None else self.pending.n

    def nbytes(self) -> int:
        tensors = [self.static_scale, self.static_zero]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        total += sum(r.nbytes for r in (self.sinks, self.pending) if r is not None)
        return total + sum(c.nbytes for c in self.chunks)


def _select_batch(qt: QTensor, index: torch.Tensor) -> QTensor:
    """``qt`` for the sequences ``index`` of its leading batch dim. Metadata without that dim
    (static scales, shared by the batch) is kept as it is."""
    lead = qt.codes.ndim

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.ndim < lead:
            return t
        return t.index_select(0, index.to(t.device))

    shape = (int(index.numel()), *qt.shape[1:])
    return QTensor(pick(qt.codes), pick(qt.scale), pick(qt.zero), qt.fmt, shape, qt.page_size)


class KverrLayer(CacheLayerMixin):
    """One layer of a :class:`KverrCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        config: CacheConfig,
        layer_idx: int,
        n_kv_heads: int,
        rotary: Rotary | None = None,
        static_scales: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.n_kv_heads = n_kv_heads
        self.rotary = rotary
        self.static_scales = static_scales or {}
        self.cumulative_length = 0
        self.groups: dict[str, list[_Group]] = {
            w: [_Group(fmt, heads) for fmt, heads in config.head_groups(layer_idx, n_kv_heads, w)] for w in WHICH
        }
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    # ---- transformers API -----------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.ndim != 4 or key_states.shape[1] != self.n_kv_heads:
            raise ShapeError(
                f"layer {self.layer_idx}: keys of shape {tuple(key_states.shape)} do not have "
                f"{self.n_kv_heads} kv heads on dim 1 ([batch, kv_head, token, channel])"
            )
        D = key_states.shape[-1]
        for w in WHICH:
            for g in self.groups[w]:
                g.fmt.check_head_dim(D, f"layer {self.layer_idx} {w}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length
        n = key_states.shape[-2]
        keys_in = key_states
        if self.config.key_pre_rope:
            cos, sin = self._cos_sin(start, start + n)
            keys_in = unrotate(key_states.float(), cos, sin)
        self._append("k", keys_in)
        self._append("v", value_states)
        self.cumulative_length += n
        self._flush(respect_window=True)
        if start == 0:
            # The prefill attends to its fresh values, as a serving engine's prefill does.
            return key_states, value_states
        # Later steps read everything from storage, the new tokens as stored (as vLLM's decode
        # does after reshape_and_cache, and as the kernel path does).
        return self._read("k").to(key_states.dtype), self._read("v").to(value_states.dtype)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the sequences ``beam_idx`` (beam search): every stored tensor is selected along
        the batch, codes and scales as stored, so nothing is quantized again. Static scales are
        shared by the batch and stay."""
        if self.cumulative_length == 0:
            return
        for w in WHICH:
            for g in self.groups[w]:
                g.sinks = None if g.sinks is None else g.sinks.select(beam_idx)
                g.pending = None if g.pending is None else g.pending.select(beam_idx)
                g.chunks = [_select_batch(c, beam_idx) for c in g.chunks]
                g.decoded = [d.index_select(0, beam_idx.to(d.device)) for d in g.decoded]

    def reset(self) -> None:
        self.cumulative_length = 0
        for w in WHICH:
            self.groups[w] = [_Group(g.fmt, g.heads) for g in self.groups[w]]

    # ---- storage ---------------------------------------------------------------------------

    def _cos_sin(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is None:
            raise ConfigError("this config quantizes keys before RoPE: build the cache with KverrCache.for_model")
        return self.rotary(torch.arange(lo, hi, device=self.device))

    def _append(self, which: str, x: torch.Tensor) -> None:
        for g in self.groups[which]:
            part = WindowRows.store(x[:, g.heads], self.config.window_dtype)
            take = max(0, min(self.config.sinks - g.n_sinks, part.n))
            if take:
                head = part.tokens(0, take)
                g.sinks = head if g.sinks is None else g.sinks.cat(head)
                part = part.tokens(take)
            if part.n:
                g.pending = part if g.pending is None else g.pending.cat(part)

    def _flush(self, respect_window: bool) -> None:
        P = self.config.page_size
        for w in WHICH:
            for g in self.groups[w]:
                avail = g.n_pending - (self.config.window if respect_window else 0)
                tb = token_block(g.fmt.granularity, P)
                n = max(0, avail) // tb * tb
                if n == 0:
                    continue
                block = g.pending.tokens(0, n).float()
                g.pending = g.pending.tokens(n)
                g.chunks.append(self._quantize(w, g, block))

    def _quantize(self, which: str, g: _Group, x: torch.Tensor) -> QTensor:
        fmt, P = g.fmt, self.config.page_size
        if fmt.is_float or not is_static(fmt.granularity):
            return quantize(x, fmt, page_size=P)
        if g.static_scale is None:
            given = self.static_scales.get(which)
            if given is not None:
                g.static_scale, g.static_zero = given
            else:  # first chunk (the prefill) sets the static scales, jointly over the batch
                B, h, n, D = x.shape
                ref = quantize(x.permute(1, 0, 2, 3).reshape(1, h, B * n, D), fmt, page_size=P)
                g.static_scale, g.static_zero = ref.scale[0], None if ref.zero is None else ref.zero[0]
        return quantize(x, fmt, page_size=P, scale=g.static_scale, zero=g.static_zero)

    def _read(self, which: str) -> torch.Tensor | None:
        """Everything stored for ``which`` as ``[B, H, T, D]`` float32 (post-RoPE keys), or None."""
        if self.cumulative_length == 0:
            return None
        out: torch.Tensor | None = None
        for g in self.groups[which]:
            parts = []
            if g.sinks is not None:
                parts.append(g.sinks.float())
            for i in range(len(g.decoded), len(g.chunks)):
                g.decoded.append(dequantize(g.chunks[i]))
            parts += g.decoded
            if g.pending is not None and g.pending.n:
                parts.append(g.pending.float())
            x = torch.cat(parts, dim=2)
            if out is None:
                B, _, T, D = x.shape
                out = torch.empty((B, self.n_kv_heads, T, D), dtype=torch.float32, device=x.device)
            out[:, g.heads] = x
        if which == "k" and self.config.key_pre_rope and out is not None:
            cos, sin = self._cos_sin(0, out.shape[2])
            out = rotate(out, cos, sin)
        return out

    def nbytes(self) -> int:
        return sum(g.nbytes() for w in WHICH for g in self.groups[w])


class KverrCache(Cache):
    """A quantized KV cache for any :class:`CacheConfig`.

    Parameters
    ----------
    config
        The cache config (checked against the model shape).
    n_layers, n_kv_heads, head_dim
        Model shape.
    rotary
        ``positions -> (cos, sin)``; needed when ``config.key_pre_rope``. :meth:`for_model`
        takes it from the model.
    static_scales
        Optional calibrated static metadata per layer: ``{layer: {"k": (scale, zero), ...}}``.
    """

    def __init__(
        self,
        config: CacheConfig,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rotary: Rotary | None = None,
        static_scales: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor | None]]] | None = None,
    ) -> None:
        config.check_model(n_layers, n_kv_heads, head_dim)
        if config.key_pre_rope and rotary is None:
            raise ConfigError("config.key_pre_rope needs the model's rotary embedding: use KverrCache.for_model")
        self.config = config
        static_scales = static_scales or {}
        layers = [KverrLayer(config, i, n_kv_heads, rotary, static_scales.get(i)) for i in range(n_layers)]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model: Any, config: CacheConfig, **kwargs: Any) -> KverrCache:
        """A cache shaped for a transformers causal LM."""
        from kverr.capturing.model import model_dims

        n_layers, _, n_kv, head_dim, _ = model_dims(model.config)
        rotary = model_rotary(model) if config.key_pre_rope else None
        return cls(config, n_layers, n_kv, head_dim, rotary=rotary, **kwargs)

    def flush(self) -> None:
        """Quantize every whole token block now, ignoring the window (sinks stay full precision)."""
        for layer in self.layers:
            layer._flush(respect_window=False)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (codes, scales, zero points, fp tokens)."""
        return sum(layer.nbytes() for layer in self.layers)

    def read(self, layer: int, which: str) -> torch.Tensor:
        """What the cache holds for ``which`` of ``layer``, ``[B, H, T, D]`` float32 (post-RoPE)."""
        if which not in WHICH:
            raise ConfigError(f"which={which!r} is not allowed; 'k' or 'v'")
        out = self.layers[layer]._read(which)
        if out is None:
            raise ShapeError(f"layer {layer} holds no tokens yet")
        return out
