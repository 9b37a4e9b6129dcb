"""Keys alone, values alone: how much of a calibrated config's measured KL each side causes, and
how well each sensitivity measurement predicts it.

Usage::

    python experiments/do-key-errors-cost-more-than-predicted/kv_only.py configs OUT_DIR CONFIG.json ...
        # OUT_DIR/only{k,v}-<name>.json for each config (<name>: its name without "calibrated-"):
        # the config with the other side kept in fp16 (then: kverr evaluate --config ...)
    python experiments/do-key-errors-cost-more-than-predicted/kv_only.py ratios EVAL.segments.csv CAPTURE CONFIG.json ...
        # measured mean KL of each only-k / only-v config over its segments against the objective's
        # K or V part on CAPTURE, with the config's own (o_proj) weights and with the kv-noise
        # weights of bench/results/calibrate-sensitivity-kv-2026-11-29.json

The committed rows: ``configs`` / ``ratios`` of data/configs/calibrated-{2.5,3}b.json on
bench/results/eval/calibrate-kv-only-argparse.segments.csv, and of the 4.5-bit configs of
``--candidates all`` (static-all-4.5b) and of the default on
bench/results/eval/calibrate-static-kv-only-argparse-4.5b.segments.csv.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def short(name: str) -> str:
    return name.removeprefix("calibrated-")


def write_configs(out: Path, paths: list[str]) -> None:
    from kverr.config import CacheConfig, Override
    from kverr.quant import float_format

    out.mkdir(parents=True, exist_ok=True)
    fp16 = float_format("fp16")
    for p in paths:
        cfg = CacheConfig.load(p)
        for keep, drop in (("k", "v"), ("v", "k")):
            heads = {h: Override(**{keep: getattr(o, keep)}) for h, o in cfg.heads.items() if getattr(o, keep)}
            one = cfg.with_(**{drop: fp16}, heads=heads, name=f"only{keep}-{short(cfg.name)}")
            print(one.save(out / f"{one.name}.json"))


def ratios(eval_csv: str, capture: str, paths: list[str]) -> None:
    import numpy as np
    import pandas as pd

    from kverr.calibration import Sensitivity, predict
    from kverr.config import CacheConfig
    from kverr.io import open_capture

    ev = pd.read_csv(eval_csv).groupby("scheme").mean_kl.mean()
    cap = open_capture(capture)
    kv = Sensitivity.from_dict(json.loads((ROOT / "bench/results/calibrate-sensitivity-kv-2026-11-29.json").read_text())["kv"])
    print("config  side  measured KL  | o_proj weights: predicted, measured/predicted | kv weights: predicted, measured/predicted")
    for p in paths:
        cfg = CacheConfig.load(p)
        own = Sensitivity.from_dict(cfg.provenance["sensitivity"])
        rel = predict(cap, cfg, queries=32)  # unweighted per-layer parts, weighted below both ways
        for side, wo, wk in (("k", own.weights_k, kv.weights_k), ("v", own.weights_v, kv.weights_v)):
            m = float(ev[f"only{side}-{short(cfg.name)}"])
            a, c = float(np.dot(rel[side], wo[rel["layers"]])), float(np.dot(rel[side], wk[rel["layers"]]))
            print(f"{short(cfg.name):>14}  {side.upper():>4}  {m:11.4g}  | {a:10.4g}  {m / a:5.2f} | {c:10.4g}  {m / c:5.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "configs":
        write_configs(Path(sys.argv[2]), sys.argv[3:])
    else:
        ratios(sys.argv[2], sys.argv[3], sys.argv[4:])
