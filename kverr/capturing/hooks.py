"""Capture queries, keys and values from a model's own forward pass.

How the tensors are taken, and why they are the model's own state:

* **q, k (post-RoPE) and v** are read where transformers hands them to the attention kernel.
  Every supported attention module looks its kernel up by name in transformers'
  ``ALL_ATTENTION_FUNCTIONS`` (``config._attn_implementation``). For the duration of a capture,
  kverr registers a wrapper under its own name (``kverr_capture|<inner>``), points the config at
  it, records the tensors and calls the original kernel (sdpa, eager, ...) unchanged, with the
  same mask function registered for it. The keys and values it sees are exactly those the module
  passes to ``cache.update`` one line earlier: the KV cache contents.
* **k_pre** is the output of ``k_proj`` (or of ``k_norm`` for families that normalise keys
  before RoPE, such as Qwen3), taken with a forward hook.
* The forward runs the base model only (no LM head) with explicit ``position_ids = 0..T-1`` and
  no cache, and stops right after the last requested layer.

Tensors are copied into preallocated numpy buffers of the storage dtype as the forward
proceeds; the in-memory footprint of a capture is that of the returned Dataset.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kverr import __version__
from kverr.dims import (
    CHANNEL,
    KV_HEAD,
    KV_HEAD_OF_Q,
    LAYER,
    Q_HEAD,
    SCHEMA_VERSION,
    TOKEN,
)
from kverr.exceptions import CaptureError, DTypeError

from .model import LoadedModel, _rope_params, float_environment
from .text import Text

log = logging.getLogger(__name__)

__all__ = ["STORAGE_DTYPES", "attention_modules", "capture", "capture_to_zarr"]

#: Storage dtypes a capture may use.
STORAGE_DTYPES: tuple[str, ...] = ("float32", "float16")

_IMPL_PREFIX = "kverr_capture|"


class _StopForward(Exception):
    """Raised from inside the forward once the last requested layer is recorded."""


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The attention module of each layer, indexed by layer.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A Llama/Mistral/Qwen2/Qwen3-family causal LM.

    Raises
    ------
    CaptureError
        The model's attention modules do not have the expected structure.
    """
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj")):
            found[int(idx)] = module
    if not found or sorted(found) != list(range(len(found))):
        raise CaptureError(
            f"cannot find one attention module with q_proj/k_proj/v_proj per layer in "
            f"{type(model).__name__} (found layers {sorted(found)})"
        )
    return [found[i] for i in range(len(found))]


def _inner_attention(module: torch.nn.Module, inner: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager" or inner is None:
        # Each modeling file defines its own eager kernel (some add sinks or soft-capping).
        modeling = sys.modules[type(module).__module__]
        return modeling.eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def register_attention_wrapper(prefix: str, inner: str, before: Callable[..., Any]) -> str:
    """Register, under ``<prefix><inner>``, an attention function that calls
    ``before(module, query, key, value, kwargs)`` and returns what it returns unless that is
    None, else the model's own kernel ``inner`` (sdpa, eager, ...) unchanged, with the same mask
    function registered for it. Returns the name (for ``config._attn_implementation``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = prefix + inner

    def wrapped_attention(module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = before(module, query, key, value, kwargs)
        if out is not None:
            return out
        return _inner_attention(module, inner)(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, wrapped_attention)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # The same mask as the wrapped kernel gets, so the forward is the plain forward.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[inner])
    return name


def _record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            kwargs: dict[str, Any]) -> None:
    recorder = getattr(module, "_kverr_recorder", None)
    if recorder is not None:
        recorder.on_attention(module, query, key, value, kwargs)


def _register_wrapper(inner: str) -> str:
    """Register the capturing attention under ``kverr_capture|<inner>``; returns the name."""
    return register_attention_wrapper(_IMPL_PREFIX, inner, _record)


class _Recorder:
    """Copies one layer's tensors into the capture buffers as the forward reaches it."""

    def __init__(
        self,
        layers: Sequence[int],
        n_q: int,
        n_kv: int,
        head_dim: int,
        n_tokens: int,
        dtype: np.dtype,
        progress: Any,
    ) -> None:
        self.index = {layer: i for i, layer in enumerate(layers)}
        self.last = max(layers)
        self.n_q, self.n_kv, self.head_dim, self.n_tokens = n_q, n_kv, head_dim, n_tokens
        n_l = len(layers)
        self.q = np.empty((n_l, n_q, n_tokens, head_dim), dtype=dtype)
        self.k_pre = np.empty((n_l, n_kv, n_tokens, head_dim), dtype=dtype)
        self.k = np.empty((n_l, n_kv, n_tokens, head_dim), dtype=dtype)
        self.v = np.empty((n_l, n_kv, n_tokens, head_dim), dtype=dtype)
        self.sliding_window = np.zeros(n_l, dtype=np.int64)
        self.sink = np.full((n_l, n_q), np.nan)  # learned sink logits, where the model has them
        self.scaling = np.full(n_l, np.nan)
        self.seen_pre: set[int] = set()
        self.seen: set[int] = set()
        self.progress = progress

    def _check(self, name: str, t: torch.Tensor, heads: int, layer: int) -> None:
        want = (1, heads, self.n_tokens, self.head_dim)
        if tuple(t.shape) != want:
            raise CaptureError(
                f"layer {layer}: {name} has shape {tuple(t.shape)}, expected {want}; "
                "this attention layout is not supported"
            )

    def on_k_pre(self, layer: int, out: torch.Tensor) -> None:
        i = self.index.get(layer)
        if i is None:
            return
        # [batch, token, kv_head * channel] (k_proj), [batch, token, kv_head, channel] (k_norm
        # before the heads move forward: Qwen3) or [batch, kv_head, token, channel] (after: Gemma 3)
        heads_first = out.ndim == 4 and tuple(out.shape[1:3]) == (self.n_kv, self.n_tokens)
        if heads_first and self.n_kv == self.n_tokens:
            raise CaptureError(f"layer {layer}: cannot tell the normed keys' layout when the capture has as many "
                               f"tokens as kv heads ({self.n_kv}); capture another number of tokens")
        if heads_first:
            t = out.reshape(1, self.n_kv, self.n_tokens, self.head_dim)
        else:
            t = out.reshape(1, self.n_tokens, self.n_kv, self.head_dim).transpose(1, 2)
        torch.from_numpy(self.k_pre[i]).copy_(t[0])
        self.seen_pre.add(layer)

    def on_attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> None:
        layer = int(module.layer_idx)
        i = self.index.get(layer)
        if i is not None:
            self._check("query", query, self.n_q, layer)
            self._check("key", key, self.n_kv, layer)
            self._check("value", value, self.n_kv, layer)
            torch.from_numpy(self.q[i]).copy_(query[0])
            torch.from_numpy(self.k[i]).copy_(key[0])
            torch.from_numpy(self.v[i]).copy_(value[0])
            self.sliding_window[i] = int(kwargs.get("sliding_window") or 0)
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.Tensor):
                if tuple(sinks.shape) != (self.n_q,):
                    raise CaptureError(f"layer {layer}: sinks of shape {tuple(sinks.shape)}, expected one logit "
                                       f"per query head ({self.n_q},)")
                self.sink[i] = sinks.detach().double().cpu().numpy()
            self.scaling[i] = float(kwargs.get("scaling") or getattr(module, "scaling", np.nan))
            self.seen.add(layer)
        if self.progress is not None:
            self.progress.update(1)
        if layer == self.last:
            raise _StopForward


