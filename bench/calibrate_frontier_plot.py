"""The calibration frontier beside measured held-out KL: the figure in the README.

Usage::

    python bench/calibrate_frontier_plot.py FRONTIER.csv PREDICTED_VS_MEASURED.csv OUT.png [THINNED.csv]

``FRONTIER.csv`` is ``kverr calibrate --frontier`` output (with its ``candidates`` and
``window_dtype`` columns when ``auto`` searched two candidate sets or window dtypes); ``PREDICTED_VS_MEASURED.csv`` is
``bench/calibrate_heldout.py``'s. Lines: the predicted-KL frontier of each candidate set and window dtype (the best
point within every 0.02 bit, steps); markers: the measured held-out mean KL of the calibrated
configs (filled) and of the presets and peers (open), at their effective bits.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd


def thin(frontier: pd.DataFrame, step: float = 0.02) -> pd.DataFrame:
    """The lowest predicted damage within each ``step`` bits, per candidate set."""
    f = frontier.copy()
    if "candidates" not in f:
        f["candidates"] = "default"
    if "window_dtype" not in f:
        f["window_dtype"] = "fp16"
    f["bin"] = np.floor(f["effective_bits"] / step).astype(int)
    keys = ["window_dtype", "candidates"]
    i = f.groupby([*keys, "bin"])["predicted"].idxmin()
    return f.loc[i].drop(columns="bin").sort_values([*keys, "effective_bits"]).reset_index(drop=True)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fr_path, pvm_path, out, *rest = sys.argv[1:]
    fr = thin(pd.read_csv(fr_path))
    fr = fr[fr.effective_bits <= 9]
    if rest:
        fr.to_csv(rest[0], index=False)
    pvm = pd.read_csv(pvm_path)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = {"all": "78 candidates (static scales)", "dynamic": "60 candidates (no static scales)"}
    for (wdt, cset), g in fr.groupby(["window_dtype", "candidates"]):
        ax.step(g.effective_bits, g.predicted, where="post", lw=1.5,
                label=f"predicted frontier, {names.get(cset, cset)}, {wdt} window")
    cal = pvm[pvm.kind == "calibrated"]
    ref = pvm[pvm.kind != "calibrated"]
    ax.scatter(cal.effective_bits, cal.mean_kl, color="k", s=36, zorder=3, label="calibrated, measured held out")
    ax.scatter(ref.effective_bits, ref.mean_kl, facecolor="none", edgecolor="C3", s=36, zorder=3,
               label="presets and peers, measured held out")
    for _, r in pd.concat([cal, ref]).iterrows():
        ax.annotate(r.scheme.replace("calibrated-", "cal-"), (r.effective_bits, r.mean_kl), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (metadata, sinks, window, pages included; 1280 tokens)")
    ax.set_ylabel("next-token KL (nats)")
    nseg = int(pvm["segments"].min()) if "segments" in pvm else 1
    ax.set_title(f"Calibration frontier (predicted, pydoc) and held-out KL (typing.py, {nseg} segments)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    sns.despine(fig)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(fr)} frontier points)")


if __name__ == "__main__":
    main()
