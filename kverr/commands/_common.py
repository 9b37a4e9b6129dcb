"""Argument helpers shared by subcommands (not a subcommand: no ``register``)."""

from __future__ import annotations

import argparse

from kverr.errors import ConfigError


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


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
