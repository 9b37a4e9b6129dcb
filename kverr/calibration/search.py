"""Calibration: score every candidate per (layer, kv head, K|V) on a capture, then solve the
knapsack under a budget in effective bits, per outer option, and build the config.

Effective bits are those :func:`kverr.memory.account` reports for the whole config at
``context`` tokens (batch 1): payload, scales, zero points, page rounding, alignment, sinks and
window included. They depend on the context length, which is recorded in the provenance.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kverr.config import CacheConfig, Override, check_model_matches  # noqa: F401 (re-exported)
from kverr.exceptions import CaptureError, ConfigError
from kverr.quant.formats import QuantFormat

from .candidates import OuterOption, candidates_for_budget, check_candidates, head_bytes, window_dtype_for_budget
from .knapsack import Frontier, solve
from .sensitivity import DEFAULT_TOKENS, NOISE_SITES, check_capture_model, sensitivity_for_capture
from .objective import (
    DEFAULT_DECODE,
    OBJECTIVE_DOC,
    OBJECTIVE_KL_DOC,
    OBJECTIVES,
    _layer_arrays,
    capture_positions_rope,
    check_queries,
    prepare_layer,
    score_layer,
)

log = logging.getLogger(__name__)

#: Model-wide (sinks, window) pairs tried by default, each with keys after and before RoPE: no
#: full-precision tokens, or 4 sinks with a window of 16, 32 or 64 recent tokens. Held out
#: (typing.py, P=1024, N=256, two segments), windows and pre-RoPE keys are what move the 4-bit
#: config from KL 0.0154 to 0.0037 and the 4.5-bit one to 0.0018; the full 2 x 4 x 2 grid chose
#: only these pairs (bench/results/calibrate-heldout-windows-2026-11-29.md; measured with the
#: earlier 72 candidates, before static scales were searched). Scoring pre- and
#: post-RoPE keys doubles the key-side work; `kverr calibrate` tries the pre-RoPE half by default
#: when the capture holds pre-RoPE keys (104 s instead of 152 s on two idle cores, default model,
#: 4096-token capture).
DEFAULT_SINKS_WINDOWS = ((0, 0), (4, 16), (4, 32), (4, 64))
#: The dtype calibrated configs keep their sinks, window and pending token blocks in: ``auto``,
#: int8 rows with an fp16 scale each (:func:`kverr.quant.formats.window_format`, D + 2 bytes a
#: row instead of fp16's 2 D) below :data:`~.candidates.INT8_WINDOW_BELOW_BITS`, fp16 from there
#: on (:func:`~.candidates.window_dtype_for_budget`). Held out, the int8 window lowered the 3-bit
#: config's KL by ~30 % and the 4.5-bit one's by ~12 % against fp16 on two validation texts, and
#: raised the 5-bit one's by ~30 % (README).
DEFAULT_WINDOW_DTYPE = "auto"
DEFAULT_OPTIONS = tuple(OuterOption(window=r, sinks=s_, key_pre_rope=pre)
                        for pre in (False, True) for s_, r in DEFAULT_SINKS_WINDOWS)


def outer_options(capture, key_rope: str | None = None, sinks=None, windows=None) -> list[OuterOption]:
    """The outer options `kverr calibrate` tries on ``capture``.

    ``key_rope`` is ``"post"``, ``"pre"`` or ``"both"``; by default ``"pre"`` when the capture
    holds pre-RoPE keys and RoPE parameters (pre-RoPE keys won at every budget on the default
    model, held out, at the same scoring cost), else ``"post"``. Without ``sinks`` and
    ``windows`` the (sinks, window) pairs are :data:`DEFAULT_SINKS_WINDOWS`; with either, their
    grid (a missing one is ``[0]``).
    """
    if key_rope is None:
        key_rope = "pre" if "k_pre" in capture and "rope" in capture.attrs else "post"
    pres = {"post": [False], "pre": [True], "both": [False, True]}[key_rope]
    if sinks is None and windows is None:
        pairs = list(DEFAULT_SINKS_WINDOWS)
    else:
        pairs = [(s_, r) for r in (windows or [0]) for s_ in (sinks or [0])]
    return [OuterOption(window=r, sinks=s_, key_pre_rope=p) for p in pres for s_, r in pairs]


@dataclass
class Scores:
    """Damage tables: ``k [option, layer, cand, kv_head]`` and ``v`` likewise (float64)."""

    k: np.ndarray
    v: np.ndarray
    layers: list[int]
    cands_k: tuple[QuantFormat, ...]
    cands_v: tuple[QuantFormat, ...]
    options: tuple[OuterOption, ...]
    queries: int
    window_dtype: str  # the dtype the cache received the candidates' input in
    cpu_seconds: float = 0.0
    decode: int | None = DEFAULT_DECODE

    def subset(self, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat]) -> Scores:
        """The tables of a subset of the candidates (in the order given)."""
        try:
            ik = [self.cands_k.index(f) for f in cands_k]
            iv = [self.cands_v.index(f) for f in cands_v]
        except ValueError:
            raise ConfigError("a subset's candidates must all have been scored") from None
        return Scores(self.k[:, :, ik], self.v[:, :, iv], self.layers, tuple(cands_k), tuple(cands_v),
                      self.options, self.queries, self.window_dtype, self.cpu_seconds, self.decode)


@dataclass
class Calibration:
    """Result of :func:`calibrate`.

    Attributes
    ----------
    config : CacheConfig
        The chosen config (provenance filled in).
    frontier : pandas.DataFrame
        The Pareto frontier over all outer options: ``option, effective_bits, bytes,
        predicted`` (+ ``window, sinks, key_pre_rope``), by increasing bits; ``predicted`` is in
        the objective's units (nats of next-token KL for ``objective="kl"``).
    choices : pandas.DataFrame
        One row per (layer, kv_head, which) of the chosen config: format label, bits, bytes,
        predicted damage.
    scores : Scores
        The full damage tables.
    """

    config: CacheConfig
    frontier: Any
    choices: Any
    scores: Scores
    frontiers: dict[OuterOption, Frontier] = field(default_factory=dict)
    context: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    objective: str = "kl"
    sensitivity: Any = None

    def config_at(self, budget_bits: float, name: str | None = None) -> CacheConfig:
        """The best config within another budget (no new scoring)."""
        return _build(self, budget_bits, name)


# --------------------------------------------------------------------------------------------
# scoring (parallel over layers)
# --------------------------------------------------------------------------------------------


_WORKER_CAPTURE: dict[str, Any] = {}


def _exit_with_parent(parent: int, interval: float = 0.5) -> None:
    """End this worker process soon after ``parent`` dies, however it died.

    A parent killed with SIGKILL cannot stop its workers; without this they would score on,
    orphaned, holding their memory. A daemon thread polls the parent id (portable, unlike
    Linux's PR_SET_PDEATHSIG, which also fires when the spawning *thread* ends).
    """
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="kverr-exit-with-parent", daemon=True).start()


def _init_worker(capture_path: str, threads: int, parent: int | None = None) -> None:
    """Per-process setup: exit with the parent, one torch thread and the capture opened once
    (not once per layer)."""
    import torch

    from kverr.io import open_capture

    if parent is not None:
        _exit_with_parent(parent)
    torch.set_num_threads(threads)
    _WORKER_CAPTURE["capture"] = open_capture(capture_path)


def _stop_workers(ex: ProcessPoolExecutor) -> None:
    """Terminate the workers of ``ex`` now (``shutdown(wait=True)`` would let each finish its
    layer first: minutes, after an error, Ctrl-C or SIGTERM)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for p in procs:
        p.terminate()
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(timeout=5)


def _score_one(args) -> tuple[int, np.ndarray, np.ndarray, float]:
    import time

    import torch

    capture, layer, cands_k, cands_v, options, queries, page_size, window_dtype, threads, decode = args
    t0 = time.process_time()
    if threads:
        torch.set_num_threads(threads)
    if capture is None:
        capture = _WORKER_CAPTURE["capture"]
    elif isinstance(capture, (str, Path)):
        from kverr.io import open_capture

        capture = open_capture(capture)
    need_pre = any(o.key_pre_rope for o in options)
    q, k, v, kp, scale, kv_map = _layer_arrays(capture, layer, need_pre)
    positions, rope = capture_positions_rope(capture)
    prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=queries,
                         positions=positions, rope=rope, decode=decode)
    dk, dv = score_layer(prep, cands_k, cands_v, options, page_size=page_size, window_dtype=window_dtype)
    return layer, dk, dv, time.process_time() - t0


