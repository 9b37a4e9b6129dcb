"""Would non-uniform codebooks help static per-channel scales? Squared error of a per-(head,
channel) Lloyd-Max codebook (2^b levels, 1-D k-means over all tokens: what a KVQuant-style "nuq"
format with static per-channel levels would store) against the best uniform asymmetric grid
(kverr's asymmetric MSE clip search through the oracle: each end of the range shrunk
independently over a 24 x 24 grid of ratios 1 .. 0.2, a stronger search than the candidates'
symmetric 9-ratio one; scales and zero points stored in fp16 as the formats do), on the default
model's keys (pre-RoPE) and values, with and without a Hadamard rotation.

Usage: python experiments/would-nonuniform-codebooks-help-static-scales/codebook_mse.py CAPTURE   (the 4096-token pydoc capture)
"""
import sys

import numpy as np
import torch
from scipy.linalg import hadamard

from kverr.io import open_capture
from kverr.quant import PerChannel, fake_quantize, int_format
from kverr.quant.formats import MSEClip

#: Hadamard rotation of a 64-channel head (orthonormal; the Lloyd side, the uniform side uses kverr's).
HADAMARD_64 = hadamard(64) / 8.0

#: The uniform side: kverr's asymmetric MSE clip search, each end of the range shrunk towards the
#: middle by its own ratio, 24 x 24 ratios from 1 to 0.2 (a stronger search than the candidates').
UNIFORM_CLIP = MSEClip(grid=24, min_ratio=0.2, asymmetric=True)


def uniform_best(x: torch.Tensor, bits: int, rotate: str) -> float:
    """Total squared error of int``bits`` static per-channel scales with :data:`UNIFORM_CLIP`
    (the oracle, :func:`kverr.quant.fake_quantize`) for ``x [kv_head, T, D]``."""
    fmt = int_format(bits, PerChannel(None), clip=UNIFORM_CLIP, rotate=rotate)
    return float(((fake_quantize(x, fmt) - x) ** 2).double().sum())


def lloyd(x: np.ndarray, bits: int, iters: int = 40) -> float:
    """Total squared error of a per-row Lloyd-Max codebook of ``2**bits`` levels (1-D k-means from
    quantile starts, ``iters`` rounds) for ``x [rows, T]``."""
    k = 2**bits
    levels = np.quantile(x, (np.arange(k) + 0.5) / k, axis=1).T  # [rows, k]
    for it in range(iters + 1):
        mids = (levels[:, 1:] + levels[:, :-1]) / 2
        idx = (x[:, :, None] > mids[:, None, :]).sum(-1)  # nearest level of every element
        if it == iters:
            break
        for j in range(k):
            m = idx == j
            n = m.sum(1)
            levels[:, j] = np.where(n > 0, (x * m).sum(1) / np.maximum(n, 1), levels[:, j])
        levels.sort(1)
    q = np.take_along_axis(levels, idx, 1)
    return float(((q - x) ** 2).sum())


def main() -> None:
    cap = open_capture(sys.argv[1])
    print(f"# {sys.argv[1]}; ratio = Lloyd-Max squared error / best asymmetric uniform grid's (< 1: codebook better)")
    for layer in (3, 14, 25):
        for var in ("k_pre", "v"):
            x = cap[var].isel(layer=layer).values.astype(np.float64)  # kv, T, D
            for rot in ("none", "H"):
                y = x @ HADAMARD_64 if rot == "H" else x
                rows = y.transpose(0, 2, 1).reshape(-1, y.shape[1])  # [kv*D, T]
                for bits in (2, 3):
                    u = uniform_best(torch.as_tensor(x, dtype=torch.float32), bits, "hadamard" if rot == "H" else "none")
                    lo = lloyd(rows, bits)
                    print(f"layer {layer:2d} {var:5s} {rot:4s} int{bits}: ratio {lo / u:.3f}", flush=True)


if __name__ == "__main__":
    main()
