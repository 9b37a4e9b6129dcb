"""The whole pipeline as one function: capture (or open) -> decompose -> calibrate -> export ->
evaluate -> validate, on one model, into one folder.

``kverr demo`` is this function on the bundled default model; a notebook runs the same thing::

    from kverr.pipeline import run_pipeline

    res = run_pipeline("out", budget=4.0, progress=True)
    res.summary          # evaluation of the calibrated config beside the peers (pandas)
    res.calibration      # kverr.calibration.Calibration: frontier, choices, scores, sensitivity

Every argument is checked before any work, so a bad one leaves no half-made outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DEMO_PEERS", "PipelineResult", "heldout_text_path", "run_pipeline"]

#: Presets and peers the calibrated config is evaluated beside by default.
DEMO_PEERS = ("kivi-4", "int4-token-g64", "quanto-int4", "kivi-2")


def heldout_text_path() -> str:
    """A Python stdlib source file (typing.py): text disjoint from the pydoc calibration text."""
    import sysconfig

    return str(Path(sysconfig.get_paths()["stdlib"]) / "typing.py")


@dataclass(frozen=True)
class PipelineResult:
    """What :func:`run_pipeline` made (every file is also in ``out``).

    Attributes
    ----------
    out : Path
        The output folder.
    capture_path : Path
        The capture calibrated on.
    decomposition : str
        Per-layer table of the decomposition of ``kivi-4``'s error (``decompose-kivi-4.txt``).
    calibration : kverr.calibration.Calibration
        The calibration (frontier, choices, scores, sensitivity, timing).
    config : CacheConfig
        The calibrated config, written to ``config_path``.
    config_path : Path
    exports : dict of str to str
        Per export target (``vllm``, ``hf``): the files written, or why the target refused.
    evaluation : pandas.DataFrame
        Per-segment evaluation rows (``evaluate.segments.csv``).
    summary : pandas.DataFrame
        Per-scheme summary with the calibration's ``predicted`` damage (``evaluate.csv``).
    validation : str
        One line: the kernel path against the reference, or why it was skipped.
    text : str
        The terminal summary (``summary.txt``).
    steps : list of str
        One line per finished step, with its time (``steps.txt``).
    """

    out: Path
    capture_path: Path
    decomposition: str
    calibration: Any
    config: Any
    config_path: Path
    exports: dict[str, str]
    evaluation: Any
    summary: Any
    validation: str
    text: str
    steps: list[str] = field(default_factory=list)


def run_pipeline(out: str | Path, *, model: str = "default", capture: str | Path | None = None,
                 tokens: int = 2048, budget: float = 4.0, prefill: int = 1024, decode: int = 128,
                 segments: int = 1, offset: int = 0, eval_text: str | None = None,
                 schemes: Sequence[str] = DEMO_PEERS, queries: int = 32, workers: int | None = 2,
                 scheduler: Any = None, validate: bool = True, progress: bool = False,
                 layers_decompose: int | None = None,
                 on_step: Callable[[str], None] | None = None) -> PipelineResult:
    """Run the pipeline on one model into ``out``.

    Parameters
    ----------
    out : path
        Output folder (created; the pipeline's own files in it are replaced).
    model : str
        ``"default"`` (the bundled SmolLM2-135M-Instruct) or a transformers model directory.
    capture : path, optional
        An existing capture of every layer of ``model`` to calibrate on; by default ``tokens``
        tokens of pydoc are captured into ``out/capture.zarr``.
    tokens : int
        Calibration tokens captured (without ``capture``).
    budget : float
        Effective bits per element of the calibrated config, at ``prefill + decode`` tokens.
    prefill, decode, segments, offset : int
        Evaluation protocol on the held-out text (:func:`kverr.evaluation.evaluate`).
    eval_text : str, optional
        Held-out text file (default: :func:`heldout_text_path`).
    schemes : sequence of str
        Presets and peers evaluated beside the calibrated config.
    queries : int
        Calibration queries per layer.
    workers : int, optional
        Local threads scoring layers; ``scheduler``: a dask.distributed address to score on.
    validate : bool
        Run the calibrated config through the kernel path (layer 0) against the reference.
    progress : bool
        Show progress bars.
    layers_decompose : int, optional
        Decompose only the first this many layers (default: all).
    on_step : callable, optional
        Called with a one-line message as each step ends (the demo prints it); steps are
        logged at INFO level too.

    Returns
    -------
    PipelineResult
    """
    from kverr.calibration import CalibrationConfig, calibrate, check_model_matches, predict
    from kverr.engines import export
    from kverr.calibration.objective import check_queries
    from kverr.calibration.plots import plot_frontier
    from kverr.calibration.search import check_budget
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.config import atomic_write_text
    from kverr.error.xr import decompose_capture, layer_table
    from kverr.evaluation import evaluate, parse_schemes, plot_kl_vs_bits, segment_jobs, summarize_schemes
    from kverr.exceptions import ConfigError, TextError
    from kverr.io import check_output_path, open_capture
    from kverr.memory import model_shape

    t0 = time.perf_counter()
    out = Path(out)
    steps: list[str] = []

    def step(msg: str) -> None:
        line = f"[{time.perf_counter() - t0:6.1f} s] {msg}"
        steps.append(line)
        log.info("%s", line)
        if on_step is not None:
            on_step(line)

    # The pipeline refreshes its own files in out; that it is a writable folder is checked first.
    check_output_path(out / "summary.txt", overwrite=True, kind="file")
    # 0. every argument is checked before any work, so a bad one leaves no half-made outputs
    shape = model_shape(model)
    parse_schemes(list(schemes), config_option=None)  # the calibrated config joins them later
    context = prefill + decode
    settings = CalibrationConfig(budgets=(budget,), context=context, queries=queries)
    check_budget(budget, n_layers=shape.n_layers, n_kv=shape.n_kv_heads, head_dim=shape.head_dim,
                 context=context, context_from="--prefill + --decode", sliding_windows=shape.sliding_windows)
    if capture is None:
        check_queries(queries, tokens, "--queries")
    text = load_text("pydoc")
    try:
        held = load_text(eval_text or heldout_text_path())
    except TextError as exc:
        raise TextError(f"--eval-text: {exc}") from None
    loaded = load_model(model)
    ids = None
    if capture is None:
        ids = tokenize(loaded.tokenizer, text, tokens, 0)
        if loaded.max_context and tokens > loaded.max_context:
            raise ConfigError(f"--tokens {tokens} exceeds the model's context of {loaded.max_context} tokens")
    segment_jobs(loaded, held, prefill=[prefill], decode=decode, segments=segments, offset=offset)
    out.mkdir(parents=True, exist_ok=True)
    # 1. capture (or open)
    if capture is None:
        cap_path = out / "capture.zarr"
        capture_to_zarr(loaded, ids, cap_path, text=text, overwrite=True, progress=progress)
        cap = open_capture(cap_path)
        step(f"captured {tokens} tokens of pydoc, {loaded.n_layers} layers -> {cap_path}")
    else:
        cap_path = Path(capture)
        cap = open_capture(cap_path)
        check_queries(queries, cap.sizes["token"], "--queries")
        step(f"opened {cap_path} ({cap.sizes['token']} tokens, {cap.sizes['layer']} layers)")
    # 2. decompose (one preset, for the anatomy of the error)
    dec_layers = None if layers_decompose is None else [int(x) for x in cap["layer"].values][:layers_decompose]
    ds = decompose_capture(cap, "kivi-4", queries=64, layers=dec_layers, scheduler="synchronous")
    table = layer_table(ds)
    atomic_write_text(out / "decompose-kivi-4.txt", table + "\n")
    step("decomposed the error of kivi-4 per layer -> decompose-kivi-4.txt")
    # 3. calibrate
    cal = calibrate(cap, settings, scheduler=scheduler, workers=workers, progress=progress, model=loaded)
    cfg = cal.config
    check_model_matches(cfg, loaded.weights_sha256, loaded.model_id)
    cfg_path = cfg.save(out / f"calibrated-{budget:g}b.json")
    frontier = cal.searches[0].frontier
    atomic_write_text(out / "frontier.csv", frontier.to_csv(index=False))
    atomic_write_text(out / "choices.csv", cal.choices[budget].to_csv(index=False))
    plot_frontier(frontier, out / "frontier.png", marks={f"{budget:g} b": cfg.provenance["effective_bits"]},
                  ylabel="predicted next-token KL (nats)")
    step(f"calibrated at {budget:g} bits ({cfg.provenance['effective_bits']:.3f} effective at {context} "
         f"tokens) in {cal.seconds['score'] + cal.seconds['search']:.1f} s -> {cfg_path.name}")
    # 4. export
    exports: dict[str, str] = {}
    for fmt in ("vllm", "hf"):
        try:
            files = export(cfg, fmt, out / "export" / fmt, capture=cap, n_layers=loaded.n_layers,
                           n_kv=loaded.n_kv_heads, head_dim=loaded.head_dim, overwrite=True)
            exports[fmt] = f"wrote {', '.join(str(f) for f in files)}"
        except Exception as exc:  # noqa: BLE001 - a refusal is a result here
            exports[fmt] = f"refused: {exc}"
    exp_lines = [f"{fmt}: {what}" for fmt, what in exports.items()]
    atomic_write_text(out / "export.txt", "\n".join(exp_lines) + "\n")
    step("export: " + " | ".join(f"{fmt} {'refused' if what.startswith('refused') else 'ok'}"
                                 for fmt, what in exports.items()))
    # 5. evaluate on held-out text
    sch = parse_schemes(list(schemes), [str(cfg_path)], config_option=None)
    df = evaluate(loaded, held, sch, prefill=[prefill], decode=decode, segments=segments,
                  offset=offset, greedy_steps=0, progress=progress)
    summ = summarize_schemes(df)
    pred = {}
    for s in sch:
        if s.config is not None:
            pred[s.name] = predict(cap, s.config, queries=queries, weights=cal.sensitivity.weights_k,
                                   weights_v=cal.sensitivity.weights_v)["total"]
    summ["predicted"] = summ["scheme"].map(pred)
    atomic_write_text(out / "evaluate.segments.csv", df.to_csv(index=False))
    atomic_write_text(out / "evaluate.csv", summ.to_csv(index=False))
    plot_kl_vs_bits(summ, out / "evaluate.png")
    step(f"evaluated {len(sch)} schemes on {Path(held.source).name} (P={prefill}, N={decode}, "
         f"{segments} segment(s)) -> evaluate.csv")
    # 6. validate on the kernel path
    val_line = "validate: skipped"
    if validate:
        try:
            from kverr.validation import validate as kvalidate

            rep = kvalidate(cfg, cap, tokens=64, batch=1, steps=2, layers=[0])
            atomic_write_text(out / "validate.txt", rep.to_table() + "\n")
            val_line = (f"validate: kernel path == reference on layer 0: {'yes' if rep.ok else 'NO'} "
                        f"({'interpreter' if rep.interpreted else rep.device})")
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            val_line = f"validate: not run ({type(exc).__name__}: {exc})"
        step(val_line)
    cols = ["scheme", "effective_bits", "mean_kl", "p99_kl", "top1", "ppl_delta", "predicted"]
    source = f"{tokens} tokens of pydoc" if capture is None else f"{cap.sizes['token']} tokens of {cap_path.name}"
    lines = [
        f"kverr demo: {loaded.model_id}",
        f"calibrated on {source}; evaluated on held-out {Path(held.source).name}, "
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
    return PipelineResult(out=out, capture_path=cap_path, decomposition=table, calibration=cal, config=cfg,
                          config_path=cfg_path, exports=exports, evaluation=df, summary=summ,
                          validation=val_line, text=text_out, steps=steps)