def score(capture: Any, *, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat],
          options: Sequence[OuterOption], window_dtype: str, queries: int = 64, page_size: int = 64,
          workers: int = 1, progress: bool = False,
          capture_path: str | os.PathLike | None = None, meanwhile=None,
          decode: int | None = DEFAULT_DECODE) -> Scores:
    """Damage of every candidate for every (option, layer, kv head), K and V.

    With ``workers > 1`` and a ``capture_path``, layers are scored by that many processes, each
    opening the capture once and running one torch thread; every layer is computed the same way
    whichever process takes it, so the tables do not depend on ``workers``. ``meanwhile``, a
    callable, runs in this process while the workers score (before scoring when serial).
    """
    from kverr.dims import LAYER
    from kverr.progress import progress as progress_bar

    layers = [int(x) for x in capture[LAYER].values]
    n_kv = capture.sizes["kv_head"]
    dk = np.empty((len(options), len(layers), len(cands_k), n_kv))
    dv = np.empty((len(options), len(layers), len(cands_v), n_kv))
    parallel = workers > 1 and len(layers) > 1 and capture_path is not None
    src = None if parallel else capture
    jobs = [(src, l, tuple(cands_k), tuple(cands_v), tuple(options), queries, page_size,
             window_dtype, 0, decode) for l in layers]
    bar = progress_bar(total=len(layers), desc="calibrate: score layers", unit="layer", enabled=progress)
    pos = {l: i for i, l in enumerate(layers)}
    cpu = 0.0
    if parallel:
        import multiprocessing as mp

        from concurrent.futures import as_completed

        ex = ProcessPoolExecutor(max_workers=min(workers, len(layers)), mp_context=mp.get_context("spawn"),
                                 initializer=_init_worker, initargs=(str(capture_path), 1, os.getpid()))
        try:
            # Dearest layers are not known in advance; submit in order, collect as they finish.
            futs = [ex.submit(_score_one, job) for job in jobs]
            if meanwhile is not None:
                meanwhile()

            for fut in as_completed(futs):
                layer, a, b, c = fut.result()
                dk[:, pos[layer]], dv[:, pos[layer]] = a, b
                cpu += c
                bar.update()
        except BaseException:
            _stop_workers(ex)
            bar.close()
            raise
        ex.shutdown()
    else:
        if meanwhile is not None:
            meanwhile()
        for job in jobs:
            layer, a, b, c = _score_one(job)
            dk[:, pos[layer]], dv[:, pos[layer]] = a, b
            cpu += c
            bar.update()
    bar.close()
    log.info("scored %d layers: %.1f s CPU in the scoring processes", len(layers), cpu)
    return Scores(dk, dv, layers, tuple(cands_k), tuple(cands_v), tuple(options), int(queries), window_dtype,
                  cpu, decode)


