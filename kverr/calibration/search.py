"""Calibration: score every candidate per (layer, kv head, K|V) on a capture, then solve the
knapsack under a budget in effective bits, per outer option, and build the config.

:func:`calibrate` takes the capture and a :class:`~.config.CalibrationConfig` and returns a
:class:`Calibration`. Layers are scored by dask, one task per layer (:func:`score`), on local
threads or a dask.distributed cluster: the engine :func:`kverr.error.decompose_capture` uses.
Threads, not processes, by default: torch releases the GIL in the scoring work, so two threads
score as fast as two processes without starting any, and a killed calibration leaves nothing
running.

Effective bits are those :func:`kverr.memory.account` reports for the whole config at
``context`` tokens for ``batch`` sequences (default 1; static bytes counted once for them all):
payload, scales, zero points, page rounding, alignment, sinks and window included. They depend on
the context length and the batch, which are recorded in the provenance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kverr.catalog import codebook_candidates
from kverr.config import CacheConfig, Override, check_model_matches  # noqa: F401 (re-exported)
from kverr.exceptions import CaptureError, ConfigError
from kverr.quant.compensated import KeyMoments
from kverr.quant.formats import QuantFormat

from .candidates import (
    DEFAULT_WINDOW_DTYPE,
    OuterOption,
    candidate_set,
    candidates_for_budget,
    NESTED_SETS,
    check_candidates,
    head_bytes,
    named_candidates,
    window_dtype_for_budget,
)
from .config import CalibrationConfig
from .knapsack import Frontier, layer_items, solve
from .objective import (
    DEFAULT_DECODE,
    OBJECTIVE_DOC,
    OBJECTIVE_KL_DOC,
    OBJECTIVES,
    capture_key_moments,
    check_queries,
    prepare_layer,
    score_layer,
)
from .sensitivity import Sensitivity, check_capture_model, sensitivity_for_capture

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
    import kverr.accessor  # noqa: F401  (registers ds.kv)

    if key_rope is None:
        key_rope = "pre" if "k_pre" in capture and capture.kv.rope is not None else "post"
    pres = {"post": [False], "pre": [True], "both": [False, True]}[key_rope]
    if sinks is None and windows is None:
        pairs = list(DEFAULT_SINKS_WINDOWS)
    else:
        pairs = [(s_, r) for r in (windows or [0]) for s_ in (sinks or [0])]
    return [OuterOption(window=r, sinks=s_, key_pre_rope=p) for p in pres for s_, r in pairs]


@dataclass(frozen=True)
class WindowsPerHead:
    """Outer options that differ only in their window, searched as one
    (:attr:`CalibrationConfig.window_per_head`): each (layer, kv head, K|V) picks one of them
    with its format. A frontier choice ``j`` of a group whose side has ``n`` candidates is
    candidate ``j % n`` under ``options[j // n]``."""

    options: tuple[OuterOption, ...]

    def label(self) -> str:
        first = self.options[0].label()
        return first.replace(f"/R{self.options[0].window}/", f"/R{'|'.join(str(o.window) for o in self.options)}/", 1)

    def member(self, choice: int, n_candidates: int) -> tuple[OuterOption, int]:
        """The option and candidate index a frontier choice stands for."""
        return self.options[choice // n_candidates], choice % n_candidates


def calibration_options(capture: Any, cfg: CalibrationConfig) -> tuple[OuterOption, ...]:
    """The outer options a calibration with ``cfg`` scores: ``cfg.options``, or those of
    :func:`outer_options` for its RoPE side, sinks and windows; each keeping ``cfg``'s salient
    tokens."""
    options = cfg.options or tuple(outer_options(capture, cfg.key_rope, cfg.sinks, cfg.windows))
    if cfg.salient:
        options = tuple(dataclasses.replace(o, salient=cfg.salient, salient_sides=cfg.salient_sides,
                                            salient_recent=cfg.salient_recent) for o in options)
    return options


def window_families(options: Sequence[OuterOption]) -> list[WindowsPerHead]:
    """The options that differ only in their window, grouped (two or more lengths each), by
    increasing window within a group."""
    by: dict[OuterOption, list[OuterOption]] = {}
    for o in options:
        by.setdefault(dataclasses.replace(o, window=0), []).append(o)
    return [WindowsPerHead(tuple(sorted(g, key=lambda o: o.window))) for g in by.values() if len(g) > 1]


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
    #: fitted widths of the template candidates (``channel_bits``): ``widths_k [side, layer, cand_k,
    #: kv_head, channel]`` (side 0 post-RoPE keys, 1 pre-RoPE), ``widths_v [layer, cand_v, kv_head,
    #: channel]``; None when no candidate is a template
    widths_k: np.ndarray | None = None
    widths_v: np.ndarray | None = None
    #: key candidates scored rounded with compensation (:attr:`CalibrationConfig.compensated_keys`)
    compensated_keys: bool = False
    #: ... and with decode steps, the generated keys too (:attr:`CalibrationConfig.static_moments`);
    #: else those to nearest (:func:`~.objective.rounds_generated_apart`)
    static_moments: bool = False

    def format_of(self, which: str, option: OuterOption, layer: int, cand: int, kv_head: int) -> QuantFormat:
        """The format candidate ``cand`` stands for at (``layer``, ``kv_head``, ``which``) under
        ``option``: the candidate, or for a template its fitted widths."""
        f = (self.cands_k if which == "k" else self.cands_v)[cand]
        if f.channel_bits is None:
            return f
        li = self.layers.index(layer)
        bits = (self.widths_k[int(option.key_pre_rope), li, cand, kv_head] if which == "k"
                else self.widths_v[li, cand, kv_head])
        return dataclasses.replace(f, channel_bits=tuple(int(b) for b in bits))  # bits: their largest

    @classmethod
    def mean(cls, tables: Sequence[Scores]) -> Scores:
        """The tables of several captures scored alike, averaged with the captures counting alike.

        Each entry of a capture's table is a candidate's damage relative to the layer's output on
        that capture, over its sampled queries; the mean is the damage a format is expected to do
        on a text drawn from the captures' texts, one text as likely as another. Fitted widths of
        template candidates are the first capture's (the configs are served with their widths
        refit on each prompt: :attr:`CalibrationConfig.refit_widths`); CPU seconds are summed.
        """
        tables = list(tables)
        if not tables:
            raise ConfigError("give at least one capture's scores to average")
        first = tables[0]
        same = ("layers", "cands_k", "cands_v", "options", "queries", "window_dtype", "decode",
                "compensated_keys", "static_moments")
        for t in tables[1:]:
            differ = [n for n in same if getattr(t, n) != getattr(first, n)]
            if differ or t.k.shape != first.k.shape or t.v.shape != first.v.shape:
                raise ConfigError(f"scores averaged over captures must be computed alike; these differ in "
                                  f"{', '.join(differ) or 'the tables shape'}")
        return dataclasses.replace(first, k=np.mean([t.k for t in tables], axis=0),
                                   v=np.mean([t.v for t in tables], axis=0),
                                   cpu_seconds=float(sum(t.cpu_seconds for t in tables)))

    def subset(self, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat]) -> Scores:
        """The tables of a subset of the candidates (in the order given)."""
        try:
            ik = [self.cands_k.index(f) for f in cands_k]
            iv = [self.cands_v.index(f) for f in cands_v]
        except ValueError:
            raise ConfigError("a subset's candidates must all have been scored") from None
        return Scores(self.k[:, :, ik], self.v[:, :, iv], self.layers, tuple(cands_k), tuple(cands_v),
                      self.options, self.queries, self.window_dtype, self.cpu_seconds, self.decode,
                      None if self.widths_k is None else self.widths_k[:, :, ik],
                      None if self.widths_v is None else self.widths_v[:, iv], self.compensated_keys,
                      self.static_moments)


@dataclass(frozen=True)
class Search:
    """One knapsack search: the frontier of one window dtype and candidate set, and its configs.

    Attributes
    ----------
    window_dtype : str
        What the searched configs keep their sinks, window and pending tokens in.
    candidates : str
        The candidate set searched: ``"all"``, ``"dynamic"``, ``"fitted"``
        (:func:`~.candidates.candidate_set`), each with ``"+codebooks"`` when the codebook
        candidates were added, or ``"custom"`` (explicit candidates for keys and values).
    budgets : tuple of float
        The budgets of the calibration this search chose configs for.
    scores : Scores
        The damage tables searched.
    frontier : pandas.DataFrame
        The Pareto frontier over all outer options: ``option, window, sinks, key_pre_rope,
        bytes, effective_bits, predicted, index``, by increasing bytes; ``predicted`` is in the
        objective's units (nats of next-token KL for ``objective="kl"``). A
        :class:`WindowsPerHead` point's ``window`` is the longest its heads may keep.
    frontiers : dict of OuterOption or WindowsPerHead to Frontier
        The knapsack frontier of each outer option (and with ``window_per_head``, of each
        :func:`window_families` group).
    weights : tuple of numpy.ndarray or None
        ``(w_k [layer], w_v [layer])`` the damage was weighted by (None: ``objective="rel"``).
    sensitivity : Sensitivity or None
        The measured sensitivity the weights come from.
    shape : kverr.memory.ModelShape
        The model's layer count, kv heads and head dim.
    context, page_size, align : int
        Tokens at which effective bits are counted; the configs' page size and alignment.
    objective : str
        ``"kl"`` or ``"rel"``.
    capture : dict
        The capture's provenance (``ds.kv.provenance``), as recorded in the configs.
    seconds : dict of str to float
        Wall time of this search's ``score`` (0 when its tables were reused) and ``search``.
    max_groups_per_layer : int or None
        The bound on distinct (K, V) format pairs per layer the search obeyed (None: none).
    """

    window_dtype: str
    candidates: str
    budgets: tuple[float, ...]
    scores: Scores
    frontier: Any
    frontiers: dict[OuterOption | WindowsPerHead, Frontier]
    weights: tuple[np.ndarray, np.ndarray] | None
    sensitivity: Any
    shape: Any
    context: int
    page_size: int
    align: int
    objective: str
    capture: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    max_groups_per_layer: int | None = None
    batch: int = 1  # sequences the bytes are counted for (static bytes once)
    refit_widths: bool = False  # each sequence's width tables counted (CalibrationConfig.refit_widths)
    #: static moments (CalibrationConfig.static_moments): the capture's query moments every config
    #: carries, counted in the frontier's bytes
    key_moments: KeyMoments | None = None
    #: every calibration capture's provenance when there were several (``capture`` is the first's)
    captures: tuple[dict[str, Any], ...] = ()
    #: with several captures, each one's damage tables (``scores`` is their mean), so that a
    #: config's predicted damage is known on each; empty otherwise or when the scores were given
    scores_each: tuple[Scores, ...] = ()

    def config_at(self, budget_bits: float, name: str | None = None) -> CacheConfig:
        """The best config of this search within ``budget_bits`` (no new scoring)."""
        return _build(self, budget_bits, name)[0]

    def step_times(self, tokens: int | None = None, batch: int = 1, gpu: str = "h200") -> np.ndarray:
        """Every frontier point's predicted decode step (:mod:`kverr.cost`, CUDA graphs) over
        fp16's, at ``tokens`` (default: the calibration context) x ``batch`` on ``gpu``; in the
        order of :attr:`frontier`'s rows. Builds and plans each point's config."""
        from kverr.cost import fp16_step, step_cost

        t = tokens or self.context
        ref = fp16_step(self.shape, t, batch, gpu).seconds(True)
        out = np.empty(len(self.frontier))
        for i, (_, row) in enumerate(self.frontier.iterrows()):
            cfg = _build_row(self, row, float(row["effective_bits"]), None)[0]
            out[i] = step_cost(cfg, self.shape, t, batch, gpu).seconds(True) / ref
        return out

    def choices_at(self, budget_bits: float) -> Any:
        """One row per (layer, kv_head, which) of :meth:`config_at`'s config: format label,
        dtype, bits, granularity, rotate, clip, bytes, predicted and relative damage."""
        return _build(self, budget_bits, None)[1]


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`.

    Attributes
    ----------
    settings : CalibrationConfig
        What was asked for.
    configs : dict of float to CacheConfig
        The chosen config of each budget (provenance filled in), in the order of the budgets.
    choices : dict of float to pandas.DataFrame
        Per budget, one row per (layer, kv_head, which) of its config (:meth:`Search.choices_at`).
    searches : tuple of Search
        One per (window dtype, candidate set) the budgets needed, in the order they were run.
    budget_search : dict of float to int
        The index in ``searches`` of each budget's search.
    options : tuple of OuterOption
        The outer options tried.
    sensitivity : Sensitivity or None
        The layer sensitivity of ``objective="kl"`` (measured once, shared by every search).
    capture : dict
        The capture's provenance (``ds.kv.provenance``; the first capture's when there were several).
    context : int
        Tokens at which effective bits are counted.
    seconds : dict of str to float
        Wall seconds: ``score`` (checks, model load and scoring), ``search`` (knapsacks),
        ``sensitivity`` and ``model_load`` (within ``score``), ``sensitivity_cpu``.
    captures : tuple of dict
        Every capture's provenance when :func:`calibrate` was given several (else empty).
    """

    settings: CalibrationConfig
    configs: dict[float, CacheConfig]
    choices: dict[float, Any]
    searches: tuple[Search, ...]
    budget_search: dict[float, int]
    options: tuple[OuterOption, ...]
    sensitivity: Any
    capture: dict[str, Any]
    context: int
    seconds: dict[str, float]
    captures: tuple[dict[str, Any], ...] = ()

    @property
    def config(self) -> CacheConfig:
        """The chosen config of a calibration at a single budget."""
        if len(self.configs) != 1:
            raise ConfigError(f"this calibration chose {len(self.configs)} configs (budgets "
                              f"{', '.join(f'{b:g}' for b in self.configs)}); read .configs[budget]")
        return next(iter(self.configs.values()))

    @property
    def scores(self) -> Scores:
        """The damage tables of a calibration that ran a single search."""
        if len(self.searches) != 1:
            raise ConfigError(f"this calibration ran {len(self.searches)} searches; read .searches[i].scores")
        return self.searches[0].scores

    @property
    def frontier(self) -> Any:
        """Every search's frontier, one after the other, with columns ``candidates``,
        ``window_dtype`` and ``max_groups_per_layer`` (0: no bound) naming the search (what
        ``kverr calibrate --frontier`` writes)."""
        import pandas as pd

        return pd.concat([s.frontier.assign(candidates=s.candidates, window_dtype=s.window_dtype,
                                            max_groups_per_layer=s.max_groups_per_layer or 0)
                          for s in self.searches], ignore_index=True)

    def frontier_steps(self) -> Any:
        """:attr:`frontier` with ``predicted_step``: each point's predicted decode step over
        fp16's (:meth:`Search.step_times`) where the settings ask for one (``step_tokens``,
        default the context; ``step_batch``; ``gpu``)."""
        st = self.settings
        return self.frontier.assign(predicted_step=np.concatenate(
            [s.step_times(st.step_tokens, st.step_batch, st.gpu) for s in self.searches]))

    def config_at(self, budget_bits: float, name: str | None = None) -> CacheConfig:
        """The best config within another budget (no new scoring), from the search of that
        budget's window dtype and candidate set; a calibration with a single search answers
        every budget from it."""
        if len(self.searches) == 1:
            return self.searches[0].config_at(budget_bits, name)
        key = _search_key(self.settings, budget_bits)
        for s in self.searches:
            if (s.window_dtype, s.candidates) == key:
                return s.config_at(budget_bits, name)
        raise ConfigError(f"no search of this calibration covers {budget_bits:g} bits (window dtype "
                          f"{key[0]}, candidates {key[1]}); calibrate at that budget")


# --------------------------------------------------------------------------------------------
# scoring: one dask task per layer, on the scheduler the decomposition uses
# --------------------------------------------------------------------------------------------


def _score_block(q, k, v, k_pre, layer_vals, scales, windows, sinks, *, kv_map, positions, rope, cands_k, cands_v,
                 options, queries, page_size, window_dtype, decode, compensated_keys=False, static_moments=False,
                 moments=None):
    """Score the layers of one chunk; called by dask with numpy arrays.

    Parameters
    ----------
    q : numpy.ndarray
        ``[L, q_head, token, channel]`` post-RoPE queries.
    k, v, k_pre : numpy.ndarray
        ``[L, kv_head, token, channel]`` (``k_pre`` is ``k`` when no option needs it).
    layer_vals, scales, windows : numpy.ndarray
        ``[L]`` model layer indices, softmax scales and sliding windows (0: full attention).
    sinks : numpy.ndarray
        ``[L, q_head]`` learned sink logits (NaN: the model has none).
    moments : numpy.ndarray, optional
        ``[model layer, kv_head, D, D]``: the static moments compensated keys are rounded under
        instead of each layer's own queries' (:func:`lazy_scores`).

    Returns
    -------
    tuple of numpy.ndarray
        ``K [L, option, cand_k, kv_head]``, ``V [L, option, cand_v, kv_head]`` (float64), the
        CPU seconds of each layer ``[L]``, and the fitted widths of template candidates,
        ``[L, side, cand_k, kv_head, channel]`` (side 0 post-RoPE, 1 pre-RoPE keys) and
        ``[L, cand_v, kv_head, channel]`` (int8; 0 for other candidates).
    """
    import time

    import torch

    from kverr.rope import layer_rope

    # One torch thread per task, whichever worker runs it: a reduction split over more threads
    # rounds differently, and the tables must not depend on the engine or the worker count.
    torch.set_num_threads(1)
    need_pre = any(o.key_pre_rope for o in options)
    n_l, n_kv = q.shape[0], k.shape[1]
    dk = np.empty((n_l, len(options), len(cands_k), n_kv))
    dv = np.empty((n_l, len(options), len(cands_v), n_kv))
    D = k.shape[-1]
    wk = np.zeros((n_l, 2, len(cands_k), n_kv, D), dtype=np.int8)
    wv = np.zeros((n_l, len(cands_v), n_kv, D), dtype=np.int8)
    cpu = np.empty(n_l)
    for i in range(n_l):
        t0 = time.thread_time()  # this thread's CPU: other tasks share the process
        prep = prepare_layer(q[i], k[i], v[i], k_pre[i] if need_pre else None, layer=int(layer_vals[i]),
                             kv_map=kv_map, scale=float(scales[i]), queries=queries, positions=positions,
                             rope=None if rope is None else layer_rope(rope, int(layer_vals[i])), decode=decode,
                             sliding_window=int(windows[i]),
                             sinks=None if np.isnan(sinks[i]).all() else sinks[i],
                             salient=any(o.salient for o in options), compensated_keys=compensated_keys,
                             moment=None if moments is None else moments[int(layer_vals[i])])
        fitted: dict = {}
        dk[i], dv[i] = score_layer(prep, cands_k, cands_v, options, page_size=page_size, window_dtype=window_dtype,
                                   widths=fitted, compensated_keys=compensated_keys, static_moments=static_moments)
        for (which, pre, j, h), bits in fitted.items():
            if which == "k":
                wk[i, int(pre), j, h] = bits
            else:
                wv[i, j, h] = bits
        cpu[i] = time.thread_time() - t0
        log.debug("layer %d scored", int(layer_vals[i]))
    return dk, dv, cpu, wk, wv


def lazy_scores(capture: Any, *, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat],
                options: Sequence[OuterOption], window_dtype: str, queries: int = 32, page_size: int = 64,
                decode: int | None = DEFAULT_DECODE, compensated_keys: bool = False,
                static_moments: bool = False, moments: KeyMoments | None = None) -> Any:
    """The damage tables of :func:`score` as a lazy dask-backed dataset (one task per layer);
    compensated keys are rounded under ``moments`` when given (the static moments of several
    captures), else under each layer's own queries' (:func:`~.objective.capture_moment`).

    Returns
    -------
    xarray.Dataset
        ``k [layer, option, cand_k, kv_head]``, ``v [layer, option, cand_v, kv_head]`` (float64)
        and ``cpu_seconds [layer]``; compute it with :func:`kverr.error.xr.compute`.
    """
    import xarray as xr

    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.dims import CHANNEL, KV_HEAD, LAYER, Q_HEAD, TOKEN

    whole = {TOKEN: -1, CHANNEL: -1, Q_HEAD: -1, KV_HEAD: -1, LAYER: 1}

    def per_layer(da):
        # a layer per chunk: each task reads (on its worker) only the layer it scores
        if da.chunks is None:
            da = da.chunk({LAYER: 1})
        return da.chunk({d: c for d, c in whole.items() if d in da.dims})

    need_pre = any(o.key_pre_rope for o in options)
    q, k, v = (per_layer(capture[n]) for n in ("q", "k", "v"))
    k_pre = per_layer(capture["k_pre"]) if need_pre else k
    layer_idx = capture[LAYER].copy().chunk({LAYER: 1})
    scales = capture.kv.attn_scales().chunk({LAYER: 1})
    windows = capture.kv.sliding_windows().chunk({LAYER: 1})
    sinks = capture.kv.attn_sinks().chunk({LAYER: 1, Q_HEAD: -1})
    core = [Q_HEAD, TOKEN, CHANNEL], [KV_HEAD, TOKEN, CHANNEL]
    dk, dv, cpu, wk, wv = xr.apply_ufunc(
        _score_block, q, k, v, k_pre, layer_idx, scales, windows, sinks,
        input_core_dims=[core[0], core[1], core[1], core[1], [], [], [], [Q_HEAD]],
        output_core_dims=[["option", "cand_k", KV_HEAD], ["option", "cand_v", KV_HEAD], [],
                          ["side", "cand_k", KV_HEAD, "width_channel"], ["cand_v", KV_HEAD, "width_channel"]],
        dask="parallelized",
        output_dtypes=[np.float64, np.float64, np.float64, np.int8, np.int8],
        dask_gufunc_kwargs={"output_sizes": {"option": len(options), "cand_k": len(cands_k),
                                             "cand_v": len(cands_v), "side": 2,
                                             "width_channel": capture.sizes[CHANNEL]}},
        kwargs=dict(kv_map=capture.kv.kv_head_of_q, positions=capture.kv.positions, rope=capture.kv.rope,
                    cands_k=tuple(cands_k), cands_v=tuple(cands_v), options=tuple(options), queries=int(queries),
                    page_size=int(page_size), window_dtype=window_dtype, decode=decode,
                    compensated_keys=bool(compensated_keys), static_moments=bool(static_moments),
                    moments=None if moments is None else np.stack([moments.layer(i).numpy()
                                                                   for i in range(moments.n_layers)])),
    )
    keep = (LAYER, KV_HEAD)
    return xr.Dataset({"k": dk, "v": dv, "cpu_seconds": cpu, "widths_k": wk, "widths_v": wv}).drop_vars(
        [c for c in dk.coords if c not in keep])


def _with_meanwhile(work, meanwhile):
    """``work()`` in this thread while ``meanwhile()`` runs in another; both results' errors
    raised (``work``'s first). ``work`` stays in the calling thread so that Ctrl-C reaches it."""
    import threading

    if meanwhile is None:
        return work()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            meanwhile()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            failed.append(exc)

    side = threading.Thread(target=run, name="kverr-calibrate-meanwhile", daemon=True)
    side.start()
    out = work()
    side.join()
    if failed:
        raise failed[0]
    return out


def score(capture: Any, *, cands_k: Sequence[QuantFormat], cands_v: Sequence[QuantFormat],
          options: Sequence[OuterOption], window_dtype: str, queries: int = 32, page_size: int = 64,
          decode: int | None = DEFAULT_DECODE, scheduler: Any = None, workers: int | None = None,
          progress: bool = False, meanwhile=None, compensated_keys: bool = False,
          static_moments: bool = False, desc: str = "calibrate: score layers",
          moments: KeyMoments | None = None) -> Scores:
    """Damage of every candidate for every (option, layer, kv head), K and V.

    Layers are scored by dask, one task per layer (:func:`lazy_scores`), on the local threads
    scheduler or a dask.distributed cluster, as :func:`kverr.error.decompose_capture` is. Each
    task runs one torch thread, so the tables are the same bits whatever the scheduler and the
    number of workers.

    Parameters
    ----------
    capture : xarray.Dataset
        A capture (:func:`kverr.io.open_capture`; on a cluster its store must be readable by
        the workers).
    cands_k, cands_v, options, window_dtype, queries, page_size, decode, compensated_keys, static_moments
        As in :class:`~.config.CalibrationConfig` (``window_dtype`` resolved: not ``auto``).
    scheduler : None, str or distributed.Client
        None or ``"threads"``: local threads; ``"synchronous"``; an address
        (``tcp://HOST:PORT``) or a Client: that cluster (:func:`kverr.error.xr.compute`).
    workers : int, optional
        Local threads scoring layers at once (default: one per core).
    progress : bool
        Show a progress bar.
    meanwhile : callable, optional
        Runs in this process, in another thread, while the layers are scored.
    desc : str
        The progress bar's label.
    moments : KeyMoments, optional
        Round compensated keys under these static moments (:func:`lazy_scores`).

    Returns
    -------
    Scores
    """
    import time

    import dask
    import torch

    from kverr.error.xr import compute

    t0 = time.perf_counter()
    lazy = lazy_scores(capture, cands_k=cands_k, cands_v=cands_v, options=options, window_dtype=window_dtype,
                       queries=queries, page_size=page_size, decode=decode, compensated_keys=compensated_keys,
                       static_moments=static_moments, moments=moments)
    where = scheduler if scheduler not in (None, "threads") else f"{workers or 'one per core'} local threads"
    log.info("scoring %d layers on %s", lazy.sizes["layer"], where)
    threads = torch.get_num_threads()
    # Scoring tasks run one torch thread each; so does the sensitivity measured meanwhile, which
    # restores the count it found when it ends. Both find 1, so neither changes it under the other.
    torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as stack:
            if workers:
                stack.enter_context(dask.config.set(num_workers=workers))
            done = _with_meanwhile(lambda: compute(lazy, scheduler or "threads", progress=progress,
                                                   desc=desc), meanwhile)
    finally:
        torch.set_num_threads(threads)
    dk = np.asarray(done["k"].transpose("option", "layer", "cand_k", "kv_head").values, dtype=np.float64)
    dv = np.asarray(done["v"].transpose("option", "layer", "cand_v", "kv_head").values, dtype=np.float64)
    cpu = float(done["cpu_seconds"].sum())
    templated = any(f.channel_bits is not None for f in (*cands_k, *cands_v))
    wk = np.asarray(done["widths_k"].transpose("side", "layer", "cand_k", "kv_head", "width_channel").values) if templated else None
    wv = np.asarray(done["widths_v"].transpose("layer", "cand_v", "kv_head", "width_channel").values) if templated else None
    log.info("scored %d layers in %.1f s: %.1f s CPU in the scoring tasks", done.sizes["layer"],
             time.perf_counter() - t0, cpu)
    return Scores(dk, dv, capture.kv.layers, tuple(cands_k), tuple(cands_v), tuple(options), int(queries),
                  window_dtype, cpu, decode, wk, wv, bool(compensated_keys), bool(static_moments))


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


def _costs(cands, opt, head_dim, context, page_size, window_dtype, align, sliding_window=0, *, which,
           batch=1, width_tables=False) -> np.ndarray:
    return np.array([head_bytes(f, opt, head_dim, context, page_size, window_dtype, align, sliding_window,
                                which=which, batch=batch, width_tables=width_tables) for f in cands], dtype=np.int64)


def _layer_windows(windows: Sequence[int] | None, n_layers: int) -> list[int]:
    """Per-layer sliding windows (0: full attention) from a shape's possibly empty tuple."""
    return list(windows) if windows else [0] * n_layers


def _elements(n_layers: int, n_kv: int, head_dim: int, context: int, batch: int) -> int:
    """Cached key and value elements of ``batch`` sequences of ``context`` tokens."""
    return 2 * n_layers * n_kv * head_dim * context * batch


def bits_of(nbytes: int, n_layers: int, n_kv: int, head_dim: int, context: int, batch: int = 1) -> float:
    """Effective bits of ``nbytes`` holding ``batch`` sequences of ``context`` tokens."""
    return 8.0 * nbytes / _elements(n_layers, n_kv, head_dim, context, batch)


def budget_bytes_of(budget_bits: float, n_layers: int, n_kv: int, head_dim: int, context: int, batch: int = 1) -> int:
    """The most bytes within ``budget_bits`` effective bits (the inverse of :func:`bits_of`, floored)."""
    return math.floor(budget_bits * _elements(n_layers, n_kv, head_dim, context, batch) / 8 + 1e-9)


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
    sliding_windows: Sequence[int] | None = None,
    batch: int = 1,
    width_tables: bool = False,
    static_bytes: int = 0,
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
    sliding_windows : sequence of int, optional
        Per layer, the sliding window (0 or empty: full attention): a sliding layer holds only
        its window, whatever the context.
    batch : int
        Sequences the bytes are counted for, their static bytes once (:class:`CalibrationConfig`).
    width_tables : bool
        Count each sequence's width tables of the formats with per-channel widths
        (:attr:`CalibrationConfig.refit_widths`).
    static_bytes : int
        Bytes every config holds whatever its formats: the static key moments of compensated keys
        (:meth:`kverr.quant.compensated.KeyMoments.bytes_for`).

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
    windows = _layer_windows(sliding_windows, n_layers)
    cheapest = min(
        sum(int(min(_costs(c, o, head_dim, context, page_size, window_dtype, align, w, which=s, batch=batch,
                           width_tables=width_tables)))
            * windows.count(w) for s, c in (("k", cands_k), ("v", cands_v)) for w in set(windows)) * n_kv
        for o in options
    ) + static_bytes
    cheapest_bits = bits_of(cheapest, n_layers, n_kv, head_dim, context, batch)
    budget_bytes = budget_bytes_of(budget_bits, n_layers, n_kv, head_dim, context, batch)
    if budget_bytes < cheapest:
        raise ConfigError(
            f"budget of {budget_bits:g} effective bits is infeasible at {context} tokens{batch_phrase(batch)}: the "
            f"cheapest possible config costs {cheapest_bits:.4f} effective bits ({cheapest} bytes)"
        )
    return window_dtype, cands_k, cands_v


def batch_phrase(batch: int) -> str:
    """What follows "at N tokens" in a message when bytes are counted for ``batch`` sequences."""
    return f" x {batch} sequences" if batch != 1 else ""


#: What a candidate set's name carries when the codebook candidates are added to it.
CODEBOOKS_SUFFIX = "+codebooks"


def _search_key(settings: CalibrationConfig, budget_bits: float) -> tuple[str, str]:
    """``(window dtype, candidate set)`` of a budget: budgets sharing them share one search."""
    wdt = window_dtype_for_budget(budget_bits, settings.window_dtype)
    if settings.cands_k is not None and settings.cands_v is not None:
        return wdt, "custom"
    return wdt, candidate_set(budget_bits, settings.candidates) + (CODEBOOKS_SUFFIX if settings.codebooks else "")


def _search_candidates(settings: CalibrationConfig, cand_set: str, head_dim: int):
    named = None
    if cand_set != "custom":
        base = cand_set.removesuffix(CODEBOOKS_SUFFIX)
        named = named_candidates(base, head_dim) + (codebook_candidates(head_dim) if base != cand_set else ())
    return tuple(settings.cands_k or named), tuple(settings.cands_v or named)


def calibrate(
    capture: Any,
    config: CalibrationConfig,
    *,
    scheduler: Any = None,
    workers: int | None = None,
    progress: bool = False,
    model: Any = None,
    sensitivity: Any = None,
    scores: Scores | None = None,
) -> Calibration:
    """Choose a format per (layer, kv head, K|V) minimising the predicted damage within each budget.

    Budgets that share a window dtype and a candidate set share one search (one knapsack
    frontier per outer option); a search whose candidates are a subset of an earlier one's with
    the same window dtype reuses its damage tables, and every search shares one sensitivity.

    Parameters
    ----------
    capture : xarray.Dataset or sequence of them
        A capture of *every* layer of the model (:func:`kverr.io.open_capture`), or several of
        the same model, e.g. of different kinds of text: each is scored and its sensitivity
        measured as one would be, and the knapsack is solved once on their damage tables and
        layer weights averaged, the captures counting alike (:meth:`Scores.mean`,
        :meth:`~.sensitivity.Sensitivity.mean`). Their lengths must be equal unless
        ``config.context`` is given; template candidates (``candidates="fitted"``) need
        ``refit_widths``, since a config would store one capture's widths; ``static_moments``
        stores their moments averaged (:func:`~.objective.capture_key_moments`).
    config : CalibrationConfig
        What to compute: every option that changes the result.
    scheduler : None, str or distributed.Client
        Where layers are scored (:func:`score`): local threads by default, or a dask.distributed
        cluster (``tcp://HOST:PORT`` or a Client). The result does not depend on it.
    workers : int, optional
        Local threads scoring layers at once (default: one per core).
    progress : bool
        Show progress bars.
    model : str or LoadedModel, optional
        ``objective="kl"``: the capture's model, already loaded (or a spec), instead of
        ``config.model``; refused unless its weights are the capture's.
    sensitivity : Sensitivity, optional
        Reuse a measured sensitivity (``"kl"`` only) instead of measuring it while the layers
        are scored (:mod:`.sensitivity`).
    scores : Scores, optional
        Reuse earlier damage tables (same options, window dtype and ``decode``; candidates a
        superset of each search's).

    Returns
    -------
    Calibration

    Raises
    ------
    ConfigError
        A budget below the cheapest possible config, candidates that do not fit the head dim,
        options covering the whole context, scores or a sensitivity that do not fit.
    CaptureError
        A capture of some layers only, without the variables asked for, or of another model
        than ``model`` (or than the first capture).
    """
    if not isinstance(config, CalibrationConfig):
        raise ConfigError(f"calibrate() takes a kverr.calibration.CalibrationConfig, got {type(config).__name__} "
                          f"{config!r}: calibrate(capture, CalibrationConfig(budgets=...))")
    return _calibrate(capture, config, scheduler=scheduler, workers=workers, progress=progress, model=model,
                      sensitivity=sensitivity, scores=scores)


def _calibrate(capture: Any, cfg: CalibrationConfig, *, scheduler: Any, workers: int | None, progress: bool,
               model: Any, sensitivity: Any, scores: Scores | None) -> Calibration:
    import time

    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.io import check_finite

    t0 = time.perf_counter()
    captures = _captures_of(capture)
    _check_whole(captures, cfg)
    capture = captures[0]
    several = len(captures) > 1
    kv = capture.kv
    n_layers = kv.n_layers
    n_kv, head_dim, n_tok = kv.n_kv_heads, kv.head_dim, kv.n_tokens
    context = cfg.context or n_tok
    options = calibration_options(capture, cfg)
    need_pre = any(o.key_pre_rope for o in options)
    for i, c in enumerate(captures):
        if need_pre and "k_pre" not in c:
            raise CaptureError(f"a pre-RoPE option was asked for but {_which(i, several)} has no k_pre")
    if cfg.objective == "rel" and sensitivity is not None:
        raise ConfigError("a sensitivity was given but objective='rel' does not use one")
    # searches in a fixed order: int8 windows first, and within a window dtype the larger
    # candidate sets (NESTED_SETS) first, so that the later searches reuse their damage tables
    keys = {b: _search_key(cfg, b) for b in cfg.budgets}
    # static moments: every config carries the capture's query moments (static bytes)
    moment_bytes = KeyMoments.bytes_for(n_layers, n_kv, head_dim) if cfg.static_moments else 0
    rank = {name: i for i, name in enumerate(NESTED_SETS)}
    order = sorted(set(keys.values()),
                   key=lambda g: (g[0] != "int8", g[0], rank.get(g[1].removesuffix(CODEBOOKS_SUFFIX), -1)))
    # Every budget is checked before any work, so a bad one wastes no scoring.
    for key in order:
        cands_k, cands_v = _search_candidates(cfg, key[1], head_dim)
        if several and not cfg.refit_widths and any(f.channel_bits is not None for f in (*cands_k, *cands_v)):
            raise ConfigError("template candidates (fitted per-channel widths) with several captures need "
                              "refit_widths (--refit-widths): a config would store widths fitted on one capture")
        for b in sorted(b for b in cfg.budgets if keys[b] == key):
            check_budget(b, n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, context=context, options=options,
                         cands_k=cands_k, cands_v=cands_v, page_size=cfg.page_size, window_dtype=key[0],
                         align=cfg.align,
                         context_from=None if cfg.context else f"the capture's length, {n_tok} tokens",
                         sliding_windows=kv.shape.sliding_windows, batch=cfg.batch,
                         width_tables=cfg.refit_widths, static_bytes=moment_bytes)
    if scores is not None:
        checked = [("decode", cfg.decode), ("options", options), ("compensated_keys", cfg.compensated_keys)]
        if cfg.decode is not None and cfg.compensated_keys:  # the generated keys' rounding follows it
            checked.append(("static_moments", cfg.static_moments))
        for name, want in checked:
            if getattr(scores, name) != want:
                raise ConfigError(f"the scores were computed with {name}={getattr(scores, name)}, not {want}")
        for key in order:
            if scores.window_dtype != key[0]:
                raise ConfigError(f"the scores were computed with window_dtype={scores.window_dtype!r}, "
                                  f"not {key[0]!r}")
    # A NaN or Inf would surface only after scoring, as a knapsack error that names no tensor.
    for c in captures:
        check_finite(c, ("q", "k", "v") + (("k_pre",) if need_pre else ()))
    # the sensitivity measured on each capture, in order, each while that capture is scored
    measured: list[Any] = []
    sens_box: dict[str, float] = {"t": 0.0, "cpu": 0.0}

    def measure(c: Any) -> None:
        ts, tc = time.perf_counter(), time.thread_time()
        measured.append(sensitivity_for_capture(c, model=model, tokens=cfg.sensitivity_tokens,
                                                noise=cfg.sensitivity_noise, sinks=max(o.sinks for o in options),
                                                threads=1, progress=progress))
        sens_box["t"] += time.perf_counter() - ts
        sens_box["cpu"] += time.thread_time() - tc

    need_sens = cfg.objective == "kl" and sensitivity is None
    if need_sens:
        from kverr.progress import progress as progress_bar

        tl = time.perf_counter()
        # a bar of one step: loading the model takes ~20 s before any other bar can move
        with progress_bar(total=1, desc="calibrate: load the model", unit="model", enabled=progress) as bar:
            model = check_capture_model(capture, model or cfg.model)  # load once; refuse before scoring
            for c in captures[1:]:
                check_capture_model(c, model)
            bar.update()
        sens_box["load"] = time.perf_counter() - tl
    # static moments: every config carries the captures' query moments (of several, their mean),
    # and every capture is scored with its keys rounded under them, as the config rounds them
    moments = capture_key_moments(captures) if cfg.static_moments else None
    tables: dict[tuple[str, str], Scores] = {}
    tables_each: dict[tuple[str, str], tuple[Scores, ...]] = {}  # each capture's, with several
    score_s: dict[tuple[str, str], float] = {}
    for key in order:
        wdt, _ = key
        cands_k, cands_v = _search_candidates(cfg, key[1], head_dim)
        prev = next((k for k in tables if k[0] == wdt), None)
        base = scores if scores is not None else None if prev is None else tables[prev]
        ts = time.perf_counter()
        if base is not None:
            tables[key] = base.subset(cands_k, cands_v)
            tables_each[key] = () if scores is not None else tuple(t.subset(cands_k, cands_v) for t in tables_each[prev])
            while need_sens and len(measured) < len(captures):
                measure(captures[len(measured)])
        else:
            each = []
            for i, c in enumerate(captures):
                pending = need_sens and len(measured) == i
                each.append(score(c, cands_k=cands_k, cands_v=cands_v, options=options, queries=cfg.queries,
                                  page_size=cfg.page_size, window_dtype=wdt, decode=cfg.decode, scheduler=scheduler,
                                  compensated_keys=cfg.compensated_keys, static_moments=cfg.static_moments,
                                  workers=workers, progress=progress,
                                  meanwhile=(lambda c=c: measure(c)) if pending else None,
                                  desc=f"calibrate: score capture {i + 1}/{len(captures)}" if several
                                  else "calibrate: score layers", moments=moments))
            tables[key] = Scores.mean(each)
            tables_each[key] = tuple(each) if several else ()
        score_s[key] = time.perf_counter() - ts
    if measured:
        sensitivity = Sensitivity.mean(measured)
    weights = None
    if cfg.objective == "kl":
        weights = tuple(np.asarray(w, dtype=np.float64) for w in (sensitivity.weights_k, sensitivity.weights_v))
        if any(w.shape != (n_layers,) or not np.all(np.isfinite(w)) or np.any(w < 0) for w in weights):
            raise ConfigError(f"the sensitivity must hold {n_layers} finite non-negative layer weights per side")
    t1 = time.perf_counter()
    max_bytes = math.ceil(cfg.frontier_bits * _elements(n_layers, n_kv, head_dim, context, cfg.batch) / 8)
    searches = []

    def search(key, max_groups):
        ts = time.perf_counter()
        frontier, frontiers = _frontier(tables[key], weights, options, n_layers=n_layers, n_kv=n_kv,
                                        head_dim=head_dim, context=context, page_size=cfg.page_size,
                                        window_dtype=key[0], align=cfg.align, max_bytes=max_bytes,
                                        max_groups=max_groups, sliding_windows=kv.shape.sliding_windows,
                                        batch=cfg.batch, width_tables=cfg.refit_widths, static_bytes=moment_bytes,
                                        window_per_head=cfg.window_per_head)
        return Search(
            window_dtype=key[0], candidates=key[1], budgets=tuple(b for b in cfg.budgets if keys[b] == key),
            scores=tables[key], frontier=frontier, frontiers=frontiers, weights=weights,
            sensitivity=sensitivity, shape=kv.shape, context=context, page_size=cfg.page_size, align=cfg.align,
            objective=cfg.objective, capture=kv.provenance,
            seconds={"score": score_s[key], "search": time.perf_counter() - ts},
            max_groups_per_layer=max_groups, batch=cfg.batch, refit_widths=cfg.refit_widths,
            key_moments=moments, captures=provenances, scores_each=tables_each[key])

    provenances = tuple(c.kv.provenance for c in captures) if several else ()

    searches = [search(key, cfg.max_groups_per_layer) for key in order]
    configs, choices, index = {}, {}, {}
    for b in cfg.budgets:
        i = order.index(keys[b])
        configs[b], choices[b] = _build(searches[i], b, cfg.name)
        index[b] = i
        if cfg.max_step_time is not None:
            # the most format groups per layer whose predicted step time fits: fewer groups,
            # fewer launches, more damage; each bound one more search of the same tables
            bound = min(cfg.max_groups_per_layer or n_kv, n_kv)
            while True:
                step = _step_time(configs[b], cfg, kv, context)
                if step["ratio"] <= cfg.max_step_time:
                    break
                if bound == 1:
                    raise ConfigError(
                        f"no config within {b:g} bits meets max_step_time={cfg.max_step_time:g}: with one format "
                        f"pair per layer the predicted decode step takes {step['ratio']:.3g}x fp16's at "
                        f"{step['tokens']} tokens x batch {step['batch']} on {step['gpu']} (kverr plan)")
                bound -= 1
                found = next((j for j, sr in enumerate(searches) if (sr.window_dtype, sr.candidates) == keys[b]
                              and sr.max_groups_per_layer == bound), None)
                if found is None:
                    searches.append(search(keys[b], bound))
                    found = len(searches) - 1
                configs[b], choices[b] = _build(searches[found], b, cfg.name)
                index[b] = found
            prov = dict(configs[b].provenance, predicted_step=step | {"max_step_time": cfg.max_step_time})
            configs[b] = configs[b].with_(provenance=prov)
    t2 = time.perf_counter()
    return Calibration(
        settings=cfg, configs=configs, choices=choices, searches=tuple(searches), budget_search=index,
        options=tuple(options), sensitivity=sensitivity, capture=kv.provenance, context=context,
        seconds={"score": t1 - t0, "search": t2 - t1, "sensitivity": sens_box["t"],
                 "model_load": sens_box.get("load", 0.0), "sensitivity_cpu": sens_box["cpu"]},
        captures=provenances,
    )


def _step_time(config: CacheConfig, cfg: CalibrationConfig, kv: Any, context: int) -> dict[str, Any]:
    """``config``'s predicted decode step (:mod:`kverr.cost`, CUDA graphs) against fp16's, at
    ``cfg.step_tokens`` (default: the context) x ``cfg.step_batch`` on ``cfg.gpu``."""
    from kverr.cost import fp16_step, step_cost

    shape = kv.shape
    tokens, batch, gpu = cfg.step_tokens or context, cfg.step_batch, cfg.gpu
    t = step_cost(config, shape, tokens, batch, gpu).seconds(True)
    ref = fp16_step(shape, tokens, batch, gpu).seconds(True)
    return {"tokens": tokens, "batch": batch, "gpu": gpu, "seconds": t, "fp16_seconds": ref, "ratio": t / ref}


def _grouped_solve(dmg: list[np.ndarray], ck: list[np.ndarray], cv: list[np.ndarray], n_kv: int, max_groups: int,
                   max_bytes: int) -> Frontier:
    """:func:`solve` with at most ``max_groups`` (K, V) format pairs per layer: one knapsack group
    per layer whose candidates are :func:`~.knapsack.layer_items`; the frontier's choices are
    given back per (layer, kv head, K|V), in :func:`_groups`' order, as without the bound."""
    n_layers = len(dmg) // (2 * n_kv)
    items = []
    for li in range(n_layers):
        d = dmg[2 * n_kv * li: 2 * n_kv * (li + 1)]
        items.append(layer_items(ck[li], np.stack(d[0::2], axis=1), cv[li], np.stack(d[1::2], axis=1), max_groups))
    fr = solve([it.cost for it in items], [it.damage for it in items], max_cost=max_bytes)
    choices = np.empty((fr.choices.shape[0], 2 * n_kv * n_layers), dtype=np.int64)
    for li, it in enumerate(items):
        j = fr.choices[:, li]
        choices[:, 2 * n_kv * li: 2 * n_kv * (li + 1): 2] = it.k[j]
        choices[:, 2 * n_kv * li + 1: 2 * n_kv * (li + 1): 2] = it.v[j]
    return Frontier(fr.cost, fr.damage, choices, fr.unit, fr.exact, fr.min_cost, fr.max_cost)


def _frontier(scores: Scores, weights, options, *, n_layers: int, n_kv: int, head_dim: int, context: int,
              page_size: int, window_dtype: str, align: int, max_bytes: int, max_groups: int | None = None,
              sliding_windows: Sequence[int] | None = None, batch: int = 1, width_tables: bool = False,
              static_bytes: int = 0, window_per_head: bool = False):
    """The knapsack frontier of every outer option, and their common Pareto frontier (with at
    most ``max_groups`` (K, V) format pairs per layer when given). A candidate's bytes depend on
    its layer's sliding window (a sliding layer holds only its window). ``static_bytes`` every
    config holds whatever its formats (static key moments) are in each point's bytes. With
    ``window_per_head`` each :func:`window_families` group of the options is searched as one too
    (:class:`WindowsPerHead`: every group's candidates under each of its options)."""
    import pandas as pd

    frontiers: dict[OuterOption | WindowsPerHead, Frontier] = {}
    tables: dict[OuterOption, tuple[list, list]] = {}  # per option: (costs, damages) per group
    rows = []

    def add_rows(key, fr, opt, window):
        for i in range(len(fr.cost)):
            rows.append(dict(option=key.label(), window=window, sinks=opt.sinks,
                             key_pre_rope=opt.key_pre_rope, bytes=int(fr.cost[i]) + static_bytes,
                             effective_bits=bits_of(int(fr.cost[i]) + static_bytes, n_layers, n_kv, head_dim,
                                                    context, batch),
                             predicted=float(fr.damage[i]), index=i))

    for oi, opt in enumerate(options):
        keys, dmg = _groups(scores, oi, n_kv, weights)
        windows = _layer_windows(sliding_windows, n_layers)
        by_w = {w: tuple(_costs(c, opt, head_dim, context, page_size, window_dtype, align, w, which=s, batch=batch,
                                width_tables=width_tables)
                         for s, c in (("k", scores.cands_k), ("v", scores.cands_v)))
                for w in set(windows)}
        ck = [by_w[windows[layer]][0] for layer in scores.layers]
        cv = [by_w[windows[layer]][1] for layer in scores.layers]
        if max_groups is not None and max_groups < n_kv:
            fr = _grouped_solve(dmg, ck, cv, n_kv, max_groups, max_bytes - static_bytes)
        else:
            costs = [by_w[windows[layer]][0 if w == "k" else 1] for (layer, _, w) in keys]
            fr = solve(costs, dmg, max_cost=max_bytes - static_bytes)
            tables[opt] = (costs, dmg)
        frontiers[opt] = fr
        add_rows(opt, fr, opt, opt.window)
    if window_per_head:  # (CalibrationConfig refuses it with max_groups_per_layer)
        families = window_families(options)
        if not families:
            raise ConfigError(f"window_per_head needs outer options that differ only in their window; the options "
                              f"are {', '.join(o.label() for o in options)}")
        for fam in families:
            n_groups = len(tables[fam.options[0]][0])
            costs = [np.concatenate([tables[o][0][g] for o in fam.options]) for g in range(n_groups)]
            dmg = [np.concatenate([tables[o][1][g] for o in fam.options]) for g in range(n_groups)]
            fr = solve(costs, dmg, max_cost=max_bytes - static_bytes)
            frontiers[fam] = fr
            add_rows(fam, fr, fam.options[0], fam.options[-1].window)
    allf = pd.DataFrame(rows).sort_values(["bytes", "predicted"], kind="stable").reset_index(drop=True)
    pareto = allf[allf["predicted"] < allf["predicted"].cummin().shift(fill_value=np.inf)]
    return pareto.reset_index(drop=True), frontiers


def _build(search: Search, budget_bits: float, name: str | None) -> tuple[CacheConfig, Any]:
    """The config of ``search`` within ``budget_bits`` and its per-head choices."""
    n_layers, n_kv, D = search.shape.n_layers, search.shape.n_kv_heads, search.shape.head_dim
    context, batch = search.context, search.batch
    budget_bytes = budget_bytes_of(budget_bits, n_layers, n_kv, D, context, batch)
    fr_all = search.frontier
    ok = fr_all[fr_all["bytes"] <= budget_bytes]
    if ok.empty:
        cheapest = int(fr_all["bytes"].min())
        raise ConfigError(
            f"budget of {budget_bits:g} effective bits is infeasible at {context} tokens{batch_phrase(batch)}: the "
            f"cheapest possible config costs {bits_of(cheapest, n_layers, n_kv, D, context, batch):.4f} "
            f"effective bits ({cheapest} bytes)"
        )
    return _build_row(search, ok.iloc[-1], budget_bits, name)


def _build_row(search: Search, row: Any, budget_bits: float, name: str | None) -> tuple[CacheConfig, Any]:
    """The config of one row of ``search.frontier`` and its per-head choices."""
    import pandas as pd

    n_layers, n_kv, D = search.shape.n_layers, search.shape.n_kv_heads, search.shape.head_dim
    context = search.context
    key = next(o for o in search.frontiers if o.label() == row["option"])
    fr = search.frontiers[key]
    pick = fr.choices[int(row["index"])]
    weights = search.weights
    sc = search.scores
    keys, _ = _groups(sc, 0, n_kv)
    each = np.zeros(len(search.scores_each))  # the config's predicted damage on each capture
    chosen: dict[tuple[int, int, str], QuantFormat] = {}
    window: dict[tuple[int, int, str], int] = {}
    recs = []
    for (layer, h, w), j in zip(keys, pick):
        opt, j = (key.member(int(j), len(sc.cands_k if w == "k" else sc.cands_v)) if isinstance(key, WindowsPerHead)
                  else (key, int(j)))
        oi = sc.options.index(opt)
        f = sc.format_of(w, opt, layer, j, h)
        chosen[(layer, h, w)] = f
        window[(layer, h, w)] = opt.window
        li = sc.layers.index(layer)
        rel = float((sc.k if w == "k" else sc.v)[oi, li, j, h])
        wt = 1.0 if weights is None else float(weights[0 if w == "k" else 1][layer])
        d = rel * wt
        for i, t in enumerate(search.scores_each):
            each[i] += float((t.k if w == "k" else t.v)[oi, li, j, h]) * wt
        b = head_bytes(f, opt, D, context, search.page_size, search.window_dtype, search.align,
                       search.shape.sliding_window(layer), which=w, batch=search.batch,
                       width_tables=search.refit_widths)
        recs.append(dict(layer=layer, kv_head=h, which=w, format=f.label(), dtype=f.dtype, bits=f.element_bits,
                         granularity=f.granularity.kind, rotate=f.rotate, clip=f.clip.kind, window=opt.window,
                         bytes=b, predicted=float(d), relative=rel))
    choices = pd.DataFrame(recs)
    opt = key.options[0] if isinstance(key, WindowsPerHead) else key
    # the most common window is the config's; the heads keeping another say so
    default_window = Counter(window[g] for g in sorted(window)).most_common(1)[0][0]
    default = {w: Counter(f for (_, _, ww), f in sorted(chosen.items(), key=lambda kv: kv[0]) if ww == w)
               for w in ("k", "v")}
    dk = max(default["k"].items(), key=lambda kv: kv[1])[0]
    dv = max(default["v"].items(), key=lambda kv: kv[1])[0]
    heads = {}
    for layer in range(n_layers):
        for h in range(n_kv):
            fk, fv = chosen[(layer, h, "k")], chosen[(layer, h, "v")]
            wk, wv = window[(layer, h, "k")], window[(layer, h, "v")]
            ov = Override(k=None if fk == dk else fk, v=None if fv == dv else fv,
                          k_window=None if wk == default_window else wk, v_window=None if wv == default_window else wv)
            if ov != Override():
                heads[(layer, h)] = ov
    # the frontier counts a template at its own bytes; its fitted widths may take fewer
    km = search.key_moments
    nbytes = int(choices["bytes"].sum()) + (0 if km is None else km.nbytes)
    bits = bits_of(nbytes, n_layers, n_kv, D, context, search.batch)
    prov = {
        "tool": "kverr calibrate",
        "capture": search.capture,
        **({"captures": [dict(c) for c in search.captures]} if search.captures else {}),
        "budget_bits": float(budget_bits),
        "effective_bits": bits,
        "bytes": nbytes,
        "context_tokens": context,
        "batch": search.batch,
        **({"refit_widths": True} if search.refit_widths else {}),
        **({"compensated_keys": True} if sc.compensated_keys else {}),
        **({"static_moments": True} if km is not None else {}),
        "objective": OBJECTIVES[search.objective],
        "objective_definition": OBJECTIVE_KL_DOC if search.objective == "kl" else OBJECTIVE_DOC,
        "predicted_damage": float(row["predicted"]),
        # on each capture, with the averaged layer weights: their mean is predicted_damage
        **({"predicted_damage_each": [float(x) for x in each]} if len(each) else {}),
        "predicted_relative": float(choices["relative"].sum()),
        "predicted_k": float(choices.loc[choices.which == "k", "predicted"].sum()),
        "predicted_v": float(choices.loc[choices.which == "v", "predicted"].sum()),
        "queries_per_layer": sc.queries,
        "decode_steps": sc.decode,
        "outer_option": key.label(),
        "outer_options_tried": [o.label() for o in sc.options],
        "candidates_k": len(sc.cands_k),
        "candidates_v": len(sc.cands_v),
        "knapsack": {"unit_bytes": fr.unit, "exact": fr.exact},
    }
    if search.max_groups_per_layer is not None:
        prov["max_groups_per_layer"] = search.max_groups_per_layer
    if search.objective == "kl":
        prov["sensitivity"] = search.sensitivity.to_dict()
    cfg = CacheConfig(
        k=dk, v=dv, window=default_window, sinks=opt.sinks, key_pre_rope=opt.key_pre_rope, salient=opt.salient,
        salient_sides=opt.salient_sides, salient_recent=opt.salient_recent,
        page_size=search.page_size, window_dtype=search.window_dtype, align=search.align, heads=heads,
        key_rounding="compensated" if sc.compensated_keys else "nearest", key_moments=km,
        name=(name or "calibrated-{bits}b").replace("{bits}", f"{budget_bits:g}"), provenance=prov,
    )
    return cfg, choices


def _captures_of(capture: Any) -> tuple[Any, ...]:
    """The calibration captures: one dataset, or a non-empty sequence of them, each checked
    (:func:`_check_capture`) and all of one model (:func:`_check_same_model`)."""
    import xarray as xr

    captures = (capture,) if isinstance(capture, xr.Dataset) else tuple(capture) if isinstance(
        capture, (list, tuple)) else (capture,)
    if not captures:
        raise CaptureError("give at least one capture")
    for c in captures:
        _check_capture(c)
    _check_same_model(captures)
    return captures


def _check_whole(captures: Sequence[Any], cfg: CalibrationConfig) -> None:
    """Refuse captures a calibration with ``cfg`` cannot use: one of some layers only, captures of
    different lengths without ``cfg.context`` (effective bits are counted at one), or one too short
    for ``cfg.queries`` sampled positions."""
    several = len(captures) > 1
    for i, c in enumerate(captures):
        if c.kv.layers != list(range(c.kv.n_layers)):
            raise CaptureError(
                f"calibration needs every layer of the model; {_which(i, several)} has layers {c.kv.layers} "
                f"of {c.kv.n_layers} (recapture with --layers all)"
            )
    lengths = [c.kv.n_tokens for c in captures]
    if cfg.context is None and len(set(lengths)) > 1:
        raise ConfigError(f"the captures hold {', '.join(map(str, lengths))} tokens: give the context at which "
                          "effective bits are counted (--context), or captures of one length")
    for c in captures:
        check_queries(cfg.queries, c.kv.n_tokens)


def _which(i: int, several: bool) -> str:
    """Capture ``i`` named in a message: "the capture" when it is the only one, else "capture
    i + 1" (counting from 1, in the order given)."""
    return f"capture {i + 1}" if several else "the capture"


def _check_same_model(captures: Sequence[Any]) -> None:
    """Refuse captures of different models: by weights sha256 where both record one, and by
    shape (layers, kv heads, head dim) and RoPE always."""
    import kverr.accessor  # noqa: F401  (registers ds.kv)

    first = captures[0].kv.provenance
    shape = ("n_layers", "n_kv_heads", "head_dim")
    for i, c in enumerate(captures[1:], start=2):
        p = c.kv.provenance
        a, b = first["weights_sha256"], p["weights_sha256"]
        if a and b and a != b:
            raise CaptureError(f"capture {i} is of {p['model_id']!r} (weights sha256 {b[:12]}...), capture 1 of "
                               f"{first['model_id']!r} ({a[:12]}...): calibrate on captures of one model")
        if any(p[k] != first[k] for k in shape) or c.attrs.get("rope") != captures[0].attrs.get("rope"):
            raise CaptureError(f"capture {i} ({', '.join(f'{k} {p[k]}' for k in shape)}) is not of capture 1's "
                               f"model ({', '.join(f'{k} {first[k]}' for k in shape)}, or another RoPE): "
                               "calibrate on captures of one model")


def _check_capture(capture: Any) -> None:
    import xarray as xr

    import kverr.accessor  # noqa: F401  (registers ds.kv)

    if not isinstance(capture, xr.Dataset):
        raise CaptureError(f"capture must be an xarray.Dataset, got {type(capture).__name__}")
    for n in ("q", "k", "v"):
        if n not in capture.data_vars:
            raise CaptureError(f"the capture lacks the variable {n!r}")
    if "kv_head_of_q" not in capture.coords:
        raise CaptureError("the capture lacks the coordinate 'kv_head_of_q'")
