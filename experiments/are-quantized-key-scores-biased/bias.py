"""Do a config's quantized keys change the scores' spread -- a softmax temperature -- as well as
add noise to them?

For each layer of a capture and each sampled query (the calibration objective's positions,
:func:`kverr.calibration.objective.prepare_layer`), the score errors ``δs_t = q·e_t`` of the
config's keys (its formats, compensated rounding and pre-RoPE side as calibrated; no window, no
sinks, as the objective scores them) over the tokens the head's format quantizes are regressed on
the clean scores ``s_t`` under the query's attention ``a_t`` restricted to those tokens::

    α = Cov_a(δs, s) / Var_a(s)

``α < 0``: the keys' errors flatten the query's attention (a temperature above 1), ``α > 0``
sharpen it. Noise alone gives α spread around 0. A shift shared by the heads and layers adds up
through the residual stream where independent noise does not, which the per-layer sensitivity
(noise in one layer at a time) cannot see. Also ``explained``, the share of the attention-weighted
variance of ``δs`` that ``α (s − s̄)`` accounts for.

Usage (from the repository root):
    PYTHONPATH=. python experiments/are-quantized-key-scores-biased/bias.py CAPTURE CONFIG OUT.csv [--queries 64]
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import torch


def family(fmt) -> str:
    return "k:widths" if fmt.channel_bits is not None else "k:other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--layers", type=int, nargs="*")
    a = ap.parse_args(argv)

    import kverr.accessor  # noqa: F401
    from kverr.calibration.objective import _layer_arrays, key_error, prepare_layer
    from kverr.config import CacheConfig
    from kverr.io import open_capture

    cap = open_capture(a.capture)
    cfg = CacheConfig.load(a.config)
    base = cfg.without_windows().with_(sinks=0, provenance={})
    rows = []
    for layer in a.layers or cap.kv.layers:
        q, k, v, kp, scale, kv_map = _layer_arrays(cap, layer, cfg.key_pre_rope)
        prep = prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=a.queries,
                             positions=cap.kv.positions, rope=cap.kv.rope_of(layer) if cfg.key_pre_rope else None,
                             decode=None, sliding_window=cap.kv.sliding_window(layer),
                             sinks=cap.kv.attn_sink(layer), compensated_keys=cfg.compensates_keys)
        e = key_error(prep, base).double()
        kvm = prep.kv_map
        qs = prep.q.double()
        s = torch.einsum("hnd,htd->hnt", qs, prep.k.double()[kvm])
        ds = torch.einsum("hnd,htd->hnt", qs, e[kvm])
        T = s.shape[-1]
        t = torch.arange(T)
        for hq in range(qs.shape[0]):
            h = int(kvm[hq])
            win = cfg.window_for(layer, h, "k")
            quant = (t[None, :] >= cfg.sinks) & (t[None, :] <= prep.pos[:, None] - win)  # [n, T]
            w = prep.a[hq].double() * quant
            keep = w.sum(-1) > 1e-3  # queries with some attention on quantized tokens
            w = w[keep] / w[keep].sum(-1, keepdim=True)
            sc, d = s[hq][keep], ds[hq][keep]
            sc = torch.where(w > 0, sc, 0.0)
            d = torch.where(w > 0, d, 0.0)
            sm = (w * sc).sum(-1, keepdim=True)
            dm = (w * d).sum(-1, keepdim=True)
            cov = (w * (d - dm) * (sc - sm)).sum(-1)
            var = (w * (sc - sm) ** 2).sum(-1)
            vd = (w * (d - dm) ** 2).sum(-1)
            alpha = cov / var
            fmt = cfg.format_for(layer, h, "k")
            rows.append(dict(layer=layer, q_head=hq, kv_head=h, family=family(fmt), bits=fmt.bits,
                             rotate=fmt.rotate, queries=int(keep.sum()), alpha=float(alpha.mean()),
                             alpha_se=float(alpha.std() / max(1, len(alpha)) ** 0.5),
                             explained=float((cov ** 2 / var).sum() / vd.sum()),
                             ds_rms=float(vd.mean().sqrt())))
        r = pd.DataFrame([x for x in rows if x["layer"] == layer])
        print(f"layer {layer:2d}: alpha " + " ".join(f"{x:+.4f}" for x in r.groupby("kv_head").alpha.mean())
              + "  explained " + " ".join(f"{x:.3f}" for x in r.groupby("kv_head").explained.mean()), flush=True)
        pd.DataFrame(rows).to_csv(a.out, index=False)
    df = pd.DataFrame(rows)
    print(df.groupby("family")[["alpha", "explained", "ds_rms"]].agg(["mean", "count"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