# --------------------------------------------------------------------------------------------
# search
# --------------------------------------------------------------------------------------------


def _groups(scores: Scores, opt_i: int, n_kv: int, weights: tuple[np.ndarray, np.ndarray] | None = None):
    """Groups in a fixed order: for each layer, for each kv head, K then V; damage times the
    layer's key or value weight when ``weights = (w_k [layer], w_v [layer])`` are given."""
    keys, dmg = [], []
    for li, layer in enumerate(scores.layers):
        wk, wv = (1.0, 1.0) if weights is None else (float(weights[0][layer]), float(weights[1][layer]))
        for h in range(n_kv):
            keys.append((layer, h, "k"))
            dmg.append(scores.k[opt_i, li, :, h] * wk)
            keys.append((layer, h, "v"))
            dmg.append(scores.v[opt_i, li, :, h] * wv)
    return keys, dmg


def _costs(cands, opt, head_dim, context, page_size, window_dtype, align) -> np.ndarray:
    return np.array([head_bytes(f, opt, head_dim, context, page_size, window_dtype, align) for f in cands],
                    dtype=np.int64)


def bits_of(nbytes: int, n_layers: int, n_kv: int, head_dim: int, context: int) -> float:
    return 8.0 * nbytes / (2 * n_layers * n_kv * head_dim * context)


