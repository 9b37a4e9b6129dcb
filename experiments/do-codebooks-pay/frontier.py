"""Does adding codebook candidates move the calibration frontier? (predicted damage, in sample)

Calibrates the bundled 512-token capture twice at 2.5, 3 and 4 effective bits with the ``rel``
objective (unweighted relative attention-output error, no model needed): once with the ``all``
candidate set, once with it plus codebook formats (Lloyd-Max levels of the normal, per token and
per 32 channels of a token, 2/3/4 bits, Hadamard-rotated with an MSE clip or an rms scale, and
unrotated with an MSE clip). Prints the predicted damage of each budget's config and which
codebook formats it chose::

    python experiments/do-codebooks-pay/frontier.py
"""

from __future__ import annotations

import collections
import sys
import time

import kverr as kv
from kverr.calibration.candidates import named_candidates
from kverr.calibration.config import CalibrationConfig
from kverr.calibration.search import calibrate
from kverr.catalog import CALIBRATION_MSE_CLIP
from kverr.quant import PerToken, PerTokenGroup, codebook_format

BUDGETS = (2.5, 3.0, 4.0)


def codebook_candidates():
    out = []
    for bits in (2, 3, 4):
        for g in (PerToken(), PerTokenGroup(32)):
            out += [codebook_format(bits, g, rotate="hadamard", clip=CALIBRATION_MSE_CLIP),
                    codebook_format(bits, g, rotate="hadamard", scale_stat="rms"),
                    codebook_format(bits, g, clip=CALIBRATION_MSE_CLIP)]
    return tuple(out)


def main(path: str = "data/smollm2-pydoc-512.zarr") -> None:
    cap = kv.open_capture(path)
    base = named_candidates("all", 64)
    rows = {}
    for name, cands in (("all", base), ("all+codebooks", base + codebook_candidates())):
        t = time.time()
        cal = calibrate(cap, CalibrationConfig(budgets=BUDGETS, objective="rel", cands_k=cands, cands_v=cands,
                                               queries=32))
        print(f"{name}: {len(cands)} candidates, {time.time() - t:.0f} s", flush=True)
        for b, cfg in cal.configs.items():
            p = cfg.provenance
            used = collections.Counter(f.label() for _, f in cfg._all_formats() if f.is_codebook)
            rows[(name, b)] = p["predicted_damage"]
            print(f"  {b:4g} bits: effective {p['effective_bits']:.3f}, predicted {p['predicted_damage']:.4g}, "
                  f"codebook formats chosen: {dict(used) or 'none'}", flush=True)
    for b in BUDGETS:
        a, c = rows[("all", b)], rows[("all+codebooks", b)]
        print(f"{b:4g} bits: with codebooks / without = {c / a:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
