"""The format catalog: every format kverr offers, in one place.

Calibration reads its candidates here, ahead-of-time compilation compiles every format listed
here, and the presets (today's formats, :data:`kverr.config.PRESETS`) are read from here too:

* :data:`CALIBRATION_MSE_CLIP`, :data:`STATIC_MSE_CLIP` -- the clips the calibrator searches;
* :func:`default_candidates` -- the calibrator's candidate formats for keys and values (their
  reasons are in :mod:`kverr.calibration.candidates`);
* :func:`codebook_candidates` -- the codebook formats ``--codebooks`` adds to them;
* :func:`template`, :func:`fitted_templates` -- the templates of per-channel widths the
  calibrator refits per head (:mod:`kverr.calibration.channel_bits`);
* :func:`window_formats` -- what a full-precision window may store its rows in;
* :func:`preset_formats` -- the formats of the presets;
* :func:`catalog` -- all of them, each once.
"""

from __future__ import annotations

from kverr.exceptions import ConfigError
from kverr.quant.formats import (
    CHANNEL_BITS,
    WINDOW_DTYPES,
    MSEClip,
    PerChannel,
    PerHead,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    codebook_format,
    float_format,
    fp8_format,
    int_format,
    window_format,
)

__all__ = [
    "CALIBRATION_MSE_CLIP",
    "STATIC_MSE_CLIP",
    "catalog",
    "codebook_candidates",
    "TEMPLATES",
    "default_candidates",
    "fitted_templates",
    "preset_formats",
    "template",
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


def codebook_candidates(head_dim: int = 64) -> tuple[QuantFormat, ...]:
    """The codebook candidates (``kverr calibrate --codebooks``): the normal's Lloyd-Max levels
    with one fp16 scale per token, at 2, 3 and 4 bits, Hadamard-rotated with the MSE clip or an
    rms scale, and unrotated with the MSE clip -- 9."""
    out = []
    for bits in (2, 3, 4):
        out += [codebook_format(bits, PerToken(), rotate="hadamard", clip=CALIBRATION_MSE_CLIP),
                codebook_format(bits, PerToken(), rotate="hadamard", scale_stat="rms"),
                codebook_format(bits, PerToken(), clip=CALIBRATION_MSE_CLIP)]
    return tuple(f for f in out if _fits(f, head_dim))


def _fits(fmt: QuantFormat, head_dim: int) -> bool:
    try:
        fmt.check_head_dim(head_dim)
    except ConfigError:
        return False
    return True


#: ``(floor, mean code bits)`` of the templates :func:`fitted_templates` offers (``--candidates fitted``):
#: any width from 0. Templates with a floor of 2 (``template(mean, D, floor=2)``) can be given as
#: candidates; they were not measured held out, so the named set leaves them out.
TEMPLATES = ((0, 1.5), (0, 2.0), (0, 2.5), (0, 3.0), (0, 3.5))


def template(mean_bits: float, head_dim: int, floor: int = 0, clip=None, tokens: int | None = None) -> QuantFormat:
    """A template of ``mean_bits`` code bits per element whose channels keep at least ``floor`` bits.

    Asymmetric integers with per-channel scales (static for ``tokens=None``); its ``channel_bits``
    put a share ``f`` of the channels at the narrowest width ``hi`` of :data:`CHANNEL_BITS` for which
    ``f = (mean_bits − floor) / (hi − floor)`` is a multiple of 1/8 in (0, 1), the rest at
    ``floor`` (every channel at ``floor`` when ``mean_bits == floor``). So the template's narrowest
    width is ``floor`` -- the fit keeps every channel at least that wide -- and its codes take
    ``mean_bits · head_dim / 8`` bytes when ``head_dim`` is a multiple of 64: the fit's budget.
    """
    if floor not in CHANNEL_BITS or not floor <= mean_bits <= max(CHANNEL_BITS):
        raise ConfigError(f"floor={floor!r}, mean_bits={mean_bits!r}: the floor must be one of "
                          f"{', '.join(map(str, CHANNEL_BITS))} and at most the mean")
    if mean_bits == floor:
        if floor < 2:
            raise ConfigError(f"mean_bits={mean_bits!r}: a template needs channels with codes")
        split = (floor,) * head_dim
    else:
        for hi in (b for b in CHANNEL_BITS if b > floor):
            f = (mean_bits - floor) / (hi - floor)
            if 0 < f < 1 and float(f * 8).is_integer():
                break
        else:
            raise ConfigError(
                f"mean_bits={mean_bits!r} with floor {floor}: no width of {', '.join(map(str, CHANNEL_BITS))} "
                "puts a multiple of 1/8 of the channels above the floor for that mean"
            )
        n_hi = round(f * head_dim)
        split = (hi,) * n_hi + (floor,) * (head_dim - n_hi)
    return QuantFormat(dtype="int", bits=max(split), symmetric=False, granularity=PerChannel(tokens),
                       scale_dtype="fp16", clip=clip or MSEClip(grid=9, min_ratio=0.2), channel_bits=split)


def fitted_templates(head_dim: int = 64, clip=None) -> tuple[QuantFormat, ...]:
    """The static templates of per-channel widths the calibrator refits per head (``--candidates
    fitted``, :mod:`kverr.calibration.channel_bits`), at every ``(floor, mean)`` of
    :data:`TEMPLATES`; it writes formats with the same layout rules and other widths, which the
    kernels serve alike."""
    return tuple(template(m, head_dim, floor, clip) for floor, m in TEMPLATES)


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
    return _unique((*preset_formats(), *default_candidates(head_dim), *codebook_candidates(head_dim),
                    *fitted_templates(head_dim), *window_formats()))


def _unique(formats) -> tuple[QuantFormat, ...]:
    return tuple(dict.fromkeys(formats))