def check_budget(
    budget_bits: float,
    *,
    n_layers: int,
    n_kv: int,
    head_dim: int,
    context: int,
    options: Sequence[OuterOption] = DEFAULT_OPTIONS,
    cands_k: Sequence[QuantFormat] | None = None,
    cands_v: Sequence[QuantFormat] | None = None,
    page_size: int = 64,
    window_dtype: str = DEFAULT_WINDOW_DTYPE,
    align: int = 16,
    context_from: str | None = None,
) -> tuple[str, tuple[QuantFormat, ...], tuple[QuantFormat, ...]]:
    """Check, from the model's shape alone, that :func:`calibrate` can meet ``budget_bits``.

    Everything here is known before a capture is read, so callers (``kverr demo``) can refuse a
    budget before any work; :func:`calibrate` runs the same check.

    Parameters
    ----------
    budget_bits : float
        Effective bits per element at ``context`` tokens.
    n_layers, n_kv, head_dim : int
        The model's shape.
    context : int
        Tokens at which effective bits are counted.
    options, cands_k, cands_v, page_size, window_dtype, align
        As in :func:`calibrate` (candidates default to those of the budget).
    context_from : str, optional
        Where ``context`` came from, for the error message (e.g. "the capture's length").

    Returns
    -------
    tuple
        ``(window_dtype, cands_k, cands_v)`` resolved for this budget.

    Raises
    ------
    ConfigError
        A budget that is not a positive number, candidates that do not fit the head dim, an
        option whose sinks and window cover the whole context, or a budget below the cheapest
        possible config.
    """
    if not (isinstance(budget_bits, (int, float)) and math.isfinite(budget_bits) and budget_bits > 0):
        raise ConfigError(f"budget_bits={budget_bits!r} must be a positive number of bits")
    options = tuple(options)
    if not options:
        raise ConfigError("give at least one outer option")
    window_dtype = window_dtype_for_budget(budget_bits, window_dtype)
    cands_k = tuple(cands_k or candidates_for_budget(budget_bits, head_dim))
    cands_v = tuple(cands_v or candidates_for_budget(budget_bits, head_dim))
    check_candidates(cands_k, head_dim, page_size, "key")
    check_candidates(cands_v, head_dim, page_size, "value")
    for o in options:
        CacheConfig(k=cands_k[0], v=cands_v[0], window=o.window, sinks=o.sinks,
                    key_pre_rope=o.key_pre_rope, page_size=page_size).check_model(n_layers, n_kv, head_dim)
        if o.sinks + o.window > context:
            raise ConfigError(
                f"option {o.label()}: {o.sinks} sink + {o.window} window tokens = {o.sinks + o.window} "
                f"full-precision tokens, more than the {context} tokens at which effective bits are counted "
                f"({context_from or 'the context'}): nothing would be quantized; count at a longer "
                "context or try fewer sinks and a smaller window"
            )
    # Infeasible budgets are refused before any scoring work.
    cheapest = min(
        sum(int(min(_costs(c, o, head_dim, context, page_size, window_dtype, align))) for c in (cands_k, cands_v))
        * n_layers * n_kv for o in options
    )
    cheapest_bits = bits_of(cheapest, n_layers, n_kv, head_dim, context)
    budget_bytes = math.floor(budget_bits * 2 * n_layers * n_kv * head_dim * context / 8 + 1e-9)
    if budget_bytes < cheapest:
        raise ConfigError(
            f"budget of {budget_bits:g} effective bits is infeasible at {context} tokens: the "
            f"cheapest possible config costs {cheapest_bits:.4f} effective bits ({cheapest} bytes)"
        )
    return window_dtype, cands_k, cands_v


