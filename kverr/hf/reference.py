"""A transformers ``Cache`` that stores K and V quantized per a :class:`~kverr.config.CacheConfig`.

Each layer keeps, per group of kv heads sharing a format, the sink tokens and the pending
(most recent) tokens in ``window_dtype`` (:class:`kverr.quant.store.WindowRows`) and the tokens
between as packed codes + scales (:class:`kverr.quant.QTensor` chunks). Memory is really saved:
codes are packed bytes; the cache reports the bytes it holds (:meth:`KverrCache.nbytes`).

Token policy (the same as :func:`kverr.quant.reconstruct`): after every update, pending tokens
beyond the ``window`` most recent (the group's own, :meth:`~kverr.config.CacheConfig.window_for`) are quantized in whole token blocks of the format (one token
for per-token scales; ``G`` tokens for KIVI-style per-channel key groups; a page for per-page
scales), so a token moves into quantized storage when its block fills. :meth:`KverrCache.flush`
quantizes every whole block regardless of the window (the "quantize the prefill" protocol of
:mod:`kverr.evaluation`). The prefill (the first update) attends to its own fresh values; every
later step stores its tokens first and attends to everything as stored, the new tokens included
-- what a serving engine's decode does, and what the kernel path (:class:`kverr.hf.kernel.KernelKVCache`) does.

Static granularities (``tensor``, ``head``, ``channel`` over all tokens) take their scales from
the first chunk they quantize (the prefill) unless ``static_scales`` were given (calibrated), and
keep them: later tokens beyond that range saturate, as they would in a deployed cache.

Left-padded batches (``generate(input_ids, attention_mask=...)``): transformers gives the pad
positions of a left-padded prompt position id 0 and each sequence's real tokens the positions
``0..n-1`` (the attention mask's cumulative sum); the cache reads the pads off the position ids of
the first update (:func:`left_pads`). Pads are never stored, so nothing about them is quantized:
each sequence is then stored on its own from its first real token, as if it had been alone --
its sinks are its own first real tokens, its token blocks (per-page, per-channel groups) start at
its first real token, its keys are stored before RoPE at its own positions -- and the window is
the most recent tokens (the same positions for every sequence: the padding is on the left).
Reading gives the pad positions zeros, which the attention mask hides. Static scales not given
are the one exception to "as if alone": they are shared by the batch (as a deployed cache's
calibrated scales are), set jointly from the real tokens the sequences quantize in the first
update that quantizes any -- pads never count. A prompt with no padding, or a model that does not
pass ``position_ids`` to its cache, is stored as one batch.

:meth:`KverrLayer.crop` (speculative/assisted decoding) is exact: it removes tokens of the last
update by restoring the cache as it was before that update and storing the kept part again, so
the cache then holds what it would hold had only the kept tokens arrived (token policy and static
scales included). Older tokens may already be quantized from values the cache no longer holds:
cropping into them is refused. ``copy.deepcopy`` gives an independent cache; batch selections
(``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``) move stored tensors as
they are.

Keys can be stored before RoPE (``key_pre_rope``): the cache undoes the rotation with the
model's own rotary embedding and applies it again when it reads keys back.

With ``key_rounding`` ``"compensated"`` the cache waits for the prefill's queries as it does for
salient tokens, and every integer key format then chooses the codes of the keys it quantizes with
the prefill -- and by a :meth:`KverrCache.flush` before the next update -- by
:mod:`kverr.quant.compensated` under the second moment of the prefill's last queries (per sequence
and kv head), turned to each token's position for keys stored before RoPE. The moment is dropped
at the next update: keys quantized later (those that leave the window while the sequence decodes)
round to nearest on the same grid, and the cache keeps no per-sequence state beyond its tokens.
A config with ``key_moments`` (static moments from a calibration capture) needs no queries: every
key it quantizes, prompt and decode, of every sequence, is rounded under its layer and head's
moment.

On a CUDA device the paged Triton path (:class:`kverr.hf.kernel.KernelKVCache`) runs the same
config; this class is the CPU reference path that evaluation runs on.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kverr.config import WHICH, CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.quant import QTensor, QuantFormat, dequantize, is_static, quantize, token_block
from kverr.quant.compensated import compensable, compensated_quantize, query_moment, turned_cost
from kverr.quant.store import SALIENT_INDEX_DTYPE, WindowRows, fit_static_scales, without_salient
from kverr.quant.reference import table_nbytes
from kverr.rope import rotate, unrotate

log = logging.getLogger(__name__)

try:  # transformers >= 4.56 has layer-based caches
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("kverr.hf needs transformers >= 4.56 (layer-based caches)") from exc

Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def model_rotary(model: Any, layer: int | None = None) -> Rotary:
    """``positions [T] -> (cos, sin) [T, D]`` from a transformers model's own rotary embedding
    (models whose tables cover half the head dim, as gpt-oss's, get them repeated over both);
    models with a RoPE per layer type (Gemma 3) give the one of ``layer``'s type."""
    import inspect

    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise ConfigError("key_pre_rope needs the model's rotary embedding (model.model.rotary_emb); none found")
    param = next(model.parameters())

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kw: dict[str, Any] = {}
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        types = getattr(cfg, "layer_types", None)
        if layer is None or types is None:
            raise ConfigError("the model has a RoPE per layer type: model_rotary needs the layer")
        kw["layer_type"] = types[layer]

    def fn(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.zeros(1, device=param.device, dtype=torch.float32)
        cos, sin = rotary(dummy, positions.reshape(1, -1).to(param.device), **kw)
        cos, sin = cos[0].float(), sin[0].float()
        if 2 * cos.shape[-1] == head_dim:
            # half-width tables (gpt-oss rotates [x1, x2] to [x1 cos - x2 sin, x2 cos + x1 sin]):
            # the same rotation as rotate_half with each table repeated over both halves
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return cos, sin

    fn.layer_type = kw.get("layer_type")  # layers of one type share their tables
    return fn


def left_pads(kwargs: dict[str, Any], batch: int, n: int) -> list[int] | None:
    """The pad count of each sequence of a left-padded first update, read off ``position_ids``
    (from transformers' generate: pads at position 0, real tokens at ``0..n_b-1``); None when the
    update carries no ``[batch, n]`` position ids of that form (then nothing is taken as padding)."""
    pos = kwargs.get("position_ids")
    if pos is None and isinstance(kwargs.get("kwargs"), dict):
        pos = kwargs["kwargs"].get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or tuple(pos.shape) != (batch, n) or n == 0:
        return None
    pos = pos.long()
    pads = []
    for row in pos:
        p = n - 1 - int(row[-1])
        if not 0 <= p < n:
            return None
        if not torch.equal(row[p:].cpu(), torch.arange(n - p)) or bool((row[:p] != 0).any()):
            return None
        pads.append(p)
    return pads


@dataclass
class _Group:
    """Storage of one (K|V, head group) of one layer."""

    fmt: QuantFormat
    heads: list[int]
    window: int  # recent tokens kept unquantized (config.window_for the heads)
    sinks: WindowRows | None = None  # [B, h, s, D] window_dtype
    chunks: list[QTensor] = field(default_factory=list)  # quantized, in token order
    # dequantize(chunk) of chunks[i], kept because a stored chunk never changes: a decode step
    # then reads the cache without dequantizing all of it again (a compute cache, not storage:
    # not counted by nbytes)
    decoded: list[torch.Tensor] = field(default_factory=list)
    pending: WindowRows | None = None  # [B, h, p, D] window_dtype
    static_scale: torch.Tensor | None = None
    static_zero: torch.Tensor | None = None
    # salient prompt tokens (config.salient): their rows as received, and positions [B, h, m]
    salient: WindowRows | None = None
    salient_pos: torch.Tensor | None = None
    # config.key_rounding "compensated", keys: the prefill queries' second moment [B, h, D, D]
    # float64 that weighs the rounding of the group's keys (a cost, not storage); with static
    # config.key_moments, the layer's [1, h, D, D] for every sequence
    key_cost: torch.Tensor | None = None

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
        total += table_nbytes(self.fmt) if self.chunks else 0  # a codebook's levels
        total += sum(r.nbytes for r in (self.sinks, self.pending, self.salient) if r is not None)
        if self.salient_pos is not None:
            total += self.salient_pos.numel() * self.salient_pos.element_size()
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
    """One layer of a :class:`KverrCache`.

    A left-padded batch is stored as one :class:`KverrLayer` per sequence (``rows``), each fed
    only its real tokens; see the module documentation for the rule.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # crop restores the last update exactly (see crop)

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
            w: [_Group(fmt, heads, window) for fmt, window, heads in config.window_groups(layer_idx, n_kv_heads, w)]
            for w in WHICH
        }
        if config.key_moments is not None:  # static: one cost for every sequence, never dropped
            moment = config.key_moments.layer(layer_idx)
            for g in (g for g in self.groups["k"] if compensable(g.fmt)):
                g.key_cost = moment[None, g.heads]
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        # a left-padded batch: one layer per sequence, fed its real tokens; pads per sequence
        self.rows: list[KverrLayer] | None = None
        self.pads: list[int] | None = None
        # (state before the last update, its keys, its values, its pads): what crop restores
        self._undo: tuple[dict[str, Any], torch.Tensor, torch.Tensor, list[int] | None] | None = None
        self._no_undo = "it holds no update"  # why there is nothing to undo
        # config.needs_queries: the prefill's keys while the layer waits for their queries (observe)
        self._awaiting: torch.Tensor | None = None

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
        start = self.cumulative_length
        pads = left_pads(kwargs, key_states.shape[0], key_states.shape[-2]) if start == 0 else None
        if start > 0:
            self._forget_key_cost()
        self._store_update(key_states, value_states, pads)
        if start == 0 and self.config.needs_queries:
            # nothing is quantized before the prefill's queries choose the salient tokens or
            # weigh the keys' rounding
            from kverr.hf.salient import await_queries

            self._awaiting = key_states
            await_queries(key_states, self)
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

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers 5; a positive value is the
        length to keep, as transformers 4 passes it; 0 removes nothing).

        Exact: the cache goes back to its state before the last update and stores that update's
        kept tokens again, so it holds what it would hold had only those tokens arrived (the
        token policy and static scales re-derived from them). Only tokens of the last update
        can be removed -- older ones may already be quantized from values the cache no longer
        holds -- and not after :meth:`KverrCache.flush` or a batch selection.
        """
        T = self.cumulative_length
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, T - tokens_to_remove)
        if remove == 0:
            return
        if self._undo is None:
            raise ConfigError(f"layer {self.layer_idx}: cannot crop {remove} of {T} tokens: {self._no_undo}, so the "
                              "cache cannot re-derive what it would hold without them")
        last = self._undo[1].shape[-2]
        if remove > last:
            raise ConfigError(f"layer {self.layer_idx}: cannot crop {remove} of {T} tokens: only the {last} tokens of "
                              "the last update can be removed exactly (older ones may already be quantized from "
                              "values the cache no longer holds)")
        before, k, v, pads = self._undo
        if self.config.needs_queries and before["length"] == 0:
            raise ConfigError(f"layer {self.layer_idx}: cannot crop the prefill of a cache that keeps salient tokens "
                              "or rounds keys with compensation: the prefill's queries chose or weighed them and "
                              "would not be seen again")
        self._restore(before)
        self._undo, self._no_undo = None, "the last update was already cropped away"
        keep = last - remove
        if keep:
            self._store_update(k[..., :keep, :], v[..., :keep, :], pads)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the sequences ``beam_idx`` (beam search): every stored tensor is selected along
        the batch, codes and scales as stored, so nothing is quantized again. Static scales are
        shared by the batch and stay. A sequence of a padded batch taken twice is copied."""
        if self.cumulative_length == 0:
            return
        self._undo, self._no_undo = None, "the batch was reordered or selected after the last update"
        if self.rows is not None:
            idx = [int(i) for i in beam_idx.tolist()]
            taken: set[int] = set()
            rows = []
            for i in idx:
                rows.append(copy.deepcopy(self.rows[i]) if i in taken else self.rows[i])
                taken.add(i)
            self.rows, self.pads = rows, [self.pads[i] for i in idx]
            return
        for w in WHICH:
            for g in self.groups[w]:
                g.sinks = None if g.sinks is None else g.sinks.select(beam_idx)
                g.pending = None if g.pending is None else g.pending.select(beam_idx)
                g.chunks = [_select_batch(c, beam_idx) for c in g.chunks]
                g.decoded = [d.index_select(0, beam_idx.to(d.device)) for d in g.decoded]
                if g.salient is not None:
                    g.salient = g.salient.select(beam_idx)
                    g.salient_pos = g.salient_pos.index_select(0, beam_idx.to(g.salient_pos.device))
                if g.key_cost is not None and self.config.key_moments is None:  # static ones are shared
                    g.key_cost = g.key_cost.index_select(0, beam_idx.to(g.key_cost.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if self.cumulative_length == 0:
            return
        self.reorder_cache(torch.arange(self._batch()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices`` (integer indices or a boolean mask)."""
        if self.cumulative_length == 0:
            return
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.reorder_cache(indices.long())

    def reset(self) -> None:
        self.cumulative_length = 0
        self.rows = self.pads = self._undo = None
        self._no_undo = "it holds no update"
        self._release()
        for w in WHICH:
            self.groups[w] = [_Group(g.fmt, g.heads) for g in self.groups[w]]

    # ---- storage ---------------------------------------------------------------------------

    def _batch(self) -> int:
        if self.rows is not None:
            return len(self.rows)
        for w in WHICH:
            for g in self.groups[w]:
                for t in (g.sinks, g.pending):
                    if t is not None:
                        return int(t.data.shape[0])
                if g.chunks:
                    return int(g.chunks[0].shape[0])
        raise ShapeError(f"layer {self.layer_idx} holds no tokens yet")

    def _state(self) -> dict[str, Any]:
        """What an update changes, as references (stored tensors are never modified in place)."""
        return {
            "length": self.cumulative_length,
            "groups": {w: [(g.sinks, list(g.chunks), list(g.decoded), g.pending, g.static_scale, g.static_zero,
                            g.salient, g.salient_pos, g.key_cost) for g in self.groups[w]] for w in WHICH},
            "rows": None if self.rows is None else [(r, r._state()) for r in self.rows],
            "pads": self.pads,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.cumulative_length = state["length"]
        for w in WHICH:
            for g, saved in zip(self.groups[w], state["groups"][w]):
                (g.sinks, chunks, decoded, g.pending, g.static_scale, g.static_zero, g.salient, g.salient_pos,
                 g.key_cost) = saved
                g.chunks, g.decoded = list(chunks), list(decoded)
        self.rows, self.pads = None, state["pads"]
        if state["rows"] is not None:
            self.rows = []
            for r, s in state["rows"]:
                r._restore(s)
                self.rows.append(r)

    def _store_update(self, k: torch.Tensor, v: torch.Tensor, pads: list[int] | None) -> None:
        """Store one update (``pads``: of a first update) and remember how to undo it."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        before = self._state()
        start, n = self.cumulative_length, k.shape[-2]
        if start == 0 and pads is not None and any(pads):
            self.rows = [KverrLayer(self.config, self.layer_idx, self.n_kv_heads, self.rotary, self.static_scales)
                         for _ in pads]
            self.pads = list(pads)
        # a cache with salient tokens or compensated keys quantizes the prefill once its queries
        # chose or weighed them (observe)
        defer = self.config.needs_queries and start == 0
        if self.rows is None:
            self._ingest(k, v)
            if not defer:
                self._flush(respect_window=True)
        else:
            if k.shape[0] != len(self.rows):
                raise ShapeError(f"layer {self.layer_idx} holds {len(self.rows)} sequences, got a batch of {k.shape[0]}")
            for b, (row, p) in enumerate(zip(self.rows, self.pads)):
                lo = max(0, p - start)  # the pads of this update (those of the prefill)
                if lo < n:
                    row._ingest(k[b:b + 1, :, lo:], v[b:b + 1, :, lo:])
            if not defer:
                self._share_static_scales(respect_window=True)
                for row in self.rows:
                    row._flush(respect_window=True)
            self.cumulative_length += n
        self._undo = (before, k, v, pads)

    def _ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens (keys before RoPE if the config says so) without quantizing any."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        start, n = self.cumulative_length, k.shape[-2]
        keys_in = k
        if self.config.key_pre_rope:
            cos, sin = self._cos_sin(start, start + n)
            keys_in = unrotate(k.float(), cos, sin)
        self._append("k", keys_in)
        self._append("v", v)
        self.cumulative_length += n

    def _share_static_scales(self, respect_window: bool) -> None:
        """Padded batch: static scales not given are set once, jointly over the real tokens the
        sequences quantize in the first update that quantizes any (as one batch does)."""
        for w in WHICH:
            if self.static_scales.get(w) is not None:
                continue
            for gi, g0 in enumerate(self.rows[0].groups[w]):
                if g0.fmt.is_float or not is_static(g0.fmt.granularity) or g0.static_scale is not None:
                    continue
                blocks = []
                for row in self.rows:
                    g = row.groups[w][gi]
                    n = row._flushable(g, respect_window)
                    if n:
                        blocks.append(row._fit_tokens(g, g.pending.tokens(0, n).float()))
                if not blocks:
                    continue
                scale, zero = fit_static_scales(blocks, g0.fmt, self.config.page_size)
                for row in self.rows:
                    row.groups[w][gi].static_scale, row.groups[w][gi].static_zero = scale, zero

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

    def _flushable(self, g: _Group, respect_window: bool) -> int:
        """How many pending tokens of ``g`` the token policy quantizes now (whole token blocks)."""
        avail = g.n_pending - (g.window if respect_window else 0)
        tb = token_block(g.fmt.granularity, self.config.page_size)
        return max(0, avail) // tb * tb

    def _flush(self, respect_window: bool) -> None:
        if self._awaiting is not None:
            raise ConfigError(
                f"layer {self.layer_idx}: the config keeps salient tokens or rounds keys with compensation, both "
                "from the prefill's queries, and this cache never saw them: build it with "
                "KverrCache.for_model(model, config) and run the prefill through that model")
        if self.rows is not None:
            self._share_static_scales(respect_window)
            for row in self.rows:
                row._flush(respect_window)
            return
        for w in WHICH:
            for g in self.groups[w]:
                n = self._flushable(g, respect_window)
                if n == 0:
                    continue
                block = g.pending.tokens(0, n).float()
                g.pending = g.pending.tokens(n)
                g.chunks.append(self._quantize(w, g, block))

    def _quantize(self, which: str, g: _Group, x: torch.Tensor) -> QTensor:
        fmt, P = g.fmt, self.config.page_size
        if fmt.is_float or not is_static(fmt.granularity):
            return self._encode(g, x)
        if g.static_scale is None:
            given = self.static_scales.get(which)
            if given is not None:
                g.static_scale, g.static_zero = given
            else:  # first chunk (the prefill) sets the static scales, jointly over the batch
                g.static_scale, g.static_zero = fit_static_scales([self._fit_tokens(g, x)], fmt, P)
        return self._encode(g, x, g.static_scale, g.static_zero)

    def _encode(self, g: _Group, x: torch.Tensor, scale: torch.Tensor | None = None,
                zero: torch.Tensor | None = None) -> QTensor:
        """The block ``x [B, h, n, D]`` (the next after the sinks and the quantized tokens) in
        ``g``'s format: compensated codes where the group has a key cost
        (:mod:`kverr.quant.compensated`; turned to each token's position for keys stored before
        RoPE), the format's own rounding elsewhere."""
        P = self.config.page_size
        if g.key_cost is None:
            return quantize(x, g.fmt, page_size=P, scale=scale, zero=zero)
        cost = g.key_cost[:, :, None]  # [B, h, 1, D, D]: one for every token after RoPE
        if self.config.key_pre_rope:
            lo = g.n_sinks + g.n_quantized
            cost = turned_cost(g.key_cost, *self._cos_sin(lo, lo + x.shape[2]))
        return compensated_quantize(x, g.fmt, cost.to(x.device), page_size=P, scale=scale, zero=zero)

    def _read(self, which: str) -> torch.Tensor | None:
        """Everything stored for ``which`` as ``[B, H, T, D]`` float32 (post-RoPE keys), or None.
        A padded batch reads zeros at its pad positions."""
        if self.cumulative_length == 0:
            return None
        if self.rows is not None:
            out = None
            for b, row in enumerate(self.rows):
                x = row._read(which)
                if x is None:  # a sequence whose tokens so far are all pads
                    continue
                if out is None:
                    out = torch.zeros((len(self.rows), self.n_kv_heads, self.cumulative_length, x.shape[-1]),
                                      dtype=torch.float32, device=x.device)
                out[b, :, self.cumulative_length - x.shape[2]:] = x[0]
            return out
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
            if g.salient is not None and g.salient.n:
                pos = g.salient_pos.long()[..., None].expand(*g.salient_pos.shape, x.shape[-1])
                x = x.scatter(2, pos.to(x.device), g.salient.float())
            if out is None:
                B, _, T, D = x.shape
                out = torch.empty((B, self.n_kv_heads, T, D), dtype=torch.float32, device=x.device)
            out[:, g.heads] = x
        if which == "k" and self.config.key_pre_rope and out is not None:
            cos, sin = self._cos_sin(0, out.shape[2])
            out = rotate(out, cos, sin)
        return out

    # ---- salient tokens (config.salient; kverr.hf.salient) ----------------------------------

    def observe(self, query: torch.Tensor, key: torch.Tensor, scaling: float, *, sliding_window: int = 0,
                sink: torch.Tensor | None = None) -> None:
        """The prefill's queries ``[B, q_head, n, D]`` and fresh keys ``[B, kv_head, n, D]``:
        choose each sequence's salient tokens and keep their rows (``config.salient``), take the
        second moment of its last :data:`~kverr.error.salient.OBSERVED_QUERIES` queries as the
        cost that weighs the rounding of the keys quantized with the prefill
        (``config.key_rounding`` ``"compensated"``, integer key formats; dropped at the next
        update), then quantize the prefill as the token policy says."""
        from kverr.error.salient import OBSERVED_QUERIES, positions

        self._release()
        ctx = dict(scaling=scaling, sliding_window=sliding_window, sink=sink)
        # (the layer storing the sequences, their queries and keys); a padded batch: per row,
        # from its first real token
        seqs = ([(self, query, key)] if self.rows is None
                else [(r, query[b:b + 1, :, p:], key[b:b + 1, :, p:]) for b, (r, p) in enumerate(zip(self.rows, self.pads))])
        for layer, q, k in seqs:
            if self.config.salient:
                pos = positions(self.config, self.layer_idx, q, k, **ctx)  # [B, kv_head, m]
                for g in (g for w in WHICH for g in layer.groups[w] if self.config.keeps_salient(w, g.fmt)):
                    g.salient = g.pending.gather(pos[:, g.heads] - (g.n_sinks + g.n_quantized))
                    g.salient_pos = pos[:, g.heads].to(SALIENT_INDEX_DTYPE)
            if self.config.compensates_keys and self.config.key_moments is None:
                moment = query_moment(q, self.n_kv_heads, OBSERVED_QUERIES)
                for g in (g for g in layer.groups["k"] if compensable(g.fmt)):
                    g.key_cost = moment[:, g.heads]
        self._flush(respect_window=True)

    def _forget_key_cost(self) -> None:
        """Drop the prefill's query moment (``key_rounding`` ``"compensated"``): it weighs the keys
        quantized with the prefill and by a flush before the next update, no later ones, so the
        cache keeps nothing per sequence while it decodes. Static moments (``key_moments``) stay."""
        if self.config.key_moments is not None:
            return
        for layer in [self] if self.rows is None else self.rows:
            for g in layer.groups["k"]:
                g.key_cost = None

    def _release(self) -> None:
        """Stop waiting for the prefill's queries."""
        if self._awaiting is not None:
            from kverr.hf.salient import forget

            forget(self._awaiting)
            self._awaiting = None

    def _fit_tokens(self, g: _Group, x: torch.Tensor) -> torch.Tensor:
        """The tokens of the block ``x [B, h, n, D]`` about to be quantized (the next after the
        sinks and the quantized ones) that static scales are fitted on: all but the salient.
        Static scales are fitted on the first block, the one :meth:`observe` chose the salient
        tokens in."""
        if g.salient_pos is None:
            return x
        return without_salient(x, g.salient_pos.long() - (g.n_sinks + g.n_quantized))

    def nbytes(self) -> int:
        km = self.config.key_moments
        return self._held_nbytes() + (0 if km is None else km.layer_nbytes())  # static moments, once

    def _held_nbytes(self) -> int:
        if self.rows is not None:
            return sum(row._held_nbytes() for row in self.rows)
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
        rotary: Rotary | Sequence[Rotary] | None = None,
        static_scales: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor | None]]] | None = None,
    ) -> None:
        config.check_model(n_layers, n_kv_heads, head_dim)
        if config.key_pre_rope and rotary is None:
            raise ConfigError("config.key_pre_rope needs the model's rotary embedding: use KverrCache.for_model")
        self.config = config
        static_scales = static_scales or {}
        per_layer = list(rotary) if isinstance(rotary, (list, tuple)) else [rotary] * n_layers
        layers = [KverrLayer(config, i, n_kv_heads, per_layer[i], static_scales.get(i)) for i in range(n_layers)]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model: Any, config: CacheConfig, **kwargs: Any) -> KverrCache:
        """A cache shaped for a transformers causal LM."""
        from kverr.capturing.model import model_dims

        n_layers, _, n_kv, head_dim, _ = model_dims(model.config)
        rotary = [model_rotary(model, i) for i in range(n_layers)] if config.key_pre_rope else None
        if config.needs_queries:
            from kverr.hf.salient import observe_queries

            observe_queries(model)
        return cls(config, n_layers, n_kv, head_dim, rotary=rotary, **kwargs)

    def flush(self) -> None:
        """Quantize every whole token block now, ignoring the window (sinks stay full precision)."""
        for layer in self.layers:
            layer._flush(respect_window=False)
            # the tokens just quantized cannot be un-quantized by crop
            layer._undo, layer._no_undo = None, "the cache was flushed after its last update"

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
