"""``kverr plan``: what one decode step of a config costs on a GPU (launches, bytes, time)."""

from __future__ import annotations

import argparse
import json

from kverr.commands._common import add_model_shape_args, config_and_shape, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from kverr.cost import GPUS

    p = sub.add_parser(
        "plan",
        help="predict what one decode step of a config costs on a GPU",
        description="For one decode step of the Triton kernels (one new token per sequence), per "
        "layer: launch groups (kv heads sharing a K and V format), launches, bytes read by kind "
        "(codes, scales, zeros, window, RoPE tables, the rest), and a predicted time from a "
        "roofline with a per-launch cost, replayed from a CUDA graph and launched eagerly; then "
        "the predicted speedup of attention over an fp16 cache at 4k/32k/128k tokens and batch "
        "1/16/64. The constants are in kverr.cost (GPUS, OVERHEADS) and docs/performance.md.",
    )
    p.add_argument("config", metavar="CONFIG|PRESET", help="a config JSON file or a preset name (see `kverr presets`)")
    add_model_shape_args(p)
    p.add_argument("--tokens", type=positive_int, required=True, help="cached tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="the GPU's rates (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--total-only", action="store_true", help="print only the total line, not every layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.cost import fp16_step, speedup_table, step_cost

    cfg, shape = config_and_shape(args)
    plan = step_cost(cfg, shape, args.tokens, args.batch, args.gpu)
    ref = fp16_step(shape, args.tokens, args.batch, args.gpu)
    if args.json:
        out = plan.to_dict()
        out["fp16"] = {"seconds_graphs": ref.seconds(True), "seconds_eager": ref.seconds(False),
                       "total_bytes": ref.total_bytes, "launches": ref.launches}
        print(json.dumps(out, indent=2))
        return 0
    s, g = plan.shape, plan.gpu
    print(f"{plan.config_name} on {s.name} ({s.n_layers} layers x {s.n_kv_heads} kv heads x head dim {s.head_dim}, "
          f"{s.n_q_heads} query heads), one decode step at {plan.tokens} tokens x batch {plan.batch}, {g.name} "
          f"({g.bandwidth / 1e12:.2f} TB/s)")
    if s.max_context is not None and args.tokens > s.max_context:
        print(f"note: {args.tokens} tokens is beyond the model's context of {s.max_context}")
    print(plan.to_table(per_layer=not args.total_only))
    print(f"fp16 reference: {ref.total_bytes / 1e6:.3f} MB, {ref.launches:g} launches, "
          f"{ref.seconds(True) * 1e6:.1f} us with graphs, {ref.seconds(False) * 1e6:.1f} us eager; this config: "
          f"x{ref.seconds(True) / plan.seconds(True):.2f} with graphs, x{ref.seconds(False) / plan.seconds(False):.2f} eager")
    print(speedup_table(cfg, shape, args.gpu))
    return 0