def calibrate(
    capture: Any,
    budget_bits: float,
    *,
    context: int | None = None,
    options: Sequence[OuterOption] = DEFAULT_OPTIONS,
    cands_k: Sequence[QuantFormat] | None = None,
    cands_v: Sequence[QuantFormat] | None = None,
    queries: int = 64,
    page_size: int = 64,
    window_dtype: str = DEFAULT_WINDOW_DTYPE,
    align: int = 16,
    max_bits: float = 8.0,
    workers: int = 1,
    progress: bool = False,
    capture_path: str | os.PathLike | None = None,
    name: str | None = None,
    scores: Scores | None = None,
    objective: str = "kl",
    sensitivity: Any = None,
    model: Any = None,
    sensitivity_tokens: int | None = None,
    sensitivity_noise: str = "o_proj",
    decode: int | None = DEFAULT_DECODE,
) -> Calibration:
    """Choose a format per (layer, kv head, K|V) minimising the predicted damage within a budget.

    Parameters
    ----------
    capture : xarray.Dataset
        A capture of *every* layer of the model (:func:`kverr.io.open_capture`).
    budget_bits : float
        Effective bits per cached element, metadata, sinks and window included, at ``context``.
    context : int, optional
        Tokens at which effective bits are counted (default: the capture's length).
    options : sequence of OuterOption
        Model-wide sinks / window / pre-RoPE keys to try; the best under the budget wins.
    cands_k, cands_v : sequence of QuantFormat, optional
        Candidates (default :func:`~.candidates.candidates_for_budget`: static per-channel
        scales only below 3.5 bits; the frontier is that of this budget's set).
    queries : int
        Sampled query positions per layer for the objective.
    window_dtype : str
        What the config keeps its sinks, window and pending token blocks in: ``"auto"``
        (:func:`~.candidates.window_dtype_for_budget` of ``budget_bits``: int8 rows at low
        budgets, fp16 at high ones), ``"int8"`` or a float dtype. The cache receives every token
        in it, so the candidates are scored on the values it leaves; the frontier and every
        config taken from this calibration use it.
    max_bits : float
        The frontier is computed up to ``max(max_bits, budget_bits)`` effective bits.
    workers : int
        Processes scoring layers in parallel (needs ``capture_path``).
    scores : Scores, optional
        Reuse earlier damage tables (same candidates, options and ``decode``).
    objective : {"kl", "rel"}
        ``"kl"``: predicted next-token KL, each layer's relative error weighted by its measured
        sensitivity (:mod:`.sensitivity`); ``"rel"``: relative errors summed with equal weights.
    sensitivity : Sensitivity, optional
        Reuse a measured sensitivity (``"kl"`` only); otherwise it is measured with the
        capture's model (or ``model``: a spec or a LoadedModel, which must be the capture's),
        on the capture's first ``sensitivity_tokens`` tokens, while the workers score, with noise
        at the ``o_proj`` input (``sensitivity_noise="o_proj"``: one weight per layer) or in the
        cached keys and values (``"kv"``: a weight per layer and side, sparing the options'
        largest number of sinks); see :mod:`.sensitivity`.
    decode : int or None
        The token policy the objective models: a prompt quantized whole at prefill, then this many
        decode steps whose window holds only the newest generated tokens (the protocol of
        ``kverr evaluate``); None lets every query's window hold its most recent tokens.
    """
    import time

    import pandas as pd

    t0 = time.perf_counter()
    _check_capture(capture)
    n_layers_model = int(capture.attrs.get("model_n_layers", capture.sizes["layer"]))
    layers = [int(x) for x in capture["layer"].values]
    if layers != list(range(n_layers_model)):
        raise CaptureError(
            f"calibration needs every layer of the model; the capture has layers {layers} of "
            f"{n_layers_model} (recapture with --layers all)"
        )
    n_kv, head_dim, n_tok = capture.sizes["kv_head"], capture.sizes["channel"], capture.sizes["token"]
    given_context = bool(context)
    context = int(context or n_tok)
    if context < 1:
        raise ConfigError(f"context={context} must be a positive number of tokens")
    if not (isinstance(max_bits, (int, float)) and math.isfinite(max_bits) and max_bits > 0):
        raise ConfigError(f"max_bits={max_bits!r} must be a finite positive number of bits")
    check_queries(queries, n_tok)
    options = tuple(options)
    if not options or len(set(options)) != len(options):
        raise ConfigError("give at least one outer option, without duplicates")
    if any(o.key_pre_rope for o in options) and "k_pre" not in capture:
        raise CaptureError("a pre-RoPE option was asked for but the capture has no k_pre")
    if decode is not None and (isinstance(decode, bool) or not isinstance(decode, int) or decode < 1):
        raise ConfigError(f"decode={decode!r} must be a positive number of decode steps, or None")
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} is not known; use one of {sorted(OBJECTIVES)}")
    if sensitivity_noise not in NOISE_SITES:
        raise ConfigError(f"sensitivity_noise={sensitivity_noise!r} is not known; use one of {', '.join(NOISE_SITES)}")
    if objective == "rel" and sensitivity is not None:
        raise ConfigError("a sensitivity was given but objective='rel' does not use one")
    window_dtype, cands_k, cands_v = check_budget(
        budget_bits, n_layers=n_layers_model, n_kv=n_kv, head_dim=head_dim, context=context, options=options,
        cands_k=cands_k, cands_v=cands_v, page_size=page_size, window_dtype=window_dtype, align=align,
        context_from=None if given_context else f"the capture's length, {n_tok} tokens")
    from kverr.io import check_finite

    # A NaN or Inf would surface only after scoring, as a knapsack error that names no tensor.
    check_finite(capture, ("q", "k", "v") + (("k_pre",) if any(o.key_pre_rope for o in options) else ()))
    sens_box: dict[str, Any] = {"s": sensitivity}

    def _measure() -> None:
        ts, tc = time.perf_counter(), time.process_time()
        sens_box["s"] = sensitivity_for_capture(capture, model=model, tokens=sensitivity_tokens or DEFAULT_TOKENS,
                                                noise=sensitivity_noise, sinks=max(o.sinks for o in options),
                                                threads=1, progress=progress)
        sens_box["t"], sens_box["cpu"] = time.perf_counter() - ts, time.process_time() - tc

    need_sens = objective == "kl" and sensitivity is None
    if need_sens:
        from kverr.progress import progress as progress_bar

        tl = time.perf_counter()
        # a bar of one step: loading the model takes ~20 s before any other bar can move
        with progress_bar(total=1, desc="calibrate: load the model", unit="model", enabled=progress) as bar:
            model = check_capture_model(capture, model)  # load once; refuse before any scoring work
            bar.update()
        sens_box["load"] = time.perf_counter() - tl
    if scores is None:
        scores = score(capture, cands_k=cands_k, cands_v=cands_v, options=options, queries=queries,
                       page_size=page_size, window_dtype=window_dtype, workers=workers,
                       progress=progress, capture_path=capture_path, meanwhile=_measure if need_sens else None,
                       decode=decode)
    else:
        if scores.decode != decode:
            raise ConfigError(f"the scores were computed with decode={scores.decode}, not {decode}")
        if scores.window_dtype != window_dtype:
            raise ConfigError(f"the scores were computed with window_dtype={scores.window_dtype!r}, "
                              f"not {window_dtype!r}")
        if need_sens:
            _measure()
    sensitivity = sens_box["s"]
    weights = None
    if objective == "kl":
        weights = tuple(np.asarray(w, dtype=np.float64) for w in (sensitivity.weights_k, sensitivity.weights_v))
        if any(w.shape != (n_layers_model,) or not np.all(np.isfinite(w)) or np.any(w < 0) for w in weights):
            raise ConfigError(f"the sensitivity must hold {n_layers_model} finite non-negative layer weights per side")
    t1 = time.perf_counter()
    max_bytes = math.ceil(max(max_bits, budget_bits) * 2 * n_layers_model * n_kv * head_dim * context / 8)
    frontiers: dict[OuterOption, Frontier] = {}
    rows = []
    for oi, opt in enumerate(options):
        keys, dmg = _groups(scores, oi, n_kv, weights)
        ck = _costs(cands_k, opt, head_dim, context, page_size, window_dtype, align)
        cv = _costs(cands_v, opt, head_dim, context, page_size, window_dtype, align)
        costs = [ck if w == "k" else cv for (_, _, w) in keys]
        fr = solve(costs, dmg, max_cost=max_bytes)
        frontiers[opt] = fr
        for i in range(len(fr.cost)):
            rows.append(dict(option=opt.label(), window=opt.window, sinks=opt.sinks,
                             key_pre_rope=opt.key_pre_rope, bytes=int(fr.cost[i]),
                             effective_bits=bits_of(int(fr.cost[i]), n_layers_model, n_kv, head_dim, context),
                             predicted=float(fr.damage[i]), index=i))
    allf = pd.DataFrame(rows).sort_values(["bytes", "predicted"], kind="stable").reset_index(drop=True)
    pareto = allf[allf["predicted"] < allf["predicted"].cummin().shift(fill_value=np.inf)]
    t2 = time.perf_counter()
    cal = Calibration(
        config=None, frontier=pareto.reset_index(drop=True), choices=None, scores=scores,  # type: ignore[arg-type]
        frontiers=frontiers, context=context,
        seconds={"score": t1 - t0, "search": t2 - t1, "sensitivity": sens_box.get("t", 0.0),
                 "model_load": sens_box.get("load", 0.0), "sensitivity_cpu": sens_box.get("cpu", 0.0)},
        objective=objective, sensitivity=sensitivity,
    )
    cal._weights = weights
    cal._meta = dict(n_layers=n_layers_model, n_kv=n_kv, head_dim=head_dim, page_size=page_size,
                     window_dtype=window_dtype, align=align, capture=_capture_provenance(capture))
    cal.config = _build(cal, budget_bits, name)
    return cal


