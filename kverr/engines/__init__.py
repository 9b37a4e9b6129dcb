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


def export(config: CacheConfig, fmt: str, out: str | Path, *, capture: Any = None,
           n_layers: int | None = None, n_kv: int | None = None, head_dim: int | None = None,
           overwrite: bool = False) -> list[Path]:
    """Dispatch to :func:`export_vllm` or :func:`export_hf`."""
    if fmt == "vllm":
        from kverr.engines.vllm import export_vllm

        return export_vllm(config, out, capture=capture, n_layers=n_layers, n_kv=n_kv, overwrite=overwrite)
    if fmt == "hf":
        from kverr.engines.hf import export_hf

        return export_hf(config, out, n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, overwrite=overwrite)
    raise ConfigError(f"--format {fmt!r} is not allowed; one of {', '.join(FORMATS)}")
