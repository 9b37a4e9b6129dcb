"""Calibration for a serving engine: search only what the engine serves, with the same objective.

vLLM serves one ``--kv-cache-dtype`` for the model, minus ``--kv-cache-dtype-skip-layers`` kept
in the model's dtype (:mod:`kverr.engines.vllm`). So :func:`calibrate_for_vllm` scores, for every
(layer, kv head, K|V), the formats of vLLM's cache dtypes -- fp8 with static scales per tensor or
per kv head (each with the absmax scale and with the MSE-optimal clip of the capture, chosen per
layer and side: the scale is data in the checkpoint, so each layer may have its own), the
per-token-head dtypes, ``nvfp4``, ``turboquant_k8v4``, and fp16 -- with the calibration objective (:mod:`.objective`, weighted
by the measured layer sensitivity), and then, for each dtype and each budget, keeps in 16 bits
the layers where the dtype does the most damage. Every quantized layer costs the same bytes and
every skipped layer the same more, so skipping the ``n`` layers of largest damage is the best
choice of ``n`` layers; ``n`` is the most the budget allows. A TurboQuant dtype's boundary layers
(:func:`~kverr.engines.vllm_dtypes.boundary_layers`) are skipped by vLLM itself, so they are
always among its skipped layers. The dtype of least predicted damage wins.

Beside each choice, :attr:`VllmCalibration.table` gives every dtype's predicted damage at each
budget with the calibrated skip layers, and, at equal memory, with the convention of vLLM's
TurboQuant path (the first and last two layers kept, the rest quantized) and with as many
calibrated skip layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kverr.catalog import STATIC_MSE_CLIP
from kverr.config import CacheConfig, Override
from kverr.engines.vllm_dtypes import boundary_layers, has_boundary_skip
from kverr.exceptions import CaptureError, ConfigError
from kverr.quant.formats import PerHead, PerTensor, QuantFormat, float_format, fp8_format

from .candidates import OuterOption, head_bytes
from .config import CalibrationConfig
from .search import bits_of, budget_bytes_of

#: The outer option vLLM serves: no sinks, no window, keys after RoPE.
VLLM_OPTION = OuterOption(window=0, sinks=0, key_pre_rope=False)


@dataclass(frozen=True)
class Family:
    """One vLLM cache dtype as calibration candidates: per side, the formats a layer may use."""

    name: str  # e.g. "fp8 (static, per head)", "int8_per_token_head"
    kv_cache_dtype: str
    k: tuple[QuantFormat, ...]
    v: tuple[QuantFormat, ...]

    @property
    def boundary(self) -> bool:
        """Whether vLLM itself keeps the boundary layers unquantized with this dtype."""
        return has_boundary_skip(self.kv_cache_dtype)


def vllm_families(head_dim: int) -> tuple[Family, ...]:
    """vLLM's cache dtypes kverr expresses, as candidate families (see the module docs)."""
    from kverr.engines.vllm_dtypes import KV_CACHE_DTYPE, PRESETS

    fams = []
    for gran, what in ((PerTensor(), "tensor"), (PerHead(), "head")):
        clips = (fp8_format(gran), fp8_format(gran, clip=STATIC_MSE_CLIP))
        fams.append(Family(f"fp8 (static, per {what})", "fp8", clips, clips))
    for name, cfg in PRESETS.items():
        if cfg.layers or cfg.heads:  # dtypes with their own skip layers are not searched here
            continue
        fams.append(Family(KV_CACHE_DTYPE[name], KV_CACHE_DTYPE[name], (cfg.k,), (cfg.v,)))
    out = []
    for f in fams:
        try:
            for fmt in {*f.k, *f.v}:
                fmt.check_head_dim(head_dim)
        except ConfigError:
            continue
        out.append(f)
    return tuple(out)


def _layer_bytes(fmt: QuantFormat, n_kv: int, head_dim: int, context: int, settings: CalibrationConfig) -> int:
    """Bytes of one side of one layer in ``fmt`` at ``context`` tokens (vLLM's option, batch 1)."""
    return head_bytes(fmt, VLLM_OPTION, head_dim, context, settings.page_size, "fp16", settings.align, which="k") * n_kv


