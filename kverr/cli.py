"""The ``kverr`` command.

Each subcommand lives in its own module under :mod:`kverr.commands` and exposes
``register(subparsers)`` (modules whose name starts with ``_`` are helpers), which adds its parser and sets ``func`` to the function that runs it.
Modules are discovered, so adding a subcommand never touches this file. Heavy dependencies are
imported inside the run functions, so ``kverr --help`` stays fast.

Every :class:`kverr.errors.KverrError` becomes one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

from kverr import __version__
from kverr.errors import KverrError

log = logging.getLogger("kverr")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand registered."""
    import kverr.commands as commands

    parser = argparse.ArgumentParser(
        prog="kverr",
        description=(
            "Understand and choose KV-cache quantization: exact memory accounting, exact error "
            "decomposition, calibrated per-layer/per-head formats and Triton kernels."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kverr {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # shared helpers, not subcommands
            continue
        module = importlib.import_module(f"kverr.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kverr`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        status = args.func(args)
    except KverrError as exc:
        print(f"kverr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kverr {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
