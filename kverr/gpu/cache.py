"""A paged, quantized KV cache driven by the Triton kernels: plan once per step, run per layer.

Layout
------
One block table ``[max_batch, max_pages]`` (int32) is shared by every layer, K/V and head group:
logical page ``p`` of sequence ``b`` is physical page ``block_table[b, p]`` of *every* pool, as in
vLLM. Per ``(layer, K|V, head group)`` -- the kv heads sharing one format and one window -- the
cache holds

* ``codes``  ``[num_pages, h, page_size, cb]`` uint8 (planar packed codes, fp8 bit patterns) or
  the plain float dtype (``cb = D``);
* ``scale``/``zero`` ``[num_pages, h, page_size // bts, D // bd]`` in the scale dtype, i.e. one
  row per token (token, token groups), per token block (channel groups) or per page; static
  granularities hold ``[h, D // bd]`` once;
* ``fp`` ``[max_batch, h, sinks + window + tb, D]`` in ``window_dtype``: the sink tokens in slots
  ``[0, sinks)`` and the full-precision window as a ring (token ``t`` in slot
  ``sinks + (t - sinks) % (window + tb)``), so flushing a token block never moves data. ``window``
  is the group's own (:meth:`~kverr.config.CacheConfig.window_for`: a layer or head override may
  give a side its own length; heads of one format but other windows are other groups). An
  ``int8`` window holds the oracle's uint8 codes there and a scale per slot in ``fp_scale``
  ``[max_batch, h, sinks + window + tb]`` fp16.
* with ``config.salient`` = N, a pool that keeps salient rows (``config.keeps_salient``: its side
  and a format that quantizes) holds each sequence's salient prompt tokens
  (:mod:`kverr.error.salient`) as N more ``window_dtype`` rows after the ring (slots
  ``sinks + window + tb + j``) and their positions in ``sal_pos`` ``[max_batch, h, N]`` int32
  (-1: none); :meth:`PagedKVCache.store` takes them with the prefill. Their codes stay in the
  pages, unread: the decode kernel reads the rows.

Token policy is exactly :func:`kverr.quant.token_regions` with each group's window: page ``p``
holds quantized tokens ``sinks + p*P .. sinks + (p+1)*P``. A step's store jobs are planned once
per distinct (token block, window) pair of the pools; a decode launch serves the kv heads whose
K pool and V pool are the same (:meth:`~kverr.config.CacheConfig.launch_groups`), each side with
its own window. As in the oracle, the cache receives K/V in its own dtype
(``window_dtype``, :func:`kverr.quant.store.receive`): inputs are rounded to it first (for an
``int8`` window, quantized on the device by the store kernel in the window's int8 format, bit
for bit the oracle's, and decoded inside the store kernels that read them), so a token
quantized straight from the input and one quantized from its window copy when its block fills get
the same, reference, codes.

With ``config.key_pre_rope`` the cache stores the keys it is given -- pre-RoPE keys -- and the
decode kernel rotates every key row to its position (``t`` = the token's index in its sequence)
with the ``rope=(cos, sin)`` tables, ``[max_tokens, D]``, given at construction (the cache keeps
one half of each: in transformers' half-rotation convention both halves of a row are the same);
models with a RoPE per layer type (Gemma 3) give a list of such pairs, one per layer.

Usage::

    cache = PagedKVCache(config, n_layers=L, n_kv_heads=H, n_q_heads=Hq, head_dim=D,
                         max_batch=B, max_tokens=T_max, device="cuda")
    step = cache.plan([n_new_0, ..., n_new_{B-1}])     # host bookkeeping once per step
    for layer in range(L):
        cache.store(step, layer, k_new, v_new)          # [N_new, H, D] rows, sequences in order
        out = cache.decode(step, layer, q)              # [B, Hq, D]: the last query of each sequence
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kverr.cost import decode_splits, default_block_n
from kverr.exceptions import ConfigError, KernelError, ShapeError
from kverr.gpu.interpreter import interpreting
from kverr.gpu.spec import GRAN_BLOCK, KIND_FLOAT, KernelSpec, check_head_dim, codebook_table, kernel_spec, mixed_layout
from kverr.quant.compensated import compensable
from kverr.quant.formats import TORCH_DTYPES, window_format
from kverr.quant.reference import QTensor, dequantize
from kverr.quant.store import SALIENT_INDEX_DTYPE, WindowRows, receive

log = logging.getLogger(__name__)

#: Most rows a store job quantizes for per-row granularities (one tile of the store kernel).
JOB_ROWS = 16
#: Most bytes of compensation factors (float64 ``[D, D]`` per job row and head) one store launch of
#: pre-RoPE keys rounded with compensation reads; a longer store runs as several launches.
COMP_FACTOR_BYTES = 64 << 20


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _order_table(order: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., 2D]``: a factor's channel order ``[..., D]``, then each channel's position in it."""
    return torch.cat([order, torch.argsort(order, dim=-1)], dim=-1).to(torch.int32).contiguous()


@dataclass(eq=False)
class Pool:
    """Storage of one ``(layer, K|V, head group)``."""

    spec: KernelSpec
    heads: list[int]
    heads_t: torch.Tensor
    heads_l: torch.Tensor  # the heads as int64 indices, for the host side's gathers
    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    fp: torch.Tensor
    fp_scale: torch.Tensor | None  # int8 windows: [max_batch, h, sinks + cap] fp16, else None
    cap: int
    ratios: torch.Tensor  # fp32 MSE clip ratios for the store kernel (one unused 1.0 when absmax)
    # per-channel widths (spec.bits == 0): the layout words of kverr.gpu.spec.mixed_layout, int32
    # [D] (unpack) and [8, D] (pack); codebooks: their table (kverr.gpu.spec.codebook_table) and
    # no packing; None otherwise
    layout: torch.Tensor | None = None
    packing: torch.Tensor | None = None
    # salient rows (config.salient, quantized formats): how many per sequence and head, positions
    nsal: int = 0
    sal_pos: torch.Tensor | None = None
    # recent tokens the group keeps unquantized (config.window_for its heads); cap = window + tb
    window: int = 0

    @property
    def job_key(self) -> tuple[int, int]:
        """``(token block, window)``: the key of this pool's store jobs in :attr:`StepPlan.store`."""
        return self.spec.tb, self.window

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scale, self.zero, self.fp, self.fp_scale, self.sal_pos)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(eq=False)
class StoreJobs:
    """Work of one step for the pools whose token block is ``tb`` and window ``window`` (device
    tensors)."""

    tb: int
    window: int
    n_jobs: int
    block_r: int
    page: torch.Tensor
    row0: torch.Tensor
    nrows: torch.Tensor
    seq: torch.Tensor
    src_new: torch.Tensor
    src_slot: torch.Tensor
    n_fp: int
    fp_row: torch.Tensor
    fp_seq: torch.Tensor
    fp_slot: torch.Tensor
    # host copies for the factors of compensated keys: each job's sequence [n_jobs] and, for keys
    # stored before RoPE, each job row's token position [n_jobs, block_r] (-1: no row)
    seq_np: np.ndarray | None = None
    tokens: np.ndarray | None = None

    def select(self, j0: int, j1: int) -> StoreJobs:
        """Jobs ``j0 .. j1 - 1`` (views), without the window's writes."""
        return replace(self, n_jobs=j1 - j0, page=self.page[j0:j1], row0=self.row0[j0:j1], nrows=self.nrows[j0:j1],
                       seq=self.seq[j0:j1], src_new=self.src_new[j0:j1], src_slot=self.src_slot[j0:j1], n_fp=0,
                       seq_np=self.seq_np[j0:j1], tokens=None if self.tokens is None else self.tokens[j0:j1])


