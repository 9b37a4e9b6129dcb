"""``kverr presets``: today's formats as configs, with their effective bits."""

from __future__ import annotations

import argparse

from kverr.commands._common import add_model_shape_args, positive_int, resolve_shape


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "presets",
        help="list the preset configs (today's formats) with their effective bits",
        description="List the preset configs -- today's KV-cache formats expressed as kverr "
        "configs -- with their key/value formats, token policy and effective bits per element "
        "(payload, scales, zero points, padding, pages and full-precision tokens included) at a "
        "model shape and context length.",
    )
    add_model_shape_args(p)
    p.add_argument("--tokens", type=positive_int, default=4096, help="cached tokens per sequence (default: %(default)s)")
    p.add_argument("--show", metavar="NAME", help="print one preset's JSON config instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.config import named_presets, resolve
    from kverr.exceptions import ConfigError
    from kverr.memory import account

    if args.show:
        print(resolve(args.show).to_json(), end="")
        return 0
    shape = resolve_shape(args)
    rows = []
    unfit = {}
    for name, cfg in named_presets().items():
        try:
            rep = account(cfg, shape, args.tokens)
        except ConfigError as exc:  # e.g. a group size that does not divide this head dim
            unfit[name] = str(exc)
            rows.append([name, cfg.k.label(), cfg.v.label(), str(cfg.window), "-", "-"])
            continue
        rows.append(
            [
                name,
                cfg.k.label(),
                cfg.v.label(),
                str(cfg.window),
                f"{rep.total_bytes / 2**20:.2f}",
                f"{rep.effective_bits:.3f}",
            ]
        )
    head = ["preset", "keys", "values", "window", "MiB", "eff.bits"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(f"model {shape.name}: {shape.n_layers} layers x {shape.n_kv_heads} kv heads x head dim {shape.head_dim}, {args.tokens} tokens, batch 1")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(r, widths))
        print(f"{line}  does not fit: {unfit[r[0]]}" if r[0] in unfit else line.rstrip())
    from kverr.engines.emulated import emulated_peers
    from kverr.evaluation import PEERS

    emulated = emulated_peers().values()
    engine = [p.name for p in emulated if p.source.startswith("vLLM")]
    papers = [p.name + (" (fitted: --calibration)" if p.fit else "") for p in emulated if not p.source.startswith("vLLM")]
    print(f"peers (not kverr formats; kverr evaluate --scheme NAME): {', '.join(PEERS)} (transformers' "
          f"QuantizedCache); {', '.join(engine)} (vLLM's caches, emulated); {', '.join(papers)} (papers' "
          "methods, emulated)")
    return 0


