"""One synthetic capture for the tests that need no model: the capture schema, random contents.

Keys after RoPE are the keys before RoPE rotated by :func:`kverr.rope.apply_rope` (as a real
capture's are), so configs that quantize either side can be checked on it.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import xarray as xr

from kverr.dims import KV_HEAD_OF_Q, SCHEMA_VERSION
from kverr.rope import apply_rope, default_inv_freq


def synthetic_capture(n_layers: int = 2, n_q: int = 4, n_kv: int = 2, n_tokens: int = 64,
                      head_dim: int = 16, seed: int = 0, *, outlier_channel: int | None = None,
                      sliding_windows: list[int] | None = None) -> xr.Dataset:
    """A capture-shaped dataset: ``q`` [layer, q_head, token, channel] and ``k_pre``, ``k``, ``v``
    [layer, kv_head, token, channel] standard normal in float32 (``outlier_channel`` of the
    keys shifted by 4, as real keys have such channels), RoPE with theta 1e4; a
    ``sliding_window`` coordinate when ``sliding_windows`` (one per layer) is given."""
    rng = np.random.default_rng(seed)
    rope = json.dumps({"rope_theta": 1e4, "inv_freq": default_inv_freq(head_dim, 1e4).tolist(),
                       "attention_scaling": 1.0})
    pos = np.arange(n_tokens)

    def arr(heads):
        return rng.standard_normal((n_layers, heads, n_tokens, head_dim)).astype(np.float32)

    q, k_pre, v = arr(n_q), arr(n_kv), arr(n_kv)
    if outlier_channel is not None:
        k_pre[..., outlier_channel] += 4.0
    k = apply_rope(torch.from_numpy(k_pre), pos, rope).numpy()
    kv = ("layer", "kv_head", "token", "channel")
    windows = {} if sliding_windows is None else {"sliding_window": ("layer", np.asarray(sliding_windows))}
    return xr.Dataset(
        {
            "q": (("layer", "q_head", "token", "channel"), q),
            "k_pre": (kv, k_pre),
            "k": (kv, k),
            "v": (kv, v),
            "token_id": (("token",), rng.integers(0, 100, n_tokens).astype(np.int32)),
            "position": (("token",), pos.astype(np.int32)),
        },
        coords={
            "layer": np.arange(n_layers),
            KV_HEAD_OF_Q: ("q_head", np.arange(n_q) // (n_q // n_kv)),
            "attn_scale": ("layer", np.full(n_layers, head_dim ** -0.5)),
            **windows,
        },
        attrs={
            "model_id": "synthetic",
            "weights_sha256": "0" * 64,
            "model_n_layers": n_layers,
            "rope": rope,
            "head_dim": head_dim,
            "dtype": "float32",
            "text_source": "",
            "text_sha256": "",
            "kverr_version": "test",
            "schema_version": SCHEMA_VERSION,
        },
    )
