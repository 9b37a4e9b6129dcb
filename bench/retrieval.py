"""Held out: pass-key retrieval through the quantized cache (``docs/results.md``, the README).

The calibrated configs at 2.5–5 bits (calibrated on pydoc), the presets and the peers at their
effective bits, and the unquantized cache, on a haystack they were not calibrated on, the
stdlib's ``typing.py`` (Python 3.11): a five-digit key at depths 0, 25, 50, 75 and 100 %, four
trials per depth, one context per run, one torch thread::

    kverr evaluate --task passkey --threads 1 --text <python 3.11 lib>/typing.py --context C \\
        --depth 0,25,50,75,100 --trials 4 --config data/configs/calibrated-<b>b.json ... \\
        --scheme kivi-2 ... --out retrieval-C.csv

The unquantized cache alone, at contexts up to the model's limit, says where the model itself
retrieves (``python -m bench.retrieval baseline``: 1024, 2048, 4096 and 8000 tokens, the same
depths and trials, into ``bench/results/retrieval-baseline.trials.csv``).

``python -m bench.retrieval run C`` runs it and appends its trial rows, stamped with machine and
date, to ``bench/results/retrieval.trials.csv`` (replacing earlier rows of that context);
``python -m bench.retrieval`` prints the table from the committed rows, with each scheme's mean
held-out KL on running text (``bench/results/heldout.segments.csv``) beside it, and writes the
figures ``bench/results/retrieval.png`` and ``retrieval-vs-kl.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.common import RESULTS, ROOT, WORK, machine, now

TRIALS_CSV = RESULTS / "retrieval.trials.csv"
BASELINE_CSV = RESULTS / "retrieval-baseline.trials.csv"
BASELINE_CONTEXTS = (1024, 2048, 4096, 8000)
FIGURE = RESULTS / "retrieval.png"
#: Retrieval damage (the key's NLL increase) against running-text KL, one point per scheme.
AGAINST_KL = RESULTS / "retrieval-vs-kl.png"
BUDGETS = ("2.5", "3", "4", "4.5", "5")
CONFIGS = [ROOT / "data" / "configs" / f"calibrated-{b}b.json" for b in BUDGETS]
SCHEMES = ("kivi-2", "quanto-int2", "q4_0", "int4-token-g64", "kivi-4", "quanto-int4", "fp8-e4m3-head")
DEPTHS, TRIALS = "0,25,50,75,100", 4


def _measure(contexts: tuple[int, ...], schemes: bool, into: Path) -> None:
    """Run ``kverr evaluate --task passkey`` and keep its stamped trial rows in ``into``, replacing
    earlier rows of the same contexts."""
    import pandas as pd

    from bench.heldout import typing_py
    from kverr.cli import main
    from kverr.config import atomic_write_text

    out = WORK / f"{into.name.split('.')[0]}-{'-'.join(map(str, contexts))}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["evaluate", "--task", "passkey", "--threads", "1", "--text", str(typing_py()), "--depth", DEPTHS,
            "--trials", str(TRIALS), "--overwrite", "--out", str(out)]
    for c in contexts:
        argv += ["--context", str(c)]
    for c in CONFIGS if schemes else ():
        argv += ["--config", str(c)]
    for s in SCHEMES if schemes else ():
        argv += ["--scheme", s]
    if main(argv) != 0:
        raise RuntimeError("kverr evaluate failed")
    df = pd.read_csv(out.with_name(out.stem + ".trials.csv"), dtype={"key": str})
    df["machine"], df["date"] = machine(), now()
    if into.exists():
        old = pd.read_csv(into, dtype={"key": str})
        df = pd.concat([old[~old.context.isin(contexts)], df], ignore_index=True)
    atomic_write_text(into, df.to_csv(index=False))


def run(context: int) -> None:
    """Measure every scheme at one context into :data:`TRIALS_CSV`."""
    _measure((context,), True, TRIALS_CSV)


def baseline() -> None:
    """Measure the unquantized cache alone at :data:`BASELINE_CONTEXTS` into :data:`BASELINE_CSV`."""
    _measure(BASELINE_CONTEXTS, False, BASELINE_CSV)


def _text_kl():
    """Each scheme's mean held-out running-text KL over its segments (the results table's)."""
    import pandas as pd

    return pd.read_csv(RESULTS / "heldout.segments.csv").groupby("scheme")["mean_kl"].mean()


def table() -> str:
    """The retrieval table from the committed rows: per scheme and context, accuracy (Wilson 95 %),
    kept, the key's NLL increase (nats, summed over its tokens) and the answer steps' mean KL; the
    running-text KL beside it."""
    import pandas as pd

    from kverr.retrieval import summarize_passkey

    df = pd.read_csv(TRIALS_CSV, dtype={"key": str})
    s = summarize_passkey(df)
    text_kl = _text_kl()
    contexts = sorted(s["context"].unique())
    head = ("| scheme | effective bits | running-text KL | "
            + " | ".join(f"accuracy at {c} (95 % CI) | kept | key NLL + | answer KL" for c in contexts) + " |")
    lines = [head, "|---|---:|---:|" + "---:|---:|---:|---:|" * len(contexts)]
    names = s.sort_values("effective_bits")["scheme"].unique()
    for name in names:
        g = s[s.scheme == name].set_index("context")
        bits = g["effective_bits"].mean()
        kl = f"{text_kl[name]:#.3g}" if name in text_kl else ("0" if name == "unquantized" else "")
        cells = []
        for c in contexts:
            r = g.loc[c]
            cells.append(f"{r['accuracy']:.2f} ({r['accuracy_lo']:.2f}–{r['accuracy_hi']:.2f}) | {r['kept']:.2f} | "
                         f"{r['key_nll_delta']:+.2f} | {r['answer_kl']:#.2g}")
        lines.append(f"| {name} | {bits:.2f} | {kl} | " + " | ".join(cells) + " |")
    n = df.groupby("context")["trial"].size() // df["scheme"].nunique()
    m, d = df["machine"].iloc[0], df["date"].max()
    lines.append("")
    lines.append(f"Trials per context: {', '.join(f'{c}: {k}' for c, k in n.items())}; measured on {m}, {d}.")
    return "\n".join(lines) + "\n"


def baseline_table() -> str:
    """Where the model itself retrieves: the unquantized cache's accuracy per context (Wilson 95 %)
    and per depth, from :data:`BASELINE_CSV`."""
    import pandas as pd

    from kverr.retrieval import summarize_passkey

    df = pd.read_csv(BASELINE_CSV, dtype={"key": str})
    s = summarize_passkey(df).set_index("context")
    d = summarize_passkey(df, by=("context", "depth")).pivot(index="context", columns="depth", values="accuracy")
    depths = list(d.columns)
    lines = ["| context | accuracy (95 % CI) | " + " | ".join(f"depth {100 * x:g} %" for x in depths)
             + " | key NLL |", "|---:|---:|" + "---:|" * len(depths) + "---:|"]
    for c, r in s.iterrows():
        lines.append(f"| {c} | {r['accuracy']:.2f} ({r['accuracy_lo']:.2f}–{r['accuracy_hi']:.2f}) | "
                     + " | ".join(f"{d.loc[c, x]:.2f}" for x in depths) + f" | {r['key_nll']:.2f} |")
    m, when = df["machine"].iloc[0], df["date"].max()
    return "\n".join(lines) + f"\n\nTrials per context: {int(s['trials'].iloc[0])}; measured on {m}, {when}.\n"


def figure() -> None:
    """:func:`kverr.retrieval.plot_passkey` of the committed rows, and the key's NLL increase
    against the running-text KL per scheme (where the two rank schemes differently)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from kverr.io import atomic_write
    from kverr.retrieval import plot_passkey, summarize_passkey

    df = pd.read_csv(TRIALS_CSV, dtype={"key": str})
    plot_passkey(df, FIGURE)
    s = summarize_passkey(df)
    kl = _text_kl()
    s = s[s.scheme.isin(kl.index)].assign(text_kl=lambda d: d.scheme.map(kl))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for _, r in s.iterrows():
        cal = r["scheme"].startswith("calibrated")
        ax.scatter(r["text_kl"], r["key_nll_delta"], c="tab:blue" if cal else "tab:orange", s=40)
        ax.annotate(f"{r['scheme']} ({r['accuracy']:.2f})", (r["text_kl"], r["key_nll_delta"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.05)
    ax.set_ylim(bottom=min(0.0, float(s["key_nll_delta"].min()) * 1.5))
    from matplotlib.lines import Line2D

    ax.legend(handles=[Line2D([], [], ls="", marker="o", color=c, label=lab)
                       for c, lab in (("tab:blue", "calibrated"), ("tab:orange", "presets and peers"))],
              fontsize=8, loc="lower right")
    ax.set_xlabel("running-text mean KL, held out (8 segments)")
    ax.set_ylabel("pass key: increase of the key's NLL (nats)")
    ax.set_title(f"Retrieval against running-text KL (accuracy in brackets; {int(s['trials'].iloc[0])} trials, "
                 f"{int(s['context'].iloc[0])} tokens)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        atomic_write(AGAINST_KL, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    finally:
        plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(int(sys.argv[2]))
    elif sys.argv[1:] == ["baseline"]:
        baseline()
    elif len(sys.argv) == 1:
        sys.stdout.write(baseline_table() + "\n" + table())
        figure()
    else:
        sys.exit("usage: python -m bench.retrieval [run CONTEXT | baseline]")
