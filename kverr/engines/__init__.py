"""Serving engines: which kverr configs vLLM and transformers run, and the files they read.

- :mod:`kverr.engines.vllm`: vLLM's KV-cache formats and its compressed-tensors export;
- :mod:`kverr.engines.hf`: transformers' ``QuantizedCache`` backends and their ``cache_config``.

A config a target cannot express is refused with the list of what it cannot express.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError

#: The export targets, as ``kverr export --format`` names them.
FORMATS = ("vllm", "hf")


def engine_presets() -> dict[str, CacheConfig]:
    """The engines' own cache formats as kverr configs, by name (``vllm-...``, ``hf-...``).

    Each engine module defines ``PRESETS``; the names say which engine serves them, and each
    preset's comment names the engine code whose numbers it follows. :func:`kverr.config.resolve`
    and ``kverr presets`` read them beside kverr's own :data:`kverr.config.PRESETS`.
    """
    from kverr.engines import hf, vllm

    out: dict[str, CacheConfig] = {}
    for module in (vllm, hf):
        for name, cfg in module.PRESETS.items():
            if name in out:
                raise AssertionError(f"engine preset {name!r} is defined twice")
            out[name] = cfg
    return out


def export(config: CacheConfig, fmt: str, out: str | Path, *, capture: Any = None,
           n_layers: int | None = None, n_kv: int | None = None, head_dim: int | None = None,
           overwrite: bool = False) -> list[Path]:
    """Dispatch to :func:`kverr.engines.vllm.export_vllm` (an overlay; its files) or
    :func:`kverr.engines.hf.export_hf`."""
    if fmt == "vllm":
        from kverr.engines.vllm import export_vllm

        return list(export_vllm(config, out, capture=capture, n_layers=n_layers, n_kv=n_kv,
                                overwrite=overwrite).files)
    if fmt == "hf":
        from kverr.engines.hf import export_hf

        return export_hf(config, out, n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, overwrite=overwrite)
    raise ConfigError(f"--format {fmt!r} is not allowed; one of {', '.join(FORMATS)}")
