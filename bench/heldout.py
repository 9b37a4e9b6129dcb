"""Held-out evaluation: the calibrated configs beside today's formats at equal memory.

The README's results table. The ten committed configs ``data/configs/calibrated-<b>b.json``
(calibrated on pydoc) and the presets and peers at the same effective bits are evaluated on text
they were not calibrated on, the stdlib's ``typing.py`` (Python 3.11): P=1024 prefill, N=256
teacher-forced decode steps, eight disjoint segments from token 0, one torch thread::

    kverr evaluate --threads 1 --greedy 0 --text <python 3.11 lib>/typing.py --offset 0 \\
        --prefill 1024 --decode 256 --segments 8 --config data/configs/calibrated-<b>b.json ... \\
        --scheme kivi-2 ... --out out/bench/heldout.csv

then each scheme's predicted KL (the calibration objective, :func:`kverr.calibration.predict`,
32 queries per layer, with the layer sensitivities recorded in ``calibrated-4b.json``) on the
4096-token pydoc calibration capture. It writes ``bench/results/heldout.segments.csv`` (the
per-segment rows, with machine and date) and ``bench/results/heldout-predicted.csv``; the rows of
the long table are summarised from those two files (:func:`summarise`), so
``python -m bench.run heldout --from-results`` remakes them without measuring again.

The full run takes one to two hours on two cores (22 schemes x 8 segments), so ``--quick`` skips it.
The configs calibrated with fitted per-channel widths (:data:`FITTED_BUDGETS`), with the codebook
candidates (:data:`CODEBOOK_BUDGETS`) and with both and salient prompt tokens
(:data:`SALIENT_BUDGETS`; the objective takes each query's salient tokens out) joined it the
same way (their ``--config`` options only). The
serving engines' own cache dtypes (:data:`ENGINE_SCHEMES`: vLLM's per-token-head int8 and fp8, its
nvfp4 (also with four-over-six scales), its int4 and its Lloyd-Max TurboQuant dtypes (emulated, no prediction), transformers' fp8 and
HQQ int8 backends), TurboQuant's
MSE quantizer and the NVFP4 and
MXFP4 layouts (:data:`PEER_SCHEMES`) joined the table later: measured by the same command with
only their ``--scheme`` options and merged into the committed files (``evaluate(only=...)``,
``predicted(only=...)``), which replace the rows of the schemes measured and keep the others;
vLLM's ``turboquant_k8v4`` likewise, as vLLM runs it on the bundled model (its boundary layers
in 16 bits: :data:`BOUNDARY_SCHEMES`, a ``--config`` file written by :func:`served_configs`), and
today's methods from their papers (:data:`PAPER_SCHEMES`, emulated; OSCAR and KVQuant fitted to
the calibration capture, ``--calibration``). The fitted configs (and ``salient-2.5b``, ``salient-3b``) with their widths
refit on each prompt (:data:`REFIT_SCHEMES`, ``--refit-widths``) are measured the same way and kept in
:data:`SEGMENTS_CSV`; they are one config per prompt, so they have no prediction and stay out of
the long table (``docs/calibration.md`` quotes them). So do the salient configs with their keys
rounded with compensation (``NAME+ck``, ``NAME+ck+refit``: ``--compensated-keys``, a run of their
own, ``evaluate(only=[...])``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import RESULTS, ROOT, WORK, Row, machine, now, pydoc_capture

BUDGETS = ("2.5", "3", "4", "4.3", "4.5", "5", "5.65", "6.1", "8", "8.5")
#: Budgets of the configs calibrated with per-channel widths fitted to each head (``--candidates fitted``).
FITTED_BUDGETS = ("2", "2.5", "3")
#: The fitted configs with their widths refit on each prompt (``kverr evaluate --refit-widths``).
REFIT = "+refit"
REFIT_SCHEMES = (tuple(f"fitted-{b}b{REFIT}" for b in FITTED_BUDGETS)
                 + (f"salient-2.5b{REFIT}", f"salient-3b{REFIT}"))
#: Configs with their keys rounded with compensation (``kverr evaluate --compensated-keys``), also
#: with their widths refit on each prompt.
CK = "+ck"
#: Budgets of the configs calibrated with the codebook candidates added (``--codebooks``).
CODEBOOK_BUDGETS = ("2.5", "3", "4")
#: Budgets of the configs calibrated with fitted widths, codebooks and salient prompt tokens
#: (``--candidates fitted --codebooks --salient 8``).
SALIENT_BUDGETS = ("2", "2.5", "3")
CONFIGS = ([ROOT / "data" / "configs" / f"calibrated-{b}b.json" for b in BUDGETS]
           + [ROOT / "data" / "configs" / f"fitted-{b}b.json" for b in FITTED_BUDGETS]
           + [ROOT / "data" / "configs" / f"codebooks-{b}b.json" for b in CODEBOOK_BUDGETS]
           + [ROOT / "data" / "configs" / f"salient-{b}b.json" for b in SALIENT_BUDGETS])
#: The presets and peers at the calibrated configs' effective bits (at 1280 tokens).
SCHEMES = ("kivi-2", "quanto-int2", "q4_0", "int4-token-g64", "kivi-4", "quanto-int4", "fp8-e4m3-head", "q8_0")
#: The engines' cache formats as kverr presets (``kverr presets``), at their own effective bits.
ENGINE_SCHEMES = ("vllm-int8-per-token-head", "vllm-fp8-per-token-head", "hf-fp8", "hf-hqq-int8", "vllm-nvfp4",
                  "vllm-nvfp4-4over6", "vllm-int4-per-token-head", "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc",
                  "vllm-turboquant-3bit-nc")
#: Today's methods as peers, at their own effective bits: TurboQuant's MSE quantizer, and the
#: microscaling layouts NVFP4 (also with "four over six" scales) and MXFP4 (fp4 codes with
#: one-byte block scales).
PEER_SCHEMES = ("turboquant-mse-2", "turboquant-mse-3", "turboquant-mse-4", "nvfp4", "mxfp4", "nvfp4-4over6")
#: Today's methods from their papers, emulated (:mod:`kverr.peers`): TurboQuant with outlier
#: channels, OSCAR and KVQuant (the last two fitted to the calibration capture).
PAPER_SCHEMES = ("turboquant-2.5", "turboquant-3.5", "oscar-int2-s4r32", "oscar-int2-s4r32-fp16", "oscar-int2",
                 "kvquant-2bit-1pct", "kvquant-3bit-1pct")
ALL_SCHEMES = SCHEMES + ENGINE_SCHEMES + PEER_SCHEMES + PAPER_SCHEMES
#: Engine dtypes vLLM runs with its boundary layers unquantized, evaluated as vLLM runs them on
#: the bundled model (:func:`kverr.engines.vllm_dtypes.with_boundary_skip`), as configs named
#: ``<preset>-edges`` written next to the run's output.
BOUNDARY_SCHEMES = ("vllm-turboquant-k8v4",)
SERVED_SCHEMES = tuple(f"{name}-edges" for name in BOUNDARY_SCHEMES)
SEGMENTS_CSV = RESULTS / "heldout.segments.csv"
PREDICTED_CSV = RESULTS / "heldout-predicted.csv"
SEGMENTS, PREFILL, DECODE = 8, 1024, 256
#: Acceptance targets: at most this many effective bits -> mean KL at most, top-1 at least.
TARGETS = ((4.5, 0.002, 0.98), (3.0, 0.02, 0.93))


def typing_py() -> Path:
    import typing

    return Path(typing.__file__)


def protocol_segments(loaded, numbers, text: str | None = None, offset: int = 0) -> list:
    """The segments ``numbers`` of this protocol, numbered as :data:`SEGMENTS_CSV` numbers them
    (segment ``i`` starts at token ``offset + i * (PREFILL + DECODE + 1)`` of ``typing.py``, or
    of ``text``: a path or a name :func:`kverr.capturing.text.load_text` knows), as
    :func:`kverr.evaluation.segment_jobs` gives them: ``(prefill, segment, offset, ids)``, for
    experiments that run the protocol's segments with their own caches."""
    from kverr.capturing.text import load_text
    from kverr.evaluation import segment_jobs

    jobs = segment_jobs(loaded, load_text(text or str(typing_py())), prefill=[PREFILL], decode=DECODE,
                        segments=max(numbers) + 1, offset=offset)
    return [job for job in jobs if job[1] in set(numbers)]


