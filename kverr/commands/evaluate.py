"""``kverr evaluate``: what cache formats do to the real model's output — next-token KL, top-1 and
perplexity on running text (``--task text``), or pass-key retrieval (``--task passkey``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kverr.commands._common import non_negative_int, positive_int


#: Defaults of the options that belong to one task (None on the command line: not given).
TEXT_DEFAULTS = {"prefill": [1024], "decode": 128, "segments": 1, "offset": 5000, "prefill_policy": "all",
                 "greedy": None, "refit_widths": False,
                 "compensated_keys": False}
PASSKEY_DEFAULTS = {"context": [1024], "depth": [0.0, 0.25, 0.5, 0.75, 1.0], "trials": 4, "keys": 1, "seed": 0}


def _percents(text: str) -> list[float]:
    """``"0,50,100"`` -> ``[0.0, 0.5, 1.0]``: percentages 0 to 100, as fractions."""
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of percentages such as 0,50,100") from None
        if not 0.0 <= v <= 100.0:
            raise argparse.ArgumentTypeError(f"depth {part.strip()} is outside 0-100 %")
        out.append(v / 100.0)
    return out


def _task_options(args: argparse.Namespace) -> None:
    """Refuse the other task's options; fill this task's defaults."""
    mine, other = ((TEXT_DEFAULTS, PASSKEY_DEFAULTS) if args.task == "text" else (PASSKEY_DEFAULTS, TEXT_DEFAULTS))
    given = [k for k in other if getattr(args, k) is not None]
    if given:
        from kverr.exceptions import ConfigError

        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"{names}: not an option of --task {args.task}")
    for k, v in mine.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="measure what cache formats do to the model's output, beside today's formats",
        description="Prefill P tokens of real text into each cache, quantize, then decode N tokens "
        "teacher-forced and compare every next-token distribution with the unquantized cache: "
        "mean/p50/p99 KL, top-1 agreement, perplexity and its delta, and the first step where "
        "greedy generation diverges. Peers: quanto-int4, quanto-int2 (transformers' "
        "QuantizedCache, group 64, residual 128); vllm-int4-per-token-head, vllm-turboquant-4bit-nc, "
        "vllm-turboquant-k3v4-nc, vllm-turboquant-3bit-nc (vLLM's caches kverr's formats cannot express, "
        "emulated); turboquant-2.5, turboquant-3.5, oscar-int2, oscar-int2-s4r32(-fp16), kvquant-2bit-1pct, "
        "kvquant-3bit-1pct (papers' methods, emulated; OSCAR and KVQuant fitted to --calibration). "
        "Writes a CSV (one row per scheme and context, mean over segments, with standard errors), "
        "the per-segment rows beside it and a plot of KL against effective bits. Static "
        "per-tensor/per-head scales come from the prefill unless --scales gives them, as a serving engine has them fixed beforehand. "
        "--task passkey instead hides a five-digit key at --depth percent of a haystack of --text, asks for "
        "it at the end of a --context-token prompt and scores the greedy answer through each cache, "
        "beside the unquantized cache: accuracy with its Wilson 95%% interval per scheme and context.",
    )
    p.add_argument("--task", choices=("text", "passkey"), default="text",
                   help="'text': KL on running text (default); 'passkey': retrieval of a hidden key")
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
    p.add_argument("--text", default="pydoc", help="'pydoc' (the stdlib's topics) or a UTF-8 file (the haystack "
                   "for --task passkey)")
    text = p.add_argument_group("--task text")
    text.add_argument("--prefill", action="append", type=positive_int, metavar="P", help="prefill tokens (repeat; default 1024)")
    text.add_argument("--decode", type=positive_int, help=f"teacher-forced decode steps (default: {TEXT_DEFAULTS['decode']})")
    text.add_argument("--segments", type=positive_int, help=f"disjoint text segments (default: {TEXT_DEFAULTS['segments']})")
    text.add_argument("--offset", type=non_negative_int,
                      help=f"first token of the first segment (default: {TEXT_DEFAULTS['offset']})")
    text.add_argument(
        "--prefill-policy", choices=("all", "window"),
        help="'all': quantize everything after prefill (default); 'window': keep each config's window",
    )
    text.add_argument("--greedy", type=non_negative_int, help="greedy steps for first divergence (default: --decode; 0 skips)")
    key = p.add_argument_group("--task passkey")
    key.add_argument("--context", action="append", type=positive_int, metavar="C",
                     help=f"prompt tokens (repeat; default {PASSKEY_DEFAULTS['context'][0]})")
    key.add_argument("--depth", type=_percents, metavar="D,D,...",
                     help="depths of the key in the haystack, percent (default: 0,25,50,75,100)")
    key.add_argument("--trials", type=positive_int,
                     help=f"prompts per context and depth (default: {PASSKEY_DEFAULTS['trials']})")
    key.add_argument("--keys", type=positive_int,
                     help="needles per prompt; more than 1 is the multi-key variant, the question names one (default: 1)")
    key.add_argument("--seed", type=non_negative_int, help="seed of the keys and haystack offsets (default: 0)")
    p.add_argument("--calibration", type=Path, metavar="CAPTURE",
                   help="the capture peers fitted offline are fitted to (the one kverr's configs were "
                   "calibrated on)")
    p.add_argument("--refit-widths", action="store_true", default=None,
                   help="also evaluate every config with per-channel widths with its widths refit on each prompt "
                   "before it is quantized (as NAME+refit; the widths each sequence stores are counted)")
    p.add_argument("--compensated-keys", action="store_true", default=None,
                   help="evaluate every config with integer key formats with its keys rounded with error "
                   "compensation under the prefill's queries (or the config's static key_moments) instead (key_rounding "
                   "'compensated'; as NAME+ck; "
                   "same bytes, reference cache only)")
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
    from kverr.config import atomic_write_text
    from kverr.evaluation import evaluate, parse_schemes, plot_kl_vs_bits, summarize_schemes
    from kverr.io import check_output_path

    import torch

    _task_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.task == "passkey":
        return _passkey(args)
    out: Path = args.out
    segments_csv = out.with_name(out.stem + ".segments.csv")
    # The plot and per-segment CSV beside --out obey the same overwrite rule as --out itself.
    for path in (out, segments_csv, out.with_suffix(".png")):
        check_output_path(path, overwrite=args.overwrite, kind="file")
    calibration = _calibration(args)
    schemes = parse_schemes(args.scheme, args.config, scales=args.scales, calibration=calibration,
                            refit=args.refit_widths, compensated_keys=args.compensated_keys)
    # Everything that can be checked without the model is checked before loading it.
    _check_schemes(schemes, supported_shape(args.model))
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


def _calibration(args: argparse.Namespace) -> str | None:
    """``--calibration``, checked to be a capture (None when not given)."""
    if args.calibration is None:
        return None
    from kverr.io import open_capture

    open_capture(args.calibration)  # a missing or broken capture fails here, before the model loads
    return str(args.calibration)


def _check_schemes(schemes, shape) -> None:
    """Each config against the model's shape and weights, and its given scales, before loading."""
    from kverr.config import check_model_matches
    from kverr.evaluation import read_scales

    from kverr.engines.vllm_dtypes import KV_CACHE_DTYPE, boundary_layers, has_boundary_skip

    dims = (shape.n_layers, shape.n_kv_heads, shape.head_dim)
    for s in schemes:
        if s.config is not None:
            s.config.check_model(*dims)
            check_model_matches(s.config, shape=dims)
            if s.scales is not None:
                read_scales(s.scales, s.config, shape.n_layers, shape.n_kv_heads)
        dtype = KV_CACHE_DTYPE.get(s.name)
        if dtype and has_boundary_skip(dtype) and boundary_layers(shape.n_layers):
            print(f"note: {s.name} quantizes every layer; vLLM's {dtype} keeps layers "
                  f"{', '.join(map(str, boundary_layers(shape.n_layers)))} of this model in 16 bits "
                  "(kverr.engines.vllm_dtypes.with_boundary_skip writes that config)", file=sys.stderr)


