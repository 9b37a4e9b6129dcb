"""Rotary position embedding (RoPE) as the Llama family of models applies it.

A capture stores keys both before and after RoPE, together with the parameters needed to go
from one to the other (the ``rope`` attribute, a JSON object holding ``inv_freq`` and
``attention_scaling`` as the model computed them). This module applies that rotation, so that a
format which quantizes pre-RoPE keys can be evaluated on the keys the model really attends with.

Convention ("rotate half", the one transformers uses for Llama, Mistral and Qwen2): channel ``i``
and channel ``i + R/2`` form a pair rotated by the angle ``position * inv_freq[i]``, where ``R``
is the number of rotary channels (``2 * len(inv_freq)``); channels beyond ``R`` are left as they
are (partial rotary embeddings).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kverr.exceptions import ShapeError

__all__ = ["apply_rope", "default_inv_freq", "parse_rope", "rope_cos_sin"]


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of the original ("default") RoPE.

    Parameters
    ----------
    rotary_dim : int
        Number of rotary channels (even).
    theta : float
        RoPE base (``rope_theta``).

    Returns
    -------
    torch.Tensor
        ``[rotary_dim // 2]`` float32, computed exactly as transformers does.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ShapeError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def layer_rope(rope: Mapping[str, Any] | str, layer: int) -> dict[str, Any]:
    """The RoPE parameters of model layer ``layer``: ``rope`` itself, or for models with a RoPE
    per layer type (``{"layer_types": [...], "types": {...}}``, Gemma 3) that of its type."""
    params = json.loads(rope) if isinstance(rope, str) else dict(rope)
    if "types" not in params:
        return params
    types = params["layer_types"]
    if not 0 <= int(layer) < len(types):
        raise ShapeError(f"layer {layer} is not one of the {len(types)} layers the RoPE parameters describe")
    return dict(params["types"][types[int(layer)]])


def parse_rope(rope: Mapping[str, Any] | str) -> tuple[torch.Tensor, float]:
    """Read ``inv_freq`` and ``attention_scaling`` from a capture's ``rope`` attribute.

    Parameters
    ----------
    rope : mapping or str
        The RoPE parameters, as a dict or as the JSON string stored in a capture's attrs.

    Returns
    -------
    inv_freq : torch.Tensor
        ``[rotary_dim // 2]`` float32.
    attention_scaling : float
        Factor applied to cos and sin (1.0 except for some scaled RoPE variants).
    """
    params = json.loads(rope) if isinstance(rope, str) else dict(rope)
    if "types" in params:
        raise ShapeError("the model has a RoPE per layer type; take one layer's with kverr.rope.layer_rope(rope, layer)")
    if "inv_freq" not in params:
        raise ShapeError(
            "RoPE parameters have no 'inv_freq'; they must come from a kverr capture "
            f"(keys present: {sorted(params)})"
        )
    inv_freq = torch.tensor(params["inv_freq"], dtype=torch.float32)
    return inv_freq, float(params.get("attention_scaling", 1.0))


def rope_cos_sin(
    positions: torch.Tensor | np.ndarray, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotation angles, as transformers' rotary embedding module.

    Parameters
    ----------
    positions : array
        ``[token]`` integer positions.
    inv_freq : torch.Tensor
        ``[R // 2]`` inverse frequencies.
    attention_scaling : float
        Factor applied to both.

    Returns
    -------
    cos, sin : torch.Tensor
        ``[token, R]`` float32 each.
    """
    pos = torch.as_tensor(np.asarray(positions)).to(torch.float32)
    # An outer product in float32: the same single roundings as transformers' matmul with K=1.
    freqs = pos[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, D]`` by tables ``cos, sin [T, D]`` (transformers' half-rotation
    convention): ``x cos + R(x) sin``. The one RoPE rotation of kverr; :func:`apply_rope`
    builds the tables from a capture's parameters, the caches take them from the model."""
    return x * cos + _rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``(cos I + sin R)^-1 = cos I - sin R`` since ``R^2 = -I``
    (exact only when the tables carry no attention scaling)."""
    return x * cos - _rotate_half(x) * sin


def apply_rope(
    x: torch.Tensor | np.ndarray,
    positions: torch.Tensor | np.ndarray,
    rope: Mapping[str, Any] | str,
    *,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate keys or queries by their positions (or undo the rotation).

    Parameters
    ----------
    x : array
        ``[..., token, channel]``; float16 inputs are computed in float32.
    positions : array
        ``[token]`` positions of the tokens of ``x``.
    rope : mapping or str
        RoPE parameters (see :func:`parse_rope`).
    inverse : bool
        Rotate by minus the angle, mapping post-RoPE vectors back to pre-RoPE ones
        (exact only when ``attention_scaling`` is 1).

    Returns
    -------
    torch.Tensor
        ``[..., token, channel]`` float32 (float64 if ``x`` is float64).
    """
    xt = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if not xt.is_floating_point():
        raise ShapeError(f"apply_rope needs floating-point input, got {xt.dtype}")
    if xt.dtype != torch.float64:
        xt = xt.to(torch.float32)
    inv_freq, scaling = parse_rope(rope)
    rotary_dim = 2 * inv_freq.numel()
    n_tokens = np.asarray(positions).shape[0]
    if xt.ndim < 2 or xt.shape[-2] != n_tokens or xt.shape[-1] < rotary_dim:
        raise ShapeError(
            f"apply_rope expects x of shape [..., token={n_tokens}, channel>={rotary_dim}], "
            f"got {tuple(xt.shape)}"
        )
    cos, sin = rope_cos_sin(positions, inv_freq, scaling)
    cos, sin = cos.to(xt.dtype), sin.to(xt.dtype)
    rot, rest = xt[..., :rotary_dim], xt[..., rotary_dim:]
    out = (unrotate if inverse else rotate)(rot, cos, sin)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
