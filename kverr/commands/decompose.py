"""``kverr decompose``: exact key/value/cross decomposition of a config's error on a capture."""

from __future__ import annotations

import argparse

from kverr.commands._common import parse_layers, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decompose",
        help="split a config's attention error on a capture into key, value and cross terms",
        description="Reconstruct the captured keys and values with a cache config (the kverr.quant "
        "oracle) as a cache that prefilled the capture holds them (salient tokens chosen and compensated "
        "keys weighed by the captured queries), then decompose the attention output error of the last N query positions of every "
        "layer and head exactly: o' - o = (a'-a)V + a E_V + (a'-a)E_V. Writes a zarr dataset with "
        "per-query metrics (layer, q_head, query), reconstruction error (layer, kv_head) and summaries, "
        "then prints a per-layer table: energy shares of the key, value and cross terms, output error "
        "relative to |o|, mean KL(a||a'), mean rank flips among the top-k keys, top-1 flip rate, and "
        "the tensor-level reconstruction MSE of K and V.",
    )
    p.add_argument("--capture", required=True, metavar="PATH", help="a capture made by `kverr capture`")
    p.add_argument("--config", required=True, metavar="CONFIG|PRESET", help="a config JSON file or a preset name")
    p.add_argument("--out", required=True, metavar="PATH", help="output zarr store")
    p.add_argument("--queries", type=positive_int,
                   help="query positions: the last N tokens, at most the capture's tokens (default: 256, "
                   "or every token of a shorter capture)")
    p.add_argument("--layers", metavar="I,J,...",
                   help="layer indices to decompose, as `kverr info` lists them, e.g. 0,15 or 0-3 (default: all in the capture)")
    p.add_argument("--topk", type=positive_int, default=8, help="k of top-k overlap and rank flips (default: %(default)s)")
    p.add_argument("--scheduler", metavar="ADDR",
                   help="a dask.distributed scheduler address (tcp://HOST:PORT) to run on; default: "
                   "local threads")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.config import check_model_matches, resolve
    from kverr.error import decompose_capture
    from kverr.error.xr import compute, layer_table
    from kverr.dims import layer_positions
    from kverr.exceptions import ShapeError
    from kverr.io import check_finite, check_output_path, open_capture, write_dataset

    check_output_path(args.out, overwrite=args.overwrite)  # fail before any work
    layers = parse_layers(args.layers)
    config = resolve(args.config)
    capture = open_capture(args.capture)
    check_model_matches(config, capture=capture)
    n_tok = int(capture.sizes["token"])
    if args.queries is not None and args.queries > n_tok:
        raise ShapeError(f"--queries {args.queries} exceeds the capture's {n_tok} tokens; give 1..{n_tok}")
    lazy = decompose_capture(capture, config, queries=args.queries or 256, layers=layers,
                             topk=args.topk)
    # one read of the layers asked for, so that a NaN is named by its coordinates
    sel = capture if layers is None else capture.isel(layer=layer_positions(capture["layer"].values, layers))
    check_finite(sel, ("q", "k_pre" if config.key_pre_rope else "k", "v"))
    ds = compute(lazy, args.scheduler or "threads", progress=not args.no_progress,
                 desc=f"decompose {config.name or args.config}")
    write_dataset(ds, args.out, overwrite=args.overwrite)
    n_t = ds.attrs["context_tokens"]
    print(f"{config.name or args.config}: {ds.sizes['layer']} layers x {ds.sizes['q_head']} q heads, "
          f"last {ds.sizes['query']} of {n_t} tokens as queries; shares are energy shares of "
          f"|o'-o|^2's three terms; flips = discordant pairs among the top-{args.topk} keys")
    print(layer_table(ds))
    print(f"wrote {args.out}")
    return 0
