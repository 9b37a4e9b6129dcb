"""A config with its salient rows changed: ``--salient N --salient-recent R`` (N rows per
(layer, kv head, K|V), the prompt's last R tokens among them), written to OUT; prints the
effective bits of both at the held-out protocol (``--context`` tokens, static bytes shared by
``--batch`` sequences, the prompt quantized whole), so that a config calibrated a few
hundredths of a bit low can be given the prompt's tail and compared at equal bits.

Usage (from the repository root): PYTHONPATH=. python experiments/does-the-prompt-s-tail-pay-as-int8-rows/with_rows.py
    CONFIG OUT --salient 12 --salient-recent 4 [--name NAME]
"""
from __future__ import annotations

import argparse

from bench.heldout import DECODE, PREFILL
from kverr.config import resolve
from kverr.memory import account, model_shape


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--salient", type=int, required=True)
    ap.add_argument("--salient-recent", type=int, required=True)
    ap.add_argument("--name", default=None, help="the new config's name (default: CONFIG's, +xNrR)")
    ap.add_argument("--context", type=int, default=PREFILL + DECODE)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args(argv)
    cfg = resolve(a.config)
    new = cfg.with_(salient=a.salient, salient_recent=a.salient_recent,
                    name=a.name or f"{cfg.name}+x{a.salient}r{a.salient_recent}")
    new.save(a.out)
    for c in (cfg, new):
        bits = account(c, model_shape("default"), a.context, batch=a.batch,
                       prefill_quantized=PREFILL).effective_bits
        print(f"{c.name}: salient {c.salient}, recent {c.salient_recent}, {bits:.4f} bits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
