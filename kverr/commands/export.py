"""``kverr export``: a config for vLLM or transformers, or a clear error saying why not."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a config for vLLM (fp8 kv_cache_scheme + k/v scales) or transformers (QuantizedCache)",
        description="Write what a serving engine reads: --format vllm gives the llm-compressor "
        "kv_cache_scheme and per-layer k_scale/v_scale (per tensor or per kv head; the scales "
        "are computed from --capture); --format hf gives transformers' QuantizedCache settings. "
        "A config the target cannot express is refused with the list of what it cannot express.",
    )
    p.add_argument("config", help="a config JSON or a preset name")
    p.add_argument("--format", required=True, choices=("vllm", "hf"), help="target engine")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--capture", type=Path, help="capture for static fp8 scales (vllm)")
    p.add_argument("--model", default="default", help="model whose shape the config is checked against")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.engines import export
    from kverr.config import check_model_matches, resolve
    from kverr.memory import model_shape

    cfg = resolve(args.config)
    shape = model_shape(args.model)
    cfg.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
    check_model_matches(cfg, shape=(shape.n_layers, shape.n_kv_heads, shape.head_dim))
    capture = None
    if args.capture is not None:
        from kverr.io import open_capture

        capture = open_capture(args.capture)
    files = export(cfg, args.format, args.out, capture=capture, n_layers=shape.n_layers,
                   n_kv=shape.n_kv_heads, head_dim=shape.head_dim, overwrite=args.overwrite)
    for f in files:
        print(f"wrote {f}")
    return 0