def _build(cal: Calibration, budget_bits: float, name: str | None) -> CacheConfig:
    import pandas as pd

    m = cal._meta
    n_layers, n_kv, D = m["n_layers"], m["n_kv"], m["head_dim"]
    budget_bytes = math.floor(budget_bits * 2 * n_layers * n_kv * D * cal.context / 8 + 1e-9)
    fr_all = cal.frontier
    ok = fr_all[fr_all["bytes"] <= budget_bytes]
    if ok.empty:
        cheapest = int(fr_all["bytes"].min())
        raise ConfigError(
            f"budget of {budget_bits:g} effective bits is infeasible at {cal.context} tokens: the "
            f"cheapest possible config costs {bits_of(cheapest, n_layers, n_kv, D, cal.context):.4f} "
            f"effective bits ({cheapest} bytes)"
        )
    row = ok.iloc[-1]
    opt = next(o for o in cal.frontiers if o.label() == row["option"])
    oi = list(cal.frontiers).index(opt)
    fr = cal.frontiers[opt]
    pick = fr.choices[int(row["index"])]
    weights = getattr(cal, "_weights", None)
    keys, _ = _groups(cal.scores, oi, n_kv)
    sc = cal.scores
    chosen: dict[tuple[int, int, str], QuantFormat] = {}
    recs = []
    for (layer, h, w), j in zip(keys, pick):
        cands = sc.cands_k if w == "k" else sc.cands_v
        f = cands[int(j)]
        chosen[(layer, h, w)] = f
        li = sc.layers.index(layer)
        rel = float((sc.k if w == "k" else sc.v)[oi, li, int(j), h])
        d = rel * (1.0 if weights is None else float(weights[0 if w == "k" else 1][layer]))
        b = head_bytes(f, opt, D, cal.context, m["page_size"], m["window_dtype"], m["align"])
        recs.append(dict(layer=layer, kv_head=h, which=w, format=f.label(), dtype=f.dtype, bits=f.bits,
                         granularity=f.granularity.kind, rotate=f.rotate, clip=f.clip.kind,
                         bytes=b, predicted=float(d), relative=rel))
    choices = pd.DataFrame(recs)
    default = {w: Counter(f for (_, _, ww), f in sorted(chosen.items(), key=lambda kv: kv[0]) if ww == w)
               for w in ("k", "v")}
    dk = max(default["k"].items(), key=lambda kv: kv[1])[0]
    dv = max(default["v"].items(), key=lambda kv: kv[1])[0]
    heads = {}
    for layer in range(n_layers):
        for h in range(n_kv):
            fk, fv = chosen[(layer, h, "k")], chosen[(layer, h, "v")]
            ov = Override(k=None if fk == dk else fk, v=None if fv == dv else fv)
            if ov.k is not None or ov.v is not None:
                heads[(layer, h)] = ov
    bits = bits_of(int(row["bytes"]), n_layers, n_kv, D, cal.context)
    prov = {
        "tool": "kverr calibrate",
        "capture": m["capture"],
        "budget_bits": float(budget_bits),
        "effective_bits": bits,
        "bytes": int(row["bytes"]),
        "context_tokens": cal.context,
        "batch": 1,
        "objective": OBJECTIVES[cal.objective],
        "objective_definition": OBJECTIVE_KL_DOC if cal.objective == "kl" else OBJECTIVE_DOC,
        "predicted_damage": float(row["predicted"]),
        "predicted_relative": float(choices["relative"].sum()),
        "predicted_k": float(choices.loc[choices.which == "k", "predicted"].sum()),
        "predicted_v": float(choices.loc[choices.which == "v", "predicted"].sum()),
        "queries_per_layer": sc.queries,
        "decode_steps": sc.decode,
        "outer_option": opt.label(),
        "outer_options_tried": [o.label() for o in sc.options],
        "candidates_k": len(sc.cands_k),
        "candidates_v": len(sc.cands_v),
        "knapsack": {"unit_bytes": fr.unit, "exact": fr.exact},
    }
    if cal.objective == "kl":
        prov["sensitivity"] = cal.sensitivity.to_dict()
    cfg = CacheConfig(
        k=dk, v=dv, window=opt.window, sinks=opt.sinks, key_pre_rope=opt.key_pre_rope,
        page_size=m["page_size"], window_dtype=m["window_dtype"], align=m["align"], heads=heads,
        name=name or f"calibrated-{budget_bits:g}b", provenance=prov,
    )
    cal.choices = choices
    return cfg


