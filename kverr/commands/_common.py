"""Argument helpers shared by subcommands (not a subcommand: no ``register``)."""

from __future__ import annotations

import argparse
import math

from kverr.exceptions import ConfigError


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


def positive_float(text: str) -> float:
    """An argparse type: a finite number greater than zero (refuses 0, negatives, nan, inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number greater than 0")
    return value


def parse_layers(spec: str | None, option: str = "--layers") -> list[int] | None:
    """Layer indices (the capture's ``layer`` coordinate values) from ``"0,5,10"`` or ``"0-3,8"``.

    ``None``, ``""`` and ``"all"`` give None (every layer). Every subcommand that takes
    ``--layers`` parses it here, so the same text selects the same layers everywhere; the
    library function that opens the capture checks that they are in it
    (:func:`kverr.dims.layer_positions`).

    Raises
    ------
    ConfigError
        Not a list of non-negative integers and ranges, a range that runs backwards, or a
        layer given twice.
    """
    if spec is None or not spec.strip() or spec.strip().lower() == "all":
        return None
    layers: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
        except ValueError:
            raise ConfigError(
                f"{option} {spec!r} is not a list of layer indices such as 0,5,10 or 0-3"
            ) from None
        if hi < lo:
            raise ConfigError(f"{option} {spec!r}: the range {part} runs backwards; write {hi}-{lo}")
        layers.extend(range(lo, hi + 1))
    if any(x < 0 for x in layers):
        raise ConfigError(f"{option} {spec!r}: layer indices are non-negative")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{option} {spec!r} names a layer twice")
    return layers


def add_model_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the bundled SmolLM2-135M-Instruct) or a transformers model directory; "
        "only its config.json is read (default: %(default)s)",
    )
    p.add_argument(
        "--shape",
        metavar="L,H,D[,HQ]",
        help="give the shape explicitly instead of --model: layers, kv heads, head dim (and query heads)",
    )


def config_and_shape(args: argparse.Namespace):
    """The config (file or preset) and model shape a command names, checked to belong together."""
    from kverr.config import check_model_matches, resolve

    cfg = resolve(args.config)
    shape = resolve_shape(args)
    check_model_matches(cfg, model_id="" if args.shape else shape.name,
                        shape=(shape.n_layers, shape.n_kv_heads, shape.head_dim))
    return cfg, shape


def resolve_shape(args: argparse.Namespace):
    from kverr.memory import model_shape, parse_shape

    if args.shape:
        if args.model != "default":
            raise ConfigError("give either --model or --shape, not both")
        return parse_shape(args.shape)
    return model_shape(args.model)
