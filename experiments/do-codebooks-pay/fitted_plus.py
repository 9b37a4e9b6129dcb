"""Codebook candidates beside the fitted per-channel widths: calibrate at 2, 2.5 and 3 bits.

As ``kverr calibrate --candidates fitted --context 1280`` made ``data/configs/fitted-{2,2.5,3}b.json``
(4096 tokens of pydoc, the ``kl`` objective with the sensitivity recorded in
``data/configs/calibrated-4b.json``), with the codebook candidates of ``frontier.py`` added.
Writes ``out/codebooks/fitted-codebooks-<b>b.json`` and prints predicted KL and time::

    PYTHONPATH=. python experiments/do-codebooks-pay/fitted_plus.py
"""

from __future__ import annotations

import collections
import time

from kverr.calibration.candidates import named_candidates
from kverr.calibration.config import CalibrationConfig
from kverr.calibration.search import calibrate

from frontier import calibration_inputs, codebook_candidates

BUDGETS = (2.0, 2.5, 3.0)


def main() -> None:
    cap, sens, out = calibration_inputs()
    cands = named_candidates("fitted", 64) + codebook_candidates()
    t = time.time()
    cal = calibrate(cap, CalibrationConfig(budgets=BUDGETS, context=1280, cands_k=cands, cands_v=cands),
                    sensitivity=sens)
    print(f"fitted+codebooks: {len(cands)} candidates, {time.time() - t:.0f} s", flush=True)
    for b, cfg in cal.configs.items():
        p = cfg.provenance
        used = collections.Counter(f.label() for _, f in cfg._all_formats() if f.is_codebook)
        print(f"  {b:4g} bits: effective {p['effective_bits']:.3f}, predicted {p['predicted_damage']:.4g}, "
              f"outer {p['outer_option']}, codebook formats: {dict(used) or 'none'}", flush=True)
        cfg.with_(name=f"fitted-codebooks-{b:g}b").save(out / f"fitted-codebooks-{b:g}b.json")


if __name__ == "__main__":
    main()
