"""Which layers carry a config's held-out KL, and does the calibration objective rank them so?

Per segment of the held-out protocol (typing.py, P = 1024 quantized whole after the prefill,
N = 256 teacher-forced steps, one torch thread), the config is run with only one group of layers
quantized -- the cache's other layers hold their keys and values exactly (transformers'
``DynamicLayer``) -- and the mean KL of its decode steps against the full-precision run is
recorded, with the group's predicted damage from the config's provenance sensitivity and the
objective on the calibration capture (:func:`kverr.calibration.objective.predict`, the layer
weights of the sensitivity stored in the config).

Usage (from the repository root):
    PYTHONPATH=. python experiments/which-layers-carry-the-3-bit-kl/layers.py CONFIG OUT.csv
        [--segments 0] [--groups 0-4 5-9 ...] [--compensated-keys] [--refit]
    PYTHONPATH=. python experiments/which-layers-carry-the-3-bit-kl/layers.py CONFIG OUT.csv --predict CAPTURE
"""
from __future__ import annotations

from bench.heldout import protocol_parser, protocol_runs, record


def parse_group(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def partial_cache(model, cfg, active):
    """A :class:`~kverr.hf.KverrCache` for ``cfg`` whose layers outside ``active`` hold their
    keys and values exactly; its flush quantizes the active layers' prefills whole."""
    from transformers.cache_utils import DynamicLayer

    from kverr.hf import KverrCache

    cache = KverrCache.for_model(model, cfg)
    for i in range(len(cache.layers)):
        if i not in active:
            cache.layers[i] = DynamicLayer()
    quantized = [cache.layers[i] for i in active]

    def flush():
        for layer in quantized:
            layer._flush(respect_window=False)
            layer._undo, layer._no_undo = None, "the cache was flushed after its last update"

    cache.flush = flush
    return cache


def predicted(cfg, capture_path: str, queries: int) -> dict:
    """``{layer: (key, value)}`` predicted damage (nats) of ``cfg`` on the capture, under the layer
    weights of the sensitivity in its provenance."""
    from kverr.calibration.objective import predict
    from kverr.io import open_capture

    sens = cfg.provenance["sensitivity"]
    out = predict(open_capture(capture_path), cfg, queries=queries, weights=sens["weights_k"],
                  weights_v=sens["weights_v"])
    return {int(li): (float(k), float(v)) for li, k, v in zip(out["layers"], out["k"], out["v"])}


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--groups", nargs="+", default=[f"{a}-{a + 4}" for a in range(0, 30, 5)],
                    help="layer groups quantized one at a time, e.g. 0-4 5 6-9")
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--predict", metavar="CAPTURE", help="instead: write each layer's predicted damage on CAPTURE")
    ap.add_argument("--queries", type=int, default=64, help="query positions per layer for --predict")
    a = ap.parse_args(argv)
    if a.predict:
        import pandas as pd

        from kverr.config import CacheConfig

        cfg = CacheConfig.load(a.config)
        if a.compensated_keys:
            cfg = cfg.with_(key_rounding="compensated")
        rows = [{"config": cfg.name, "layer": li, "predicted_k": k, "predicted_v": v}
                for li, (k, v) in predicted(cfg, a.predict, a.queries).items()]
        pd.DataFrame(rows).to_csv(a.out, index=False)
        print(f"predicted total {sum(r['predicted_k'] + r['predicted_v'] for r in rows):.5g}")
        return 0
    from kverr.calibration.refit import refit_widths
    from kverr.capturing import capture
    from kverr.evaluation import compare, teacher_forced

    loaded, cfg, runs = protocol_runs(a)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    groups = [parse_group(g) for g in a.groups]
    rows: list = []
    for p, seg, off, ids, ref in runs:
        run_cfg = refit_widths(cfg, capture(loaded, ids[:p])) if a.refit else cfg
        for g in groups:
            logp = teacher_forced(loaded.model, partial_cache(loaded.model, run_cfg, g), ids, p, flush=True)
            row = {"config": name, "segment": seg, "offset": off, "layers": f"{g[0]}-{g[-1]}",
                   **compare(ref, logp, ids[p + 1:])}
            record(rows, row, a.out, f"{name} seg {seg} layers {g[0]}-{g[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
