"""Engine cache dtypes kverr's formats cannot express, emulated as evaluation peers.

Each is a transformers cache that stores what the engine's cache holds and reads it back as the
engine's attention reads it (:mod:`kverr.engines.vllm_int4`, :mod:`kverr.engines.vllm_turboquant`),
with a kverr config of the same bytes for its effective bits. ``kverr evaluate --scheme NAME``
runs them beside kverr's configs; the calibration objective cannot predict them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kverr.config import CacheConfig


@dataclass(frozen=True)
class EmulatedPeer:
    """An emulated engine cache: its name, the engine's dtype, and for a model of ``n_layers``
    a fresh cache and a kverr config of the same bytes."""

    name: str
    kv_cache_dtype: str
    make_cache: Callable[[int], Any]
    equivalent: Callable[[int], CacheConfig]


def emulated_peers() -> dict[str, EmulatedPeer]:
    """Every emulated peer, by name."""
    from kverr.engines import vllm_int4, vllm_turboquant as tq

    peers = [EmulatedPeer(vllm_int4.NAME, "int4_per_token_head", lambda n: vllm_int4.make_cache(),
                          lambda n: vllm_int4.EQUIVALENT)]
    peers += [EmulatedPeer(tq.peer_name(d), d, partial(tq.make_cache, d), partial(tq.equivalent, d))
              for d in tq.DTYPES]
    return {p.name: p for p in peers}