def _check_capture(capture: Any) -> None:
    import xarray as xr

    if not isinstance(capture, xr.Dataset):
        raise CaptureError(f"capture must be an xarray.Dataset, got {type(capture).__name__}")
    for n in ("q", "k", "v"):
        if n not in capture.data_vars:
            raise CaptureError(f"the capture lacks the variable {n!r}")
    if "kv_head_of_q" not in capture.coords:
        raise CaptureError("the capture lacks the coordinate 'kv_head_of_q'")
    if "sliding_window" in capture.coords and np.any(np.asarray(capture["sliding_window"].values) > 0):
        raise CaptureError("the capture has sliding-window layers; calibration supports full causal attention")


def _capture_provenance(capture: Any) -> dict[str, Any]:
    a = capture.attrs
    return {
        "model_id": str(a.get("model_id", "")),
        "weights_sha256": str(a.get("weights_sha256", "")),
        "text_source": str(a.get("text_source", "")),
        "text_sha256": str(a.get("text_sha256", "")),
        "token_offset": int(a.get("token_offset", 0)),
        "tokens": int(capture.sizes["token"]),
        "created_utc": str(a.get("created_utc", "")),
        # the model's shape, so that a config is refused on another model (check_model_matches)
        "n_layers": int(a.get("model_n_layers", capture.sizes["layer"])),
        "n_kv_heads": int(capture.sizes["kv_head"]),
        "head_dim": int(capture.sizes["channel"]),
    }
