"""The format catalog: every format kverr offers, in one place.

Calibration reads its candidates here, ahead-of-time compilation compiles every format listed
here, and the presets (today's formats, :data:`kverr.config.PRESETS`) are read from here too:

* :data:`CALIBRATION_MSE_CLIP`, :data:`STATIC_MSE_CLIP` -- the clips the calibrator searches;
* :func:`default_candidates` -- the calibrator's candidate formats for keys and values (their
  reasons are in :mod:`kverr.calibration.candidates`);
* :func:`fitted_templates` -- the templates of per-channel widths the calibrator refits per head
  (:mod:`kverr.calibration.channel_bits`);
* :func:`window_formats` -- what a full-precision window may store its rows in;
* :func:`preset_formats` -- the formats of the presets;
* :func:`catalog` -- all of them, each once.
"""

from __future__ import annotations

from kverr.exceptions import ConfigError
from kverr.quant.formats import (
    WINDOW_DTYPES,
    MSEClip,
    PerChannel,
    PerHead,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    float_format,
    fp8_format,
    int_format,
    window_format,
)

__all__ = [
    "CALIBRATION_MSE_CLIP",
    "STATIC_MSE_CLIP",
    "catalog",
    "default_candidates",
    "fitted_templates",
    "preset_formats",
    "window_formats",
]

#: The clip searched by the calibration's MSE candidates: 5 ratios from 1 down to 0.6 (cheap
#: enough for 4096 tokens).
CALIBRATION_MSE_CLIP = MSEClip(grid=5, min_ratio=0.6)
#: The deeper clip also searched for static per-channel scales: 9 ratios from 1 down to 0.2.
STATIC_MSE_CLIP = MSEClip(grid=9, min_ratio=0.2)


def default_candidates(head_dim: int = 64, *, static: bool = True) -> tuple[QuantFormat, ...]:
    """The default candidate formats (the same list for keys and values), in a fixed order;
    ``static=False`` leaves out the integers with static per-channel scales."""
    out: list[QuantFormat] = []
    grans = [PerToken(), PerTokenGroup(32), PerChannel(32), PerChannel(64)]
    for bits in (2, 3, 4):
        for g in grans:
            for rot in ("none", "hadamard"):
                for clip in (None, CALIBRATION_MSE_CLIP):
                    out.append(int_format(bits, g, clip=clip, rotate=rot))
    for bits in (2, 3, 4) if static else ():
        for rot in ("none", "hadamard"):
            for clip in (None, CALIBRATION_MSE_CLIP, STATIC_MSE_CLIP):
                out.append(int_format(bits, PerChannel(None), clip=clip, rotate=rot))
    for g in (PerToken(), PerTokenGroup(32)):
        for rot in ("none", "hadamard"):
            out.append(int_format(8, g, rotate=rot))
    out.append(int_format(8, PerTokenGroup(32), symmetric=True))
    for g in (PerToken(), PerTokenGroup(32), PerHead()):
        for rot in ("none", "hadamard"):
            out.append(fp8_format(g, rotate=rot))
    out.append(float_format("fp16"))
    return tuple(f for f in out if _fits(f, head_dim))


def _fits(fmt: QuantFormat, head_dim: int) -> bool:
    try:
        fmt.check_head_dim(head_dim)
    except ConfigError:
        return False
    return True


def fitted_templates(head_dim: int = 64) -> tuple[QuantFormat, ...]:
    """The templates of per-channel widths (``--candidates fitted``); the calibrator writes
    formats with the same layout rules and other widths, which the kernels serve alike."""
    from kverr.calibration.channel_bits import templates

    return templates(head_dim)


def window_formats() -> tuple[QuantFormat, ...]:
    """The formats a full-precision window (and sink tokens) may store rows in."""
    return tuple(window_format(d) for d in WINDOW_DTYPES)


def preset_formats() -> tuple[QuantFormat, ...]:
    """The key and value formats of every preset, each once, in preset order."""
    from kverr.config import PRESETS

    return _unique(f for cfg in PRESETS.values() for _, f in cfg._all_formats())


def catalog(head_dim: int = 64) -> tuple[QuantFormat, ...]:
    """Every format kverr offers for ``head_dim``: presets, calibration candidates (static ones
    and the fitted templates included) and window formats, each once."""
    return _unique((*preset_formats(), *default_candidates(head_dim), *fitted_templates(head_dim), *window_formats()))


def _unique(formats) -> tuple[QuantFormat, ...]:
    return tuple(dict.fromkeys(formats))
