"""The calibration figures' inputs: the family each format belongs to, and a config's choices."""

from __future__ import annotations

from kverr.calibration.plots import FAMILIES, config_choices, family_heatmaps, format_family
from kverr.config import PRESETS, CacheConfig, Override
from kverr.quant import PerChannel, PerToken, QuantFormat, codebook_format, float_format, fp4_format, int_format


def test_every_format_has_one_family():
    widths = QuantFormat("int", 4, False, PerChannel(None), "fp16", channel_bits=(0, 2, 4, 4))
    cases = {"uniform": int_format(4, PerToken()), "fitted widths": widths, "codebook": codebook_format(3, PerToken()),
             "minifloat": fp4_format(PerToken()), "float": float_format("fp16")}
    assert set(cases) == set(FAMILIES)
    for family, fmt in cases.items():
        assert format_family(fmt) == family
    assert format_family(PRESETS["fp8-e4m3-head"].k) == "minifloat"


def test_config_choices_and_the_family_figure():
    cfg = CacheConfig(k=int_format(2, PerChannel(32)), v=codebook_format(3, PerToken()),
                      layers={1: Override(k=float_format("fp16"), v=fp4_format(PerToken()))})
    ch = config_choices(cfg, 2, 3)
    assert len(ch) == 2 * 3 * 2
    got = ch.groupby(["layer", "which"]).family.unique().map(tuple).to_dict()
    assert got == {(0, "k"): ("uniform",), (0, "v"): ("codebook",), (1, "k"): ("float",), (1, "v"): ("minifloat",)}
    assert ch[ch.family == "float"].bits.unique().tolist() == [16.0]
    fig = family_heatmaps(ch, title="t")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["uniform", "codebook", "minifloat", "float"]
