"""``kverr export``: what vLLM or transformers needs to serve a config, or a clear error saying why not."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a config for vLLM (a model directory it loads, and the vllm serve line) or "
        "transformers (QuantizedCache settings)",
        description="Write what a serving engine reads. --format vllm: with --model-dir, a complete "
        "model directory whose config.json holds a compressed-tensors kv_cache_scheme and whose "
        "safetensors hold the per-layer k_scale/v_scale (per tensor or per kv head, computed from "
        "--capture); without it, an overlay (quantization_config.json and kv_scales.safetensors); "
        "either way kverr-export.json and the printed vllm serve command, with "
        "--kv-cache-dtype-skip-layers for layers the config keeps in 16 bits. --format hf: "
        "transformers' QuantizedCache settings (generation_config.json). A config the target "
        "cannot express is refused with the list of what it cannot express.",
    )
    p.add_argument("config", help="a config JSON or a preset name")
    p.add_argument("--format", required=True, choices=("vllm", "hf"), help="target engine")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--capture", type=Path, help="capture for static fp8 scales (vllm)")
    p.add_argument("--model-dir", help="vllm: the model's transformers directory (config.json and "
                   "safetensors weights), or 'default' for the bundled model; the export is then a "
                   "complete model directory vLLM loads")
    p.add_argument("--dtype", choices=("fp16", "bf16"), help="vllm: the dtype the model is served in "
                   "(default: the model directory's, else fp16)")
    p.add_argument("--model", default="default", help="model whose shape the config is checked against "
                   "(default: the bundled model; ignored with --model-dir)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kverr.config import check_model_matches, resolve
    from kverr.memory import model_shape

    cfg = resolve(args.config)
    if args.model_dir == "default":
        from kverr.capturing import transformers_dir

        args.model_dir = transformers_dir("default")
    shape = model_shape(str(args.model_dir) if args.model_dir is not None else args.model)
    cfg.check_model(shape.n_layers, shape.n_kv_heads, shape.head_dim)
    check_model_matches(cfg, shape=(shape.n_layers, shape.n_kv_heads, shape.head_dim))
    capture = None
    if args.capture is not None:
        from kverr.io import open_capture

        capture = open_capture(args.capture)
    if args.format == "vllm":
        from kverr.engines.vllm import export_vllm

        res = export_vllm(cfg, args.out, capture=capture, model_dir=args.model_dir, n_layers=shape.n_layers,
                          n_kv=shape.n_kv_heads, overwrite=args.overwrite, model_dtype=args.dtype)
        files = res.files
        if res.linked:
            print(f"linked {len(res.linked)} files of {args.model_dir} into {args.out}")
    else:
        from kverr.engines import export

        files = export(cfg, "hf", args.out, n_layers=shape.n_layers, n_kv=shape.n_kv_heads,
                       head_dim=shape.head_dim, overwrite=args.overwrite)
    for f in files:
        print(f"wrote {f}")
    if args.format == "vllm":
        print(f"serve it with:\n  {res.command}")
    return 0
