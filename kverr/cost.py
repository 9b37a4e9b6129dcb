"""What one decode step of a config costs on a GPU: launches, bytes read by kind, arithmetic and a
predicted time (the serving-cost model behind ``kverr plan``).

A smaller cache does not by itself decode faster: scale loads, unpacking, conversions, launches
and the batch shape count too. This module counts, for one decode step (one new token per
sequence, ``tokens`` cached per sequence, ``batch`` sequences) and the launch structure of
:class:`kverr.gpu.PagedKVCache`, per layer:

* **launches** -- decode attention once per launch group (the kv heads sharing a (K format,
  V format) pair and their K and V window lengths, :meth:`kverr.config.CacheConfig.launch_groups`;
  every count below uses each head group's own window, :meth:`~kverr.config.CacheConfig.window_for`): a *main* launch over the
  quantized tokens, split in ``splits`` chunks, and a *tail* over the full-precision tokens,
  then one *merge* per layer; the store kernel once per (K|V, head group) when a token block
  fills (every ``tb``-th step: counted as ``1 / tb`` per step), with an int8 window once per K|V
  to receive the new rows; and the eager torch operations of the host side of a store
  (:data:`HOST_OPS`);
* **bytes read**, by kind -- ``codes``, ``scales``, ``zeros`` of the quantized tokens
  (:func:`kverr.memory.group_bytes`: exactly what the cache holds, less page rounding and
  padding, which are never read), ``static`` scales (once per program), ``window`` (sinks,
  window and pending rows, with their int8 scales), ``rope`` (pre-RoPE keys: an fp32 cos and sin
  half-row, ``D/2`` values each, per key position and launch -- the sequences and heads of a launch read the same rows, and
  L2 serves the repeats), ``query`` (each program reads its query rows), ``partials``
  (written by the attention programs and read by the merge, output included) and ``store``
  (the step's new rows, amortised);
* **arithmetic** -- matrix-unit FLOPs of the two dots (tiles of ``max(16, rep)`` query rows, so
  padding rows count) and CUDA-core operations: dequantization per element
  (:data:`DEQUANT_OPS`), RoPE per key element, the online softmax per score.

Predicted time is a roofline per launch plus a per-launch cost, with the constants of one
table (:data:`GPUS`, :data:`OVERHEADS`)::

    t_launch = launch_device + max(bytes / bandwidth, alu / fp32_rate, dot / tensor_rate)
    graphs:  t_step = sum of t_launch (CUDA-graph replay: no host work in the loop)
    eager:   t_step = max(sum of t_launch, host time of every launch and torch op)

The fp16 reference is an fp16 cache read by one attention kernel per layer (torch's scaled-dot-
product attention) plus one write each of the new key and value rows: three launches per layer.
Only attention and the cache are modelled; the model's own matrix products are not, so a
speedup here is the attention part's. The constants are leads until ``bench/gpu/run.sh`` fits
them on a GPU: the H200's copy bandwidth was measured (4.3 TB/s), the rest is datasheet or
assumption, each marked where it is defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kverr.config import WHICH, CacheConfig
from kverr.exceptions import ConfigError, ShapeError
from kverr.memory import ModelShape, group_bytes, window_row_sections
from kverr.quant.formats import QuantFormat, window_format
from kverr.quant.store import SALIENT_INDEX_BYTES, held_tokens, live_start, token_block, token_regions


@dataclass(frozen=True)
class Gpu:
    """The rates of one GPU the model predicts for (bytes and operations per second)."""

    name: str
    bandwidth: float  # sustained device-memory bandwidth, read + write bytes per second
    fp32: float  # CUDA-core operations per second (an FMA counts as one operation here)
    tensor: float  # dense fp16 matrix-unit FLOP/s
    sms: int  # multiprocessors (the decode split rule depends on them)
    source: str


#: The GPUs ``kverr plan --gpu`` knows. Bandwidth: H200 measured (device-to-device copy of a
#: large buffer, read + write bytes over time, on one H200 of the GPU machines kverr is lent,
#: 2026-11-04, not yet by ``bench/gpu``: about 4.3 TB/s, 0.9 of the datasheet's 4.8); H100 and A100 are their datasheet
#: figures times that same 0.9, not measured. fp32: datasheet FP32 FLOP/s halved (an FMA is one
#: operation here). tensor: datasheet dense fp16.
GPUS: dict[str, Gpu] = {
    "h200": Gpu("NVIDIA H200 SXM", 4.3e12, 33.5e12, 990e12, 132,
                "bandwidth measured (4.3 TB/s copy, 2026-11-04); rates from the datasheet"),
    "h100": Gpu("NVIDIA H100 SXM", 3.35e12 * 0.9, 33.5e12, 990e12, 132,
                "datasheet 3.35 TB/s x 0.9 (the H200's measured fraction); not measured"),
    "a100": Gpu("NVIDIA A100 SXM 80GB", 2.04e12 * 0.9, 9.75e12, 312e12, 108,
                "datasheet 2.04 TB/s x 0.9 (the H200's measured fraction); not measured"),
}


@dataclass(frozen=True)
class Overheads:
    """Per-launch costs (seconds). Leads, not measured: ``bench/gpu/run.sh`` fits them."""

    launch_device: float = 2.0e-6  # device time a launch costs beyond its bytes (graph replay, a tiny kernel's floor)
    triton_host: float = 20e-6  # host time of one eager Triton launch (argument binding, specialisation key)
    torch_host: float = 5e-6  # host time of one eager torch operation


OVERHEADS = Overheads()

#: CUDA-core operations per element the decode kernel dequantizes, by storage: a plain float
#: converts; fp8 converts and scales; an integer code is shifted, masked, converted and scaled,
#: a codebook code shifted, masked, looked up and scaled, four either way (one more with a zero
#: point; 3-bit codes and per-channel widths gather two pieces: three more). An fp4 code is
#: unpacked (2), placed in an fp16 pattern and converted (``kernels.minifloat.fp4_value``: 8) and
#: scaled (1); a one-byte scale read per element (channel groups, channel scales) is decoded there
#: too: an e4m3 byte's fp16 pattern (8), an e8m0 byte's exponent (3). Leads.
DEQUANT_OPS = {"float": 1, "fp8": 2, "int": 4, "zero": 1, "int3": 3, "int8_row": 3, "fp4": 11,
               "scale_fp8_e4m3": 8, "scale_e8m0": 3}
#: Per-channel widths: each program also reads the format's int32 unpack word per channel
#: (``kverr.gpu.spec.mixed_layout``), counted with the static scales.
LAYOUT_BYTES_PER_CHANNEL = 4
#: Per key element of pre-RoPE keys: the rotate-half gather and ``k cos + r sin``.
ROPE_OPS = 6
#: Per score: scale, max, subtract, exp2, sum (the online softmax).
SOFTMAX_OPS = 5
#: Eager torch operations (non-view aten operations, one kernel each on a GPU) of a store's host
#: side, per (K|V, head group) and step: writing the new rows into the full-precision buffer (a
#: gather and a scatter; for an int8 window, of codes and of scales: 4; one more when the new rows
#: arrive in another dtype than the window's). An int8 window receives the new rows with one
#: store-kernel launch per K|V and step (no host operation, no synchronisation). Counted on the
#: real cache by ``tests/gpu/test_cost_counts.py``.
HOST_OPS = {"fp_rows": 2, "fp_rows_int8": 4}
#: Host-to-device copies of one step's plan (sequence lengths; per (token block, window) pair of
#: the pools, the store jobs' nine index arrays), counted from ``PagedKVCache.plan`` (on a CPU they are no copies at all);
#: with an int8 window, the five index arrays of the receiving launch's jobs.
PLAN_COPIES = {"step": 1, "token_block": 9, "int8_window": 5}
#: Bytes of a query, output or new key/value element (the model's fp16/bf16 activations).
ACT_BYTES = 2


def default_block_n(head_dim: int) -> int:
    """Tokens per decode tile: 32 up to head dim 64, else 16 (register pressure)."""
    return 32 if head_dim <= 64 else 16


def decode_splits(batch: int, n_kv_heads: int, tokens_after_sinks: int, sms: int, block_n: int) -> int:
    """Chunks the main decode launch splits the quantized tokens into: enough programs for two
    per multiprocessor (``batch * n_kv_heads`` of them without splitting), at most one chunk per
    tile of ``block_n`` tokens; 0 when no token follows the sinks."""
    if tokens_after_sinks <= 0:
        return 0
    return min(max(1, -(-2 * sms // (batch * n_kv_heads))), -(-tokens_after_sinks // block_n))


#: The launches of decode attention (a benchmark of decode alone, store left out, times these);
#: ``attention`` is the fp16 reference's kernel.
DECODE_KINDS = ("main", "tail", "merge", "attention")
BYTE_KINDS = ("codes", "scales", "zeros", "static", "window", "rope", "query", "partials", "store")


@dataclass
class Launch:
    """One kernel launch (or eager torch operation) of a layer's decode step."""

    kind: str  # "main", "tail", "merge", "store", "receive", "host"; the fp16 reference's "attention"
    count: float  # launches per step (fractional: a store every tb-th step)
    heads: tuple[int, ...] = ()
    bytes: dict[str, float] = field(default_factory=dict)
    alu: float = 0.0
    dot: float = 0.0
    triton: bool = True

    @property
    def nbytes(self) -> float:
        return float(sum(self.bytes.values()))

    def device_seconds(self, gpu: Gpu, oh: Overheads) -> float:
        """Roofline time of all ``count`` launches of this kind (the bytes and work are theirs
        together): ``count`` launch costs plus the slowest of bytes, operations and FLOPs."""
        return self.count * oh.launch_device + max(self.nbytes / gpu.bandwidth, self.alu / gpu.fp32,
                                                   self.dot / gpu.tensor)

    def host_seconds(self, oh: Overheads) -> float:
        return self.count * (oh.triton_host if self.triton else oh.torch_host)