def _passkey(args: argparse.Namespace) -> int:
    """``--task passkey``: the trials checked before the model's weights are loaded, then run."""
    from kverr.capturing import load_model, load_text, supported_shape
    from kverr.config import atomic_write_text
    from kverr.evaluation import parse_schemes, read_scales
    from kverr.io import check_output_path
    from kverr.retrieval import (
        check_passkey_request,
        evaluate_passkey,
        passkey_trials,
        plot_passkey,
        summarize_passkey,
    )

    out: Path = args.out
    trials_csv = out.with_name(out.stem + ".trials.csv")
    for path in (out, trials_csv, out.with_suffix(".png")):
        check_output_path(path, overwrite=args.overwrite, kind="file")
    # No scheme: the unquantized cache alone, to find the contexts where the model retrieves.
    schemes = parse_schemes(args.scheme, args.config, scales=args.scales, required=False,
                            calibration=_calibration(args))
    shape = supported_shape(args.model)
    check_passkey_request(args.context, args.depth, args.trials, args.keys, shape.max_context)
    _check_schemes(schemes, shape)
    text = load_text(args.text)
    loaded = load_model(args.model)
    trials = passkey_trials(loaded.tokenizer, text, contexts=args.context, depths=args.depth, trials=args.trials,
                            keys=args.keys, seed=args.seed, max_context=loaded.max_context)
    given = {s.name: read_scales(s.scales, s.config, shape.n_layers, shape.n_kv_heads)
             for s in schemes if s.scales is not None}
    import pandas as pd

    def save_rows(rows: list[dict]) -> None:
        atomic_write_text(trials_csv, pd.DataFrame(rows).to_csv(index=False))

    df = evaluate_passkey(loaded, trials, schemes, static_scales=given, on_row=save_rows)
    save_rows(df.to_dict("records"))
    summary = summarize_passkey(df)
    atomic_write_text(out, summary.to_csv(index=False))
    plot = plot_passkey(df, out.with_suffix(".png"))
    cols = ["scheme", "context", "effective_bits", "accuracy", "accuracy_lo", "accuracy_hi", "kept", "key_nll_delta",
            "answer_kl", "trials"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {out}, {trials_csv} and {plot}")
    return 0
