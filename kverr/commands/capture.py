"""``kverr capture``: capture q/k/v of a model on a text into a zarr store."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kverr.commands._common import parse_layers

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``capture`` subcommand."""
    p = subparsers.add_parser(
        "capture",
        help="capture queries, keys (pre/post-RoPE) and values of a model on real text",
        description=(
            "Run a model on a window of text and store its per-layer queries, keys before and "
            "after RoPE and values as a zarr dataset (written atomically)."
        ),
    )
    p.add_argument("--model", default="default",
                   help="'default' (bundled SmolLM2-135M-Instruct) or a local transformers model directory")
    p.add_argument("--text", default="pydoc",
                   help="'pydoc' (Python's documentation topics) or a UTF-8 text file")
    p.add_argument("--tokens", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--offset", type=int, default=0, help="tokens of the text to skip first")
    p.add_argument("--layers", default=None, help="layers to capture, e.g. 0,5,10 or 0-3 (default all)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="storage dtype")
    p.add_argument("--out", required=True, help="output zarr store, e.g. caps/smol.zarr")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``kverr capture``; returns the exit status."""
    from kverr.capturing import capture_to_zarr, load_model, load_text, tokenize
    from kverr.io import check_output_path

    # Cheap checks first: a bad output path or text should not cost a model load.
    check_output_path(args.out, overwrite=args.overwrite)
    layers = parse_layers(args.layers)
    text = load_text(args.text)
    loaded = load_model(args.model)
    ids = tokenize(loaded.tokenizer, text, args.tokens, args.offset)
    out = capture_to_zarr(
        loaded,
        ids,
        args.out,
        layers=layers,
        dtype=args.dtype,
        text=text,
        offset=args.offset,
        overwrite=args.overwrite,
        progress=True,  # drawn only when stderr is a terminal (kverr.progress)
    )
    print(f"wrote {out} ({len(ids)} tokens, model {loaded.model_id})")
    return 0
