"""Do levels fitted to a layer beat the normal's Lloyd-Max levels? (predicted damage, in sample)

For each layer of the bundled capture and each of keys (pre-RoPE) and values, per-token codebook
formats at 2 and 3 bits (Hadamard-rotated, rms and MSE-clipped absmax scales, and unrotated with
an MSE clip): Lloyd's algorithm (:func:`kverr.quant.codebooks.lloyd_max`, unweighted, started at
the normal's levels) fitted to the layer's values over their scale, then the objective's
predicted relative damage (three layers summed) with the normal's levels, with the fitted ones,
and their ratio::

    python experiments/do-codebooks-pay/fitted_levels.py
"""

from __future__ import annotations

import dataclasses

import torch

import kverr as kv
from kverr.calibration.objective import predict
from kverr.catalog import CALIBRATION_MSE_CLIP
from kverr.config import CacheConfig, Override
from kverr.quant import PerToken, block_shape, codebook_format, fit_params, hadamard_rotate, to_blocks
from kverr.quant.codebooks import lloyd_max


def scaled_values(x: torch.Tensor, fmt) -> torch.Tensor:
    """The values of ``x [H, T, D]`` over their block's scale, as ``fmt`` computes it."""
    x4 = x[None].float()
    if fmt.rotate == "hadamard":
        x4 = hadamard_rotate(x4)
    b = to_blocks(x4, block_shape(fmt, *x.shape, 64))
    s, _ = fit_params(fmt, b)
    return b.values / s.float().clamp(min=1e-30)[..., None]


def main() -> None:
    cap = kv.open_capture("data/smollm2-pydoc-512.zarr")
    layers = list(cap.kv.layers)
    for bits in (2, 3):
        for base in (codebook_format(bits, PerToken(), rotate="hadamard", scale_stat="rms"),
                     codebook_format(bits, PerToken(), rotate="hadamard", clip=CALIBRATION_MSE_CLIP),
                     codebook_format(bits, PerToken(), clip=CALIBRATION_MSE_CLIP)):
            over = {}
            for layer in layers:
                sides = {}
                for which, var in (("k", "k_pre"), ("v", "v")):
                    x = torch.from_numpy(cap[var].sel(layer=layer).values)
                    levels = lloyd_max(scaled_values(x, base), bits, init=base.codebook_levels, iters=30)
                    sides[which] = dataclasses.replace(base, codebook=levels)
                over[layer] = Override(**sides)
            plain = CacheConfig(k=base, v=base, key_pre_rope=True)
            fitted = plain.with_(layers=over)
            a = predict(cap, plain, queries=32)
            b = predict(cap, fitted, queries=32)
            print(f"{base.label():24s} keys {a['k'].sum():.4g} -> {b['k'].sum():.4g} "
                  f"({b['k'].sum() / a['k'].sum():.3f}), values {a['v'].sum():.4g} -> {b['v'].sum():.4g} "
                  f"({b['v'].sum() / a['v'].sum():.3f})", flush=True)


if __name__ == "__main__":
    main()
