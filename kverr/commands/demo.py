"""``kverr demo``: the main job on the bundled default model."""

from __future__ import annotations

import argparse

from kverr.commands._common import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run kverr's main job on the bundled default model",
        description="Run kverr's main job on the bundled default model (SmolLM2-135M-Instruct): "
        "the memory table of every preset at the model's shape.",
    )
    p.add_argument("--tokens", type=positive_int, default=4096, help="context length (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.commands import presets

    ns = argparse.Namespace(model="default", shape=None, tokens=args.tokens, show=None)
    return presets.run(ns)
