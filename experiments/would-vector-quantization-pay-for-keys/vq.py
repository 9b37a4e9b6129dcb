"""Would vector quantization of small sub-vectors pay for keys?

Per (layer, kv head) of a capture, the pre-RoPE keys are quantized by

* ``int<b>``: kverr's asymmetric integer format with static per-channel scales and the MSE clip
  (``int_format``), the family the calibrated configs use most for keys;
* ``vq2/<b>``: each RoPE pair ``(c, c + D/2)`` -- the two channels RoPE turns together, so the
  pair's geometry is the same at every position -- normalized by its channels' mean and standard
  deviation, then replaced by the nearest of ``2^(2b)`` centroids (k-means on the fitting tokens,
  one codebook per pair, Euclidean in the space where each channel is weighted by the queries'
  energy on it);
* ``vq4/<b>`` (b = 2 only): two RoPE pairs at once, ``2^8`` centroids, one codebook per head
  shared by its 16 pair-pairs.

* ``lloyd1/<b>``: each channel alone, its ``2^b`` Lloyd-Max levels (no scale): what VQ gains
  over non-uniform scalar levels;
* with ``--config``, the config's own key format of the head (``bits``: its mean width), and
  ``vq2-allotted``: RoPE-pair VQ at the same bits, allotted over the pairs greedily by the
  weighted error on the fitting tokens (:func:`allocated`); for a config that rounds its keys
  with compensation, also ``config+ck``: so rounded under the capture's query moment, as the
  calibration scores it (in-sample only).

All but the config use ``b`` bits per channel for the codes (the VQ codebooks and the integer scales are static
bytes, left out of the bits). Errors are measured as the compensated rounding weighs them: the
cost of an error ``e_t`` in a key at position ``t`` is ``e_tᵀ C_t e_t``, ``C_t`` the second
moment of the layer's queries turned to ``t`` (:func:`kverr.calibration.objective.key_cost`).
Reported: ``Σ_t e_tᵀ C_t e_t / Σ_t k_tᵀ C_t k_t`` over the evaluation tokens, fitted and
evaluated on all tokens (``in``) and fitted on the first half, evaluated on the second (``out``).

Usage (from the repository root):
    PYTHONPATH=. python experiments/would-vector-quantization-pay-for-keys/vq.py CAPTURE OUT.csv [--layers 3 14 25]
"""
from __future__ import annotations

import argparse

import pandas as pd
import torch


def kmeans(x: torch.Tensor, k: int, iters: int = 25, seed: int = 0) -> torch.Tensor:
    """``[G, k, d]`` centroids of ``x [G, n, d]``, each group by scipy's ``kmeans2`` (k-means++
    starts, ``iters`` Lloyd rounds, seeded)."""
    from scipy.cluster.vq import kmeans2

    return torch.stack([torch.as_tensor(kmeans2(g.numpy(), k, iter=iters, minit="++", seed=seed + i)[0])
                        for i, g in enumerate(x.double())])


