"""Would non-uniform codebooks help static per-channel scales? Squared error of a per-(head,
channel) Lloyd-Max codebook (2^b levels, 1-D k-means over all tokens: what a KVQuant-style "nuq"
format with static per-channel levels would store) against the best uniform asymmetric grid
(each end of the range shrunk independently over a 24 x 24 grid of ratios 1 .. 0.2: a stronger
search than the candidates' symmetric 9-ratio one), on the default model's keys (pre-RoPE) and
values, with and without a Hadamard rotation.

Usage: python bench/calibrate_static_codebook_mse.py CAPTURE   (e.g. /tmp/kv/pydoc-4096.zarr)
"""
import sys

import numpy as np
from scipy.linalg import hadamard

from kverr.io import open_capture
#: Hadamard rotation of a 64-channel head (orthonormal).
HADAMARD_64 = hadamard(64) / 8.0


def uniform_best(x: np.ndarray, bits: int, grid: int = 24) -> float:
    """Least total squared error of per-row asymmetric uniform quantization of ``x [rows, T]``, the
    low and high end of each row's range shrunk independently towards its middle (``grid`` ratios
    from 1 to 0.2 each)."""
    lo0, hi0 = x.min(1, keepdims=True), x.max(1, keepdims=True)
    levels = 2**bits - 1
    mid = (lo0 + hi0) / 2
    best = np.full(x.shape[0], np.inf)
    for a in np.linspace(1.0, 0.2, grid):
        for b in np.linspace(1.0, 0.2, grid):
            lo, hi = mid + (lo0 - mid) * a, mid + (hi0 - mid) * b
            step = np.maximum(hi - lo, 1e-12) / levels
            q = np.clip(np.round((x - lo) / step), 0, levels) * step + lo
            best = np.minimum(best, ((q - x) ** 2).sum(1))
    return float(best.sum())


def lloyd(x: np.ndarray, bits: int, iters: int = 40) -> float:
    """Total squared error of a per-row Lloyd-Max codebook of ``2**bits`` levels (1-D k-means from
    quantile starts, ``iters`` rounds) for ``x [rows, T]``."""
    k = 2**bits
    levels = np.quantile(x, (np.arange(k) + 0.5) / k, axis=1).T  # [rows, k]
    for _ in range(iters + 1):
        mids = (levels[:, 1:] + levels[:, :-1]) / 2
        idx = (x[:, :, None] > mids[:, None, :]).sum(-1)  # nearest level of every element
        if _ == iters:
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
                    u, lo = uniform_best(rows, bits), lloyd(rows, bits)
                    print(f"layer {layer:2d} {var:5s} {rot:4s} int{bits}: ratio {lo / u:.3f}", flush=True)


if __name__ == "__main__":
    main()
