"""Statistics of captured keys, values and queries, per layer and head.

These are what makes a KV cache hard or easy to quantize: a few key channels with ranges far
above the rest (outlier channels), how RoPE mixes channel pairs, per-token ranges and the first
tokens that attract most attention (attention sinks). Array functions work on numpy arrays with
stated axes; the ``*_da`` style wrappers take a capture dataset and return named, computed
xarray objects.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kverr.dims import CHANNEL, KV_HEAD, KV_HEAD_OF_Q, LAYER, Q_HEAD, TOKEN
from kverr.exceptions import ShapeError

log = logging.getLogger(__name__)

__all__ = [
    "attention_mass_by_key",
    "causal_attention",
    "channel_absmax",
    "outlier_ratio",
    "pair_norm_absmax",
    "summary_table",
    "token_absmax",
]

_QUERY_BLOCK = 1024


def _head_dim_name(da: Any) -> str:
    return Q_HEAD if Q_HEAD in da.dims else KV_HEAD


def _softmax_rows(
    qh: np.ndarray, kh: np.ndarray, rows: np.ndarray, scale: float, sliding_window: int, sink: float | None = None
) -> np.ndarray:
    """Attention weights ``[len(rows), token]`` (float64) of the queries ``rows`` of one head; a
    ``sink`` logit takes its share of the softmax and gives no value (its weight is left out)."""
    idx = np.arange(kh.shape[0])
    s = np.asarray(qh[rows], dtype=np.float64) @ kh.T * scale
    allowed = idx[None, :] <= rows[:, None]
    if sliding_window > 0:
        allowed &= idx[None, :] > rows[:, None] - sliding_window
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=1, keepdims=True) if sink is None else np.maximum(s.max(axis=1, keepdims=True), sink)
    a = np.exp(s - m)
    a /= a.sum(axis=1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    return a


def causal_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    kv_head_of_q: np.ndarray,
    sliding_window: int = 0,
    sinks: np.ndarray | None = None,
    return_weights: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Causal (optionally sliding-window) softmax attention in float64, the textbook way.

    Parameters
    ----------
    q : numpy.ndarray
        ``[q_head, token, channel]`` queries (post-RoPE).
    k, v : numpy.ndarray
        ``[kv_head, token, channel]`` keys (post-RoPE) and values.
    scale : float
        Softmax scale (the capture's ``attn_scale``).
    kv_head_of_q : numpy.ndarray
        ``[q_head]`` kv head read by each query head.
    sliding_window : int
        If positive, query ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``
        (transformers' convention); 0 means full causal attention.
    sinks : numpy.ndarray, optional
        ``[q_head]`` learned sink logits (gpt-oss): one more softmax column per head, without a
        value.
    return_weights : bool
        Also return the attention weights (``[q_head, token, token]``, float64; mind memory).

    Returns
    -------
    out : numpy.ndarray
        ``[q_head, token, channel]`` float64, the attention output before the output projection.
    weights : numpy.ndarray
        Only with ``return_weights``.
    """
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[1:] != k.shape[1:]:
        raise ShapeError(
            f"causal_attention needs q [q_head, token, channel] and k, v [kv_head, token, channel] "
            f"of one length and width; got {q.shape}, {k.shape}, {v.shape}"
        )
    n_q, n_t, _ = q.shape
    kvh = np.asarray(kv_head_of_q)
    out = np.empty(q.shape, dtype=np.float64)
    weights = np.empty((n_q, n_t, n_t)) if return_weights else None
    idx = np.arange(n_t)
    for h in range(n_q):
        kh = np.asarray(k[kvh[h]], dtype=np.float64)
        vh = np.asarray(v[kvh[h]], dtype=np.float64)
        for start in range(0, n_t, _QUERY_BLOCK):
            rows = idx[start : start + _QUERY_BLOCK]
            a = _softmax_rows(q[h], kh, rows, scale, sliding_window, None if sinks is None else float(sinks[h]))
            out[h, rows] = a @ vh
            if weights is not None:
                weights[h, rows] = a
    return (out, weights) if return_weights else out


def channel_absmax(ds: Any, var: str = "k") -> Any:
    """Largest magnitude of each channel over all tokens.

    Returns
    -------
    xarray.DataArray
        ``(layer, kv_head | q_head, channel)``, float32, computed.
    """
    return abs(ds[var]).max(TOKEN).astype(np.float32).compute().rename(f"{var}_channel_absmax")


def outlier_ratio(ds: Any, var: str = "k") -> Any:
    """How far the widest channel stands out: max channel absmax / median channel absmax.

    A ratio near 1 means every channel has a similar range (one scale per token fits them);
    tens mean a few outlier channels dominate a per-token scale.

    Returns
    -------
    xarray.DataArray
        ``(layer, kv_head | q_head)``.
    """
    cmax = channel_absmax(ds, var)
    return (cmax.max(CHANNEL) / cmax.median(CHANNEL)).rename(f"{var}_outlier_ratio")


