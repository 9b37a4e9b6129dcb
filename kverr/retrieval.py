"""Retrieval through a quantized cache: a pass key hidden in a haystack of real text.

Protocol (:func:`evaluate_passkey`), for every context length ``C``, depth ``d`` and trial:

1. a haystack of ``C`` tokens minus the needle and the question, cut from the text at an offset
   drawn for the trial; the needle ``"\\nThe secret pass key is NNNNN. Remember it.\\n"`` (a
   five-digit key drawn for the trial) goes in at depth ``d`` of the haystack, moved to the nearest
   line start within :data:`SNAP` tokens so that it does not split a line; the question
   ``"\\nThe secret pass key is"`` ends the prompt. With ``keys=k > 1`` (the multi-key variant) the
   haystack holds ``k`` needles, ``"... pass key of the <name> door is NNNNN ..."`` with distinct
   names and keys, the asked one at depth ``d`` and the others at depths drawn for the trial, and
   the question names the asked door;
2. the prompt but its last token is prefilled into each cache, which then quantizes everything it
   holds (as ``kverr evaluate`` does with ``prefill_policy="all"``); the last prompt token is the
   first decode step, so that every answer token, the first included, reads the key through the
   quantized cache (a serving engine's prefill attention sees the fresh prompt; a question asked
   in a later turn does not);
3. the key's tokens are decoded teacher-forced: the greedy answer is the key exactly when at
   every step the key's next token is the argmax given the key's previous ones, so one pass gives
   the greedy verdict (``correct``), the key's negative log-likelihood (``key_nll``, which moves
   before the verdict does) and the KL of each answer step against the unquantized cache.

Accuracy is a binomial proportion over trials; :func:`summarize_passkey` gives Wilson 95 %
intervals. ``kept`` is the fraction of the trials the unquantized cache answers that the scheme
still answers: a small model misses some keys with any cache, and those misses say nothing of the
format.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kverr.exceptions import ConfigError, TextError

log = logging.getLogger(__name__)

__all__ = ["PasskeyTrial", "check_passkey_request", "evaluate_passkey", "passkey_trials", "plot_passkey",
           "summarize_passkey", "wilson_interval"]

NEEDLE = "\nThe secret pass key is {key}. Remember it.\n"
QUESTION = "\nThe secret pass key is"
NEEDLE_NAMED = "\nThe secret pass key of the {name} door is {key}. Remember it.\n"
QUESTION_NAMED = "\nThe secret pass key of the {name} door is"
#: The doors of the multi-key variant (one word each, distinct).
NAMES = ("red", "blue", "green", "yellow", "black", "white", "brown", "orange", "purple", "grey")
#: A needle moves to the nearest line start at most this many tokens away from its depth.
SNAP = 32
#: At least this many haystack tokens per needle: shorter contexts are refused.
MIN_HAYSTACK = 64


@dataclass(frozen=True)
class PasskeyTrial:
    """One prompt: token ids, where the asked key went, and the key's tokens.

    Attributes
    ----------
    context : int
        Prompt tokens (BOS, haystack, needles and question).
    depth : float
        The asked needle's requested depth, 0 (start of the haystack) to 1 (its end).
    trial : int
        Index of the trial at this context and depth.
    key : str
        The asked five-digit key.
    offset : int
        First text token of the haystack.
    needle_depth : float
        Where the asked needle went: haystack tokens before it over haystack tokens.
    prompt : torch.Tensor
        ``[context]`` int64 token ids.
    answer : torch.Tensor
        The key's token ids as the prompt continues (``" NNNNN"``).
    keys : int
        Needles in the prompt (1: the single-key task).
    """

    context: int
    depth: float
    trial: int
    key: str
    offset: int
    needle_depth: float
    prompt: torch.Tensor
    answer: torch.Tensor
    keys: int = 1

    @property
    def ids(self) -> torch.Tensor:
        """Prompt and answer, ``[context + len(answer)]``."""
        return torch.cat([self.prompt, self.answer])


def _line_starts(tokenizer: Any, ids: Sequence[int]) -> np.ndarray:
    """Indices ``i`` such that token ``i - 1`` ends a line (0 included): where a needle can go."""
    pieces = tokenizer.batch_decode([[t] for t in ids])
    return np.array([0] + [i + 1 for i, p in enumerate(pieces) if p.endswith("\n")], dtype=np.int64)


def _snap(at: int, starts: np.ndarray) -> int:
    """The line start nearest ``at`` if one is within :data:`SNAP` tokens, else ``at``."""
    near = starts[np.abs(starts - at) <= SNAP]
    return int(near[np.argmin(np.abs(near - at))]) if near.size else at


def check_passkey_request(contexts: Sequence[int], depths: Sequence[float], trials: int, keys: int,
                          max_context: int = 0) -> None:
    """What a pass-key request can be refused for without the tokenizer (:func:`passkey_trials`
    checks it first; the command line before loading the model).

    Raises
    ------
    ConfigError
        No context or depth, a depth outside 0–1, a context over ``max_context`` (0: no limit),
        ``trials`` below 1, ``keys`` outside 1 to ``len(NAMES)``.
    """
    if trials < 1:
        raise ConfigError(f"trials must be at least 1, got {trials}")
    if not 1 <= keys <= len(NAMES):
        raise ConfigError(f"keys must be 1 to {len(NAMES)} (one needle per door name), got {keys}")
    if not contexts or not depths:
        raise ConfigError("give at least one context and one depth")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"depth {100 * d:g} % is outside 0-100 %")
    for c in contexts:
        if max_context and c > max_context:
            raise ConfigError(f"context {c} exceeds the model's context of {max_context} tokens")


def passkey_trials(
    tokenizer: Any,
    text: Any,
    *,
    contexts: Sequence[int],
    depths: Sequence[float],
    trials: int,
    keys: int = 1,
    seed: int = 0,
    max_context: int = 0,
) -> list[PasskeyTrial]:
    """The prompts of a pass-key run, every one checked before any is returned.

    A trial's key, haystack offset and other needles' depths are drawn from a generator seeded
    with ``(seed, context, depth in 1/1000, trial)``: the same trial gets the same prompt whatever
    else is asked for.

    Parameters
    ----------
    tokenizer
        The model's tokenizer.
    text
        A :class:`kverr.capturing.Text` (or str): the haystack's source.
    contexts
        Prompt lengths in tokens.
    depths
        Depths of the asked needle, fractions 0 to 1.
    trials
        Prompts per context and depth.
    keys
        Needles per prompt (1: the single-key task; more: the multi-key variant, at most
        ``len(NAMES)``).
    seed
        Seed of the draws.
    max_context
        The model's context limit (0: none).

    Raises
    ------
    ConfigError
        A depth outside 0–1, a context over the model's limit or too short for the needles,
        ``trials`` or ``keys`` out of range.
    TextError
        The text is shorter than a haystack.
    """
    from kverr.capturing.text import Text, adds_bos

    check_passkey_request(contexts, depths, trials, keys, max_context)

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    body = text.text if isinstance(text, Text) else text
    source = text.source if isinstance(text, Text) else "the text"
    hay_ids = encode(body)
    out = []
    for c in contexts:
        for d in depths:
            for t in range(trials):
                rng = np.random.default_rng([seed, c, round(1000 * d), t])
                digits = rng.choice(np.arange(10000, 100000), size=keys, replace=False)
                names = [NAMES[i] for i in rng.permutation(len(NAMES))[:keys]]
                if keys == 1:
                    needles = [encode(NEEDLE.format(key=digits[0]))]
                    q_text = QUESTION
                else:
                    needles = [encode(NEEDLE_NAMED.format(name=n, key=k)) for n, k in zip(names, digits)]
                    q_text = QUESTION_NAMED.format(name=names[0])
                question = encode(q_text)
                n_hay = c - len(bos) - sum(map(len, needles)) - len(question)
                if n_hay < MIN_HAYSTACK * keys:
                    raise ConfigError(
                        f"context {c} leaves {max(n_hay, 0)} haystack tokens for {keys} needle(s); give a "
                        f"context of at least {c - n_hay + MIN_HAYSTACK * keys} tokens")
                if len(hay_ids) < n_hay:
                    raise TextError(f"{source} has {len(hay_ids)} tokens; a context of {c} needs a haystack of "
                                    f"{n_hay}: give a longer text or a shorter context")
                offset = int(rng.integers(0, len(hay_ids) - n_hay + 1))
                hay = hay_ids[offset : offset + n_hay]
                starts = _line_starts(tokenizer, hay)
                where = [_snap(round(d * n_hay), starts)]
                where += [_snap(int(x), starts) for x in rng.integers(0, n_hay + 1, size=keys - 1)]
                # Needles at the same place go in the order drawn; later ones after earlier ones.
                order = sorted(range(keys), key=lambda i: (where[i], i))
                prompt, prev = list(bos), 0
                for i in order:
                    prompt += hay[prev : where[i]] + needles[i]
                    prev = where[i]
                prompt += hay[prev:] + question
                asked = encode(q_text + f" {digits[0]}")
                answer = asked[len(question):]
                if asked[: len(question)] != question or not answer:
                    raise ConfigError("the tokenizer merges the question with its answer; the pass-key task "
                                      "needs them apart")
                if max_context and c + len(answer) > max_context:
                    raise ConfigError(f"context {c} and the key's {len(answer)} answer tokens exceed the model's "
                                      f"context of {max_context} tokens; give a context of at most "
                                      f"{max_context - len(answer)}")
                assert len(prompt) == c, (len(prompt), c)
                out.append(PasskeyTrial(c, float(d), t, str(digits[0]), offset, where[0] / n_hay,
                                        torch.as_tensor(prompt, dtype=torch.int64),
                                        torch.as_tensor(answer, dtype=torch.int64), keys))
    return out


def evaluate_passkey(
    loaded: Any,
    trials: Sequence[PasskeyTrial],
    schemes: Sequence[Any],
    *,
    static_scales: dict[str, Any] | None = None,
    progress: bool = True,
    on_row: Any = None,
):
    """Run every trial through the unquantized cache and each scheme's; a pandas DataFrame, one
    row per (scheme, trial), trial by trial, each trial's unquantized row (scheme
    ``"unquantized"``) before its schemes'.

    Columns: ``scheme, kind, context, depth, needle_depth, trial, offset, key, keys, correct,
    ref_correct, key_nll, ref_key_nll, answer_kl, first_wrong`` (the first key token that is not
    the argmax, -1 when none), ``effective_bits`` (the cache after prompt and answer, the prompt
    quantized whole).

    Parameters
    ----------
    loaded
        A :class:`kverr.capturing.LoadedModel`.
    trials
        From :func:`passkey_trials`.
    schemes
        :class:`kverr.evaluation.Scheme` objects.
    static_scales
        ``scheme name -> scales`` as :func:`kverr.evaluation.read_scales` gives them.
    on_row
        Called with the rows so far after every (scheme, trial).
    """
    import pandas as pd

    from kverr.evaluation import Scheme, compare, make_cache, teacher_forced
    from kverr.progress import progress as progress_bar

    model = loaded.model
    shape = loaded.shape
    for s in schemes:
        if s.config is not None:
            s.config.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
    given = static_scales or {}
    reference = Scheme("unquantized", "reference")
    ref_bits = float(torch.finfo(model.dtype).bits)
    rows: list[dict] = []
    bar = progress_bar(total=len(trials) * (len(schemes) + 1), desc="passkey", enabled=progress, unit="run")

    def verdict(logp: torch.Tensor, answer: torch.Tensor) -> tuple[bool, float, int]:
        hit = (logp.argmax(-1) == answer).numpy()
        nll = float(-logp.gather(-1, answer[:, None]).sum())
        return bool(hit.all()), nll, int(np.argmin(hit)) if not hit.all() else -1

    for tr in trials:
        ids, p = tr.ids, tr.context - 1
        common = {"context": tr.context, "depth": tr.depth, "needle_depth": tr.needle_depth, "trial": tr.trial,
                  "offset": tr.offset, "key": tr.key, "keys": tr.keys}
        bar.set_postfix_str(f"C={tr.context} d={tr.depth:g} #{tr.trial} unquantized")
        ref_logp = teacher_forced(model, make_cache(reference, model), ids, p, flush=False)
        ref_ok, ref_nll, ref_wrong = verdict(ref_logp, tr.answer)
        rows.append({"scheme": reference.name, "kind": reference.kind, **common, "correct": ref_ok,
                     "ref_correct": ref_ok, "key_nll": ref_nll, "ref_key_nll": ref_nll, "answer_kl": 0.0,
                     "first_wrong": ref_wrong, "effective_bits": ref_bits})
        if on_row is not None:
            on_row(rows)
        bar.update()
        for s in schemes:
            bar.set_postfix_str(f"C={tr.context} d={tr.depth:g} #{tr.trial} {s.name}")
            logp = teacher_forced(model, make_cache(s, model, given.get(s.name)), ids, p, flush=True)
            ok, nll, wrong = verdict(logp, tr.answer)
            m = compare(ref_logp, logp, tr.answer)
            rep = s.account(model.dtype, shape, ids.shape[0] - 1, prefill_quantized=p)
            rows.append({"scheme": s.name, "kind": s.kind, **common, "correct": ok, "ref_correct": ref_ok,
                         "key_nll": nll, "ref_key_nll": ref_nll, "answer_kl": m["mean_kl"], "first_wrong": wrong,
                         "effective_bits": rep.effective_bits})
            if on_row is not None:
                on_row(rows)
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


def wilson_interval(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (``hits`` of ``n``)."""
    from scipy.stats import binomtest

    if n == 0:
        return float("nan"), float("nan")
    ci = binomtest(int(hits), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def summarize_passkey(df: Any, by: Sequence[str] = ("scheme", "context")) -> Any:
    """Accuracy per group with its Wilson 95 % interval, ``kept`` (accuracy on the trials the
    unquantized cache answers), mean key NLL and its increase over the unquantized cache, mean
    answer KL, effective bits and trials; ordered by context and effective bits."""
    by = list(by)
    rows = []
    for key, g in df.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        n, hits = len(g), int(g["correct"].sum())
        lo, hi = wilson_interval(hits, n)
        base = g[g["ref_correct"].astype(bool)]
        rows.append({**dict(zip(by, key)), "kind": g["kind"].iloc[0], "effective_bits": g["effective_bits"].mean(),
                     "accuracy": hits / n, "accuracy_lo": lo, "accuracy_hi": hi,
                     "kept": base["correct"].mean() if len(base) else float("nan"),
                     "key_nll": g["key_nll"].mean(), "key_nll_delta": (g["key_nll"] - g["ref_key_nll"]).mean(),
                     "answer_kl": g["answer_kl"].mean(), "trials": n})
    import pandas as pd

    out = pd.DataFrame(rows)
    order = [c for c in ("context", "depth") if c in by] + ["effective_bits"]
    return out.sort_values(order).reset_index(drop=True)


def plot_passkey(df: Any, path: Any) -> Any:
    """Two panels: accuracy against effective bits (Wilson 95 % bars, one marker per scheme and
    context), and accuracy against the needle's depth per scheme (all contexts pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt
    import seaborn as sns

    from kverr.io import atomic_write

    path = Path(path)
    s = summarize_passkey(df)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    palette = dict(zip(s["scheme"].unique(), sns.color_palette("husl", s["scheme"].nunique())))
    from itertools import cycle

    markers = dict(zip(sorted(s["context"].unique()), cycle("osD^v<>ph*")))
    for _, r in s.iterrows():
        a1.errorbar(r["effective_bits"], r["accuracy"],
                    yerr=[[r["accuracy"] - r["accuracy_lo"]], [r["accuracy_hi"] - r["accuracy"]]],
                    fmt=markers[r["context"]], color=palette[r["scheme"]], capsize=2, ms=6)
        a1.annotate(r["scheme"], (r["effective_bits"], r["accuracy"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("effective bits per element (log scale)")
    a1.set_ylabel("pass-key accuracy (Wilson 95 %)")
    a1.set_ylim(-0.05, 1.05)
    a1.set_title("contexts: " + ", ".join(f"{m} {c}" for c, m in markers.items()), fontsize=9)
    a1.grid(True, alpha=0.3)
    d = summarize_passkey(df, by=("scheme", "depth"))
    d["depth %"] = 100 * d["depth"]
    sns.lineplot(data=d, x="depth %", y="accuracy", hue="scheme", palette=palette, marker="o", ax=a2)
    a2.set_ylim(-0.05, 1.05)
    a2.set_ylabel("accuracy (all contexts)")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7, ncol=2)
    fig.suptitle("Pass-key retrieval through the quantized cache")
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    finally:
        plt.close(fig)
