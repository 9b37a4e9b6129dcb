"""Per-channel widths refit on the prompt a cache is serving.

A calibrated config's per-channel widths (formats with ``channel_bits``,
:mod:`kverr.calibration.channel_bits`) are fitted to the calibration text's queries, keys and
values. A server has the same three for every prompt it prefills, so it can refit the widths of
each such (layer, kv head, K|V) on the prompt itself before it quantizes it: the same weights
(:func:`~kverr.calibration.objective.width_weights`), error curves and greedy allocation as the
calibrator, from the prompt's own sampled queries, within the code bytes the config's widths take
(so the refit codes never take more). Formats without ``channel_bits`` are left as they are.

The refit widths belong to the sequence: :func:`width_table_nbytes` counts what storing them takes
(a 3-bit index into :data:`~kverr.quant.formats.CHANNEL_BITS` per channel, packed). A refit config
is a config like any other, so the kernels run it for one sequence; a batch whose sequences hold
different widths would need the kernels' layout tables per sequence, which they do not take.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kverr.config import WHICH, CacheConfig, Override
from kverr.exceptions import ConfigError, ShapeError
from kverr.quant import channel_reconstructions
from kverr.quant.formats import CHANNEL_BITS
from kverr.quant.packing import packed_nbytes
from kverr.quant.store import receive

from . import channel_bits as cb
from .objective import _head_groups, _layer_arrays, max_queries, prepare_layer, width_weights

#: Sampled prompt queries per layer that the widths are refit with (the calibrator's default).
QUERIES = 32

#: Bits of one channel's width in a sequence's width table: an index into ``CHANNEL_BITS``.
WIDTH_INDEX_BITS = max(1, (len(CHANNEL_BITS) - 1).bit_length())


def refit_sides(config: CacheConfig, n_layers: int, n_kv_heads: int) -> list[tuple[int, int, str]]:
    """``(layer, kv_head, "k"|"v")`` of every format of ``config`` with per-channel widths."""
    return [(layer, h, w) for layer in range(n_layers) for h in range(n_kv_heads) for w in WHICH
            if config.format_for(layer, h, w).channel_bits is not None]


def has_channel_widths(config: CacheConfig) -> bool:
    """Whether any format of ``config`` has per-channel widths."""
    return any(f.channel_bits is not None for _, f in config._all_formats())


def width_row_nbytes(head_dim: int) -> int:
    """Bytes one sequence stores for the refit widths of one (layer, kv head, K|V):
    :data:`WIDTH_INDEX_BITS` per channel, packed."""
    return packed_nbytes(head_dim, WIDTH_INDEX_BITS)


def add_width_tables(report: Any, config: CacheConfig) -> None:
    """Add to a :class:`~kverr.memory.MemoryReport` of ``config`` the width tables each of its
    sequences stores (:func:`width_table_nbytes`), as metadata of the quantized tokens
    (``scales``) of their layer and side."""
    s = report.shape
    row = width_row_nbytes(s.head_dim) * report.batch
    for layer, _, w in refit_sides(config, s.n_layers, s.n_kv_heads):
        report.per_layer[layer][w].scales += row


def width_table_nbytes(config: CacheConfig, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes one sequence stores for its refit widths: :data:`WIDTH_INDEX_BITS` per channel of
    every (layer, kv head, K|V) with per-channel widths, each row packed on its own."""
    return len(refit_sides(config, n_layers, n_kv_heads)) * width_row_nbytes(head_dim)


def refit_widths(config: CacheConfig, prompt: Any, *, queries: int = QUERIES) -> CacheConfig:
    """``config`` with every per-channel-width format refit on ``prompt``.

    Parameters
    ----------
    config : CacheConfig
        A config for the prompt's model (its layers, kv heads and head dim).
    prompt : xarray.Dataset
        A capture of the prompt (:func:`kverr.capturing.capture` of its token ids): the queries,
        keys (pre-RoPE too, if the config stores keys so) and values of every layer.
    queries : int
        Prompt positions sampled per layer (:func:`~kverr.calibration.objective.query_positions`,
        at most what the prompt offers).

    Returns
    -------
    CacheConfig
        The refit formats as per-head overrides; every other format, the sinks, window and
        page layout unchanged. Its provenance records the prompt's length and the queries.
    """
    import kverr.accessor  # noqa: F401  (registers ds.kv)

    n_layers, n_kv, D = (prompt.sizes.get(d) for d in ("layer", "kv_head", "channel"))
    if None in (n_layers, n_kv, D) or list(prompt.kv.layers) != list(range(n_layers)):
        raise ShapeError("the prompt capture must hold every layer of the model (kverr.capturing.capture "
                         "without layers=)")
    config.check_model(n_layers, n_kv, D)
    T = int(prompt.sizes["token"])
    if T <= config.sinks:
        raise ConfigError(f"a prompt of {T} tokens has none beyond the config's {config.sinks} sinks to refit widths on")
    n_q = min(int(queries), max_queries(T))
    sides = refit_sides(config, n_layers, n_kv)
    by_layer: dict[int, list[tuple[int, str]]] = {}
    for layer, h, w in sides:
        by_layer.setdefault(layer, []).append((h, w))
    heads = dict(config.heads)
    positions = prompt.kv.positions
    for layer, here in by_layer.items():
        q, k, v, kp, scale, kv_map = _layer_arrays(prompt, layer, config.key_pre_rope)
        prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=n_q,
                             positions=positions, rope=prompt.kv.rope_of(layer) if config.key_pre_rope else None,
                             sliding_window=prompt.kv.sliding_window(layer), sinks=prompt.kv.attn_sink(layer))
        readers = dict(_head_groups(prep))
        new: dict[tuple[int, str], Any] = {}
        for which in WHICH:
            todo = [h for h, w in here if w == which and h in readers]  # unread heads: nothing to weigh by
            if not todo:
                continue
            clean = prep.v if which == "v" else (prep.k_pre if config.key_pre_rope else prep.k)
            got = receive(clean[None], config.window_dtype)[0]
            recon: dict = {}
            for h in todo:
                fmt = config.format_for(layer, h, which)
                probe = fmt.with_bits(2)
                if probe not in recon:
                    recon[probe] = channel_reconstructions(got, probe, page_size=config.page_size)
                wts = width_weights(prep, h, readers[h], which, pre_rope=config.key_pre_rope, skip=config.sinks)
                curves = cb.curves(recon[probe][:, h], clean[h], wts, min(fmt.channel_bits))
                new[(h, which)] = cb.fit(fmt, curves)
        for h in sorted({h for h, _ in new}):
            # the head's formats, its window lengths (if it overrides them) as they were
            heads[(layer, h)] = replace(config.heads.get((layer, h), Override()),
                                        **{w: new.get((h, w), config.format_for(layer, h, w)) for w in WHICH})
    prov = dict(config.provenance)
    prov["refit_widths"] = {"prompt_tokens": T, "queries_per_layer": n_q, "refit": len(sides)}
    return config.with_(heads=heads, provenance=prov)

