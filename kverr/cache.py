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
-- what a serving engine's decode does, and what the kernel path (:class:`KernelKVCache`) does.

Static granularities (``tensor``, ``head``, ``channel`` over all tokens) take their scales from
the first chunk they quantize (the prefill) unless ``static_scales`` were given (calibrated), and
keep them: later tokens beyond that range saturate, as they would in a deployed cache.

Keys can be stored before RoPE (``key_pre_rope``): the cache undoes the rotation with the
model's own rotary embedding and applies it again when it reads keys back.

On a CUDA device the paged Triton path of :mod:`kverr.gpu` is used by the kernel benchmarks and
validation; this class is the CPU reference path that evaluation runs on.
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
    raise ImportError("kverr.cache needs transformers >= 4.56 (layer-based caches)") from exc

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
        from kverr.capturing.model import _shape_from_config

        n_layers, _, n_kv, head_dim, _ = _shape_from_config(model.config)
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


# ---------------------------------------------------------------------------------------------
# The kernel path: the same config on the Triton kernels of kverr.gpu
# ---------------------------------------------------------------------------------------------

_KERNEL_IMPL_PREFIX = "kverr_paged|"


def _register_kernel_attention(inner: str) -> str:
    """Register an attention function that decodes from the paged cache; returns its name.

    Single-token steps of a model that holds a :class:`KernelKVCache` run the fused-dequant
    decode kernel; everything else (the prefill) runs the model's own attention ``inner`` on the
    fresh keys and values, as a serving engine does.
    """
    import sys

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = _KERNEL_IMPL_PREFIX + inner

    def paged_attention(module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        cache = getattr(module, "_kverr_kernel_cache", None)
        if cache is not None and cache.decoding:
            if query.shape[2] == 1:
                out = cache.paged.decode(cache.step, module.layer_idx, query[:, :, 0, :].float(),
                                         sm_scale=kwargs.get("scaling"))
                return out[:, None].to(query.dtype), None  # [B, 1, n_q_heads, D]
            # a later chunk of several tokens: causal attention over the cache as stored
            out = cache.paged.prefill(cache.step, module.layer_idx, query.float(), sm_scale=kwargs.get("scaling"))
            return out.transpose(1, 2).to(query.dtype), None  # [B, n, n_q_heads, D]
        if inner == "eager":
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[inner]
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, paged_attention)
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if inner in masks:
        AttentionMaskInterface.register(name, masks[inner])
    return name