def cheapest_bits(shape: Any, context: int, settings: CalibrationConfig) -> float:
    """Effective bits of vLLM's cheapest cache dtype kverr expresses, every layer quantized."""
    n, kv, D = shape.n_layers, shape.n_kv_heads, shape.head_dim
    total = min((_layer_bytes(f.k[0], kv, D, context, settings) + _layer_bytes(f.v[0], kv, D, context, settings)) * n
                for f in vllm_families(D))
    return bits_of(total, n, kv, D, context)


@dataclass(frozen=True)
class VllmCalibration:
    """Result of :func:`calibrate_for_vllm`.

    Attributes
    ----------
    configs : dict of float to CacheConfig
        The chosen config of each budget (vLLM serves it: :func:`kverr.engines.vllm.serving`).
    table : pandas.DataFrame
        One row per (budget, dtype, skip rule): ``budget_bits, dtype, kv_cache_dtype,
        skip_rule, skip_layers, effective_bits, predicted`` (the objective's units), ``feasible``
        (within the budget), ``bytes``. Skip rules: ``calibrated`` (the most layers the budget
        allows, those of most damage), ``turboquant-edges`` (the first and last
        :data:`~kverr.engines.vllm_dtypes.TURBOQUANT_EDGE_LAYERS`) and ``calibrated-as-many`` (as many layers as the edges,
        those of most damage: the same memory).
    sensitivity : Sensitivity or None
        The layer sensitivity the damage was weighted by (``objective="kl"``).
    capture : dict
        The capture's provenance.
    seconds : float
        Wall time of the sensitivity and the scoring.
    """

    configs: dict[float, CacheConfig]
    table: Any
    sensitivity: Any
    capture: dict[str, Any]
    seconds: float


def _scored(captures: tuple[Any, ...], settings: CalibrationConfig, configs: list[CacheConfig], *, model: Any,
            sensitivity: Any, progress: bool) -> tuple[Any, int, Any, np.ndarray, tuple, tuple]:
    """Check the captures (:func:`~.search._captures_of`'s), measure the sensitivity if
    ``settings.objective`` is ``kl`` and none is given, and score every config everywhere: ``(ds.kv, context, sensitivity,
    damage, provenances, damage_each)`` with ``damage[config, layer, side]`` (side 0 keys, 1
    values) weighted by the layer's sensitivity. Several captures of one model count alike, as in
    :func:`~.search.calibrate`: the damage and the sensitivity are each capture's averaged
    (``ds.kv`` is the first's; ``provenances`` every capture's and ``damage_each`` each one's
    damage under the averaged weights; both empty for one capture)."""
    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.io import check_finite

    from .objective import layer_damage
    from .search import _check_whole
    from .sensitivity import Sensitivity, check_capture_model, sensitivity_for_capture

    if settings.batch != 1:
        raise ConfigError(f"batch={settings.batch}: the engine targets count one sequence's bytes; "
                          "give batch=1 (kverr's own target counts a batch)")
    several = len(captures) > 1
    kv = captures[0].kv
    if kv.has_sliding_window:
        # the engines' own layouts of a sliding layer (what they free, what they keep unquantized)
        # are not modelled here; kverr's own target counts them
        raise CaptureError("calibration for an engine target supports full-attention models only; the capture "
                           f"has sliding-window layers (windows {list(kv.shape.sliding_windows)}); calibrate "
                           "with --target kverr")
    _check_whole(captures, settings)
    for c in captures:
        check_finite(c, ("q", "k", "v"))
    if settings.objective == "kl" and sensitivity is None:
        model = check_capture_model(captures[0], model or settings.model)
        sensitivity = Sensitivity.mean([
            sensitivity_for_capture(c, model=model, tokens=settings.sensitivity_tokens,
                                    noise=settings.sensitivity_noise, sinks=0, progress=progress)
            for c in captures])
    w = (np.stack([np.asarray(sensitivity.weights_k, dtype=np.float64), np.asarray(sensitivity.weights_v,
                                                                                   dtype=np.float64)], axis=-1)
         if settings.objective == "kl" else np.ones((kv.n_layers, 2)))
    each = [layer_damage(c, configs, queries=settings.queries, decode=settings.decode, progress=progress)
            for c in captures]
    damage = np.mean(each, axis=0)
    provenances = tuple(c.kv.provenance for c in captures) if several else ()
    return (kv, settings.context or kv.n_tokens, sensitivity, damage * w[None], provenances,
            tuple(d * w[None] for d in each) if several else ())


