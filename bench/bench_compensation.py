"""Benchmark: the factors of compensated key rounding against the textbook formula.

Rounding keys with error compensation (:mod:`kverr.quant.compensated`) needs, per token stored
before RoPE, the upper Cholesky factor ``U`` of the damped inverse cost: ``Uᵀ U = (C_t + λI)⁻¹``.
The calibrator computes one per token, kv head and (rotation, channels without bits) of its key
candidates, and that dominated the time it took to score them. The textbook formula takes three
factorizations of all tokens at once: ``cholesky``, ``cholesky_inverse``, then ``cholesky`` of the
inverse. :func:`~kverr.quant.compensated.compensation_factor` takes one factorization and one
triangular inverse, on a few hundred matrices at a time.

The cost of each token, ``C_t = P_t Σ P_tᵀ`` (:func:`~kverr.quant.compensated.turned_cost`), has
two terms per row of ``P_t``; the library forms it elementwise, in ``O(D²)`` per token. This prints
its time against two batched ``D³`` products, their largest difference and how many code bytes of
the two formats below differ between factors made from each.

For 3 kv heads of pre-RoPE costs (a synthetic query moment turned to each position, head dim 64)
this prints, for a plain format and a Hadamard-rotated one with a quarter of its channels without
bits:

- both times, measured in the same run, and their ratio;
- the largest difference between the two ``U``, relative to the largest element;
- how many bytes of packed codes of random keys differ between the two.

Usage::

    python -m bench.run compensation            # 4096 tokens
    python -m bench.run compensation --quick    # 512 tokens
"""

from __future__ import annotations

import dataclasses
import math
import time


def _textbook(C, fmt, damp):
    """Order and U by the textbook formula: everything for all tokens at once, the inverse formed."""
    import torch

    from kverr.quant import hadamard_rotate
    from kverr.quant.compensated import _zeros

    D = C.shape[-1]
    if fmt.rotate == "hadamard":
        A = hadamard_rotate(torch.eye(D)).double()
        C = A.T @ C @ A
    zeros = torch.tensor(_zeros(fmt, D))
    diag = C.diagonal(dim1=-2, dim2=-1)
    order = torch.argsort(torch.where(zeros, math.inf, diag), dim=-1, descending=True, stable=True)
    flat = (order[..., :, None] * D + order[..., None, :]).reshape(*order.shape[:-1], D * D)
    C = C.reshape(*C.shape[:-2], D * D).gather(-1, flat).reshape(C.shape)
    mean = diag.mean(-1)
    lam = torch.where(mean > 0, damp * mean, torch.ones_like(mean))
    Cd = C + lam[..., None, None] * torch.eye(D, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Cd)), upper=True)
    return order, U


def _turned_by_products(moment, cos, sin):
    """``C_t = P_t Σ P_tᵀ`` by two batched D³ products, ``P_t`` formed whole (rows ``R_t e_j``)."""
    import torch

    from kverr.rope import rotate

    T, D = cos.shape
    P = rotate(torch.eye(D).expand(T, D, D), cos.float()[:, None, :], sin.float()[:, None, :]).double()
    return P @ moment.double()[..., None, :, :] @ P.transpose(-1, -2)


def measure(quick: bool) -> list:
    """Registry entry: the library's factor against the textbook one, same costs, same run."""
    import torch

    from bench.common import Row
    from kverr.quant import PerChannel, int_format
    from kverr.quant.compensated import DAMP, compensated_quantize, compensation_factor, turned_cost
    from kverr.rope import default_inv_freq, rope_cos_sin

    torch.set_num_threads(1)
    T, D, H = (512 if quick else 4096), 64, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(H, 2048, D, generator=g, dtype=torch.float64) @ torch.randn(D, D, generator=g, dtype=torch.float64)
    moment = q.transpose(-1, -2) @ q / q.shape[1]
    cos, sin = rope_cos_sin(torch.arange(T), default_inv_freq(D, 10000.0))
    t0 = time.perf_counter()
    C = turned_cost(moment, cos, sin)  # [H, T, D, D]
    library = time.perf_counter() - t0
    t0 = time.perf_counter()
    C_products = _turned_by_products(moment, cos, sin)
    products = time.perf_counter() - t0
    x = torch.randn(1, H, T, D, generator=g) * torch.linspace(0.3, 2.5, D)
    formats = {
        "int2 static": int_format(2, PerChannel()),
        "int2 static, Hadamard, 1/4 channels 0 bits": dataclasses.replace(
            int_format(4, PerChannel(), rotate="hadamard"), channel_bits=(0, 2, 3, 4) * (D // 4)),
    }
    case = f"turned cost, {H}x{T} tokens"
    rel = float((C - C_products).abs().max() / C_products.abs().max())
    rows = [Row(case, "products_s", products, "s"), Row(case, "library_s", library, "s"),
            Row(case, "speedup", products / library, "x"), Row(case, "max_rel_diff_C", rel, "ratio")]
    print(f"{case}: two products {products:.2f} s, library {library:.2f} s ({products / library:.2f}x); "
          f"max |dC| / max |C| {rel:.1e}", flush=True)
    for name, fmt in formats.items():
        a = compensated_quantize(x, fmt, C, page_size=64)
        b = compensated_quantize(x, fmt, C_products, page_size=64)
        rows += [Row(f"{case}, {name}", "code_bytes_differing", int((a.codes != b.codes).sum()), "count"),
                 Row(f"{case}, {name}", "code_bytes", a.codes.numel(), "count")]
        print(f"  {name}: {rows[-2].value} of {rows[-1].value} code bytes differ between the two costs", flush=True)
    for name, fmt in formats.items():
        t0 = time.perf_counter()
        order, U = _textbook(C, fmt, DAMP)
        textbook = time.perf_counter() - t0
        t0 = time.perf_counter()
        fac = compensation_factor(C, fmt)
        library = time.perf_counter() - t0
        assert torch.equal(order, fac.order)
        rel = float((U - fac.U).abs().max() / U.abs().max())
        old = compensated_quantize(x, fmt, dataclasses.replace(
            fac, channel_major=U.reshape(-1, D * D).t().contiguous().reshape(D, D, *U.shape[:-2])), page_size=64)
        new = compensated_quantize(x, fmt, fac, page_size=64)
        case = f"{name}, {H}x{T} tokens"
        rows += [Row(case, "textbook_s", textbook, "s"), Row(case, "library_s", library, "s"),
                 Row(case, "speedup", textbook / library, "x"), Row(case, "max_rel_diff_U", rel, "ratio"),
                 Row(case, "code_bytes_differing", int((old.codes != new.codes).sum()), "count"),
                 Row(case, "code_bytes", old.codes.numel(), "count")]
        print(f"{case}: textbook {textbook:.2f} s, library {library:.2f} s ({textbook / library:.2f}x); "
              f"max |dU| / max |U| {rel:.1e}; {rows[-2].value} of {rows[-1].value} code bytes differ", flush=True)
    return rows


if __name__ == "__main__":
    measure(quick=False)
