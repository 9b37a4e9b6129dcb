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
        "mean over segments, with standard errors), the per-segment rows beside it and a plot of "
        "KL against effective bits. Static per-tensor/per-head scales come from the prefill unless "
        "--scales gives them, as a serving engine has them fixed beforehand.",
    )
    p.add_argument("--model", default="default", help="'default' or a transformers model directory")
    p.add_argument("--scheme", action=_Remember, default=[], metavar="NAME", help="a preset or a peer (repeat)")
    p.add_argument("--config", action=_Remember, default=[], metavar="PATH", help="a config JSON (repeat)")
    p.add_argument(
        "--scales", action=_Scales, default={}, metavar="SRC",
        help="static scales for the --scheme or --config just before it: a vLLM export directory or a "
        "safetensors file (model.layers.{i}.self_attn.{k,v}_scale, [1] per tensor or [n_kv_heads] per "
        "head, as vLLM loads them), 'unit' (all 1.0: vLLM's fp8 without checkpoint scales) or 'prefill' "
        "(the first chunk's, the default); the scheme is named NAME@SRC, so one config may be given "
        "several times with different scales",
    )
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


class _Remember(argparse.Action):
    """Append like ``action="append"`` and remember which option and index came last, for --scales."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        setattr(namespace, self.dest, [*items, values])
        namespace._scales_target = (self.dest, len(items))


class _Scales(argparse.Action):
    """``--scales SRC``: the scales of the --scheme or --config given just before it."""

    def __call__(self, parser, namespace, values, option_string=None):
        target = getattr(namespace, "_scales_target", None)
        given = dict(getattr(namespace, self.dest) or {})
        if target is None:
            parser.error(f"--scales {values}: put it after the --scheme or --config it gives scales to")
        if target in given:
            parser.error(f"--scales {values}: --{target[0]} {getattr(namespace, target[0])[target[1]]} already "
                         f"has --scales {given[target]}")
        given[target] = values
        setattr(namespace, self.dest, given)


def run(args: argparse.Namespace) -> int:
    from kverr.capturing import load_model, load_text, supported_shape
    from kverr.config import atomic_write_text, check_model_matches
    from kverr.evaluation import evaluate, parse_schemes, plot_kl_vs_bits, read_scales, summarize_schemes
    from kverr.io import check_output_path

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out
    segments_csv = out.with_name(out.stem + ".segments.csv")
    # The plot and per-segment CSV beside --out obey the same overwrite rule as --out itself.
    for path in (out, segments_csv, out.with_suffix(".png")):
        check_output_path(path, overwrite=args.overwrite, kind="file")
    schemes = parse_schemes(args.scheme, args.config, scales=args.scales)
    # Everything that can be checked without the model is checked before loading it.
    shape = supported_shape(args.model)
    dims = (shape.n_layers, shape.n_kv_heads, shape.head_dim)
    for s in schemes:
        if s.config is not None:
            s.config.check_model(*dims)
            check_model_matches(s.config, shape=dims)
            if s.scales is not None:
                read_scales(s.scales, s.config, shape.n_layers, shape.n_kv_heads)
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
    cols = ["scheme", "prefill", "effective_bits", "mean_kl", "mean_kl_se", "p99_kl", "top1", "top1_se", "ppl",
            "ppl_fp16"]
    if "first_divergence" in summary:
        cols.append("first_divergence")
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {out}, {segments_csv} and {plot}")
    return 0
