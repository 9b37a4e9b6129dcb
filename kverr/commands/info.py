"""``kverr info``: summarise a capture dataset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary of the capture at ``path`` (reads metadata only)."""
    from kverr.capturing.model import NUMERICS_ATTRS
    from kverr.io import open_capture

    src = Path(path)
    ds = open_capture(src)
    rope = ds.kv.rope

    def short(params):
        return {k: v for k, v in params.items() if k != "inv_freq"}

    rope_short = ({"layer_types": rope["layer_types"], "types": {t: short(p) for t, p in rope["types"].items()}}
                  if "types" in rope else short(rope))
    return {
        "path": str(src),
        "model_id": ds.attrs["model_id"],
        "weights_sha256": ds.attrs["weights_sha256"],
        "dims": {k: int(v) for k, v in ds.sizes.items()},
        "layers": [int(x) for x in ds["layer"].values],
        "kv_head_of_q": [int(x) for x in ds["kv_head_of_q"].values],
        "dtype": ds.attrs["dtype"],
        "head_dim": int(ds.attrs["head_dim"]),
        "rope": rope_short,
        "sliding_window": [int(x) for x in ds["sliding_window"].values] if "sliding_window" in ds.coords else None,
        "text_source": ds.attrs["text_source"],
        "text_sha256": ds.attrs["text_sha256"],
        "token_offset": int(ds.attrs.get("token_offset", 0)),
        "variables": {
            name: {"dims": list(da.dims), "dtype": str(da.dtype), "chunks": [list(c) for c in (da.chunks or [])][:2]}
            for name, da in ds.data_vars.items()
        },
        "kverr_version": ds.attrs["kverr_version"],
        "schema_version": int(ds.attrs["schema_version"]),
        "created_utc": ds.attrs.get("created_utc", ""),
        "stack": {key: ds.attrs.get(key, "") for key in NUMERICS_ATTRS},
        "disk_bytes": _disk_bytes(src),
    }


def _stack_line(stack: dict[str, str]) -> str:
    """What decided the capture's float32 rounding (torch, transformers, CPU kernels, MKL)."""
    cpu = stack["cpu_capability"] or "not recorded"
    mkl = f", MKL_CBWR={stack['mkl_cbwr']}" if stack["mkl_cbwr"] else ""
    blas = f", BLAS {stack['blas']}" if stack["blas"] else ""
    return (f"numerics  torch {stack['torch_version']}, transformers {stack['transformers_version']}, "
            f"CPU kernels {cpu}{mkl}{blas}")


def _text(s: dict[str, Any]) -> str:
    d = s["dims"]
    lines = [
        f"capture   {s['path']}  ({s['disk_bytes'] / 2**20:.1f} MiB on disk, schema {s['schema_version']}, "
        f"kverr {s['kverr_version']}, {s['created_utc']})",
        f"model     {s['model_id']}",
        f"weights   sha256 {s['weights_sha256']}",
        f"shape     {d.get('layer')} layers {s['layers']}, {d.get('q_head')} q heads / "
        f"{d.get('kv_head')} kv heads (kv_head_of_q {s['kv_head_of_q']}), head dim {s['head_dim']}, "
        f"{d.get('token')} tokens, {s['dtype']}",
        f"rope      {json.dumps(s['rope'], sort_keys=True)}",
        f"text      {s['text_source'] or '(token ids given directly)'} (sha256 {s['text_sha256'] or '-'}), "
        f"token offset {s['token_offset']}",
        _stack_line(s["stack"]),
    ]
    if s["sliding_window"] and any(s["sliding_window"]):
        lines.append(f"window    sliding window per layer {s['sliding_window']}")
    for name, v in s["variables"].items():
        lines.append(f"  {name:<8} {v['dtype']:<8} ({', '.join(v['dims'])})")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Add the ``info`` subcommand."""
    p = subparsers.add_parser("info", help="summarise a capture dataset",
                              description="Print what a capture holds: model, shape, text, RoPE, variables.")
    p.add_argument("path", help="capture store (from kverr capture)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``kverr info``; returns the exit status."""
    summary = describe(args.path)
    print(json.dumps(summary, indent=1) if args.json else _text(summary))
    return 0
