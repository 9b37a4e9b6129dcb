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
    from kverr.cost import GPUS

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
    p.add_argument("--capture", required=True, type=Path, nargs="+", metavar="CAPTURE",
                   help="a capture of every layer (kverr capture), or several of one model (e.g. of prose and "
                   "of code): each is scored and its sensitivity measured, and the budget is solved on their "
                   "damage and layer weights averaged, the captures counting alike")
    p.add_argument("--target", choices=("kverr", "vllm", "hf"), default="kverr",
                   help="kverr (default): any format per layer, kv head and K|V; vllm: only what vLLM "
                   "serves -- one --kv-cache-dtype (fp8 with static per-tensor or per-head scales, "
                   "absmax or MSE-clipped per layer, or a per-token-head dtype) and the skip layers the "
                   "budget allows, those where the dtype does most damage; --frontier then writes every "
                   "dtype's damage, with the calibrated skip layers and with vLLM's TurboQuant "
                   "convention (first and last two layers) at equal memory; hf: transformers' "
                   "QuantizedCache settings (backend, bits, group size, residual length), one format "
                   "for the model; --frontier then writes every setting's bits and damage")
    p.add_argument("--budget-bits", required=True, type=_budgets, metavar="B[,B...]",
                   help="effective bits per element; a list writes one config per budget (use {bits} in --out)")
    p.add_argument("--out", required=True, help="config JSON to write; '{bits}' is replaced by the budget")
    p.add_argument("--frontier", type=Path, help="write the Pareto frontier as CSV (with --max-step-time or "
                   "--step-at, each point's predicted decode step over fp16's too, column predicted_step)")
    p.add_argument("--context", type=positive_int,
                   help="tokens at which effective bits are counted (default: the capture's length)")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="sequences the budget counts together, static bytes (static scales, codebooks) "
                   "once for them all (default: 1)")
    p.add_argument("--refit-widths", action="store_true",
                   help="the configs will be served with their per-channel widths refit on each prompt "
                   "(kverr evaluate --refit-widths): count the width tables each sequence then stores")
    p.add_argument("--compensated-keys", action="store_true",
                   help="the configs will round their keys with compensation (key_rounding compensated, "
                   "kverr evaluate --compensated-keys): score the integer key formats rounded so")
    p.add_argument("--static-moments", action="store_true",
                   help="with --compensated-keys: the configs carry the capture's query moments (of several "
                   "captures, their mean; key_moments, "
                   "static bytes counted in the budget) and round every key under them, decode steps included, "
                   "without waiting for each prefill's queries")
    p.add_argument("--sinks", type=_ints, metavar="S[,S...]",
                   help="full-precision sink tokens to try, crossed with --window (default: the pairs "
                   "S0/R0, S4/R16, S4/R32, S4/R64)")
    p.add_argument("--window", type=_ints, metavar="R[,R...]",
                   help="full-precision recent-token windows to try, crossed with --sinks (default: see --sinks)")
    p.add_argument("--window-per-head", action="store_true",
                   help="let each layer, kv head and K|V pick its window among the --window lengths (with its "
                   "format, at its own bytes); not with --max-groups-per-layer or --max-step-time")
    p.add_argument("--salient", type=non_negative_int, default=0, metavar="N",
                   help="keep the N prompt tokens each (layer, kv head) attends to most as window-dtype rows "
                        "with their positions, besides their codes (counted against the budget; the objective "
                        "scores each format with them taken out; serving engines' exports refuse them; default 0)")
    p.add_argument("--salient-sides", choices=("kv", "k", "v"), default="kv",
                   help="the sides whose salient rows are kept: keys and values (kv, the default), keys or values")
    p.add_argument("--salient-recent", type=non_negative_int, default=0, metavar="R",
                   help="of the --salient rows, R hold the prompt's last R tokens whatever their saliency (the tokens the "
                        "first decode steps read most; at most N; priced by the objective only with --decode; default 0)")
    p.add_argument("--key-rope", choices=("post", "pre", "both"),
                   help="quantize keys after RoPE, before, or try both (default: pre when the capture holds "
                   "pre-RoPE keys and RoPE parameters, else post; 'both' doubles the key-side scoring)")
    p.add_argument("--window-dtype", choices=("auto", "fp16", "bf16", "fp32", "int8"), default="auto",
                   help="dtype of the sinks, window and pending tokens: int8 (a row of int8 codes and an "
                        "fp16 scale per token and kv head: D + 2 bytes instead of fp16's 2 D) or a float; "
                        "auto (default): int8 below 4.75 effective bits, where it beat fp16 held out, fp16 "
                        "from there on")
    p.add_argument("--candidates", choices=("auto", "all", "dynamic", "fitted"), default="auto",
                   help="candidate formats: 'all' 78, 'dynamic' the 60 without static per-channel "
                        "scales, 'auto' (default) all below 3.5 bits and dynamic from there on "
                        "(held out, static scales won below and lost above; see the README); 'fitted' "
                        "all and static per-channel widths fitted to each head's queries and attention "
                        "at 1.5 to 3.5 mean bits")
    p.add_argument("--codebooks", action="store_true",
                   help="add 9 codebook candidates to the set: the normal's Lloyd-Max levels with one "
                        "scale per token, 2 to 4 bits, rotated or not (held out they cut KL by 15 %% at "
                        "2.5 and 3 bits; see docs/calibration.md)")
    p.add_argument("--decode", type=non_negative_int, default=0,
                   help="model this many decode steps after a prompt quantized whole, as kverr "
                        "evaluate does (default 0: every query's window holds its most recent tokens)")
    p.add_argument("--queries", type=positive_int, default=32,
                   help="sampled query positions per layer (default: %(default)s); more fit less of their noise: "
                        "256 chose a 2-bit config with 8 %% less held-out KL for about 7 more minutes of "
                        "scoring on two cores (docs/calibration.md)")
    p.add_argument("--max-bits", type=positive_float,
                   help="frontier up to this many bits, at least the largest budget (default: 8 or the "
                   "largest budget, whichever is more)")
    p.add_argument("--workers", type=positive_int, default=2,
                   help="local threads scoring layers at once, one torch thread each (default: %(default)s; "
                   "--target vllm and hf score in the calling thread)")
    p.add_argument("--scheduler", metavar="ADDR",
                   help="a dask.distributed scheduler address (tcp://HOST:PORT) to score layers on; the "
                   "capture must be readable by its workers (default: local threads)")
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
    p.add_argument("--max-groups-per-layer", type=positive_int, metavar="N",
                   help="at most N distinct (K format, V format) pairs among a layer's kv heads: the "
                   "kernels launch decode attention once per pair and layer (kverr plan counts the "
                   "launches); default: no bound")
    p.add_argument("--max-step-time", type=positive_float, metavar="X",
                   help="the predicted decode step (kverr plan, CUDA graphs) may take at most X times fp16's: "
                   "each config gets the most format groups per layer that fits")
    p.add_argument("--step-at", type=_step_at, metavar="T,B",
                   help="with --max-step-time: cached tokens and batch it is predicted at (default: the context, 1)")
    p.add_argument("--gpu", choices=sorted(GPUS),
                   help="with --max-step-time: the GPU it is predicted on (default: h200)")
    p.add_argument("--name", help="config name; '{bits}' is replaced by the budget (default: calibrated-{bits}b)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.set_defaults(func=run)


def print_captures(paths, provenances) -> None:
    """Name the captures a calibration averaged (nothing for one capture)."""
    if provenances:
        print(f"damage and layer weights averaged over {len(provenances)} captures: " + "; ".join(
            f"{path} ({c['text_source'] or 'text not recorded'}, tokens {c['token_offset']}.."
            f"{c['token_offset'] + c['tokens'] - 1})" for path, c in zip(paths, provenances)))


def on_each_capture(provenance) -> str:
    """The line naming a config's predicted damage on each of several captures (the objective is
    their mean)."""
    return "  on each capture: " + ", ".join(f"{d:.4g}" for d in provenance["predicted_damage_each"])


def _step_at(text: str) -> tuple[int, int]:
    try:
        tokens, batch = (int(p) for p in text.split(","))
        if tokens < 1 or batch < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give TOKENS,BATCH, two positive integers, e.g. 32768,16") from None
    return tokens, batch


def settings_of(args: argparse.Namespace):
    """The :class:`~kverr.calibration.CalibrationConfig` the command line asks for."""
    from kverr.calibration import CalibrationConfig

    return CalibrationConfig(
        budgets=tuple(args.budget_bits), context=args.context, batch=args.batch,
        refit_widths=args.refit_widths, compensated_keys=args.compensated_keys, static_moments=args.static_moments,
        window_per_head=args.window_per_head, key_rope=args.key_rope,
        sinks=None if args.sinks is None else tuple(args.sinks),
        windows=None if args.window is None else tuple(args.window),
        candidates=args.candidates, codebooks=args.codebooks, window_dtype=args.window_dtype, queries=args.queries,
        salient=args.salient, salient_sides=args.salient_sides, salient_recent=args.salient_recent,
        decode=args.decode or None, max_bits=args.max_bits, objective=args.objective,
        sensitivity_noise=args.sensitivity_noise, sensitivity_tokens=args.sensitivity_tokens,
        model=args.model, name=args.name, max_groups_per_layer=args.max_groups_per_layer,
        max_step_time=args.max_step_time, step_tokens=args.step_at[0] if args.step_at else None,
        step_batch=args.step_at[1] if args.step_at else 1, gpu=args.gpu or "h200",
    )


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kverr.calibration import calibrate
    from kverr.calibration.search import batch_phrase
    from kverr.config import atomic_write_text
    from kverr.io import check_output_path, open_capture

    budgets = args.budget_bits
    if len(budgets) > 1 and "{bits}" not in args.out:
        raise ConfigError("several budgets need '{bits}' in --out, e.g. --out cfg-{bits}b.json")
    if args.max_bits is not None and args.max_bits < max(budgets):
        raise ConfigError(f"--max-bits {args.max_bits:g} is below the budget of {max(budgets):g} bits: the "
                          f"frontier must reach the budget; give --max-bits {max(budgets):g} or more, or leave it out")
    if len(set(budgets)) != len(budgets):
        raise ConfigError(f"--budget-bits {','.join(f'{b:g}' for b in budgets)} names a budget twice")
    if args.target != "kverr":
        given = [o for o, v in (("--sinks", args.sinks), ("--window", args.window), ("--key-rope", args.key_rope),
                                ("--scheduler", args.scheduler), ("--max-bits", args.max_bits),
                                ("--max-groups-per-layer", args.max_groups_per_layer),
                                ("--max-step-time", args.max_step_time))
                 if v is not None]
        given += [o for o, v in (("--window-dtype", args.window_dtype), ("--candidates", args.candidates))
                  if v != "auto"]
        given += ["--salient"] if args.salient else []
        given += ["--compensated-keys"] if args.compensated_keys else []
        given += ["--static-moments"] if args.static_moments else []
        given += ["--window-per-head"] if args.window_per_head else []
        given += ["--salient-sides"] if args.salient_sides != "kv" else []
        given += ["--salient-recent"] if args.salient_recent else []
        if given:
            raise ConfigError(f"--target {args.target} searches only what the engine serves: "
                              f"{', '.join(given)} does not apply")
    if len({c.resolve() for c in args.capture}) != len(args.capture):
        raise ConfigError("--capture names a capture twice")
    settings = settings_of(args)
    outs = [Path(args.out.replace("{bits}", f"{b:g}")) for b in budgets]
    for o in outs + ([args.frontier] if args.frontier else []):
        check_output_path(o, overwrite=args.overwrite, kind="file")
    captures = [open_capture(c) for c in args.capture]  # one or several: calibrate() takes either
    if args.target == "vllm":
        return _run_vllm(args, settings, captures, budgets, outs)
    if args.target == "hf":
        return _run_hf(args, settings, captures, budgets, outs)
    # bars are drawn only when stderr is a terminal (kverr.progress)
    cal = calibrate(captures, settings, scheduler=args.scheduler, workers=args.workers, progress=True)
    print_captures(args.capture, cal.captures)
    if cal.sensitivity is not None:
        sv = cal.sensitivity
        r = sv.quadratic_ratio
        ws = (f"w = {sv.weights_k.min():.3g} .. {sv.weights_k.max():.3g} nats per unit relative squared "
              f"error (layer {int(sv.weights_k.argmax())} highest)") if sv.noise == "o_proj" else (
              f"nats per unit relative squared error: keys {sv.weights_k.min():.3g} .. "
              f"{sv.weights_k.max():.3g} (layer {int(sv.weights_k.argmax())} highest), values "
              f"{sv.weights_v.min():.3g} .. {sv.weights_v.max():.3g} (layer {int(sv.weights_v.argmax())})")
        print(f"layer sensitivity ({sv.noise} noise) on {sv.tokens} tokens in {cal.seconds['sensitivity']:.1f} s: "
              f"{ws}; quadratic check (KL/r)(eps2)/(KL/r)(eps1) = {np.nanmin(r):.3f} .. {np.nanmax(r):.3f}")
    for b, out in zip(budgets, outs):
        cfg = cal.configs[b]
        cfg.save(out)
        pv = cfg.provenance
        print(f"budget {b:g} bits -> {out}: {pv['effective_bits']:.4f} effective bits at "
              f"{pv['context_tokens']} tokens{batch_phrase(pv.get('batch', 1))}, option {pv['outer_option']}, "
              f"{cfg.window_dtype} window, "
              f"{pv['candidates_k']} candidates, "
              f"objective {pv['objective']} = {pv['predicted_damage']:.4g} (K {pv['predicted_k']:.3g}, "
              f"V {pv['predicted_v']:.3g})")
        if "predicted_damage_each" in pv:
            print(on_each_capture(pv))
        if cfg.windows_vary:  # --window-per-head: how many groups keep each length
            ch = cal.choices[b]
            print("  window per (layer, kv head): " + "; ".join(
                f"{'keys' if w == 'k' else 'values'} " + ", ".join(
                    f"{n} tokens x{c}" for n, c in ch[ch.which == w].window.value_counts().sort_index().items())
                for w in ("k", "v")))
        if "predicted_step" in pv:
            st = pv["predicted_step"]
            print(f"  at most {pv.get('max_groups_per_layer', 'any number of')} format pairs per layer: predicted decode "
                  f"step {st['ratio']:.3f}x fp16's at {st['tokens']} tokens x batch {st['batch']} on {st['gpu']} "
                  f"(bound {st['max_step_time']:g}x)")
    if args.frontier:
        # with a step-time question, every frontier point's predicted step beside its bits and KL
        fr = cal.frontier_steps() if args.max_step_time is not None or args.step_at else cal.frontier
        atomic_write_text(args.frontier, fr.to_csv(index=False))
        groups = ", ".join(f"{s.candidates} ({s.window_dtype} window)" for s in cal.searches)
        print(f"wrote the frontier ({len(fr)} points; candidates {groups}) to {args.frontier}")
    print(f"scored in {cal.seconds['score']:.1f} s, searched in {cal.seconds['search']:.1f} s")
    return 0


def _run_vllm(args: argparse.Namespace, settings, captures, budgets, outs) -> int:
    from kverr.calibration.target import calibrate_for_vllm
    from kverr.config import atomic_write_text

    res = calibrate_for_vllm(captures, settings, progress=True)
    print_captures(args.capture, next(iter(res.configs.values())).provenance.get("captures"))
    for b, out in zip(budgets, outs):
        res.configs[b].save(out)
    print(report_vllm(res, dict(zip(budgets, outs))))
    if args.frontier:
        t = res.table
        atomic_write_text(args.frontier, t.assign(skip_layers=t.skip_layers.map(
            lambda x: " ".join(map(str, x)))).to_csv(index=False))
        print(f"wrote every dtype and skip rule ({len(t)} rows) to {args.frontier}")
    print(f"scored in {res.seconds:.1f} s; export a config with: kverr export CONFIG --format vllm "
          "--capture CAPTURE --model-dir MODEL_DIR --out OUT")
    return 0


def report_vllm(res, outs: dict) -> str:
    """What ``kverr calibrate --target vllm`` prints for each budget: the choice, then every
    dtype and skip rule."""
    lines = []
    for b, out in outs.items():
        pv = res.configs[b].provenance
        skip = pv["kv_cache_dtype_skip_layers"]
        lines.append(f"budget {b:g} bits -> {out}: --kv-cache-dtype {pv['kv_cache_dtype']}, skip layers "
                     f"{skip or 'none'}, {pv['effective_bits']:.4f} effective bits at {pv['context_tokens']} "
                     f"tokens, objective {pv['objective']} = {pv['predicted_damage']:.4g}")
        if "predicted_damage_each" in pv:
            lines.append(on_each_capture(pv))
        for r in res.table[res.table.budget_bits == float(b)].to_dict("records"):
            mark = "" if r["feasible"] else "  (over budget)"
            lines.append(f"    {r['dtype']:26s} {r['skip_rule']:18s} skip {str(list(r['skip_layers'])):16s} "
                         f"{r['effective_bits']:7.4f} bits  predicted {r['predicted']:.4g}{mark}")
    return "\n".join(lines)


def _run_hf(args: argparse.Namespace, settings, captures, budgets, outs) -> int:
    from kverr.calibration.target import calibrate_for_hf
    from kverr.config import atomic_write_text
    from kverr.engines.hf import check_hf

    res = calibrate_for_hf(captures, settings, progress=True)
    print_captures(args.capture, next(iter(res.configs.values())).provenance.get("captures"))
    kv = captures[0].kv
    for b, out in zip(budgets, outs):
        cfg = res.configs[b]
        cfg.save(out)
        pv = cfg.provenance
        cc = check_hf(cfg, kv.n_layers, kv.n_kv_heads, kv.head_dim)
        print(f"budget {b:g} bits -> {out}: {pv['candidate']} (cache_config {cc}), {pv['effective_bits']:.4f} "
              f"effective bits at {pv['context_tokens']} tokens, objective {pv['objective']} = "
              f"{pv['predicted_damage']:.4g} ({pv['candidates_compared']} settings compared)")
        if "predicted_damage_each" in pv:
            print(on_each_capture(pv))
    if args.frontier:
        atomic_write_text(args.frontier, res.table.to_csv(index=False))
        print(f"wrote every setting ({len(res.table)} rows) to {args.frontier}")
    print(f"scored in {res.seconds:.1f} s; export a config with: kverr export CONFIG --format hf --out OUT")
    return 0
