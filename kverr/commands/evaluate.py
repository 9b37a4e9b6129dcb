"""``kverr evaluate``: next-token KL, top-1 and perplexity of cache formats in the real model."""

from __future__ import annotations

import argparse
from pathlib import Path

from kverr.commands._common import non_negative_int, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="measure what cache formats do to the model's output, beside today's formats",
        description="Prefill P tokens of real text into each cache, quantize, then decode N tokens "
        "teacher-forced and compare every next-token distribution with the unquantized cache: "
        "mean/p50/p99 KL, top-1 agreement, perplexity and its delta, and the first step where "
        "greedy generation diverges. Peers: quanto-int4, quanto-int2 (transformers' "
        "QuantizedCache, group 64, residual 128). Writes a CSV (one row per scheme and context, "
        "mean over segments), the per-segment rows beside it and a plot of KL against effective bits.",
    )
    p.add_argument("--model", default="default", help="'default' or a transformers model directory")
    p.add_argument("--scheme", action="append", default=[], metavar="NAME", help="a preset or a peer (repeat)")
    p.add_argument("--config", action="append", default=[], metavar="PATH", help="a config JSON (repeat)")
    p.add_argument("--text", default="pydoc", help="'pydoc' (the stdlib's topics) or a UTF-8 file")
    p.add_argument("--prefill", action="append", type=positive_int, metavar="P", help="prefill tokens (repeat; default 1024)")
    p.add_argument("--decode", type=positive_int, default=128, help="teacher-forced decode steps (default: %(default)s)")
    p.add_argument("--segments", type=positive_int, default=1, help="disjoint text segments (default: %(default)s)")
    p.add_argument("--offset", type=non_negative_int, default=5000, help="first token of the first segment (default: %(default)s)")
    p.add_argument(
        "--prefill-policy", choices=("all", "window"), default="all",
        help="'all': quantize everything after prefill (default); 'window': keep each config's window",
    )
    p.add_argument("--greedy", type=non_negative_int, help="greedy steps for first divergence (default: --decode; 0 skips)")
    p.add_argument("--out", required=True, type=Path, help="CSV to write (plot and per-segment CSV beside it)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--threads", type=positive_int,
        help="torch CPU threads (default: torch's choice; 1 is fastest on a busy 2-core machine)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.capturing import load_model, load_text, supported_shape
    from kverr.config import atomic_write_text, check_model_matches
    from kverr.evaluation import evaluate, parse_schemes, plot_kl_vs_bits, summarize_schemes
    from kverr.io import check_output_path

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out
    segments_csv = out.with_name(out.stem + ".segments.csv")
    # The plot and per-segment CSV beside --out obey the same overwrite rule as --out itself.
    for path in (out, segments_csv, out.with_suffix(".png")):
        check_output_path(path, overwrite=args.overwrite, kind="file")
    schemes = parse_schemes(args.scheme, args.config)
    # Everything that can be checked without the model is checked before loading it.
    shape = supported_shape(args.model)
    dims = (shape.n_layers, shape.n_kv_heads, shape.head_dim)
    for s in schemes:
        if s.config is not None:
            s.config.check_model(*dims)
            check_model_matches(s.config, shape=dims)
    text = load_text(args.text)
    loaded = load_model(args.model)
    import pandas as pd

    def save_rows(rows: list[dict]) -> None:
        # Rows are saved as they are measured: an interrupted run keeps what it had.
        atomic_write_text(segments_csv, pd.DataFrame(rows).to_csv(index=False))

    df = evaluate(
        loaded, text, schemes,
        prefill=args.prefill or [1024], decode=args.decode, segments=args.segments, offset=args.offset,
        prefill_policy=args.prefill_policy, greedy_steps=args.greedy, on_row=save_rows,
    )
    summary = summarize_schemes(df)
    atomic_write_text(out, summary.to_csv(index=False))
    plot = plot_kl_vs_bits(summary, out.with_suffix(".png"))
    cols = ["scheme", "prefill", "effective_bits", "mean_kl", "p99_kl", "top1", "ppl", "ppl_fp16"]
    if "first_divergence" in summary:
        cols.append("first_divergence")
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {out}, {segments_csv} and {plot}")
    return 0