def _provenance(target: str, settings: CalibrationConfig, *, budget: float, effective_bits: float,
                context: int, damage: float, capture: dict[str, Any], sensitivity: Any,
                captures: tuple[dict[str, Any], ...] = (), damage_each: Sequence[float] = (),
                **extra: Any) -> dict[str, Any]:
    """The provenance of a config calibrated for ``target`` (what ``kverr calibrate`` records too;
    with several captures, ``captures`` every one's provenance and ``damage_each`` the config's
    damage on each under the averaged weights, their mean ``damage``)."""
    from .objective import OBJECTIVE_DOC, OBJECTIVE_KL_DOC, OBJECTIVES

    prov = {"tool": f"kverr calibrate --target {target}", "target": target, **extra, "capture": capture,
            **({"captures": [dict(c) for c in captures]} if captures else {}),
            "budget_bits": float(budget), "effective_bits": float(effective_bits), "context_tokens": context,
            "batch": 1, "objective": OBJECTIVES[settings.objective],
            "objective_definition": OBJECTIVE_KL_DOC if settings.objective == "kl" else OBJECTIVE_DOC,
            "predicted_damage": float(damage), "queries_per_layer": settings.queries,
            **({"predicted_damage_each": [float(d) for d in damage_each]} if len(damage_each) else {})}
    if sensitivity is not None:
        prov["sensitivity"] = sensitivity.to_dict()
    return prov