class _KernelLayer(CacheLayerMixin):
    """One layer of a :class:`KernelKVCache`: stores through the quantize-and-store kernel."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: KernelKVCache, layer_idx: int) -> None:
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.owner._store(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.paged.max_pages * self.owner.paged.P


class KernelKVCache(Cache):
    """A transformers cache that runs a :class:`CacheConfig` on the Triton kernels.

    Keys and values go through the quantize-and-store kernel into the paged cache of
    :class:`kverr.gpu.PagedKVCache`; every single-token decode step's attention is the
    fused-dequant decode kernel (installed as the model's attention function while the cache is
    attached; :meth:`close` restores the model). The prefill attends to its fresh values with the
    model's own attention. On a CPU the kernels run in the Triton interpreter
    (``TRITON_INTERPRET=1``), slowly but exactly.

    Static scales not given (``static_scales=...``) are set, per layer, from the first tokens it
    quantizes (the prefill's, sinks and window left out, jointly over the batch), as
    :class:`KverrCache` sets them; a prefill no longer than sinks + window sets them from all its
    tokens (KverrCache waits for its first quantized chunk instead).

    Use :meth:`for_model`; a batch of equal-length sequences. The first forward pass (the prefill)
    attends with the model's own attention; every later one -- single tokens with the decode
    kernel, chunks of several tokens with the chunked-prefill kernel -- attends to the cache as
    stored (sinks and window in full precision, the rest dequantized), as :class:`KverrCache` does.
    """

    def __init__(self, model: Any, config: CacheConfig, *, batch: int = 1, max_tokens: int = 4096, **kwargs: Any) -> None:
        from kverr.capturing.model import _shape_from_config
        from kverr.gpu import PagedKVCache

        n_layers, n_heads, n_kv, head_dim, _ = _shape_from_config(model.config)
        device = next(model.parameters()).device
        self.config = config
        self._cos = self._sin = None
        if config.key_pre_rope:
            # the cache stores keys before RoPE, as KverrCache does: undo the model's rotation on the
            # way in; the decode kernel applies it again per key row from the same tables
            self._cos, self._sin = model_rotary(model)(torch.arange(max_tokens, device=device))
            kwargs["rope"] = (self._cos, self._sin)
        # static scales not given: the prefill sets them, as in KverrCache
        kwargs.setdefault("static_scales", "first")
        self.paged = PagedKVCache(
            config, n_layers=n_layers, n_kv_heads=n_kv, n_q_heads=n_heads, head_dim=head_dim,
            max_batch=batch, max_tokens=max_tokens, device=device, **kwargs,
        )
        self.batch, self.length = batch, 0
        self.step = None
        self.decoding = False
        self._model = model
        self._modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
        if len(self._modules) != n_layers:
            raise ConfigError(f"found {len(self._modules)} attention modules, expected {n_layers}")
        configs = {id(c): c for c in [model.config, *(m.config for m in self._modules if hasattr(m, "config"))]}
        self._saved = {key: (c, c._attn_implementation) for key, c in configs.items()}
        for c, impl in self._saved.values():
            c._attn_implementation = _register_kernel_attention(impl or "eager")
        for m in self._modules:
            m._kverr_kernel_cache = self
        super().__init__(layers=[_KernelLayer(self, i) for i in range(n_layers)])

    @classmethod
    def for_model(cls, model: Any, config: CacheConfig, **kwargs: Any) -> KernelKVCache:
        return cls(model, config, **kwargs)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        B, _, n, _ = k.shape
        if B != self.batch:
            raise ShapeError(f"this cache holds {self.batch} sequences, got a batch of {B}")
        if layer == 0:
            self.decoding = self.length > 0
            self.step = self.paged.plan([n] * B)
            self.length += n
        k_in = k
        if self._cos is not None:
            t0 = self.length - n
            k_in = unrotate(k.float(), self._cos[t0:self.length], self._sin[t0:self.length])
        if self.paged.static_pending(layer):
            # the first chunk quantized sets the static scales, jointly over the batch, from the
            # same tokens KverrCache quantizes first: the prefill's, sinks and window left out
            from kverr.gpu.cache import layer_static_scales

            self.paged.set_static_scales(layer_static_scales(self.config, layer, k_in, v))
        self.paged.store(self.step, layer, k_in, v)
        return k, v

    def nbytes(self) -> int:
        """Bytes the paged cache allocated (pools, full-precision buffers, block table)."""
        return self.paged.nbytes

    def close(self) -> None:
        """Restore the model's attention functions and detach the cache."""
        for c, impl in self._saved.values():
            c._attn_implementation = impl
        for m in self._modules:
            if getattr(m, "_kverr_kernel_cache", None) is self:
                del m._kverr_kernel_cache

    def __enter__(self) -> KernelKVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cache_for(model: Any, config: CacheConfig, *, backend: str = "auto", **kwargs: Any) -> Cache:
    """The cache that runs ``config`` for ``model``.

    ``backend="auto"`` picks the Triton kernel path (:class:`KernelKVCache`) when the model is on
    a CUDA device and the kernels support the config, and the CPU reference path
    (:class:`KverrCache`) otherwise; ``"reference"`` and ``"triton"`` force one. The two agree
    (tests compare them through a whole model in the Triton interpreter).
    """
    if backend not in ("auto", "reference", "triton"):
        raise ConfigError(f"backend={backend!r} is not allowed; 'auto', 'reference' or 'triton'")
    if backend == "auto":
        on_cuda = next(model.parameters()).device.type == "cuda"
        backend = "triton" if on_cuda and kernels_support(config) else "reference"
    if backend == "triton":
        return KernelKVCache.for_model(model, config, **kwargs)
    return KverrCache.for_model(model, config, **kwargs)


def kernels_support(config: CacheConfig) -> bool:
    """Whether the Triton kernels can run ``config`` (all but percentile clips with dynamic scales)."""
    from kverr.exceptions import KernelError
    from kverr.gpu.spec import kernel_spec

    for _, fmt in config._all_formats():
        try:
            kernel_spec(fmt, 64, config.page_size)
        except (KernelError, ConfigError):
            return False
    return True
