"""The README's results table, rendered from the long table (:data:`bench.common.TABLE`).

    .venv/bin/python -m bench.table              # print the markdown table
    .venv/bin/python -m bench.table --check      # exit 1 unless README.md and docs/results.md hold it

Rows: the ``heldout`` benchmark's full-mode measurements, one line per scheme, by effective bits
with static bytes shared by a batch of 8 sequences (one sequence's beside it where it differs;
calibrated configs before presets and peers at equal bits). A calibrated config is in bold when
it meets an acceptance target (:data:`bench.heldout.TARGETS`) or a preset or peer sits at its
effective bits (within 0.005 bit): the comparisons the table is for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import ROOT, TABLE
from bench.heldout import AMORTISED_BATCH, AMORTISED_BITS, TARGETS

HEADER = (f"| config | option | window | effective bits, batch {AMORTISED_BATCH} (1) | mean KL, 8 segments (s.e.) "
          "| top-1 | predicted |\n|---|---|---|---:|---:|---:|---:|")
#: Files whose copy of the table must equal :func:`render`'s output.
HOLDERS = ("README.md", "docs/results.md")


def heldout_wide(table: Path = TABLE):
    """One row per scheme, one column per metric, of the full-mode ``heldout`` rows."""
    import pandas as pd

    t = pd.read_csv(table, dtype={"value": str})
    t = t[(t.benchmark == "heldout") & (t["mode"] == "full")]
    w = t.pivot(index="case", columns="metric", values="value")
    for col in ("effective_bits", AMORTISED_BITS, "mean_kl", "mean_kl_se", "top1", "predicted"):
        w[col] = w[col].astype(float)
    w["amortised_bits"] = w[AMORTISED_BITS]
    w["calibrated"] = w["kind"] == "calibrated"
    return w.assign(bits=w.amortised_bits.round(2)).sort_values(["bits", "calibrated", "case"],
                                                                   ascending=[True, False, True])


def _bits(r) -> str:
    """Effective bits with static bytes shared by the batch, one sequence's beside it where it differs."""
    one = "" if round(r.effective_bits, 2) == round(r.amortised_bits, 2) else f" ({r.effective_bits:.2f})"
    return f"{r.amortised_bits:.2f}{one}"


def render(table: Path = TABLE) -> str:
    w = heldout_wide(table)
    others = w[~w.calibrated]
    lines = [HEADER]
    for name, r in w.iterrows():
        if r.calibrated:
            met = any(r.amortised_bits <= b + 1e-9 and r.mean_kl <= kl and r.top1 >= top for b, kl, top in TARGETS)
            matched = bool(((others.amortised_bits - r.amortised_bits).abs() < 0.005).any())
            bold = met or matched
            kl = f"{r.mean_kl:#.3g}"
            cells = [f"**{name}**" if bold else name, r.outer_option, r.window_dtype,
                     _bits(r), (f"**{kl}**" if bold else kl) + f" ({r.mean_kl_se:#.2g})"]
        else:
            cells = [name, "", "", _bits(r), f"{r.mean_kl:#.3g} ({r.mean_kl_se:#.2g})"]
        cells += [f"{r.top1:.3f}", "–" if r.predicted != r.predicted else f"{r.predicted:#.3g}"]  # NaN: none
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help=f"check that {' and '.join(HOLDERS)} hold the table")
    args = ap.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    bad = [h for h in HOLDERS if text not in (ROOT / h).read_text()]
    for h in bad:
        print(f"{h}: its results table differs from `python -m bench.table`", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