def calibrate_for_vllm(capture: Any, settings: CalibrationConfig, *, progress: bool = False, model: Any = None,
                       sensitivity: Any = None) -> VllmCalibration:
    """Choose, per budget, the vLLM cache dtype and skip layers of least predicted damage.

    ``settings`` gives the budgets, context, queries, objective and the rest as for
    :func:`~.search.calibrate`; its outer options, candidates and window dtype are vLLM's
    (no sinks, no window, keys after RoPE; :func:`vllm_families`). ``capture`` is one capture or
    several of one model, their damage and sensitivity averaged as :func:`~.search.calibrate`
    averages them.

    Raises
    ------
    ConfigError
        A budget below the cheapest vLLM dtype (every layer quantized) at ``context``.
    """
    import time

    import pandas as pd

    from .search import _captures_of

    t0 = time.perf_counter()
    captures = _captures_of(capture)
    D = captures[0].sizes["channel"]
    fams = vllm_families(D)
    fp16 = float_format("fp16")
    cands = tuple(dict.fromkeys([fp16, *(f for fam in fams for f in (*fam.k, *fam.v))]))
    kv, context, sensitivity, damage, provenances, damage_each = _scored(
        captures, settings, [CacheConfig(k=f, v=f, page_size=settings.page_size) for f in cands],
        model=model, sensitivity=sensitivity, progress=progress)
    n_layers, n_kv = kv.n_layers, kv.n_kv_heads
    seconds = time.perf_counter() - t0

    def side(which: str, fmt: QuantFormat, d: np.ndarray = damage) -> np.ndarray:
        """Weighted damage per layer of ``fmt`` on one side, summed over kv heads (of ``d``: the
        mean over the captures, or one capture's)."""
        return d[cands.index(fmt), :, 0 if which == "k" else 1]

    def nbytes(fmt: QuantFormat) -> int:
        return _layer_bytes(fmt, n_kv, D, context, settings)

    keep = side("k", fp16) + side("v", fp16)  # damage of a skipped layer (fp16 rounding: tiny)
    keep_bytes = nbytes(fp16) * 2
    edges = boundary_layers(n_layers)
    rows, plans = [], {}
    for fam in fams:
        dk = np.stack([side("k", f) for f in fam.k])  # [clip, layer]
        dv = np.stack([side("v", f) for f in fam.v])
        ck, cv = dk.argmin(axis=0), dv.argmin(axis=0)  # per layer, the side's best scale rule
        quant = dk.min(axis=0) + dv.min(axis=0)
        q_bytes = nbytes(fam.k[0]) + nbytes(fam.v[0])
        gain_order = np.argsort(-(quant - keep), kind="stable")  # layers where quantizing hurts most first
        forced = edges if fam.boundary else []  # vLLM skips these itself
        free = [int(x) for x in gain_order if int(x) not in forced]
        for budget in settings.budgets:
            budget_bytes = budget_bytes_of(budget, n_layers, n_kv, D, context)
            n_skip = (budget_bytes - q_bytes * n_layers) // (keep_bytes - q_bytes) if keep_bytes > q_bytes else n_layers
            n_skip = int(min(max(n_skip, -1), n_layers))
            if n_skip < len(forced):
                n_skip = -1  # the boundary layers alone are over the budget
            rules = [("calibrated", sorted(forced + free[:max(n_skip - len(forced), 0)])),
                     ("turboquant-edges", edges)]
            if not fam.boundary:  # a boundary dtype cannot choose which layers to skip instead
                rules.append(("calibrated-as-many", sorted(free[:len(edges)])))
            for rule, skip in rules:
                skip_set = set(skip)
                total = sum(keep_bytes if l in skip_set else q_bytes for l in range(n_layers))
                dmg = float(sum(keep[l] if l in skip_set else quant[l] for l in range(n_layers)))
                rows.append(dict(budget_bits=float(budget), dtype=fam.name, kv_cache_dtype=fam.kv_cache_dtype,
                                 skip_rule=rule, skip_layers=tuple(skip),
                                 effective_bits=bits_of(total, n_layers, n_kv, D, context),
                                 predicted=dmg, feasible=bool(n_skip >= 0 and total <= budget_bytes),
                                 bytes=total))
                if rule == "calibrated" and n_skip >= 0:
                    plans[(budget, fam.name)] = (fam, tuple(skip), ck, cv, dmg, total)
    table = pd.DataFrame(rows)
    configs = {}
    for budget in settings.budgets:
        ok = table[(table.budget_bits == float(budget)) & (table.skip_rule == "calibrated") & table.feasible]
        if ok.empty:
            raise ConfigError(f"budget of {budget:g} effective bits is below every vLLM cache dtype kverr "
                              f"expresses at {context} tokens: the cheapest, every layer quantized, costs "
                              f"{cheapest_bits(kv.shape, context, settings):.4f} effective bits")
        best = ok.sort_values("predicted", kind="stable").iloc[0]
        fam, skip, ck, cv, dmg, total = plans[(budget, best["dtype"])]
        each = [float(sum(side("k", fp16, d)[l] + side("v", fp16, d)[l] if l in skip else
                          side("k", fam.k[int(ck[l])], d)[l] + side("v", fam.v[int(cv[l])], d)[l]
                          for l in range(n_layers))) for d in damage_each]  # the choice's damage on each capture
        configs[budget] = _config(fam, skip, ck, cv, n_layers=n_layers, budget=budget, damage=dmg, total=total,
                                  damage_each=each,
                                  context=context, table=table[table.budget_bits == float(budget)],
                                  sensitivity=sensitivity, capture=kv.provenance, settings=settings,
                                  shape=(n_layers, n_kv, D), captures=provenances)
    return VllmCalibration(configs, table, sensitivity, kv.provenance, seconds)


