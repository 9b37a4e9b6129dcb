"""Seaborn figures of a decomposition (used by notebooks/02_error_anatomy.ipynb).

Every function takes computed datasets from :func:`kverr.error.decompose_capture` or
:func:`kverr.error.study.sweep` and returns a matplotlib Figure; nothing is shown or saved here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kverr.dims import LAYER, Q_HEAD

__all__ = ["first_order_figure", "margin_figure", "rank_figure", "share_heatmaps"]


def share_heatmaps(ds: Any, title: str = ""):
    """Heatmaps layer × q_head of the key and value energy shares (and the output error).

    Parameters
    ----------
    ds : xarray.Dataset
        One config's decomposition (``key_share``, ``value_share``, ``out_rel_err`` with dims
        ``(layer, q_head)``).
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, 3, figsize=(13, 0.5 * ds.sizes[LAYER] + 2.2), constrained_layout=True)
    for ax, var, cmap, lab in (
        (axes[0], "key_share", "rocket_r", "key share"),
        (axes[1], "value_share", "mako_r", "value share"),
        (axes[2], "out_rel_err", "viridis", "‖o′−o‖/‖o‖"),
    ):
        da = ds[var].transpose(LAYER, Q_HEAD)
        kw = dict(vmin=0, vmax=1) if var.endswith("share") else {}
        sns.heatmap(da.values, ax=ax, cmap=cmap, annot=True, fmt=".2f", cbar=False,
                    xticklabels=ds[Q_HEAD].values, yticklabels=ds[LAYER].values, **kw)
        ax.set_xlabel("q head")
        ax.set_ylabel("layer")
        ax.set_title(lab)
    if title:
        fig.suptitle(title)
    return fig


def margin_figure(ds: Any, title: str = ""):
    """Top-1/top-2 margin vs the largest logit perturbation, per query, coloured by top-1 flip.

    A flip needs max|δs| ≥ margin/2 (both of the top two logits must move towards each other);
    the dashed line marks that bound, the solid one max|δs| = margin.
    """
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame({
        "margin": ds["margin"].values.ravel(),
        "max |δs|": ds["logit_max_abs"].values.ravel(),
        "top-1 flip": ds["top1_flip"].values.ravel() > 0,
        "layer": np.broadcast_to(ds[LAYER].values[:, None, None], ds["margin"].shape).ravel(),
    }).dropna()
    df = df[df["margin"] > 0]
    fig, ax = plt.subplots(figsize=(6.5, 5), constrained_layout=True)
    sns.scatterplot(df.sort_values("top-1 flip"), x="margin", y="max |δs|", hue="top-1 flip",
                    style="layer", s=12, alpha=0.6, ax=ax, palette={False: "0.6", True: "crimson"})
    lo = max(df["margin"].min(), 1e-4)
    hi = df["margin"].max()
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs / 2, "k--", lw=1, label="max|δs| = margin/2")
    ax.plot(xs, xs, "k-", lw=1, label="max|δs| = margin")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title)
    return fig


def first_order_figure(ds: Any, title: str = ""):
    """Relative error of the first-order prediction δa ≈ (diag(a) − aaᵀ)δs vs the logit spread.

    x: RMS logit perturbation; y: ‖δa − Jδs‖/‖δa‖ (attention) and the same pushed through V.
    The first-order error grows linearly with the perturbation (its remainder is O(δs²)).
    """
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    x = ds["logit_rms"].values.ravel()
    df = pd.concat([
        pd.DataFrame({"logit RMS": x, "relative error": ds["first_order_err"].values.ravel(),
                      "where": "attention weights"}),
        pd.DataFrame({"logit RMS": x, "relative error": ds["first_order_key_err"].values.ravel(),
                      "where": "key term (output)"}),
    ]).dropna()
    df = df[(df["logit RMS"] > 0) & (df["relative error"] > 0)]
    fig, ax = plt.subplots(figsize=(6.5, 5), constrained_layout=True)
    sns.scatterplot(df, x="logit RMS", y="relative error", hue="where", s=8, alpha=0.5, ax=ax)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("‖exact − first order‖ / ‖exact‖")
    if title:
        ax.set_title(title)
    return fig


def rank_figure(frame: Any, title: str = ""):
    """Reconstruction MSE vs output error and vs attention KL, one point per (config, layer).

    Parameters
    ----------
    frame : pandas.DataFrame
        :func:`kverr.error.study.layer_table_frame` output.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = frame[frame["config"] != "fp16"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for ax, y, lab in ((axes[0], "out_rel_err", "‖o′−o‖/‖o‖"), (axes[1], "kl_mean", "mean KL(a‖a′)")):
        sns.scatterplot(df, x="recon_mse", y=y, hue="config", style="layer", s=70, ax=ax)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("reconstruction MSE (K + V)")
        ax.set_ylabel(lab)
        ax.get_legend().remove()
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig
