"""What a cache format does to the model's real output, side by side with today's formats.

Protocol (:func:`evaluate`), for every text segment and prefill length ``P``:

1. prefill ``P`` tokens of real text into the cache (their own attention uses fresh values, as
   in a serving engine); then, by default, quantize everything the cache holds
   (``prefill_policy="all"``: the window applies to decode tokens only, which is what
   transformers' quantized cache does); ``"window"`` keeps the config's window instead;
2. teacher-forced decode ``N`` tokens one at a time through the cache;
3. compare each step's next-token distribution with the same model and an unquantized cache:
   KL(p_ref ‖ p), top-1 agreement, negative log-likelihood of the true next token;
4. greedy generation of ``N`` tokens from the same prompt, with and without quantization: the
   first step at which the tokens differ (the number of greedy steps when they never do).

Schemes: every kverr config (presets or JSON files), and the peers — transformers'
``QuantizedCache`` with the quanto backend (``quanto-int4``, ``quanto-int2``: group 64,
residual 128) — each at its effective bits including metadata.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kverr.config import PRESETS, CacheConfig, resolve
from kverr.exceptions import ConfigError, TextError
from kverr.memory import ModelShape, account
from kverr.quant import PerTokenGroup, int_format

log = logging.getLogger(__name__)

PEERS = {"quanto-int4": 4, "quanto-int2": 2}
QUANTO_GROUP, QUANTO_RESIDUAL = 64, 128


@dataclass(frozen=True)
class Scheme:
    """A cache to evaluate: a kverr config, a quanto peer, or the unquantized reference."""

    name: str
    kind: str  # "kverr" | "quanto" | "reference"
    config: CacheConfig | None = None
    nbits: int | None = None

    def equivalent_config(self, model_dtype: torch.dtype) -> CacheConfig | None:
        """A kverr config that stores what this scheme stores (for effective bits)."""
        if self.kind == "kverr":
            return self.config
        if self.kind == "quanto":
            # quanto keeps scale and shift in the model's dtype, per 64 channels of a token.
            sdt = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model_dtype, "fp32")
            fmt = int_format(self.nbits, PerTokenGroup(QUANTO_GROUP), scale_dtype=sdt)
            return CacheConfig(k=fmt, v=fmt, window=QUANTO_RESIDUAL, name=self.name)
        return None


def parse_schemes(schemes: Iterable[str] = (), configs: Iterable[str] = (), *,
                  config_option: str | None = "--config") -> list[Scheme]:
    """``--scheme NAME`` (preset or peer) and ``--config PATH`` -> schemes, in order, no duplicates.

    ``config_option`` is the option that gives config files in the calling command, named in
    error messages; None when the command has none.
    """
    from kverr.engines import engine_presets

    hint = f" (give a config file with {config_option})" if config_option else ""
    named = {**PRESETS, **engine_presets()}
    out: list[Scheme] = []
    for s in schemes:
        if s in PEERS:
            out.append(Scheme(s, "quanto", nbits=PEERS[s]))
        elif s in named:
            out.append(Scheme(s, "kverr", named[s]))
        else:
            raise ConfigError(
                f"--scheme {s!r} is not known; schemes: {', '.join([*named, *PEERS])}{hint}"
            )
    for path in configs:
        cfg = resolve(path)
        out.append(Scheme(cfg.name or Path(path).stem, "kverr", cfg))
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"scheme {sorted(dup)[0]!r} is given twice")
    if not out:
        raise ConfigError(f"give at least one --scheme{' or ' + config_option if config_option else ''}")
    return out


def make_cache(scheme: Scheme, model: Any) -> Any:
    """A fresh cache object for ``scheme``."""
    if scheme.kind == "kverr":
        from kverr.hf import cache_for

        return cache_for(model, scheme.config)  # the kernel path on a GPU, the reference on a CPU
    from transformers import DynamicCache

    if scheme.kind == "reference":
        return DynamicCache()
    from transformers import QuantizedCache

    return QuantizedCache(
        backend="quanto",
        config=model.config,
        nbits=scheme.nbits,
        axis_key=0,
        axis_value=0,
        q_group_size=QUANTO_GROUP,
        residual_length=QUANTO_RESIDUAL,
    )


@torch.no_grad()
def teacher_forced(model: Any, cache: Any, ids: torch.Tensor, prefill: int, *, flush: bool) -> torch.Tensor:
    """Log-probabilities of the decode steps: ``[N, vocab]`` float64 for ``ids [prefill + N + 1]``.

    Decode step ``t`` feeds ``ids[prefill + t]`` and predicts ``ids[prefill + t + 1]``. The
    prefill's own prediction is not a decode step (its attention used fresh values) and is left out.
    """
    from kverr.hf import cache_kwarg

    kw = cache_kwarg(model)
    model(ids[None, :prefill], use_cache=True, **{kw: cache})
    if flush and hasattr(cache, "flush"):
        cache.flush()
    rows = []
    for t in range(prefill, ids.shape[0] - 1):
        out = model(ids[None, t : t + 1], use_cache=True, **{kw: cache})
        rows.append(torch.log_softmax(out.logits[0, -1].double(), -1))
    return torch.stack(rows)


@torch.no_grad()
def greedy(model: Any, cache: Any, prompt: torch.Tensor, steps: int, *, flush: bool) -> list[int]:
    """Greedy continuation of ``prompt`` for ``steps`` tokens through ``cache``."""
    from kverr.hf import cache_kwarg

    kw = cache_kwarg(model)
    out = model(prompt[None], use_cache=True, **{kw: cache})
    if flush and hasattr(cache, "flush"):
        cache.flush()
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]], device=prompt.device), use_cache=True, **{kw: cache})
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Metrics of decode log-probs ``logp`` against the reference, ``[N, vocab]`` each."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0.0).numpy()
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1).numpy()
    ref_nll = -ref_logp.gather(-1, targets[:, None]).squeeze(-1).numpy()
    return {
        "mean_kl": float(kl.mean()),
        "p50_kl": float(np.percentile(kl, 50)),
        "p99_kl": float(np.percentile(kl, 99)),
        "max_kl": float(kl.max()),
        "top1": float((logp.argmax(-1) == ref_logp.argmax(-1)).double().mean()),
        "ppl": float(math.exp(nll.mean())),
        "ppl_ref": float(math.exp(ref_nll.mean())),
    }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token, or -1 if the sequences agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1


def segment_offsets(start: int, n_segments: int, length: int) -> list[int]:
    """Token offsets of ``n_segments`` disjoint segments of ``length`` tokens from ``start``."""
    return [start + i * length for i in range(n_segments)]


def segment_jobs(loaded: Any, text: Any, *, prefill: Sequence[int], decode: int, segments: int,
                 offset: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """The token ids of every (prefill, segment) run of :func:`evaluate`, checked first.

    The text is tokenized once per prefill length and every segment is checked against the
    model's context and the text's length, so that a request that cannot be met fails in
    seconds, before any model work.

    Parameters
    ----------
    loaded
        A :class:`kverr.capturing.LoadedModel` (its tokenizer and context length).
    text
        A :class:`kverr.capturing.Text`.
    prefill, decode, segments, offset
        As in :func:`evaluate`.

    Returns
    -------
    list of tuple
        ``(prefill, segment, offset, ids [prefill + decode + 1])`` per run.

    Raises
    ------
    ConfigError
        ``prefill + decode`` exceeds the model's context.
    TextError
        The text is too short for ``segments`` segments from ``offset``.
    """
    from kverr.capturing.text import tokenize_windows

    for p in prefill:
        if loaded.max_context and p + decode > loaded.max_context:
            raise ConfigError(f"prefill {p} + decode {decode} exceeds the model's context of {loaded.max_context}")
    jobs = []
    for p in prefill:
        length = p + decode + 1
        offsets = segment_offsets(offset, segments, length)
        try:
            windows = tokenize_windows(loaded.tokenizer, text, length, offsets, what="segment")
        except TextError as exc:
            raise TextError(
                f"{segments} segment(s) of prefill {p} + decode {decode} + 1 tokens from offset {offset} "
                f"need {offset + segments * length} tokens: {exc}"
            ) from None
        jobs += [(p, i, off, torch.as_tensor(ids)) for i, (off, ids) in enumerate(zip(offsets, windows))]
    return jobs


def evaluate(
    loaded: Any,
    text: Any,
    schemes: Sequence[Scheme],
    *,
    prefill: Sequence[int] = (1024,),
    decode: int = 128,
    segments: int = 1,
    offset: int = 5000,
    prefill_policy: str = "all",
    greedy_steps: int | None = None,
    progress: bool = True,
    on_row: Any = None,
):
    """Run the protocol; returns a pandas DataFrame, one row per (scheme, prefill, segment).

    Parameters
    ----------
    loaded
        A :class:`kverr.capturing.LoadedModel`.
    text
        A :class:`kverr.capturing.Text`.
    schemes
        What to evaluate (:func:`parse_schemes`).
    prefill
        Prefill lengths ``P`` (context lengths).
    decode
        Teacher-forced decode steps ``N``.
    segments
        Disjoint text segments per prefill length, starting at token ``offset``.
    prefill_policy
        ``"all"`` quantizes everything after prefill; ``"window"`` keeps the config's window.
    greedy_steps
        Greedy steps for the first-divergence metric (default ``decode``; 0 skips it).
    on_row
        Called with the list of rows so far after every (scheme, prefill, segment), so that a
        long run can save what it has measured (the CLI rewrites its per-segment CSV each time).
    """
    import pandas as pd

    from kverr.progress import progress as progress_bar

    if prefill_policy not in ("all", "window"):
        raise ConfigError(f"prefill_policy={prefill_policy!r} is not allowed; 'all' or 'window'")
    if decode < 1 or segments < 1 or any(p < 1 for p in prefill):
        raise ConfigError("prefill, decode and segments must be at least 1")
    model = loaded.model
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim, loaded.model_id, loaded.max_context)
    for s in schemes:
        if s.config is not None:
            s.config.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
            if (dict(s.config.provenance).get("capture") or {}).get("weights_sha256"):
                from kverr.config import check_model_matches

                check_model_matches(s.config, loaded.weights_sha256, loaded.model_id)
    g_steps = decode if greedy_steps is None else greedy_steps
    jobs = segment_jobs(loaded, text, prefill=prefill, decode=decode, segments=segments, offset=offset)
    flush = prefill_policy == "all"
    reference = Scheme("reference", "reference")
    rows = []
    bar = progress_bar(total=len(jobs) * (len(schemes) + 1), desc="evaluate", enabled=progress, unit="run")
    for p, seg, off, ids in jobs:
        bar.set_postfix_str(f"P={p} seg={seg} reference")
        ref_logp = teacher_forced(model, make_cache(reference, model), ids, p, flush=False)
        ref_greedy = greedy(model, make_cache(reference, model), ids[:p], g_steps, flush=False) if g_steps else []
        bar.update()
        targets = ids[p + 1 :]
        for s in schemes:
            bar.set_postfix_str(f"P={p} seg={seg} {s.name}")
            cache = make_cache(s, model)
            logp = teacher_forced(model, cache, ids, p, flush=flush)
            row = {"scheme": s.name, "kind": s.kind, "prefill": p, "decode": decode, "segment": seg, "offset": off}
            eq = s.equivalent_config(model.dtype)
            # What the cache held at the end of this run: the P + N tokens fed, the prefill
            # quantized whole when the run flushed it (teacher_forced flushes caches that can;
            # quanto always quantizes its prefill whole).
            whole = (flush and hasattr(cache, "flush")) or s.kind == "quanto"
            rep = account(eq, shape, p + decode, prefill_quantized=p if whole else 0)
            row["effective_bits"] = rep.effective_bits
            row["cache_bytes"] = rep.total_bytes
            if s.kind == "kverr":
                row["measured_cache_bytes"] = cache.nbytes()
            row.update(compare(ref_logp, logp, targets))
            row["ppl_delta"] = row["ppl"] - row["ppl_ref"]
            if g_steps:
                # No divergence within the greedy steps counts as g_steps (a lower bound), so
                # that means over segments stay meaningful.
                div = first_divergence(ref_greedy, greedy(model, make_cache(s, model), ids[:p], g_steps, flush=flush))
                row["first_divergence"] = g_steps if div < 0 else div
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            bar.update()
            log.info("%s P=%d seg=%d: mean KL %.4g top-1 %.3f", s.name, p, seg, row["mean_kl"], row["top1"])
    bar.close()
    return pd.DataFrame(rows)


def summarize_schemes(df: Any) -> Any:
    """Mean (and spread over segments) per (scheme, prefill), ordered by effective bits."""
    metrics = ["effective_bits", "mean_kl", "p50_kl", "p99_kl", "top1", "ppl", "ppl_ref", "ppl_delta"]
    if "first_divergence" in df:
        metrics.append("first_divergence")
    g = df.groupby(["scheme", "prefill"], sort=False)
    out = g[metrics].mean()
    spread = g[["mean_kl", "top1", "ppl_delta"]].std(ddof=0).add_suffix("_std")
    out = out.join(spread)
    out["segments"] = g.size()
    out = out.reset_index()
    out["ppl_fp16"] = out["ppl_ref"]  # the unquantized cache of the model's own dtype
    return out.sort_values(["prefill", "effective_bits"]).reset_index(drop=True)


def plot_kl_vs_bits(summary: Any, path: str | Path) -> Path:
    """Mean next-token KL against effective bits (log scale), one marker per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    data = summary.copy()
    data["context"] = data["prefill"].astype(str)
    sns.scatterplot(data=data, x="effective_bits", y="mean_kl", hue="scheme", style="context", s=70, ax=ax)
    for _, r in data.iterrows():
        ax.annotate(r["scheme"], (r["effective_bits"], r["mean_kl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (metadata, window and pages included)")
    ax.set_ylabel("mean next-token KL vs unquantized cache")
    ax.set_title("KV-cache formats: damage against memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    from kverr.io import atomic_write

    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    finally:
        plt.close(fig)
