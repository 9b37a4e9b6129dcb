"""The kernel path as a transformers ``Cache``: a :class:`~kverr.config.CacheConfig` on the Triton kernels.

Keys and values go through the quantize-and-store kernel into :class:`kverr.gpu.PagedKVCache`;
decode steps attend with the fused-dequant decode kernel, installed as the model's attention
function (:func:`register_kernel_attention`) while the cache is attached. Same token policy,
static-scale rule, salient tokens (:mod:`kverr.error.salient`) and keys rounded with compensation
(:mod:`kverr.quant.compensated`, under the second moment of the prefill's last queries, or the
config's static ``key_moments``) as the
reference path (:class:`kverr.hf.reference.KverrCache`): the prefill is stored once the attention
function has handed over its queries.
"""

from __future__ import annotations

from typing import Any

import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.hf.reference import Cache, CacheLayerMixin, left_pads, model_rotary
from kverr.rope import unrotate

_KERNEL_IMPL_PREFIX = "kverr_paged|"


def register_kernel_attention(inner: str) -> str:
    """Register an attention function that decodes from the paged cache; returns its name.

    Single-token steps of a model that holds a :class:`KernelKVCache` run the fused-dequant
    decode kernel; everything else (the prefill) runs the model's own attention ``inner`` on the
    fresh keys and values, as a serving engine does.
    """
    from kverr.capturing.hooks import register_attention_wrapper

    def paged_attention(module, query, key, value, kwargs):  # type: ignore[no-untyped-def]
        cache = getattr(module, "_kverr_kernel_cache", None)
        if cache is not None and module.layer_idx in cache._awaiting:
            cache._observe(module, query, key, kwargs)
        if cache is None or not cache.decoding:
            return None  # the model's own attention
        if query.shape[2] == 1:
            out = cache.paged.decode(cache.step, module.layer_idx, query[:, :, 0, :].float(),
                                     sm_scale=kwargs.get("scaling"))
            return out[:, None].to(query.dtype), None  # [B, 1, n_q_heads, D]
        # a later chunk of several tokens: causal attention over the cache as stored
        out = cache.paged.prefill(cache.step, module.layer_idx, query.float(), sm_scale=kwargs.get("scaling"))
        return out.transpose(1, 2).to(query.dtype), None  # [B, n, n_q_heads, D]

    return register_attention_wrapper(_KERNEL_IMPL_PREFIX, inner, paged_attention)


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
        if self.owner.length == 0 and self.layer_idx == 0:
            pads = left_pads(kwargs, key_states.shape[0], key_states.shape[-2])
            if pads is not None and any(pads):
                raise ConfigError(f"left-padded batches (pads {pads}) are not supported on the kernel path (its pages "
                                  "would store and quantize the pads); use cache_for(..., backend='reference')")
        return self.owner._store(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.paged.max_pages * self.owner.paged.P

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ConfigError("beam search is not supported on the kernel path (its pages are not reordered); "
                          "use cache_for(..., backend='reference')")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ConfigError("crop (assisted/speculative decoding) is not supported on the kernel path (its pages "
                          "cannot be un-quantized); use cache_for(..., backend='reference')")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ConfigError("batch_repeat_interleave is not supported on the kernel path (its pages are not "
                          "copied between sequences); use cache_for(..., backend='reference')")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ConfigError("batch_select_indices is not supported on the kernel path (its pages are not "
                          "reordered); use cache_for(..., backend='reference')")


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

    Use :meth:`for_model`; a batch of equal-length sequences: a left-padded batch, beam search,
    crop (assisted decoding), batch selections and ``copy.deepcopy`` are refused, each with one
    line naming the reference path (:class:`KverrCache`), which supports them. The first forward pass (the prefill)
    attends with the model's own attention; every later one -- single tokens with the decode
    kernel, chunks of several tokens with the chunked-prefill kernel -- attends to the cache as
    stored (sinks and window in full precision, the rest dequantized), as :class:`KverrCache` does.
    """

    def __init__(self, model: Any, config: CacheConfig, *, batch: int = 1, max_tokens: int = 4096, **kwargs: Any) -> None:
        from kverr.capturing.model import model_dims
        from kverr.gpu import PagedKVCache

        n_layers, n_heads, n_kv, head_dim, _ = model_dims(model.config)
        device = next(model.parameters()).device
        self.config = config
        self._rope: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if config.key_pre_rope:
            # the cache stores keys before RoPE, as KverrCache does: undo the model's rotation on the
            # way in; the decode kernel applies it again per key row from the same tables (a pair
            # per layer: models with a RoPE per layer type have two)
            pos = torch.arange(max_tokens, device=device)
            tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
            self._rope = []
            for i in range(n_layers):
                rotary = model_rotary(model, i)
                if rotary.layer_type not in tables:  # one pair per layer type, computed once
                    tables[rotary.layer_type] = rotary(pos)
                self._rope.append(tables[rotary.layer_type])
            kwargs["rope"] = self._rope
        # static scales not given: the prefill sets them, as in KverrCache
        kwargs.setdefault("static_scales", "first")
        self.paged = PagedKVCache(
            config, n_layers=n_layers, n_kv_heads=n_kv, n_q_heads=n_heads, head_dim=head_dim,
            max_batch=batch, max_tokens=max_tokens, device=device, **kwargs,
        )
        self.batch, self.length = batch, 0
        self.step = None
        # config.needs_queries: per layer, the prefill's (keys as stored, values) until its queries arrive
        self._awaiting: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decoding = False
        self._model = model
        self._modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
        if len(self._modules) != n_layers:
            raise ConfigError(f"found {len(self._modules)} attention modules, expected {n_layers}")
        configs = {id(c): c for c in [model.config, *(m.config for m in self._modules if hasattr(m, "config"))]}
        self._saved = {key: (c, c._attn_implementation) for key, c in configs.items()}
        for c, impl in self._saved.values():
            c._attn_implementation = register_kernel_attention(impl or "eager")
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
            if self._awaiting:
                raise ConfigError(
                    f"layers {sorted(self._awaiting)}: the config keeps salient tokens or rounds keys with "
                    "compensation, both weighed by the prefill's queries, and this cache never saw them: run the "
                    "prefill through the model the cache was built for")
            self.decoding = self.length > 0
            self.step = self.paged.plan([n] * B)
            self.length += n
        k_in = k
        if self._rope is not None:
            t0 = self.length - n
            cos, sin = self._rope[layer]
            k_in = unrotate(k.float(), cos[t0:self.length], sin[t0:self.length])
        if self.config.needs_queries and not self.decoding:
            self._awaiting[layer] = (k_in, v)  # stored once the prefill's queries arrive (_observe)
        else:
            self._write(layer, k_in, v)
        return k, v

    def _write(self, layer: int, k_in: torch.Tensor, v: torch.Tensor, salient: torch.Tensor | None = None,
               key_moment: torch.Tensor | None = None) -> None:
        if self.paged.static_pending(layer):
            # the first chunk quantized sets the static scales, jointly over the batch, from the
            # same tokens KverrCache quantizes first: the prefill's, sinks, window and salient
            # tokens left out
            from kverr.gpu.cache import layer_static_scales

            self.paged.set_static_scales(layer_static_scales(self.config, layer, k_in, v, salient=salient))
        self.paged.store(self.step, layer, k_in, v, salient=salient, key_moment=key_moment)

    def _observe(self, module: Any, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """The prefill's queries reached ``module``'s attention: choose the salient tokens of each
        sequence (:mod:`kverr.error.salient`) and take the second moment of its last
        :data:`~kverr.error.salient.OBSERVED_QUERIES` queries (keys rounded with compensation),
        then store the layer's prefill."""
        from kverr.error.salient import OBSERVED_QUERIES, positions
        from kverr.hf.salient import attention_context
        from kverr.quant.compensated import query_moment

        layer = module.layer_idx
        k_in, v = self._awaiting.pop(layer)
        pos = moment = None
        if self.config.salient:
            pos = positions(self.config, layer, query.detach(), key.detach(), **attention_context(module, kwargs))
        if self.config.compensates_keys and self.config.key_moments is None:  # else the store's static ones
            moment = query_moment(query.detach(), k_in.shape[1], OBSERVED_QUERIES)
        self._write(layer, k_in, v, salient=pos, key_moment=moment)

    def __deepcopy__(self, memo: dict) -> KernelKVCache:
        raise ConfigError("a KernelKVCache cannot be copied (it is attached to its model and holds device pages); "
                          "use cache_for(..., backend='reference') for a copyable cache")

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