def _config(fam: Family, skip: tuple[int, ...], ck, cv, *, n_layers: int, budget: float, damage: float,
            total: int, context: int, table, sensitivity, capture, settings: CalibrationConfig,
            shape, captures: tuple[dict[str, Any], ...] = (), damage_each: Sequence[float] = ()) -> CacheConfig:
    from collections import Counter

    fp16 = float_format("fp16")
    quantized = [l for l in range(n_layers) if l not in skip]
    dk = Counter(int(ck[l]) for l in quantized).most_common(1)[0][0] if quantized else 0
    dv = Counter(int(cv[l]) for l in quantized).most_common(1)[0][0] if quantized else 0
    layers = {}
    for l in range(n_layers):
        if l in skip:
            layers[l] = Override(k=fp16, v=fp16)
        elif int(ck[l]) != dk or int(cv[l]) != dv:
            layers[l] = Override(k=None if int(ck[l]) == dk else fam.k[int(ck[l])],
                                 v=None if int(cv[l]) == dv else fam.v[int(cv[l])])
    n, kvh, D = shape
    prov = _provenance(
        "vllm", settings, budget=budget, effective_bits=bits_of(total, n, kvh, D, context), context=context,
        damage=damage, capture=capture, captures=captures, damage_each=damage_each, sensitivity=sensitivity,
        kv_cache_dtype=fam.kv_cache_dtype,
        kv_cache_dtype_skip_layers=list(skip), bytes=int(total),
        dtypes_compared=[{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items() if k != "budget_bits"}
                         for r in table.to_dict("records")])
    return CacheConfig(k=fam.k[dk], v=fam.v[dv], layers=layers, page_size=settings.page_size,
                       align=settings.align, name=settings.name or f"vllm-{budget:g}b", provenance=prov)


@dataclass(frozen=True)
class Projection:
    """A config and the nearest one vLLM serves (:func:`project_to_vllm`).

    ``bits`` are effective bits at ``context`` tokens, ``predicted`` the objective's damage on the
    capture (nats of predicted next-token KL with ``objective="kl"``). ``within_budget`` is False
    when vLLM has nothing as small as the config: ``config`` is then vLLM's cheapest choice.
    """

    original: CacheConfig
    config: CacheConfig
    original_bits: float
    bits: float
    original_predicted: float
    predicted: float
    within_budget: bool
    context: int
    above: CacheConfig | None = None


#: How far above the projection :func:`project_to_vllm` looks for a less damaging vLLM config.
PROJECT_MARGIN_BITS = 1.0


def project_to_vllm(capture: Any, config: CacheConfig, settings: CalibrationConfig | None = None, *,
                    model: Any = None, sensitivity: Any = None, progress: bool = False) -> Projection:
    """The config vLLM serves of least predicted damage within ``config``'s effective bits (or,
    when vLLM has nothing that small, its cheapest), and what the projection costs.

    ``settings`` gives the context (default: the config's calibration context, else the
    capture's length), queries and objective; its budgets are ignored. The sensitivity is the
    one recorded in a calibrated config's provenance unless given.
    """
    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.memory import account

    from .objective import predict
    from .sensitivity import Sensitivity

    kv = capture.kv
    prov = config.provenance or {}
    context = (settings.context if settings is not None and settings.context else
               int(prov.get("context_tokens") or kv.n_tokens))
    settings = (settings or CalibrationConfig(budgets=(16.0,))).with_(context=context)
    if sensitivity is None and settings.objective == "kl" and "sensitivity" in prov:
        sensitivity = Sensitivity.from_dict(prov["sensitivity"])
    bits = account(config, kv.shape, context).effective_bits
    # the config's own bits, or (when vLLM has nothing that small) its cheapest
    cheapest = cheapest_bits(kv.shape, context, settings)
    within = bits >= cheapest
    budget = bits if within else cheapest
    res = calibrate_for_vllm(capture, settings.with_(budgets=(budget, budget + PROJECT_MARGIN_BITS)), model=model,
                             sensitivity=sensitivity, progress=progress)
    projected, up = res.configs[budget], res.configs[budget + PROJECT_MARGIN_BITS]
    better = up.provenance["predicted_damage"] < projected.provenance["predicted_damage"]
    sens = res.sensitivity
    weights = None if sens is None else (sens.weights_k, sens.weights_v)
    pred = predict(capture, config, queries=settings.queries, decode=settings.decode,
                   weights=None if weights is None else weights[0], weights_v=None if weights is None else weights[1])
    return Projection(config, projected.with_(name=f"{config.name or 'config'}-vllm"), bits,
                      projected.provenance["effective_bits"], pred["total"],
                      projected.provenance["predicted_damage"], within, context,
                      up.with_(name=f"{config.name or 'config'}-vllm-above") if better else None)