@dataclass(eq=False)
class StepPlan:
    """Everything a step needs that does not depend on the layer (see :meth:`PagedKVCache.plan`)."""

    new_tokens: np.ndarray
    lengths: np.ndarray
    n_rows: int
    store: dict[tuple[int, int], StoreJobs]  # by (token block, window): Pool.job_key
    seq_lens: torch.Tensor
    num_splits: int
    chunk: int
    partial_o: torch.Tensor
    partial_m: torch.Tensor
    partial_l: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Launch:
    """One decode launch: the kv heads of a layer whose K pool and V pool are the same (one K
    format and window, one V format and window)."""

    kpool: Pool
    vpool: Pool
    heads: list[int]
    heads_t: torch.Tensor
    kmap: torch.Tensor
    vmap: torch.Tensor


def calibrate_static_scales(config, keys, values) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor | None]]:
    """Static scales for every static-granularity head group, from calibration data.

    Parameters
    ----------
    config : CacheConfig
    keys, values : list of array ``[B, kv_head, token, channel]``, one per layer
        The scales are taken, as :class:`kverr.quant.ReferenceStore` takes them, jointly over
        the quantized tokens of all ``B`` sequences with :func:`kverr.quant.store.fit_static_scales`.

    Returns
    -------
    dict
        ``(layer, "k"|"v", first_head) -> (scale, zero)``, ready for :class:`PagedKVCache`.
    """
    out = {}
    for layer, (k, v) in enumerate(zip(keys, values)):
        out.update(layer_static_scales(config, layer, k, v))
    return out


