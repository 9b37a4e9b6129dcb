"""Caches kverr's formats cannot express, emulated as evaluation peers.

The engines' cache dtypes (:mod:`kverr.engines.vllm_int4`, :mod:`kverr.engines.vllm_turboquant`)
and today's methods from their papers (:mod:`kverr.peers`). Each is a transformers cache that
stores what the method's cache holds and reads it back as its attention reads it, with a kverr
config of the same bytes for its effective bits. ``kverr evaluate --scheme NAME`` runs them
beside kverr's configs; the calibration objective cannot predict them. A method fitted offline
(rotations, clip ranges, codebooks) fits to the calibration capture ``kverr evaluate
--calibration`` gives, the one kverr's configs were calibrated on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError


@dataclass(frozen=True)
class EmulatedPeer:
    """An emulated cache: its name, where it comes from (an engine's dtype, a paper), a fresh
    cache for a model, and its bytes for a model shape: a kverr config of the same bytes
    (``equivalent``, for ``n_layers`` layers of head dim ``head_dim``, plus ``layer_static``
    bytes per layer and side it keeps beyond that config, such as a rotation), or counted by the
    method itself (``report``, a :class:`kverr.memory.MemoryReport`). ``fit``, for a method
    fitted offline, takes the calibration capture (as :func:`kverr.io.open_capture` opens it) to
    what ``make_cache`` is given as ``fitted``."""

    name: str
    source: str
    make_cache: Callable[[Any, Any], Any]  # (model, fitted) -> cache
    equivalent: Callable[[int, int], CacheConfig] | None = None  # (n_layers, head_dim) -> config
    fit: Callable[[Any], Any] | None = None
    layer_static: Callable[[int], int] | None = None
    report: Callable[..., Any] | None = None  # (shape, tokens, batch=..) -> MemoryReport

    def account(self, shape: Any, tokens: int, **kwargs: Any) -> Any:
        """The peer's bytes for ``tokens`` tokens of a model of ``shape`` (the keywords of
        :func:`kverr.memory.account`)."""
        from kverr.memory import account

        if self.report is not None:
            return self.report(shape, tokens, **kwargs)
        rep = account(self.equivalent(shape.n_layers, shape.head_dim), shape, tokens, **kwargs)
        if self.layer_static is not None:
            for sides in rep.per_layer:
                for b in sides.values():
                    b.static += self.layer_static(shape.head_dim)
        return rep

    def cache(self, model: Any, calibration: str | None = None) -> Any:
        """A fresh cache for ``model``, fitted to the capture at ``calibration`` when the method
        is fitted offline (each peer fits to a capture once per process)."""
        if self.fit is None:
            return self.make_cache(model, None)
        if calibration is None:
            raise ConfigError(f"{self.name} is fitted offline; give the calibration capture "
                              "(kverr evaluate --calibration CAPTURE)")
        return self.make_cache(model, _fitted(self, calibration))


_FITS: dict[tuple[str, str], Any] = {}


def _fitted(peer: EmulatedPeer, calibration: str) -> Any:
    """``peer.fit`` of the capture at ``calibration``, once per peer and path."""
    from pathlib import Path

    from kverr.io import open_capture

    key = (peer.name, str(Path(calibration).resolve()))
    if key not in _FITS:
        _FITS[key] = peer.fit(open_capture(calibration))
    return _FITS[key]


def _n_layers(model: Any) -> int:
    return model.config.get_text_config().num_hidden_layers


@functools.cache
def emulated_peers() -> Mapping[str, EmulatedPeer]:
    """Every emulated peer, by name (built once; read-only)."""
    from kverr.engines import vllm_int4, vllm_turboquant as tq
    from kverr.peers import kvquant, oscar
    from kverr.peers import turboquant as tq_paper

    peers = [EmulatedPeer(vllm_int4.NAME, "vLLM int4_per_token_head", lambda m, f: vllm_int4.make_cache(),
                          lambda n, d: vllm_int4.EQUIVALENT)]
    peers += [EmulatedPeer(tq.peer_name(d), f"vLLM {d}", lambda m, f, d=d: tq.make_cache(d, _n_layers(m)),
                           lambda n, hd, d=d: tq.equivalent(d, n)) for d in tq.DTYPES]
    peers += [EmulatedPeer(v, "TurboQuant (ICLR 2026), outlier channels",
                           lambda m, f, v=v: tq_paper.make_cache(v, _n_layers(m)), partial(tq_paper.equivalent, v))
              for v in tq_paper.VARIANTS]
    peers += [EmulatedPeer(v, "OSCAR (Together AI, 2026)", lambda m, f, v=v: oscar.make_cache(v, _n_layers(m), f),
                           partial(oscar.equivalent, v), fit=oscar.fit, layer_static=oscar.rotation_bytes)
              for v in oscar.VARIANTS]
    peers += [EmulatedPeer(v, "KVQuant (NeurIPS 2024), unweighted nuq with 1% outliers",
                           lambda m, f, v=v: kvquant.make_cache(v, f),
                           fit=partial(kvquant.fit, bits=b), report=partial(kvquant.report, v))
              for v, b in kvquant.VARIANTS.items()]
    return MappingProxyType({p.name: p for p in peers})
