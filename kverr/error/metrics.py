"""Per-query metric definitions and small numerically careful helpers.

Everything here works on torch tensors on trailing axes. The metrics themselves are accumulated
block by block in :mod:`kverr.error.stream`; this module names them, documents them, and holds
the pieces that need care (a cancellation-free ``expm1(x) - x``, top-k merging, rank flips),
plus the tensor-level reconstruction error used for contrast.

Metric names (each ``[..., Q]`` per query; see :data:`QUERY_METRICS`):

``logit_max_abs``
    max_j |δs_j| over the keys the query sees (δs = q·(k̂−k)ᵀ·scale).
``logit_rms``
    sqrt(mean_j δs_j²) over the keys the query sees.
``margin``
    top-1 minus top-2 logit of the clean scores s (NaN when the query sees one key).
``entropy``
    −Σ a log a of the clean attention, in nats.
``sensitivity``
    logit_max_abs / margin: above 1/2 the top-1 key *can* change, below it it cannot.
``kl``
    KL(a ‖ a′) in nats (= δlse − Σ a δs; relative accuracy ~ ulp/|δs|).
``tv``
    total variation ½ Σ |a′ − a|.
``first_order_err``
    ‖δa − J δs‖₂ / ‖δa‖₂ with J = diag(a) − aaᵀ: how wrong the linearised softmax is.
``first_order_key_err``
    ‖(J δs)·V − key_term‖₂ / ‖key_term‖₂: the same at the output.
``top1_flip``
    1.0 when the arg-max key changes, else 0.0.
``topk_overlap``
    |top-k(a) ∩ top-k(a′)| / k (k capped by the number of visible keys).
``rank_flips``
    number of discordant pairs among the top-k keys of a when ranked by a′ (Kendall distance).
``out_norm``
    ‖o‖₂ of the clean output o = a·V.
``key_rel``, ``value_rel``, ``cross_rel``, ``total_rel``
    ‖term‖₂ / ‖o‖₂ for the key, value and cross terms and the total output error.
"""

from __future__ import annotations

import torch

#: Per-query metrics returned by the decomposition, in a fixed order.
QUERY_METRICS: tuple[str, ...] = (
    "logit_max_abs",
    "logit_rms",
    "margin",
    "entropy",
    "sensitivity",
    "kl",
    "tv",
    "first_order_err",
    "first_order_key_err",
    "top1_flip",
    "topk_overlap",
    "rank_flips",
    "out_norm",
    "key_rel",
    "value_rel",
    "cross_rel",
    "total_rel",
)

#: Tensor-level reconstruction metrics per kv head (see :func:`reconstruction_error`).
RECON_METRICS: tuple[str, ...] = ("k_mse", "v_mse", "k_snr_db", "v_snr_db")

def merge_topk(
    vals: torch.Tensor,
    idx: torch.Tensor,
    extra: torch.Tensor | None,
    new_vals: torch.Tensor,
    new_idx: torch.Tensor,
    new_extra: torch.Tensor | None,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merge a running top-k with a block's top-k along the last axis.

    Parameters
    ----------
    vals, idx : torch.Tensor
        ``[..., k0]`` running values (descending) and their key indices.
    extra : torch.Tensor or None
        ``[..., k0]`` a value carried along with each index (e.g. the perturbed logit).
    new_vals, new_idx, new_extra : torch.Tensor
        ``[..., k1]`` the same for the new block.
    k : int
        How many to keep.

    Returns
    -------
    tuple
        ``(vals, idx, extra)`` each ``[..., min(k, k0 + k1)]``.
    """
    v = torch.cat([vals, new_vals], dim=-1)
    i = torch.cat([idx, new_idx], dim=-1)
    kk = min(k, v.shape[-1])
    top_v, pos = v.topk(kk, dim=-1)
    top_i = i.gather(-1, pos)
    top_e = None
    if extra is not None and new_extra is not None:
        top_e = torch.cat([extra, new_extra], dim=-1).gather(-1, pos)
    return top_v, top_i, top_e


def rank_flips(order_vals: torch.Tensor, other_vals: torch.Tensor) -> torch.Tensor:
    """Number of discordant pairs between two rankings of the same k items.

    Parameters
    ----------
    order_vals : torch.Tensor
        ``[..., k]`` values sorted descending (the clean logits of the top-k keys); entries
        equal to −inf are padding and take part in no pair.
    other_vals : torch.Tensor
        ``[..., k]`` the perturbed logits of the same keys.

    Returns
    -------
    torch.Tensor
        ``[...]`` count of pairs (i, j), i ranked above j by ``order_vals``, that the perturbed
        values order the other way (ties in ``other_vals`` count as half a flip).
    """
    valid = torch.isfinite(order_vals)
    a_i = order_vals.unsqueeze(-1)
    a_j = order_vals.unsqueeze(-2)
    b_i = other_vals.unsqueeze(-1)
    b_j = other_vals.unsqueeze(-2)
    pair = valid.unsqueeze(-1) & valid.unsqueeze(-2) & (a_i > a_j)
    flipped = (b_i < b_j).to(order_vals.dtype) + 0.5 * (b_i == b_j).to(order_vals.dtype)
    return (flipped * pair.to(order_vals.dtype)).sum(dim=(-1, -2))


def topk_overlap(idx_a: torch.Tensor, idx_b: torch.Tensor, k_eff: torch.Tensor) -> torch.Tensor:
    """Fraction of shared indices between two top-k index sets.

    Parameters
    ----------
    idx_a, idx_b : torch.Tensor
        ``[..., k]`` integer indices; padding entries must be negative and differ between the
        two (−1 and −2) so that they never match.
    k_eff : torch.Tensor
        ``[...]`` or broadcastable: the number of real entries (min(k, visible keys)).

    Returns
    -------
    torch.Tensor
        ``[...]`` overlap in [0, 1].
    """
    match = (idx_a.unsqueeze(-1) == idx_b.unsqueeze(-2)).any(dim=-1)
    return match.sum(dim=-1).to(torch.float64) / k_eff.to(torch.float64)


def reconstruction_error(x, x_hat, *, axes=(-2, -1)):
    """Tensor-level reconstruction error: MSE and signal-to-noise ratio.

    Parameters
    ----------
    x, x_hat : numpy.ndarray or torch.Tensor
        ``[..., token, channel]`` original and reconstructed tensors, same shape.
    axes : tuple of int
        Axes reduced over (default: token and channel).

    Returns
    -------
    tuple of numpy.ndarray
        ``(mse, snr_db)`` each ``[...]``: mean squared error and 10·log10(Σx² / Σ(x̂−x)²)
        (+inf when the reconstruction is exact).
    """
    import numpy as np

    xa = np.asarray(x, dtype=np.float64)
    xh = np.asarray(x_hat, dtype=np.float64)
    err = xh - xa
    mse = np.mean(err * err, axis=axes)
    sig = np.sum(xa * xa, axis=axes)
    noise = np.sum(err * err, axis=axes)
    with np.errstate(divide="ignore"):
        snr = 10.0 * np.log10(sig / noise)
    snr = np.where(noise == 0, np.inf, snr)
    return mse, snr
