"""``kverr validate``: a config through the Triton kernel path and the reference path on a capture."""

from __future__ import annotations

import argparse
import json
import os

from kverr.commands._common import non_negative_int, parse_layers, positive_float, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check that the Triton kernels compute what the reference says, on captured data",
        description="Store the captured keys and values of each layer in the paged quantized cache with "
        "the Triton quantize-and-store kernel (a prefill, then single-token decode steps), decode "
        "attention with fused dequantization, and compare with the reference: what the cache holds "
        "must equal kverr.quant's reconstruction bit for bit, and the decode output must match the "
        "reference attention (kverr.error) within --tol relative RMS. Without CUDA the kernels run in "
        "the Triton interpreter (slow: keep --tokens small). Exit status 0 only when they agree.",
    )
    p.add_argument("config", metavar="CONFIG|PRESET", help="a config JSON file or a preset name")
    p.add_argument("--capture", required=True, metavar="PATH", help="a capture made by `kverr capture`")
    p.add_argument("--tokens", type=positive_int, default=200, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences, disjoint windows of the capture (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=2, help="single-token decode steps after the prefill (default: %(default)s)")
    p.add_argument("--layers", metavar="I,J,...",
                   help="layer indices to compare, as `kverr info` lists them, e.g. 0,15 or 0-3 (default: all)")
    p.add_argument("--tol", type=positive_float, default=1e-3,
                   help="largest relative RMS of decode outputs, > 0 (default: %(default)s)")
    p.add_argument("--top", type=non_negative_int, default=10, help="layers listed, largest differences first; 0 lists all (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    layers = parse_layers(args.layers)
    if not torch.cuda.is_available():
        # must precede the first import of the kernel modules
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kverr.validation import validate

    rep = validate(args.config, args.capture, tokens=args.tokens, batch=args.batch, steps=args.steps,
                   layers=layers, tol=args.tol)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        mode = "Triton interpreter (CPU)" if rep.interpreted else rep.device
        print(f"{rep.config}: kernel path vs reference on {rep.batch} x {rep.tokens} tokens, "
              f"{rep.steps} decode steps, {mode}; tolerance {rep.tol:g} relative RMS")
        print(rep.to_table(largest=args.top or None))
        worst = max(rep.layers, key=lambda r: r.rel_rms)
        print(f"largest difference: layer {worst.layer}, {worst.worst}: rel RMS {worst.rel_rms:.2e}, "
              f"max |diff| {worst.max_abs:.2e}; cache contents mismatched in {sum(r.mismatched for r in rep.layers)} elements")
        print("AGREE" if rep.ok else "DISAGREE")
    return 0 if rep.ok else 1
