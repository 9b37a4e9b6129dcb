"""TurboQuant with outlier channels (Zandieh et al., ICLR 2026), emulated as a peer.

TurboQuant's MSE quantizer stores a vector as its norm and, for the unit vector turned by a
random rotation, each coordinate as its nearest Lloyd-Max level for the law of one coordinate of a
uniform point on the sphere. For the KV cache the paper reaches widths between integers (2.5 and
3.5 bits per channel) by splitting each head vector's channels into outlier and ordinary sets,
each quantized by its own instance, the outliers with more bits. The emulation, per (token, kv
head) row ``x`` of ``D`` channels of keys (after RoPE, as a cache receives them) and of values:

* **the split:** the ``D/2`` channels of largest mean square over the first rows a layer caches
  (the prefill), per kv head and side, are the outliers, fixed from then on; half the channels one
  bit wider makes the mean width the named one (``b + 1/2``). How outliers are picked, and how many,
  is the emulation's choice where the paper leaves it open;
* **each set** of ``m = D/2`` channels: its norm ``n`` kept in fp16; the unit vector ``x / n``
  (zero for a zero set) times a Haar-random orthogonal ``m x m`` matrix (:func:`rotation`: QR of a
  standard normal matrix from a seeded generator, signs fixed so that ``R``'s diagonal is
  positive); each coordinate the index of its nearest level of
  :func:`kverr.quant.codebooks.lloyd_max_sphere` for ``m`` dimensions at ``b + 1`` bits
  (outliers) or ``b`` bits (the rest);
* **read back:** the levels turned back by the transpose, times the fp16 norm.

Not emulated: the inner-product variant (a 1-bit QJL sketch of the residual), and the paper's
own rotation draws (any Haar draw has the same law). Every layer is quantized. Bytes per row:
``D (b + 1/2)`` code bits and two fp16 norms; :func:`equivalent` is a kverr config of the same
code and norm bits (see its docs for the few static bytes it adds).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError
from kverr.quant.codebooks import level_codes, lloyd_max_sphere
from kverr.quant.formats import CHANNEL_BITS, PerChannel, QuantFormat

#: Peer name -> width of the ordinary channels (the outliers have one bit more).
VARIANTS = {"turboquant-2.5": 2, "turboquant-3.5": 3}
#: Seed of the generator the rotations are drawn from.
SEED = 20260428


@functools.lru_cache(maxsize=8)
def rotation(m: int) -> torch.Tensor:
    """The Haar-random orthogonal ``m x m`` matrix (fp64) every set of ``m`` channels is turned by."""
    g = torch.Generator().manual_seed(SEED)
    q, r = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def outlier_channels(rows: torch.Tensor) -> torch.Tensor:
    """Per kv head, the ``D/2`` channels of largest mean square over ``rows [B, H, T, D]`` (as a
    ``[H, D]`` bool mask)."""
    ms = rows.float().pow(2).mean(dim=(0, 2))
    top = ms.topk(rows.shape[-1] // 2, dim=-1).indices
    return torch.zeros_like(ms, dtype=torch.bool).scatter_(-1, top, True)


def fake_quantize_set(x: torch.Tensor, bits: int) -> torch.Tensor:
    """One TurboQuant instance on rows ``x [..., m]``: what it reads back (fp32)."""
    m = x.shape[-1]
    xd = x.double()
    norm = torch.linalg.vector_norm(xd, dim=-1, keepdim=True)
    unit = torch.where(norm > 0, xd / torch.where(norm > 0, norm, 1.0), 0.0)
    rot = rotation(m)
    y = (unit @ rot).float()
    levels = lloyd_max_sphere(m, bits)
    codes = level_codes(y, levels).long()  # the nearest level, a tie going down
    back = torch.tensor(levels, dtype=torch.float64)[codes] @ rot.T
    return (back * norm.to(torch.float16).double()).float()


def fake_quantize(x: torch.Tensor, outliers: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows ``x [B, H, T, D]`` read back, the channels ``outliers [H, D]`` at ``bits + 1``, the rest
    at ``bits`` (fp32)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for h in range(x.shape[1]):
        for mask, b in ((outliers[h], bits + 1), (~outliers[h], bits)):
            out[:, h, :, mask] = fake_quantize_set(x[:, h][..., mask], b)
    return out


def equivalent(name: str, n_layers: int, head_dim: int = 64) -> CacheConfig:
    """A kverr config storing a row's ``D (b + 1/2) + 32`` bits as code bits: per-channel widths
    (asymmetric integers with per-channel scales) summing to exactly that. Its per-channel scales
    and zero points (fp16, once per layer, kv head and channel) are static bytes the peer does not
    store: ``8 D`` bytes per layer and kv head, amortised over the batch and the tokens."""
    bits = VARIANTS[name]
    if head_dim % 2:
        raise ConfigError(f"{name}: head dim {head_dim} is odd; the emulation splits it in halves")
    total = head_dim * (2 * bits + 1) // 2 + 32
    w, extra = divmod(total, head_dim)
    widths = (w + 1,) * extra + (w,) * (head_dim - extra)
    if not set(widths) <= set(CHANNEL_BITS):
        raise ConfigError(f"{name}: no kverr config of per-channel widths holds {total} bits per row of "
                          f"{head_dim} channels")
    fmt = QuantFormat(dtype="int", bits=w, symmetric=False, granularity=PerChannel(), scale_dtype="fp16",
                      channel_bits=widths)
    return CacheConfig(k=fmt, v=fmt, name=name)


def make_cache(name: str, n_layers: int) -> Any:
    """A transformers cache holding what the ``name`` variant stores (every layer quantized)."""
    from transformers import DynamicCache

    bits = VARIANTS[name]

    class TurboQuantOutlierCache(DynamicCache):
        def __init__(self):
            super().__init__()
            self._outliers: dict[tuple[int, str], torch.Tensor] = {}

        def _read_back(self, x: torch.Tensor, layer: int, side: str) -> torch.Tensor:
            mask = self._outliers.setdefault((layer, side), outlier_channels(x))
            return fake_quantize(x, mask, bits).to(x.dtype)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = self._read_back(key_states, layer_idx, "k")
            v = self._read_back(value_states, layer_idx, "v")
            return super().update(k, v, layer_idx, *args, **kwargs)

    return TurboQuantOutlierCache()
