"""The calibration objective: predicted damage of a format, per (layer, kv head, K|V).

Two objectives share one measurement of attention damage (documented in the README):

* ``predicted_kl`` (the default, ``--objective kl``): predicted next-token KL in nats,
  ``Σ_l w_l^K · r_l^K + w_l^V · r_l^V``, where ``r_l^K`` and ``r_l^V`` are the key and value
  parts of layer ``l``'s relative squared attention-output error below and ``w_l^K``, ``w_l^V``
  its *measured* sensitivities (:mod:`.sensitivity`: the model's next-token KL per unit of
  relative squared error, from noise injected on the calibration text -- into that layer's
  ``o_proj`` input, one weight for both sides, by default; into its cached keys, or values, a
  weight per side, with ``noise="kv"``). A layer whose errors the rest of the network amplifies
  gets its bits first, and with per-side weights so does the side whose errors cost more.
* ``rel_attn_out_sq`` (``--objective rel``): ``Σ_l r_l``, every layer with the same weight.

The relative squared error ``r_l``. For every layer we sample ``n`` query positions
``p_1 < ... < p_n`` spread over the calibration capture (the first eighth is skipped so each
query sees a long context) and form, for each query head, the clean scores ``s = c·q Kᵀ``
(causal), the weights ``a = softmax(s)`` and the output ``o = a V``. A candidate format
reconstructs ``K̂ = K + E_K`` (or ``V̂ = V + E_V``) through the oracle
(:func:`kverr.quant.reconstruct`). With the model-wide outer option (``S`` sinks, ``R``-token
window) a query at ``p`` sees the error only on its quantized keys, ``S <= t <= p - R``
(mask ``M``; the sinks' and window's own rounding to ``window_dtype`` -- for int8 at most half
a step of 1/127 of a row's absmax -- is left out, while every quantized token is quantized from
the values the cache received). With ``decode`` (:func:`decode_steps`) the token policy is that of
:mod:`kverr.evaluation` and of a server that quantizes a prompt whole when it is prefilled: the
queries are decode steps ``d`` spread evenly over ``decode`` steps, and the window of step ``d``
holds only the ``min(R, d + 1)`` newest tokens (``S <= t <= p - min(R, d + 1)``).
An option with ``N`` salient tokens (:mod:`kverr.error.salient`) also takes out of ``M``, per
kv head and on the sides that keep rows, each query's ``N`` quantized tokens of highest
saliency for the prompt that ends just before it (:func:`salient_tokens`), as a cache that
chose them at that prompt's prefill reads them back from their rows.
With ``compensated_keys`` (``kverr calibrate --compensated-keys``) the integer key formats
reconstruct ``K̂`` with the codes a cache with ``key_rounding`` ``"compensated"`` chooses
(:mod:`kverr.quant.compensated`) under the second moment of all the capture's queries as static
moments store it (:func:`capture_moment`, :func:`key_cost`). A cache without static moments
rounds only the prompt's keys so and the keys generated after it to nearest; with decode steps,
each query then sees the nearest-rounded error on its sequence's generated tokens
(:func:`generated_tokens`, ``E_K`` there taken from the format rounded to nearest).
Then the terms as :mod:`kverr.error.terms` defines them (the definitions
:func:`kverr.error.decompose` uses too):

* keys: ``δs = c·q (M∘E_K)ᵀ``, ``a′ = softmax(s + δs)``, key term ``(a′ − a) V``
  (formed without cancellation: :func:`~kverr.error.terms.key_term_from_growth`, or
  :func:`~kverr.error.terms.weight_change` where that is unsafe);
* values: value term ``a (M∘E_V)`` (:func:`~kverr.error.terms.value_term`).

The damage of a (layer, kv head, K|V, format) is the squared norm of that term, averaged over
the queries and summed over the query heads that read the kv head, divided by the layer's mean
squared output norm ``mean ‖o‖²`` times its number of query heads: a *relative* squared
attention-output error (of the concatenated heads, the ``o_proj`` input). ``r_l`` sums it over
the layer's kv heads, keys and values. Summing assumes the heads' and the two sides' errors add
(the cross term is second order and left out) and, for ``predicted_kl``, that a quantization
error costs what an isotropic error of the same relative size does; :func:`predict` evaluates
any config with the same definition, so it can be ranked against measured next-token KL.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kverr.config import WHICH, CacheConfig
from kverr.error import terms as _terms
from kverr.error.salient import OBSERVED_QUERIES, choose, prompt_saliency
from kverr.exceptions import CaptureError, ConfigError
from kverr.quant.formats import QuantFormat
from kverr.quant.compensated import KeyCost, KeyMoments, compensable, query_moment, reads_in_groups, stored_moment
from kverr.quant.store import reconstruct

from .candidates import OuterOption

log = logging.getLogger(__name__)

#: The objective's salient tokens are voted by every SALIENCY_STRIDE-th of a prompt's last
#: queries (:func:`kverr.error.salient.prompt_saliency`): an estimate of the cache's choice at
#: 1/8 of the work (on layers 3, 15 and 27 of the default capture it picks 16–83 % of the same
#: 8 tokens, the most in layer 3, where they hold 43–75 % of the quantized tokens' attention).
SALIENCY_STRIDE = 8
OBJECTIVE_NAME = "rel_attn_out_sq"
OBJECTIVE_DOC = (
    "sum over layers, kv heads and K|V of mean_q ||term||^2 / (n_q_heads * mean_q ||o||^2), "
    "term = key term (a'-a)V for K errors, value term a E_V for V errors (kverr.error.decompose "
    "definitions), sampled queries over the capture, sinks and per-query window masked (their own "
    "window_dtype rounding left out), and with salient tokens N each query's N most salient quantized "
    f"tokens for the prompt ending before it (sum of a^2 over every {SALIENCY_STRIDE}th of that "
    f"prompt's last {OBSERVED_QUERIES} queries); with "
    "decode_steps N the queries are decode steps d spread over N after a prompt quantized whole, "
    "whose window holds the min(R, d + 1) newest tokens"
)
OBJECTIVE_KL_NAME = "predicted_kl"
OBJECTIVE_KL_DOC = (
    "predicted next-token KL in nats: sum over layers l of w_l^K * r_l^K + w_l^V * r_l^V, r_l^K and "
    "r_l^V = the key and value parts of the layer's rel_attn_out_sq (" + OBJECTIVE_DOC + "), w_l^K "
    "and w_l^V = measured next-token KL per unit relative squared error of the layer's o_proj input "
    "(noise injection, see 'sensitivity': noise at the o_proj input gives both sides one weight, "
    "noise in the cached keys and in the cached values a weight per side)"
)
#: ``--objective`` value -> provenance name.
OBJECTIVES = {"kl": OBJECTIVE_KL_NAME, "rel": OBJECTIVE_NAME}


def max_queries(n_tokens: int) -> int:
    """How many distinct query positions :func:`query_positions` can sample from ``n_tokens``."""
    return max(1, n_tokens - n_tokens // 8)


def check_queries(queries: Any, n_tokens: int, option: str = "queries") -> None:
    """Refuse a number of sampled query positions that a ``n_tokens``-token capture cannot give
    (1 .. :func:`max_queries`); ``option`` names it in the message (``"--queries"`` in the CLI)."""
    q_max = max_queries(n_tokens)
    if isinstance(queries, bool) or not isinstance(queries, (int, np.integer)) or queries < 1:
        raise ConfigError(f"{option}={queries!r} must be a whole number of query positions, 1..{q_max}")
    if queries > q_max:
        raise ConfigError(
            f"{option} {queries} is more than the {q_max} positions a {n_tokens}-token capture offers "
            f"(its last 7/8); give 1..{q_max} or capture more tokens"
        )


def query_positions(n_tokens: int, queries: int) -> np.ndarray:
    """``queries`` distinct positions spread evenly over ``[n_tokens // 8, n_tokens)`` (at most
    :func:`max_queries`)."""
    lo = n_tokens // 8
    n = max(1, min(int(queries), n_tokens - lo))
    return np.unique(np.linspace(lo, n_tokens - 1, n).round().astype(np.int64))


@dataclass
class LayerPrep:
    """Everything of one layer the objective reuses across candidates.

    Attributes
    ----------
    q : Tensor ``[q_head, n, D]``  sampled (post-RoPE) queries, times the logit scale.
    k, v : Tensor ``[kv_head, T, D]``  clean keys (post-RoPE) and values.
    k_pre : Tensor or None ``[kv_head, T, D]``  pre-RoPE keys.
    a : Tensor ``[q_head, n, T]``  clean attention weights (0 where masked).
    o : Tensor ``[q_head, n, D]``  clean outputs; causal ``[n, T]`` 1 where a query sees a key
        (causal, within the layer's sliding window).
    norm : float  ``n_q_heads * mean ||o||^2``.
    steps : Tensor ``[n]`` or None  decode step of each query (see :func:`decode_steps`); None: every
        query's window holds its ``window`` most recent tokens.
    rest : Tensor ``[q_head, n]`` or None  weight of a learned sink (no value, no error), so that
        the keys' weights ``a`` sum to ``1 − rest``.
    saliency : Tensor ``[kv_head, n, T]`` float64 or None  per query, the saliency of every token
        for the prompt that ends just before it (:func:`salient_tokens`); None unless asked for.
    moment : Tensor ``[kv_head, D, D]`` float64 or None  the second moment of all the layer's
        queries per kv head, the cost compensated key rounding weighs (:func:`key_cost`); None
        unless asked for.
    masks : dict  the quantized masks of the options (:func:`_quantized_rows`) and the query
        blocks (:func:`query_blocks`), built once per layer.
    key_costs : dict  the :class:`~kverr.quant.compensated.KeyCost` of each RoPE side, built once.
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pre: torch.Tensor | None
    a: torch.Tensor
    o: torch.Tensor
    causal: torch.Tensor
    pos: torch.Tensor
    kv_map: torch.Tensor
    norm: float
    positions: np.ndarray
    rope: Any
    steps: torch.Tensor | None = None
    rest: torch.Tensor | None = None
    saliency: torch.Tensor | None = None
    moment: torch.Tensor | None = None
    masks: dict = field(default_factory=dict, repr=False)
    key_costs: dict = field(default_factory=dict, repr=False)


#: Decode steps the objective models by default: none (every query's window holds its most
#: recent tokens). ``kverr calibrate --decode 256`` models the evaluation protocol instead; held
#: out on the default model that chose better configs at 2.5, 4, 4.5 and 5 bits and a worse one at
#: 3 bits (README, "Calibrate"), so it is not the default.
DEFAULT_DECODE: int | None = None


def decode_steps(n_queries: int, decode: int) -> torch.Tensor:
    """Decode step of each of ``n_queries`` sampled queries: evenly spread over ``[0, decode)``.

    Models the protocol of :mod:`kverr.evaluation` (and of a server that quantizes a prompt whole
    when it is prefilled): every prompt token is quantized after the prefill, so at decode step
    ``d`` the full-precision window holds only the ``min(window, d + 1)`` newest generated tokens,
    not the ``window`` most recent tokens of the sequence.
    """
    if decode < 1:
        raise ConfigError(f"decode={decode} must be a positive number of steps")
    return torch.as_tensor((np.arange(n_queries) * decode) // max(1, n_queries), dtype=torch.long)


def capture_moment(q: Any, n_kv_heads: int) -> torch.Tensor:
    """The moment compensated keys are scored, and a calibrated config rounds them, under: the
    second moment of all of one layer's captured queries ``q [q_head, T, D]`` per kv head
    (:func:`~kverr.quant.compensated.query_moment`) as the config stores it
    (:func:`~kverr.quant.compensated.stored_moment`), ``[kv_head, D, D]`` float64."""
    q = torch.as_tensor(np.asarray(q), dtype=torch.float32)
    return stored_moment(query_moment(q[None], n_kv_heads, q.shape[1])[0])


def capture_key_moments(capture: Any) -> KeyMoments:
    """:func:`capture_moment` of every layer of a capture Dataset (its ``q`` ``[layer, q_head,
    token, channel]``): the static moments a calibration with compensated keys puts in its
    configs (``CacheConfig.key_moments``). Of several captures of one model (a list or tuple):
    each one's moments, as stored (divided by their mean diagonal), averaged with the captures
    counting alike."""
    captures = tuple(capture) if isinstance(capture, (list, tuple)) else (capture,)
    n_kv = captures[0].sizes["kv_head"]
    each = [torch.stack([capture_moment(c.q.isel(layer=i).values, n_kv) for i in range(c.sizes["layer"])])
            for c in captures]
    return KeyMoments.of(each[0] if len(each) == 1 else torch.stack(each).mean(0))


def prepare_layer(q, k, v, k_pre, *, layer: int, kv_map, scale: float, queries: int,
                  positions=None, rope=None, decode: int | None = None, sliding_window: int = 0,
                  sinks=None, salient: bool = False, compensated_keys: bool = False, moment: Any = None) -> LayerPrep:
    """Clean attention of the sampled queries of one layer.

    ``q [q_head, T, D]``, ``k, v, k_pre [kv_head, T, D]`` (numpy or torch). ``decode``: model
    each query as a decode step after a wholly quantized prompt (:func:`decode_steps`); None
    lets every query's window hold its most recent tokens. ``sliding_window`` W > 0: a query at
    p sees the keys ``p − W < t ≤ p`` only (the layer's attention mask), so the keys it cannot
    see carry no damage. ``sinks [q_head]``: learned sink logits, a softmax column per head
    without a value (the key growth form is exact with it, since the sink's logit does not move).
    ``salient``: also the saliency of every token for each query's prompt (:func:`salient_tokens`),
    which options with salient tokens need. ``compensated_keys``: also the queries' second moment
    that scoring keys rounded with compensation needs (:func:`key_cost`): ``moment [kv_head, D, D]``
    when given (static moments of several captures, :func:`capture_key_moments`), else
    :func:`capture_moment` of ``q``.
    """
    q = torch.as_tensor(np.asarray(q), dtype=torch.float32)
    k = torch.as_tensor(np.asarray(k), dtype=torch.float32)
    v = torch.as_tensor(np.asarray(v), dtype=torch.float32)
    kp = None if k_pre is None else torch.as_tensor(np.asarray(k_pre), dtype=torch.float32)
    T = k.shape[1]
    pos = torch.as_tensor(query_positions(T, queries))
    kv_map = torch.as_tensor(np.asarray(kv_map), dtype=torch.long)
    qs = q[:, pos] * float(scale)
    s = torch.einsum("hnd,htd->hnt", qs, k[kv_map])
    causal = torch.arange(T)[None, :] <= pos[:, None]  # [n, T]
    if sliding_window:
        causal &= torch.arange(T)[None, :] > (pos - int(sliding_window))[:, None]
    s = s.masked_fill(~causal, -math.inf)
    rest = None
    if sinks is None:
        a = torch.softmax(s, dim=-1)
    else:
        sk = torch.as_tensor(np.asarray(sinks), dtype=torch.float32)[:, None, None].expand(*s.shape[:2], 1)
        lse = torch.logsumexp(torch.cat([s, sk], -1), -1, keepdim=True)
        a = torch.exp(s - lse)
        rest = torch.exp(sk - lse)[..., 0]
    o = torch.einsum("hnt,htd->hnd", a, v[kv_map])
    norm = float((o * o).sum(-1).mean()) * q.shape[0]
    steps = None if decode is None else decode_steps(len(pos), decode)
    saliency = None
    if (salient or compensated_keys) and not reads_in_groups(kv_map, k.shape[0]):
        raise CaptureError("salient tokens and compensated keys need query head i to read kv head "
                           "i // (q_heads / kv_heads)")
    if compensated_keys:
        moment = capture_moment(q, k.shape[0]) if moment is None else torch.as_tensor(moment, dtype=torch.float64)
    else:
        moment = None
    if salient:
        saliency = prompt_saliency(q, k, float(scale), _prompt_ends(pos, steps).tolist(), stride=SALIENCY_STRIDE,
                                   sliding_window=int(sliding_window),
                                   sink=None if sinks is None else torch.as_tensor(np.asarray(sinks)))
    return LayerPrep(layer, qs, k, v, kp, a, o, causal.to(torch.float32), pos, kv_map,
                     norm if norm > 0 else 1.0,
                     np.arange(T) if positions is None else np.asarray(positions), rope,
                     steps, rest, saliency, moment)


def _prompt_ends(pos: torch.Tensor, steps: torch.Tensor | None) -> torch.Tensor:
    """The last token of each sampled query's prompt: the token before it, or before its first
    generated token for a decode step."""
    return torch.clamp(pos - 1 - (0 if steps is None else steps), min=0)


def generated_tokens(prep: LayerPrep) -> torch.Tensor:
    """``[n, T]`` bool: for each decode-step query, the tokens its sequence generated after its
    prompt (past :func:`_prompt_ends`), which a cache quantizes one by one as they leave the
    window, after the prefill's queries are gone."""
    if prep.steps is None:
        raise ConfigError("generated tokens are those of decode steps: prepare the layer with decode")
    if "generated" not in prep.masks:
        T = prep.k.shape[1]
        prep.masks["generated"] = torch.arange(T)[None, :] > _prompt_ends(prep.pos, prep.steps)[:, None]
    return prep.masks["generated"]


def rounds_generated_apart(prep: LayerPrep, compensated: bool, static_moments: bool) -> bool:
    """Whether a cache rounds the keys a decode-step query's sequence generated after its prompt
    otherwise than the prompt's: with ``compensated`` keys but no ``static_moments`` (a config's
    ``key_moments``) it rounds the prompt's keys under the prefill's queries and the later ones to
    nearest (:class:`kverr.hf.reference.KverrCache`), which needs no query kept per sequence."""
    return prep.steps is not None and compensated and not static_moments


def salient_tokens(prep: LayerPrep, h: int, mask: torch.Tensor, count: int, recent: int = 0) -> torch.Tensor:
    """``mask [n, T]`` (1 where a query sees a token quantized) with kv head ``h``'s salient
    tokens taken out: per query, the ``count`` quantized tokens of the prompt that ends just
    before it (for a decode step, before its first generated token) that
    :func:`kverr.error.salient.choose` keeps: that prompt's last ``recent`` tokens (a decode
    step's, before its first generated token, are quantized; a sampled query's are in its own
    window) and the others by saliency. A cache reads those tokens back from their
    ``window_dtype`` rows, whose rounding the objective leaves out as it does the window's."""
    if prep.saliency is None:
        raise ConfigError("salient tokens need the layer prepared with salient=True")
    out = mask.clone()
    seen = mask * prep.causal
    ends = _prompt_ends(prep.pos, prep.steps)
    for i in range(mask.shape[0]):
        idx = torch.nonzero(seen[i]).flatten()
        if idx.numel():
            lo, hi = int(idx[0]), min(int(idx[-1]), int(ends[i])) + 1
            out[i, choose(prep.saliency[h, i], lo, hi, count, recent, int(ends[i]) + 1)] = 0.0
    return out


def _quantized_rows(prep: LayerPrep, sinks: int, window: int, salient: int = 0, recent: int = 0, *,
                    h: int = 0) -> torch.Tensor:
    """``[n, T]`` float: 1 on the tokens a query sees quantized (causal, neither sink nor in its
    window, nor one of kv head ``h``'s ``salient`` tokens, ``recent`` of them its prompt's last),
    built once per layer (and kv head, with salient tokens). Key and value damage both apply it
    directly: subtracting the sink columns from unmasked sums instead cancels catastrophically
    when a sink's error is large."""
    key = (sinks, window, salient, recent, h if salient else None)
    if key not in prep.masks:
        if salient:
            prep.masks[key] = salient_tokens(prep, h, _quantized_rows(prep, sinks, window), salient, recent)
        else:
            m = prep.causal if window == 0 else _window_mask(prep, window)
            if sinks:
                m = m.clone()
                m[:, :sinks] = 0.0
            prep.masks[key] = m
    return prep.masks[key]


#: Sampled queries whose damage is computed at once (:func:`query_blocks`).
QUERY_BLOCK = 64


def query_blocks(prep: LayerPrep) -> list[tuple[int, int, int, int]]:
    """``(i0, i1, lo, hi)``: the sampled queries ``i0:i1`` see no token outside ``lo:hi``.

    The queries are in position order, so a block of :data:`QUERY_BLOCK` of them sees the tokens
    up to its last query only (and, under a sliding window, from the first its first query
    sees): on the default 4096-token capture, 512 queries in blocks of 64 read 0.62 of the
    query-token pairs. The damage of the tokens a query cannot see is zero term by term, so a
    block computes the same sums over fewer terms (its matmuls may group the sums otherwise:
    float32 rounding)."""
    if "blocks" not in prep.masks:
        n = prep.causal.shape[0]
        out = []
        for i0 in range(0, n, QUERY_BLOCK):
            i1 = min(n, i0 + QUERY_BLOCK)
            seen = torch.nonzero(prep.causal[i0:i1].any(0)).flatten()
            if seen.numel():
                out.append((i0, i1, int(seen[0]), int(seen[-1]) + 1))
        prep.masks["blocks"] = out
    return prep.masks["blocks"]


def _window_mask(prep: LayerPrep, window: int) -> torch.Tensor:
    """``[n, T]`` float: 1 where a query sees a token older than its window's tokens: its
    ``window`` most recent ones, or, with decode steps, its ``min(window, step + 1)`` newest."""
    T = prep.k.shape[1]
    w = window if prep.steps is None else torch.clamp(prep.steps + 1, max=window)
    return (torch.arange(T)[None, :] <= (prep.pos - w)[:, None]).to(torch.float32)


def key_cost(prep: LayerPrep, pre: bool) -> KeyCost:
    """The cost compensated key rounding weighs on one RoPE side of the layer: the second moment
    ``Σ_q`` of all the layer's queries per kv head (:func:`~kverr.quant.compensated.query_moment`
    over every position of the capture), for post-RoPE keys one matrix per head, for pre-RoPE
    keys turned to each token's position (:func:`~kverr.quant.compensated.turned_cost`), as a
    calibrated config's static moments store it (:func:`capture_moment`), under which that config
    rounds every key. (A config without them takes ``Σ_q`` from each prompt's last queries and
    rounds only the prompt's keys so; the objective, which reconstructs the capture once for every
    query, takes the capture's, for every key.)"""
    if prep.moment is None:
        raise ConfigError("this layer was prepared without compensated_keys: no query moment to round keys under")
    if pre not in prep.key_costs:
        if pre and (prep.k_pre is None or prep.rope is None):
            raise CaptureError("pre-RoPE keys requested but the capture has no k_pre or RoPE parameters")
        prep.key_costs[pre] = (KeyCost.of_moment(prep.moment, positions=prep.positions, rope=prep.rope) if pre
                               else KeyCost.of_moment(prep.moment))
    return prep.key_costs[pre]


def _key_reconstruct(prep: LayerPrep, x: torch.Tensor, cfg: CacheConfig, pre: bool,
                     heads: Sequence[int] | None = None) -> torch.Tensor:
    """``reconstruct`` of keys ``x`` (the layer's kv heads, or ``heads`` of them) on RoPE side
    ``pre``, rounded with compensation when ``cfg`` says so: under its static ``key_moments``
    where it has them, else under :func:`key_cost`."""
    cost = None
    if cfg.key_moments is not None:
        m = cfg.key_moments.layer(prep.layer)
        cost = KeyCost.of_moment(m, positions=prep.positions, rope=prep.rope) if pre else KeyCost.of_moment(m)
        cost = cost if heads is None else cost.heads(heads)
    elif cfg.compensates_keys:
        cost = key_cost(prep, pre)
        cost = cost if heads is None else cost.heads(heads)
    return reconstruct(x, cfg, layer=prep.layer, which="k", key_cost=cost)


def key_error(prep: LayerPrep, fmt_cfg: CacheConfig) -> torch.Tensor:
    """``E_K [kv_head, T, D]`` (post-RoPE) of a config whose sinks and window are 0 (its keys
    rounded with compensation under :func:`key_cost` if it says so)."""
    if fmt_cfg.key_pre_rope:
        if prep.k_pre is None:
            raise CaptureError("pre-RoPE keys requested but the capture has no k_pre")
        from kverr.rope import apply_rope

        k_hat = apply_rope(_key_reconstruct(prep, prep.k_pre, fmt_cfg, True), prep.positions, prep.rope)
    else:
        k_hat = _key_reconstruct(prep, prep.k, fmt_cfg, False)
    return k_hat.to(torch.float32) - prep.k


def value_error(prep: LayerPrep, fmt_cfg: CacheConfig) -> torch.Tensor:
    return reconstruct(prep.v, fmt_cfg, layer=prep.layer, which="v").to(torch.float32) - prep.v


def _per_kv_head(prep: LayerPrep, err2: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``err2 [..., q_head, n]`` -> relative damage per kv head ``[..., n_kv]`` (float64)."""
    per_q = err2.to(torch.float64).mean(-1)
    out = torch.zeros((*per_q.shape[:-1], n_kv), dtype=torch.float64)
    out.index_add_(per_q.ndim - 1, prep.kv_map, per_q)
    return out / prep.norm


def _option_key(option: OuterOption, which: str) -> tuple[int, int, int, int]:
    """``(sinks, window, salient tokens, recent ones among them)`` of ``option`` as side
    ``which`` sees them."""
    if which not in option.salient_sides or not option.salient:
        return option.sinks, option.window, 0, 0
    return option.sinks, option.window, option.salient, option.salient_recent


def _option_keys(options: Sequence[OuterOption], which: str) -> list[tuple[int, int, int, int]]:
    """Distinct :func:`_option_key` of ``options`` in first-seen order."""
    return list(dict.fromkeys(_option_key(o, which) for o in options))


def _head_groups(prep: LayerPrep) -> list[tuple[int, torch.Tensor]]:
    """``(kv_head, q_heads reading it)`` for every kv head that has query heads."""
    n_kv = prep.k.shape[0]
    out = []
    for h in range(n_kv):
        qi = torch.nonzero(prep.kv_map == h).flatten()
        if qi.numel():
            out.append((h, qi))
    return out


def _grouped(prep: LayerPrep, qi: torch.Tensor, x: torch.Tensor, queries: slice = slice(None),
             tokens: slice | None = None) -> torch.Tensor:
    """``x [q_head, n, ...]`` of the query heads ``qi`` as one ``[len(qi) * n', ...]`` block: the
    sampled ``queries`` of each head, and of ``x [q_head, n, T]`` the ``tokens`` only."""
    x = x[qi, queries] if tokens is None else x[qi, queries, tokens]
    return x.reshape(-1, *x.shape[2:])


def key_damage_batch(prep: LayerPrep, e_k: torch.Tensor, options: Sequence[OuterOption],
                     e_generated: torch.Tensor | None = None) -> np.ndarray:
    """Relative key-term damage ``[cand, option, kv_head]`` of key errors ``e_k [cand, kv_head, T, D]``.

    ``e_generated`` (same shape; decode steps only): the errors of the keys a query's sequence
    generated after its prompt (:func:`generated_tokens`), where the cache rounds them otherwise
    than the prompt's; each query sees ``e_k`` on its prompt's keys and ``e_generated`` on those.

    With the growth ``u = a·expm1(δs)`` over the quantized keys (mask ``M``) and
    ``Z = 1 + Σ M·u``, the changed weights are ``a′ = (a + M·u)/Z``, so the key term is
    ``(a′ − a)V = (Σ M·u·v − o·(Z − 1)) / Z`` (:func:`kverr.error.terms.key_term_from_growth`):
    no difference of two nearly equal weights is formed. Where that fp32 form is not safe --
    ``e^δs`` overflows, or ``Z`` is so small that its rounding matters (the quantized keys'
    weights all but vanish) -- the candidate batch is done in float64 as
    ``a′ − a = a·expm1(δs − log Σ a e^δs)`` (:func:`kverr.error.terms.weight_change`), which
    cannot overflow. Work is done per kv head on the block of all query heads reading it (GQA:
    no copy of a key error per query head), for a batch of candidates at once;
    ``δs = c·q E_Kᵀ`` is formed once per candidate and reused by every outer option.
    """
    C, n_kv = e_k.shape[0], e_k.shape[1]
    keys = _option_keys(options, "k")
    res = {key: torch.zeros((C, n_kv), dtype=torch.float64) for key in keys}
    for h, qi in _head_groups(prep):
        g = qi.numel()
        for i0, i1, lo, hi in query_blocks(prep):
            # [g*nb, D|T'] rows of the block's queries over the tokens they see
            qh, oh = (_grouped(prep, qi, x, slice(i0, i1)) for x in (prep.q, prep.o))
            ah = _grouped(prep, qi, prep.a, slice(i0, i1), slice(lo, hi))
            vh = prep.v[h, lo:hi]
            ds = torch.matmul(qh, e_k[:, h, lo:hi].transpose(-1, -2))  # [C, g*nb, T']
            if e_generated is not None:
                ds = torch.where(generated_tokens(prep)[i0:i1, lo:hi].repeat(g, 1),
                                 torch.matmul(qh, e_generated[:, h, lo:hi].transpose(-1, -2)), ds)
            ds.mul_(prep.causal[i0:i1, lo:hi].repeat(g, 1))
            u = _terms.growth(ah, ds)
            # a finite sum has no inf or NaN term (one pass, no mask); else every element is checked
            finite = bool(torch.isfinite(u.sum())) or bool(torch.isfinite(u).all())
            for key in keys:
                m = _quantized_rows(prep, *key, h=h)[i0:i1, lo:hi].repeat(g, 1)
                term = None
                if finite:
                    uw = u * m
                    us, z = _terms.growth_normaliser(uw)
                    if bool(torch.isfinite(z).all()) and float(z.min()) > Z_MIN:
                        term = _terms.key_term_from_growth(uw, us, z, vh, oh)
                if term is None:
                    # float64: the logsumexp form cannot overflow, and a = 0 (masked by causality)
                    # contributes nothing, whatever its δs
                    rest = None if prep.rest is None else _grouped(prep, qi, prep.rest, slice(i0, i1)).double()[:, None]
                    da = _terms.weight_change(ah.double(), ds.double() * m, rest)
                    term = _terms.key_term(da, vh.double())
                res[key][:, h] += (term * term).sum(-1).to(torch.float64).sum(-1)
    out = torch.stack([res[_option_key(o, "k")] for o in options], 1) / (prep.norm * prep.causal.shape[0])
    return out.numpy()


#: Below this ``Z = Σ a e^δs`` the fp32 key term is redone in float64 (its rounding, ~1e-7 of the
#: larger of 1 and Σ|u|, would no longer be negligible next to Z).
Z_MIN = 1e-2


def value_damage_batch(prep: LayerPrep, e_v: torch.Tensor, options: Sequence[OuterOption]) -> np.ndarray:
    """Relative value-term damage ``[cand, option, kv_head]`` of ``e_v [cand, kv_head, T, D]``."""
    C, n_kv = e_v.shape[0], e_v.shape[1]
    keys = _option_keys(options, "v")
    res = {key: torch.zeros((C, n_kv), dtype=torch.float64) for key in keys}
    for h, qi in _head_groups(prep):
        g = qi.numel()
        for i0, i1, lo, hi in query_blocks(prep):
            ah = _grouped(prep, qi, prep.a, slice(i0, i1), slice(lo, hi))  # [g*nb, T']
            eh = e_v[:, h, lo:hi]  # [C, T', D]
            for key in keys:
                m = _quantized_rows(prep, *key, h=h)[i0:i1, lo:hi].repeat(g, 1)
                term = _terms.value_term(ah * m, eh)  # [C, g*nb, D]
                res[key][:, h] += (term * term).sum(-1).to(torch.float64).sum(-1)
    out = torch.stack([res[_option_key(o, "v")] for o in options], 1) / (prep.norm * prep.causal.shape[0])
    return out.numpy()


def key_damage(prep: LayerPrep, e_k: torch.Tensor, options: Sequence[OuterOption],
               e_generated: torch.Tensor | None = None) -> np.ndarray:
    """Relative key-term damage ``[option, kv_head]`` of one key error ``e_k [kv_head, T, D]``
    (and ``e_generated`` on the generated keys; see :func:`key_damage_batch`)."""
    return key_damage_batch(prep, e_k[None], options, None if e_generated is None else e_generated[None])[0]


def value_damage(prep: LayerPrep, e_v: torch.Tensor, options: Sequence[OuterOption]) -> np.ndarray:
    """Relative value-term damage ``[option, kv_head]`` of ``e_v [kv_head, T, D]``."""
    return value_damage_batch(prep, e_v[None], options)[0]


def width_weights(prep: LayerPrep, h: int, qi: torch.Tensor, which: str, *, pre_rope: bool,
                  skip: int) -> torch.Tensor:
    """``W [T, D]`` of kv head ``h`` (read by query heads ``qi``) that per-channel widths are
    fitted with (:func:`kverr.calibration.channel_bits.key_weights` for ``which="k"``,
    :func:`~kverr.calibration.channel_bits.value_weights` for ``"v"``); ``skip`` sink tokens
    left out."""
    from . import channel_bits as cb

    a = _grouped(prep, qi, prep.a)
    if which == "k":
        return cb.key_weights(_grouped(prep, qi, prep.q), a, prep.v[h], _grouped(prep, qi, prep.o),
                              pre_rope=pre_rope, skip=skip)
    return cb.value_weights(a, prep.k.shape[-1], skip=skip)


def _score_templates(prep: LayerPrep, cands_k, cands_v, options, pres, groups, page_size: int,
                     window_dtype: str, dk: np.ndarray, dv: np.ndarray, compensated_keys: bool = False,
                     generated_apart: bool = False) -> dict:
    """Fit and score the template candidates (``channel_bits``) of :func:`score_layer` in place;
    returns the fitted widths. With ``compensated_keys`` the key templates' widths are fitted as
    for nearest rounding and scored with the keys rounded with compensation (and, with
    ``generated_apart``, the generated keys to nearest, as in :func:`score_layer`)."""
    from kverr.quant import CHANNEL_BITS, channel_reconstructions
    from kverr.quant.store import receive, token_regions
    from kverr.rope import apply_rope

    from . import channel_bits as cb

    tk = [j for j, f in enumerate(cands_k) if f.channel_bits is not None]
    tv = [j for j, f in enumerate(cands_v) if f.channel_bits is not None]
    out: dict = {}
    if not tk and not tv:
        return out
    skip = max(o.sinks for o in options)
    n_kv, _, D = prep.k.shape
    heads = _head_groups(prep)
    sides = [(pre, "k", tk, cands_k) for pre in pres if tk] + ([(None, "v", tv, cands_v)] if tv else [])
    for pre, which, js, cands in sides:
        clean = prep.v if which == "v" else (prep.k_pre if pre else prep.k)
        if clean is None:
            raise CaptureError("pre-RoPE keys requested but the capture has no k_pre")
        got = receive(clean[None], window_dtype)[0]
        T = clean.shape[1]
        errs = torch.zeros((len(js), n_kv, *clean.shape[1:]))
        errs_gen = errs.clone() if generated_apart and which == "k" else None
        recon: dict = {}  # per template's plain format: every channel at every width [W, kv_head, T, D]
        for h, qi in heads:
            shared: dict = {}  # per (plain format, floor): the templates' error curves
            w = width_weights(prep, h, qi, which, pre_rope=bool(pre), skip=skip)
            for c, j in enumerate(js):
                tmpl = cands[j]
                probe = tmpl.with_bits(2)
                if probe not in recon:
                    recon[probe] = channel_reconstructions(got, probe, page_size=page_size)
                floor = min(tmpl.channel_bits)
                if (probe, floor) not in shared:
                    shared[probe, floor] = cb.curves(recon[probe][:, h], clean[h], w, floor)
                fmt = cb.fit(tmpl, shared[probe, floor])
                out[(which, pre, j, h)] = fmt.channel_bits
                ck = compensated_keys and which == "k" and compensable(fmt)
                cfg = CacheConfig(k=fmt, v=fmt, page_size=page_size, window_dtype=window_dtype)
                near = None
                if not ck or errs_gen is not None:
                    if token_regions(T, cfg, fmt) == (0, T):
                        # every token quantized: the widths' reconstructions are the oracle's, bit for bit
                        pick = torch.as_tensor([CHANNEL_BITS.index(b) for b in fmt.channel_bits])
                        near = recon[probe][:, h].gather(0, pick[None, None, :].expand(1, T, D))[0]
                    else:
                        near = reconstruct(clean[h:h + 1], cfg, layer=prep.layer, which=which)[0]
                hat = (_key_reconstruct(prep, clean[h:h + 1], cfg.with_(key_rounding="compensated"), bool(pre), [h])[0]
                       if ck else near)
                ref = prep.k[h] if which == "k" else clean[h]
                for out_errs, x in ((errs, hat), (errs_gen, near)):
                    if out_errs is not None:
                        if pre:
                            x = apply_rope(x[None], prep.positions, prep.rope)[0].to(torch.float32)
                        out_errs[c, h] = x - ref
        if which == "k":
            idx = groups[pre]
            dk[np.ix_(idx, js)] = key_damage_batch(prep, errs, [options[i] for i in idx],
                                                   errs_gen).transpose(1, 0, 2)
        else:
            dv[:, js] = value_damage_batch(prep, errs, options).transpose(1, 0, 2)
    return out


#: Candidates whose damage is formed in one batch (bounds memory: ~C * q_head * n * T floats).
BATCH = 8


def score_layer(prep: LayerPrep, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat],
                options: Sequence[OuterOption], *, page_size: int = 64,
                window_dtype: str = "fp16", batch: int = BATCH,
                widths: dict | None = None, compensated_keys: bool = False,
                static_moments: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Damage tables of one layer: ``K [option, cand_k, kv_head]``, ``V [option, cand_v, kv_head]``.

    The keys of every RoPE side and the values are stacked on the head axis and reconstructed
    under every distinct format by :class:`~.fastrecon.SharedReconstruct` (the oracle's
    ``reconstruct``, bit for bit, with the format-independent work done once), then the key and
    value damage of ``batch`` candidates at a time for every outer option at once.

    Candidates with ``channel_bits`` are templates (:mod:`.channel_bits`): each (kv head, K|V,
    RoPE side) is scored with its own fitted widths, which are put into ``widths`` (when given)
    as ``{(which, pre, cand, kv_head): channel_bits}`` (``which`` ``"k"`` or ``"v"``; ``pre``
    True/False for keys, None for values).

    With ``compensated_keys`` (``prep`` prepared with it) the key candidates that can be rounded
    with compensation (:func:`~kverr.quant.compensated.compensable`) are scored so, under
    :func:`key_cost`: as a cache with ``key_rounding`` ``"compensated"`` would store them. With
    decode steps, each query sees its sequence's generated keys rounded to nearest, as such a
    cache rounds them (:func:`rounds_generated_apart`), unless ``static_moments``: a config that
    carries its moments rounds every key with compensation.
    """
    from .fastrecon import SharedReconstruct

    n_kv = prep.k.shape[0]
    dk = np.empty((len(options), len(cands_k), n_kv))
    dv = np.empty((len(options), len(cands_v), n_kv))
    pres = sorted({o.key_pre_rope for o in options})
    groups = {pre: [i for i, o in enumerate(options) if o.key_pre_rope == pre] for pre in pres}
    generated_apart = rounds_generated_apart(prep, compensated_keys, static_moments)
    if compensated_keys:
        # The plain formats' factors first (one per rotation and RoPE side, for all kv heads):
        # the templates, rounded head by head, share them where no channel is left without bits.
        for pre in pres:
            for f in {f.rotate: f for f in cands_k if f.channel_bits is None and compensable(f)}.values():
                key_cost(prep, bool(pre)).factor(f)
    fitted = _score_templates(prep, cands_k, cands_v, options, pres, groups, page_size, window_dtype, dk, dv,
                              compensated_keys, generated_apart)
    if widths is not None:
        widths.update(fitted)
    k_index = {f: j for j, f in enumerate(cands_k) if f.channel_bits is None}
    v_index = {f: j for j, f in enumerate(cands_v) if f.channel_bits is None}
    fmts = list(dict.fromkeys([*k_index, *v_index]))
    parts: list[tuple[Any, torch.Tensor]] = []
    for pre in pres:
        kin = prep.k_pre if pre else prep.k
        if kin is None:
            raise CaptureError("pre-RoPE keys requested but the capture has no k_pre")
        parts.append((pre, kin))
    parts.append(("v", prep.v))
    shared = SharedReconstruct(torch.cat([p for _, p in parts]), page_size=page_size, window_dtype=window_dtype)

    ck_cfg = {f: CacheConfig(k=f, v=f, page_size=page_size, window_dtype=window_dtype, key_rounding="compensated")
              for f in k_index if compensated_keys and compensable(f)}

    def errors(f: QuantFormat) -> dict:
        """``{side: error}``, and ``{(side, "generated"): error}`` of the generated keys where they
        are rounded apart (to nearest)."""
        both = shared(f) if f in v_index or f not in ck_cfg or generated_apart else None
        out: dict = {}
        for i, (name, clean) in enumerate(parts):
            if (name == "v" and f not in v_index) or (name != "v" and f not in k_index):
                continue
            near = both[i * n_kv:(i + 1) * n_kv] if both is not None else None
            if name != "v" and f in ck_cfg:
                hats = {name: _key_reconstruct(prep, clean, ck_cfg[f], bool(name))}
                if generated_apart:
                    hats[(name, "generated")] = near
            else:
                hats = {name: near}
            if name is True:
                from kverr.rope import apply_rope

                hats = {key: apply_rope(x, prep.positions, prep.rope).to(torch.float32) for key, x in hats.items()}
                clean = prep.k
            out.update({key: x - clean for key, x in hats.items()})
        return out

    for b0 in range(0, len(fmts), batch):
        chunk = fmts[b0:b0 + batch]
        errs = [errors(f) for f in chunk]
        for pre in pres:
            js = [k_index[f] for f in chunk if f in k_index]
            if js:
                e = torch.stack([er[pre] for er in errs if pre in er])
                eg = (torch.stack([er.get((pre, "generated"), er[pre]) for er in errs if pre in er])
                      if any((pre, "generated") in er for er in errs) else None)
                idx = groups[pre]
                dk[np.ix_(idx, js)] = key_damage_batch(prep, e, [options[i] for i in idx], eg).transpose(1, 0, 2)
        js = [v_index[f] for f in chunk if f in v_index]
        if js:
            e = torch.stack([er["v"] for er in errs if "v" in er])
            dv[:, js] = value_damage_batch(prep, e, options).transpose(1, 0, 2)
    return dk, dv


def _layer_arrays(capture: Any, layer: int, need_pre: bool):
    """One layer of a capture as :func:`prepare_layer` takes it.

    Returns ``q [q_head, T, D]``, ``k, v [kv_head, T, D]``, ``k_pre [kv_head, T, D]`` (None
    unless ``need_pre``), all float32 numpy, the layer's softmax scale and ``kv_head_of_q
    [q_head]``; the capture's metadata is read through ``ds.kv`` (:mod:`kverr.accessor`).
    """
    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.dims import LAYER

    sel = capture.sel({LAYER: layer})
    q = np.asarray(sel["q"].values, dtype=np.float32)
    k = np.asarray(sel["k"].values, dtype=np.float32)
    v = np.asarray(sel["v"].values, dtype=np.float32)
    kp = np.asarray(sel["k_pre"].values, dtype=np.float32) if need_pre else None
    return q, k, v, kp, capture.kv.attn_scale(layer), capture.kv.kv_head_of_q


def layer_damage(capture: Any, configs: Sequence[CacheConfig], *, queries: int = 64,
                 layers: Sequence[int] | None = None, decode: int | None = DEFAULT_DECODE,
                 progress: bool = False) -> np.ndarray:
    """Unweighted damage ``[config, layer, side]`` (side 0 keys, 1 values) of each config on a
    capture: the calibration objective, each layer prepared once for all configs.

    Sinks and window act through the per-query mask, formats through the oracle; a format's
    scale spans what its granularity says (a per-tensor scale spans the layer's kv heads).
    """
    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.progress import progress as progress_bar

    layers = capture.kv.layers if layers is None else list(layers)
    positions = capture.kv.positions
    out = np.zeros((len(configs), len(layers), 2))
    need_pre = any(c.key_pre_rope for c in configs)
    with progress_bar(total=len(layers), desc="predict", unit="layer", enabled=progress) as bar:
        for li, layer in enumerate(layers):
            q, k, v, kp, scale, kv_map = _layer_arrays(capture, layer, need_pre)
            prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=queries,
                                 positions=positions, rope=capture.kv.rope_of(layer) if need_pre else None, decode=decode,
                                 sliding_window=capture.kv.sliding_window(layer), sinks=capture.kv.attn_sink(layer),
                                 salient=any(c.salient for c in configs),
                                 compensated_keys=any(c.compensates_keys for c in configs))
            for ci, config in enumerate(configs):
                # one outer option per window length a head of the layer keeps; each head's
                # damage under its own
                H = prep.k.shape[0]
                windows = {w: [config.window_for(layer, h, w) for h in range(H)] for w in WHICH}
                lengths = {w: sorted(set(windows[w])) for w in WHICH}
                opts = {w: [OuterOption(window=n, sinks=config.sinks, key_pre_rope=config.key_pre_rope,
                                        salient=config.salient, salient_sides=config.salient_sides,
                                        salient_recent=config.salient_recent) for n in lengths[w]]
                        for w in WHICH}
                base = config.without_windows().with_(sinks=0, provenance={})
                e_gen = (key_error(prep, base.with_(key_rounding="nearest"))
                         if rounds_generated_apart(prep, base.compensates_keys, base.key_moments is not None) else None)
                dmg = {"k": key_damage(prep, key_error(prep, base), opts["k"], e_gen),
                       "v": value_damage(prep, value_error(prep, base), opts["v"])}
                for side, w in enumerate(WHICH):
                    out[ci, li, side] = float(sum(dmg[w][lengths[w].index(n), h] for h, n in enumerate(windows[w])))
            bar.update()
    return out


def predict(capture: Any, config: CacheConfig, *, queries: int = 64,
            layers: Sequence[int] | None = None, weights: Sequence[float] | None = None,
            weights_v: Sequence[float] | None = None, decode: int | None = DEFAULT_DECODE) -> dict[str, Any]:
    """Predicted damage of any config on a capture (the calibration objective; ``decode`` as in
    :func:`prepare_layer`).

    Returns ``{"total": float, "k": [layer] array, "v": [layer] array, "layers": [...],
    "relative": float}``; sinks and window act through the per-query mask, formats through the
    oracle (:func:`layer_damage`). ``relative`` is the unweighted sum (``rel_attn_out_sq``);
    with per-layer ``weights`` for keys and ``weights_v`` for values (a
    :class:`~.sensitivity.Sensitivity`'s ``weights_k`` and ``weights_v``, indexed by layer;
    without ``weights_v`` values take ``weights``), ``k``, ``v`` and ``total`` are weighted
    (``predicted_kl``, nats), else ``total == relative``.
    """
    import kverr.accessor  # noqa: F401  (registers ds.kv)

    layers = capture.kv.layers if layers is None else list(layers)
    d = layer_damage(capture, [config], queries=queries, layers=layers, decode=decode)[0]
    dk, dv = d[:, 0].copy(), d[:, 1].copy()
    rel = float(dk.sum() + dv.sum())
    if weights is not None:
        wk = np.asarray(weights, dtype=np.float64)[layers]
        wv = wk if weights_v is None else np.asarray(weights_v, dtype=np.float64)[layers]
        dk, dv = dk * wk, dv * wv
    return {"total": float(dk.sum() + dv.sum()), "k": dk, "v": dv, "layers": layers, "relative": rel}
