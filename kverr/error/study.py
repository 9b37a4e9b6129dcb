"""Does tensor-level reconstruction error rank cache formats the way attention damage does?

:func:`sweep` decomposes one capture under many configs (by default every preset);
:func:`rank_agreement` measures, with Spearman's ρ, how well reconstruction MSE orders the
configs compared with the output error and the attention KL, per layer and pooled;
:func:`disagreements` lists the pairs of configs that the two orderings put the other way round.

Units of comparison: a (config, layer) pair (layer-level MSE = K MSE + V MSE averaged over kv
heads; output error = sqrt(Σ‖o′−o‖²/Σ‖o‖²) over all heads and queries; KL = mean over queries
and heads) and, finer, a (config, layer, kv_head) triple (the query heads reading that kv head).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kverr.dims import KV_HEAD, KV_HEAD_OF_Q, LAYER, Q_HEAD, QUERY

log = logging.getLogger(__name__)

__all__ = ["disagreements", "head_table", "layer_table_frame", "rank_agreement", "sweep"]


def sweep(
    capture: Any,
    configs: Sequence[Any] | None = None,
    *,
    queries: int = 256,
    scheduler: Any = "threads",
    progress: bool = False,
) -> Any:
    """Decompose a capture under several configs.

    Parameters
    ----------
    capture : xarray.Dataset
        A capture (see :func:`kverr.error.decompose_capture`).
    configs : sequence of CacheConfig or str, optional
        Configs or preset names (default: every preset in :data:`kverr.config.PRESETS`).
    queries : int
        Query positions per head (the last ``queries`` tokens).
    scheduler : str or distributed.Client
        Where to compute (see :func:`kverr.error.xr.compute`).
    progress : bool
        Show a progress bar per config.

    Returns
    -------
    xarray.Dataset
        The decomposition datasets concatenated along a new ``config`` dim (config names),
        with a coordinate ``effective_bits`` (config): every cached byte (payload, scales,
        zero points, padding, pages, sinks and window) per K/V element, from
        :func:`kverr.memory.account` for this capture's shape and token count.
    """
    import xarray as xr

    from kverr.config import PRESETS, resolve
    import kverr.accessor  # noqa: F401  (ds.kv)
    from kverr.error.xr import compute, decompose_capture
    from kverr.memory import account

    cfgs = [resolve(c) for c in (configs if configs is not None else list(PRESETS))]
    names = [c.name or f"config{i}" for i, c in enumerate(cfgs)]
    parts = []
    for name, cfg in zip(names, cfgs):
        lazy = decompose_capture(capture, cfg, queries=queries)
        parts.append(compute(lazy, scheduler, progress=progress, desc=name).drop_attrs())
        log.info("decomposed %s", name)
    bits = [account(c, capture.kv.shape, capture.kv.n_tokens).effective_bits for c in cfgs]
    out = xr.concat(parts, dim="config", coords="minimal", compat="override")
    return out.assign_coords(config=names, effective_bits=("config", bits))


def layer_table_frame(sw: Any):
    """One row per (config, layer): MSEs, SNRs, output error, KL, shares, flips.

    Returns
    -------
    pandas.DataFrame
        Columns ``config, layer, effective_bits, k_mse, v_mse, recon_mse, k_snr_db, v_snr_db, out_rel_err,
        kl_mean, key_share, value_share, cross_share, top1_flip_rate, rank_flips_mean``.
    """
    import pandas as pd

    rows = []
    for c in sw["config"].values:
        for layer in sw[LAYER].values:
            s = sw.sel(config=c, layer=layer)
            bits = float(s["effective_bits"]) if "effective_bits" in s.coords else float("nan")
            rows.append(dict(
                config=str(c), layer=int(layer), effective_bits=bits,
                k_mse=float(s.layer_k_mse), v_mse=float(s.layer_v_mse),
                recon_mse=float(s.layer_k_mse + s.layer_v_mse),
                k_snr_db=float(s.layer_k_snr_db), v_snr_db=float(s.layer_v_snr_db),
                out_rel_err=float(s.layer_out_rel_err), kl_mean=float(s.layer_kl_mean),
                key_share=float(s.layer_key_share), value_share=float(s.layer_value_share),
                cross_share=float(s.layer_cross_share),
                top1_flip_rate=float(s.layer_top1_flip_rate),
                rank_flips_mean=float(s.layer_rank_flips_mean),
            ))
    return pd.DataFrame(rows)


def head_table(sw: Any):
    """One row per (config, layer, kv_head): its MSEs and the damage to the q heads reading it.

    Returns
    -------
    pandas.DataFrame
        Columns ``config, layer, kv_head, k_mse, v_mse, recon_mse, out_rel_err, kl_mean``.
    """
    import pandas as pd

    on2 = sw["out_norm"] ** 2
    tot2 = (sw["total_rel"] ** 2) * on2
    kvq = sw[KV_HEAD_OF_Q]
    rows = []
    for h in sw[KV_HEAD].values:
        sel = {Q_HEAD: sw[Q_HEAD].values[kvq.values == h]}
        err = np.sqrt(tot2.sel(sel).sum([Q_HEAD, QUERY]) / on2.sel(sel).sum([Q_HEAD, QUERY]))
        kl = sw["kl"].sel(sel).mean([Q_HEAD, QUERY])
        for c in sw["config"].values:
            for layer in sw[LAYER].values:
                km = float(sw.k_mse.sel(config=c, layer=layer, kv_head=h))
                vm = float(sw.v_mse.sel(config=c, layer=layer, kv_head=h))
                rows.append(dict(config=str(c), layer=int(layer), kv_head=int(h), k_mse=km,
                                 v_mse=vm, recon_mse=km + vm,
                                 out_rel_err=float(err.sel(config=c, layer=layer)),
                                 kl_mean=float(kl.sel(config=c, layer=layer))))
    return pd.DataFrame(rows)


def _spearman(x, y) -> float:
    from scipy.stats import spearmanr

    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    return float(spearmanr(x, y).statistic)


def rank_agreement(sw: Any, *, exclude: Sequence[str] = ("fp16",)):
    """Spearman rank correlations between reconstruction MSE and attention damage.

    Parameters
    ----------
    sw : xarray.Dataset
        Output of :func:`sweep`.
    exclude : sequence of str
        Configs left out (the unquantized baseline would be a trivial agreement at the
        bottom of every ranking).

    Returns
    -------
    pandas.DataFrame
        One row per scope (``layer <i>`` ranking configs within a layer, ``pooled layers``
        over every (config, layer), ``pooled heads`` over every (config, layer, kv head)) with
        columns ``n``, ``rho(recon_mse, out_rel_err)``, ``rho(recon_mse, kl)``,
        ``rho(k_mse, kl)``, ``rho(v_mse, out_rel_err)``, ``rho(out_rel_err, kl)``.
    """
    import pandas as pd

    lt = layer_table_frame(sw)
    lt = lt[~lt.config.isin(exclude)]
    ht = head_table(sw)
    ht = ht[~ht.config.isin(exclude)]

    def row(scope, df):
        return {
            "scope": scope, "n": len(df),
            "rho(recon_mse, out_rel_err)": _spearman(df.recon_mse.values, df.out_rel_err.values),
            "rho(recon_mse, kl)": _spearman(df.recon_mse.values, df.kl_mean.values),
            "rho(k_mse, kl)": _spearman(df.k_mse.values, df.kl_mean.values),
            "rho(v_mse, out_rel_err)": _spearman(df.v_mse.values, df.out_rel_err.values),
            "rho(out_rel_err, kl)": _spearman(df.out_rel_err.values, df.kl_mean.values),
        }

    rows = [row(f"layer {int(layer)}", lt[lt.layer == layer]) for layer in sorted(lt.layer.unique())]
    rows.append(row("pooled layers", lt))
    rows.append(row("pooled heads", ht))
    return pd.DataFrame(rows).set_index("scope")


def disagreements(sw: Any, *, by: str = "recon_mse", against: str = "out_rel_err",
                  exclude: Sequence[str] = ("fp16",), min_ratio: float = 1.0):
    """Pairs of configs in the same layer that ``by`` and ``against`` order oppositely.

    Parameters
    ----------
    sw : xarray.Dataset
        Output of :func:`sweep`.
    by, against : str
        Columns of :func:`layer_table_frame` (e.g. ``recon_mse`` vs ``out_rel_err`` or
        ``kl_mean``).
    exclude : sequence of str
        Configs left out.
    min_ratio : float
        Only pairs where ``against`` differs by at least this factor.

    Returns
    -------
    pandas.DataFrame
        ``layer, better_by, worse_by, <by> of each, <against> of each, against_ratio``: the
        config ``better_by`` has the smaller ``by`` but the larger ``against`` (by
        ``against_ratio``). Sorted by ``against_ratio``, largest first.
    """
    import pandas as pd

    lt = layer_table_frame(sw)
    lt = lt[~lt.config.isin(exclude)]
    rows = []
    for layer, df in lt.groupby("layer"):
        recs = df.to_dict("records")
        for a in recs:
            for b in recs:
                if a[by] < b[by] and a[against] > b[against] * min_ratio:
                    rows.append({
                        "layer": int(layer), "better_by": a["config"], "worse_by": b["config"],
                        f"{by}_better": a[by], f"{by}_worse": b[by],
                        f"{against}_better": a[against], f"{against}_worse": b[against],
                        "against_ratio": a[against] / b[against],
                    })
    out = pd.DataFrame(rows)
    if len(out):
        out = out.sort_values("against_ratio", ascending=False).reset_index(drop=True)
    return out
