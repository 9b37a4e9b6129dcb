"""Figures of calibration: the frontier, chosen bits per layer x head, predicted vs measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    from kverr.io import atomic_write

    path = Path(path)
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format=path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)


def frontier_figure(frontier: Any, marks: dict[str, float] | None = None, points: Any = None,
                    ylabel: str = "predicted damage (relative attention-output error²)"):
    """Predicted damage against effective bits, one line per outer option (Pareto union bold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(data=frontier, x="effective_bits", y="predicted", hue="option", drawstyle="steps-post",
                 ax=ax, marker=".", markersize=3)
    for name, b in (marks or {}).items():
        ax.axvline(b, color="grey", ls=":", lw=1)
        ax.annotate(name, (b, ax.get_ylim()[1]), fontsize=8, rotation=90, va="top")
    if points is not None:
        sns.scatterplot(data=points, x="effective_bits", y="predicted", style="scheme", ax=ax, color="k", s=40)
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (metadata, sinks, window, pages included)")
    ax.set_ylabel(ylabel)
    ax.set_title("Calibration frontier")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_frontier(frontier: Any, path: str | Path, marks: dict[str, float] | None = None, points: Any = None,
                  ylabel: str | None = None) -> Path:
    kw = {} if ylabel is None else {"ylabel": ylabel}
    return _save(frontier_figure(frontier, marks, points, **kw), path)


def bits_heatmaps(choices: Any, title: str = "", value: str = "bits"):
    """Chosen bits per layer x kv head, keys and values side by side (the mean over the channels
    for per-channel widths); ``value="window"``: the window length each keeps instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, 2, figsize=(7, 8), sharey=True)
    for ax, w in zip(axes, ("k", "v")):
        t = choices[choices.which == w].pivot(index="layer", columns="kv_head", values=value)
        span = dict(vmin=1, vmax=16) if value == "bits" else dict(vmin=choices[value].min(), vmax=choices[value].max())
        sns.heatmap(t, annot=True, fmt=".3g", cbar=False, ax=ax, cmap="viridis", **span)
        ax.set_title(f"{'keys' if w == 'k' else 'values'}: {value}")
    fig.suptitle(title or f"chosen {value} per layer and kv head")
    fig.tight_layout()
    return fig


def family_heatmaps(choices: Any, title: str = ""):
    """The format family of every layer x kv head (:func:`format_family`), keys and values side by
    side, each cell annotated with its code bits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = sns.color_palette("Set2", len(FAMILIES))
    fig, axes = plt.subplots(1, 2, figsize=(7, 8), sharey=True)
    for ax, w in zip(axes, ("k", "v")):
        c = choices[choices.which == w]
        fam = c.pivot(index="layer", columns="kv_head", values="family").map(FAMILIES.index)
        bits = c.pivot(index="layer", columns="kv_head", values="bits")
        sns.heatmap(fam, annot=bits.to_numpy(), fmt=".3g", cbar=False, ax=ax, cmap=ListedColormap(colors),
                    vmin=-0.5, vmax=len(FAMILIES) - 0.5)
        ax.set_title(f"{'keys' if w == 'k' else 'values'}: family (bits)")
    present = [f for f in FAMILIES if f in set(np.asarray(choices.family))]
    fig.legend(handles=[Patch(color=colors[FAMILIES.index(f)], label=f) for f in present],
               loc="lower center", ncol=len(present), frameon=False)
    fig.suptitle(title or "format family per layer and kv head")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def predicted_vs_measured(table: Any, x: str = "predicted", y: str = "mean_kl", *, hue: str | None = None,
                          identity: bool = False, xlabel: str | None = None, title: str = ""):
    """Scatter of predicted damage against measured KL (log-log), one marker per scheme.

    ``hue`` colours by a column (e.g. ``kind``: calibrated / preset / peer); ``identity`` draws
    ``y = x`` (for a prediction in nats of KL).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    if hue is None:
        sns.scatterplot(data=table, x=x, y=y, hue="scheme", ax=ax, s=60, legend=False)
    else:
        sns.scatterplot(data=table, x=x, y=y, hue=hue, style=hue, ax=ax, s=60)
    for _, r in table.iterrows():
        ax.annotate(r["scheme"], (r[x], r[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    if identity:
        lo = min(table[x].min(), table[y].min()) / 1.5
        hi = max(table[x].max(), table[y].max()) * 1.5
        ax.plot([lo, hi], [lo, hi], color="grey", ls="--", lw=1, label="measured = predicted")
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel or "predicted damage on the calibration capture")
    ax.set_ylabel("measured mean next-token KL (held-out text)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


#: The format families :func:`format_family` names, in the order figures list them.
FAMILIES = ("uniform", "fitted widths", "codebook", "minifloat", "float")


def format_family(fmt: Any) -> str:
    """The family of a format: ``uniform`` (integer codes, one width), ``fitted widths`` (a width
    per channel), ``codebook``, ``minifloat`` (scaled fp8 or fp4 codes) or ``float`` (stored as it is)."""
    if fmt.is_float:
        return "float"
    if fmt.channel_bits is not None:
        return "fitted widths"
    if fmt.is_codebook:
        return "codebook"
    if fmt.is_minifloat:
        return "minifloat"
    return "uniform"


def config_choices(config: Any, n_layers: int, n_kv: int):
    """One row per (layer, kv_head, which) of a config: format label, code bits per element (the
    mean of per-channel widths), family (:func:`format_family`), granularity, rotate, clip and
    the window length it keeps (:meth:`~kverr.config.CacheConfig.window_for`)."""
    import pandas as pd

    rows = []
    for layer in range(n_layers):
        for h in range(n_kv):
            for w in ("k", "v"):
                f = config.format_for(layer, h, w)
                family = format_family(f)
                rows.append(dict(layer=layer, kv_head=h, which=w, format=f.label(), bits=f.element_bits,
                                 family=family, dtype=f.dtype, granularity=f.granularity.kind, rotate=f.rotate,
                                 clip=f.clip.kind, window=config.window_for(layer, h, w)))
    return pd.DataFrame(rows)


def channel_widths_figure(config: Any, n_layers: int, n_kv: int, head_dim: int, title: str = ""):
    """Code bits of every channel, one row per (layer, kv head), keys and values side by side:
    where a config spends its bits inside each head (per-channel widths vary along a row; a
    uniform format fills its row with one width; plain floats show their width)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 8), sharey=True)
    for ax, w in zip(axes, ("k", "v")):
        grid = np.zeros((n_layers * n_kv, head_dim))
        for layer in range(n_layers):
            for h in range(n_kv):
                f = config.format_for(layer, h, w)
                grid[layer * n_kv + h] = f.channel_bits if f.channel_bits is not None else f.element_bits
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=8)
        ax.set_title(f"{'keys' if w == 'k' else 'values'}: bits per channel")
        ax.set_xlabel("channel")
        ax.set_yticks(np.arange(0, n_layers * n_kv, n_kv * 5), [str(layer) for layer in range(0, n_layers, 5)])
    axes[0].set_ylabel(f"layer (rows: its {n_kv} kv heads)")
    fig.colorbar(im, ax=axes, label="bits (8 and up: 8)", shrink=0.6)
    fig.suptitle(title or "code bits per channel")
    return fig


def thin_frontier(frontier: Any, step: float = 0.05):
    """The best frontier point in every ``step``-bit bin (for plotting and committing)."""
    f = frontier.copy()
    f["bin"] = (f["effective_bits"] / step).astype(int)
    return f.loc[f.groupby("bin")["predicted"].idxmin()].drop(columns="bin").reset_index(drop=True)
