"""``ds.kv``: what a capture says about its model, derived in one place.

A capture dataset (:mod:`kverr.io` lists its attrs and coordinates) records the model's layer
count, RoPE parameters and softmax scales; captures of a subset of layers, or made by older
versions, lack some of them. Every rule for reading them, and its fallback, lives here::

    import kverr.accessor  # registers the accessor (kverr.io.open_capture does so too)

    ds = kverr.io.open_capture("data/smollm2-pydoc-512.zarr")
    ds.kv.n_layers          # the model's layer count, not the captured layers'
    ds.kv.attn_scale(5)     # softmax scale of model layer 5
    ds.kv.rope              # RoPE parameters (dict), or None
    ds.kv.shape             # kverr.memory.ModelShape, for byte accounting

Importing this module imports xarray; :mod:`kverr` itself does not.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import xarray as xr

from kverr.dims import CHANNEL, KV_HEAD, KV_HEAD_OF_Q, LAYER, Q_HEAD, TOKEN

__all__ = ["CaptureAccessor"]


@xr.register_dataset_accessor("kv")
class CaptureAccessor:
    """Derived metadata of a capture dataset (``ds.kv``)."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    @property
    def layers(self) -> list[int]:
        """Model layer indices held by the dataset, in dataset order."""
        return [int(x) for x in self._ds[LAYER].values]

    @property
    def n_layers(self) -> int:
        """The model's layer count (``model_n_layers``; else one past the highest captured layer).

        A capture may hold a subset of layers, so the dataset's ``layer`` size is not the model's.
        """
        if "model_n_layers" in self._ds.attrs:
            return int(self._ds.attrs["model_n_layers"])
        return max(self.layers) + 1

    @property
    def n_kv_heads(self) -> int:
        return int(self._ds.sizes[KV_HEAD])

    @property
    def n_q_heads(self) -> int:
        return int(self._ds.sizes[Q_HEAD])

    @property
    def head_dim(self) -> int:
        return int(self._ds.sizes[CHANNEL])

    @property
    def n_tokens(self) -> int:
        return int(self._ds.sizes[TOKEN])

    @property
    def kv_head_of_q(self) -> np.ndarray:
        """int64 [q_head]: the kv head each query head reads."""
        return np.asarray(self._ds[KV_HEAD_OF_Q].values, dtype=np.int64)

    @property
    def positions(self) -> np.ndarray:
        """Integer [token]: absolute positions (``position``, as stored; else 0..T-1)."""
        if "position" in self._ds:
            return np.asarray(self._ds["position"].values)
        return np.arange(self.n_tokens, dtype=np.int64)

    @property
    def rope(self) -> dict[str, Any] | None:
        """The model's RoPE parameters (the ``rope`` attr decoded), or None when not recorded."""
        rope = self._ds.attrs.get("rope")
        if rope is None:
            return None
        return dict(json.loads(rope)) if isinstance(rope, str) else dict(rope)

    def rope_of(self, layer: int) -> dict[str, Any] | None:
        """The RoPE parameters of model layer ``layer`` (:func:`kverr.rope.layer_rope`; models with
        a RoPE per layer type have one per type), or None when not recorded."""
        from kverr.rope import layer_rope

        rope = self.rope
        return None if rope is None else layer_rope(rope, layer)

    def attn_scale(self, layer: int) -> float:
        """Softmax scale of model layer ``layer`` (``attn_scale``; else ``head_dim ** -0.5``)."""
        if "attn_scale" in self._ds.coords:
            return float(self._ds["attn_scale"].sel({LAYER: int(layer)}).values)
        return 1.0 / math.sqrt(self.head_dim)

    def attn_scales(self) -> xr.DataArray:
        """float64 [layer]: :meth:`attn_scale` of every captured layer."""
        if "attn_scale" in self._ds.coords:
            return self._ds["attn_scale"].astype(np.float64)
        return xr.full_like(self._ds[LAYER], 1.0 / math.sqrt(self.head_dim), dtype=np.float64)

    def sliding_window(self, layer: int) -> int:
        """Sliding-window length of model layer ``layer`` (0: full causal attention)."""
        if "sliding_window" in self._ds.coords:
            return int(self._ds["sliding_window"].sel({LAYER: int(layer)}).values)
        return 0

    @property
    def has_sinks(self) -> bool:
        """Whether the model has learned attention-sink logits (``attn_sink``)."""
        return "attn_sink" in self._ds.data_vars

    def attn_sink(self, layer: int) -> np.ndarray | None:
        """float64 [q_head]: the sink logit of each query head of model layer ``layer`` (a softmax
        column without a value), or None when the model has none."""
        if not self.has_sinks:
            return None
        return np.asarray(self._ds["attn_sink"].sel({LAYER: int(layer)}).values, dtype=np.float64)

    def attn_sinks(self) -> xr.DataArray:
        """float64 [layer, q_head]: :meth:`attn_sink` of every captured layer (NaN: none)."""
        if self.has_sinks:
            return self._ds["attn_sink"].astype(np.float64)
        return xr.DataArray(np.full((self._ds.sizes[LAYER], self._ds.sizes[Q_HEAD]), np.nan), dims=(LAYER, Q_HEAD),
                            coords={LAYER: self._ds[LAYER].values})

    def sliding_windows(self) -> xr.DataArray:
        """int64 [layer]: :meth:`sliding_window` of every captured layer."""
        if "sliding_window" in self._ds.coords:
            return self._ds["sliding_window"].astype(np.int64)
        return xr.zeros_like(self._ds[LAYER], dtype=np.int64)

    @property
    def has_sliding_window(self) -> bool:
        return "sliding_window" in self._ds.coords and bool(np.any(self._ds["sliding_window"].values > 0))

    @property
    def shape(self):
        """:class:`kverr.memory.ModelShape` of the captured model (for byte accounting)."""
        from kverr.memory import ModelShape

        return ModelShape(self.n_layers, self.n_kv_heads, self.head_dim,
                          name=str(self._ds.attrs.get("model_id", "")), n_q_heads=self.n_q_heads,
                          sliding_windows=self.model_sliding_windows)

    @property
    def model_sliding_windows(self) -> tuple[int, ...]:
        """The sliding window of every model layer (``model_sliding_windows``; else those of the
        captured layers, 0 for the others); empty when no layer has one."""
        a = self._ds.attrs.get("model_sliding_windows")
        if a is not None:
            return tuple(int(w) for w in (json.loads(a) if isinstance(a, str) else a))
        if not self.has_sliding_window:
            return ()
        out = [0] * self.n_layers
        for layer in self.layers:
            out[layer] = self.sliding_window(layer)
        return tuple(out)

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the capture comes from, and the model's shape, as recorded in configs."""
        a = self._ds.attrs
        return {
            "model_id": str(a.get("model_id", "")),
            "weights_sha256": str(a.get("weights_sha256", "")),
            "text_source": str(a.get("text_source", "")),
            "text_sha256": str(a.get("text_sha256", "")),
            "token_offset": int(a.get("token_offset", 0)),
            "tokens": self.n_tokens,
            "created_utc": str(a.get("created_utc", "")),
            # the model's shape, so that a config is refused on another model (check_model_matches)
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
        }
