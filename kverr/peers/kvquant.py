"""KVQuant (Hooper et al., NeurIPS 2024), emulated as a peer: ``nuqX-1%`` with the first token
in fp16.

Restated from the paper and its public simulated quantizer (the one behind the paper's
perplexities), with the choices below where they differ or where a capture cannot supply what
the method uses.

**Offline fit** (:func:`fit`, on the calibration capture), per layer:

* keys, before RoPE, per channel (per kv head and channel): ``upper`` and ``lower`` the 99.5th
  and 0.5th percentiles over the capture's tokens (linear interpolation), kept in fp16;
* a codebook per layer and side of ``2**bits`` levels: Lloyd's algorithm
  (:func:`kverr.quant.codebooks.lloyd_max`) on the normalised non-outlier values
  (``|x_n| <= 1``), the first token left out. Keys are normalised by their channel's
  ``zero = (upper + lower) / 2`` and ``scale = (upper - lower) / 2``; values by the same
  statistics of each calibration token's row. KVQuant weights the k-means by the loss's Fisher
  information (squared gradients), which a capture does not hold: the fit is the paper's
  unweighted ablation, from quantile starts rather than k-means++.

**Cache** (per layer; the first token, position 0, kept exact in fp16 on both sides):

* keys: the cache undoes RoPE (with the capture's RoPE parameters: the model's); an element
  outside its channel's ``(lower, upper)`` (strictly) is an outlier, kept exact; the others take
  the nearest level of ``(x - zero) / scale`` (ties to the lower level) and read back
  ``level * scale + zero``; RoPE is applied again to what is read back;
* values, online per token over the whole row of all kv heads (as the method's ``v_proj``
  output): ``upper``/``lower`` the row's 99.5th and 0.5th percentiles (``torch.quantile``,
  linear), outliers ``>= upper`` or ``<= lower`` kept exact; the range of the rest is the row's
  min and max with the outliers replaced by the row's median; then as for keys;
* read-backs are rounded to fp16 (the method's model dtype).

Memory (:func:`report`), as the paper counts it: ``bits`` per element; the sparse outliers at a
nominal 1 % of the quantized elements, 16-bit value and 16-bit index each, and a 32-bit pointer
per token and side (CSC for keys, CSR for values); per value row an fp16 scale and zero point;
per key channel the fp16 thresholds and per layer and side the fp16 levels (static); the first
token in fp16. The outliers a run really finds can be more or fewer than 1 % (the key thresholds
are the calibration text's); :attr:`KVQuantCache.outlier_fraction` says how many it found.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kverr.memory import Bytes, MemoryReport, ModelShape
from kverr.progress import progress
from kverr.quant.codebooks import lloyd_max

#: Peer name -> bits of the dense codes.
VARIANTS = {"kvquant-2bit-1pct": 2, "kvquant-3bit-1pct": 3}
#: The outlier rate: 0.5 % at each end.
OUTLIERS = 0.01
#: Tokens kept in fp16 at the start (the attention sink).
FIRST = 1


def _normalised(x: np.ndarray, upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
    zero, scale = (upper + lower) / 2, (upper - lower) / 2
    return (x - zero) / np.where(scale > 0, scale, 1.0)


def _levels(xn: np.ndarray, bits: int) -> tuple[float, ...]:
    inside = xn[np.abs(xn) <= 1]
    return lloyd_max(torch.from_numpy(inside.astype(np.float64)), bits)


def fit(capture: Any, bits: int) -> dict[int, dict[str, Any]]:
    """Per layer: its RoPE parameters, key thresholds ``[H, D]`` (fp16 values, as fp32 tensors) and
    the key and value levels (see the module)."""
    from kverr.exceptions import ConfigError
    from kverr.rope import layer_rope

    if capture.attrs.get("rope") is None:
        raise ConfigError("kvquant quantizes keys before RoPE: the capture records no RoPE parameters")
    hi, lo = 100 * (1 - OUTLIERS / 2), 100 * OUTLIERS / 2
    out = {}
    for layer in progress(capture["layer"].values, desc="fit kvquant", unit="layer", leave=False):
        rope = layer_rope(capture.attrs["rope"], int(layer))
        sel = capture.sel(layer=layer)
        k = np.asarray(sel["k_pre"].values, dtype=np.float64)  # [H, N, D]
        v = np.asarray(sel["v"].values, dtype=np.float64)
        ku = np.percentile(k, hi, axis=1).astype(np.float16).astype(np.float64)  # [H, D]
        kl = np.percentile(k, lo, axis=1).astype(np.float16).astype(np.float64)
        kn = _normalised(k[:, FIRST:], ku[:, None], kl[:, None])
        rows = v.transpose(1, 0, 2).reshape(v.shape[1], -1)[FIRST:]  # [N, H * D], one row per token
        vu = np.percentile(rows, hi, axis=1, keepdims=True)
        vl = np.percentile(rows, lo, axis=1, keepdims=True)
        out[int(layer)] = dict(rope=rope, k_upper=torch.from_numpy(ku).float(), k_lower=torch.from_numpy(kl).float(),
                               k_levels=_levels(kn, bits), v_levels=_levels(_normalised(rows, vu, vl), bits))
    return out


def _nearest(xn: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """The nearest level of each normalised value as the method finds it: the argmin of the fp32
    distances (the lower level on a tie). Not :func:`kverr.quant.codebooks.level_codes`, whose
    rounded midpoints decide a value within an ulp of one otherwise (1 element in 393,216 of a
    held-out layer)."""
    c = torch.tensor(levels, dtype=torch.float32)
    return c[(xn[..., None] - c).abs().argmin(-1)]


def quantize_keys(k: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                  levels) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys ``k [B, H, T, D]`` read back (fp32, before the fp16 rounding), and the outlier mask."""
    k = k.float()
    up, lo = upper[None, :, None, :], lower[None, :, None, :]
    out = (k > up) | (k < lo)
    zero, scale = (up + lo) / 2, (up - lo) / 2
    dense = _nearest(torch.where(out, 0.0, k - zero) / torch.where(scale > 0, scale, 1.0), levels) * scale + zero
    return torch.where(out, k, dense), out


