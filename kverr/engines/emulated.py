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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError


@dataclass(frozen=True)
class EmulatedPeer:
    """An emulated cache: its name, where it comes from (an engine's dtype, a paper), for a model
    of ``n_layers`` layers and head dim ``head_dim`` a kverr config of the same bytes, and a
    fresh cache. ``fit``, for a method fitted offline, takes the calibration capture (as
    :func:`kverr.io.open_capture` opens it) to what ``make_cache`` is given as ``fitted``."""

    name: str
    source: str
    make_cache: Callable[..., Any]  # (n_layers, fitted) -> cache
    equivalent: Callable[[int, int], CacheConfig]  # (n_layers, head_dim) -> config
    fit: Callable[[Any], Any] | None = None
    #: bytes the method keeps once per layer and side beyond its config's (a rotation), by head dim
    layer_static: Callable[[int], int] | None = None

    def account(self, shape: Any, tokens: int, **kwargs: Any) -> Any:
        """:func:`kverr.memory.account` of the equivalent config, with ``layer_static`` added to
        every layer's static bytes of each side."""
        from kverr.memory import account

        rep = account(self.equivalent(shape.n_layers, shape.head_dim), shape, tokens, **kwargs)
        if self.layer_static is not None:
            for sides in rep.per_layer:
                for b in sides.values():
                    b.static += self.layer_static(shape.head_dim)
        return rep

    def cache(self, n_layers: int, calibration: str | None = None) -> Any:
        """A fresh cache, fitted to the capture at ``calibration`` when the method is fitted offline
        (each peer fits to a capture once per process)."""
        if self.fit is None:
            return self.make_cache(n_layers, None)
        if calibration is None:
            raise ConfigError(f"{self.name} is fitted offline; give the calibration capture "
                              "(kverr evaluate --calibration CAPTURE)")
        return self.make_cache(n_layers, _fitted(self, calibration))


_FITS: dict[tuple[str, str], Any] = {}


def _fitted(peer: EmulatedPeer, calibration: str) -> Any:
    """``peer.fit`` of the capture at ``calibration``, once per peer and path."""
    from pathlib import Path

    from kverr.io import open_capture

    key = (peer.name, str(Path(calibration).resolve()))
    if key not in _FITS:
        _FITS[key] = peer.fit(open_capture(calibration))
    return _FITS[key]


def emulated_peers() -> dict[str, EmulatedPeer]:
    """Every emulated peer, by name."""
    from kverr.engines import vllm_int4, vllm_turboquant as tq
    from kverr.peers import oscar
    from kverr.peers import turboquant as tq_paper

    peers = [EmulatedPeer(vllm_int4.NAME, "vLLM int4_per_token_head", lambda n, f: vllm_int4.make_cache(),
                          lambda n, d: vllm_int4.EQUIVALENT)]
    peers += [EmulatedPeer(tq.peer_name(d), f"vLLM {d}", lambda n, f, d=d: tq.make_cache(d, n),
                           lambda n, hd, d=d: tq.equivalent(d, n)) for d in tq.DTYPES]
    peers += [EmulatedPeer(v, "TurboQuant (ICLR 2026), outlier channels", lambda n, f, v=v: tq_paper.make_cache(v, n),
                           partial(tq_paper.equivalent, v)) for v in tq_paper.VARIANTS]
    peers += [EmulatedPeer(v, "OSCAR (Together AI, 2026)", lambda n, f, v=v: oscar.make_cache(v, n, f),
                           partial(oscar.equivalent, v), fit=oscar.fit, layer_static=oscar.rotation_bytes)
              for v in oscar.VARIANTS]
    return {p.name: p for p in peers}
