"""``kverr demo``: the whole pipeline on the bundled default model, into ``out/``.

capture -> decompose -> calibrate at a budget -> export -> evaluate against the presets and the
quanto peer on held-out text -> validate on the kernel path -> tables, plots and a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from kverr.commands._common import non_negative_int, positive_float, positive_int

log = logging.getLogger(__name__)

DEMO_PEERS = ("kivi-4", "int4-token-g64", "quanto-int4", "kivi-2")


def heldout_text_path() -> str:
    """A Python stdlib source file (typing.py): text disjoint from the pydoc calibration text."""
    import sysconfig

    return str(Path(sysconfig.get_paths()["stdlib"]) / "typing.py")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on the bundled default model into out/",
        description="capture (pydoc) -> decompose -> calibrate at --budget effective bits -> export "
        "(vLLM, transformers) -> evaluate beside presets and the quanto peer on held-out text (the "
        "stdlib's typing.py) -> validate on the kernel path -> tables and plots in --out, and a "
        "summary on the terminal. A few minutes on 2 cores.",
    )
    p.add_argument("--out", type=Path, default=Path("out"), help="output folder (default: %(default)s)")
    p.add_argument("--model", default="default", help="'default' or a transformers model directory")
    p.add_argument("--tokens", type=positive_int, default=2048, help="calibration capture tokens (default: %(default)s)")
    p.add_argument("--budget", type=positive_float, default=4.0, help="effective bits (default: %(default)s)")
    p.add_argument("--prefill", type=positive_int, default=1024, help="evaluation prefill P (default: %(default)s)")
    p.add_argument("--decode", type=positive_int, default=128, help="evaluation decode N (default: %(default)s)")
    p.add_argument("--segments", type=positive_int, default=1, help="evaluation segments (default: %(default)s)")
    p.add_argument("--offset", type=non_negative_int, default=0, help="first token of held-out text (default: %(default)s)")
    p.add_argument("--eval-text", help="held-out text file (default: the stdlib's typing.py)")
    p.add_argument("--scheme", action="append", help=f"peer/preset to compare (repeat; default {', '.join(DEMO_PEERS)})")
    p.add_argument("--queries", type=positive_int, default=32, help="calibration queries per layer")
    p.add_argument("--workers", type=positive_int, default=2, help="calibration processes")
    p.add_argument("--no-validate", action="store_true", help="skip the kernel-path validation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    if not torch.cuda.is_available():
        # The validation step runs the kernels in the Triton interpreter; the variable must be
        # set before the kernel modules are first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    summary = run_demo(
        out=args.out, model=args.model, tokens=args.tokens, budget=args.budget, prefill=args.prefill,
        decode=args.decode, segments=args.segments, offset=args.offset, eval_text=args.eval_text,
        schemes=args.scheme or list(DEMO_PEERS), queries=args.queries, workers=args.workers,
        validate=not args.no_validate, progress=True,
    )
    print(summary)
    return 0


def _step(name: str, t0: float, lines: list[str]) -> None:
    msg = f"[{time.perf_counter() - t0:6.1f} s] {name}"
    lines.append(msg)
    print(msg, file=sys.stderr, flush=True)


def run_demo(*, out: Path, model: str = "default", tokens: int = 2048, budget: float = 4.0,
             prefill: int = 1024, decode: int = 128, segments: int = 1, offset: int = 0,
             eval_text: str | None = None, schemes=DEMO_PEERS, queries: int = 32, workers: int = 2,
             validate: bool = True, progress: bool = False, layers_decompose: int | None = None) -> str:
    """Run the pipeline; returns the terminal summary (also written to ``out/summary.txt``)."""
    from kverr.calibration import calibrate, check_model_matches, predict
    from kverr.calibration.export import export
    from kverr.calibration.plots import plot_frontier
    from kverr.calibration.objective import check_queries
    from kverr.calibration.search import check_budget, outer_options
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.config import atomic_write_text
    from kverr.error.xr import decompose_capture, layer_table
    from kverr.exceptions import ConfigError, TextError
    from kverr.evaluation import evaluate, parse_schemes, plot_kl_vs_bits, segment_jobs, summarize
    from kverr.io import open_capture
    from kverr.memory import model_shape

    from kverr.io import check_output_path

    t0 = time.perf_counter()
    out = Path(out)
    # The demo refreshes its own files in --out; that it is a writable folder is checked first.
    check_output_path(out / "summary.txt", overwrite=True, kind="file")
    # 0. every argument is checked before any work, so a bad one leaves no half-made outputs
    shape = model_shape(model)
    parse_schemes(list(schemes), config_option=None)  # the calibrated config joins them later
    context = prefill + decode
    check_budget(budget, n_layers=shape.n_layers, n_kv=shape.n_kv_heads, head_dim=shape.head_dim,
                 context=context, context_from="--prefill + --decode")
    check_queries(queries, tokens, "--queries")
    text = load_text("pydoc")
    try:
        held = load_text(eval_text or heldout_text_path())
    except TextError as exc:
        raise TextError(f"--eval-text: {exc}") from None
    loaded = load_model(model)
    ids = tokenize(loaded.tokenizer, text, tokens, 0)
    if loaded.max_context and tokens > loaded.max_context:
        raise ConfigError(f"--tokens {tokens} exceeds the model's context of {loaded.max_context} tokens")
    segment_jobs(loaded, held, prefill=[prefill], decode=decode, segments=segments, offset=offset)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[str] = []
    # 1. capture
    cap_path = out / "capture.zarr"
    capture_to_zarr(loaded, ids, cap_path, text=text, overwrite=True, progress=progress)
    capture = open_capture(cap_path)
    _step(f"captured {tokens} tokens of pydoc, {loaded.n_layers} layers -> {cap_path}", t0, steps)
    # 2. decompose (one preset, for the anatomy of the error)
    dec_layers = None
    if layers_decompose is not None:
        dec_layers = [int(x) for x in capture["layer"].values][:layers_decompose]
    ds = decompose_capture(capture, "kivi-4", queries=64, layers=dec_layers, scheduler="synchronous")
    table = layer_table(ds)
    atomic_write_text(out / "decompose-kivi-4.txt", table + "\n")
    _step("decomposed the error of kivi-4 per layer -> decompose-kivi-4.txt", t0, steps)
    # 3. calibrate
    cal = calibrate(capture, budget, context=context, queries=queries, workers=workers,
                    options=outer_options(capture),  # as `kverr calibrate` does by default
                    capture_path=cap_path, progress=progress, model=loaded)
    cfg = cal.config
    check_model_matches(cfg, loaded.weights_sha256, loaded.model_id)
    cfg_path = cfg.save(out / f"calibrated-{budget:g}b.json")
    atomic_write_text(out / "frontier.csv", cal.frontier.to_csv(index=False))
    atomic_write_text(out / "choices.csv", cal.choices.to_csv(index=False))
    plot_frontier(cal.frontier, out / "frontier.png", marks={f"{budget:g} b": cfg.provenance["effective_bits"]},
                  ylabel="predicted next-token KL (nats)")
    _step(f"calibrated at {budget:g} bits ({cfg.provenance['effective_bits']:.3f} effective at {context} "
          f"tokens) in {cal.seconds['score'] + cal.seconds['search']:.1f} s -> {cfg_path.name}", t0, steps)
    # 4. export
    exp_lines = []
    for fmt in ("vllm", "hf"):
        try:
            files = export(cfg, fmt, out / "export" / fmt, capture=capture, n_layers=loaded.n_layers,
                           n_kv=loaded.n_kv_heads, head_dim=loaded.head_dim, overwrite=True)
            exp_lines.append(f"{fmt}: wrote {', '.join(str(f) for f in files)}")
        except Exception as exc:  # noqa: BLE001 - a refusal is a result here
            exp_lines.append(f"{fmt}: refused: {exc}")
    atomic_write_text(out / "export.txt", "\n".join(exp_lines) + "\n")
    _step("export: " + " | ".join(line.split(":")[0] + (" refused" if "refused" in line else " ok") for line in exp_lines), t0, steps)
    # 5. evaluate on held-out text
    sch = parse_schemes(list(schemes), [str(cfg_path)], config_option=None)
    df = evaluate(loaded, held, sch, prefill=[prefill], decode=decode, segments=segments,
                  offset=offset, greedy_steps=0, progress=progress)
    summ = summarize(df)
    pred = {}
    for s in sch:
        if s.config is not None:
            pred[s.name] = predict(capture, s.config, queries=queries,
                                   weights=cal.sensitivity.weights_k,
                                   weights_v=cal.sensitivity.weights_v)["total"]
    summ["predicted"] = summ["scheme"].map(pred)
    atomic_write_text(out / "evaluate.segments.csv", df.to_csv(index=False))
    atomic_write_text(out / "evaluate.csv", summ.to_csv(index=False))
    plot_kl_vs_bits(summ, out / "evaluate.png")
    _step(f"evaluated {len(sch)} schemes on {Path(held.source).name} (P={prefill}, N={decode}, "
          f"{segments} segment(s)) -> evaluate.csv", t0, steps)
    # 6. validate on the kernel path
    val_line = "validate: skipped"
    if validate:
        try:
            from kverr.validation import validate as kvalidate

            rep = kvalidate(cfg, capture, tokens=64, batch=1, steps=2, layers=[0])
            atomic_write_text(out / "validate.txt", rep.to_table() + "\n")
            val_line = (f"validate: kernel path == reference on layer 0: {'yes' if rep.ok else 'NO'} "
                        f"({'interpreter' if rep.interpreted else rep.device})")
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            val_line = f"validate: not run ({type(exc).__name__}: {exc})"
        _step(val_line, t0, steps)
    cols = ["scheme", "effective_bits", "mean_kl", "p99_kl", "top1", "ppl_delta", "predicted"]
    lines = [
        f"kverr demo: {loaded.model_id}",
        f"calibrated on {tokens} tokens of pydoc; evaluated on held-out {Path(held.source).name}, "
        f"P={prefill}, N={decode}, {segments} segment(s); effective bits at {context} tokens",
        "",
        summ[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"),
        "",
        *exp_lines,
        val_line,
        f"outputs in {out}/ ({time.perf_counter() - t0:.0f} s)",
    ]
    text_out = "\n".join(lines)
    atomic_write_text(out / "summary.txt", text_out + "\n")
    atomic_write_text(out / "steps.txt", "\n".join(steps) + "\n")
    return text_out
