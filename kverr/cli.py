"""The ``kverr`` command.

Each subcommand lives in its own module under :mod:`kverr.commands` and exposes
``register(subparsers)`` (modules whose name starts with ``_`` are helpers), which adds its parser and sets ``func`` to the function that runs it.
Modules are discovered, so adding a subcommand never touches this file. Heavy dependencies are
imported inside the run functions, so ``kverr --help`` stays fast.

Every :class:`kverr.exceptions.KverrError` becomes one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import signal
import sys
import threading
from collections.abc import Sequence

from kverr import __version__
from kverr.exceptions import KverrError

log = logging.getLogger("kverr")

PIPELINE_EPILOG = """\
pipeline (each step reads what the one before it wrote):
  capture -> info -> decompose -> calibrate -> (project) -> export -> evaluate -> validate
  capture   run a model on text, store its queries, keys and values (a capture)
  info      what a capture holds
  decompose split a config's attention error on a capture into key, value and cross terms
  calibrate choose formats per layer and head under a budget (a config JSON)
  project   the nearest config vLLM serves, and what the projection costs
  plan      what one decode step of a config costs on a GPU (launches, bytes, time)
  export    write the config for vLLM or transformers
  evaluate  measure configs, presets and peers in the real model
  validate  check the Triton kernels against the reference on a capture
presets, memory and plan need no capture; demo runs the whole pipeline on the bundled model.
`kverr COMMAND --help` explains each command."""

VERBOSE_HELP = "log progress details (also accepted after the command)"


class _Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that cleanup (worker processes, temporary
    files) runs as it does on Ctrl-C."""


def _on_sigterm(signum, _frame):  # pragma: no cover - exercised through a subprocess
    raise _Terminated(signum)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other kverr error: the usage
    block argparse prints first is left to ``--help``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand registered."""
    import kverr.commands as commands

    parser = _Parser(
        prog="kverr",
        description=(
            "Understand and choose KV-cache quantization: exact memory accounting, exact error\n"
            "decomposition, calibrated per-layer/per-head formats and Triton kernels."
        ),
        epilog=PIPELINE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kverr {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # shared helpers, not subcommands
            continue
        module = importlib.import_module(f"kverr.commands.{info.name}")
        module.register(sub)
    for p in sub.choices.values():
        # SUPPRESS: a subcommand without -v leaves the value of `kverr -v COMMAND` alone.
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kverr`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        status = args.func(args)
    except KverrError as exc:
        print(f"kverr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kverr {args.command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"kverr {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return int(status or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