def quantize_values(v: torch.Tensor, levels) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``v [B, H, T, D]`` read back per token over all kv heads (fp32), and the outlier mask."""
    b, h, t, d = v.shape
    rows = v.float().permute(0, 2, 1, 3).reshape(b, t, h * d)
    up = torch.quantile(rows, 1 - OUTLIERS / 2, dim=-1, keepdim=True)
    lo = torch.quantile(rows, OUTLIERS / 2, dim=-1, keepdim=True)
    out = (rows >= up) | (rows <= lo)
    med = rows.median(dim=-1, keepdim=True).values
    rest = torch.where(out, med, rows)
    mx, mn = rest.amax(-1, keepdim=True), rest.amin(-1, keepdim=True)
    zero, scale = (mx + mn) / 2, (mx - mn) / 2
    dense = _nearest(torch.where(out, 0.0, rows - zero) / torch.where(scale > 0, scale, 1.0), levels) * scale + zero
    back = torch.where(out, rows, dense)
    return (back.reshape(b, t, h, d).permute(0, 2, 1, 3),
            out.reshape(b, t, h, d).permute(0, 2, 1, 3))


def report(name: str, shape: ModelShape, tokens: int, batch: int = 1, **_: Any) -> MemoryReport:
    """The cache's bytes as the paper counts them (see the module)."""
    bits = VARIANTS[name]
    h, d = shape.n_kv_heads, shape.head_dim
    first = min(FIRST, tokens)
    n_q = (tokens - first) * batch  # quantized rows per kv head
    elements = n_q * h * d
    sparse = round(OUTLIERS * elements) * 4 + n_q * 4
    per_layer = []
    for _ in range(shape.n_layers):
        sides = {}
        for side in ("k", "v"):
            b = Bytes(payload=(elements * bits + 7) // 8 + sparse, sinks=first * batch * h * d * 2)
            b.static = 2 * 2**bits + (h * d * 4 if side == "k" else 0)
            if side == "v":
                b.scales = b.zeros = n_q * 2
            sides[side] = b
        per_layer.append(sides)
    return MemoryReport(config_name=name, shape=shape, tokens=tokens, batch=batch, page_size=1, per_layer=per_layer)


def make_cache(name: str, fitted: dict[int, dict[str, Any]]) -> Any:
    """A transformers cache holding what ``name`` stores, fitted as :func:`fit` gives it."""
    from transformers import DynamicCache

    from kverr.exceptions import ConfigError
    from kverr.rope import apply_rope

    class KVQuantCache(DynamicCache):
        def __init__(self):
            super().__init__()
            self.outliers = [0, 0]  # (outliers, quantized elements), both sides

        @property
        def outlier_fraction(self) -> float:
            """Outliers found so far over the elements quantized."""
            return self.outliers[0] / max(self.outliers[1], 1)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in fitted:
                raise ConfigError(f"{name}: no fit for layer {layer_idx}; fit it on a capture of every layer")
            f = fitted[layer_idx]
            t0 = self.get_seq_length(layer_idx)
            n = key_states.shape[-2]
            pos = torch.arange(t0, t0 + n)
            k_pre = apply_rope(key_states.float(), pos, f["rope"], inverse=True)
            kq, kout = quantize_keys(k_pre, f["k_upper"], f["k_lower"], f["k_levels"])
            vq, vout = quantize_values(value_states, f["v_levels"])
            keep = (torch.arange(t0, t0 + n) < FIRST)[:, None]
            kq, vq = torch.where(keep, k_pre, kq), torch.where(keep, value_states.float(), vq)
            self.outliers[0] += int((kout & ~keep).sum() + (vout & ~keep).sum())
            b, h, _, d = key_states.shape
            self.outliers[1] += 2 * int((~keep).sum()) * b * h * d
            k_back = apply_rope(kq.to(torch.float16).float(), pos, f["rope"]).to(key_states.dtype)
            return super().update(k_back, vq.to(torch.float16).to(value_states.dtype), layer_idx, *args, **kwargs)

    return KVQuantCache()
