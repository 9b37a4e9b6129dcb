"""Does adding codebook candidates move the calibration frontier? (predicted KL, in sample)

Calibrates the 4096-token pydoc capture (``bench.common.pydoc_capture(4096)``, as the committed
configs were) twice at 2.5, 3 and 4 effective bits at 1280 tokens with the ``kl`` objective and
the layer sensitivity recorded in ``data/configs/calibrated-4b.json``: once with the ``all``
candidate set, once with it plus codebook formats (Lloyd-Max levels of the normal, per token and
per 32 channels of a token, 2/3/4 bits, Hadamard-rotated with an MSE clip or an rms scale, and
unrotated with an MSE clip). Prints the predicted KL of each budget's config and which codebook
formats it chose, and writes the configs to ``out/codebooks/``::

    PYTHONPATH=. python experiments/do-codebooks-pay/frontier.py
"""

from __future__ import annotations

import collections
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


def calibration_inputs():
    """The 4096-token pydoc capture, the sensitivity recorded in ``calibrated-4b.json`` and the
    output folder ``out/codebooks`` (made), as the committed configs were calibrated."""
    from pathlib import Path

    from bench.common import ROOT, pydoc_capture
    from kverr.calibration import Sensitivity
    from kverr.config import CacheConfig

    cap = kv.open_capture(pydoc_capture(4096))
    sens = Sensitivity.from_dict(CacheConfig.load(ROOT / "data/configs/calibrated-4b.json").provenance["sensitivity"])
    out = Path("out/codebooks")
    out.mkdir(parents=True, exist_ok=True)
    return cap, sens, out


def main() -> None:
    cap, sens, out = calibration_inputs()
    base = named_candidates("all", 64)
    rows = {}
    for name, cands in (("all", base), ("all+codebooks", base + codebook_candidates())):
        t = time.time()
        cal = calibrate(cap, CalibrationConfig(budgets=BUDGETS, context=1280, cands_k=cands, cands_v=cands),
                        sensitivity=sens)
        print(f"{name}: {len(cands)} candidates, {time.time() - t:.0f} s", flush=True)
        for b, cfg in cal.configs.items():
            p = cfg.provenance
            used = collections.Counter(f.label() for _, f in cfg._all_formats() if f.is_codebook)
            rows[(name, b)] = p["predicted_damage"]
            cfg.with_(name=f"{name.replace('+', '-')}-{b:g}b").save(out / f"{name.replace('+', '-')}-{b:g}b.json")
            print(f"  {b:4g} bits: effective {p['effective_bits']:.3f}, predicted {p['predicted_damage']:.4g}, "
                  f"codebook formats chosen: {dict(used) or 'none'}", flush=True)
    for b in BUDGETS:
        a, c = rows[("all", b)], rows[("all+codebooks", b)]
        print(f"{b:4g} bits: with codebooks / without = {c / a:.3f}")


if __name__ == "__main__":
    main()