@dataclass
class LayerCost:
    layer: int
    groups: int
    splits: int
    launches: list[Launch]

    def bytes_by_kind(self) -> dict[str, float]:
        out = dict.fromkeys(BYTE_KINDS, 0.0)
        for ln in self.launches:
            for k, v in ln.bytes.items():
                out[k] += v
        return out

    @property
    def n_launches(self) -> float:
        return sum(ln.count for ln in self.launches)


@dataclass
class StepCost:
    """One decode step of a config: per layer launches, bytes and arithmetic; predicted times."""

    config_name: str
    shape: ModelShape
    tokens: int
    batch: int
    gpu: Gpu
    overheads: Overheads
    layers: list[LayerCost]
    plan_copies: int

    def bytes_by_kind(self) -> dict[str, float]:
        out = dict.fromkeys(BYTE_KINDS, 0.0)
        for lc in self.layers:
            for k, v in lc.bytes_by_kind().items():
                out[k] += v
        return out

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_by_kind().values())

    @property
    def alu(self) -> float:
        return sum(ln.alu for lc in self.layers for ln in lc.launches)

    @property
    def dot(self) -> float:
        return sum(ln.dot for lc in self.layers for ln in lc.launches)

    @property
    def launches(self) -> float:
        return sum(lc.n_launches for lc in self.layers) + self.plan_copies

    def _times(self, lc: LayerCost) -> tuple[float, float]:
        return (sum(ln.device_seconds(self.gpu, self.overheads) for ln in lc.launches),
                sum(ln.host_seconds(self.overheads) for ln in lc.launches))

    def decode_seconds(self) -> float:
        """Device time of the attention launches alone (main, tail and merge of every layer; for
        the fp16 reference, its attention kernels): what a benchmark of decode, store left
        out, measures from a CUDA graph."""
        return sum(ln.device_seconds(self.gpu, self.overheads) for lc in self.layers for ln in lc.launches
                   if ln.kind in DECODE_KINDS)

    def layer_seconds(self, layer: int, graphs: bool = True) -> float:
        dev, host = self._times(self.layers[layer])
        return dev if graphs else max(dev, host)

    def seconds(self, graphs: bool = True) -> float:
        """Predicted step time.

        ``graphs``: the step's launches replayed from a CUDA graph (the device time alone).
        Eager: the host's launch work and the device's run overlap, and the slower sets the pace
        (no launch of the step waits for the device).
        """
        oh = self.overheads
        times = [self._times(lc) for lc in self.layers]
        dev = sum(d for d, _ in times) + self.plan_copies * oh.launch_device
        if graphs:
            return dev
        host = sum(h for _, h in times) + self.plan_copies * oh.torch_host
        return max(dev, host)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config_name, "model": asdict(self.shape), "tokens": self.tokens, "batch": self.batch,
            "gpu": asdict(self.gpu), "overheads": asdict(self.overheads),
            "bytes": self.bytes_by_kind(), "total_bytes": self.total_bytes, "alu_ops": self.alu, "dot_flops": self.dot,
            "launches": self.launches, "plan_copies": self.plan_copies,
            "seconds_graphs": self.seconds(True), "seconds_eager": self.seconds(False),
            "layers": [
                {"layer": lc.layer, "groups": lc.groups, "splits": lc.splits, "launches": lc.n_launches,
                 "bytes": lc.bytes_by_kind(), "seconds_graphs": self.layer_seconds(i, True),
                 "seconds_eager": self.layer_seconds(i, False),
                 "by_launch": [{"kind": ln.kind, "count": ln.count, "heads": list(ln.heads), "bytes": ln.bytes,
                                "alu_ops": ln.alu, "dot_flops": ln.dot} for ln in lc.launches]}
                for i, lc in enumerate(self.layers)
            ],
        }

    def to_table(self, per_layer: bool = True) -> str:
        kinds = ["codes", "scales", "zeros", "window", "rope", "other"]
        head = ["layer", "groups", "launches", *(f"{k} MB" for k in kinds), "graph us", "eager us"]

        def row(name, groups, launches, by, tg, te):
            other = sum(v for k, v in by.items() if k not in kinds)
            vals = [by.get(k, 0.0) for k in kinds[:-1]] + [other]
            return [name, groups, f"{launches:.1f}", *(f"{v / 1e6:.3f}" for v in vals), f"{tg * 1e6:.1f}", f"{te * 1e6:.1f}"]

        rows = []
        if per_layer:
            for i, lc in enumerate(self.layers):
                rows.append(row(str(lc.layer), str(lc.groups), lc.n_launches, lc.bytes_by_kind(),
                                self.layer_seconds(i, True), self.layer_seconds(i, False)))
        rows.append(row("all", str(sum(lc.groups for lc in self.layers)), self.launches, self.bytes_by_kind(),
                        self.seconds(True), self.seconds(False)))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)


