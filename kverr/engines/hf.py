"""transformers' ``QuantizedCache``: which kverr configs it runs, and the export it reads.

Integer codes with a zero point, groups of ``q_group_size`` channels of one token (``axis 0``),
``residual_length`` recent tokens in full precision, the same ``nbits`` for keys and values, the
same for every layer and head; backend ``quanto`` (2 or 4 bits) or ``hqq`` (other bits). Scales
are kept in the model's dtype. The export writes ``generation_config.json`` with
``cache_implementation`` and ``cache_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kverr.config import CacheConfig
from kverr.engines.common import common_refusals, formats_of, refuse, shape_of, uniform, write_folder
from kverr.exceptions import ConfigError
from kverr.quant.formats import AbsMax, PerToken, PerTokenGroup, int_format

#: The files the export writes (an existing folder holding only these may be overwritten).
FILES = ("generation_config.json",)

#: This engine's cache formats as kverr configs, by name (see :func:`kverr.engines.engine_presets`).
PRESETS: dict[str, CacheConfig] = {}


def check_hf(config: CacheConfig, n_layers: int | None = None, n_kv: int | None = None,
             head_dim: int | None = None) -> dict[str, Any]:
    """The ``cache_config`` of transformers' QuantizedCache for ``config``, or raise ConfigError."""
    n_layers, n_kv = shape_of(config, n_layers, n_kv)
    fk, fv, p = uniform(formats_of(config, n_layers, n_kv), "transformers' QuantizedCache")
    p += common_refusals(config, "QuantizedCache")
    groups = {}
    for w, f in (("keys", fk), ("values", fv)):
        if f.dtype != "int":
            p.append(f"{w} {f.label()}: QuantizedCache stores integer codes only")
            continue
        if f.symmetric:
            p.append(f"{w} {f.label()}: symmetric codes (QuantizedCache uses a zero point)")
        if isinstance(f.granularity, PerTokenGroup):
            groups[w] = f.granularity.group
        elif isinstance(f.granularity, PerToken) and head_dim:
            groups[w] = head_dim
        elif isinstance(f.granularity, PerToken):
            p.append(f"{w} {f.label()}: per-token scales need the head dim (pass head_dim)")
        else:
            p.append(f"{w} {f.label()}: '{f.granularity.kind}' scales (QuantizedCache groups "
                     "channels of one token, axis 0)")
        if f.rotate != "none":
            p.append(f"{w} {f.label()}: Hadamard rotation")
        if not isinstance(f.clip, AbsMax):
            p.append(f"{w} {f.label()}: '{f.clip.kind}' clipping (QuantizedCache uses min/max)")
    if fk.dtype == "int" and fv.dtype == "int" and fk.bits != fv.bits:
        p.append(f"keys at {fk.bits} bits and values at {fv.bits} bits (one nbits for both)")
    if len(set(groups.values())) > 1:
        p.append(f"key group {groups.get('keys')} and value group {groups.get('values')} differ (one q_group_size)")
    refuse("transformers' QuantizedCache", p)
    nbits = fk.bits
    backend = "quanto" if nbits in (2, 4) else "HQQ"
    return {"backend": backend, "nbits": nbits, "axis_key": 0, "axis_value": 0,
            "q_group_size": next(iter(groups.values())), "residual_length": config.window}


def export_hf(config: CacheConfig, out: str | Path, *, n_layers: int | None = None,
              n_kv: int | None = None, head_dim: int | None = None, overwrite: bool = False) -> list[Path]:
    """Write ``generation_config.json`` for ``model.generate(..., cache_implementation='quantized')``
    into the folder ``out``, all or nothing (as :func:`export_vllm`)."""
    cc = check_hf(config, n_layers, n_kv, head_dim)
    body = {"cache_implementation": "quantized", "cache_config": cc,
            "kverr": {"config": config.name, "scale_dtype": config.k.scale_dtype,
                      "note": "QuantizedCache keeps scales in the model's dtype"}}
    return write_folder(out, {"generation_config.json": json.dumps(body, indent=2) + "\n"},
                         overwrite=overwrite, own_files=FILES)


def import_hf(path: str | Path, *, scale_dtype: str = "fp16") -> CacheConfig:
    """A kverr config from an hf export (or any dict with ``cache_config``)."""
    p = Path(path)
    obj = json.loads((p / "generation_config.json" if p.is_dir() else p).read_text())
    cc = obj.get("cache_config", obj)
    try:
        nbits, g, r = int(cc["nbits"]), int(cc["q_group_size"]), int(cc.get("residual_length", 0))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{p}: cache_config needs nbits, q_group_size (and residual_length)") from None
    if cc.get("axis_key", 0) != 0 or cc.get("axis_value", 0) != 0:
        raise ConfigError(f"{p}: only axis 0 (groups of channels of one token) is read")
    f = int_format(nbits, PerTokenGroup(g), scale_dtype=scale_dtype)
    return CacheConfig(k=f, v=f, window=r)
