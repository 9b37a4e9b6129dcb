"""A cache config through the kernel path and through the reference path, on the same captured data.

The kernel path is :class:`kverr.gpu.PagedKVCache`: quantize-and-store every token (a prefill, then
single-token decode steps that flush token blocks out of the full-precision window) and decode
attention with fused dequantization. The reference path is :func:`kverr.quant.reconstruct` (what the
oracle says the cache holds) and :func:`kverr.error.decompose` (attention over it). They agree
when

* what the cache holds, read back through its block table, equals ``reconstruct`` bit for bit
  (``mismatched`` counts differing elements; it must be 0), and
* the decode output differs from the reference attention output by a relative RMS of at most
  ``tol`` (default 1e-3; the kernel multiplies in fp32 unless ``dot_fp16``).

Keys and values reach both paths as they are; both round them to the config's ``window_dtype``
first (the cache receives K/V in its own dtype, as a model running in that dtype produces them;
an ``int8`` window: the oracle's int8 row round trip, :func:`kverr.quant.store.receive`). On a machine without CUDA the kernels run in the Triton interpreter; set
``TRITON_INTERPRET=1`` before anything imports :mod:`kverr_kernels` (the ``kverr validate`` command
does this itself).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kverr.exceptions import CaptureError, KernelError, ShapeError

log = logging.getLogger(__name__)

__all__ = ["LayerResult", "ValidationReport", "reference_decode", "rel_rms", "validate", "validate_arrays"]


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (0 when both are 0)."""
    g, w = got.double(), want.double()
    den = float(w.norm())
    num = float((g - w).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                     kv_head_of_q, scale: float | None = None, window: int = 0, sink=None):
    """Reference attention of the last position over reconstructed keys/values, via the decomposition.

    Parameters
    ----------
    q : ``[q_head, D]`` the query of the last token.
    k, v, k_hat, v_hat : ``[kv_head, T, D]`` clean and reconstructed keys/values.
    kv_head_of_q : ``[q_head]`` kv head each query head reads.
    window : the layer's sliding window (0: full attention).
    sink : ``[q_head]`` learned sink logits, or None.

    Returns
    -------
    (out_hat, out, decomposition)
        ``out_hat`` = attention over ``k_hat``/``v_hat`` and ``out`` over ``k``/``v``, float64
        ``[q_head, D]``.
    """
    from kverr.error import decompose

    T = k.shape[-2]
    d = decompose(q[:, None, :].double(), k.double(), v.double(), k_hat.double(), v_hat.double(), causal=True,
                  scale=scale, kv_head_of_q=list(map(int, kv_head_of_q)), q_positions=[T - 1], window=window,
                  sink=None if sink is None else torch.as_tensor(sink).double())
    return (d.out + d.total)[:, 0], d.out[:, 0], d


@dataclass
class LayerResult:
    """Agreement of the two paths on one layer (worst over sequences and steps)."""

    layer: int
    k_formats: str
    v_formats: str
    mismatched: int
    rel_rms: float
    max_abs: float
    worst: str
    quant_rel_error: float
    ok: bool


@dataclass
class ValidationReport:
    """Result of :func:`validate`; ``ok`` only when every layer agrees."""

    config: str
    tokens: int
    batch: int
    steps: int
    tol: float
    device: str
    interpreted: bool
    layers: list[LayerResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.layers)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "layers"}
        out["ok"] = self.ok
        out["layers"] = [asdict(r) for r in self.layers]
        return out

    def to_table(self, largest: int | None = None) -> str:
        rows = sorted(self.layers, key=lambda r: -r.rel_rms)[:largest] if largest else self.layers
        head = f"{'layer':>5}  {'K format':<22} {'V format':<22} {'mismatch':>8} {'rel RMS':>10} {'max |diff|':>10}  {'quant err':>9}  ok"
        lines = [head]
        for r in rows:
            lines.append(
                f"{r.layer:>5}  {r.k_formats[:22]:<22} {r.v_formats[:22]:<22} {r.mismatched:>8} {r.rel_rms:>10.2e} "
                f"{r.max_abs:>10.2e}  {r.quant_rel_error:>9.2e}  {'yes' if r.ok else 'NO'}"
            )
        return "\n".join(lines)


