"""OSCAR (Zhou et al., Together AI, 2026: offline spectral covariance-aware rotation for 2-bit KV
caches), emulated as a peer.

Restated from its public code (the offline rotation fit and the SGLang INT2 kernels of its paper
release) where the paper's excerpts leave a step open; each choice below says which.

**Offline fit** (:func:`fit`, on the calibration capture's post-RoPE queries, keys and values, all
tokens pooled, no centring), one rotation per layer and side shared by its kv heads:

* keys: ``C_K``, the mean over kv heads ``h`` of ``M_h = Q_hᵀ Q_h / (N g)``, ``Q_h`` the ``N g``
  rows of the ``g`` query heads reading ``h``: the second moment of the queries, so a key error
  ``e`` costs ``eᵀ C_K e`` in squared logits;
* values: ``C_S``, the mean over kv heads of ``Σ_t w_t v_t v_tᵀ / Σ_t w_t`` with
  ``w_t = k_t M_h k_tᵀ``, the mean squared logit token ``t`` receives (the code's weight; the paper
  writes a score-weighted covariance);
* ``R = U H P``: ``U`` the eigenvectors of ``C`` in ascending eigenvalue order, ``H`` the
  normalised Sylvester Hadamard matrix of the head dim, ``P`` the bit-reversal permutation of the
  eigenvalues sorted large to small: column ``j`` of ``R`` is column ``D - 1 - bitrev(j)`` of
  ``U H``, so each quantization group takes one direction from each level of importance.

**Cache** (per (token, kv head) row, keys after RoPE as a cache receives them):

* a row is stored rotated, ``x R``, in bf16 (``x`` and ``R`` cast to bf16, the product rounded to
  bf16); the first :data:`SINKS` tokens and the most recent ones stay so;
* the most recent tokens: the last ``min(L - SINKS, RECENT)`` of an ``L``-token prefill, then each
  decoded token; when the window would exceed ``RECENT + 7`` tokens, its 8 oldest are demoted (the
  window holds ``RECENT`` to ``RECENT + 7`` tokens, as the kernels' 8-token pages make it);
* every other row is INT2: clipped to ``±τ``, ``τ`` the ``min(int(r D), D - 1)``-th smallest
  magnitude of the rotated row (ascending), ``r`` 0.96 for keys and 0.92 for values (the released
  scripts' constants; the paper describes fitted thresholds, whose procedure is not public); then
  in fp32 ``scale = max(max - min, 1e-8) / 3``, ``zero = -min / scale`` (not rounded),
  ``code = clamp(floor(x / scale + zero + 0.5), 0, 3)``, read back ``(code - zero) scale`` rounded
  to bf16;
* read back in the model's space: the rows times ``Rᵀ`` (the bf16 ``R``). The attention OSCAR
  computes, ``(q R)·(x̂ R)`` for keys and ``(Σ a x̂ R) Rᵀ`` for values, is the same bilinear form in
  exact arithmetic; the rounding of the rotated query and output is the attention's, not the
  cache's, and is not emulated. Nor is the decode-time demotion's clip, which the kernels find
  by a 7-step bisection that can clip about one order statistic lower than the sort.

Memory, counted by :func:`equivalent` and :func:`rotation_bytes`: two bits per element, scale and
zero in fp32 per (token, kv head) (what the kernels store; the paper's 2.28 bits count 16-bit
ones at 128K tokens), the sink and recent tokens in bf16 (the window's 7-token slack not counted),
and both rotations in bf16 once per layer. Peers: ``oscar-int2`` with the released scripts' 64
sink and 256 recent tokens, ``oscar-int2-s4r32`` with the 4 and 32 of kverr's low-bit configs, and
``oscar-int2-s4r32-fp16`` with the 16-bit scale and zero the paper's bit count assumes (rounded to
fp16 before they encode).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError
from kverr.progress import progress
from kverr.quant.formats import PerToken, int_format

#: Peer name -> (sink tokens, recent tokens, dtype of the INT2 rows' scale and zero).
VARIANTS = {"oscar-int2": (64, 256, "fp32"), "oscar-int2-s4r32": (4, 32, "fp32"),
            "oscar-int2-s4r32-fp16": (4, 32, "fp16")}
#: Clip ratio per side (the released evaluation scripts').
CLIP_RATIO = {"k": 0.96, "v": 0.92}
#: Tokens demoted from the recent window at once (the kernels' INT2 page).
DEMOTE = 8


def bit_reversal_columns(d: int) -> list[int]:
    """``perm[j] = d - 1 - bitrev(j)`` over ``log2(d)`` bits: the column of ``U H`` that is column
    ``j`` of the rotation (eigenvalues ascending, so the largest comes first in the bit-reversed
    order)."""
    n = d.bit_length() - 1
    return [d - 1 - int(format(j, f"0{n}b")[::-1], 2) for j in range(d)]


def rotation(cov: torch.Tensor) -> torch.Tensor:
    """``R = U H P`` for a symmetric ``cov [D, D]`` (float64)."""
    from kverr.quant.reference import sylvester

    d = cov.shape[-1]
    if d & (d - 1):
        raise ConfigError(f"OSCAR needs a power-of-two head dim for its Hadamard matrix, got {d}")
    _, u = torch.linalg.eigh((cov + cov.T).double() / 2)
    uh = u @ (sylvester(d).double() / math.sqrt(d))
    return uh[:, bit_reversal_columns(d)]


def covariances(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_of_q: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C_K, C_S)`` of one layer from ``q [Hq, N, D]``, ``k``, ``v [Hkv, N, D]`` (see the module)."""
    q, k, v = q.double(), k.double(), v.double()
    cks, css = [], []
    for h in range(k.shape[0]):
        rows = q[[i for i, kv in enumerate(kv_of_q) if kv == h]].reshape(-1, q.shape[-1])
        m = rows.T @ rows / rows.shape[0]
        w = torch.einsum("td,de,te->t", k[h], m, k[h])
        cks.append(m)
        css.append((v[h].T * w) @ v[h] / w.sum())
    return torch.stack(cks).mean(0), torch.stack(css).mean(0)


