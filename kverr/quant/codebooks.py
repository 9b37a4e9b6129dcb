"""Scalar codebooks: the levels of the ``codebook`` element format.

A codebook format stores each element as the index of one of ``2**bits`` levels ``c_0 < c_1 <
...`` (fp32), in units of its block's scale: ``x_hat = c[u] * s``. Two codebooks are named by a
rule, and any other is given by its levels (a codebook fitted to a capture):

* ``"normal"`` -- the Lloyd-Max quantizer of the standard normal distribution (J. Max, 1960):
  the levels of least mean squared error for ``N(0, 1)``, each the centroid of its cell, the
  cells split at the midpoints. A Hadamard-rotated (or randomly rotated) row is close to
  normal in every channel, which is why TurboQuant quantizes a rotated unit vector with it.
* ``"nf"`` -- NormalFloat (QLoRA, Dettmers et al. 2023): ``2**(b-1)`` positive and
  ``2**(b-1) - 1`` negative quantiles of ``N(0, 1)`` and an exact zero, scaled into
  ``[-1, 1]``; the quantiles are those of ``offset = (o_low + o_high) / 2`` with ``o_n = 1 -
  1 / (2 n)`` for ``n = 2**b - 1`` and ``2**b`` cells (at 4 bits 0.9677083, QLoRA's NF4).

:func:`lloyd_max` fits levels to weighted samples (Lloyd's algorithm), for codebooks fitted per
layer or head. Levels are fp32; an element's code is the number of cell boundaries below its
scaled value (:func:`boundaries`), so a tie goes to the lower level.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from kverr.exceptions import ConfigError

#: Codebooks named by a rule.
CODEBOOK_NAMES = ("normal", "nf")
#: Widths a codebook format may have.
CODEBOOK_BITS = (2, 3, 4)


def _norm_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _to_fp32(levels: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in np.asarray(levels, dtype=np.float64).astype(np.float32))


@functools.lru_cache(maxsize=None)
def lloyd_max_normal(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max levels of ``N(0, 1)``, ascending, rounded to fp32.

    Lloyd's fixed point in float64: every level is the normal centroid of its cell,
    ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))``, every cell boundary the midpoint of its levels;
    iterated from the quantiles of the cells' centres until no level moves by 1e-14.
    """
    from scipy.special import ndtr, ndtri

    n = 2**bits
    c = ndtri((np.arange(n) + 0.5) / n)
    for _ in range(100_000):
        t = np.concatenate(([-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]))
        new = (_norm_pdf(t[:-1]) - _norm_pdf(t[1:])) / (ndtr(t[1:]) - ndtr(t[:-1]))
        new = (new - new[::-1]) / 2  # the fixed point is symmetric; keep it exactly so
        if np.max(np.abs(new - c)) < 1e-14:
            c = new
            break
        c = new
    else:  # pragma: no cover - converges in a few hundred iterations
        raise RuntimeError(f"Lloyd-Max for {bits} bits did not converge")
    return _to_fp32(c)