def pair_norm_absmax(ds: Any, var: str = "k_pre") -> Any:
    """Largest norm of each RoPE channel pair ``(i, i + R/2)`` over tokens.

    RoPE rotates each pair, so the pair norms of ``k_pre`` and ``k`` agree (times the RoPE
    ``attention_scaling``) even where the single-channel ranges differ.

    Returns
    -------
    xarray.DataArray
        ``(layer, kv_head | q_head, pair)``.
    """
    import kverr.accessor  # noqa: F401  (ds.kv)

    half = len(ds.kv.rope_of(ds.kv.layers[0])["inv_freq"])  # every layer type rotates the same channels
    x = ds[var].astype(np.float32)
    first = x.isel({CHANNEL: slice(0, half)})
    second = x.isel({CHANNEL: slice(half, 2 * half)}).assign_coords({CHANNEL: first[CHANNEL].values})
    norms = np.sqrt(first**2 + second**2)
    norms = norms.rename({CHANNEL: "pair"}).assign_coords(pair=np.arange(half))
    return norms.max(TOKEN).compute().rename(f"{var}_pair_absmax")


def token_absmax(ds: Any, var: str = "k") -> Any:
    """Largest magnitude over the channels of each token.

    Returns
    -------
    xarray.DataArray
        ``(layer, kv_head | q_head, token)``, computed.
    """
    return abs(ds[var]).max(CHANNEL).astype(np.float32).compute().rename(f"{var}_token_absmax")


def attention_mass_by_key(ds: Any, n_keys: int = 8, *, first_query: int | None = None) -> Any:
    """Mean attention weight each of the first ``n_keys`` key positions receives.

    Recomputes the model's attention from the captured q and k (float64, with the capture's
    ``attn_scale`` and sliding windows) and averages over the queries from ``first_query`` on
    (default ``n_keys``, so that every query could attend to all of them). An attention sink is
    a key, usually token 0, that takes a large share of the weight whatever the query.

    Returns
    -------
    xarray.DataArray
        ``(layer, q_head, key)`` with ``key`` = 0..n_keys-1, plus the coordinate
        ``uniform`` (layer, q_head): the mean weight a key would get under uniform attention.
    """
    import xarray as xr

    n_t = ds.sizes[TOKEN]
    start = n_keys if first_query is None else first_query
    if not 0 < n_keys <= n_t or not 0 <= start < n_t:
        raise ShapeError(f"need 0 < n_keys <= {n_t} and 0 <= first_query < {n_t}")
    kvh = ds[KV_HEAD_OF_Q].values
    layers = ds[LAYER].values
    mass = np.zeros((len(layers), ds.sizes[Q_HEAD], n_keys))
    for li in range(len(layers)):
        q = ds.q.isel({LAYER: li}).values
        k = ds.k.isel({LAYER: li}).values
        scale = ds.kv.attn_scale(layers[li])
        window = ds.kv.sliding_window(layers[li])
        idx = np.arange(n_t)
        for h in range(q.shape[0]):
            kh = k[kvh[h]].astype(np.float64)
            acc = np.zeros(n_keys)
            for s0 in range(start, n_t, _QUERY_BLOCK):
                rows = idx[s0 : s0 + _QUERY_BLOCK]
                a = _softmax_rows(q[h], kh, rows, scale, window)
                acc += a[:, :n_keys].sum(axis=0)
            mass[li, h] = acc / (n_t - start)
    uniform = np.mean(1.0 / (np.arange(start, n_t) + 1.0))
    return xr.DataArray(
        mass,
        dims=(LAYER, Q_HEAD, "key"),
        coords={LAYER: layers, Q_HEAD: ds[Q_HEAD].values, "key": np.arange(n_keys)},
        name="attention_mass",
        attrs={"uniform": float(uniform), "first_query": start},
    )


def summary_table(ds: Any) -> Any:
    """One row per (variable, layer, head): ranges and outlier measures.

    Columns: ``var``, ``layer``, ``head``, ``absmax``, ``std``, ``outlier_ratio`` (max/median
    channel absmax), ``token0_ratio`` (absmax of token 0 / median token absmax).

    Returns
    -------
    pandas.DataFrame
    """
    import pandas as pd

    rows = []
    for var in ("k_pre", "k", "v", "q"):
        da = ds[var].astype(np.float32)
        head = _head_dim_name(da)
        cmax = abs(da).max(TOKEN).compute()
        tmax = abs(da).max(CHANNEL).compute()
        std = da.std((TOKEN, CHANNEL)).compute()
        for layer in da[LAYER].values:
            for h in da[head].values:
                sel = {LAYER: layer, head: h}
                c = cmax.sel(sel).values
                t = tmax.sel(sel).values
                rows.append(
                    {
                        "var": var,
                        "layer": int(layer),
                        "head": int(h),
                        "absmax": float(c.max()),
                        "std": float(std.sel(sel)),
                        "outlier_ratio": float(c.max() / np.median(c)),
                        "token0_ratio": float(t[0] / np.median(t)),
                    }
                )
    return pd.DataFrame(rows)
