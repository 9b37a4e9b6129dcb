"""``kverr memory``: exact cache bytes of a config at a model shape."""

from __future__ import annotations

import argparse
import json

from kverr.commands._common import add_model_shape_args, config_and_shape, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory",
        help="count the exact bytes a config's cache holds",
        description="Count every byte a KV cache holds for a config: payload, scales, zero "
        "points, static scales, full-precision sink and window tokens, rounding to whole pages "
        "and alignment padding; per layer and in total, with effective bits per element and "
        "the seed formula 2*L*H_kv*D*T*b beside it.",
    )
    p.add_argument("config", metavar="CONFIG|PRESET", help="a config JSON file or a preset name (see `kverr presets`)")
    add_model_shape_args(p)
    p.add_argument("--tokens", type=positive_int, required=True, help="cached tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences in the batch (default: %(default)s)")
    p.add_argument("--page-size", type=positive_int, help="tokens per page (default: the config's)")
    p.add_argument("--refit-widths", action=argparse.BooleanOptionalAction, default=None,
                   help="count the width tables every sequence stores when a config's per-channel widths are "
                   "refit on each prompt (as `kverr evaluate --refit-widths` does); default: when its provenance "
                   "records refit widths (calibrated with --refit-widths, so that the count is the one its budget "
                   "held, or refit on a prompt)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--total-only", action="store_true", help="print only the total line, not every layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.calibration.refit import add_width_tables, has_channel_widths
    from kverr.exceptions import ConfigError
    from kverr.memory import account

    cfg, shape = config_and_shape(args)
    refit = args.refit_widths
    if refit is None:
        refit = bool((cfg.provenance or {}).get("refit_widths")) and has_channel_widths(cfg)
    elif refit and not has_channel_widths(cfg):
        raise ConfigError(f"{cfg.name}: --refit-widths counts the tables of refit per-channel widths, and no format "
                          "of this config has per-channel widths")
    rep = account(cfg, shape, args.tokens, batch=args.batch, page_size=args.page_size)
    if refit:
        add_width_tables(rep, cfg)
    if args.json:
        print(json.dumps({**rep.to_dict(), "refit_width_tables": refit}, indent=2))
        return 0
    s = rep.shape
    print(
        f"{rep.config_name} on {s.name} ({s.n_layers} layers x {s.n_kv_heads} kv heads x head dim "
        f"{s.head_dim}), {rep.tokens} tokens x batch {rep.batch}, pages of {rep.page_size} tokens"
    )
    if refit:
        print("per-channel widths refit on each prompt: every sequence's width tables are counted as scales "
              "(--no-refit-widths leaves them out)")
    print(rep.to_table(per_layer=not args.total_only))
    return 0