@functools.lru_cache(maxsize=None)
def lloyd_max_sphere(dim: int, bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max levels of one coordinate of a point drawn uniformly from the unit
    sphere in ``dim`` dimensions (TurboQuant's scalar quantizer for a randomly rotated unit
    vector), ascending, rounded to fp32.

    The coordinate has the density ``f(x) = (1 - x**2)**k / B(1/2, (dim-1)/2)`` on ``[-1, 1]``,
    ``k = (dim - 3) / 2`` (so ``(1 + x) / 2`` is ``Beta((dim-1)/2, (dim-1)/2)``); a cell
    ``[a, b]``'s mass is a difference of that law's distribution function and its first moment
    ``(((1 - a**2)**(k+1) - (1 - b**2)**(k+1)) / (2 (k+1))) / B(1/2, (dim-1)/2)`` in closed form.
    Lloyd's fixed point in float64 as :func:`lloyd_max_normal`, from the law's quantiles of the
    cells' centres. For large ``dim`` the levels approach the normal's over ``sqrt(dim)``.
    """
    from scipy.special import beta as beta_fn
    from scipy.special import betainc, betaincinv

    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ConfigError(f"dim={dim!r}: a sphere coordinate needs a dimension of at least 2")
    n = 2**bits
    a = (dim - 1) / 2
    k1 = (dim - 1) / 2  # k + 1
    norm_c = beta_fn(0.5, a)
    c = 2 * betaincinv(a, a, (np.arange(n) + 0.5) / n) - 1
    for _ in range(100_000):
        t = np.concatenate(([-1.0], (c[:-1] + c[1:]) / 2, [1.0]))
        mass = np.diff(betainc(a, a, (1 + t) / 2))
        moment = -np.diff((1 - t * t) ** k1) / (2 * k1) / norm_c
        new = moment / mass
        new = (new - new[::-1]) / 2
        if np.max(np.abs(new - c)) < 1e-14:
            c = new
            break
        c = new
    else:  # pragma: no cover
        raise RuntimeError(f"Lloyd-Max on the sphere (dim {dim}, {bits} bits) did not converge")
    return _to_fp32(c)


@functools.lru_cache(maxsize=None)
def normal_float(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` NormalFloat levels in ``[-1, 1]``, ascending, rounded to fp32 (see the module)."""
    from scipy.special import ndtri

    n = 2**bits
    offset = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    pos = ndtri(np.linspace(offset, 0.5, n // 2 + 1)[:-1])
    neg = -ndtri(np.linspace(offset, 0.5, n // 2)[:-1])
    levels = np.sort(np.concatenate((pos, [0.0], neg)))
    return _to_fp32(levels / levels.max())


def resolve(codebook: str | tuple[float, ...], bits: int) -> tuple[float, ...]:
    """The levels of a named codebook at ``bits``, or the given levels (checked)."""
    if isinstance(codebook, str):
        if codebook not in CODEBOOK_NAMES:
            raise ConfigError(f"codebook={codebook!r} is not allowed; one of {', '.join(CODEBOOK_NAMES)}, "
                              "or a list of levels")
        return lloyd_max_normal(bits) if codebook == "normal" else normal_float(bits)
    return check_levels(codebook, bits)


def check_levels(levels, bits: int) -> tuple[float, ...]:
    """``levels`` as a tuple of fp32 values: ``2**bits`` finite, strictly increasing, the first
    negative and the last positive (the scale is about zero); raises :class:`ConfigError` otherwise."""
    if isinstance(levels, (str, bytes)) or not hasattr(levels, "__iter__"):
        raise ConfigError(f"codebook={levels!r} is not allowed; a name or a list of {2**bits} levels")
    vals = list(levels)
    if len(vals) != 2**bits or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in vals):
        raise ConfigError(f"codebook has {len(vals)} entries; a {bits}-bit codebook is a list of {2**bits} numbers")
    f32 = _to_fp32(np.asarray(vals, dtype=np.float64))
    if not all(math.isfinite(v) for v in f32):
        raise ConfigError("codebook levels must be finite (in fp32)")
    if any(b <= a for a, b in zip(f32, f32[1:])):
        raise ConfigError(f"codebook levels must increase strictly (in fp32), got {list(f32)}")
    if not f32[0] < 0.0 < f32[-1]:
        raise ConfigError(f"codebook levels must have both signs (the first negative, the last positive), "
                          f"got {list(f32)}")
    return f32


@functools.lru_cache(maxsize=256)
def boundaries(levels: tuple[float, ...]) -> tuple[float, ...]:
    """The ``2**bits - 1`` cell boundaries: ``(c_i + c_{i+1}) / 2`` rounded to fp32 (the exact
    midpoint of two fp32 numbers, rounded once). A scaled value ``q`` gets code ``#{t_i < q}``."""
    c = np.asarray(levels, dtype=np.float64)
    return _to_fp32((c[:-1] + c[1:]) / 2)


def level_codes(q: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """The codes (uint8) of values ``q`` already in the levels' units: the number of cell
    boundaries (:func:`boundaries`) strictly below each, so the nearest level, a tie going to the
    lower one. One comparison per boundary: several times faster than ``searchsorted`` on the CPU
    at these widths."""
    u = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for t in boundaries(tuple(levels)):
        u += q > t
    return u


def top_level(levels: tuple[float, ...]) -> float:
    """The largest magnitude of the levels: an absmax scale maps the block's largest magnitude onto it."""
    return max(abs(levels[0]), abs(levels[-1]))


def lloyd_max(x: torch.Tensor, bits: int, weights: torch.Tensor | None = None, *,
              init: tuple[float, ...] | None = None, iters: int = 50) -> tuple[float, ...]:
    """Levels of least weighted squared error for the samples ``x`` (Lloyd's algorithm, float64).

    Parameters
    ----------
    x
        Samples (any shape), in the units the codebook's levels are in (values over their scale).
    bits
        Width: ``2**bits`` levels.
    weights
        Non-negative weight of each sample (same shape as ``x``); uniform when None.
    init
        Starting levels (default: the weighted quantiles of the cells' centres).
    iters
        Lloyd iterations (each: assign to the nearest level, move every level to its cell's
        weighted mean). A cell left empty keeps its level.

    Returns
    -------
    tuple of float
        Ascending fp32 levels (ties between levels broken by one fp32 step, so they increase
        strictly).
    """
    v = torch.as_tensor(x).double().reshape(-1)
    w = torch.ones_like(v) if weights is None else torch.as_tensor(weights).double().reshape(-1)
    if v.numel() == 0 or w.shape != v.shape or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ConfigError("lloyd_max needs samples and as many non-negative weights, not all zero")
    n = 2**bits
    if init is None:
        order = torch.argsort(v)
        cw = torch.cumsum(w[order], 0)
        targets = (torch.arange(n, dtype=torch.float64) + 0.5) / n * cw[-1]
        c = v[order][torch.searchsorted(cw, targets).clamp(max=v.numel() - 1)]
    else:
        c = torch.tensor(init, dtype=torch.float64)
    for _ in range(iters):
        c, _ = torch.sort(c)
        cell = torch.searchsorted((c[:-1] + c[1:]) / 2, v)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w * v)
        c = torch.where(mass > 0, moment / mass.clamp(min=1e-300), c)
    out = np.sort(c.numpy()).astype(np.float32)
    for i in range(1, n):  # strictly increasing in fp32
        if out[i] <= out[i - 1]:
            out[i] = np.nextafter(out[i - 1], np.float32(np.inf))
    return tuple(float(v) for v in out)