def layer_static_scales(config, layer: int, k, v, salient: torch.Tensor | None = None,
                        ) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`calibrate_static_scales` of one layer (``k, v [B, kv_head, token, channel]``);
    ``salient [B, kv_head, m]``: the prefill's salient positions, left out of the fit on the sides
    that keep their rows (as :class:`kverr.hf.KverrCache` leaves them out)."""
    from kverr.quant.store import fit_static_scales, token_regions, without_salient

    out = {}
    for which, x in (("k", k), ("v", v)):
        x = receive(torch.as_tensor(x).float(), config.window_dtype)  # the cache receives K/V in window_dtype
        H, T = x.shape[1], x.shape[2]
        for fmt, window, heads in config.window_groups(layer, H, which):
            if not fmt.takes_static_scales:
                continue  # a fixed scale is the format's own, set by the cache
            start, end = token_regions(T, config, fmt, window=window)
            if end > start:
                keeps = salient is not None and config.keeps_salient(which, fmt)
                rel = salient[:, heads].long() - start if keeps else None
                region = without_salient(x[:, heads, start:end], rel)
            else:
                region = x[:, heads]
            out[(layer, which, heads[0])] = fit_static_scales([region], fmt, config.page_size)
    return out


class PagedKVCache:
    """Paged quantized KV cache for ``max_batch`` sequences of a model (see the module docs).

    Parameters
    ----------
    config : CacheConfig
        Formats per layer and head, sinks, window, page size, window dtype.
    n_layers, n_kv_heads, n_q_heads, head_dim : int
        Model shape; ``n_q_heads`` a multiple of ``n_kv_heads`` (query head ``h`` reads kv head
        ``h // (n_q_heads // n_kv_heads)``).
    max_batch : int
        Sequence slots.
    max_tokens : int
        Longest sequence; sizes the block table (and, unless ``num_pages`` is given, the pools).
    device : str or torch.device
        ``"cuda"`` for real kernels; ``"cpu"`` under ``TRITON_INTERPRET=1``.
    static_scales : dict or "first", optional
        Calibrated scales for static granularities, see :func:`calibrate_static_scales`; or
        ``"first"``: each layer's are set by :meth:`set_static_scales` before its first store
        (:class:`kverr.hf.KernelKVCache` takes them from the prefill, as
        :class:`kverr.hf.KverrCache` does).
    num_pages : int, optional
        Physical pages per pool (default: enough for every slot at ``max_tokens``).
    dot_fp16 : bool
        Multiply in fp16 on tensor cores (fp32 accumulation); default fp32 (IEEE) products.
    block_n : int, optional
        Tokens per decode tile (default 32 at head dim <= 64, else 16: with 8 warps no
        specialisation spills, see bench/results/aot-*.txt).
    sliding_windows : sequence of int, optional
        Per layer, the sliding window (0: full attention): decode and prefill of that layer see
        the tokens ``p − W < t ≤ p`` of a query at ``p``. Every token stays stored (no page is
        freed behind the window; :mod:`kverr.memory` counts what an engine that frees them holds).
    sinks : torch.Tensor, optional
        ``[n_layers, n_q_heads]`` learned sink logits (gpt-oss): one more softmax term per query
        head, without a value.
    """

    def __init__(self, config, *, n_layers: int, n_kv_heads: int, n_q_heads: int, head_dim: int,
                 max_batch: int, max_tokens: int, device: str | torch.device | None = None,
                 static_scales: dict | None = None, num_pages: int | None = None,
                 dot_fp16: bool = False, block_n: int | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sliding_windows=None, sinks: torch.Tensor | None = None) -> None:
        from kverr.config import CacheConfig

        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config must be a CacheConfig, got {type(config).__name__}")
        for name, val in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("n_q_heads", n_q_heads),
                          ("max_batch", max_batch), ("max_tokens", max_tokens)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ShapeError(f"{name}={val!r} must be a positive integer")
        if n_q_heads % n_kv_heads:
            raise ShapeError(f"n_q_heads={n_q_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        check_head_dim(head_dim)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type != "cuda" and not interpreting():
            raise KernelError(
                f"the Triton kernels need a CUDA device, got {self.device}; on a CPU set "
                "TRITON_INTERPRET=1 before importing kverr.gpu to run them in the interpreter"
            )
        config.check_model(n_layers, n_kv_heads, head_dim)
        self.config = config
        self.L, self.H, self.Hq, self.D = n_layers, n_kv_heads, n_q_heads, head_dim
        self.windows = [0] * n_layers if sliding_windows is None else [int(w) for w in sliding_windows]
        if len(self.windows) != n_layers or min(self.windows) < 0:
            raise ShapeError(f"sliding_windows={sliding_windows!r}: give one non-negative window per layer ({n_layers})")
        self.sinks = None
        if sinks is not None:
            if tuple(sinks.shape) != (n_layers, n_q_heads):
                raise ShapeError(f"sinks of shape {tuple(sinks.shape)}: give [n_layers, n_q_heads] = "
                                 f"[{n_layers}, {n_q_heads}] sink logits")
            self.sinks = sinks.detach().to(device=self.device, dtype=torch.float32).contiguous()
        self.rep = n_q_heads // n_kv_heads
        self.B = max_batch
        self.P = config.page_size
        self.S = config.sinks
        self.max_pages = -(-max_tokens // self.P)
        self.num_pages = num_pages if num_pages is not None else max_batch * self.max_pages
        self.dot_fp16 = bool(dot_fp16)
        self.block_n = block_n or default_block_n(head_dim)
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise KernelError(f"block_n={self.block_n} must be a power of two >= 16")
        self.fp_q = not window_format(config.window_dtype).is_float  # int8 rows + a scale per slot
        wdt = torch.uint8 if self.fp_q else TORCH_DTYPES[config.window_dtype]
        deferred = isinstance(static_scales, str)
        if deferred and static_scales != "first":
            raise ConfigError(f"static_scales={static_scales!r}: give a dict of scales or 'first'")
        static_scales = {} if deferred else dict(static_scales or {})
        self.unset_static: set[tuple[int, str, int]] = set()
        dev = self.device
        self.key_pre_rope = bool(config.key_pre_rope)
        self._static_moments: dict[int, torch.Tensor] = {}  # config.key_moments per layer, on the device
        # post-RoPE keys under static moments: each (layer, pool heads)' (order table, factor), made once
        self._static_factors: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        # per layer, the (cos, sin) half tables the decode kernel reads; layers sharing a pair share it
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.key_pre_rope:
            if rope is None:
                raise KernelError("config.key_pre_rope: pass rope=(cos, sin), the [max_tokens, head_dim] RoPE tables "
                                  "of positions 0..max_tokens-1 (the decode kernel rotates keys to their positions)")
            pairs = list(rope) if isinstance(rope, list) else [rope] * n_layers
            if len(pairs) != n_layers:
                raise ShapeError(f"rope: {len(pairs)} (cos, sin) pairs for {n_layers} layers; give one pair, or one per layer")
            halves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self.rope_tables = [halves.setdefault(id(p), self._rope_half(p, max_tokens, head_dim, dev)) for p in pairs]
        elif rope is not None:
            raise ConfigError("rope tables were given but config.key_pre_rope is false (keys are post-RoPE)")

        self.pools: list[dict[str, list[Pool]]] = []
        self.launches: list[list[_Launch]] = []
        for layer in range(n_layers):
            per: dict[str, list[Pool]] = {}
            for which in ("k", "v"):
                per[which] = []
                for fmt, window, heads in config.window_groups(layer, n_kv_heads, which):
                    spec = kernel_spec(fmt, head_dim, self.P)
                    h = len(heads)
                    codes = torch.zeros((self.num_pages, h, self.P, spec.cb), dtype=spec.codes_dtype, device=dev)
                    scale = zero = None
                    if spec.kind != KIND_FLOAT:
                        ncol = head_dim // spec.bd
                        if spec.static and fmt.fixed_scale is not None:  # the format's constant
                            scale, zero = self._static_pair((torch.tensor(fmt.fixed_scale), None), h, ncol, spec,
                                                            (layer, which, heads[0]), fmt)
                        elif spec.static:
                            key = (layer, which, heads[0])
                            if deferred:
                                self.unset_static.add(key)
                            elif key not in static_scales:
                                raise KernelError(
                                    f"layer {layer} {which} heads {heads}: {fmt.label()} has static scales; "
                                    "pass static_scales (see kverr.gpu.calibrate_static_scales), or 'first'"
                                )
                            else:
                                scale, zero = self._static_pair(static_scales[key], h, ncol, spec, key, fmt)
                        else:
                            shape = (self.num_pages, h, spec.scale_rows(self.P), ncol)
                            scale = torch.zeros(shape, dtype=spec.scale_dtype, device=dev)
                            if spec.kind == 1:
                                zero = torch.zeros(shape, dtype=spec.scale_dtype, device=dev)
                    cap = window + spec.tb
                    nsal = config.salient if config.keeps_salient(which, fmt) else 0
                    fp = torch.zeros((max_batch, h, self.S + cap + nsal, head_dim), dtype=wdt, device=dev)
                    fp_scale = (torch.zeros((max_batch, h, self.S + cap + nsal), dtype=torch.float16, device=dev)
                                if self.fp_q else None)
                    sal_pos = (torch.full((max_batch, h, nsal), -1, dtype=SALIENT_INDEX_DTYPE, device=dev)
                               if nsal else None)
                    ratios = torch.tensor(spec.clip_ratios or (1.0,), dtype=torch.float32, device=dev)
                    layout = packing = None
                    if spec.bits == 0:
                        layout, packing = (torch.from_numpy(t).to(dev) for t in mixed_layout(fmt, head_dim))
                    elif fmt.is_codebook:
                        layout = torch.from_numpy(codebook_table(fmt)).to(dev)
                    per[which].append(Pool(spec, list(heads), torch.tensor(heads, dtype=torch.int32, device=dev),
                                           torch.tensor(heads, dtype=torch.int64, device=dev),
                                           codes, scale, zero, fp, fp_scale, cap, ratios, layout, packing,
                                           nsal, sal_pos, window))
            self.pools.append(per)
            self.launches.append(self._make_launches(layer, per))
        if self.fp_q:  # the int8 window's format, for receiving new rows on the device
            self.receive_spec = kernel_spec(window_format(config.window_dtype), head_dim, JOB_ROWS)
            self.all_heads = torch.arange(n_kv_heads, dtype=torch.int32, device=dev)
            self.unit_ratio = torch.ones(1, dtype=torch.float32, device=dev)
        # decode serves query row b of sequence b: fixed, made once
        self.decode_rows = torch.arange(max_batch, dtype=torch.int32, device=dev)
        self.decode_count = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.block_table = np.zeros((max_batch, self.max_pages), dtype=np.int32)
        self.block_table_t = torch.zeros((max_batch, self.max_pages), dtype=torch.int32, device=dev)
        self.lengths = np.zeros(max_batch, dtype=np.int64)
        self.pages_held = np.zeros(max_batch, dtype=np.int64)
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        # the (token block, window) pairs of the pools: a step plans store jobs once per pair
        self.job_keys = sorted({p.job_key for per in self.pools for ps in per.values() for p in ps})

    # ---- construction helpers ----------------------------------------------------------------

    @property
    def rope_cos(self) -> torch.Tensor | None:
        """Layer 0's ``[max_tokens, D/2]`` cos table (pre-RoPE keys), as the kernel reads it."""
        return None if self.rope_tables is None else self.rope_tables[0][0]

    @staticmethod
    def _rope_half(pair, max_tokens: int, head_dim: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = (torch.as_tensor(t) for t in pair)
        if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] < max_tokens or cos.shape[1] != head_dim:
            raise ShapeError(f"rope tables must both be [>= max_tokens={max_tokens}, head_dim={head_dim}] "
                             f"(full rotary dimension), got {tuple(cos.shape)} and {tuple(sin.shape)}")
        # The half-rotation convention repeats each frequency in both halves of a row: the
        # kernel reads one half (half the bytes of a pre-RoPE key's rotation, same numbers).
        half = head_dim // 2
        for name, t in (("cos", cos), ("sin", sin)):
            if not torch.equal(t[:, :half], t[:, half:]):
                raise ShapeError(f"rope {name} table: its two halves differ; the decode kernel rotates keys in "
                                 "transformers' half-rotation convention, whose tables repeat each frequency")
        return cos[:, :half].float().to(dev).contiguous(), sin[:, :half].float().to(dev).contiguous()

    def _static_pair(self, sz, h, ncol, spec: KernelSpec, key, fmt) -> tuple[torch.Tensor, torch.Tensor | None]:
        s, z = sz
        scale = self._static(s, h, ncol, spec, "scale", key)
        zero = None
        if spec.kind == 1:
            if z is None:
                raise KernelError(f"{key}: {fmt.label()} is asymmetric and needs a static zero point")
            zero = self._static(z, h, ncol, spec, "zero", key)
        return scale, zero

    def static_pending(self, layer: int) -> list[tuple[int, str, int]]:
        """Head groups of ``layer`` still waiting for :meth:`set_static_scales` (none once every
        layer's prefill has set them: then no scan)."""
        if not self.unset_static:
            return []
        return sorted(key for key in self.unset_static if key[0] == layer)

    def set_static_scales(self, scales: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Set the static scales of head groups created with ``static_scales="first"`` (keys as
        :func:`calibrate_static_scales` returns them); each group's, once, before its first store."""
        for key, sz in scales.items():
            if key not in self.unset_static:
                raise KernelError(f"{key}: no head group waits for static scales there (already set, or not static)")
            layer, which, first = key
            pool = next(p for p in self.pools[layer][which] if p.heads[0] == first)
            fmt = self.config.format_for(layer, first, which)
            pool.scale, pool.zero = self._static_pair(sz, len(pool.heads), self.D // pool.spec.bd, pool.spec, key, fmt)
            self.unset_static.discard(key)

    def _static(self, t, h, ncol, spec: KernelSpec, what, key) -> torch.Tensor:
        t = torch.as_tensor(t).float()
        try:
            t = torch.broadcast_to(t.reshape(-1, 1, t.shape[-1]) if t.ndim >= 1 else t.reshape(1, 1, 1), (h, 1, ncol))
        except RuntimeError:
            raise ShapeError(f"{key}: static {what} of shape {tuple(t.shape)} does not fit {h} heads x {ncol} columns") from None
        return spec.pool_scales(t.reshape(h, ncol)).to(self.device).contiguous()

    def _make_launches(self, layer: int, per: dict[str, list[Pool]]) -> list[_Launch]:
        owner = {}
        for w in ("k", "v"):
            for pool in per[w]:
                for i, h in enumerate(pool.heads):
                    owner[(w, h)] = (pool, i)
        mk = lambda vals: torch.tensor(vals, dtype=torch.int32, device=self.device)  # noqa: E731
        out = []
        for _, _, heads in self.config.launch_groups(layer, self.H):
            kp, vp = owner[("k", heads[0])][0], owner[("v", heads[0])][0]
            if any(owner[("k", h)][0] is not kp or owner[("v", h)][0] is not vp for h in heads):
                raise KernelError(f"layer {layer}: the kv heads {heads} of one decode launch are stored in more "
                                  "than one K or V pool")
            out.append(_Launch(kp, vp, heads, mk(heads), mk([owner[("k", h)][1] for h in heads]),
                               mk([owner[("v", h)][1] for h in heads])))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache allocated (pools, fp buffers, block table)."""
        return sum(p.nbytes for per in self.pools for ps in per.values() for p in ps) + self.block_table_t.numel() * 4

    # ---- token policy ------------------------------------------------------------------------

    def region_end(self, T: np.ndarray | int, tb: int, window: int):
        """End of the quantized region of ``T`` tokens for token block ``tb`` and a window of
        ``window`` tokens (cf. token_regions)."""
        T = np.asarray(T, dtype=np.int64)
        start = np.minimum(self.S, T)
        avail = np.maximum(0, T - start - window)
        return start + avail - avail % tb

    def reset(self, seq: int) -> None:
        """Forget sequence slot ``seq`` and return its pages to the free list."""
        for p in range(int(self.pages_held[seq])):
            self.free_pages.append(int(self.block_table[seq, p]))
        self.pages_held[seq] = 0
        self.lengths[seq] = 0
        for per in self.pools:
            for ps in per.values():
                for pool in ps:
                    if pool.sal_pos is not None:
                        pool.sal_pos[seq] = -1

    # ---- plan (once per step) ------------------------------------------------------------------

    def plan(self, new_tokens, *, num_splits: int | None = None) -> StepPlan:
        """Append ``new_tokens[b]`` tokens to every sequence ``b``; build the step's work lists.

        The lengths advance immediately: call :meth:`store` for every layer with the returned
        plan before :meth:`decode` reads it.
        """
        n = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
        if n.shape[0] != self.B or (n < 0).any():
            raise ShapeError(f"new_tokens must hold {self.B} non-negative counts (one per slot), got {n.tolist()}")
        T0 = self.lengths.copy()
        T1 = T0 + n
        if (T1 > self.max_pages * self.P).any():
            raise ShapeError(f"a sequence would exceed max_tokens={self.max_pages * self.P}: lengths {T1.tolist()}")
        # pages: enough for the longest quantized region among the (token block, window) pairs
        need_end = np.max([self.region_end(T1, tb, w) for tb, w in self.job_keys], axis=0)
        need = -(-(np.maximum(need_end - np.minimum(self.S, T1), 0)) // self.P)
        changed = False
        for b in range(self.B):
            while self.pages_held[b] < need[b]:
                if not self.free_pages:
                    raise KernelError(f"the cache is out of pages ({self.num_pages} per pool); raise num_pages")
                self.block_table[b, self.pages_held[b]] = self.free_pages.pop()
                self.pages_held[b] += 1
                changed = True
        if changed:
            self.block_table_t.copy_(torch.from_numpy(self.block_table))
        cu = np.concatenate([[0], np.cumsum(n)])
        store = {(tb, w): self._jobs(tb, w, T0, T1, cu) for tb, w in self.job_keys}
        self.lengths = T1

        max_q = int(max(0, (T1 - np.minimum(self.S, T1)).max()))
        bn = self.block_n
        if num_splits is None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 8
            ns = decode_splits(self.B, self.H, max_q, sms, bn)
        else:
            ns = min(int(num_splits), -(-max_q // bn)) if max_q else 0
        chunk = (-(-(-(-max_q // ns)) // bn) * bn) if ns else 0
        nsp = ns + 1
        dev = self.device
        extras = {}
        rows = int(n.sum())
        if self.fp_q and rows:
            extras["receive"] = self._receive_jobs(rows)
        return StepPlan(
            new_tokens=n, lengths=T1.copy(), n_rows=rows, store=store,
            seq_lens=torch.tensor(T1, dtype=torch.int32, device=dev), num_splits=ns, chunk=chunk,
            partial_o=torch.empty((self.B, self.Hq, nsp, self.D), dtype=torch.float32, device=dev),
            partial_m=torch.empty((self.B, self.Hq, nsp), dtype=torch.float32, device=dev),
            partial_l=torch.empty((self.B, self.Hq, nsp), dtype=torch.float32, device=dev),
            extras=extras,
        )

    def _i32(self, a) -> torch.Tensor:
        """A host index array as an int32 tensor on the cache's device (one copy)."""
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self.device)

    def _receive_jobs(self, rows: int) -> StoreJobs:
        """Jobs of :meth:`_receive`: the step's new rows ``0 .. rows-1`` in blocks of
        :data:`JOB_ROWS` (one scale per row: the rows of a job are independent)."""
        br = min(JOB_ROWS, _next_pow2(rows))
        n_jobs = -(-rows // br)
        src = np.full((n_jobs, br), -1, dtype=np.int32)
        src.reshape(-1)[:rows] = np.arange(rows)
        i32 = self._i32
        zeros = i32(np.zeros(n_jobs))
        nrows = np.minimum(br, rows - br * np.arange(n_jobs))
        return StoreJobs(tb=1, window=0, n_jobs=n_jobs, block_r=br, page=i32(np.arange(n_jobs)), row0=zeros, nrows=i32(nrows),
                         seq=zeros, src_new=i32(src), src_slot=i32(np.full_like(src, -1)), n_fp=0, fp_row=zeros,
                         fp_seq=zeros, fp_slot=zeros)

    def _jobs(self, tb: int, window: int, T0: np.ndarray, T1: np.ndarray, cu: np.ndarray) -> StoreJobs:
        """The step's store jobs of the pools of token block ``tb`` and window ``window`` (ring of
        ``window + tb`` slots): the tokens it quantizes, and the new tokens its ring keeps."""
        S, P, cap = self.S, self.P, window + tb
        # quantized tokens start at the sinks; below that region_end() is the length itself
        e0, e1 = np.maximum(self.region_end(T0, tb, window), S), self.region_end(T1, tb, window)
        q_t, q_b, fp_t, fp_b = [], [], [], []
        for b in range(self.B):
            if e1[b] > e0[b]:
                q_t.append(np.arange(e0[b], e1[b]))
                q_b.append(np.full(e1[b] - e0[b], b))
            t = np.arange(T0[b], T1[b])
            keep = (t < S) | (t >= e1[b])
            fp_t.append(t[keep])
            fp_b.append(np.full(int(keep.sum()), b))
        dev = self.device
        i32 = self._i32
        t = np.concatenate(q_t) if q_t else np.zeros(0, np.int64)
        b = np.concatenate(q_b) if q_b else np.zeros(0, np.int64)
        if t.size:
            i = t - S
            page = self.block_table[b, i // P]
            row = i % P
            src_new = np.where(t >= T0[b], cu[b] + t - T0[b], -1)
            src_slot = np.where(t >= T0[b], -1, S + (t - S) % cap)
            if tb == 1:
                key = (i // P) * P + row // JOB_ROWS
            else:
                key = i // tb
            key = b * (1 << 40) + key
            starts = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1])
            nrows = np.diff(np.concatenate([starts, [t.size]]))
            block_r = _next_pow2(int(nrows.max()))
            job_of = np.repeat(np.arange(starts.size), nrows)
            pos = np.arange(t.size) - starts[job_of]
            sn = np.full((starts.size, block_r), -1, np.int64)
            ss = np.full((starts.size, block_r), -1, np.int64)
            sn[job_of, pos] = src_new
            ss[job_of, pos] = src_slot
            tok = None
            if self.config.compensates_keys and self.key_pre_rope:  # each row's factor is its position's
                tok = np.full((starts.size, block_r), -1, np.int64)
                tok[job_of, pos] = t
            jobs = dict(n_jobs=int(starts.size), block_r=block_r, page=i32(page[starts]), row0=i32(row[starts]),
                        nrows=i32(nrows), seq=i32(b[starts]), src_new=i32(sn), src_slot=i32(ss),
                        seq_np=b[starts], tokens=tok)
        else:
            z = i32(np.zeros(1))
            jobs = dict(n_jobs=0, block_r=1, page=z, row0=z, nrows=z, seq=z, src_new=z, src_slot=z)
        ft = np.concatenate(fp_t) if fp_t else np.zeros(0, np.int64)
        fb = np.concatenate(fp_b) if fp_b else np.zeros(0, np.int64)
        slot = np.where(ft < S, ft, S + (ft - S) % cap)
        row_new = cu[fb] + ft - T0[fb]
        to_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)  # noqa: E731
        return StoreJobs(tb=tb, window=window, **jobs, n_fp=int(ft.size), fp_row=to_long(row_new), fp_seq=to_long(fb),
                         fp_slot=to_long(slot))

    # ---- run (per layer) ---------------------------------------------------------------------

    def _rows(self, x, step: StepPlan, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name} must be a torch tensor")
        if not x.is_floating_point():
            raise ShapeError(f"{name} must be floating point, got {x.dtype}")
        if x.device.type != self.device.type:
            raise KernelError(f"{name} is on {x.device}, the cache on {self.device}")
        if x.ndim == 4:  # [B, H, n, D] with equal n
            n = int(x.shape[2])
            if x.shape[0] != self.B or not (step.new_tokens == n).all():
                raise ShapeError(f"{name} of shape {tuple(x.shape)} needs new_tokens == [{n}] * {self.B}")
            x = x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])
        if x.ndim != 3 or x.shape[0] != step.n_rows or x.shape[1] != self.H or x.shape[2] != self.D:
            raise ShapeError(
                f"{name} has shape {tuple(x.shape)}; want [{step.n_rows}, {self.H}, {self.D}] "
                "(this step's new tokens of every sequence, in order) or [B, H, n, D]"
            )
        if x.stride(2) != 1:
            x = x.contiguous()
        return x

    def store(self, step: StepPlan, layer: int, k: torch.Tensor, v: torch.Tensor, *,
              salient: torch.Tensor | None = None, key_moment: torch.Tensor | None = None) -> None:
        """Quantize-and-store this step's new keys and values of ``layer``.

        ``salient`` (a config with ``salient`` = N): ``[B, n_kv_heads, m]`` (``m <= N``) positions of
        each sequence's salient tokens (:func:`kverr.error.salient.choose`), ascending, -1 after the
        last where a sequence has fewer; given once, with the prefill: this step's new tokens,
        among those it quantizes in both formats of their kv head
        (:func:`kverr.quant.store.salient_candidates`). Their rows, as received, are kept beside
        their codes and read in their place.

        ``key_moment`` (a config that rounds keys with compensation, ``key_rounding``
        ``"compensated"``): ``[B, n_kv_heads, D, D]`` float, the second moment of each sequence's
        queries (:func:`kverr.quant.compensated.query_moment`), given with the prefill. The keys
        this store quantizes in integer formats that encode with their stored scale choose their
        codes by the sequential rule under it (:mod:`kverr.quant.compensated`; turned to each
        token's position for keys stored before RoPE), bit for bit
        :func:`~kverr.quant.compensated.compensated_quantize`'s given the same factors; the cache
        does not keep it, so the keys later stores quantize round to nearest, as in
        :class:`~kverr.hf.reference.KverrCache`. A config with static ``key_moments`` takes none:
        every store rounds its keys under the layer's static moments.
        """
        from kverr.gpu.launch import launch_store

        self._check_layer(layer)
        if self.config.key_moments is not None:
            if key_moment is not None:
                raise ConfigError("this config rounds keys under its static key_moments; give no key_moment")
            moment = self._static_moment(layer)
        else:
            moment = None if key_moment is None else self._key_moment(key_moment)
        waiting = self.static_pending(layer)
        if waiting:
            raise KernelError(f"layer {layer}: static scales of {waiting} are not set yet (set_static_scales)")
        sal = None if salient is None else self._salient_rows(step, layer, salient)
        for which, x in (("k", k), ("v", v)):
            x = self._rows(x, step, which)
            codes = scale = None
            if self.fp_q and step.n_rows:
                # an int8 window: the cache receives every row as the oracle's int8 row, quantized
                # on the device by the store kernel in the window's format (JOB_ROWS rows a job):
                # its codes and scale go to the window, and the store kernels decode them
                codes, scale = self._receive(step, x)
            for pool in self.pools[layer][which]:
                jobs = step.store[pool.job_key]
                # quantize first: a job may read a window slot this step's new tokens overwrite
                if jobs.n_jobs and which == "k" and moment is not None and compensable(pool.spec.fmt):
                    for part, comp in self._compensation(layer, pool, jobs, moment):
                        launch_store(pool, part, x if codes is None else codes, self.D, self.P, xs=scale, comp=comp)
                elif jobs.n_jobs:
                    launch_store(pool, jobs, x if codes is None else codes, self.D, self.P, xs=scale)
                if jobs.n_fp:
                    # one gather and one scatter per tensor (rows x heads at once): each is a
                    # kernel launch of the step's host side (kverr.cost.HOST_OPS)
                    rows = (jobs.fp_row[:, None], pool.heads_l[None, :])
                    if codes is None:
                        pool.fp[jobs.fp_seq, :, jobs.fp_slot] = x[rows].to(pool.fp.dtype)
                    else:
                        pool.fp[jobs.fp_seq, :, jobs.fp_slot] = codes[rows]
                        pool.fp_scale[jobs.fp_seq, :, jobs.fp_slot] = scale[rows]
                if sal is not None and pool.nsal:
                    src_rows, pos = sal
                    m = pos.shape[-1]
                    at = (src_rows[:, pool.heads_l], pool.heads_l[None, :, None])  # [B, h, m]
                    slots = slice(self.S + pool.cap, self.S + pool.cap + m)
                    if codes is None:
                        pool.fp[:, :, slots] = x[at].to(pool.fp.dtype)
                    else:
                        pool.fp[:, :, slots] = codes[at]
                        pool.fp_scale[:, :, slots] = scale[at]
                    pool.sal_pos[:, :, :m] = pos[:, pool.heads_l]

    def _key_moment(self, moment) -> torch.Tensor:
        """A checked query moment ``[B, H, D, D]``, float64 on the device."""
        if not self.config.compensates_keys:
            raise ConfigError("a key moment was given but the config rounds keys to nearest "
                              f"(key_rounding={self.config.key_rounding!r})")
        m = torch.as_tensor(moment).detach()
        if m.shape != (self.B, self.H, self.D, self.D) or not m.is_floating_point():
            raise ShapeError(f"key_moment of shape {tuple(m.shape)} ({m.dtype}): want floating point "
                             f"[{self.B}, {self.H}, {self.D}, {self.D}]")
        m = m.to(device=self.device, dtype=torch.float64)
        if not bool(torch.isfinite(m).all()):
            raise ConfigError("key_moment holds NaN/Inf")
        return m

    def _static_moment(self, layer: int) -> torch.Tensor:
        """The config's static moments of ``layer``, ``[1, H, D, D]`` float64 on the device (one for
        every sequence), read once."""
        cached = self._static_moments.get(layer)
        if cached is None:
            cached = self._static_moments[layer] = self.config.key_moments.layer(layer)[None].to(self.device)
        return cached

    def _compensation(self, layer: int, pool: Pool, jobs: StoreJobs, moment: torch.Tensor):
        """``pool``'s store ``jobs`` as launches, each with the factors of its rows
        (:class:`~kverr.gpu.launch.CompensationArgs`; :func:`~kverr.quant.compensated.compensation_factor`
        under ``moment`` ``[B or 1, H, D, D]``, 1: one for every sequence): post-RoPE keys one factor
        per sequence (or one for all) and head, one launch; pre-RoPE keys one per row (the moment
        turned to the row's position), at most :data:`COMP_FACTOR_BYTES` of them a launch."""
        from kverr.gpu.launch import CompensationArgs
        from kverr.quant.compensated import compensation_factor, turned_cost

        fmt, D = pool.spec.fmt, self.D
        m = moment[:, pool.heads_l]  # [B, h, D, D]
        shared = m.shape[0] == 1  # one moment for every sequence (static moments, or a batch of one)
        if not self.key_pre_rope:
            key, static = (layer, tuple(pool.heads)), self.config.key_moments is not None
            if static and key in self._static_factors:  # a static moment's factor is computed once
                order, U = self._static_factors[key]
            else:
                f = compensation_factor(m[:, :, None], fmt)  # order [B, h, 1, D], U [D, D, B, h, 1]
                order, U = _order_table(f.order), f.channel_major
                if static:
                    self._static_factors[key] = order, U
            # a shared moment: the sequence stride is 0
            yield jobs, CompensationArgs(U, (0, 0, 0 if shared else U.stride(2), U.stride(3), U.stride(0), U.stride(1)),
                                         order, (0, 0, 0 if shared else order.stride(0), order.stride(1)))
            return
        R, h = jobs.block_r, len(pool.heads)
        per_launch = max(1, COMP_FACTOR_BYTES // (R * h * D * D * 8))
        cos_h, sin_h = self.rope_tables[layer]
        for j0 in range(0, jobs.n_jobs, per_launch):
            part = jobs.select(j0, min(jobs.n_jobs, j0 + per_launch))
            tok = part.tokens.reshape(-1)
            seq = np.repeat(part.seq_np, R)
            cost = torch.empty((h, tok.size, D, D), dtype=torch.float64, device=self.device)
            # per sequence its moment turned to its rows' positions; a shared moment: all rows at once
            for b in [0] if shared else np.unique(seq):
                rows = np.arange(seq.size) if shared else np.flatnonzero(seq == b)
                t = torch.from_numpy(np.maximum(tok[rows], 0)).to(self.device)  # no row: any position
                cos, sin = (torch.cat([tab[t]] * 2, dim=-1) for tab in (cos_h, sin_h))
                cost[:, torch.from_numpy(rows).to(self.device)] = turned_cost(m[int(b)], cos, sin)
            f = compensation_factor(cost, fmt)  # order [h, rows, D], U [D, D, h, rows]
            order, U = _order_table(f.order), f.channel_major
            yield part, CompensationArgs(U, (R * U.stride(3), U.stride(3), 0, U.stride(2), U.stride(0), U.stride(1)),
                                         order, (R * order.stride(1), order.stride(1), 0, order.stride(0)))

    def _salient_rows(self, step: StepPlan, layer: int, salient) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked salient positions ``[B, H, m]``: (their rows among the step's new rows, int64,
        and the positions, int32), on the device. Any of the step's tokens after the sinks may be
        one: the candidates both formats quantize, or the prompt's last (``salient_recent``),
        still in the window."""
        N = self.config.salient
        if not N:
            raise ConfigError("salient positions were given but the config keeps no salient tokens (config.salient = 0)")
        pos = torch.as_tensor(salient).detach().cpu()
        if pos.ndim != 3 or pos.shape[0] != self.B or pos.shape[1] != self.H or pos.shape[2] > N or pos.is_floating_point():
            raise ShapeError(f"salient positions of shape {tuple(pos.shape)} ({pos.dtype}): want integer "
                             f"[{self.B}, {self.H}, m] with m <= config.salient = {N}")
        pos = pos.long()
        pools = [p for which in ("k", "v") for p in self.pools[layer][which] if p.nsal]
        T1 = step.lengths
        T0 = T1 - step.new_tokens
        cu = np.concatenate([[0], np.cumsum(step.new_tokens)])
        for b in range(self.B):
            if any(bool((pl.sal_pos[b] >= 0).any()) for pl in pools):
                raise KernelError(f"layer {layer} sequence {b} already holds salient tokens (reset the slot first)")
            lo, hi = max(min(self.config.sinks, int(T1[b])), int(T0[b])), int(T1[b])
            for h, p in enumerate(pos[b]):
                n = int((p >= 0).sum())
                if (p[n:] != -1).any() or (n and (int(p[0]) < lo or int(p[n - 1]) >= hi or (p[:n].diff() <= 0).any())):
                    raise ShapeError(f"sequence {b} head {h}: salient positions {p.tolist()} must ascend, each among "
                                     f"this step's tokens after the sinks ({lo} .. {hi - 1}), -1 after the last")
        # a -1 entry copies the step's first row into a slot nothing reads
        rows = torch.where(pos >= 0, pos + torch.from_numpy(cu[:-1] - T0)[:, None, None], 0)
        return rows.to(self.device), pos.to(device=self.device, dtype=SALIENT_INDEX_DTYPE)

    def _receive(self, step: StepPlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new rows ``x [N, H, D]`` in the int8 window format: uint8 codes ``[N, H, D]`` and
        fp16 scales ``[N, H]``, bit for bit :meth:`kverr.quant.store.WindowRows.store`'s."""
        from kverr.gpu.launch import launch_store

        jobs = step.extras["receive"]
        n, br, H, D = step.n_rows, jobs.block_r, self.H, self.D
        rows = jobs.n_jobs * br
        # head-major buffers [H, rows, D] and [H, rows], seen by the kernel as pages of br rows
        # ([page, head, row, ...]), and by the store kernels as [N, H, D] and [N, H] (any strides)
        codes = torch.empty((H, rows, D), dtype=torch.uint8, device=self.device)
        scale = torch.empty((H, rows), dtype=torch.float16, device=self.device)
        pages = codes.as_strided((jobs.n_jobs, H, br, D), (br * D, rows * D, D, 1))
        spages = scale.as_strided((jobs.n_jobs, H, br, 1), (br, rows, 1, 1))
        # the float input stands in for the window buffer: rounding a row to its own dtype is exact
        pool = Pool(self.receive_spec, list(range(H)), self.all_heads, self.all_heads, pages, spages, None, x, None,
                    0, self.unit_ratio)
        launch_store(pool, jobs, x, D, JOB_ROWS)
        return codes[:, :n].permute(1, 0, 2), scale[:, :n].t()

    def decode(self, step: StepPlan, layer: int, q: torch.Tensor, *, sm_scale: float | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one query per sequence over its cached tokens (all of them).

        Parameters
        ----------
        q : torch.Tensor
            ``[B, n_q_heads, D]`` post-RoPE queries.
        sm_scale : float, optional
            Logit scale, default ``1/sqrt(D)``.
        out : torch.Tensor, optional
            ``[B, n_q_heads, D]`` output buffer (default: a new tensor of ``q``'s dtype).

        Returns
        -------
        torch.Tensor
            ``[B, n_q_heads, D]``.
        """
        from kverr.gpu.launch import launch_decode, launch_merge

        self._check_layer(layer)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (self.B, self.Hq, self.D):
            raise ShapeError(f"q must be [{self.B}, {self.Hq}, {self.D}], got {tuple(getattr(q, 'shape', ()))}")
        if q.device.type != self.device.type:
            raise KernelError(f"q is on {q.device}, the cache on {self.device}")
        if (step.lengths < 1).any():
            raise ShapeError(f"every sequence needs at least one cached token to decode; lengths {step.lengths.tolist()}")
        if q.stride(2) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        scale = (1.0 / math.sqrt(self.D)) if sm_scale is None else float(sm_scale)
        w = self.windows[layer]
        for ln in self.launches[layer]:
            if step.num_splits:
                launch_decode(self, step, ln, q, scale, tail=False, window=w, rope=self._rope(layer))
            launch_decode(self, step, ln, q, scale, tail=True, window=w, rope=self._rope(layer))
        launch_merge(step, out, self.Hq, self.D, sinks=None if self.sinks is None else self.sinks[layer])
        return out

    def prefill(self, step: StepPlan, layer: int, q: torch.Tensor, *, sm_scale: float | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Chunked prefill: attention of this step's new tokens over the cache as stored (causal).

        Query ``m`` of sequence ``b`` (``new_tokens[b]`` of them, at positions
        ``T_b - new_tokens[b] + m``) attends to every token up to its own position, read as the
        cache holds it after this step's :meth:`store`: sinks and window in full precision, the
        rest -- including this chunk's own tokens once they left the window -- dequantized.

        Parameters
        ----------
        q : torch.Tensor
            ``[n_rows, n_q_heads, D]`` post-RoPE queries, the step's new tokens of every sequence
            in order (as :meth:`store` takes keys), or ``[B, n_q_heads, n, D]`` with equal ``n``.
        sm_scale : float, optional
            Logit scale, default ``1/sqrt(D)``.
        out : torch.Tensor, optional
            ``[n_rows, n_q_heads, D]`` output buffer.

        Returns
        -------
        torch.Tensor
            ``[n_rows, n_q_heads, D]`` (or ``[B, n_q_heads, n, D]`` for 4-d ``q``).
        """
        from kverr.gpu.launch import QueryRows, launch_decode, launch_merge, prefill_queries_per_program

        self._check_layer(layer)
        four_d = isinstance(q, torch.Tensor) and q.ndim == 4
        if four_d:
            n = int(q.shape[2])
            if q.shape[0] != self.B or q.shape[1] != self.Hq or not (step.new_tokens == n).all():
                raise ShapeError(f"q of shape {tuple(q.shape)} needs [{self.B}, {self.Hq}, n, {self.D}] with new_tokens == [n] * {self.B}")
            q = q.permute(0, 2, 1, 3).reshape(-1, self.Hq, self.D)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (step.n_rows, self.Hq, self.D):
            raise ShapeError(f"q must be [{step.n_rows}, {self.Hq}, {self.D}] (this step's new tokens of every "
                             f"sequence, in order), got {tuple(getattr(q, 'shape', ()))}")
        if q.device.type != self.device.type:
            raise KernelError(f"q is on {q.device}, the cache on {self.device}")
        if q.stride(2) != 1:
            q = q.contiguous()
        rows = step.n_rows
        res = torch.empty_like(q) if out is None else out
        if rows == 0:
            return res
        scale = (1.0 / math.sqrt(self.D)) if sm_scale is None else float(sm_scale)
        if "prefill" not in step.extras:
            nsp = step.num_splits + 1
            n = step.new_tokens
            qm = prefill_queries_per_program(self.rep)
            qb = max(1, -(-int(n.max()) // qm))
            starts = np.concatenate([[0], np.cumsum(n)[:-1]])
            dev = self.device
            step.extras["prefill"] = QueryRows(
                torch.tensor(starts, dtype=torch.int32, device=dev), torch.tensor(n, dtype=torch.int32, device=dev),
                (torch.empty((rows, self.Hq, nsp, self.D), dtype=torch.float32, device=dev),
                 torch.empty((rows, self.Hq, nsp), dtype=torch.float32, device=dev),
                 torch.empty((rows, self.Hq, nsp), dtype=torch.float32, device=dev)),
                qm, qb)
        spec = step.extras["prefill"]
        w = self.windows[layer]
        for ln in self.launches[layer]:
            if step.num_splits:
                launch_decode(self, step, ln, q, scale, tail=False, rows=spec, window=w, rope=self._rope(layer))
            launch_decode(self, step, ln, q, scale, tail=True, rows=spec, window=w, rope=self._rope(layer))
        launch_merge(step, res, self.Hq, self.D, partials=spec.partials,
                     sinks=None if self.sinks is None else self.sinks[layer])
        if four_d:
            return res.reshape(self.B, -1, self.Hq, self.D).permute(0, 2, 1, 3)
        return res

    def _rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.rope_tables is None else self.rope_tables[layer]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.L:
            raise ShapeError(f"layer={layer} out of range (the cache has {self.L} layers)")

    # ---- read back (inspection, tests, validation) --------------------------------------------

    def quantized(self, layer: int, which: str, seq: int) -> list[tuple[QTensor, list[int], int, int]]:
        """The quantized region of sequence ``seq`` as reference :class:`QTensor` s, per head group.

        Returns ``[(qtensor, heads, start, end)]`` where ``qtensor`` has shape ``[h, end-start, D]``
        and is read from the pages through the block table, so it can be compared code for code
        with :func:`kverr.quant.quantize` and decoded with :func:`kverr.quant.dequantize`.
        """
        self._check_layer(layer)
        T = int(self.lengths[seq])
        out = []
        for pool in self.pools[layer][which]:
            spec = pool.spec
            start = min(self.S, T)
            end = int(self.region_end(T, spec.tb, pool.window))
            n = end - start
            i = np.arange(n)
            pages = torch.from_numpy(self.block_table[seq, i // self.P].astype(np.int64)).to(self.device)
            rows = torch.from_numpy(i % self.P).to(self.device)
            codes = pool.codes[pages, :, rows].permute(1, 0, 2)  # [h, n, cb]
            scale = zero = None
            if spec.kind != KIND_FLOAT:
                if spec.static:
                    # a per-tensor block spans the group's heads: one scale (stored per head)
                    hs = 1 if spec.fmt.granularity.kind == "tensor" else len(pool.heads)
                    scale = spec.oracle_scales(pool.scale[:hs, None, :])
                    zero = None if pool.zero is None else pool.zero[:hs, None, :]
                else:
                    bt = spec.bts
                    blk = np.arange(-(-n // bt)) * bt if spec.gran == GRAN_BLOCK else i
                    bp = torch.from_numpy(self.block_table[seq, blk // self.P].astype(np.int64)).to(self.device)
                    br = torch.from_numpy((blk % self.P) // bt).to(self.device)
                    scale = spec.oracle_scales(pool.scale[bp, :, br].permute(1, 0, 2))
                    zero = None if pool.zero is None else pool.zero[bp, :, br].permute(1, 0, 2)
            fmt = spec.fmt
            qt = QTensor(codes.cpu(), None if scale is None else scale.cpu(), None if zero is None else zero.cpu(),
                         fmt, (len(pool.heads), n, self.D), self.P)
            out.append((qt, pool.heads, start, end))
        return out

    def read(self, layer: int, which: str, seq: int) -> torch.Tensor:
        """What the cache holds for sequence ``seq``: float32 ``[n_kv_heads, T, D]`` (dequantized
        with the reference :func:`kverr.quant.dequantize`; sinks and window from the fp buffer)."""
        T = int(self.lengths[seq])
        res = torch.full((self.H, T, self.D), float("nan"))
        for (qt, heads, start, end), pool in zip(self.quantized(layer, which, seq), self.pools[layer][which]):
            if end > start:
                res[heads, start:end] = dequantize(qt)
            t = np.concatenate([np.arange(0, start), np.arange(end, T)]).astype(np.int64)
            slot = np.where(t < self.S, t, self.S + (t - self.S) % pool.cap)
            sl = torch.from_numpy(slot).to(self.device)
            fs = None if pool.fp_scale is None else pool.fp_scale[seq][:, sl, None].cpu()
            fp = WindowRows(pool.fp[seq][:, sl].cpu(), fs, self.config.window_dtype).float()
            res[torch.tensor(heads)[:, None], torch.from_numpy(t)[None, :]] = fp
            if pool.nsal:  # salient tokens: their rows in place of their codes
                pos = pool.sal_pos[seq].long().cpu()
                slots = slice(self.S + pool.cap, self.S + pool.cap + pool.nsal)
                fs = None if pool.fp_scale is None else pool.fp_scale[seq][:, slots, None].cpu()
                rows = WindowRows(pool.fp[seq][:, slots].cpu(), fs, self.config.window_dtype).float()
                hi, ji = torch.nonzero(pos >= 0, as_tuple=True)
                res[torch.tensor(heads)[hi], pos[hi, ji]] = rows[hi, ji]
        return res
