"""``kverr calibrate``: choose formats per layer, kv head and K|V under a memory budget."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kverr.commands._common import non_negative_int, positive_float, positive_int
from kverr.exceptions import ConfigError

log = logging.getLogger(__name__)


def _budgets(text: str) -> list[float]:
    try:
        vals = [positive_float(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a finite positive number of bits or a comma-separated list of them"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite positive number of bits")
    return vals


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give non-negative integers")
    return vals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="choose a format per layer, kv head and K|V under a budget in effective bits",
        description="Score every candidate format (ints at 2/3/4/8 bits, fp8, fp16; scale "
        "granularities; absmax or MSE clipping; Hadamard or none) for every layer, kv head, keys "
        "and values, by the attention damage it causes on a calibration capture (key term and "
        "value term of kverr's error decomposition, relative to the layer's output, weighted by "
        "the layer's sensitivity measured with the capture's model: a predicted next-token KL), then solve "
        "the multiple-choice knapsack exactly under the budget (effective bits per element with "
        "all metadata, sinks and window, at --context tokens). Writes the config with its "
        "provenance and optionally the whole Pareto frontier.",
    )
    p.add_argument("--capture", required=True, type=Path, help="a capture of every layer (kverr capture)")
    p.add_argument("--budget-bits", required=True, type=_budgets, metavar="B[,B...]",
                   help="effective bits per element; a list writes one config per budget (use {bits} in --out)")
    p.add_argument("--out", required=True, help="config JSON to write; '{bits}' is replaced by the budget")
    p.add_argument("--frontier", type=Path, help="write the Pareto frontier as CSV")
    p.add_argument("--context", type=positive_int,
                   help="tokens at which effective bits are counted (default: the capture's length)")
    p.add_argument("--sinks", type=_ints, metavar="S[,S...]",
                   help="full-precision sink tokens to try, crossed with --window (default: the pairs "
                   "S0/R0, S4/R16, S4/R32, S4/R64)")
    p.add_argument("--window", type=_ints, metavar="R[,R...]",
                   help="full-precision recent-token windows to try, crossed with --sinks (default: see --sinks)")
    p.add_argument("--key-rope", choices=("post", "pre", "both"),
                   help="quantize keys after RoPE, before, or try both (default: pre when the capture holds "
                   "pre-RoPE keys and RoPE parameters, else post; 'both' doubles the key-side scoring)")
    p.add_argument("--window-dtype", choices=("auto", "fp16", "bf16", "fp32", "int8"), default="auto",
                   help="dtype of the sinks, window and pending tokens: int8 (a row of int8 codes and an "
                        "fp16 scale per token and kv head: D + 2 bytes instead of fp16's 2 D) or a float; "
                        "auto (default): int8 below 4.75 effective bits, where it beat fp16 held out, fp16 "
                        "from there on")
    p.add_argument("--candidates", choices=("auto", "all", "dynamic"), default="auto",
                   help="candidate formats: 'all' 78, 'dynamic' the 60 without static per-channel "
                        "scales, 'auto' (default) all below 3.5 bits and dynamic from there on "
                        "(held out, static scales won below and lost above; see the README)")
    p.add_argument("--decode", type=non_negative_int, default=0,
                   help="model this many decode steps after a prompt quantized whole, as kverr "
                        "evaluate does (default 0: every query's window holds its most recent tokens)")
    p.add_argument("--queries", type=positive_int, default=32, help="sampled queries per layer (default: %(default)s)")
    p.add_argument("--max-bits", type=positive_float,
                   help="frontier up to this many bits, at least the largest budget (default: 8 or the "
                   "largest budget, whichever is more)")
    p.add_argument("--workers", type=positive_int, default=2, help="processes scoring layers (default: %(default)s)")
    p.add_argument("--objective", default="kl", choices=("kl", "rel"),
                   help="kl (default): predicted next-token KL, each layer's relative attention-output "
                   "error weighted by its sensitivity, measured with the capture's model by noise "
                   "injection; rel: relative errors summed with equal layer weights")
    p.add_argument("--sensitivity-noise", choices=("o_proj", "kv"), default="o_proj",
                   help="kl objective: measure each layer's sensitivity with noise at its o_proj input "
                   "(default: one weight per layer), or in its cached keys and, separately, values "
                   "(kv: a weight per layer and side, twice the model runs; predicts measured KL "
                   "closer, chose no better configs held out, see the README)")
    p.add_argument("--model", help="the capture's model (default: the one the capture names; it is "
                   "refused unless its weights are the capture's)")
    p.add_argument("--sensitivity-tokens", type=positive_int, default=640,
                   help="calibration tokens the sensitivity is measured on (default: %(default)s)")
    p.add_argument("--name", help="config name (default: calibrated-<budget>b)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kverr.calibration import calibrate
    from kverr.calibration.candidates import candidate_set, default_candidates, window_dtype_for_budget
    from kverr.calibration.search import outer_options
    from kverr.config import atomic_write_text
    from kverr.io import check_output_path, open_capture

    budgets = args.budget_bits
    if len(budgets) > 1 and "{bits}" not in args.out:
        raise ConfigError("several budgets need '{bits}' in --out, e.g. --out cfg-{bits}b.json")
    if args.max_bits is not None and args.max_bits < max(budgets):
        raise ConfigError(f"--max-bits {args.max_bits:g} is below the budget of {max(budgets):g} bits: the "
                          f"frontier must reach the budget; give --max-bits {max(budgets):g} or more, or leave it out")
    max_bits = max(8.0 if args.max_bits is None else args.max_bits, *budgets)
    outs = [Path(args.out.replace("{bits}", f"{b:g}")) for b in budgets]
    for o in outs + ([args.frontier] if args.frontier else []):
        check_output_path(o, overwrite=args.overwrite, kind="file")
    capture = open_capture(args.capture)
    options = outer_options(capture, args.key_rope, args.sinks, args.window)
    # budgets grouped by window dtype and candidate set; within a window dtype "all" is scored
    # first and the "dynamic" search reuses its damage tables (a subset of them); every search
    # reuses the first one's sensitivity
    set_of = {b: (window_dtype_for_budget(b, args.window_dtype), candidate_set(b, args.candidates)) for b in budgets}
    progress = True  # bars are drawn only when stderr is a terminal (kverr.progress)
    cals: dict = {}
    # int8-window groups first, and within a window dtype "all" (the superset) before "dynamic"
    for group in sorted(set(set_of.values()), key=lambda g: (g[0] != "int8", g[0], g[1])):
        wdt, name = group
        cands = default_candidates(capture.sizes["channel"], static=name == "all")
        first = next(iter(cals.values()), None)
        base = next((c for (w, _), c in cals.items() if w == wdt), None)
        cal = calibrate(capture, min(b for b in budgets if set_of[b] == group), context=args.context,
                        options=options, queries=args.queries, cands_k=cands, cands_v=cands,
                        window_dtype=wdt,
                        decode=args.decode or None, max_bits=max_bits,
                        workers=args.workers, progress=progress, capture_path=args.capture, name=args.name,
                        objective=args.objective, model=args.model, sensitivity_tokens=args.sensitivity_tokens,
                        sensitivity_noise=args.sensitivity_noise,
                        scores=None if base is None else base.scores.subset(cands, cands),
                        sensitivity=None if first is None else first.sensitivity)
        if first is None and cal.sensitivity is not None:
            sv = cal.sensitivity
            r = sv.quadratic_ratio
            ws = (f"w = {sv.weights_k.min():.3g} .. {sv.weights_k.max():.3g} nats per unit relative squared "
                  f"error (layer {int(sv.weights_k.argmax())} highest)") if sv.noise == "o_proj" else (
                  f"nats per unit relative squared error: keys {sv.weights_k.min():.3g} .. "
                  f"{sv.weights_k.max():.3g} (layer {int(sv.weights_k.argmax())} highest), values "
                  f"{sv.weights_v.min():.3g} .. {sv.weights_v.max():.3g} (layer {int(sv.weights_v.argmax())})")
            print(f"layer sensitivity ({sv.noise} noise) on {sv.tokens} tokens in {cal.seconds['sensitivity']:.1f} s: "
                  f"{ws}; quadratic check (KL/r)(eps2)/(KL/r)(eps1) = {np.nanmin(r):.3f} .. {np.nanmax(r):.3f}")
        cals[group] = cal
    for b, out in zip(budgets, outs):
        cfg = cals[set_of[b]].config_at(b, args.name)
        cfg.save(out)
        pv = cfg.provenance
        print(f"budget {b:g} bits -> {out}: {pv['effective_bits']:.4f} effective bits at "
              f"{pv['context_tokens']} tokens, option {pv['outer_option']}, {cfg.window_dtype} window, "
              f"{pv['candidates_k']} candidates, "
              f"objective {pv['objective']} = {pv['predicted_damage']:.4g} (K {pv['predicted_k']:.3g}, "
              f"V {pv['predicted_v']:.3g})")
    if args.frontier:
        import pandas as pd

        fr = pd.concat([c.frontier.assign(candidates=n, window_dtype=w) for (w, n), c in cals.items()],
                       ignore_index=True)
        atomic_write_text(args.frontier, fr.to_csv(index=False))
        groups = ", ".join(f"{n} ({w} window)" for w, n in cals)
        print(f"wrote the frontier ({len(fr)} points; candidates {groups}) to {args.frontier}")
    print(f"scored in {sum(c.seconds['score'] for c in cals.values()):.1f} s, searched in "
          f"{sum(c.seconds['search'] for c in cals.values()):.1f} s")
    return 0
