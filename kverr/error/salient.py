"""Salient prompt tokens: the tokens a prompt's own last queries attend to most, kept apart.

A config with ``salient`` = N keeps, for every (layer, kv head, K|V) whose format quantizes, the
N prompt tokens of highest saliency as ``window_dtype`` rows (what the sinks and the window
hold) with their positions (int32), beside their codes; reading the cache gives those rows at
those positions. A value error at token ``t`` reaches a query's output as ``a_qt · e_t``, so
with independent row errors its expected cost is ``Σ_q a_qt² ‖e_t‖²``: the saliency of ``t`` is
``Σ a_qt²`` over the last :data:`OBSERVED_QUERIES` queries of the prompt and the query heads
that read the kv head (:func:`kverr.error.terms.value_error_weight`, as fitted widths weigh values),
from the prefill's own attention over its fresh keys. Keys take the same positions: a key error
costs through the same attention weights.

Rules:

* The candidates of a kv head are the tokens the prefill itself quantizes under the token
  policy (after the sinks, before the window; whole token blocks) in both its K and V formats
  (:func:`kverr.quant.store.salient_candidates`), so that K and V of a kv head keep the same
  positions (a token still in the window is kept anyway). Fewer than N candidates (short
  prompts) keep as many, the same number for every kv head of the layer: the fewest any has.
* Static scales not given are fitted on the prefill's other tokens: a salient token is read
  back from its row, so its codes may saturate.
* Ties go to the earlier token. Decode tokens are never salient.
* With ``salient_recent`` = R, R of the N are the prompt's last R tokens after the sinks,
  whatever their saliency and wherever they are: the tokens a decode step's query reads most,
  kept for when they leave the window, or at once by a cache that quantizes the whole prompt
  (``kverr evaluate``'s default). While one is still in the window its row and the window's
  are the same received row, read once. The other N - R are chosen by saliency among the
  candidates before them.

The caches that choose them -- :class:`kverr.hf.KverrCache` and the kernel path -- take the
prefill's queries from the model's attention (:mod:`kverr.hf.salient`); ``kverr validate`` from
a capture. The calibration objective takes out, for each query it samples, the tokens the prompt
ending before it would choose (:func:`prompt_saliency`,
:func:`kverr.calibration.objective.salient_tokens`).

This is SnapKV's observation window (the prompt's last queries vote for the tokens to keep),
spent on precision instead of eviction, with the decomposition's ``a²`` weight.
"""

from __future__ import annotations

from typing import Any

import torch

from kverr.error.terms import value_error_weight

#: How many of the prompt's last queries vote for its salient tokens.
OBSERVED_QUERIES = 256


def token_saliency(query: torch.Tensor, key: torch.Tensor, scaling: float, *, sliding_window: int = 0,
                   sink: torch.Tensor | None = None) -> torch.Tensor:
    """Saliency ``[kv head, n]`` float64 of one sequence's prefill tokens.

    ``query [q_head, n, D]`` and ``key [kv_head, n, D]`` (post-RoPE) of the prefill; query head
    ``i`` reads kv head ``i // (q_heads / kv_heads)``. Causal attention of the last
    :data:`OBSERVED_QUERIES` queries (a ``sliding_window`` limits what each sees; learned
    ``sink`` logits, one per query head, take their share of the softmax and no saliency).
    """
    return prompt_saliency(query, key, scaling, [query.shape[1] - 1], sliding_window=sliding_window, sink=sink)[:, 0]


