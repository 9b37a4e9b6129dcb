"""Held-out acceptance of calibrated configs, and how well the objective predicts measured KL.

Usage::

    python bench/calibrate_heldout.py EVAL.csv [EVAL2.csv ...] --capture /tmp/kv/pydoc-4096.zarr \\
        --config data/configs/calibrated-2.5b.json ... --out-prefix bench/results/calibrate-heldout \\
        [--segment 0] [--weights-from data/configs/calibrated-4b.json]

``EVAL.csv`` is the summary CSV of ``kverr evaluate`` on a text the configs were NOT calibrated
on (one row per scheme; effective bits counted at prefill + decode tokens), or its per-segment
CSV with ``--segment`` choosing one segment (or ``--segment all``: mean over the segments each
scheme has); several CSVs are concatenated. For every scheme the script computes the calibration
objective (:func:`kverr.calibration.predict`) of the config that scheme stores (quanto peers:
:meth:`kverr.evaluation.Scheme.equivalent_config`) on the calibration capture -- the ``kl``
objective (predicted KL in nats) with the layer sensitivities recorded in the provenance of
``--weights-from``, else the equal-weight ``rel`` objective -- then writes

* ``<prefix>-predicted-vs-measured.csv``: scheme, effective bits, predicted damage, mean KL, top-1;
* ``<prefix>-acceptance.md``: the table, per budget whether the calibrated config has a lower mean
  KL than every preset/peer at equal or higher effective bits, per preset/peer whether a calibrated
  config at equal or fewer effective bits has a lower mean KL, the acceptance targets, and the
  Spearman (and Kendall) rank correlation between predicted damage and measured mean KL.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_csv", nargs="+")
    ap.add_argument("--segment", help="per-segment CSV input: a segment number, or 'all' (mean)")
    ap.add_argument("--weights-from", help="a calibrated config whose provenance holds the layer sensitivities")
    ap.add_argument("--capture", required=True)
    ap.add_argument("--config", action="append", default=[], help="calibrated config JSON (repeat)")
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--out-prefix", required=True)
    ap.add_argument("--command", default="", help="the evaluate command, recorded in the report")
    ap.add_argument("--predicted-cache", help="CSV of predicted damage per scheme, reused if present")
    args = ap.parse_args()

    import pandas as pd
    import torch
    from scipy.stats import kendalltau, spearmanr

    torch.set_num_threads(1)
    from kverr.calibration import predict
    from kverr.config import PRESETS, CacheConfig
    from kverr.evaluation import PEERS, Scheme
    from kverr.io import open_capture

    ev = pd.concat([pd.read_csv(p) for p in args.eval_csv], ignore_index=True)
    if args.segment is not None:
        if args.segment != "all":
            ev = ev[ev["segment"] == int(args.segment)]
        ev = ev.groupby("scheme", sort=False).agg(
            effective_bits=("effective_bits", "first"), mean_kl=("mean_kl", "mean"), top1=("top1", "mean"),
            ppl_delta=("ppl_delta", "mean"), segments=("segment", "nunique")).reset_index()
    weights, weights_v, objective = None, None, "rel_attn_out_sq"
    if args.weights_from:
        from kverr.calibration import Sensitivity

        sens = Sensitivity.from_dict(CacheConfig.load(args.weights_from).provenance["sensitivity"])
        weights, weights_v, objective = sens.weights_k, sens.weights_v, "predicted_kl"
    cap = open_capture(args.capture)
    cfgs = {c.name: c for c in (CacheConfig.load(p) for p in args.config)}
    cache = {}
    if args.predicted_cache and Path(args.predicted_cache).exists():
        cache = {r.scheme: r._asdict() for r in pd.read_csv(args.predicted_cache).itertuples(index=False)}
    rows, fresh = [], []
    for _, r in ev.iterrows():
        name = r["scheme"]
        if name in cfgs:
            cfg, kind = cfgs[name], "calibrated"
        elif name in PRESETS:
            cfg, kind = PRESETS[name], "preset"
        elif name in PEERS:
            cfg, kind = Scheme(name, "quanto", nbits=PEERS[name]).equivalent_config(torch.float32), "peer"
        else:
            continue
        if name not in cache:
            p = predict(cap, cfg, queries=args.queries, weights=weights, weights_v=weights_v)
            cache[name] = dict(scheme=name, predicted=p["total"], predicted_k=float(p["k"].sum()),
                               predicted_v=float(p["v"].sum()))
            fresh.append(cache[name])
        c = cache[name]
        rows.append(dict(scheme=name, kind=kind, effective_bits=r["effective_bits"], predicted=c["predicted"],
                         predicted_k=c["predicted_k"], predicted_v=c["predicted_v"],
                         mean_kl=r["mean_kl"], top1=r["top1"], ppl_delta=r.get("ppl_delta", float("nan")),
                         segments=int(r.get("segments", 1))))
    if args.predicted_cache and fresh:
        pd.DataFrame(list(cache.values())).to_csv(args.predicted_cache, index=False)
    t = pd.DataFrame(rows).sort_values("effective_bits").reset_index(drop=True)
    t.to_csv(f"{args.out_prefix}-predicted-vs-measured.csv", index=False)
    rho, p_rho = spearmanr(t["predicted"], t["mean_kl"])
    tau, p_tau = kendalltau(t["predicted"], t["mean_kl"])
    others = t[t.kind != "calibrated"]
    lines = [
        "# Held-out acceptance of calibrated configs (kverr calibrate -> kverr evaluate)",
        f"# date: {dt.date.today()}  machine: {platform.node()} ({os.cpu_count()} cpus, shared)",
        f"# calibration capture: {args.capture}",
        f"# evaluation: {args.command or ' '.join(args.eval_csv)}"
        + (f" (segment {args.segment})" if args.segment is not None else ""),
        f"# objective: {objective}" + (f" (layer sensitivities from {args.weights_from})" if weights is not None else ""),
        "# effective bits counted at prefill + decode tokens (metadata, window, pages included)",
        "",
        "| scheme | kind | effective bits | mean KL | top-1 | predicted | segments |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for _, r in t.iterrows():
        lines.append(f"| {r.scheme} | {r.kind} | {r.effective_bits:.3f} | {r.mean_kl:.5f} | {r.top1:.4f} "
                     f"| {r.predicted:.4g} | {r.segments} |")
    lines += ["", "## Calibrated vs every preset/peer at equal or higher effective bits", ""]
    for _, c in t[t.kind == "calibrated"].iterrows():
        rivals = others[others.effective_bits >= c.effective_bits - 1e-9]
        lost = rivals[rivals.mean_kl <= c.mean_kl]
        verdict = "YES" if lost.empty else "NO (not below: " + ", ".join(
            f"{s.scheme} {s.effective_bits:.2f} b KL {s.mean_kl:.5f}" for _, s in lost.iterrows()) + ")"
        lines.append(f"- {c.scheme} ({c.effective_bits:.3f} b, KL {c.mean_kl:.5f}) vs {len(rivals)} schemes "
                     f"with >= bits: {verdict}")
    lines += ["", "## Every preset/peer vs the calibrated configs at equal or fewer effective bits", "",
              "(Each preset or peer against every calibrated config that spends no more bits than it: is "
              "one of them below it in mean KL? Calibrating at a preset's own effective bits makes the "
              "comparison at equal memory.)", ""]
    cal = t[t.kind == "calibrated"]
    for _, s in others.iterrows():
        cheaper = cal[cal.effective_bits <= s.effective_bits + 1e-9]
        best = cheaper.loc[cheaper.mean_kl.idxmin()] if not cheaper.empty else None
        if best is None:
            verdict = "no calibrated config at <= its bits"
        else:
            verdict = ("BEATEN" if best.mean_kl < s.mean_kl else "NOT BEATEN") + (
                f" by {best.scheme} ({best.effective_bits:.3f} b, KL {best.mean_kl:.5f})")
        lines.append(f"- {s.scheme} ({s.effective_bits:.2f} b, KL {s.mean_kl:.5f}): {verdict}")
    lines += ["", "## Targets", ""]
    for lim, kl, top in ((4.5, 0.002, 0.98), (3.0, 0.02, 0.93)):
        for _, c in t[(t.kind == "calibrated") & (t.effective_bits <= lim + 1e-9)].iterrows():
            ok = c.mean_kl <= kl and c.top1 >= top
            lines.append(f"- <= {lim} b target (KL <= {kl}, top-1 >= {top}): {c.scheme} KL {c.mean_kl:.5f}, "
                         f"top-1 {c.top1:.4f} -> {'MET' if ok else 'MISSED'}")
    lines += ["", "## Does the objective predict measured KL?", "",
              f"Spearman rho = {rho:.3f} (p = {p_rho:.2g}), Kendall tau = {tau:.3f} (p = {p_tau:.2g}) "
              f"over {len(t)} schemes (predicted damage on the calibration capture, {args.queries} "
              "queries/layer, vs measured mean KL on the held-out text)."]
    Path(f"{args.out_prefix}-acceptance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
