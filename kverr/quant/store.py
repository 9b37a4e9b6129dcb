"""Token policy and the reference store: what a cache holds for a config, laid out in pages.

The cache receives keys and values in its own dtype (``window_dtype``, fp16 by default; for
``int8`` the round trip through one int8 row per token and kv head, :func:`receive`): every
stored number derives from those values, as in a serving engine whose model runs in that dtype,
or one that keeps its window in int8 and quantizes a token from that copy when it leaves.

Token policy for a sequence of ``T`` tokens and one format (see :func:`token_regions`):
the first ``sinks`` tokens and the most recent ones stay in full precision (``window_dtype``);
the tokens between are quantized. At least ``window`` recent tokens stay in full precision;
formats whose scales span a block of tokens (``channel`` with ``tokens=G``, ``page``) quantize
only whole blocks, so up to ``G - 1`` more recent tokens wait in full precision until their
block fills (as KIVI does). Token blocks and pages start at the first quantized token.

:class:`ReferenceStore` allocates and fills the real tensors such a cache holds -- code pages,
scale and zero-point pages, full-precision sink and window tokens, static scales -- so that
:mod:`kverr.memory`'s byte accounting can be checked against ``ReferenceStore.nbytes``.

Page layout, per ``(layer, K|V, kv_head)`` and page of ``page_size`` tokens: a codes section of
``page_size * codes_nbytes(fmt, D)`` bytes, then (unless the scales are static) a scales section
and, for asymmetric formats, a zero-points section, each padded to ``align`` bytes. Scale
entries in a page are ordered by token block, then channel block. The full-precision tokens of a
``(sequence, layer, K|V, kv_head)`` are one row padded to ``align`` bytes (``int8``: a row of
codes and a row of fp16 scales, each padded). Static scales
(``tensor``, ``head``, ``channel`` over all tokens) are stored once per layer, not per sequence.

A sliding-window layer of width W holds only its last W tokens (:func:`live_start`: what the
last query reads): the pages wholly behind them are freed, a page the window starts in is held
whole, and the full-precision rows keep the live sink and window tokens only. The codes of the
held tokens are those of the whole sequence, since token blocks never cross a page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kverr.exceptions import ConfigError, ShapeError
from kverr.quant.compensated import KeyCost, compensable, compensated_quantize
from kverr.quant.formats import TORCH_DTYPES, QuantFormat, is_static, token_block, window_format
from kverr.quant.reference import (
    QTensor,
    ArrayLike,
    as_float_tensor,
    block_shape,
    codes_nbytes,
    dequantize,
    fake_quantize,
    quantize,
)

if TYPE_CHECKING:  # config imports kverr.quant; avoid the cycle at run time
    from kverr.config import CacheConfig, Which


#: Dtype of a salient token's stored position (``CacheConfig.salient``), and its bytes.
SALIENT_INDEX_DTYPE = torch.int32
SALIENT_INDEX_BYTES = 4


def align_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def receive(x: torch.Tensor, window_dtype: str) -> torch.Tensor:
    """What a cache receives of ``x [..., H, T, D]`` (float32): its values in ``window_dtype``.

    A plain float dtype is a cast; ``int8`` is the round trip through one symmetric absmax
    int8 row per (token, kv head) with an fp16 scale. The round trip is idempotent, so a token
    quantized straight from the input and one quantized later from its window copy get the same
    codes. Every number a cache stores derives from these values.
    """
    fmt = window_format(window_dtype)
    if fmt.is_float:
        return x.to(TORCH_DTYPES[window_dtype]).to(torch.float32)
    return fake_quantize(x, fmt)


@dataclass(frozen=True, eq=False)
class WindowRows:
    """Tokens a cache keeps outside its pages (sinks, window, a pending block), as stored.

    ``data`` ``[..., h, n, D]`` in the window dtype (``int8``: the oracle's uint8 codes) and, for
    ``int8``, ``scale`` ``[..., h, n, 1]`` fp16. :meth:`float` gives :func:`receive`'s values;
    rows made by :meth:`store` keep them (``values``, float32: a compute cache, not storage, so
    that a cache reading its window every step does not decode it every step).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    window_dtype: str
    values: torch.Tensor | None = None

    @classmethod
    def store(cls, x: torch.Tensor, window_dtype: str) -> WindowRows:
        fmt = window_format(window_dtype)
        if fmt.is_float:
            return cls(x.to(TORCH_DTYPES[window_dtype]), None, window_dtype)
        qt = quantize(x, fmt)
        return cls(qt.codes, qt.scale, window_dtype, dequantize(qt))

    @property
    def n(self) -> int:
        return int(self.data.shape[-2])

    def tokens(self, lo: int | None = None, hi: int | None = None) -> WindowRows:
        """Tokens ``[lo, hi)``."""
        cut = lambda t: None if t is None else t[..., lo:hi, :]  # noqa: E731
        return WindowRows(cut(self.data), cut(self.scale), self.window_dtype, cut(self.values))

    def select(self, index: torch.Tensor) -> WindowRows:
        """The rows of the sequences ``index`` (along the leading batch dim), as stored."""
        pick = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        return WindowRows(pick(self.data), pick(self.scale), self.window_dtype, pick(self.values))

    def gather(self, index: torch.Tensor) -> WindowRows:
        """The tokens ``index [..., h, m]`` (positions along the token dim, per head), as stored."""
        def take(t):
            if t is None:
                return None
            return t.gather(-2, index.to(t.device)[..., None].expand(*index.shape, t.shape[-1]))

        return WindowRows(take(self.data), take(self.scale), self.window_dtype, take(self.values))

    def cat(self, other: WindowRows) -> WindowRows:
        """These tokens followed by ``other``'s."""
        def join(a, b):
            return None if a is None or b is None else torch.cat([a, b], dim=-2)

        return WindowRows(join(self.data, other.data), join(self.scale, other.scale), self.window_dtype,
                          join(self.values, other.values))

    def float(self) -> torch.Tensor:
        if self.scale is None:
            return self.data.float()
        if self.values is not None:
            return self.values
        fmt = window_format(self.window_dtype)
        return dequantize(QTensor(self.data, self.scale, None, fmt, tuple(self.data.shape), None))

    @property
    def nbytes(self) -> int:
        """Bytes stored (the data and the scales; not the ``values`` cache)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) if t is not None)


def token_regions(T: int, config: CacheConfig, fmt: QuantFormat, prefill_quantized: int = 0, *,
                  window: int | None = None) -> tuple[int, int]:
    """Quantized token range ``[start, end)`` of a ``T``-token sequence stored with ``fmt``.

    Tokens ``[0, start)`` are sinks, ``[end, T)`` the full-precision window: the ``window`` most
    recent tokens (default ``config.window``; a head group's own is
    :meth:`~kverr.config.CacheConfig.window_for`) and those of an unfilled token block.
    ``prefill_quantized``: the first that many tokens arrived as a prefill that was quantized
    whole, window ignored (whole token blocks after the sinks, as ``KverrCache.flush`` does);
    the tokens after it fill the window again.
    """
    if T < 0:
        raise ShapeError(f"T={T} tokens: must be non-negative")
    start = min(config.sinks, T)
    tb = token_block(fmt.granularity, config.page_size)
    flushed = max(0, min(prefill_quantized, T) - start) // tb * tb
    avail = max(0, T - start - flushed - (config.window if window is None else window))
    return start, start + flushed + avail - avail % tb


def salient_candidates(T: int, config: CacheConfig, layer: int, kv_head: int) -> tuple[int, int]:
    """Tokens ``[lo, hi)`` of a ``T``-token prefill that may be salient (``config.salient``) in
    ``(layer, kv_head)``: those it quantizes (:func:`token_regions`) on both sides whose format
    quantizes (one list of positions per kv head serves K and V)."""
    lo = min(config.sinks, T)
    ends = [token_regions(T, config, f, window=config.window_for(layer, kv_head, w))[1]
            for w in ("k", "v") if not (f := config.format_for(layer, kv_head, w)).is_float]
    return lo, min(ends, default=lo)


def without_salient(x: torch.Tensor, rel: torch.Tensor | None) -> torch.Tensor:
    """``x [B, h, n, D]`` without its salient tokens ``rel [B, h, m]`` (distinct, ascending
    indices from 0; those at ``n`` or past it, the prompt's newest tokens kept while the block
    ends before them (``salient_recent``), are not in the block): ``[B, h, n − m', D]``, the
    others in order, ``m'`` the salient tokens in the block. Static scales are fitted on these:
    a salient token is read back from its row, so its codes may saturate."""
    if rel is None or not rel.numel():
        return x
    B, h, n, D = x.shape
    inside = rel < n
    m = int(inside.sum(-1).max())
    if rel.shape[:2] != (B, h) or int(rel.min()) < 0 or bool((inside.sum(-1) != m).any()) or not bool(inside[..., :m].all()):
        raise ShapeError(f"salient indices of shape {tuple(rel.shape)} (range {int(rel.min())}..{int(rel.max())}) "
                         f"do not index the tokens of a [{B}, {h}, {n}, {D}] block, as many in it for every row")
    keep = torch.ones((B, h, n), dtype=torch.bool, device=x.device).scatter_(2, rel[..., :m].long().to(x.device), False)
    return x[keep].reshape(B, h, n - m, D)


def live_start(T: int, sliding_window: int) -> int:
    """First token a cache of ``T`` tokens still holds in a layer with this sliding window: the
    last query, at position ``T − 1``, reads the keys ``T − W .. T − 1``; 0 means full attention
    (every token is held)."""
    return max(0, T - sliding_window) if sliding_window else 0


def held_tokens(T: int, start: int, end: int, live: int) -> tuple[int, int, int]:
    """How many of the sinks ``[0, start)``, the quantized tokens ``[start, end)`` and the window
    ``[end, T)`` a cache still holds when it keeps the tokens from ``live`` on
    (:func:`live_start`)."""
    return start - min(live, start), max(0, end - max(start, live)), T - max(end, live)


def fit_static_scales(blocks: Sequence[torch.Tensor], fmt: QuantFormat,
                      page_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The static scales (and zeros, or None) of ``fmt``, fitted jointly over the tokens of every
    block ``[b, h, n_i, D]`` (the sequences of a batch, which may hold different numbers of
    tokens): ``[h, ...]``, the shape ``quantize`` takes for every sequence. The one fit of static
    scales: the reference store, the reference cache and the kernels' cache take theirs here."""
    if not blocks:
        raise ShapeError("no tokens to fit static scales on")
    shapes = [tuple(b.shape) for b in blocks]
    if any(len(s) != 4 or (s[1], s[3]) != (shapes[0][1], shapes[0][3]) for s in shapes):
        raise ShapeError(f"blocks of shapes {shapes}: want [b, h, n, D] each, with one h and one D")
    h, D = shapes[0][1], shapes[0][3]
    tokens = torch.cat([b.permute(1, 0, 2, 3).reshape(1, h, -1, D) for b in blocks], dim=2)
    ref = quantize(tokens, fmt, page_size=page_size)
    return ref.scale[0], None if ref.zero is None else ref.zero[0]


def _static_metadata(x: torch.Tensor, fmt: QuantFormat, page_size: int) -> dict:
    """Static scales (and zeros) taken jointly over the ``B`` sequences of ``x [B, h, n, D]``."""
    scale, zero = fit_static_scales([x], fmt, page_size)
    return {"scale": scale[None], "zero": None if zero is None else zero[None]}


def quantize_region(x: torch.Tensor, fmt: QuantFormat, page_size: int, cost=None, *,
                    fit: torch.Tensor | None = None) -> QTensor:
    """Quantize ``[B, h, n, D]`` (one head group, the quantized tokens of ``B`` sequences).

    Static granularities take one set of scales over all ``B`` sequences (as a calibrated
    static scale would be), fitted on ``fit [B, h, n', D]`` (default: ``x``); the others quantize
    each sequence on its own. With ``cost`` (a key cost or its
    :class:`~kverr.quant.compensated.CompensationFactor`, leading shape broadcastable to
    ``[B, h, n]``) the codes are chosen by :func:`~kverr.quant.compensated.compensated_quantize`
    on the same scales.
    """
    meta = (_static_metadata(x if fit is None else fit, fmt, page_size)
            if is_static(fmt.granularity) and not fmt.is_float else {})
    if cost is not None:
        return compensated_quantize(x, fmt, cost, page_size=page_size, **meta)
    return quantize(x, fmt, page_size=page_size, **meta)


def fake_quantize_region(x: torch.Tensor, fmt: QuantFormat, page_size: int, *,
                         fit: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize_region(x, fmt, page_size, fit=fit))``, bit for bit, without packing."""
    if is_static(fmt.granularity) and not fmt.is_float:
        return fake_quantize(x, fmt, page_size=page_size, **_static_metadata(x if fit is None else fit, fmt, page_size))
    return fake_quantize(x, fmt, page_size=page_size)


def reconstruct(x: ArrayLike, config: CacheConfig, *, layer: int, which: Which,
                key_cost: KeyCost | None = None, salient: Any = None) -> torch.Tensor:
    """What the cache gives back for ``x``: sinks and window in ``window_dtype``, the rest
    quantized and dequantized with the format of each kv head. Salient prompt tokens
    (``config.salient``) are chosen by queries, which this function does not see: given their
    positions (``salient``) it reads them back as received and fits static scales on the other
    tokens, as the cache does; without them it reads them back quantized (the calibration
    objective takes them out per query instead, :func:`kverr.calibration.objective.salient_tokens`).
    Keys of a config that rounds them with compensation (``key_rounding`` ``"compensated"``) are
    rounded so in its integer formats under ``key_cost``, which the queries give and this
    function cannot see.

    Parameters
    ----------
    x
        ``[..., kv_head, token, channel]``, all kv heads of ``layer``.
    config
        The cache config.
    layer
        Layer index (selects per-layer and per-head overrides).
    which
        ``"k"`` or ``"v"``.
    key_cost
        For keys of a config with ``key_rounding`` ``"compensated"``: the cost of an error in
        each key (:class:`~kverr.quant.compensated.KeyCost`, leading shape ``[kv_head, token]``
        of ``x``, ``token`` may be 1). Required there, refused elsewhere.
    salient
        For a config with ``salient`` > 0: the positions of each kv head's salient tokens,
        ``[..., kv_head, m]`` integers (the leading axes of ``x``, or none to share them), each
        among the tokens the head's formats quantize (:func:`kverr.error.salient.positions`
        chooses them so). Refused for a config that keeps none.

    Returns
    -------
    torch.Tensor
        float32, same shape as ``x``.
    """
    compensate = which == "k" and config.compensates_keys
    if compensate and key_cost is None:
        raise ConfigError(f"config {config.name or '(unnamed)'} rounds its keys with compensation (key_rounding 'compensated'): "
                          "their codes depend on the queries that read them; give reconstruct their key_cost "
                          "(kverr.quant.compensated.KeyCost), or measure the config with kverr evaluate")
    if key_cost is not None and not compensate:
        raise ConfigError(f"a key_cost is for the keys of a config that rounds them with compensation, not for "
                          f"which={which!r} with key_rounding {config.key_rounding!r}")
    x32 = as_float_tensor(x, which)
    if x32.ndim < 3:
        raise ShapeError(f"{which} must be [..., kv_head, token, channel], got {tuple(x32.shape)}")
    *lead, H, T, D = x32.shape
    # The cache receives K/V in its own dtype (window_dtype); every stored number derives from
    # those values.
    N = math.prod(lead)
    x4 = receive(x32.reshape(N, H, T, D), config.window_dtype)
    sal = None if salient is None else _salient_positions(salient, config, lead, H).to(x4.device)
    out = x4.clone()
    kept = None if sal is None else torch.zeros((N, H, T), dtype=torch.bool, device=x4.device)
    for fmt, window, heads in config.window_groups(layer, H, which):
        fmt.check_head_dim(D, which)
        start, end = token_regions(T, config, fmt, window=window)
        if end > start:
            region = x4[:, heads, start:end, :]
            fit = None
            if sal is not None and config.keeps_salient(which, fmt):
                rel = sal[:, heads] - start
                if sal.shape[-1] and (int(rel.min()) < 0 or int(rel.max()) >= T - start):
                    raise ShapeError(f"layer {layer} heads {heads}: salient positions {sorted(set(sal[:, heads].flatten().tolist()))} "
                                     f"must lie among the tokens {start} .. {T - 1} after the sinks")
                if is_static(fmt.granularity):  # only static scales are fitted on other tokens
                    fit = without_salient(region, rel)
                kept[:, heads] = kept[:, heads].scatter(2, sal[:, heads], True)
            if compensate and compensable(fmt):
                cost = key_cost.factor(fmt, heads).select(tokens=slice(start, end))
                out[:, heads, start:end, :] = quantize_region(region, fmt, config.page_size, cost, fit=fit).dequantize()
            else:
                out[:, heads, start:end, :] = fake_quantize_region(region, fmt, config.page_size, fit=fit)
    if kept is not None:  # salient tokens read back as the rows the cache received
        out = torch.where(kept[..., None], x4, out)
    return out.reshape(x32.shape)


def _salient_positions(salient: Any, config: CacheConfig, lead: list[int], H: int) -> torch.Tensor:
    """``salient`` checked and shaped ``[N, H, m]`` int64 (``N`` the product of ``lead``)."""
    if not config.salient:
        raise ConfigError(f"salient positions were given but config {config.name or '(unnamed)'} keeps no salient tokens")
    pos = torch.as_tensor(salient)
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool or pos.ndim < 2 or pos.shape[-2] != H or pos.shape[-1] > config.salient \
            or tuple(pos.shape[:-2]) not in ((), tuple(lead)):
        raise ShapeError(f"salient positions of shape {tuple(pos.shape)} ({pos.dtype}): want integer "
                         f"[{', '.join(map(str, [*lead, H]))}, m] or [{H}, m], m <= config.salient = {config.salient}")
    pos = pos.long().cpu().expand(*lead, *pos.shape[-2:]).reshape(math.prod(lead), H, pos.shape[-1])
    if pos.shape[-1] > 1 and bool((pos.diff(dim=-1) <= 0).any()):
        raise ShapeError("salient positions must ascend, each token once per kv head")
    return pos


# --------------------------------------------------------------------------------------------
# The paged reference store
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class HeadGroupStore:
    """Pages of one ``(layer, K|V)`` and one group of kv heads sharing a format.

    Attributes
    ----------
    codes
        ``[B * h * pages, align_up(page_size * codes_nbytes)]`` uint8 (or the float dtype).
    scales, zeros
        ``[B * h * pages, entries]`` in the scale dtype, padded to ``align`` bytes; ``None``
        for static or no metadata.
    static_scale, static_zero
        Static metadata stored once, or ``None``.
    fp
        ``[B * h, align_up(n_fp * D)]`` in ``window_dtype`` (``int8``: uint8 codes): sink tokens
        then window tokens.
    fp_scale
        ``int8`` windows: ``[B * h, align_up(n_fp)]`` fp16, a scale per token; else ``None``.
    live, first_page
        First token held (sliding-window layers; else 0) and the first code page held.
    table
        Codebook formats: the fp32 levels, stored once; else ``None``.
    """

    fmt: QuantFormat
    heads: list[int]
    batch: int
    n_tokens: int
    start: int
    end: int
    pages: int
    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    static_scale: torch.Tensor | None
    static_zero: torch.Tensor | None
    fp: torch.Tensor
    fp_scale: torch.Tensor | None = None
    live: int = 0
    first_page: int = 0
    table: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.codes, self.scales, self.zeros, self.static_scale, self.static_zero, self.fp,
                      self.fp_scale, self.table)
            if t is not None
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _aligned_rows(rows: torch.Tensor, align: int) -> torch.Tensor:
    """``[R, n]`` entries, each row zero-padded to a multiple of ``align`` bytes."""
    eb = rows.element_size()
    out = torch.zeros((rows.shape[0], align_up(rows.shape[1] * eb, align) // eb), dtype=rows.dtype)
    out[:, : rows.shape[1]] = rows
    return out


def _to_pages(rows: torch.Tensor, pages: int, per_page: int, padded: int) -> torch.Tensor:
    """``[R, n]`` entries -> ``[R * pages, padded]`` pages of ``per_page`` entries (zero-filled)."""
    R, n = rows.shape
    buf = torch.zeros((R, pages * per_page), dtype=rows.dtype)
    buf[:, :n] = rows
    out = torch.zeros((R * pages, padded), dtype=rows.dtype)
    out[:, :per_page] = buf.reshape(R * pages, per_page)
    return out


def _from_pages(pool: torch.Tensor, R: int, pages: int, per_page: int, n: int) -> torch.Tensor:
    return pool[:, :per_page].reshape(R, pages * per_page)[:, :n]


class ReferenceStore:
    """Real tensors holding K and V of every layer for a batch of equal-length sequences.

    Parameters
    ----------
    config
        The cache config.
    keys, values
        Per layer, ``[B, kv_head, token, channel]`` tensors (all layers the same shape).
    sliding_windows
        Per layer, the sliding window (0: full attention); a sliding layer holds only the tokens
        from :func:`live_start` on.
    """

    def __init__(
        self,
        config: CacheConfig,
        keys: list[ArrayLike],
        values: list[ArrayLike],
        sliding_windows: list[int] | None = None,
    ) -> None:
        if len(keys) != len(values):
            raise ShapeError(f"{len(keys)} key layers but {len(values)} value layers")
        if sliding_windows is not None and len(sliding_windows) != len(keys):
            raise ShapeError(f"{len(sliding_windows)} sliding windows for {len(keys)} layers")
        if config.salient:
            raise ConfigError("the reference store has no queries to choose salient tokens by; "
                              "kverr.hf.KverrCache keeps them (config.salient)")
        self.sliding_windows = [0] * len(keys) if sliding_windows is None else [int(w) for w in sliding_windows]
        self.config = config
        self.groups: dict[tuple[int, str, int], HeadGroupStore] = {}
        self.shape: tuple[int, ...] | None = None
        for layer, (k, v) in enumerate(zip(keys, values)):
            for which, x in (("k", k), ("v", v)):
                x32 = receive(as_float_tensor(x, which), config.window_dtype)
                if x32.ndim != 4:
                    raise ShapeError(f"layer {layer} {which}: want [B, kv_head, token, channel], got {tuple(x32.shape)}")
                if self.shape is None:
                    self.shape = tuple(x32.shape)
                elif tuple(x32.shape) != self.shape:
                    raise ShapeError(f"layer {layer} {which} has shape {tuple(x32.shape)}, expected {self.shape}")
                for fmt, window, heads in config.window_groups(layer, x32.shape[1], which):
                    live = live_start(x32.shape[2], self.sliding_windows[layer])
                    self.groups[(layer, which, heads[0])] = self._store(x32[:, heads], fmt, heads, live, window)

    def _store(self, x: torch.Tensor, fmt: QuantFormat, heads: list[int], live: int = 0,
               window: int | None = None) -> HeadGroupStore:
        cfg = self.config
        B, h, T, D = x.shape
        P, A = cfg.page_size, cfg.align
        fmt.check_head_dim(D)
        start, end = token_regions(T, cfg, fmt, window=window)
        n_q = end - start
        first_page = max(0, live - start) // P if live < end else -(-n_q // P)
        pages = -(-n_q // P) - first_page
        R = B * h
        # Full-precision tokens still held: sinks then window, one aligned row per (sequence, head).
        rows = WindowRows.store(torch.cat([x[:, :, min(live, start):start], x[:, :, max(live, end):]], dim=2),
                                cfg.window_dtype)
        fp = _aligned_rows(rows.data.reshape(R, -1), A)
        fp_scale = None if rows.scale is None else _aligned_rows(rows.scale.reshape(R, -1), A)
        cb = codes_nbytes(fmt, D)
        codes_dtype = TORCH_DTYPES[fmt.dtype] if fmt.is_float else torch.uint8
        esize = torch.tensor([], dtype=codes_dtype).element_size()
        static_scale = static_zero = scales = zeros = None
        if pages == 0:
            codes = torch.zeros((0, align_up(P * cb, A) // esize), dtype=codes_dtype)
        else:
            # the whole region is quantized (the codes of a token do not depend on eviction), and
            # the pages behind the window are dropped
            qt = quantize_region(x[:, :, start:end], fmt, P)
            per_page = P * cb // esize
            first = first_page * P * cb // esize
            codes = _to_pages(qt.codes.reshape(R, -1)[:, first:], pages, per_page, align_up(P * cb, A) // esize)
            if qt.scale is not None:
                if is_static(fmt.granularity):
                    static_scale = qt.scale[0].clone()
                    static_zero = None if qt.zero is None else qt.zero[0].clone()
                else:
                    bt = block_shape(fmt, h, n_q, D, P)[1]
                    entries = (P // bt) * qt.scale.shape[-1]
                    sb = qt.scale.element_size()
                    padded = align_up(entries * sb, A) // sb
                    skip = first_page * entries
                    scales = _to_pages(qt.scale.reshape(R, -1)[:, skip:], pages, entries, padded)
                    if qt.zero is not None:
                        zeros = _to_pages(qt.zero.reshape(R, -1)[:, skip:], pages, entries, padded)
        return HeadGroupStore(
            fmt, heads, B, T, start, end, pages, codes, scales, zeros, static_scale, static_zero, fp, fp_scale,
            live, first_page, torch.tensor(fmt.codebook_levels) if fmt.is_codebook and pages else None,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the store allocated (and the config's static key moments)."""
        layers = {l for (l, _, _) in self.groups}
        return sum(self.nbytes_of(layer) for layer in layers)

    def nbytes_of(self, layer: int) -> int:
        km = self.config.key_moments
        return sum(g.nbytes for (l, _, _), g in self.groups.items() if l == layer) + (0 if km is None else km.layer_nbytes())

    def read(self, layer: int, which: Which) -> torch.Tensor:
        """Read ``[B, kv_head, token, channel]`` float32 back from the pages (NaN at tokens a
        sliding-window layer no longer holds)."""
        if self.shape is None:
            raise ShapeError("the store holds no layers")
        B, H, T, D = self.shape
        out = torch.full((B, H, T, D), math.nan, dtype=torch.float32)
        for (l, w, _), g in self.groups.items():
            if l != layer or w != which:
                continue
            h = len(g.heads)
            R = B * h
            s0, e0 = min(g.live, g.start), max(g.live, g.end)  # the live sinks end, the live window starts
            n_sink = g.start - s0
            n_fp = n_sink + T - e0
            fp_scale = None if g.fp_scale is None else g.fp_scale[:, :n_fp].reshape(B, h, n_fp, 1)
            fp = WindowRows(g.fp[:, : n_fp * D].reshape(B, h, n_fp, D), fp_scale, self.config.window_dtype).float()
            out[:, g.heads, s0 : g.start] = fp[:, :, :n_sink]
            out[:, g.heads, e0:] = fp[:, :, n_sink:]
            if g.pages == 0:
                continue
            P = self.config.page_size
            q0 = g.start + g.first_page * P  # first token of the first held page
            n_q = g.end - q0
            if n_q == 0:
                continue
            fmt, P = g.fmt, self.config.page_size
            cb = codes_nbytes(fmt, D)
            esize = g.codes.element_size()
            codes = _from_pages(g.codes, R, g.pages, P * cb // esize, n_q * cb // esize)
            last = D if fmt.is_float or fmt.is_fp8 else cb
            codes = codes.reshape(B, h, n_q, last)
            if g.scales is not None:
                _, bt, bd = block_shape(fmt, h, n_q, D, P)
                nT, nD = -(-n_q // bt), D // bd
                entries = (P // bt) * nD
                scale = _from_pages(g.scales, R, g.pages, entries, nT * nD).reshape(B, h, nT, nD)
                zero = None
                if g.zeros is not None:
                    zero = _from_pages(g.zeros, R, g.pages, entries, nT * nD).reshape(B, h, nT, nD)
            else:
                scale = None if g.static_scale is None else g.static_scale.unsqueeze(0).expand(B, *g.static_scale.shape)
                zero = None if g.static_zero is None else g.static_zero.unsqueeze(0).expand(B, *g.static_zero.shape)
            qt = QTensor(codes, scale, zero, fmt, (B, h, n_q, D), P)
            out[:, g.heads, q0 : g.end] = dequantize(qt)
        out[:, :, : live_start(T, self.sliding_windows[layer])] = math.nan
        return out
