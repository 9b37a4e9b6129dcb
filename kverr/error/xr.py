"""Named-dim layer: the decomposition of a whole capture for one cache config, lazily with dask.

:func:`decompose_capture` maps the array core (:func:`kverr.error.decompose_stream`) over the
layers of a capture with :func:`xarray.apply_ufunc` (``dask="parallelized"``, one task per
layer chunk). Per layer it reconstructs K̂ and V̂ with the one quantization oracle
(:func:`kverr.quant.reconstruct`, re-applying RoPE when the config quantizes pre-RoPE keys),
decomposes the attention of the last ``queries`` positions over the whole captured context,
and measures tensor-level reconstruction error for contrast.

The cache state is the one after all T captured tokens (sinks at the start, the full-precision
window at the end of the T tokens); every query attends to it causally, and in a sliding-window
layer of width W a query at position p sees the keys ``p − W < t ≤ p`` only. A model's learned
sink logits (``attn_sink``) join each softmax row as a column without a value. This is a snapshot
of the cache at the end of the capture, not a replay of the cache as it grew. The reconstruction
of a sliding layer is that of all T tokens: a cache that frees the blocks behind the window keeps
the same codes for the keys it still holds, since no format's groups span more than one block.
As a cache that prefilled the T tokens, a config that keeps salient tokens keeps those the
captured queries choose (:func:`kverr.error.salient.positions`), read back as received, and fits
its static scales on the other tokens; one that rounds its keys with compensation (``key_rounding``
``"compensated"``) rounds them under the second moment of the last
:data:`~kverr.error.salient.OBSERVED_QUERIES` captured queries of each kv head
(:func:`kverr.quant.compensated.query_moment`), or under its static ``key_moments``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kverr.dims import CHANNEL, KV_HEAD, KV_HEAD_OF_Q, LAYER, Q_HEAD, QUERY, TOKEN
from kverr.error.metrics import QUERY_METRICS, RECON_METRICS, reconstruction_error
from kverr.exceptions import CaptureError, ConfigError, ShapeError

log = logging.getLogger(__name__)

#: The dim of the prefill's queries, which choose a config's salient tokens and weigh the rounding
#: of its compensated keys (:func:`decompose_capture`).
PREFILL_QUERY = "prefill_query"

__all__ = ["compute", "decompose_capture", "summarize", "layer_table"]

#: Per-(layer, q_head) and per-layer summary variables written by :func:`summarize`.
SUMMARY_VARS: tuple[str, ...] = (
    "key_share",
    "value_share",
    "cross_share",
    "out_rel_err",
    "kl_mean",
    "tv_mean",
    "top1_flip_rate",
    "rank_flips_mean",
    "topk_overlap_mean",
    "first_order_err_median",
    "sensitivity_max",
)


def _layer_block(q, q_all, k, v, k_pre, layer_vals, scales, windows, sinks, *, config, kv_map, positions, rope,
                 topk, block_size):
    """Decompose the layers of one chunk; called by dask with numpy arrays.

    Parameters
    ----------
    q : numpy.ndarray
        ``[L, q_head, query, channel]`` (the last Q positions).
    q_all : numpy.ndarray
        ``[L, q_head, token, channel]``: every position, the prefill's queries, which choose a
        config's salient tokens and weigh the rounding of its compensated keys (a dummy when it
        has neither).
    k, v, k_pre : numpy.ndarray
        ``[L, kv_head, token, channel]`` (``k_pre`` may be a dummy when not needed).
    layer_vals, scales, windows : numpy.ndarray
        ``[L]`` model layer indices, logit scales and sliding windows (0: full attention).
    sinks : numpy.ndarray
        ``[L, q_head]`` learned sink logits (NaN: the model has none).

    Returns
    -------
    tuple of numpy.ndarray
        ``([L, q_head, query, metric], [L, kv_head, recon_metric])`` float64.
    """
    import torch

    from kverr.error.core import decompose_stream
    from kverr.quant import reconstruct
    from kverr.error.salient import OBSERVED_QUERIES, positions as salient_positions
    from kverr.quant.compensated import KeyCost, query_moment

    n_l = q.shape[0]
    qm = np.empty((n_l, q.shape[1], q.shape[2], len(QUERY_METRICS)), dtype=np.float64)
    rc = np.empty((n_l, k.shape[1], len(RECON_METRICS)), dtype=np.float64)
    for i in range(n_l):
        layer = int(layer_vals[i])
        qi = torch.from_numpy(np.ascontiguousarray(q[i], dtype=np.float32))
        ki = torch.from_numpy(np.ascontiguousarray(k[i], dtype=np.float32))
        vi = torch.from_numpy(np.ascontiguousarray(v[i], dtype=np.float32))
        sink = None if np.isnan(sinks[i]).all() else torch.from_numpy(sinks[i].astype(np.float32))
        # as a cache that prefilled the capture: its queries choose the salient tokens, and the
        # second moment of its last ones weighs the rounding of compensated keys
        moment = sal = None
        if config.compensates_keys or config.salient:
            qa = torch.from_numpy(np.ascontiguousarray(q_all[i], dtype=np.float32))
            if config.key_moments is not None:  # static: the config's own
                moment = config.key_moments.layer(layer)
            elif config.compensates_keys:
                moment = query_moment(qa[None], ki.shape[0], OBSERVED_QUERIES)[0]
            if config.salient:
                sal = salient_positions(config, layer, qa[None], ki[None], float(scales[i]),
                                        sliding_window=int(windows[i]), sink=sink)[0]
        if config.key_pre_rope:
            from kverr.rope import apply_rope, layer_rope

            kp = torch.from_numpy(np.ascontiguousarray(k_pre[i], dtype=np.float32))
            lrope = layer_rope(rope, layer)
            cost = None if moment is None else KeyCost.of_moment(moment, positions=positions, rope=lrope)
            k_hat = apply_rope(reconstruct(kp, config, layer=layer, which="k", key_cost=cost, salient=sal), positions, lrope)
        else:
            cost = None if moment is None else KeyCost.of_moment(moment)
            k_hat = reconstruct(ki, config, layer=layer, which="k", key_cost=cost, salient=sal)
        v_hat = reconstruct(vi, config, layer=layer, which="v", salient=sal)
        d = decompose_stream(qi, ki, vi, k_hat.to(torch.float32), v_hat.to(torch.float32),
                             causal=True, scale=float(scales[i]), kv_head_of_q=kv_map,
                             topk=topk, block_size=block_size, window=int(windows[i]),
                             sink=sink)
        for j, name in enumerate(QUERY_METRICS):
            qm[i, ..., j] = d.metrics[name].to(torch.float64).numpy()
        k_mse, k_snr = reconstruction_error(ki, k_hat)
        v_mse, v_snr = reconstruction_error(vi, v_hat)
        rc[i] = np.stack([k_mse, v_mse, k_snr, v_snr], axis=-1)
        log.debug("layer %d decomposed", layer)
    return qm, rc


def _check_capture(capture, config) -> None:
    needed = ["q", "k", "v"] + (["k_pre"] if config.key_pre_rope else [])
    dims = {
        "q": (LAYER, Q_HEAD, TOKEN, CHANNEL),
        "k": (LAYER, KV_HEAD, TOKEN, CHANNEL),
        "v": (LAYER, KV_HEAD, TOKEN, CHANNEL),
        "k_pre": (LAYER, KV_HEAD, TOKEN, CHANNEL),
    }
    missing = [n for n in needed if n not in capture.data_vars]
    if missing:
        why = " (the config quantizes keys before RoPE)" if "k_pre" in missing else ""
        raise CaptureError(f"the capture lacks the variables {missing}{why}")
    for n in needed:
        if tuple(capture[n].dims) != dims[n]:
            raise CaptureError(f"variable {n!r} has dims {tuple(capture[n].dims)}, expected {dims[n]}")
    if KV_HEAD_OF_Q not in capture.coords:
        raise CaptureError(f"the capture lacks the coordinate {KV_HEAD_OF_Q!r} on {Q_HEAD!r}")
    if config.key_pre_rope and capture.kv.rope is None:
        raise CaptureError("the config quantizes keys before RoPE but the capture has no 'rope' attribute")


def decompose_capture(
    capture: Any,
    config: Any,
    *,
    queries: int = 256,
    layers: Sequence[int] | None = None,
    scheduler: Any = None,
    topk: int = 8,
    block_size: int | None = None,
    progress: bool = False,
) -> Any:
    """Decompose the attention error of every layer and head of a capture for one config.

    Parameters
    ----------
    capture : xarray.Dataset
        A capture (see :mod:`kverr.dims`): ``q [layer, q_head, token, channel]`` post-RoPE,
        ``k``, ``v`` (and ``k_pre`` when the config quantizes pre-RoPE keys)
        ``[layer, kv_head, token, channel]``, coordinate ``kv_head_of_q`` on ``q_head``.
    config : CacheConfig or str
        A config, a preset name or a config JSON path (:func:`kverr.config.resolve`). Its salient
        tokens are those the capture's queries choose, and keys it rounds with compensation are
        rounded under the second moment of the capture's last
        :data:`~kverr.error.salient.OBSERVED_QUERIES` queries, as in a cache that prefilled the capture.
    queries : int
        Number of query positions: the last ``queries`` tokens, each attending causally to
        every token up to itself, or to its last W in a layer with a sliding window W (all
        tokens when the capture is shorter).
    layers : sequence of int, optional
        Layer coordinate values to decompose (default: all in the capture).
    scheduler : None, str or distributed.Client
        None returns the lazy dataset. ``"threads"``, ``"synchronous"`` or ``"processes"``
        compute with that local dask scheduler; an address (``"tcp://host:port"``) or a
        ``distributed.Client`` computes on that dask.distributed cluster. Computed datasets
        hold numpy arrays.
    topk : int
        k of the top-k overlap and rank-flip metrics.
    block_size : int, optional
        Key-block length of the streaming engine (default: automatic).
    progress : bool
        Show a progress bar while computing (only when ``scheduler`` is given).

    Returns
    -------
    xarray.Dataset
        Per-query metrics with dims ``(layer, q_head, query)`` (one variable per name in
        :data:`kverr.error.QUERY_METRICS`), reconstruction metrics ``k_mse, v_mse, k_snr_db,
        v_snr_db`` with dims ``(layer, kv_head)``, and the summaries of :func:`summarize`
        (dims ``(layer, q_head)`` and ``layer_*`` with dims ``(layer,)``). Attributes record
        the config (JSON), the number of queries and topk.

    Raises
    ------
    kverr.exceptions.CaptureError
        Missing variables or coordinates, wrong dims; salient tokens or compensated keys of a
        capture whose query head ``i`` does not read kv head ``i // (q_heads / kv_heads)``.
    kverr.exceptions.ConfigError
        The config does not fit the model (e.g. a group size that does not divide the head
        dim, an override for a layer the model lacks).
    kverr.exceptions.ShapeError
        ``queries`` not positive, ``topk`` not in ``1..tokens``, or unknown ``layers``.
    """
    import xarray as xr

    import kverr.accessor  # noqa: F401  (ds.kv)
    from kverr.config import resolve

    cfg = resolve(config)
    if not isinstance(capture, xr.Dataset):
        raise CaptureError(f"capture must be an xarray.Dataset, got {type(capture).__name__}")
    _check_capture(capture, cfg)
    n_t = capture.sizes[TOKEN]
    n_kv = capture.sizes[KV_HEAD]
    head_dim = capture.sizes[CHANNEL]
    cfg.check_model(capture.kv.n_layers, n_kv, head_dim)
    if isinstance(queries, bool) or not isinstance(queries, (int, np.integer)) or int(queries) < 1:
        raise ShapeError(f"queries={queries!r} must be a positive integer")
    if int(queries) > n_t:
        log.warning("queries=%d exceeds the %d captured tokens; using all %d", queries, n_t, n_t)
    queries = min(int(queries), n_t)
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or not 1 <= int(topk) <= n_t:
        raise ShapeError(f"topk={topk!r} keys ranked: give 1..{n_t} (the capture holds {n_t} tokens)")
    if layers is not None:
        from kverr.dims import layer_positions

        capture = capture.isel({LAYER: layer_positions(capture[LAYER].values, layers)})

    kv_map = np.asarray(capture[KV_HEAD_OF_Q].values, dtype=np.int64)
    if kv_map.min() < 0 or kv_map.max() >= n_kv:
        raise CaptureError(f"{KV_HEAD_OF_Q} values {kv_map.tolist()} do not index the {n_kv} kv heads")
    positions = capture.kv.positions
    rope = capture.kv.rope
    scales = capture.kv.attn_scales()
    layer_idx = capture[LAYER].copy()

    whole = {TOKEN: -1, QUERY: -1, PREFILL_QUERY: -1, CHANNEL: -1, Q_HEAD: -1, KV_HEAD: -1, LAYER: 1}

    def prep(da):
        if da.chunks is None:
            da = da.chunk({LAYER: 1})
        return da.chunk({d: c for d, c in whole.items() if d in da.dims})

    q = prep(capture["q"].isel({TOKEN: slice(n_t - queries, None)}).rename({TOKEN: QUERY}))
    q = q.drop_vars([c for c in q.coords if c not in (LAYER, Q_HEAD, QUERY, CHANNEL)])
    # salient tokens and compensated keys: the prefill's queries choose the one and weigh the
    # other, the query heads of kv head h being h*G .. h*G+G-1
    if cfg.compensates_keys or cfg.salient:
        from kverr.quant.compensated import reads_in_groups

        if not reads_in_groups(kv_map, n_kv):
            raise CaptureError("salient tokens and compensated keys need query head i to read kv head "
                               f"i // (q_heads / kv_heads); this capture's {KV_HEAD_OF_Q} is {kv_map.tolist()}")
        q_all = prep(capture["q"].rename({TOKEN: PREFILL_QUERY}))
        q_all = q_all.drop_vars([c for c in q_all.coords if c not in (LAYER, Q_HEAD, PREFILL_QUERY, CHANNEL)])
    else:
        q_all = q.rename({QUERY: PREFILL_QUERY})
    k = prep(capture["k"])
    v = prep(capture["v"])
    k_pre = prep(capture["k_pre"]) if cfg.key_pre_rope else k
    layer_idx = layer_idx.chunk({LAYER: 1})
    scales = scales.chunk({LAYER: 1})
    windows = capture.kv.sliding_windows().chunk({LAYER: 1})
    sinks = capture.kv.attn_sinks().chunk({LAYER: 1, Q_HEAD: -1})

    qm, rc = xr.apply_ufunc(
        _layer_block,
        q, q_all, k, v, k_pre, layer_idx, scales, windows, sinks,
        input_core_dims=[[Q_HEAD, QUERY, CHANNEL], [Q_HEAD, PREFILL_QUERY, CHANNEL], [KV_HEAD, TOKEN, CHANNEL],
                         [KV_HEAD, TOKEN, CHANNEL], [KV_HEAD, TOKEN, CHANNEL], [], [], [], [Q_HEAD]],
        output_core_dims=[[Q_HEAD, QUERY, "metric"], [KV_HEAD, "recon_metric"]],
        dask="parallelized",
        output_dtypes=[np.float64, np.float64],
        dask_gufunc_kwargs={"output_sizes": {"metric": len(QUERY_METRICS),
                                             "recon_metric": len(RECON_METRICS)}},
        kwargs=dict(config=cfg, kv_map=kv_map, positions=positions, rope=rope, topk=int(topk),
                    block_size=block_size),
    )
    qm = qm.assign_coords(metric=list(QUERY_METRICS))
    rc = rc.assign_coords(recon_metric=list(RECON_METRICS))
    ds = qm.to_dataset(dim="metric")
    ds = ds.merge(rc.to_dataset(dim="recon_metric"))
    ds = ds.drop_vars([c for c in ("attn_scale", "sliding_window") if c in ds.coords])
    token_vals = capture[TOKEN].values[n_t - queries:]
    ds = ds.assign_coords({QUERY: token_vals, KV_HEAD_OF_Q: (Q_HEAD, kv_map)})
    ds = summarize(ds)
    ds.attrs.update(
        config=cfg.to_json(),
        config_name=cfg.name or "",
        queries=queries,
        topk=int(topk),
        context_tokens=n_t,
        source_model=capture.kv.provenance["model_id"],
        description=(
            "kverr error decomposition: per-query metrics (layer, q_head, query), tensor "
            "reconstruction error (layer, kv_head), summaries (layer, q_head) and layer_*"
        ),
    )
    if scheduler is None:
        return ds
    return compute(ds, scheduler, progress=progress)


def summarize(ds: Any) -> Any:
    """Add summary reductions of the per-query metrics to a decomposition dataset (lazily).

    Shares are energy shares over queries and channels:
    ``key_share = Σ‖key‖² / Σ(‖key‖² + ‖value‖² + ‖cross‖²)`` (likewise value and cross), so
    the three sum to 1; ``out_rel_err = sqrt(Σ‖o′−o‖² / Σ‖o‖²)``. Variables with dims
    ``(layer, q_head)`` are named as in :data:`SUMMARY_VARS`; ``layer_<name>`` aggregates over
    every query head, and ``layer_k_mse`` etc. average the reconstruction metrics over kv heads.

    Parameters
    ----------
    ds : xarray.Dataset
        Output of :func:`decompose_capture` (per-query variables).

    Returns
    -------
    xarray.Dataset
        ``ds`` with the summary variables added.
    """
    on2 = ds["out_norm"] ** 2
    sq = {t: (ds[f"{t}_rel"] ** 2) * on2 for t in ("key", "value", "cross", "total")}
    out = {}
    for prefix, dims in (("", [QUERY]), ("layer_", [Q_HEAD, QUERY])):
        e = {t: sq[t].sum(dims) for t in sq}
        denom = e["key"] + e["value"] + e["cross"]
        out[f"{prefix}key_share"] = e["key"] / denom
        out[f"{prefix}value_share"] = e["value"] / denom
        out[f"{prefix}cross_share"] = e["cross"] / denom
        out[f"{prefix}out_rel_err"] = np.sqrt(e["total"] / on2.sum(dims))
        out[f"{prefix}kl_mean"] = ds["kl"].mean(dims)
        out[f"{prefix}tv_mean"] = ds["tv"].mean(dims)
        out[f"{prefix}top1_flip_rate"] = ds["top1_flip"].mean(dims)
        out[f"{prefix}rank_flips_mean"] = ds["rank_flips"].mean(dims)
        out[f"{prefix}topk_overlap_mean"] = ds["topk_overlap"].mean(dims)
        out[f"{prefix}first_order_err_median"] = ds["first_order_err"].median(dims)
        out[f"{prefix}sensitivity_max"] = ds["sensitivity"].max(dims)
    for name in RECON_METRICS:
        if name.endswith("_mse"):
            out[f"layer_{name}"] = ds[name].mean(KV_HEAD)
        else:  # SNR of the whole layer: total signal over total noise, not a mean of dBs
            which = name[0]
            mse = ds[f"{which}_mse"]
            sig = mse * 10 ** (ds[name] / 10)
            out[f"layer_{name}"] = 10 * np.log10(sig.sum(KV_HEAD) / mse.sum(KV_HEAD))
    return ds.assign(out)


class _TqdmCallback:
    """A dask local-scheduler callback that advances a tqdm bar per finished task."""

    def __new__(cls, desc: str):
        from dask.callbacks import Callback

        from kverr.progress import progress as progress_bar

        class _CB(Callback):
            def _start_state(self, dsk, state):
                self._bar = progress_bar(total=sum(len(state[k]) for k in ("ready", "waiting", "running")),
                                         desc=desc, unit="task")

            def _posttask(self, key, result, dsk, state, worker_id):
                self._bar.update(1)

            def _finish(self, dsk, state, errored):
                self._bar.close()

        return _CB()


def compute(ds: Any, scheduler: Any = "threads", *, progress: bool = False,
            desc: str = "decompose") -> Any:
    """Compute a lazy decomposition dataset locally or on a dask.distributed cluster.

    Parameters
    ----------
    ds : xarray.Dataset
        Dask-backed dataset.
    scheduler : str or distributed.Client
        ``"threads"``, ``"synchronous"``/``"sync"``, ``"processes"``; or a scheduler address
        (``"tcp://127.0.0.1:8786"``) or a ``distributed.Client``.
    progress : bool
        Show a tqdm progress bar (tasks for local schedulers, chunks for distributed).

    Returns
    -------
    xarray.Dataset
        In memory.
    """
    local = {"threads", "synchronous", "sync", "processes", "single-threaded"}
    if isinstance(scheduler, str) and scheduler in local:
        if progress:
            with _TqdmCallback(desc):
                return ds.compute(scheduler=scheduler)
        return ds.compute(scheduler=scheduler)
    try:
        import distributed
    except ImportError as exc:  # pragma: no cover - distributed is in the analysis extra
        raise ConfigError("a scheduler address needs the 'distributed' package") from exc
    if isinstance(scheduler, distributed.Client):
        return _compute_on(ds, scheduler, progress, desc)
    if not isinstance(scheduler, str) or "://" not in scheduler and ":" not in scheduler:
        raise ConfigError(
            f"scheduler={scheduler!r} is not allowed; use 'threads', 'synchronous', "
            "'processes', a dask.distributed address like tcp://HOST:PORT, or a Client"
        )
    try:
        client = distributed.Client(scheduler, timeout="20s", set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ConfigError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from exc
    with client:
        return _compute_on(ds, client, progress, desc)


def _compute_on(ds, client, progress, desc):
    import distributed

    persisted = client.persist(ds)
    if progress:
        from kverr.progress import progress as progress_bar

        futures = distributed.futures_of(persisted)
        # as_completed looks up the current client; this one need not be the default
        with client.as_current():
            for _ in progress_bar(distributed.as_completed(futures), total=len(futures), desc=desc,
                                  unit="chunk"):
                pass
    # gather through the same client (the default scheduler may be a different one)
    return client.compute(persisted).result()


def layer_table(ds: Any) -> str:
    """A plain-text per-layer table of a computed decomposition dataset.

    Columns: layer, key / value / cross share, output error relative to ‖o‖, mean KL (nats),
    mean rank flips among the top-k, top-1 flip rate, K and V reconstruction MSE.
    """
    cols = [
        ("layer", "{:>5d}", None),
        ("key", "{:>6.3f}", "layer_key_share"),
        ("value", "{:>6.3f}", "layer_value_share"),
        ("cross", "{:>6.3f}", "layer_cross_share"),
        ("out_err", "{:>8.4f}", "layer_out_rel_err"),
        ("KL", "{:>9.2e}", "layer_kl_mean"),
        ("flips", "{:>6.3f}", "layer_rank_flips_mean"),
        ("top1", "{:>6.3f}", "layer_top1_flip_rate"),
        ("K_mse", "{:>9.2e}", "layer_k_mse"),
        ("V_mse", "{:>9.2e}", "layer_v_mse"),
    ]
    widths = [len(f.format(1)) for _, f, _ in cols]
    header = " ".join(n.rjust(w) for (n, _, _), w in zip(cols, widths))
    lines = [header, "-" * len(header)]
    for i, layer in enumerate(ds[LAYER].values):
        cells = []
        for name, fmt, var in cols:
            val = int(layer) if var is None else float(ds[var].values[i])
            cells.append(fmt.format(val))
        lines.append(" ".join(cells))
    return "\n".join(lines)