def protocol_runs(args):
    """What such an experiment starts from, given its :func:`protocol_parser` arguments: the
    default model (``args.threads`` torch threads), the config ``args.config``, and an iterator
    over ``(prefill, segment, offset, ids, reference log-probs)`` of the segments ``args.segments``
    (the reference's teacher-forced decode steps, :func:`kverr.evaluation.teacher_forced`)."""
    import torch
    from transformers import DynamicCache

    from kverr.capturing import load_model
    from kverr.config import CacheConfig
    from kverr.evaluation import teacher_forced

    torch.set_num_threads(args.threads)
    loaded = load_model("default")
    cfg = CacheConfig.load(args.config)

    def runs():
        for p, seg, off, ids in protocol_segments(loaded, args.segments, args.text, args.offset):
            yield p, seg, off, ids, teacher_forced(loaded.model, DynamicCache(), ids, p, flush=False)

    return loaded, cfg, runs()


def protocol_switch(loaded, cfg, runs, switch, *, refit: bool = False, skip_base: bool = False,
                    settings=(False, True)):
    """For an experiment that changes what a cache does by a switch (a patched method reading a
    flag): per segment of ``runs`` (:func:`protocol_runs`), ``cfg`` (its widths refit on the
    segment's prompt with ``refit``, as ``kverr evaluate --refit-widths``) teacher-forced once per
    setting of the switch (off and on; the first, the base, left out with ``skip_base``),
    ``switch(setting)`` called before each; yields ``(segment, offset, setting,
    kverr.evaluation.compare(...))``."""
    from kverr.calibration.refit import refit_widths
    from kverr.capturing import capture
    from kverr.evaluation import compare, teacher_forced
    from kverr.hf import KverrCache

    for p, seg, off, ids, ref in runs:
        run_cfg = refit_widths(cfg, capture(loaded, ids[:p])) if refit else cfg
        for setting in settings[1:] if skip_base else settings:
            switch(setting)
            logp = teacher_forced(loaded.model, KverrCache.for_model(loaded.model, run_cfg), ids, p, flush=True)
            yield seg, off, setting, compare(ref, logp, ids[p + 1:])