def fit(capture: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of the capture, ``(R_K, R_V)`` as fp32 ``[D, D]`` matrices."""
    kv_of_q = [int(x) for x in np.asarray(capture["kv_head_of_q"].values)]
    out = {}
    for layer in progress(capture["layer"].values, desc="fit oscar", unit="layer", leave=False):
        sel = capture.sel(layer=layer)
        q, k, v = (torch.from_numpy(np.asarray(sel[n].values)) for n in ("q", "k", "v"))
        ck, cs = covariances(q, k, v, kv_of_q)
        out[int(layer)] = (rotation(ck).float(), rotation(cs).float())
    return out


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Rows ``x [..., D]`` rotated as OSCAR stores them: ``bf16(bf16(x) @ bf16(R))`` (fp32)."""
    return _bf16(_bf16(x) @ _bf16(r))


def clip_threshold(y: torch.Tensor, ratio: float) -> torch.Tensor:
    """``τ`` per row of ``y [..., D]``: its ``min(int(ratio D), D - 1)``-th smallest magnitude."""
    d = y.shape[-1]
    return y.abs().sort(dim=-1).values[..., min(int(ratio * d), d - 1)]


def int2_rows(y: torch.Tensor, ratio: float, meta: str = "fp32") -> torch.Tensor:
    """Rotated rows ``y [..., D]`` (fp32) clipped, quantized to INT2 and read back (see the module);
    ``meta="fp16"``: scale and zero rounded to fp16 before they encode."""
    tau = clip_threshold(y, ratio)[..., None]
    x = torch.minimum(torch.maximum(y, -tau), tau)
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = torch.clamp(mx - mn, min=1e-8) / 3
    zero = -mn / scale
    if meta == "fp16":
        scale, zero = scale.half().float(), zero.half().float()
    code = torch.floor(x / scale + zero + 0.5).clamp(0, 3)
    return _bf16((code - zero) * scale)


def equivalent(name: str, n_layers: int, head_dim: int = 64) -> CacheConfig:
    """A kverr config of OSCAR's cache bytes: 2-bit codes with an fp32 scale and zero per (token,
    kv head) in pages of 8 tokens, the sink and recent tokens in bf16 (the rotations:
    :func:`rotation_bytes`)."""
    sinks, recent, meta = VARIANTS[name]
    fmt = int_format(2, PerToken(), symmetric=False, scale_dtype=meta)
    return CacheConfig(k=fmt, v=fmt, sinks=sinks, window=recent, window_dtype="bf16", page_size=DEMOTE, name=name)


def rotation_bytes(head_dim: int) -> int:
    """A layer's bf16 rotation of one side."""
    return head_dim * head_dim * 2


def make_cache(name: str, n_layers: int, fitted: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A transformers cache holding what OSCAR's cache holds, with the rotations ``fitted``."""
    from transformers import DynamicCache

    sinks, recent, meta = VARIANTS[name]

    class OscarCache(DynamicCache):
        def __init__(self):
            super().__init__()
            # per layer, each row both ways, read back in the model's space (rotated back once, as
            # it arrives): stored in bf16 ("k", "v") and as INT2 ("k2", "v2")
            self._rows: dict[int, dict[str, torch.Tensor]] = {}
            self._recent: dict[int, int] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in fitted:
                raise ConfigError(f"oscar: no rotation for layer {layer_idx}; fit it on a capture of every layer")
            super().update(key_states, value_states, layer_idx, *args, **kwargs)  # lengths, as any cache
            n = key_states.shape[-2]
            st = self._rows.setdefault(layer_idx, {})
            first = not st
            for side, x, r in (("k", key_states, fitted[layer_idx][0]), ("v", value_states, fitted[layer_idx][1])):
                y = rotate(x.float(), r)
                back = _bf16(r).T
                for key, rows in ((side, y @ back), (side + "2", int2_rows(y, CLIP_RATIO[side], meta) @ back)):
                    st[key] = rows if first else torch.cat([st[key], rows], dim=-2)
            total = st["k"].shape[-2]
            if first:
                self._recent[layer_idx] = min(max(total - sinks, 0), recent)
            else:
                for _ in range(n):
                    if self._recent[layer_idx] + 1 > recent + DEMOTE - 1:
                        self._recent[layer_idx] -= DEMOTE
                    self._recent[layer_idx] += 1
            pos = torch.arange(total)
            full = (pos < sinks) | (pos >= total - self._recent[layer_idx])
            return tuple(torch.where(full[:, None], st[side], st[side + "2"]).to(x.dtype)
                         for side, x in (("k", key_states), ("v", value_states)))

    return OscarCache()