def vq(k: torch.Tensor, fit: slice, w: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Reconstruction of ``k [T, D]`` by ``dim``-channel VQ (see module doc)."""
    T, D = k.shape
    h = D // 2
    mu, sd = k[fit].mean(0), k[fit].std(0).clamp(min=1e-6)
    z = (k - mu) / sd * w  # weighted, normalized
    pair = torch.stack([z[:, :h], z[:, h:]], -1)  # [T, h, 2]: RoPE pairs
    if dim == 2:
        x = pair.permute(1, 0, 2)  # [h, T, 2]: one codebook per pair
        c = kmeans(x[:, fit], 2 ** (2 * bits))
        r = c.gather(1, torch.cdist(x, c).argmin(-1)[..., None].expand(-1, -1, 2))
        rec = r.permute(1, 0, 2)
    else:
        x = pair.reshape(T, h // 2, 4).reshape(1, T * (h // 2), 4)  # one codebook for the head
        fx = pair[fit].reshape(-1, h // 2, 4).reshape(1, -1, 4)
        c = kmeans(fx, 2 ** (4 * bits))
        r = c.gather(1, torch.cdist(x, c).argmin(-1)[..., None].expand(-1, -1, 4))
        rec = r.reshape(T, h // 2, 4).reshape(T, h, 2)
    zr = torch.cat([rec[..., 0], rec[..., 1]], -1)
    return zr / w * sd + mu


def allocated(k: torch.Tensor, fit: slice, w: torch.Tensor, total_bits: int, top: int = 4) -> tuple[torch.Tensor, float]:
    """``k [T, D]`` by RoPE-pair VQ with bits allotted per pair: pair ``p`` gets ``b_p`` bits per
    channel (``4^b_p`` centroids, ``b_p`` 0..``top``; 0 reads back the pair's mean), chosen
    greedily -- two bits at a time to the pair whose weighted squared error on the fitting
    tokens falls most -- until ``total_bits`` are spent. Returns the reconstruction, the mean
    bits per channel and the number of centroids stored (over the pairs with bits)."""
    T, D = k.shape
    h = D // 2
    mu, sd = k[fit].mean(0), k[fit].std(0).clamp(min=1e-6)
    z = (k - mu) / sd * w
    x = torch.stack([z[:, :h], z[:, h:]], -1).permute(1, 0, 2)  # [h, T, 2]
    recs, errs = [torch.zeros_like(x)], [(x[:, fit] ** 2).sum((1, 2))]
    for b in range(1, top + 1):
        c = kmeans(x[:, fit], 4 ** b)
        r = c.gather(1, torch.cdist(x, c).argmin(-1)[..., None].expand(-1, -1, 2))
        recs.append(r)
        errs.append(((r - x)[:, fit] ** 2).sum((1, 2)))
    err = torch.stack(errs, 1)  # [h, top + 1]
    bits = torch.zeros(h, dtype=torch.long)
    spent = 0
    while spent + 2 <= total_bits:
        gain = torch.where(bits < top, err.gather(1, bits[:, None]).squeeze(1)
                           - err.gather(1, (bits + 1).clamp(max=top)[:, None]).squeeze(1), torch.tensor(-1.0, dtype=err.dtype))
        p = int(gain.argmax())
        if gain[p] <= 0:
            break
        bits[p] += 1
        spent += 2
    rec = torch.stack([recs[int(bits[p])][p] for p in range(h)])  # [h, T, 2]
    zr = torch.cat([rec[..., 0].T, rec[..., 1].T], -1)
    return zr / w * sd + mu, spent / D, int((4 ** bits[bits > 0]).sum())


def lloyd(k: torch.Tensor, fit: slice, bits: int) -> torch.Tensor:
    """``k [T, D]`` with each channel replaced by the nearest of its ``2^b`` levels, fitted on the
    fitting tokens by kverr's Lloyd-Max (:func:`kverr.quant.codebooks.lloyd_max`)."""
    from kverr.quant.codebooks import level_codes, lloyd_max

    out = torch.empty_like(k)
    for c in range(k.shape[1]):
        levels = lloyd_max(k[fit, c], bits)
        out[:, c] = torch.tensor(levels, dtype=k.dtype)[level_codes(k[:, c], levels).long()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 14, 25])
    ap.add_argument("--config", help="also the config's own key format per head (nearest rounding; `bits` its mean "
                                     "width per channel)")
    a = ap.parse_args(argv)

    import kverr.accessor  # noqa: F401
    from kverr.calibration.objective import _layer_arrays, key_cost, prepare_layer
    from kverr.io import open_capture
    from kverr.quant import QuantFormat
    from kverr.quant.store import fake_quantize_region

    torch.set_num_threads(2)
    cap = open_capture(a.capture)
    cfg = None
    if a.config:
        from kverr.config import CacheConfig

        cfg = CacheConfig.load(a.config)
    rows = []
    for layer in a.layers:
        q, k, v, kp, scale, kv_map = _layer_arrays(cap, layer, True)
        prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=32,
                             positions=cap.kv.positions, rope=cap.kv.rope_of(layer), compensated_keys=True)
        C = key_cost(prep, True).cost  # [H, T, D, D]
        K = torch.as_tensor(kp, dtype=torch.float64)  # [H, T, D]
        H, T, D = K.shape
        halves = {"in": (slice(0, T), slice(0, T)), "out": (slice(0, T // 2), slice(T // 2, T))}

        def rel(e, kk, hh, ev):
            c = C[hh, ev]
            return float(torch.einsum("td,tde,te->", e, c, e) / torch.einsum("td,tde,te->", kk, c, kk))

        comp = None
        if cfg is not None and cfg.compensates_keys:
            # the config's keys as the objective scores them: compensated rounding under the
            # capture's query moment, static scales fitted on every token (in-sample only)
            from kverr.quant.store import reconstruct

            base = cfg.without_windows().with_(sinks=0, provenance={})
            comp = reconstruct(kp, base, layer=layer, which="k", key_cost=key_cost(prep, True)).double()
        for hh in range(H):
            kk = K[hh]
            if comp is not None:
                e = comp[hh] - kk
                f = cfg.format_for(layer, hh, "k")
                rows.append(dict(layer=layer, kv_head=hh, split="in",
                                 bits=sum(f.channel_bits) / D if f.channel_bits is not None else f.bits,
                                 method="config+ck", weighted=rel(e, kk, hh, slice(0, T)),
                                 mse=float((e ** 2).sum() / (kk ** 2).sum())))
            energy = C[hh].diagonal(dim1=-2, dim2=-1).mean(0)  # [D]: the queries' energy per channel
            w = (energy * kk.var(0)).sqrt()
            w = w / w.mean()
            for split, (fit, ev) in halves.items():
                if a.config:
                    f = cfg.format_for(layer, hh, "k")
                    cb = sum(f.channel_bits) / D if f.channel_bits is not None else f.bits
                    kq = fake_quantize_region(kk[None, None].float(), f, 64, fit=kk[None, None, fit].float())[0, 0].double()
                    e = (kq - kk)[ev]
                    rows.append(dict(layer=layer, kv_head=hh, split=split, bits=cb, method="config",
                                     weighted=rel(e, kk[ev], hh, ev), mse=float((e ** 2).sum() / (kk[ev] ** 2).sum())))
                    rec, vb, centroids = allocated(kk, fit, w, int(round(cb * D)))
                    e = (rec - kk)[ev]
                    rows.append(dict(layer=layer, kv_head=hh, split=split, bits=vb, method="vq2-allotted",
                                     centroids=centroids,
                                     weighted=rel(e, kk[ev], hh, ev), mse=float((e ** 2).sum() / (kk[ev] ** 2).sum())))
                for bits in (2, 3):
                    fmt = QuantFormat.from_dict({"dtype": "int", "bits": bits, "symmetric": False,
                                                 "granularity": {"kind": "channel", "tokens": None},
                                                 "scale_dtype": "fp16", "clip": {"kind": "mse", "grid": 5, "min_ratio": 0.6},
                                                 "rotate": "none"})
                    kq = fake_quantize_region(kk[None, None].float(), fmt, 64, fit=kk[None, None, fit].float())[0, 0].double()
                    results = {f"int{bits}": kq, f"lloyd1/{bits}": lloyd(kk, fit, bits)}
                    results[f"vq2/{bits}"] = vq(kk, fit, w, bits, 2)
                    if bits == 2:
                        results["vq4/2"] = vq(kk, fit, w, bits, 4)
                    for name, rec in results.items():
                        e = (rec - kk)[ev]
                        rows.append(dict(layer=layer, kv_head=hh, split=split, bits=bits, method=name,
                                         weighted=rel(e, kk[ev], hh, ev),
                                         mse=float((e ** 2).sum() / (kk[ev] ** 2).sum())))
            print(layer, hh, pd.DataFrame([r for r in rows if r["layer"] == layer and r["kv_head"] == hh])
                  .pivot_table(index=["split", "method"], values="weighted").T.round(5).to_string(), flush=True)
        pd.DataFrame(rows).to_csv(a.out, index=False)
    df = pd.DataFrame(rows)
    print(df.groupby(["split", "method"])[["bits", "weighted", "mse"]].mean().to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