def record(rows: list, row: dict, out, what: str) -> None:
    """An experiment's per-segment log: ``row`` (with the ``mean_kl`` and ``top1`` of
    :func:`kverr.evaluation.compare`) appended to ``rows``, printed after ``what``, and every row
    so far written to the CSV ``out``, so that a run stopped early keeps what it measured."""
    import pandas as pd

    rows.append(row)
    print(f"{what}: mean KL {row['mean_kl']:.4g} top-1 {row['top1']:.3f}", flush=True)
    pd.DataFrame(rows).to_csv(out, index=False)


def experiment_script(folder: str, script: str):
    """The script ``experiments/<folder>/<script>`` loaded as a module (an experiment reusing
    another's code; the folders' names are not importable). Loading runs it as an import does:
    any patch it makes at import applies from then on."""
    import importlib.util

    path = ROOT / "experiments" / folder / script
    spec = importlib.util.spec_from_file_location(Path(script).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def protocol_parser(description: str | None):
    """The command line of such an experiment: ``CONFIG OUT.csv [--segments N ...] [--threads N]``."""
    import argparse

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a kverr config (JSON)")
    ap.add_argument("out", help="the CSV to write")
    ap.add_argument("--segments", type=int, nargs="+", default=[0],
                    help=f"segments of the protocol, 0-{SEGMENTS - 1} as {SEGMENTS_CSV.name} numbers them")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--text", help="the text the segments come from instead of typing.py (a path, or a name "
                                   "kverr capture --text takes, such as pydoc: the calibration text, for measuring "
                                   "on text apart from the test set)")
    ap.add_argument("--offset", type=int, default=0, help="token of the text segment 0 starts at")
    return ap


def _merged(path: Path, new, only) -> str:
    """``new`` rows replacing those of the schemes ``only`` in the CSV at ``path`` (all of it when
    ``only`` is None), as CSV text."""
    import pandas as pd

    if only is None or not path.exists():
        return new.to_csv(index=False)
    old = pd.read_csv(path)
    return pd.concat([old[~old.scheme.isin(list(only))], new], ignore_index=True).to_csv(index=False)


def served_configs() -> list[Path]:
    """The :data:`BOUNDARY_SCHEMES` as vLLM runs them on the bundled model, written to
    ``WORK`` as config files (``<preset>-edges.json``)."""
    from kverr.config import atomic_write_text, resolve
    from kverr.engines.vllm_dtypes import with_boundary_skip
    from kverr.memory import DEFAULT_SHAPE

    paths = []
    for name in BOUNDARY_SCHEMES:
        cfg = with_boundary_skip(resolve(name), DEFAULT_SHAPE.n_layers)
        path = WORK / f"{cfg.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, cfg.to_json())
        paths.append(path)
    return paths


def evaluate(only=None) -> None:
    """Run ``kverr evaluate`` and keep its per-segment rows, stamped, in :data:`SEGMENTS_CSV`
    (``only``: just these schemes, merged into the committed rows)."""
    ck = [] if only is None else [s for s in only if CK in s]
    if ck:  # --compensated-keys changes every config of a run: a run of their own
        _evaluate(ck, compensated=True)
        only = [s for s in only if CK not in s]
        if not only:
            return
    _evaluate(only)


def _evaluate(only, compensated: bool = False) -> None:
    from kverr.cli import main

    out = WORK / ("heldout-ck.csv" if compensated else "heldout.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["evaluate", "--threads", "1", "--greedy", "0", "--text", str(typing_py()), "--offset", "0",
            "--prefill", str(PREFILL), "--decode", str(DECODE), "--segments", str(SEGMENTS), "--overwrite",
            "--out", str(out)]
    names = {json.loads(c.read_text())["name"] + (CK if compensated else ""): c for c in [*CONFIGS, *served_configs()]}
    refit = [s for s in (REFIT_SCHEMES if only is None else only) if s.endswith(REFIT)]
    wanted = list(names) if only is None else [s for s in only if s in names]
    for c in dict.fromkeys([*wanted, *(s.removesuffix(REFIT) for s in refit)]):
        argv += ["--config", str(names[c])]
    if refit:
        argv.append("--refit-widths")
    if compensated:
        argv.append("--compensated-keys")
    from kverr.engines.emulated import emulated_peers

    peers = emulated_peers()
    schemes = ALL_SCHEMES if only is None else [s for s in only if s not in names and not s.endswith(REFIT)]
    for s in schemes:
        argv += ["--scheme", s]
    if any(s in peers and peers[s].fit is not None for s in schemes):  # peers fitted offline fit to the capture kverr's configs were calibrated on
        argv += ["--calibration", str(pydoc_capture(4096))]
    if main(argv) != 0:
        raise RuntimeError("kverr evaluate failed")
    merge_segments(out.with_name(out.stem + ".segments.csv"), only)


def merge_segments(segments_csv, only=None, threads=None) -> None:
    """Stamp the per-segment rows of a ``kverr evaluate`` run with this machine and date and write
    them into :data:`SEGMENTS_CSV` (``only``: replacing just those schemes' rows; ``threads``: the
    run's ``--threads``)."""
    import pandas as pd

    from kverr.config import atomic_write_text

    df = pd.read_csv(segments_csv)
    if only is not None:  # a refit scheme's run measures its config too
        df = df[df.scheme.isin(list(only))]
    df["machine"], df["date"] = machine(threads), now()
    atomic_write_text(SEGMENTS_CSV, _merged(SEGMENTS_CSV, df, only))


def predicted(only=None) -> None:
    """Each scheme's predicted KL on the calibration capture, into :data:`PREDICTED_CSV` (``only``:
    just these schemes, merged)."""
    import pandas as pd
    import torch

    from kverr.calibration import Sensitivity, predict
    from kverr.config import CacheConfig, atomic_write_text, resolve
    from kverr.evaluation import EMULATED, PEERS, Scheme
    from kverr.io import open_capture

    torch.set_num_threads(1)
    cap = open_capture(pydoc_capture(4096))
    sens = Sensitivity.from_dict(CacheConfig.load(ROOT / "data/configs/calibrated-4b.json").provenance["sensitivity"])
    configs = {c.name: c for c in map(CacheConfig.load, [*CONFIGS, *served_configs()])}
    cfgs = dict(configs) if only is None else {s: configs[s] for s in only if s in configs}
    for s in ALL_SCHEMES if only is None else [s for s in only if s not in configs]:
        if s in EMULATED or s.endswith(REFIT) or CK in s:
            continue  # not a kverr format, or one per prompt: the objective cannot predict it
        cfgs[s] = Scheme(s, "quanto", nbits=PEERS[s]).equivalent_config(torch.float32) if s in PEERS else resolve(s)
    rows = []
    for name, cfg in cfgs.items():
        p = predict(cap, cfg, queries=32, weights=sens.weights_k, weights_v=sens.weights_v)
        rows.append(dict(scheme=name, predicted=p["total"], predicted_k=float(p["k"].sum()),
                         predicted_v=float(p["v"].sum()), machine=machine(), date=now()))
    atomic_write_text(PREDICTED_CSV, _merged(PREDICTED_CSV, pd.DataFrame(rows), only))


#: Sequences a model's static bytes (static scales, codebooks, rotations) are shared by in the
#: table's first effective-bits figure (the second: one sequence, as evaluated).
AMORTISED_BATCH = 8
#: The table's metric of those effective bits.
AMORTISED_BITS = f"effective_bits_b{AMORTISED_BATCH}"


def bits_at_batch(name: str, batch: int, configs: dict) -> float:
    """Effective bits of scheme ``name`` at the evaluated context (P + N tokens, the prefill
    quantized whole for the kverr and quanto caches, as ``kverr evaluate`` counts it) with
    ``batch`` sequences sharing its static bytes (``configs``: name -> config JSON path)."""
    import torch

    from kverr.evaluation import parse_schemes
    from kverr.memory import DEFAULT_SHAPE

    given = name in configs
    (s,) = parse_schemes([] if given else [name], [str(configs[name])] if given else [], config_option=None,
                         calibration=str(pydoc_capture(4096, make=False)))  # named only: bytes need no fit
    whole = PREFILL if s.kind != "emulated" else 0
    return s.account(torch.float32, DEFAULT_SHAPE, PREFILL + DECODE, batch=batch,
                     prefill_quantized=whole).effective_bits


def summarise() -> list[Row]:
    """The long-table rows from :data:`SEGMENTS_CSV` and :data:`PREDICTED_CSV`, each with the
    machine and date of its measurement: per scheme its kind, effective bits, mean KL over the
    segments and its standard error, top-1, segments, predicted KL, and for a calibrated config
    its outer option and window dtype (from its JSON)."""
    import pandas as pd

    from kverr.evaluation import EMULATED

    seg = pd.read_csv(SEGMENTS_CSV)
    pred = pd.read_csv(PREDICTED_CSV).set_index("scheme")
    docs = {c: json.loads(c.read_text()) for c in [*CONFIGS, *served_configs()]}
    paths = {doc["name"]: c for c, doc in docs.items()}
    configs = {docs[c]["name"]: docs[c] for c in CONFIGS}
    rows: list[Row] = []
    for name, g in seg.groupby("scheme", sort=False):
        if name not in configs and name not in ALL_SCHEMES + SERVED_SCHEMES:
            continue
        m, d = g["machine"].iloc[0], g["date"].max()
        kind = ("calibrated" if name in configs
                else "peer" if name in EMULATED or name.startswith(("quanto", "turboquant", "vllm-turboquant"))
                else "preset")
        n = g["segment"].nunique()
        rows += [Row(name, "kind", kind, "label", m, d),
                 Row(name, "effective_bits", float(g["effective_bits"].iloc[0]), "bits", m, d),
                 Row(name, AMORTISED_BITS, bits_at_batch(name, AMORTISED_BATCH, paths), "bits", m, d),
                 Row(name, "mean_kl", float(g["mean_kl"].mean()), "nats", m, d),
                 Row(name, "mean_kl_se", float(g["mean_kl"].std(ddof=1) / n**0.5), "nats", m, d),
                 Row(name, "top1", float(g["top1"].mean()), "fraction", m, d),
                 Row(name, "segments", n, "count", m, d)]
        if name in pred.index:  # an emulated peer has no prediction
            p = pred.loc[name]
            rows.append(Row(name, "predicted", float(p["predicted"]), "nats", p["machine"], p["date"]))
        if name in configs:
            c = configs[name]
            rows += [Row(name, "outer_option", c["provenance"]["outer_option"], "label", m, d),
                     Row(name, "window_dtype", c["window_dtype"], "label", m, d)]
    return rows


def measure(quick: bool) -> list[Row]:
    """Registry entry: evaluate, predict, summarise (full mode only)."""
    evaluate()
    predicted()
    return summarise()


if __name__ == "__main__":
    sys.exit("run it through the registry: python -m bench.run heldout [--from-results]")
