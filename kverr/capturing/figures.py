"""Seaborn figures of capture statistics (see :mod:`kverr.capturing.stats`).

Each function takes a capture dataset (or a statistic computed from one) and returns a
matplotlib Figure; nothing is shown or saved, so notebooks and scripts decide.
"""

from __future__ import annotations

from typing import Any

from kverr.dims import CHANNEL, LAYER, TOKEN

from . import stats

__all__ = [
    "plot_attention_sinks",
    "plot_channel_ranges",
    "plot_outlier_ratios",
    "plot_pre_post_rope",
    "plot_token_ranges",
]


def _plt() -> Any:
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


def plot_channel_ranges(ds: Any, var: str = "k") -> Any:
    """Heatmaps of each channel's largest magnitude, one panel per layer (rows: heads).

    Outlier channels show up as bright vertical stripes.
    """
    plt, sns = _plt()
    cmax = stats.channel_absmax(ds, var)
    layers = cmax[LAYER].values
    fig, axes = plt.subplots(len(layers), 1, figsize=(12, 1.2 + 0.45 * cmax.shape[1] * len(layers)),
                             squeeze=False, constrained_layout=True)
    vmax = float(cmax.max())
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        sns.heatmap(cmax.sel({LAYER: layer}).values, ax=ax, cmap="magma", vmin=0, vmax=vmax,
                    cbar_kws={"label": f"max |{var}|"}, xticklabels=8, yticklabels=True)
        ax.set_title(f"{var}: per-channel max |value|, layer {layer}")
        ax.set_ylabel(cmax.dims[1])
    axes[-1, 0].set_xlabel(CHANNEL)
    return fig


def plot_outlier_ratios(ds: Any) -> Any:
    """Max / median channel range per layer and head, for k_pre, k, v and q, side by side."""
    plt, sns = _plt()
    table = stats.summary_table(ds)
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    sns.barplot(data=table, x="layer", y="outlier_ratio", hue="var", ax=ax, errorbar=("pi", 100))
    ax.set_ylabel("max / median channel range")
    ax.set_title("How far the widest channel stands out (bars: mean over heads; whiskers: min-max)")
    return fig


def plot_pre_post_rope(ds: Any, layer: int | None = None) -> Any:
    """Per-channel ranges of keys before and after RoPE, and of the RoPE channel pairs.

    RoPE rotates channel ``i`` with channel ``i + D/2``: single-channel ranges change, pair norms
    do not. A format that scales per channel sees different data pre- and post-RoPE.
    """
    plt, sns = _plt()
    import pandas as pd

    layer = int(ds[LAYER].values[-1]) if layer is None else layer
    sub = ds.sel({LAYER: [layer]})
    pre = stats.channel_absmax(sub, "k_pre").isel({LAYER: 0})
    post = stats.channel_absmax(sub, "k").isel({LAYER: 0})
    frames = []
    for name, da in (("pre-RoPE (k_pre)", pre), ("post-RoPE (k)", post)):
        df = da.to_dataframe(name="absmax").reset_index()
        df["keys"] = name
        frames.append(df)
    data = pd.concat(frames)
    heads = pre.sizes["kv_head"]
    fig, axes = plt.subplots(1, heads, figsize=(5 * heads, 3.6), sharey=True, squeeze=False,
                             constrained_layout=True)
    for h, ax in enumerate(axes[0]):
        sns.lineplot(data=data[data.kv_head == h], x=CHANNEL, y="absmax", hue="keys", ax=ax,
                     drawstyle="steps-mid")
        ax.set_title(f"layer {layer}, kv head {h}")
        ax.set_ylabel("max |key| over tokens")
    return fig


def plot_token_ranges(ds: Any, var: str = "k", n_first: int = 8) -> Any:
    """Per-token largest magnitude along the sequence, per layer (lines: heads).

    The first tokens are marked: attention-sink tokens often have keys and values unlike the rest.
    """
    plt, sns = _plt()
    tmax = stats.token_absmax(ds, var)
    head_dim = tmax.dims[1]
    df = tmax.to_dataframe(name="absmax").reset_index()
    g = sns.relplot(data=df, x=TOKEN, y="absmax", hue=head_dim, col=LAYER, kind="line",
                    height=3.2, aspect=1.3, palette="deep", linewidth=0.7)
    for ax in g.axes.flat:
        ax.axvspan(-0.5, n_first - 0.5, color="0.85", zorder=0)
        ax.set_yscale("log")
    g.set_axis_labels(TOKEN, f"max |{var}| over channels")
    g.figure.suptitle(f"{var}: per-token range (shaded: first {n_first} tokens)", y=1.03)
    return g.figure


def plot_attention_sinks(ds: Any, n_keys: int = 8) -> Any:
    """Attention mass on the first key positions, recomputed from the captured q and k.

    Left: share of every query's attention that lands on token 0, per layer and query head.
    Right: mean weight of each of the first ``n_keys`` positions, against uniform attention.
    """
    plt, sns = _plt()
    mass = stats.attention_mass_by_key(ds, n_keys)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.8), constrained_layout=True,
                                      gridspec_kw={"width_ratios": [1.2, 1]})
    sns.heatmap(mass.sel(key=0).values, ax=left, annot=True, fmt=".2f", vmin=0, vmax=1,
                cmap="rocket_r", yticklabels=mass[LAYER].values, cbar_kws={"label": "mass on token 0"})
    left.set_xlabel("q_head")
    left.set_ylabel(LAYER)
    left.set_title("Mean attention weight on token 0")
    df = mass.mean("q_head").to_dataframe(name="weight").reset_index()
    sns.barplot(data=df, x="key", y="weight", hue=LAYER, ax=right, palette="crest")
    right.axhline(mass.attrs["uniform"], color="k", ls="--", lw=1, label="uniform")
    right.set_yscale("log")
    right.set_title("Mean weight per key position (mean over heads)")
    right.legend(title=LAYER)
    return fig
