"""Per-channel bit widths fitted to what attention reads (candidates with ``channel_bits``).

A key error ``e`` moves the scores by ``c·q·e``; to first order in the score change, the key
term of a query ``q`` is ``Σ_t a_t δs_t (v_t − o)``, so with the channels' errors independent its
expected squared norm is ``Σ_t Σ_d W_td e_td²`` with

    W_td = Σ_q a_qt² |v_t − o_q|² (c q_d)²          (keys),
    W_td = Σ_q a_qt²                                (values: the value term a·E_V),

summed over the sampled queries of the kv head's query heads, over the tokens the queries see
quantized (sink tokens left out). Keys stored before RoPE: RoPE turns channel ``d`` with its
partner ``d ± D/2`` by the key's angle, so ``q_d²`` is replaced by the pair's mean
``(q_d² + q_{d±D/2}²)/2`` (exact on average over the angle). Spend bits where queries look and
attention lands: the channels whose ``W``-weighted squared error a bit lowers most get it.

:func:`curves` and :func:`fit` do that for one (layer, kv head, K|V): the weighted error of every
channel at every width of :data:`~kverr.quant.formats.CHANNEL_BITS` (the oracle's reconstructions,
:func:`kverr.quant.channel_reconstructions`), then :func:`allocate` raises widths greedily -- the
move of least weighted error per added bit among those that keep the packed codes within the
template's bytes -- until no move fits. A candidate format with ``channel_bits`` is such a
template (:func:`kverr.catalog.template`): the calibrator refits its widths for every (layer, kv head, K|V,
pre/post-RoPE keys), at no more code bytes than the template's, and writes the fitted widths into
the config. Held out on the default model the fitted widths cut the key part of the objective by
about a third against uniform static widths at equal bits
(``experiments/does-an-attention-aware-rotation-help/``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kverr.error.terms import value_error_weight
from kverr.exceptions import ConfigError
from kverr.quant.formats import CHANNEL_BITS, QuantFormat
from kverr.quant.packing import packed_nbytes
from kverr.quant.reference import codes_nbytes

def key_weights(q: torch.Tensor, a: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                pre_rope: bool, skip: int = 0) -> torch.Tensor:
    """``W [T, D]`` float64 of one kv head's keys (module docs).

    ``q [n, D]`` scaled queries of the head's query heads (rows stacked), ``a [n, T]`` their
    weights (0 where a query does not see a key), ``v [T, D]`` values, ``o [n, D]`` outputs;
    ``skip``: tokens at the start left out (sinks kept in full precision).
    """
    v64, o64 = v.double(), o.double()
    # |v_t - o_q|^2 expanded (a product instead of an [n, T, D] difference; float64 keeps the
    # cancellation far below what a weight needs)
    d2 = ((v64 * v64).sum(-1)[None, :] - 2.0 * (o64 @ v64.T) + (o64 * o64).sum(-1)[:, None]).clamp_(min=0.0)
    w = (a.double() ** 2) * d2  # [n, T]
    w[:, :skip] = 0.0
    q2 = q.double() ** 2
    if pre_rope:
        q2 = (q2 + q2.roll(q2.shape[-1] // 2, -1)) / 2
    return w.T @ q2


def value_weights(a: torch.Tensor, D: int, *, skip: int = 0) -> torch.Tensor:
    """``W [T, D]`` float64 of one kv head's values: ``Σ_q a_qt²``, the same for every channel."""
    w = value_error_weight(a)
    w[:skip] = 0.0
    return w[:, None].expand(-1, D)


def allocate(curves: np.ndarray, budget_bytes: int, widths: tuple[int, ...] = CHANNEL_BITS) -> tuple[int, ...]:
    """Widths per channel from weighted error ``curves [len(widths), D]`` (row ``w``: each
    channel's error at ``widths[w]``; ``widths`` ascending).

    Greedy: every channel starts at the narrowest width; each step takes the move -- one channel to any wider
    width -- of largest error decrease per added bit among those whose packed codes
    (:func:`kverr.quant.packing.packed_nbytes` per width) stay within ``budget_bytes``, until no
    move lowers the error. Ties go to the lower channel, then the narrower width.
    """
    curves = np.asarray(curves, dtype=np.float64)
    W, D = curves.shape
    widths = tuple(widths)
    if len(widths) != W or list(widths) != sorted(set(widths)):
        raise ConfigError(f"widths {widths} must be ascending, one per row of curves")
    at = np.zeros(D, dtype=np.int64)  # index into widths
    counts = np.zeros(W, dtype=np.int64)
    counts[0] = D

    def nbytes(w_i: int, n: int) -> int:
        return packed_nbytes(n, widths[w_i]) if widths[w_i] else 0

    used = nbytes(0, D)
    if used > budget_bytes:
        raise ConfigError(f"{D} channels of {widths[0]} bits take {used} bytes, more than the budget {budget_bytes}")
    cols = np.arange(D)
    while True:
        # byte change of moving one channel from width index i to j, for the current counts
        delta = np.array([[nbytes(i, counts[i] - 1) - nbytes(i, counts[i]) + nbytes(j, counts[j] + 1) - nbytes(j, counts[j])
                           if j > i and counts[i] > 0 else 1 << 40 for j in range(W)] for i in range(W)])
        cur = curves[at, cols]  # [D]
        gain = cur[None, :] - curves  # [W, D]: decrease moving each channel to width row
        bits = np.asarray(widths)[:, None] - np.asarray(widths)[at][None, :]
        fits = (bits > 0) & (used + delta[at][:, :].T <= budget_bytes) & (gain > 0)
        if not fits.any():
            return tuple(int(widths[i]) for i in at)
        score = np.where(fits, gain / np.maximum(bits, 1), -np.inf)
        # argmax over channels first (lower channel wins ties), then over widths
        flat = score.T.reshape(-1)
        k = int(np.argmax(flat))
        ch, j = divmod(k, W)
        used += int(delta[at[ch], j])
        counts[at[ch]] -= 1
        counts[j] += 1
        at[ch] = j


def curves(recon: torch.Tensor, clean: torch.Tensor, weights: torch.Tensor,
           floor: int = 0) -> tuple[np.ndarray, tuple[int, ...]]:
    """Weighted squared error of every channel of one (layer, kv head, K|V) at every width from
    ``floor`` up: ``(curves [W, D], widths)``, what :func:`fit` allocates from. Templates that
    share a floor share their curves: only their byte budgets differ.

    ``recon [len(CHANNEL_BITS), T, D]``: every channel's reconstruction at every width
    (:func:`kverr.quant.channel_reconstructions` of the head's tensor as the cache received it);
    ``clean [T, D]``: the values the error is measured against; ``weights [T, D]``
    (:func:`key_weights`, :func:`value_weights`).
    """
    rows = [i for i, b in enumerate(CHANNEL_BITS) if b >= floor]
    err = (recon[rows].double() - clean.double()[None]) ** 2  # [W, T, D]
    return torch.einsum("wtd,td->wd", err, weights.double()).numpy(), tuple(CHANNEL_BITS[i] for i in rows)


def fit(tmpl: QuantFormat, curves_widths: tuple[np.ndarray, tuple[int, ...]]) -> QuantFormat:
    """The template ``tmpl`` with ``channel_bits`` fitted from the :func:`curves` of its floor:
    the fitted widths are at least the template's narrowest and their codes take at most the
    template's bytes."""
    if tmpl.channel_bits is None:
        raise ConfigError(f"{tmpl.label()} is not a template (no channel_bits)")
    if tmpl.rotate != "none":
        raise ConfigError(f"{tmpl.label()}: fitted widths are defined for unrotated channels")
    c, widths = curves_widths
    if widths[0] != min(tmpl.channel_bits):
        raise ConfigError(f"{tmpl.label()}: curves from {widths[0]} bits up, the template's floor is {min(tmpl.channel_bits)}")
    bits = allocate(c, codes_nbytes(tmpl, c.shape[1]), widths)
    if max(bits) < 2:  # nothing worth a code anywhere: the template's own split
        return tmpl
    return dataclasses.replace(tmpl, channel_bits=bits)  # bits: their largest
