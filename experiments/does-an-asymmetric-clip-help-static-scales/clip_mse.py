"""Squared error of static per-channel int2 scales under three clip searches, on real K and V.

Usage::

    python experiments/does-an-asymmetric-clip-help-static-scales/clip_mse.py CAPTURE.zarr [LAYER ...]

For each layer (default 3, 14, 25), pre-RoPE keys and values, with and without the Hadamard
rotation: the summed squared reconstruction error of int2 asymmetric static per-channel scales
(one scale and zero per channel over every token) with the symmetric MSE search of the default
candidates (9 ratios from 1 to 0.2), a finer symmetric search (37 ratios from 1 to 0.1) and the
asymmetric search (low and high end separately, 19 x 19 ratios from 1 to 0.1), the last two as
ratios to the first. Uses the oracle (:func:`kverr.quant.fake_quantize`).
"""

from __future__ import annotations

import sys

import torch

from kverr.io import open_capture
from kverr.quant import PerChannel, fake_quantize, int_format
from kverr.quant.formats import MSEClip


def main() -> None:
    path, *layers = sys.argv[1:]
    cap = open_capture(path)
    searches = {"sym9": MSEClip(grid=9, min_ratio=0.2), "sym37": MSEClip(grid=37, min_ratio=0.1),
                "asym19x19": MSEClip(grid=19, min_ratio=0.1, asymmetric=True)}
    print("layer tensor   rot   sym9 (sum sq err)  sym37/sym9  asym19x19/sym9")
    for layer in [int(x) for x in layers] or [3, 14, 25]:
        for name in ("k_pre", "v"):
            x = torch.as_tensor(cap[name].sel(layer=layer).values).float()
            for rot in ("none", "hadamard"):
                err = {k: float(((fake_quantize(x, int_format(2, PerChannel(None), clip=c, rotate=rot)) - x) ** 2)
                                .double().sum()) for k, c in searches.items()}
                print(f"{layer:>5} {name:<7} {rot[:4]:<5} {err['sym9']:>17.4g}  {err['sym37'] / err['sym9']:>10.3f}"
                      f"  {err['asym19x19'] / err['sym9']:>14.3f}")


if __name__ == "__main__":
    main()