def _check(tokens: int, batch: int) -> None:
    for name, v in (("tokens", tokens), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ShapeError(f"{name}={v!r}: must be a positive integer")


def _gpu(gpu: str | Gpu) -> Gpu:
    if isinstance(gpu, Gpu):
        return gpu
    if gpu not in GPUS:
        raise ConfigError(f"gpu={gpu!r} is not known; one of {', '.join(GPUS)}")
    return GPUS[gpu]


def _q_heads(shape: ModelShape) -> int:
    if shape.n_q_heads is None:
        raise ShapeError(f"the query heads of {shape.name} are not known: give them (a model directory, or "
                         "--shape L,H,D,HQ); decoding cost depends on them")
    return shape.n_q_heads


def _dequant_ops(fmt: QuantFormat) -> int:
    if fmt.is_float:
        return DEQUANT_OPS["float"]
    # a one-byte scale loaded per element is decoded per element (a row's scale: once, not counted)
    per_element = fmt.granularity.kind in ("token_group", "channel")
    scale = DEQUANT_OPS.get(f"scale_{fmt.scale_dtype}", 0) if per_element else 0
    if fmt.is_fp8:
        return DEQUANT_OPS["fp8"] + scale
    if fmt.is_fp4:
        return DEQUANT_OPS["fp4"] + scale
    ops = DEQUANT_OPS["int"] + (DEQUANT_OPS["zero"] if fmt.has_zero else 0) + scale
    return ops + (DEQUANT_OPS["int3"] if fmt.bits == 3 or fmt.channel_bits is not None else 0)


def step_cost(config: CacheConfig, shape: ModelShape, tokens: int, batch: int = 1, gpu: str | Gpu = "h200",
              *, overheads: Overheads = OVERHEADS) -> StepCost:
    """The cost of one decode step with ``tokens`` cached per sequence (the new one included).

    Parameters
    ----------
    config
        The cache config.
    shape
        The model's shape; its ``n_q_heads`` must be known.
    tokens, batch
        Cached tokens per sequence; sequences decoded together.
    gpu
        A key of :data:`GPUS` or a :class:`Gpu`.
    overheads
        Per-launch costs (default :data:`OVERHEADS`).
    """
    _check(tokens, batch)
    g = _gpu(gpu)
    Hq, H, D = _q_heads(shape), shape.n_kv_heads, shape.head_dim
    config.check_model(shape.n_layers, H, D)
    rep = Hq // H
    block_h = max(16, 1 << max(0, rep - 1).bit_length())
    T, B = tokens, batch
    splits = decode_splits(B, H, T - min(config.sinks, T), g.sms, default_block_n(D))
    wf = window_format(config.window_dtype)
    fp_row = sum(window_row_sections(config.window_dtype, D))
    win_ops = DEQUANT_OPS["float"] if wf.is_float else DEQUANT_OPS["int8_row"]
    layers = []
    blocks: set[tuple[int, int]] = set()  # (token block, window): the plan's store jobs, copied per pair
    for layer in range(shape.n_layers):
        launches: list[Launch] = []
        # a sliding-window layer reads the tokens of its window only (the kernel starts each split
        # at the first token its query sees; the grid is that of the whole sequence)
        W = shape.sliding_window(layer)
        live = live_start(T, W)
        for kf, vf, heads in config.launch_groups(layer, H):
            h = len(heads)
            main = Launch("main", 1.0 if splits else 0.0, tuple(heads), dict.fromkeys(BYTE_KINDS, 0.0))
            tail = Launch("tail", 1.0, tuple(heads), dict.fromkeys(BYTE_KINDS, 0.0))
            wins = {w: config.window_for(layer, heads[0], w) for w in WHICH}  # the launch's K and V windows
            for fmt, is_key in ((kf, True), (vf, False)):
                which = "k" if is_key else "v"
                b, _ = group_bytes(config, fmt, h, T, D, B, sliding_window=W, which=which, window=wins[which])
                n_sink, n_q, n_win = held_tokens(T, *token_regions(T, config, fmt, window=wins[which]), live)
                n_fp = n_sink + n_win
                main.bytes["codes"] += b.payload
                main.bytes["scales"] += b.scales
                main.bytes["zeros"] += b.zeros
                static = b.static
                if fmt.channel_bits is not None:  # an int32 unpack word per channel and kv head
                    static += LAYOUT_BYTES_PER_CHANNEL * D * h
                main.bytes["static"] += static * B * splits
                tail.bytes["static"] += static * B
                # salient rows (and positions) are read by the tail, beside the sinks and window
                n_sal = min(config.salient, n_q) if config.keeps_salient(which, fmt) else 0
                tail.bytes["window"] += b.sinks + b.window + b.salient
                main.alu += B * h * n_q * D * _dequant_ops(fmt)
                tail.alu += B * h * (n_fp + n_sal) * D * win_ops
                if is_key and config.key_pre_rope:
                    # the fp32 cos and sin half-rows (D/2 each) of every key position: the sequences
                    # and heads of one launch read the same rows at about the same time, so L2
                    # serves repeats
                    main.bytes["rope"] += n_q * 2 * (D // 2) * 4
                    tail.bytes["rope"] += n_fp * 2 * (D // 2) * 4
                    main.alu += B * h * n_q * D * ROPE_OPS
                    tail.alu += B * h * n_fp * D * ROPE_OPS
            # the main launch holds the tokens quantized for both K and V; the tail the rest
            e0 = min(token_regions(T, config, f, window=wins[w])[1] for f, w in ((kf, "k"), (vf, "v")))
            n_sink, n_main, n_win = held_tokens(T, min(config.sinks, T), e0, live)
            # salient tokens: each main program loads the head's N positions and masks them out
            # (a compare per token and position); the tail attends to N more entries, their rows
            n_sal = config.salient if config.keeps_salient("k", kf) or config.keeps_salient("v", vf) else 0
            main.bytes["static"] += SALIENT_INDEX_BYTES * n_sal * B * h * splits
            main.alu += B * h * n_main * n_sal
            n_tail = n_sink + n_win + n_sal
            for ln, n, progs in ((main, n_main, splits), (tail, n_tail, 1)):
                if ln.count:
                    ln.alu += B * h * block_h * n * SOFTMAX_OPS
                    ln.dot += 4 * B * h * block_h * n * D
                    ln.bytes["query"] += B * h * rep * D * ACT_BYTES * progs
                    ln.bytes["partials"] += B * h * rep * progs * (D + 2) * 4
            launches += [ln for ln in (main, tail) if ln.count]
        nsp = splits + 1
        launches.append(Launch("merge", 1.0, (), {"partials": B * Hq * nsp * (D + 2) * 4 + B * Hq * D * ACT_BYTES}))
        for w in WHICH:
            if not wf.is_float:
                launches.append(Launch("receive", 1.0, tuple(range(H)), {"store": B * H * (D * ACT_BYTES + fp_row)}))
            for fmt, win, heads in config.window_groups(layer, H, w):
                h = len(heads)
                tb = token_block(fmt.granularity, config.page_size)
                blocks.add((tb, win))
                b1, _ = group_bytes(config, fmt, h, T, D, B, which=w, window=win)
                start, end = token_regions(T, config, fmt, window=win)
                per_tok = (b1.payload + b1.scales + b1.zeros) / max(end - start, 1)
                # steady state: past the sinks and the group's window, a token block is quantized
                # every tb-th step; the new row stays full precision unless it is quantized at once
                # (no window: in tb - 1 of tb steps it waits for its block)
                quantizes = T - min(config.sinks, T) > win
                kept = 1.0 if (win or T <= config.sinks or not quantizes) else (tb - 1) / tb
                if quantizes:
                    launches.append(Launch("store", 1.0 / tb, tuple(heads), {"store": B * h * (fp_row + per_tok)}))
                if kept:
                    n_ops = HOST_OPS["fp_rows"] if wf.is_float else HOST_OPS["fp_rows_int8"]
                    launches.append(Launch("host", n_ops * kept, tuple(heads),
                                           {"store": kept * B * h * (D * ACT_BYTES + fp_row)}, triton=False))
        layers.append(LayerCost(layer, len(config.launch_groups(layer, H)), splits, launches))
    copies = (PLAN_COPIES["step"] + PLAN_COPIES["token_block"] * len(blocks)
              + (0 if wf.is_float else PLAN_COPIES["int8_window"]))
    return StepCost(config.name or "config", shape, T, B, g, overheads, layers, copies)


def fp16_step(shape: ModelShape, tokens: int, batch: int = 1, gpu: str | Gpu = "h200", *,
              overheads: Overheads = OVERHEADS) -> StepCost:
    """The reference: an fp16 cache read by one attention kernel per layer, plus one write each
    of the new key and value rows (see the module docs)."""
    _check(tokens, batch)
    g = _gpu(gpu)
    Hq, H, D = _q_heads(shape), shape.n_kv_heads, shape.head_dim
    B = batch
    layers = []
    for layer in range(shape.n_layers):
        T = tokens - live_start(tokens, shape.sliding_window(layer))  # a sliding layer's window
        attn = Launch("attention", 1.0, tuple(range(H)),
                      {"codes": 2.0 * B * H * T * D * 2, "query": B * Hq * D * ACT_BYTES,
                       "partials": B * Hq * D * ACT_BYTES},
                      alu=B * Hq * T * SOFTMAX_OPS, dot=4.0 * B * Hq * T * D)
        write = Launch("host", 2.0, (), {"store": 2.0 * B * H * D * 2 * 2}, triton=False)
        layers.append(LayerCost(layer, 1, 0, [attn, write]))
    return StepCost("fp16 (torch SDPA)", shape, tokens, B, g, overheads, layers, 0)


#: Contexts and batches of the speedup grid ``kverr plan`` prints.
GRID_TOKENS = (4096, 32768, 131072)
GRID_BATCHES = (1, 16, 64)


def speedups(config: CacheConfig, shape: ModelShape, gpu: str | Gpu = "h200", *,
             tokens: Sequence[int] = GRID_TOKENS, batches: Sequence[int] = GRID_BATCHES,
             graphs: bool = True, overheads: Overheads = OVERHEADS) -> dict[tuple[int, int], float]:
    """Predicted speedup of a decode step's attention over fp16, per ``(tokens, batch)``."""
    out = {}
    for T in tokens:
        for B in batches:
            ref = fp16_step(shape, T, B, gpu, overheads=overheads).seconds(graphs)
            out[(T, B)] = ref / step_cost(config, shape, T, B, gpu, overheads=overheads).seconds(graphs)
    return out


def speedup_table(config: CacheConfig, shape: ModelShape, gpu: str | Gpu = "h200", *,
                  tokens: Sequence[int] = GRID_TOKENS, batches: Sequence[int] = GRID_BATCHES,
                  overheads: Overheads = OVERHEADS) -> str:
    """The speedup grid as text: rows of tokens, columns of batch, with and without graphs."""
    lines = []
    for graphs in (True, False):
        sp = speedups(config, shape, gpu, tokens=tokens, batches=batches, graphs=graphs, overheads=overheads)
        head = ["tokens"] + [f"batch {b}" for b in batches]
        rows = [[f"{T:,}"] + [f"{sp[(T, b)]:.2f}x" for b in batches] for T in tokens]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines.append(f"predicted speedup of attention over fp16 ({'CUDA graphs' if graphs else 'eager launches'}):")
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
