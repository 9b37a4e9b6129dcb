"""``kverr project``: the nearest config a serving engine runs, and what the projection costs."""

from __future__ import annotations

import argparse
from pathlib import Path

from kverr.commands._common import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "project",
        help="map a config to the nearest one vLLM serves, with the predicted cost of the projection",
        description="Find the config vLLM serves (one --kv-cache-dtype, skip layers kept in 16 bits, "
        "static fp8 scales chosen per layer) of least predicted damage within the config's own "
        "effective bits -- or, when vLLM has nothing that small, its cheapest -- scored with the "
        "calibration objective on --capture (the config's recorded layer sensitivity when it has "
        "one, else measured with the capture's model), and print both configs' effective bits and "
        "predicted KL.",
    )
    p.add_argument("config", help="a config JSON or a preset name")
    p.add_argument("--target", required=True, choices=("vllm",), help="the serving engine")
    p.add_argument("--capture", required=True, type=Path, help="a capture of every layer (kverr capture)")
    p.add_argument("--context", type=positive_int, help="tokens at which effective bits are counted "
                   "(default: the config's calibration context, else the capture's length)")
    p.add_argument("--queries", type=positive_int, default=32, help="sampled queries per layer (default: %(default)s)")
    p.add_argument("--objective", default="kl", choices=("kl", "rel"), help="as kverr calibrate's (default: kl)")
    p.add_argument("--out", type=Path, help="write the projected config JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.calibration import CalibrationConfig
    from kverr.calibration.target import PROJECT_MARGIN_BITS, project_to_vllm
    from kverr.config import resolve
    from kverr.engines.vllm import serving
    from kverr.io import check_output_path, open_capture

    cfg = resolve(args.config)
    if args.out is not None:
        check_output_path(args.out, overwrite=args.overwrite, kind="file")
    capture = open_capture(args.capture)
    settings = CalibrationConfig(budgets=(16.0,), context=args.context, queries=args.queries, objective=args.objective)
    pr = project_to_vllm(capture, cfg, settings, progress=True)
    plan = serving(pr.config, capture.kv.n_layers, capture.kv.n_kv_heads)
    unit = "nats (predicted KL)" if args.objective == "kl" else "(relative)"
    print(f"{cfg.name or args.config}: {pr.original_bits:.4f} effective bits at {pr.context} tokens, "
          f"predicted {pr.original_predicted:.4g} {unit}")
    print(f"vLLM: --kv-cache-dtype {plan.kv_cache_dtype}, skip layers {list(plan.skip_layers) or 'none'}: "
          f"{pr.bits:.4f} effective bits, predicted {pr.predicted:.4g} {unit}")
    ratio = pr.predicted / pr.original_predicted if pr.original_predicted > 0 else float("inf")
    if pr.within_budget:
        print(f"projection cost: {ratio:.3g}x the predicted damage at {pr.bits - pr.original_bits:+.4f} bits")
    else:
        # six significant digits: the cheapest config may cost a few bytes more in 10**5
        print(f"vLLM has nothing within {pr.original_bits:.6g} bits: its cheapest config costs "
              f"{pr.bits - pr.original_bits:.3g} bits more ({pr.bits / pr.original_bits:.6g}x the memory), "
              f"at {ratio:.3g}x the predicted damage")
    if pr.above is not None:
        up = pr.above.provenance
        print(f"less damaging with up to {PROJECT_MARGIN_BITS:g} bit more: --kv-cache-dtype "
              f"{up['kv_cache_dtype']}, skip layers {up['kv_cache_dtype_skip_layers'] or 'none'}: "
              f"{up['effective_bits']:.4f} effective bits, predicted {up['predicted_damage']:.4g} {unit}")
    if args.out is not None:
        pr.config.save(args.out)
        print(f"wrote {args.out}")
    return 0
