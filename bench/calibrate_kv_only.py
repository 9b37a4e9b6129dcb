"""Keys alone, values alone: how much of a calibrated config's measured KL each side causes, and
how well each sensitivity measurement predicts it.

Usage::

    python bench/calibrate_kv_only.py configs OUT_DIR
        # OUT_DIR/only{k,v}-{2.5,3}b.json: data/configs/calibrated-{2.5,3}b.json with the other
        # side kept in fp16 (then: kverr evaluate --config OUT_DIR/onlyk-3b.json ...)
    python bench/calibrate_kv_only.py ratios EVAL.segments.csv CAPTURE
        # measured mean KL of each only-k / only-v config over its segments against the objective's
        # K or V part on CAPTURE, with the configs' o_proj weights and with the kv-noise weights of
        # bench/results/calibrate-sensitivity-kv-2026-11-29.json
"""
import json
import sys
from pathlib import Path

BUDGETS = ("2.5", "3")
ROOT = Path(__file__).resolve().parents[1]


def write_configs(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for b in BUDGETS:
        c = json.loads((ROOT / f"data/configs/calibrated-{b}b.json").read_text())
        for keep, drop in (("k", "v"), ("v", "k")):
            d = json.loads(json.dumps(c))
            d["name"] = f"only{keep}-{b}b"
            d[drop] = {"dtype": "fp16"}
            for h in d["heads"].values():
                h.pop(drop, None)
            d["heads"] = {k: v for k, v in d["heads"].items() if v}
            (out / f"only{keep}-{b}b.json").write_text(json.dumps(d))
            print(out / f"only{keep}-{b}b.json")


def ratios(eval_csv: str, capture: str) -> None:
    import pandas as pd

    from kverr.calibrate import Sensitivity, predict
    from kverr.config import CacheConfig
    from kverr.io import open_capture

    ev = pd.read_csv(eval_csv).groupby("scheme").mean_kl.mean()
    cap = open_capture(capture)
    kv = Sensitivity.from_dict(json.loads((ROOT / "bench/results/calibrate-sensitivity-kv-2026-11-29.json").read_text())["kv"])
    print("config  side  measured KL  | o_proj weights: predicted, measured/predicted | kv weights: predicted, measured/predicted")
    for b in BUDGETS:
        cfg = CacheConfig.load(ROOT / f"data/configs/calibrated-{b}b.json")
        o = Sensitivity.from_dict(cfg.provenance["sensitivity"])
        po = predict(cap, cfg, queries=32, weights=o.weights_k, weights_v=o.weights_v)
        pk = predict(cap, cfg, queries=32, weights=kv.weights_k, weights_v=kv.weights_v)
        for side in ("k", "v"):
            m = float(ev[f"only{side}-{b}b"])
            a, c = float(po[side].sum()), float(pk[side].sum())
            print(f"{b:>5}b  {side.upper():>4}  {m:11.4f}  | {a:10.4g}  {m / a:5.2f} | {c:10.4g}  {m / c:5.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "configs":
        write_configs(Path(sys.argv[2]))
    else:
        ratios(sys.argv[2], sys.argv[3])