def _labels(config, layer: int, H: int, which: str) -> str:
    return ",".join(f.label() if len(h) == H else f"{f.label()}@{h}" for f, h in config.head_groups(layer, H, which))


def validate_arrays(config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_head_of_q, *, layers=None,
                    steps: int = 2, tol: float = 1e-3, device=None, dot_fp16: bool = False,
                    num_splits: int | None = None, block_n: int | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None, sliding_windows=None,
                    sinks: torch.Tensor | None = None) -> ValidationReport:
    """Validate on arrays: ``q`` ``[L, B, q_head, T, D]``, ``k``/``v`` ``[L, B, kv_head, T, D]``.

    Every sequence has ``T`` tokens: ``T - steps`` arrive in one prefill, then one per step; the
    decode output of each step is compared (the query is that step's token).

    With ``config.key_pre_rope``, ``k`` holds pre-RoPE keys and ``rope = (cos, sin)`` the
    ``[T, D]`` tables of positions ``0..T-1`` in each sequence (or a list of such pairs, one per
    layer, for a RoPE per layer type): the kernel path stores pre-RoPE keys and rotates them in
    the decode kernel; the reference rotates the clean keys and what the oracle reconstructs of
    them with the same tables.

    ``sliding_windows`` (one per layer, 0: full attention) and ``sinks`` (``[L, q_head]`` learned
    sink logits) reach both paths: the kernels mask and merge with them, the reference
    decomposes with them.

    A config with salient tokens (``config.salient``) has them chosen from the prefill's queries
    (:func:`kverr.error.salient.positions`, softmax scale ``1/sqrt(D)``) and stored with it; the
    reference reads their ``window_dtype`` rows in place of what ``reconstruct`` gives there. A
    config that rounds keys with compensation (``key_rounding`` ``"compensated"``) rounds them,
    on both paths, under the second moment of the prefill's last
    :data:`~kverr.error.salient.OBSERVED_QUERIES` queries (:func:`kverr.quant.compensated.query_moment`),
    turned to each key's position for keys stored before RoPE; with static ``key_moments`` every
    key, prefill and decode, under the config's moments.
    """
    from kverr.gpu import PagedKVCache, calibrate_static_scales
    from kverr.gpu.cache import interpreting
    from kverr.quant import is_static, reconstruct

    L, B, Hq, T, D = q.shape
    H = k.shape[2]
    if k.shape != (L, B, H, T, D) or v.shape != k.shape:
        raise ShapeError(f"k and v must be [L, B, kv_head, T, D] = {(L, B, H, T, D)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    _check_steps_tol(T, steps, tol)
    if config.key_pre_rope and rope is None:
        raise KernelError("config.key_pre_rope: pass rope=(cos, sin), the [T, D] RoPE tables, and pre-RoPE keys")
    if rope is not None and not config.key_pre_rope:
        raise KernelError("rope tables were given but config.key_pre_rope is false")
    kv_map = [int(i) for i in kv_head_of_q]
    rep = Hq // H
    if kv_map != [h // rep for h in range(Hq)]:
        raise ShapeError(f"kv_head_of_q={kv_map} is not the contiguous grouping the kernels use")
    k = k.float()
    v = v.float()
    q = q.float()
    layers = list(range(L)) if layers is None else list(layers)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    has_static = any(
        is_static(f.granularity) and not f.is_float
        for l in layers for w in "kv" for f, _ in config.head_groups(l, H, w)
    )
    # static scales are calibrated on the whole batch at its final length, as reconstruct() does
    static = calibrate_static_scales(config, [k[l] for l in range(L)], [v[l] for l in range(L)]) if has_static else None
    cache = PagedKVCache(config, n_layers=L, n_kv_heads=H, n_q_heads=Hq, head_dim=D, max_batch=B, max_tokens=T,
                         device=dev, static_scales=static, dot_fp16=dot_fp16, block_n=block_n,
                         rope=None if rope is None else ([(c.to(dev), s.to(dev)) for c, s in rope] if isinstance(rope, list)
                                                         else (rope[0].to(dev), rope[1].to(dev))),
                         sliding_windows=sliding_windows, sinks=sinks)
    windows = cache.windows
    if rope is not None:
        from kverr.rope import rotate

        pairs = [tuple(t.float().cpu() for t in p) for p in (rope if isinstance(rope, list) else [rope] * L)]

        def post(x, l):  # [..., t, D] pre-RoPE -> post-RoPE at positions 0..t-1, with layer l's tables
            cos, sin = pairs[l]
            return rotate(x.float(), cos[: x.shape[-2]], sin[: x.shape[-2]])
    else:
        def post(x, l):
            return x
    salient: dict[int, torch.Tensor] = {}
    if config.salient:
        from kverr.error.salient import positions

        n = T - steps
        for l in range(L):
            salient[l] = positions(config, l, q[l, :, :, :n], post(k[l, :, :, :n], l), 1.0 / math.sqrt(D),
                                   sliding_window=windows[l], sink=None if sinks is None else sinks[l])

    # keys rounded with compensation: those the prefill quantizes, under the second moment of its
    # last queries per sequence and kv head (the kernel path is given it with the prefill); keys
    # quantized later round to nearest on the same scales (each row's codes are its own)
    # (static key_moments: every key under the layer's moments, [1, H, D, D] for all sequences)
    moments: dict[int, torch.Tensor] = {}
    static_moments = config.key_moments is not None
    if config.compensates_keys:
        from kverr.error.salient import OBSERVED_QUERIES
        from kverr.quant.compensated import KeyCost, query_moment, turned_cost
        from kverr.quant.store import token_regions

        n = T - steps
        for l in range(L):
            moments[l] = (config.key_moments.layer(l)[None] if static_moments
                          else query_moment(q[l, :, :, :n], H, OBSERVED_QUERIES))
        nearest = config.with_(key_rounding="nearest", key_moments=None)

    def held(x, l, which):  # what the reference says layer l holds of x [B, H, t, D]
        if which == "k" and moments:
            t = x.shape[-2]
            cost = (KeyCost(turned_cost(moments[l], pairs[l][0][:t], pairs[l][1][:t])) if config.key_pre_rope
                    else KeyCost(moments[l][:, :, None]))
            hat = reconstruct(x, config, layer=l, which=which, key_cost=cost)
            if not static_moments:
                near = reconstruct(x, nearest, layer=l, which=which)
                for fmt, window, heads in config.window_groups(l, H, "k"):
                    end = token_regions(T - steps, config, fmt, window=window)[1]  # of the prefill's quantized keys
                    hat[:, heads, end:] = near[:, heads, end:]
        else:
            hat = reconstruct(x, config, layer=l, which=which)
        if l in salient:
            hat = _salient_rows(hat, x, salient[l], config, l, which)
        return hat

    report = ValidationReport(config.name or "config", T, B, steps, tol, str(dev), interpreting())
    worst = {l: dict(mis=0, rel=0.0, mx=0.0, where="", qerr=0.0) for l in layers}
    schedule = [T - steps] + [1] * steps
    t = 0
    for si, n in enumerate(schedule):
        step = cache.plan([n] * B, num_splits=num_splits)
        t += n
        final = si == len(schedule) - 1
        for l in range(L):
            cache.store(step, l, k[l, :, :, t - n:t].permute(0, 2, 1, 3).reshape(-1, H, D).to(dev),
                        v[l, :, :, t - n:t].permute(0, 2, 1, 3).reshape(-1, H, D).to(dev),
                        salient=salient.get(l) if si == 0 else None,
                        key_moment=moments[l].to(dev) if si == 0 and moments and not static_moments else None)
        if si == 0:
            continue  # the prefill is checked through the steps that follow
        if has_static and not final:
            continue  # the reference's static scales are those of the final length
        for l in layers:
            out = cache.decode(step, l, q[l, :, :, t - 1].to(dev)).float().cpu()
            k_stored = held(k[l, :, :, :t], l, "k")
            k_hat = post(k_stored, l)
            v_hat = held(v[l, :, :, :t], l, "v")
            w = worst[l]
            for b in range(B):
                for which, hat in (("k", k_stored), ("v", v_hat)):
                    got = cache.read(l, which, b)
                    w["mis"] += int((got != hat[b]).sum())
                ref, clean, _ = reference_decode(q[l, b, :, t - 1], post(k[l, b, :, :t], l), v[l, b, :, :t], k_hat[b], v_hat[b],
                                                 kv_map, window=windows[l], sink=None if sinks is None else sinks[l])
                r = rel_rms(out[b], ref)
                diff = (out[b].double() - ref).abs()
                if r >= w["rel"]:
                    w["rel"] = r
                    idx = int(diff.argmax())
                    w["where"] = f"seq {b} token {t - 1} q_head {idx // D} channel {idx % D}"
                w["mx"] = max(w["mx"], float(diff.max()))
                w["qerr"] = max(w["qerr"], rel_rms(ref, clean))
    for l in layers:
        w = worst[l]
        report.layers.append(LayerResult(
            layer=l, k_formats=_labels(config, l, H, "k"), v_formats=_labels(config, l, H, "v"),
            mismatched=w["mis"], rel_rms=w["rel"], max_abs=w["mx"], worst=w["where"], quant_rel_error=w["qerr"],
            ok=w["mis"] == 0 and w["rel"] <= tol,
        ))
    return report


def _salient_rows(hat: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, config, layer: int, which: str) -> torch.Tensor:
    """``hat [B, H, t, D]`` with the salient tokens ``pos [B, H, m]`` of the kv heads that keep
    salient rows on side ``which`` (:meth:`~kverr.config.CacheConfig.keeps_salient`) read as their
    ``window_dtype`` rows of ``x``."""
    from kverr.quant.store import receive

    out = hat.clone()
    for fmt, heads in config.head_groups(layer, x.shape[1], which):
        if not config.keeps_salient(which, fmt):
            continue
        idx = pos[:, heads].long()[..., None].expand(-1, -1, -1, x.shape[-1])
        rows = receive(x[:, heads].gather(2, idx), config.window_dtype)
        out[:, heads] = out[:, heads].scatter(2, idx, rows)
    return out


def _check_steps_tol(tokens: int, steps: int, tol: float) -> None:
    """Refuse a decode schedule or tolerance that cannot give a meaningful comparison."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ShapeError(f"steps={steps!r}: give at least 1 decode step (each step is compared)")
    if tokens < steps + 1:
        raise ShapeError(
            f"{tokens} tokens per sequence leave no prefill before {steps} decode step(s): "
            f"tokens must be at least steps + 1 = {steps + 1} (raise tokens or lower steps)"
        )
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol <= 0:
        raise ShapeError(f"tol={tol!r} must be a finite relative RMS greater than 0, e.g. 1e-3")


def validate(config, capture, *, tokens: int = 128, batch: int = 2, steps: int = 2, layers=None, tol: float = 1e-3,
             device=None, dot_fp16: bool = False) -> ValidationReport:
    """Validate ``config`` (a :class:`CacheConfig`, preset name or JSON path) on a capture.

    Parameters
    ----------
    capture : path or xarray.Dataset
        A capture (see :func:`kverr.io.open_capture`); uses ``q`` and ``k`` (post-RoPE) and ``v``.
    tokens, batch : int
        ``batch`` sequences of ``tokens`` tokens, taken as consecutive disjoint windows of the
        captured token axis.
    steps : int
        Single-token decode steps after the prefill; each is compared.
    layers : list of int, optional
        Layer indices to compare, as the capture's ``layer`` coordinate names them (all are
        stored).
    tol : float
        Largest allowed relative RMS between the kernel and reference decode outputs (finite,
        greater than 0).

    Raises
    ------
    kverr.exceptions.ShapeError
        ``tokens`` too short for ``steps``, a bad ``tol``, or layers the capture lacks.
    kverr.exceptions.CaptureError
        The capture is too short for ``batch`` sequences of ``tokens``.
    """
    import kverr.accessor  # noqa: F401  (ds.kv)
    from kverr.config import check_model_matches, resolve
    from kverr.dims import layer_positions

    _check_steps_tol(tokens, steps, tol)
    cfg = resolve(config)
    if isinstance(capture, (str, bytes)) or hasattr(capture, "__fspath__"):
        from kverr.io import open_capture

        ds = open_capture(capture)
    else:
        ds = capture
    check_model_matches(cfg, capture=ds)
    n_tok = int(ds.sizes["token"])
    if tokens * batch > n_tok:
        raise CaptureError(f"the capture has {n_tok} tokens; {batch} sequences of {tokens} need {tokens * batch}")
    sel = dict(token=slice(0, tokens * batch))
    # layers are named by their index in the model; validate_arrays takes positions
    positions = None if layers is None else layer_positions(ds["layer"].values, layers)
    key_var = "k_pre" if cfg.key_pre_rope else "k"
    if key_var not in ds:
        raise CaptureError(f"the capture has no {key_var!r} variable, which a key_pre_rope config needs")
    from kverr.io import check_finite

    check_finite(ds.isel(sel), ("q", key_var, "v"))  # named coordinates, not a kernel's mismatch
    q = torch.from_numpy(np.asarray(ds["q"].isel(sel).values, dtype=np.float32))
    k = torch.from_numpy(np.asarray(ds[key_var].isel(sel).values, dtype=np.float32))
    v = torch.from_numpy(np.asarray(ds["v"].isel(sel).values, dtype=np.float32))
    kv_map = np.asarray(ds["kv_head_of_q"].values)

    def split(x):  # [L, heads, B*T, D] -> [L, B, heads, T, D]
        Lx, Hx, _, Dx = x.shape
        return x.reshape(Lx, Hx, batch, tokens, Dx).permute(0, 2, 1, 3, 4).contiguous()

    q, rope = split(q), None
    if cfg.key_pre_rope:
        q, rope = _local_positions(ds, q, tokens, batch)
        if len({id(r) for r in rope}) == 1:
            rope = rope[0]
    # A capture may hold a subset of the model's layers: index the config by the model's layers.
    model_layers = [int(x) for x in ds["layer"].values]
    sinks = torch.from_numpy(ds.kv.attn_sinks().values).float() if ds.kv.has_sinks else None
    rep = validate_arrays(cfg.select_layers(model_layers), q, split(k), split(v), kv_map, layers=positions,
                          steps=steps, tol=tol, device=device, dot_fp16=dot_fp16, rope=rope,
                          sliding_windows=[ds.kv.sliding_window(layer) for layer in model_layers], sinks=sinks)
    for r in rep.layers:
        r.layer = model_layers[r.layer]
    return rep


def _local_positions(ds, q: torch.Tensor, tokens: int, batch: int):
    """RoPE tables of positions ``0..tokens-1`` (one (cos, sin) pair per captured layer, shared by
    layers of one RoPE) and the captured queries ``[L, B, q_head, T, D]`` moved to them.

    The kernel path rotates the pre-RoPE keys of each sequence to positions ``0, 1, ...``; the
    captured queries were rotated to their absolute positions ``p0_b + t``. Attention scores
    depend on position differences only, so each sequence's queries are turned back by ``p0_b``
    (a pure rotation, without ``attention_scaling``) and keys and queries stay consistent.
    """
    import json

    from kverr.rope import parse_rope, rope_cos_sin, rotate

    import kverr.accessor  # noqa: F401  (ds.kv)

    if ds.kv.rope is None:
        raise CaptureError("a key_pre_rope config needs the capture's RoPE parameters (attrs['rope'])")
    D = q.shape[-1]
    n = tokens * batch
    pos = ds.kv.positions[:n]
    p0 = pos.reshape(batch, tokens)[:, :1]
    if not (pos.reshape(batch, tokens) - p0 == np.arange(tokens)).all():
        raise CaptureError("the captured positions are not consecutive within each validation sequence")
    tables: dict[str, tuple] = {}
    out, pairs = [], []
    for i, layer in enumerate(ds.kv.layers):
        params = ds.kv.rope_of(layer)
        key = json.dumps(params, sort_keys=True)
        if key not in tables:
            inv_freq, scaling = parse_rope(params)
            if 2 * inv_freq.numel() != D:
                raise KernelError(f"partial rotary embeddings ({2 * inv_freq.numel()} of {D} channels) are not fused "
                                  "into the decode kernel; validate this config on the reference path")
            back = rope_cos_sin(-p0[:, 0], inv_freq, 1.0)  # [batch, D]
            tables[key] = (rope_cos_sin(np.arange(tokens), inv_freq, scaling), back)
        pair, (back_cos, back_sin) = tables[key]
        pairs.append(pair)
        out.append(torch.stack([rotate(q[i, b], back_cos[b], back_sin[b]) for b in range(batch)]))
    return torch.stack(out).contiguous(), pairs
