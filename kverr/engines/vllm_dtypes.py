"""vLLM's ``--kv-cache-dtype`` values as kverr configs: the numbers each follows, pinned by tests."""

from __future__ import annotations

from kverr.config import CacheConfig

#: vLLM's cache dtypes as kverr configs, by preset name (``vllm-...``).
PRESETS: dict[str, CacheConfig] = {}

#: The ``--kv-cache-dtype`` value that serves each preset.
KV_CACHE_DTYPE: dict[str, str] = {}
