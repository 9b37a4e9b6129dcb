"""Argument helpers shared by subcommands (not a subcommand: no ``register``)."""

from __future__ import annotations

import argparse

from kverr.errors import ConfigError


def _int_at_least(minimum: int):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def add_model_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the bundled SmolLM2-135M-Instruct) or a transformers model directory; "
        "only its config.json is read (default: %(default)s)",
    )
    p.add_argument(
        "--shape",
        metavar="L,H,D",
        help="give the shape explicitly instead of --model: layers, kv heads, head dim",
    )


def resolve_shape(args: argparse.Namespace):
    from kverr.memory import model_shape, parse_shape

    if args.shape:
        if args.model != "default":
            raise ConfigError("give either --model or --shape, not both")
        return parse_shape(args.shape)
    return model_shape(args.model)
