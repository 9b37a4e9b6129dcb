"""Held out: does undoing the keys' temperature shift lower the KL?

Each kv head's quantized keys (not its sinks, window or salient rows) are read back multiplied by
``g = 1 / (1 + s·α)``, ``α`` the head's mean score regression slope on the calibration capture
(``bias.py``'s CSV, averaged over the head's query heads) and ``s`` a strength (1: undo the
measured flattening). Scaling a key scales its score, so this is a temperature per kv head for
the quantized tokens. The held-out protocol as ``bench/heldout.py`` runs it (typing.py, P = 1024,
N = 256, one torch thread), each segment with the gains off and on.

Usage (from the repository root):
    PYTHONPATH=. python experiments/are-quantized-key-scores-biased/gain.py CONFIG OUT.csv BIAS.csv \
        [--segments 0] [--strength 1] [--compensated-keys] [--refit]
"""
from __future__ import annotations

from bench.heldout import protocol_parser, protocol_runs, protocol_switch, record

STATE = {"on": False, "gain": {}}


def patch() -> None:
    import torch

    from kverr.hf import reference

    original = reference.KverrLayer._read

    def _read(self, which):
        if which == "k" and STATE["on"] and self.rows is None:
            for g in self.groups["k"]:
                gain = torch.tensor([STATE["gain"].get((self.layer_idx, h), 1.0) for h in g.heads],
                                    dtype=torch.float32)[None, :, None, None]
                for i in range(len(g.decoded), len(g.chunks)):
                    x = reference.dequantize(g.chunks[i])
                    g.decoded.append(x * gain.to(x.device))
        return original(self, which)

    reference.KverrLayer._read = _read


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("bias", help="bias.py's CSV for this config")
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--compensated-keys", action="store_true")
    ap.add_argument("--refit", action="store_true")
    a = ap.parse_args(argv)
    import pandas as pd

    alpha = pd.read_csv(a.bias).groupby(["layer", "kv_head"]).alpha.mean()
    STATE["gain"] = {(int(l), int(h)): 1.0 / (1.0 + a.strength * float(x)) for (l, h), x in alpha.items()}
    patch()
    loaded, cfg, runs = protocol_runs(a)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    rows: list = []

    def switch(on):
        STATE["on"] = on

    for seg, off, on, res in protocol_switch(loaded, cfg, runs, switch, refit=a.refit):
        record(rows, {"config": name, "segment": seg, "offset": off, "gain": on, "strength": a.strength, **res},
               a.out, f"{name} seg {seg} gain {on}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
