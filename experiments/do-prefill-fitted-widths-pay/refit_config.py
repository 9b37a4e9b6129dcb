"""The committed fitted configs, as calibrated and with their widths refit on each segment's
prompt (:func:`kverr.calibration.refit.refit_widths`, what ``kverr evaluate --refit-widths``
does), scored with the calibration objective on the decode queries that follow the prompt.

Per segment capture: the config refit on its first ``P`` tokens, then both configs' key and
value damage on the queries at positions ``P ..`` (decode steps after a prompt quantized whole;
each config's sinks, window and RoPE side; static scales fitted on the whole segment), weighted
by the config's own layer sensitivities into predicted KL.

Usage: python refit_config.py CONFIG SEGMENT_CAPTURE... [--prefill 1024]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from kverr.calibration.candidates import OuterOption
from kverr.calibration.objective import key_damage, key_error, value_damage, value_error
from kverr.calibration.refit import refit_widths
from kverr.config import CacheConfig
from kverr.io import open_capture
from prefill_fit import _decode_prep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("segments", nargs="+")
    ap.add_argument("--prefill", type=int, default=1024)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    cfg = CacheConfig.load(a.config)
    sens = cfg.provenance["sensitivity"]
    wk, wv = np.asarray(sens["weights_k"]), np.asarray(sens["weights_v"])
    print("segment  calibrated K, V  ->  refit K, V (predicted KL)")
    for path in a.segments:
        cap = open_capture(path)
        new = refit_widths(cfg, cap.isel(token=slice(0, a.prefill)))
        tot = {"calibrated": np.zeros(2), "refit": np.zeros(2)}
        for layer in range(cap.sizes["layer"]):
            ps = _decode_prep(cap, layer, a.prefill)
            for name, c in (("calibrated", cfg), ("refit", new)):
                opt = OuterOption(window=c.window, sinks=c.sinks, key_pre_rope=c.key_pre_rope)
                base = c.with_(window=0, sinks=0, provenance={})
                tot[name] += [wk[layer] * key_damage(ps, key_error(ps, base), [opt])[0].sum(),
                              wv[layer] * value_damage(ps, value_error(ps, base), [opt])[0].sum()]
        c, r = tot["calibrated"], tot["refit"]
        print(f"{path}  {c[0]:.5f}, {c[1]:.5f}  ->  {r[0]:.5f}, {r[1]:.5f}  ({r.sum() / c.sum():.3f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
