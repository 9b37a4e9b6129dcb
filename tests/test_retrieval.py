"""Pass-key retrieval: the prompts, the verdict, the summary and the CLI, on a tiny random model.

A random model answers no key, so the verdict is tested on answers the model does give: its own
greedy continuation of a prompt (correct by construction) and that continuation with one token
changed (wrong from that token on).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pandas as pd
import pytest
import torch

from kverr.capturing.text import Text
from kverr.cli import main
from kverr.config import CacheConfig
from kverr.evaluation import Scheme, greedy, parse_schemes
from kverr.exceptions import ConfigError, TextError
from kverr.quant import float_format
from kverr.retrieval import (
    MIN_HAYSTACK,
    SNAP,
    evaluate_passkey,
    passkey_trials,
    summarize_passkey,
    wilson_interval,
)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


def _text(n_lines=400):
    import random

    rng = random.Random(0)
    words = ["cache", "key", "value", "softmax", "token", "layer", "head", "scale", "bits", "error"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) for _ in range(n_lines)]
    return Text(text="\n".join(lines), source="words", sha256="0" * 64)


def _needle_positions(tok, prompt):
    """(start token, key) of every needle in a prompt, found by decoding prefixes."""
    text = tok.decode(prompt)
    found = []
    for m in re.finditer(r"\nThe secret pass key (?:of the (\w+) door )?is (\d{5})\. Remember it\.\n", text):
        # the first token whose decoded prefix reaches the needle's start
        start = next(i for i in range(len(prompt) + 1) if len(tok.decode(prompt[:i])) > m.start()) - 1
        found.append((start, m.group(2), m.group(1)))
    return found


def test_prompts_hold_the_key_at_the_depth_asked(tiny):
    _, lm = tiny
    tok = lm.tokenizer
    contexts, depths = [200, 320], [0.0, 0.5, 1.0]
    trials = passkey_trials(tok, _text(), contexts=contexts, depths=depths, trials=2, max_context=lm.max_context)
    assert len(trials) == len(contexts) * len(depths) * 2
    for t in trials:
        assert t.prompt.shape == (t.context,)
        assert tok.decode(t.prompt).endswith("\nThe secret pass key is")
        assert tok.decode(t.answer).strip() == t.key and len(t.key) == 5
        (start, key, _), = _needle_positions(tok, t.prompt.tolist())
        assert key == t.key
        # the haystack is the prompt minus BOS, needle and question; the needle sits where it says
        bos = int(t.prompt[0] == tok.bos_token_id) if tok.bos_token_id is not None else 0
        needle = len(tok("\nThe secret pass key is 12345. Remember it.\n", add_special_tokens=False)["input_ids"])
        n_hay = t.context - bos - needle - len(tok("\nThe secret pass key is", add_special_tokens=False)["input_ids"])
        assert start - bos == round(t.needle_depth * n_hay)
        assert abs(t.needle_depth - t.depth) * n_hay <= SNAP
    # a trial is drawn from its own seed: asking for more contexts or depths does not change it
    alone = passkey_trials(tok, _text(), contexts=[320], depths=[0.5], trials=2, max_context=lm.max_context)
    same = [t for t in trials if t.context == 320 and t.depth == 0.5]
    assert [(a.key, a.offset) for a in alone] == [(b.key, b.offset) for b in same]
    assert all(torch.equal(a.prompt, b.prompt) for a, b in zip(alone, same))
    assert len({t.key for t in trials}) > len(trials) // 2  # keys are drawn, not fixed
    other = passkey_trials(tok, _text(), contexts=[320], depths=[0.5], trials=2, seed=1)
    assert [t.key for t in other] != [t.key for t in alone]


def test_multi_key_prompts_ask_for_one_named_key(tiny):
    _, lm = tiny
    tok = lm.tokenizer
    for t in passkey_trials(tok, _text(), contexts=[600], depths=[0.25, 0.75], trials=3, keys=3):
        needles = _needle_positions(tok, t.prompt.tolist())
        assert len(needles) == 3 and len({k for _, k, _ in needles}) == 3 and len({n for *_, n in needles}) == 3
        asked = [n for _, k, n in needles if k == t.key]
        assert len(asked) == 1 and tok.decode(t.prompt).endswith(f"\nThe secret pass key of the {asked[0]} door is")
        assert t.prompt.shape == (600,) and t.keys == 3


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(depths=[1.2]), ConfigError, r"depth 120 % is outside 0-100 %"),
    (dict(depths=[-0.1]), ConfigError, r"outside 0-100 %"),
    (dict(contexts=[2048]), ConfigError, r"context 2048 exceeds the model's context of 1024"),
    (dict(contexts=[1022]), ConfigError, r"context 1022 and the key's \d+ answer tokens exceed the model's context of "
                                         r"1024 tokens; give a context of at most \d+"),
    (dict(contexts=[30]), ConfigError, r"context 30 leaves 0 haystack tokens .* at least \d+ tokens"),
    (dict(trials=0), ConfigError, r"trials must be at least 1"),
    (dict(keys=11), ConfigError, r"keys must be 1 to 10"),
    (dict(text=Text("cache key value\n" * 4, "short", "0" * 64)), TextError,
     r"short has \d+ tokens; a context of 300 needs a haystack of \d+"),
])
def test_bad_requests_are_refused_with_one_line(tiny, kwargs, error, message):
    _, lm = tiny
    args = dict(text=_text(), contexts=[300], depths=[0.5], trials=1, max_context=lm.max_context) | kwargs
    with pytest.raises(error, match=message) as exc:
        passkey_trials(lm.tokenizer, args.pop("text"), **args)
    assert "\n" not in str(exc.value)
    # the shortest context accepted is the one the message names
    if "leaves" in message:
        least = int(re.search(r"at least (\d+)", str(exc.value)).group(1))
        assert passkey_trials(lm.tokenizer, _text(), contexts=[least], depths=[0.5], trials=1)
        with pytest.raises(ConfigError, match=f"leaves {MIN_HAYSTACK - 1} haystack tokens"):
            passkey_trials(lm.tokenizer, _text(), contexts=[least - 1], depths=[0.5], trials=1)


def test_verdict_on_the_models_own_answers(tiny):
    _, lm = tiny
    model = lm.model
    trial = passkey_trials(lm.tokenizer, _text(), contexts=[240], depths=[0.5], trials=1)[0]
    from transformers import DynamicCache

    # the model's greedy continuation after the whole prompt: what a correct key would be
    own = torch.tensor(greedy(model, DynamicCache(), trial.prompt, 4, flush=False))
    wrong = own.clone()
    wrong[2] = (wrong[2] + 1) % model.config.vocab_size
    lossless = CacheConfig(k=float_format("fp32"), v=float_format("fp32"), window_dtype="fp32", name="fp32")
    schemes = [Scheme("fp32", "kverr", lossless), *parse_schemes(["kivi-2"])]
    df = evaluate_passkey(lm, [replace(trial, answer=own), replace(trial, answer=wrong)], schemes, progress=False)
    assert list(df["scheme"]) == ["unquantized", "fp32", "kivi-2"] * 2
    ref = df[df.scheme == "unquantized"]
    assert list(ref["correct"]) == [True, False] and list(ref["first_wrong"]) == [-1, 2]
    fp = df[df.scheme == "fp32"].reset_index(drop=True)
    # the full-precision cache holds the same numbers: the same verdicts and log-likelihoods
    assert list(fp["correct"]) == [True, False] and list(fp["first_wrong"]) == [-1, 2]
    assert fp["key_nll"].tolist() == pytest.approx(fp["ref_key_nll"].tolist(), rel=1e-9, abs=0)
    assert (fp["answer_kl"] < 1e-9).all()
    k2 = df[df.scheme == "kivi-2"]
    assert (k2["answer_kl"] > 0).all() and (k2["effective_bits"] < 16).all()
    assert (df["ref_correct"] == [True] * 3 + [False] * 3).all()


def test_summary_counts_and_intervals():
    rows = []
    for scheme, hits, ref in (("a", [1, 1, 0, 0, 1], [1, 1, 1, 0, 1]), ("unquantized", [1, 1, 1, 0, 1], [1, 1, 1, 0, 1])):
        for i, (h, r) in enumerate(zip(hits, ref)):
            rows.append(dict(scheme=scheme, kind="x", context=100, depth=0.5, trial=i, correct=bool(h),
                             ref_correct=bool(r), key_nll=float(i + (scheme == "a")), ref_key_nll=float(i),
                             answer_kl=0.1 * h, effective_bits=4.0 if scheme == "a" else 32.0))
    s = summarize_passkey(pd.DataFrame(rows)).set_index("scheme")
    assert s.loc["a", "accuracy"] == 3 / 5 and s.loc["a", "kept"] == 3 / 4 and s.loc["a", "trials"] == 5
    assert s.loc["a", "key_nll_delta"] == 1.0 and s.loc["unquantized", "key_nll_delta"] == 0.0
    # Wilson by its formula: (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    z, n, p = 1.959963984540054, 5, 3 / 5
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (s.loc["a", "accuracy_lo"], s.loc["a", "accuracy_hi"]) == pytest.approx((c - h, c + h), rel=1e-9)
    assert wilson_interval(0, 4)[0] == 0.0 and wilson_interval(4, 4)[1] == pytest.approx(1.0)
    assert list(s.index) == ["a", "unquantized"]  # ordered by effective bits


def test_cli_writes_table_trials_and_plot(tiny, tmp_path, capsys):
    path, _ = tiny
    text = tmp_path / "hay.txt"
    text.write_text(_text().text)
    out = tmp_path / "pk.csv"
    argv = ["evaluate", "--task", "passkey", "--model", str(path), "--text", str(text), "--context", "200",
            "--depth", "0,100", "--trials", "2", "--scheme", "kivi-2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "unquantized" in printed and "kivi-2" in printed and "accuracy" in printed
    trials = pd.read_csv(tmp_path / "pk.trials.csv", dtype={"key": str})
    assert len(trials) == 2 * 2 * 2 and set(trials["depth"]) == {0.0, 1.0}
    assert (tmp_path / "pk.png").stat().st_size > 0
    summary = pd.read_csv(out)
    assert set(summary["scheme"]) == {"kivi-2", "unquantized"} and (summary["trials"] == 4).all()
    assert main(argv) == 2 and "exists" in capsys.readouterr().err  # no overwrite without --overwrite
    # no scheme: the unquantized cache alone
    assert main([*argv[: argv.index("--scheme")], "--out", str(tmp_path / "base.csv")]) == 0
    assert set(pd.read_csv(tmp_path / "base.trials.csv")["scheme"]) == {"unquantized"}


@pytest.mark.parametrize("extra, message", [
    (["--decode", "5"], "--decode: not an option of --task passkey"),
    (["--context", "99999"], "context 99999 exceeds the model's context of 1024 tokens"),
    (["--keys", "12"], "keys must be 1 to 10 (one needle per door name), got 12"),
])
def test_cli_refuses_bad_passkey_options_before_loading(tiny, tmp_path, capsys, monkeypatch, extra, message):
    import kverr.capturing

    path, _ = tiny
    monkeypatch.setattr(kverr.capturing, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["evaluate", "--task", "passkey", "--model", str(path), "--scheme", "kivi-2", "--out",
            str(tmp_path / "x.csv"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert main(["evaluate", "--model", str(path), "--scheme", "kivi-2", "--context", "100", "--out",
                 str(tmp_path / "x.csv")]) == 2
    assert "--context: not an option of --task text" in capsys.readouterr().err


def test_the_figure_takes_any_number_of_contexts(tmp_path):
    from kverr.retrieval import plot_passkey

    rows = [dict(scheme=s, kind="x", context=100 * (i + 1), depth=d, trial=0, correct=True, ref_correct=True,
                 key_nll=1.0, ref_key_nll=1.0, answer_kl=0.0, effective_bits=b)
            for i in range(11) for d in (0.0, 1.0) for s, b in (("a", 4.0), ("unquantized", 32.0))]
    assert plot_passkey(pd.DataFrame(rows), tmp_path / "p.png").stat().st_size > 0
