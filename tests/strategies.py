"""Hypothesis strategies shared by the property tests: formats, configs and data."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from kverr.config import CacheConfig, Override
from kverr.exceptions import ConfigError
from kverr.quant.codebooks import CODEBOOK_BITS, CODEBOOK_NAMES
from kverr.quant.formats import SCALE_STATS
from kverr.quant import (
    CHANNEL_BITS,
    AbsMax,
    MSEClip,
    Percentile,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
)

HEAD_DIMS = (8, 16, 32, 64)


def granularities(head_dim: int, page_size: int) -> st.SearchStrategy:
    groups = [g for g in (4, 8, 16, 32, 64) if head_dim % g == 0]
    token_groups = [t for t in (1, 2, 4, 8, 16, 32) if page_size % t == 0]
    return st.one_of(
        st.just(PerTensor()),
        st.just(PerHead()),
        st.just(PerToken()),
        st.sampled_from(groups).map(PerTokenGroup),
        st.sampled_from([None, *token_groups]).map(PerChannel),
        st.just(PerPage()),
    )


clips = st.one_of(
    st.just(AbsMax()),
    st.sampled_from([90.0, 99.0, 99.9]).map(Percentile),
    st.builds(MSEClip, grid=st.integers(2, 12), min_ratio=st.sampled_from([0.3, 0.5, 0.8])),
    st.sampled_from([(1.0, 1.5), (0.9, 1.0, 1.25)]).map(lambda c: MSEClip(candidates=c)),
)


@st.composite
def formats(
    draw,
    head_dim: int = 64,
    page_size: int = 16,
    *,
    kinds=("int", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "codebook"),
    clip: bool = True,
    rotate: bool = True,
    floats: bool = False,
    channel_bits: bool = False,
) -> QuantFormat:
    """A valid quantized format (optionally plain floats too) for ``head_dim``; with
    ``channel_bits``, asymmetric integers with channel scales may draw per-channel widths."""
    kind = draw(st.sampled_from(kinds + (("fp16", "bf16", "fp32") if floats else ())))
    if kind in ("fp16", "bf16", "fp32"):
        return QuantFormat(dtype=kind)
    gran = draw(granularities(head_dim, page_size))
    c = draw(clips) if clip else AbsMax()
    rot = draw(st.sampled_from(["none", "hadamard"])) if rotate and head_dim & (head_dim - 1) == 0 else "none"
    sdt = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    if kind == "int":
        bits = draw(st.sampled_from([2, 3, 4, 8]))
        sym = draw(st.booleans())
        widths = None
        if channel_bits and draw(st.integers(0, 2)) == 0:  # per-channel widths: channel scales, a zero point
            sym, gran = False, PerChannel(draw(st.sampled_from([None, page_size])))
            widths = tuple(draw(st.lists(st.sampled_from(CHANNEL_BITS), min_size=head_dim, max_size=head_dim)
                                .filter(lambda w: max(w) >= 2)))
        try:
            return QuantFormat("int", bits, sym, gran, sdt, c, rot, channel_bits=widths)
        except ConfigError:  # bf16 scales are too coarse for 8-bit codes: fall back to fp16
            return QuantFormat("int", bits, sym, gran, "fp16", c, rot, channel_bits=widths)
    if kind == "codebook":
        bits = draw(st.sampled_from(CODEBOOK_BITS))
        book = draw(st.sampled_from(CODEBOOK_NAMES + ("levels",)))
        if book == "levels":  # a fitted codebook: any strictly increasing levels
            steps = draw(st.lists(st.floats(0.05, 2.0), min_size=2**bits, max_size=2**bits))
            span = np.concatenate(([0.0], np.cumsum(steps[1:])))  # from 0 to the span, then about zero
            book = tuple(float(v) for v in span - draw(st.floats(0.1, 0.9)) * span[-1])
        stat = draw(st.sampled_from(SCALE_STATS))
        c = AbsMax() if stat == "rms" else c
        try:
            return QuantFormat(kind, bits, True, gran, sdt, c, rot, codebook=book, scale_stat=stat)
        except ConfigError:  # bf16 scales too coarse for the codebook's outer cells
            return QuantFormat(kind, bits, True, gran, "fp16", c, rot, codebook=book, scale_stat=stat)
    # minifloats may also take the one-byte scales: e8m0, and fp8 e4m3 for fp8 codes (an fp4
    # block scale amax / 6 would overflow e4m3's 448 on the largest data drawn here)
    byte_scales = ("e8m0", "fp8_e4m3") if kind.startswith("fp8") else ("e8m0",)
    sdt = draw(st.sampled_from(["fp32", "fp16", "bf16", *byte_scales]))
    return QuantFormat(kind, 4 if kind == "fp4_e2m1" else 8, True, gran, sdt, c, rot)


@st.composite
def data(draw, *, heads=(1, 3), tokens=(1, 70), head_dim=None, batch=(1, 2)) -> torch.Tensor:
    """Float32 ``[B, H, T, D]`` with a random scale, offset and a few outlier channels.

    The offset stays within a few standard deviations (typical of keys and values).
    """
    B = draw(st.integers(*batch))
    H = draw(st.integers(*heads))
    T = draw(st.integers(*tokens))
    D = head_dim if head_dim is not None else draw(st.sampled_from(HEAD_DIMS))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 7.5, 300.0]))
    offset = draw(st.floats(-1.0, 1.0))
    outliers = draw(st.integers(0, 2))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, H, T, D)) * scale + offset * scale
    for c in rng.choice(D, size=outliers, replace=False):
        x[..., c] *= 10.0
    return torch.from_numpy(x.astype(np.float32))


@st.composite
def configs(draw, n_layers: int = 2, n_kv_heads: int = 3, head_dim: int = 16) -> CacheConfig:
    """A valid cache config with optional per-layer and per-head overrides (formats and window
    lengths)."""
    page = draw(st.sampled_from([4, 16, 32, 64]))
    fmt = formats(head_dim, page, floats=True, channel_bits=True)
    win = st.none() | st.sampled_from([0, 3, 16, 40])
    layers = draw(
        st.dictionaries(st.integers(0, n_layers - 1),
                        st.builds(Override, k=st.none() | fmt, v=fmt, k_window=win, v_window=win), max_size=2)
    )
    heads = draw(
        st.dictionaries(
            st.tuples(st.integers(0, n_layers - 1), st.integers(0, n_kv_heads - 1)),
            st.builds(Override, k=fmt, v=st.none() | fmt, k_window=win, v_window=win),
            max_size=3,
        )
    )
    return CacheConfig(
        k=draw(fmt),
        v=draw(fmt),
        window=draw(st.sampled_from([0, 1, 7, 32])),
        sinks=draw(st.sampled_from([0, 1, 4])),
        key_pre_rope=draw(st.booleans()),
        page_size=page,
        window_dtype=draw(st.sampled_from(["fp16", "bf16", "fp32", "int8"])),
        align=draw(st.sampled_from([1, 16, 128])),
        layers=layers,
        heads=heads,
        name=draw(st.none() | st.sampled_from(["a", "calibrated-3.5"])),
    )
