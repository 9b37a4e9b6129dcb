"""Does an attention-aware rotation, with bits water-filled across its channels, cut the
calibration objective's damage below today's best static format at 2 to 3 bits?

Every variant here stores a (layer, kv head) tensor as ``T x`` (``x`` a key or value row, ``T`` a
fixed d x d matrix fitted on the calibration capture), each channel ``i`` of ``T x`` quantized to
``b_i`` bits on an asymmetric uniform grid with a *static* range (fitted on the calibration
capture; held-out values outside it saturate), ``b_i = 0`` keeping the channel's static mean, and
reads back ``T^{-1}`` of the reconstruction. Effective bits are the mean ``b_i`` (static bytes --
``T``, ranges -- are printed apart). The bits are allocated greedily (one bit at a time to the
channel whose weighted squared error it lowers most) under the variant's weighting, for a mean of
exactly B bits. Damage is kverr's calibration objective (:mod:`kverr.calibration.objective`,
relative squared attention-output error, keys and values apart) on a *held-out* capture.

Variants, keys (``pre``: pre-RoPE keys, the error rotated by RoPE before it is scored):

* ``pre/id/mse``: pre-RoPE, no transform, bits by plain squared error -- today's best family
  at 2.5-3 bits on this model (static per-channel integers, ``data/configs/calibrated-2.5b.json``);
* ``pre/id/q``: the same, bits weighted by the queries' second moment along each channel (pair-
  averaged over the RoPE pair, which RoPE mixes);
* ``pre/id/q/024``, ``pre/id/q/012348``: the same with only the widths listed (0, 2, 4; or the
  widths kverr packs, 1, 2, 3, 4, 8, and 0);
* ``pre/id/qp/012348``: the same, one width per RoPE pair (channels ``i`` and ``i + D/2``), so a
  kernel can apply RoPE inside each width's plane;
* ``pre/pair/q``, ``pre/pair/q/012348``: pre-RoPE, each RoPE pair ``(i, i + D/2)`` turned by its
  own 2 x 2 rotation into the principal axes of the pair's (token-weighted) key second moment,
  bits weighted by the queries as ``pre/id/q``: the rotations that commute with RoPE (any turn
  of a pair commutes with RoPE's turn of it), so the query can be turned once instead;
* ``pre/id/q/012348/sparse``: ``pre/id/q/012348`` with dense-and-sparse outliers as KVQuant keeps
  them: per channel, the calibration keys' 0.5th and 99.5th percentiles are thresholds, the dense
  ranges are fitted to the keys clamped to them, and a held-out element beyond them is kept exact
  (their fraction is printed as rows of option ``outliers``; each costs a 16-bit value and a 16-bit
  index, and a 32-bit pointer per token on top);
* ``pre/id/q/012348/sparse0.1`` (``0.25``, ...): thresholds at the 0.1th and 99.9th percentiles;
* ``pre/id/q/012348/top1``, ``…/top2``: the same thresholds and dense fit, but each held-out row
  keeps exactly its 1 (2) elements furthest beyond them (none when none is beyond), each as an
  fp16 value and an 8-bit channel index, paid from the budget: the dense widths get ``B - 24 k / D``
  bits, so the variant is at exactly ``B`` bits with no pointers;
* ``post/had/mse``: post-RoPE keys, normalised Hadamard;
* ``post/pca/q``: post-RoPE, the eigenbasis of the keys' second moment, bits weighted by the
  queries' second moment in that basis;
* ``post/qeig/q``: post-RoPE, the eigenbasis of the queries' second moment ``Σ_q`` (the
  attention-aware rotation), bits weighted by its eigenvalues;
* ``post/white``: post-RoPE, ``T = Uᵀ Σ_q^{1/2}`` with ``U`` the eigenbasis of
  ``Σ_q^{1/2} Σ_k Σ_q^{1/2}`` (not orthogonal; the query reads ``T^{-T} q``): the score error of
  a stored error ``ẽ`` is ``ẽ·(T^{-T} q)``, whose second moment is ``|ẽ|²``, so squared error in
  the stored space *is* the score error and the stored channels are decorrelated -- the transform
  code the first-order objective asks for.

``Σ_q`` is the second moment of the (scaled, post-RoPE) queries of the kv head's query heads,
each query-key pair weighted by its first-order key-term weight ``a² |v − o|²``; keys' and
values' token weights are likewise ``Σ_q a² |v − o|²`` (keys) and ``Σ_q a²`` (values), from 256
sampled queries of the calibration capture.

Values: ``id/mse``, ``had/mse`` and ``pca/mse`` (eigenbasis of the attention-weighted value second
moment), each with bits allocated by token-weighted squared error.

Usage: python rotation_damage.py CALIBRATION_CAPTURE HELDOUT_CAPTURE [--layers 0,1,...] [--keys V,...] [--values V,...]
       [--budgets B,...]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
from scipy.linalg import hadamard

from kverr.calibration.candidates import OuterOption
from kverr.calibration.objective import _layer_arrays, key_damage_batch, prepare_layer, value_damage_batch
from kverr.io import open_capture
from kverr.rope import apply_rope

BUDGETS = (2.0, 2.5, 3.0)
MAX_BITS = 8
#: Clip ratios tried per end of a channel's range (shrunk about its midpoint).
RATIOS = np.linspace(1.0, 0.2, 9)
OPTIONS = [OuterOption(), OuterOption(sinks=4, window=32)]
SINKS = 4  # tokens left out of every fit (the attention sinks: kept in fp16 by the S4 option)
KEY_VARIANTS = ("pre/id/mse", "pre/id/q", "pre/id/q/024", "pre/id/q/012348", "pre/id/qp/012348",
                "pre/pair/q", "pre/pair/q/012348", "pre/id/q/012348/sparse", "pre/id/q/012348/top1",
                "pre/id/q/012348/top2", "post/had/mse", "post/pca/q",
                "post/qeig/q", "post/white")
#: Per-channel outlier thresholds of the ``/sparse`` variants: these quantiles of the calibration keys.
SPARSE_QUANTILES = (0.005, 0.995)
#: Bit widths a variant may give a channel: all of 0..8, or (``/024``) only those listed.
ALLOWED = {"024": (0, 2, 4), "012348": (0, 1, 2, 3, 4, 8)}
VALUE_VARIANTS = ("id/mse", "had/mse", "pca/mse")


def fit_channels(x: torch.Tensor, m: torch.Tensor):
    """Per channel of ``x [T, D]`` (token weights ``m [T]``) and bits 1..MAX_BITS: the static range
    ``(lo, hi)`` of least weighted squared error over the clip grid, and that error; bits 0: the
    weighted mean. Returns ``ranges [MAX_BITS+1, D, 2]``, ``err [MAX_BITS+1, D]``."""
    x = x.double()
    m = (m / m.sum()).double()[:, None]
    mean = (m * x).sum(0)
    lo0, hi0 = x.min(0).values, x.max(0).values
    mid, half = (lo0 + hi0) / 2, (hi0 - lo0) / 2
    r = torch.as_tensor(RATIOS, dtype=torch.float64)
    lo = (mid - r[:, None, None] * half).expand(len(r), len(r), -1)  # [rl, rh, D]
    hi = (mid + r[None, :, None] * half).expand(len(r), len(r), -1)
    ranges = torch.zeros(MAX_BITS + 1, x.shape[1], 2, dtype=torch.float64)
    err = torch.zeros(MAX_BITS + 1, x.shape[1], dtype=torch.float64)
    ranges[0, :, 0] = ranges[0, :, 1] = mean
    err[0] = (m * (x - mean) ** 2).sum(0)
    lo_f, hi_f = lo.reshape(-1, x.shape[1]), hi.reshape(-1, x.shape[1])
    for b in range(1, MAX_BITS + 1):
        e = torch.stack([(m * (quantize(x, lo_f[j], hi_f[j], b) - x) ** 2).sum(0) for j in range(lo_f.shape[0])])
        best = e.argmin(0)
        idx = torch.arange(x.shape[1])
        ranges[b, :, 0], ranges[b, :, 1] = lo_f[best, idx], hi_f[best, idx]
        err[b] = e[best, idx]
    return ranges, err


def quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, b: int) -> torch.Tensor:
    """Asymmetric uniform ``b``-bit grid over ``[lo, hi]`` per channel, saturating."""
    L = 2**b - 1
    s = torch.clamp((hi - lo) / L, min=1e-12)
    return torch.clamp(torch.round((x - lo) / s), 0, L) * s + lo


def allocate(err: torch.Tensor, w: torch.Tensor, budget: float, allowed=tuple(range(MAX_BITS + 1))) -> np.ndarray:
    """Greedy bits per channel, each from ``allowed`` (0 included), a mean of at most ``budget``
    bits: each step moves the channel whose weighted error ``w_i err[b_i, i]`` falls most per
    added bit to its next allowed width, while that fits."""
    D = err.shape[1]
    left = int(round(budget * D))
    nxt = {a: b for a, b in zip(allowed, allowed[1:])}
    b = np.zeros(D, dtype=np.int64)
    werr = (err * w[None, :]).numpy()
    idx = np.arange(D)
    while True:
        up = np.array([nxt.get(int(x), -1) for x in b])
        cost = up - b
        ok = (up >= 0) & (cost <= left)
        if not ok.any():
            return b
        gain = np.where(ok, (werr[b, idx] - werr[np.where(ok, up, 0), idx]) / np.maximum(cost, 1), -np.inf)
        i = int(np.argmax(gain))
        left -= int(cost[i])
        b[i] = up[i]


def reconstruct(x: torch.Tensor, T: torch.Tensor, ranges, bits: np.ndarray) -> torch.Tensor:
    """``T^{-1} Q(T x)`` for rows ``x [..., D]``."""
    y = x.double() @ T.T
    out = torch.empty_like(y)
    for i, b in enumerate(bits):
        lo, hi = ranges[b, i]
        out[..., i] = lo if b == 0 else quantize(y[..., i], lo, hi, int(b))
    return torch.linalg.solve(T, out.reshape(-1, out.shape[-1]).T).T.reshape(out.shape)


def sym_sqrt(S: torch.Tensor) -> torch.Tensor:
    lam, U = torch.linalg.eigh(S)
    return (U * lam.clamp(min=0).sqrt()) @ U.T


def eig_desc(S: torch.Tensor):
    lam, U = torch.linalg.eigh(S)
    return lam.flip(0), U.flip(1)


def stats(prep, h: int):
    """Attention-weighted second moments of kv head ``h`` from the calibration queries: ``Σ_q``
    (key-term weights ``a² |v − o|²``), key token weights, value token weights."""
    qi = torch.nonzero(prep.kv_map == h).flatten()
    a = prep.a[qi]  # [g, n, T]
    v = prep.v[h]  # [T, D]
    o = prep.o[qi]  # [g, n, D]
    dv2 = ((v[None, None] - o[:, :, None]) ** 2).sum(-1)  # [g, n, T]
    wk = (a * a * dv2).double()
    wk[..., :SINKS] = 0
    q = prep.q[qi].double()  # [g, n, D]
    Sq = torch.einsum("gn,gnd,gne->de", wk.sum(-1), q, q) / wk.sum()
    mk = wk.sum((0, 1))
    mv = (a * a).double().sum((0, 1))
    mv[:SINKS] = 0
    return Sq, mk, mv


def key_transform(name: str, Sq: torch.Tensor, Sk: torch.Tensor, D: int):
    """``(T, channel weights)`` of a key variant."""
    ones = torch.ones(D, dtype=torch.float64)
    kind, wname = name.split("/")[1], name.split("/")[2] if name.count("/") >= 2 else name.split("/")[-1]
    if kind == "id":
        T = torch.eye(D, dtype=torch.float64)
    elif kind == "had":
        T = torch.as_tensor(hadamard(D) / math.sqrt(D), dtype=torch.float64)
    elif kind == "pca":
        T = eig_desc(Sk)[1].T
    elif kind == "qeig":
        T = eig_desc(Sq)[1].T
    elif kind == "pair":
        T = torch.zeros(D, D, dtype=torch.float64)
        for i in range(D // 2):
            ij = [i, i + D // 2]
            u = eig_desc(Sk[ij][:, ij])[1]
            if torch.linalg.det(u) < 0:  # a turn, not a reflection: only a turn commutes with RoPE's
                u[:, 1] = -u[:, 1]
            T[torch.tensor(ij)[:, None], torch.tensor(ij)[None, :]] = u.T
    elif kind == "white":
        R = sym_sqrt(Sq + 1e-6 * Sq.trace() / D * torch.eye(D, dtype=torch.float64))
        T = eig_desc(R @ Sk @ R)[1].T @ R
        return T, ones
    if wname == "mse":
        return T, ones
    w = torch.diagonal(T @ Sq @ T.T).clone()
    if name.startswith("pre"):  # RoPE mixes channel i with i + D/2: average their weights
        w = (w + w.roll(D // 2)) / 2
    return T, w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("calibration")
    ap.add_argument("heldout")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--keys", default=",".join(KEY_VARIANTS), help="key variants (comma-separated)")
    ap.add_argument("--values", default=",".join(VALUE_VARIANTS), help="value variants ('' for none)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="mean bits (comma-separated)")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    key_variants = [v for v in args.keys.split(",") if v]
    value_variants = [v for v in args.values.split(",") if v]
    cal, held = open_capture(args.calibration), open_capture(args.heldout)
    layers = cal.kv.layers if args.layers is None else [int(x) for x in args.layers.split(",")]
    print(f"# calibration {args.calibration}, held out {args.heldout}; damage = relative squared "
          f"attention-output error (kverr objective), options {[o.label() for o in OPTIONS]}")
    rows = []
    t0 = time.time()
    for layer in layers:
        cq, ck, cv, ckp, cscale, kv_map = _layer_arrays(cal, layer, True)
        cprep = prepare_layer(cq, ck, cv, ckp, layer=layer, kv_map=kv_map, scale=cscale, queries=256)
        hq, hk, hv, hkp, hscale, _ = _layer_arrays(held, layer, True)
        hprep = prepare_layer(hq, hk, hv, hkp, layer=layer, kv_map=kv_map, scale=hscale,
                              queries=args.queries, positions=held.kv.positions, rope=held.kv.rope_of(layer))
        hpos, hrope = held.kv.positions, held.kv.rope_of(layer)
        D = ck.shape[-1]
        n_kv = ck.shape[0]
        ek = {(vname, B): torch.zeros(n_kv, *hk.shape[1:]) for vname in key_variants for B in budgets}
        outliers: dict[str, float] = {}  # variant -> fraction of held-out key elements kept exact
        ev = {(vname, B): torch.zeros(n_kv, *hv.shape[1:]) for vname in value_variants for B in budgets}
        for h in range(n_kv):
            Sq, mk, mv = stats(cprep, h)
            for vname in key_variants:
                pre = vname.startswith("pre")
                last = vname.split("/")[-1]
                top = int(last[3:]) if last.startswith("top") else 0
                sparse = last.startswith("sparse") or top > 0
                # "/sparseP": thresholds at the P-th and (100 - P)-th percentiles (default 0.5)
                tail = float(last[6:]) / 100 if last.startswith("sparse") and len(last) > 6 else SPARSE_QUANTILES[0]
                base = vname.rsplit("/", 1)[0] if sparse else vname
                xc = torch.as_tensor(ckp[h] if pre else ck[h]).double()
                Sk = torch.einsum("t,td,te->de", mk, xc, xc) / mk.sum()
                T, w = key_transform(base, Sq, Sk, D)
                y = xc[SINKS:] @ T.T
                xh = torch.as_tensor(hkp[h] if pre else hk[h]).double()
                if sparse:
                    assert base.split("/")[1] == "id", "outliers are kept in the stored channels: no transform"
                    lo_t, hi_t = (torch.quantile(y, q, dim=0) for q in (tail, 1 - tail))
                    y = torch.minimum(torch.maximum(y, lo_t), hi_t)
                    out = (xh < lo_t) | (xh > hi_t)
                    if top:  # the row's `top` elements furthest beyond the thresholds
                        beyond = torch.maximum(xh - hi_t, lo_t - xh).clamp(min=0)
                        idx = beyond.topk(top, dim=-1).indices
                        out = torch.zeros_like(out).scatter_(-1, idx, True) & (beyond > 0)
                    out[:SINKS] = False  # the sinks are in fp16 under S4 anyway
                    outliers[vname] = outliers.get(vname, 0.0) + float(out[SINKS:].double().mean()) / n_kv
                ranges, err = fit_channels(y, mk[SINKS:])
                for B in budgets:
                    allowed = ALLOWED.get(base.split("/")[-1], tuple(range(MAX_BITS + 1)))
                    if "/qp/" in vname:  # one width per RoPE pair (i, i + D/2)
                        we = err * w[None, :]
                        half = allocate(we[:, : D // 2] + we[:, D // 2:], torch.ones(D // 2, dtype=torch.float64), B, allowed)
                        bits = np.concatenate([half, half])
                    else:
                        bits = allocate(err, w, B - 24 * top / D, allowed)
                    r = reconstruct(xh, T, ranges, bits)
                    if sparse:
                        r = torch.where(out, xh, r)
                    if pre:
                        r = apply_rope(r[None].float(), hpos, hrope)[0].double()
                    ek[(vname, B)][h] = (r - torch.as_tensor(hk[h]).double()).float()
            for vname in value_variants:
                xc = torch.as_tensor(cv[h]).double()
                kind = vname.split("/")[0]
                if kind == "id":
                    T = torch.eye(D, dtype=torch.float64)
                elif kind == "had":
                    T = torch.as_tensor(hadamard(D) / math.sqrt(D), dtype=torch.float64)
                else:
                    T = eig_desc(torch.einsum("t,td,te->de", mv, xc, xc) / mv.sum())[1].T
                ranges, err = fit_channels(xc[SINKS:] @ T.T, mv[SINKS:])
                for B in budgets:
                    bits = allocate(err, torch.ones(D, dtype=torch.float64), B)
                    ev[(vname, B)][h] = (reconstruct(torch.as_tensor(hv[h]), T, ranges, bits)
                                         - torch.as_tensor(hv[h]).double()).float()
        for vname in key_variants:
            dmg = key_damage_batch(hprep, torch.stack([ek[(vname, B)] for B in budgets]), OPTIONS)  # [B, opt, kv]
            for bi, B in enumerate(budgets):
                for oi, o in enumerate(OPTIONS):
                    rows.append((layer, "k", vname, B, o.label(), float(dmg[bi, oi].sum())))
        for vname, frac in outliers.items():
            rows.append((layer, "k", vname, 0.0, "outliers", frac))
        for vname in value_variants:
            dmg = value_damage_batch(hprep, torch.stack([ev[(vname, B)] for B in budgets]), OPTIONS)
            for bi, B in enumerate(budgets):
                for oi, o in enumerate(OPTIONS):
                    rows.append((layer, "v", vname, B, o.label(), float(dmg[bi, oi].sum())))
        print(f"# layer {layer} done, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print("layer,side,variant,bits,option,damage")
    for r in rows:
        print(",".join(map(str, r[:5])) + f",{r[5]:.6g}")


if __name__ == "__main__":
    main()