# --------------------------------------------------------------------------------------------
# transformers' QuantizedCache
# --------------------------------------------------------------------------------------------

#: Residual buffer lengths tried for transformers' integer backends (tokens).
HF_RESIDUALS = (0, 32, 64, 128)
#: Channel groups tried (those dividing the head dim).
HF_GROUPS = (32, 64, 128)


def hf_candidates(head_dim: int) -> dict[str, CacheConfig]:
    """The configs transformers' ``QuantizedCache`` runs, by a name giving backend, bits, group
    and residual length: its presets (:mod:`kverr.engines.hf`) with every group dividing the
    head dim and every residual length of :data:`HF_RESIDUALS` (the residual buffer counted as
    kverr's window of that many tokens, its largest size)."""
    from dataclasses import replace

    from kverr.engines.hf import PRESETS
    from kverr.quant.formats import PerTokenGroup

    out = {}
    for name, cfg in PRESETS.items():
        if cfg.k.dtype != "int":
            out[name] = cfg
            continue
        for g in HF_GROUPS:
            if head_dim % g:
                continue
            fk, fv = replace(cfg.k, granularity=PerTokenGroup(g)), replace(cfg.v, granularity=PerTokenGroup(g))
            for r in HF_RESIDUALS:
                out[f"{name}-g{g}-r{r}"] = cfg.with_(k=fk, v=fv, window=r, name=None)
    return out


@dataclass(frozen=True)
class HfCalibration:
    """Result of :func:`calibrate_for_hf`: the chosen config per budget, and ``table``, one row
    per candidate (``candidate, effective_bits, predicted``, by increasing bits)."""

    configs: dict[float, CacheConfig]
    table: Any
    sensitivity: Any
    capture: dict[str, Any]
    seconds: float


def calibrate_for_hf(capture: Any, settings: CalibrationConfig, *, model: Any = None, sensitivity: Any = None,
                     progress: bool = False) -> HfCalibration:
    """Choose, per budget, transformers' ``QuantizedCache`` settings (backend, bits, group size,
    residual length) of least predicted damage, with the calibration objective: every candidate
    of :func:`hf_candidates` is scored whole (one format for every layer, head, keys and values,
    as ``QuantizedCache`` stores it) and counted at ``settings.context`` tokens. ``capture`` is
    one capture or several of one model (:func:`calibrate_for_vllm`).

    Raises
    ------
    ConfigError
        A budget below every candidate.
    """
    import time

    import pandas as pd

    from kverr.memory import account

    from .search import _captures_of

    t0 = time.perf_counter()
    captures = _captures_of(capture)
    cands = hf_candidates(captures[0].sizes["channel"])
    kv, context, sensitivity, damage, provenances, damage_each = _scored(
        captures, settings, list(cands.values()), model=model, sensitivity=sensitivity, progress=progress)
    total = damage.sum(axis=(1, 2))
    rows = [dict(candidate=name, effective_bits=account(cfg, kv.shape, context).effective_bits, predicted=float(d))
            for (name, cfg), d in zip(cands.items(), total)]
    table = pd.DataFrame(rows).sort_values(["effective_bits", "predicted"], kind="stable").reset_index(drop=True)
    configs = {}
    for budget in settings.budgets:
        ok = table[table.effective_bits <= budget]
        if ok.empty:
            raise ConfigError(f"budget of {budget:g} effective bits is below every QuantizedCache setting kverr "
                              f"expresses at {context} tokens (the cheapest costs {table.effective_bits.min():.4f})")
        best = ok.sort_values("predicted", kind="stable").iloc[0]
        prov = _provenance("hf", settings, budget=budget, effective_bits=best["effective_bits"], context=context,
                           damage=best["predicted"], capture=kv.provenance, captures=provenances,
                           damage_each=[float(d[list(cands).index(best["candidate"])].sum()) for d in damage_each],
                           sensitivity=sensitivity,
                           candidate=best["candidate"], candidates_compared=len(table))
        configs[budget] = cands[best["candidate"]].with_(name=settings.name or f"hf-{budget:g}b", provenance=prov)
    return HfCalibration(configs, table, sensitivity, kv.provenance, time.perf_counter() - t0)