def prompt_saliency(query: torch.Tensor, key: torch.Tensor, scaling: float, ends, *, stride: int = 1,
                    sliding_window: int = 0, sink: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`token_saliency` of the prompts that end at each of ``ends`` (the index of a prompt's
    last token) within one sequence ``query [q_head, n, D]``, ``key [kv_head, n, D]``:
    ``[kv head, len(ends), n]`` float64, 0 past each end. ``stride`` s > 1 lets every s-th of a
    prompt's last :data:`OBSERVED_QUERIES` queries vote, counting back from its last (the
    calibration objective's estimate, ``1/s`` of the work; ``stride=1`` is the rule itself)."""
    Hq, n, _ = query.shape
    Hkv = key.shape[0]
    G = Hq // Hkv
    if stride < 1:
        raise ValueError(f"stride={stride} must be a positive number of queries")
    out = torch.zeros((Hkv, len(ends), n), dtype=torch.float64)
    for i, end in enumerate(ends):
        e = int(end)
        if not 0 <= e < n:
            raise ValueError(f"prompt end {e} is not a token of the {n}-token sequence")
        rows = torch.arange(e, max(e - OBSERVED_QUERIES, -1), -stride, device=query.device).flip(0)
        cols = torch.arange(e + 1, device=query.device)
        allowed = cols[None, :] <= rows[:, None]
        if sliding_window > 0:
            allowed &= cols[None, :] > rows[:, None] - sliding_window
        for h in range(Hkv):
            s = query[h * G:(h + 1) * G, rows].float() @ key[h, :e + 1].float().T * scaling  # [G, Q, e+1]
            s = s.masked_fill(~allowed, float("-inf"))
            if sink is not None:
                extra = sink[h * G:(h + 1) * G].float().to(s.device)[:, None, None].expand(G, len(rows), 1)
                a = torch.softmax(torch.cat([s, extra], -1), -1)[..., :e + 1]
            else:
                a = torch.softmax(s, -1)
            out[h, i, :e + 1] = value_error_weight(a.reshape(G * len(rows), e + 1).cpu())
    return out


def choose(saliency: torch.Tensor, lo: int, hi: int, count: int, recent: int = 0,
           end: int | None = None) -> torch.Tensor:
    """Positions ``[..., m]`` (ascending, int64) that a prompt of ``end`` tokens (default ``hi``)
    keeps, of ``count``: its last ``r = min(recent, count, end - lo)`` tokens, and the most
    salient of the candidates ``lo .. min(hi, end - r) - 1`` of ``saliency [..., n]``, as many
    as there are up to ``count - r`` (ties go to the earlier token)."""
    end = hi if end is None else end
    if not 0 <= recent <= max(count, 0):
        raise ValueError(f"recent={recent} must be in [0, count={count}]: the recent tokens are part of the count")
    if hi > end:
        raise ValueError(f"candidates up to {hi - 1} lie past the prompt's last token {end - 1}")
    r = max(0, min(recent, count, end - lo))
    stop = max(lo, min(hi, end - r))  # the candidates before the recent tokens
    order = torch.argsort(-saliency[..., lo:stop], dim=-1, stable=True)[..., :max(0, count - r)]
    tail = torch.arange(end - r, end, device=order.device).expand(*order.shape[:-1], r)
    return torch.cat([order.sort(dim=-1).values + lo, tail], -1).long()


def kept_count(config: Any, n: int, spans) -> tuple[int, int]:
    """``(m, r)``: how many salient tokens every kv head of a layer keeps from an ``n``-token
    prompt with candidates ``spans`` (``[(lo, hi)]`` per kv head), ``r`` of them the prompt's
    last: ``config.salient`` or, with fewer candidates, the fewest any kv head has."""
    lo = min((a for a, _ in spans), default=0)
    r = max(0, min(config.salient_recent, n - lo))
    rest = min([config.salient - r] + [max(0, min(hi, n - r) - a) for a, hi in spans])
    return r + rest, r


def positions(config: Any, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, *,
              sliding_window: int = 0, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Salient positions ``[B, kv_head, m]`` (int64, ascending) of ``layer`` for a batch of
    equal-length prefills, ``query [B, q_head, n, D]`` and ``key [B, kv_head, n, D]`` (post-RoPE):
    per sequence and kv head, the ``m`` tokens :func:`choose` keeps (:func:`kept_count`:
    ``config.salient``, or fewer where a kv head has fewer candidates): the prompt's last
    ``config.salient_recent``, and the candidates (:func:`kverr.quant.store.salient_candidates`
    of the head's K and V formats and windows) of highest :func:`token_saliency` before them."""
    from kverr.quant.store import salient_candidates

    H, n = key.shape[1], key.shape[2]
    sal = torch.stack([token_saliency(query[b], key[b], scaling, sliding_window=sliding_window, sink=sink)
                       for b in range(query.shape[0])])
    spans = [salient_candidates(n, config, layer, h) for h in range(H)]
    m, r = kept_count(config, n, spans)
    return torch.stack([choose(sal[:, h], lo, hi, m, r, n) for h, (lo, hi) in enumerate(spans)], 1)
