"""``kverr demo``: the whole pipeline on the bundled default model, into ``out/``.

capture -> decompose -> calibrate at a budget -> export -> evaluate against the presets and the
quanto peer on held-out text -> validate on the kernel path -> tables, plots and a summary. The
pipeline is the library function :func:`kverr.pipeline.run_pipeline`; this module only parses
the command line and prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kverr.commands._common import non_negative_int, positive_float, positive_int
from kverr.pipeline import DEMO_PEERS, heldout_text_path  # noqa: F401 (heldout_text_path re-exported)

log = logging.getLogger(__name__)


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
    p.add_argument("--capture", type=Path, help="calibrate on this capture of every layer of --model instead of "
                   "capturing --tokens tokens of pydoc into --out")
    p.add_argument("--workers", type=positive_int, default=2, help="calibration: local threads scoring layers")
    p.add_argument("--scheduler", metavar="ADDR",
                   help="calibration: a dask.distributed scheduler address (tcp://HOST:PORT) to score layers on")
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
        out=args.out, model=args.model, capture=args.capture, tokens=args.tokens, budget=args.budget,
        prefill=args.prefill, decode=args.decode, segments=args.segments, offset=args.offset,
        eval_text=args.eval_text, schemes=args.scheme or list(DEMO_PEERS), queries=args.queries,
        workers=args.workers, scheduler=args.scheduler, validate=not args.no_validate, progress=True,
    )
    print(summary)
    return 0


def _print_step(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_demo(*, out: Path, **kwargs) -> str:
    """:func:`kverr.pipeline.run_pipeline` with each step printed to stderr as it ends; returns
    the terminal summary (also written to ``out/summary.txt``)."""
    from kverr.pipeline import run_pipeline

    return run_pipeline(out, on_step=_print_step, **kwargs).text
