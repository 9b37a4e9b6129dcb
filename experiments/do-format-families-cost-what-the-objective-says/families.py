"""Do the format families of a config cost, held out, what the calibration objective predicts?

A config's (layer, kv head, K|V) groups are split into families by their format: keys with
fitted per-channel widths (``k:widths``) and the other keys (``k:other``); values with static
per-channel scales (``v:static``) and the other values (``v:dynamic``: per-token scales and
codebooks); the other keys split further by their scales (``k:other/static``,
``k:other/dynamic``). Per family, the config is run with only that family's groups quantized -- every
other group holds the ``fp32`` format, so it keeps the values the cache receives (with an int8
window, its int8 rows) -- through the held-out protocol (typing.py, P = 1024 quantized whole
after the prefill, N = 256 teacher-forced steps, one torch thread), and the mean KL of the decode
steps recorded. With ``--predict CAPTURE`` the objective's damage of each family instead
(:func:`kverr.calibration.objective.predict`, the layer weights of the sensitivity stored in the
config): two configs, each with one key family and one value family quantized, give all four,
the objective's key and value damage being sums over kv heads.

Usage (from the repository root):
    PYTHONPATH=. python experiments/do-format-families-cost-what-the-objective-says/families.py CONFIG OUT.csv
        [--segments 0] [--families k:widths k:other v:static v:dynamic] [--compensated-keys] [--refit]
    PYTHONPATH=. python experiments/do-format-families-cost-what-the-objective-says/families.py CONFIG OUT.csv
        --predict CAPTURE [--queries 64]
"""
from __future__ import annotations

from bench.heldout import protocol_parser, protocol_runs, record

FAMILIES = ("k:widths", "k:other", "v:static", "v:dynamic")
SUBFAMILIES = ("k:other/static", "k:other/dynamic")


def family(which: str, fmt) -> str:
    """The family of a group whose side ``which`` holds ``fmt``."""
    from kverr.quant.formats import is_static

    if which == "k":
        return "k:widths" if fmt.channel_bits is not None else "k:other"
    return "v:static" if not fmt.is_float and is_static(fmt.granularity) else "v:dynamic"


def subfamily(which: str, fmt) -> str:
    """The family of a group, with the other keys split by their scales: ``k:other/static``
    (static per-channel integer scales) and ``k:other/dynamic`` (the rest)."""
    from kverr.quant.formats import is_static

    fam = family(which, fmt)
    if fam != "k:other":
        return fam
    return "k:other/static" if not fmt.is_float and is_static(fmt.granularity) else "k:other/dynamic"


def kept(keep: set[str], layer: int, which: str, fmt) -> bool:
    """Whether a group is in one of the families ``keep``; a family written ``FAM@LO-HI`` counts
    only in layers ``LO`` to ``HI``."""
    for token in keep:
        fam, _, span = token.partition("@")
        if span:
            lo, hi = (int(x) for x in span.split("-"))
            if not lo <= layer <= hi:
                continue
        if fam in (family(which, fmt), subfamily(which, fmt)):
            return True
    return False


def only(cfg, n_layers: int, n_kv: int, keep: set[str]):
    """``cfg`` with the groups outside the families ``keep`` (:func:`kept`) in the ``fp32``
    format, windows kept."""
    from kverr.config import Override
    from kverr.quant.formats import float_format

    fp32 = float_format("fp32")
    heads = {}
    for li in range(n_layers):
        for h in range(n_kv):
            fmts = {w: cfg.format_for(li, h, w) for w in "kv"}
            fmts = {w: f if kept(keep, li, w, f) else fp32 for w, f in fmts.items()}
            heads[(li, h)] = Override(k=fmts["k"], v=fmts["v"], k_window=cfg.window_for(li, h, "k"),
                                      v_window=cfg.window_for(li, h, "v"))
    return cfg.with_(heads=heads, layers={}, name=f"{cfg.name}[{'+'.join(sorted(keep))}]")


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES),
                    help=f"the families quantized, one run each: {', '.join(FAMILIES)} (or the other keys split, "
                         f"{', '.join(SUBFAMILIES)}; FAM@LO-HI: in layers LO to HI only), several joined by '+', "
                         "all (the config itself) or none (every group fp32)")
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--predict", metavar="CAPTURE", help="instead: write each family's predicted damage on CAPTURE")
    ap.add_argument("--queries", type=int, default=64, help="query positions per layer for --predict")
    a = ap.parse_args(argv)
    bad = {f.partition("@")[0] for fam in a.families for f in fam.split("+")} - {*FAMILIES, *SUBFAMILIES, "all", "none"}
    if bad:
        ap.error(f"unknown families {sorted(bad)}; choose from {', '.join((*FAMILIES, *SUBFAMILIES))}, all, none")
    from kverr.config import CacheConfig
    from kverr.memory import model_shape

    shape = model_shape("default")
    if a.predict:
        import pandas as pd

        from kverr.calibration.objective import predict
        from kverr.io import open_capture

        cfg = CacheConfig.load(a.config)
        if a.compensated_keys:
            cfg = cfg.with_(key_rounding="compensated")
        sens = cfg.provenance["sensitivity"]
        capture = open_capture(a.predict)
        rows = []
        for keep in ({"k:widths", "v:static"}, {"k:other", "v:dynamic"}):
            out = predict(capture, only(cfg, shape.n_layers, shape.n_kv_heads, keep), queries=a.queries,
                          weights=sens["weights_k"], weights_v=sens["weights_v"])
            for fam in sorted(keep):
                rows.append({"config": cfg.name, "family": fam, "predicted": float(out[fam[0]].sum())})
                print(f"{fam}: predicted {rows[-1]['predicted']:.5g}", flush=True)
            pd.DataFrame(rows).to_csv(a.out, index=False)
        return 0
    from kverr.calibration.refit import refit_widths
    from kverr.capturing import capture
    from kverr.evaluation import compare, teacher_forced
    from kverr.hf import KverrCache

    loaded, cfg, runs = protocol_runs(a)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    rows: list = []
    for p, seg, off, ids, ref in runs:
        run_cfg = refit_widths(cfg, capture(loaded, ids[:p])) if a.refit else cfg
        for fam in a.families:
            keep = set(FAMILIES) if fam == "all" else set() if fam == "none" else set(fam.split("+"))
            part = only(run_cfg, shape.n_layers, shape.n_kv_heads, keep)
            logp = teacher_forced(loaded.model, KverrCache.for_model(loaded.model, part), ids, p, flush=True)
            row = {"config": name, "segment": seg, "offset": off, "family": fam, **compare(ref, logp, ids[p + 1:])}
            record(rows, row, a.out, f"{name} seg {seg} {fam}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