@contextlib.contextmanager
def _hooked(model: Any, recorder: _Recorder) -> Iterator[None]:
    """Install the recorder on every attention module; restore the model afterwards."""
    modules = attention_modules(model)
    configs = {id(c): c for c in [model.config, *(m.config for m in modules if hasattr(m, "config"))]}
    saved = {key: cfg._attn_implementation for key, cfg in configs.items()}
    handles = []
    try:
        for key, cfg in configs.items():
            inner = saved[key] or "eager"
            cfg._attn_implementation = _register_wrapper(inner)
        for layer, module in enumerate(modules):
            module._kverr_recorder = recorder
            pre_module = getattr(module, "k_norm", None) or module.k_proj

            def hook(_mod: Any, _inp: Any, out: torch.Tensor, layer: int = layer) -> None:
                recorder.on_k_pre(layer, out)

            handles.append(pre_module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            with contextlib.suppress(AttributeError):
                del module._kverr_recorder
        for key, cfg in configs.items():
            cfg._attn_implementation = saved[key]


def _parse_layers(layers: Sequence[int] | None, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    out = sorted({int(x) for x in layers})
    if not out:
        raise CaptureError("the layer list is empty; omit it to capture every layer")
    bad = [x for x in out if not 0 <= x < n_layers]
    if bad:
        raise CaptureError(f"layers {bad} out of range: the model has layers 0..{n_layers - 1}")
    return out


def _base_model(model: Any) -> Any:
    base = getattr(model, "base_model", None)
    return base if base is not None and base is not model else model


def capture(
    loaded: LoadedModel,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    dtype: str = "float32",
    text: Text | None = None,
    offset: int = 0,
    progress: bool = False,
) -> Any:
    """Run the model on the tokens and capture q, k_pre, k and v of the requested layers.

    Parameters
    ----------
    loaded : LoadedModel
        From :func:`kverr.capturing.load_model`.
    token_ids : array
        ``[token]`` token ids, one sequence.
    layers : sequence of int, optional
        Layers to capture (default all). Capturing stops the forward after the last of them.
    dtype : {"float32", "float16"}
        Storage dtype. float32 keeps a float32 model's tensors exactly.
    text : Text, optional
        Where the tokens came from (recorded in the attrs).
    offset : int
        Token offset of the window within ``text`` (recorded in the attrs).
    progress : bool
        Show a progress bar over the layers.

    Returns
    -------
    xarray.Dataset
        Variables ``q`` (layer, q_head, token, channel), ``k_pre``, ``k``, ``v``
        (layer, kv_head, token, channel), ``token_id`` and ``position`` (token); coordinates
        ``kv_head_of_q`` (q_head), ``sliding_window`` (layer; 0 = full causal attention) and
        ``attn_scale`` (layer; the softmax scale the model used, usually ``head_dim**-0.5``);
        attrs as documented in :mod:`kverr.io`. numpy-backed.

    Raises
    ------
    CaptureError
        Bad layers, too many or no tokens, or an attention layout kverr cannot read.
    DTypeError
        ``dtype`` is not a storage dtype.
    """
    import xarray as xr

    import kverr.accessor  # noqa: F401  (registers ds.kv on the capture returned)

    from kverr.progress import progress as progress_bar

    if dtype not in STORAGE_DTYPES:
        raise DTypeError(f"storage dtype {dtype!r} is not supported; use one of {STORAGE_DTYPES}")
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    if ids.ndim != 1 or ids.numel() == 0:
        raise CaptureError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    n_tokens = int(ids.numel())
    if loaded.max_context and n_tokens > loaded.max_context:
        raise CaptureError(
            f"{n_tokens} tokens exceed the model's context of {loaded.max_context} tokens"
        )
    vocab = getattr(loaded.model.config, "vocab_size", None)
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CaptureError(f"token ids must lie in 0..{vocab - 1} for this model")
    wanted = _parse_layers(layers, loaded.n_layers)
    model = loaded.model
    run_layers = wanted[-1] + 1
    bar = progress_bar(total=run_layers, desc="capture", unit="layer", enabled=progress)
    recorder = _Recorder(
        wanted,
        loaded.n_q_heads,
        loaded.n_kv_heads,
        loaded.head_dim,
        n_tokens,
        np.dtype(dtype),
        bar,
    )
    positions = torch.arange(n_tokens, dtype=torch.long)
    log.info("capturing layers %s of %s on %d tokens", wanted, loaded.model_id, n_tokens)
    try:
        with torch.inference_mode(), _hooked(model, recorder):
            try:
                _base_model(model)(
                    input_ids=ids[None, :], position_ids=positions[None, :], use_cache=False
                )
            except _StopForward:
                pass
    finally:
        bar.close()
    missing = sorted(set(wanted) - (recorder.seen & recorder.seen_pre))
    if missing:
        raise CaptureError(f"the forward never reached the attention of layers {missing}")

    rope = _rope_params(model, model.config)  # after the forward: dynamic RoPE may have updated
    n_rep = loaded.n_q_heads // loaded.n_kv_heads
    attrs = {
        "model_id": loaded.model_id,
        "weights_sha256": loaded.weights_sha256,
        "model_dtype": str(loaded.dtype).removeprefix("torch."),
        "model_n_layers": int(loaded.n_layers),
        "model_sliding_windows": list(loaded.sliding_windows),
        "rope": json.dumps(rope, sort_keys=True),
        "head_dim": int(loaded.head_dim),
        "dtype": dtype,
        "text_source": text.source if text is not None else "",
        "text_sha256": text.sha256 if text is not None else "",
        "token_offset": int(offset),
        "kverr_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        **float_environment(),
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    kv_dims = (LAYER, KV_HEAD, TOKEN, CHANNEL)
    return xr.Dataset(
        data_vars={
            "q": ((LAYER, Q_HEAD, TOKEN, CHANNEL), recorder.q),
            "k_pre": (kv_dims, recorder.k_pre),
            "k": (kv_dims, recorder.k),
            "v": (kv_dims, recorder.v),
            "token_id": ((TOKEN,), ids.numpy().astype(np.int32)),
            "position": ((TOKEN,), positions.numpy().astype(np.int32)),
            **({} if np.isnan(recorder.sink).all() else {"attn_sink": ((LAYER, Q_HEAD), recorder.sink)}),
        },
        coords={
            LAYER: np.asarray(wanted, dtype=np.int64),
            Q_HEAD: np.arange(loaded.n_q_heads),
            KV_HEAD: np.arange(loaded.n_kv_heads),
            TOKEN: np.arange(n_tokens),
            CHANNEL: np.arange(loaded.head_dim),
            # transformers' repeat_kv: query head h reads kv head h // (n_q / n_kv).
            KV_HEAD_OF_Q: (Q_HEAD, np.arange(loaded.n_q_heads) // n_rep),
            "sliding_window": (LAYER, recorder.sliding_window),
            "attn_scale": (LAYER, recorder.scaling),
        },
        attrs=attrs,
    )


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def capture_to_zarr(
    loaded: LoadedModel,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    out: str | Path,
    *,
    layers: Sequence[int] | None = None,
    dtype: str = "float32",
    text: Text | None = None,
    offset: int = 0,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """:func:`capture` and write the result atomically with :func:`kverr.io.write_dataset`.

    The output path is checked before the model runs, so an existing output fails fast.

    Returns
    -------
    pathlib.Path
        The written store.

    Raises
    ------
    OutputExistsError
        ``out`` exists and ``overwrite`` is false.
    """
    from kverr.io import check_output_path, write_dataset

    check_output_path(out, overwrite=overwrite)
    ds = capture(
        loaded, token_ids, layers=layers, dtype=dtype, text=text, offset=offset, progress=progress
    )
    return write_dataset(ds, out, overwrite=overwrite)
