"""Per-channel widths refit on the prompt (kverr.calibration.refit) and ``kverr evaluate
--refit-widths``, on a tiny random model."""

from __future__ import annotations

import pytest

from kverr.calibration import CalibrationConfig, OuterOption, calibrate
from kverr.calibration.refit import (
    WIDTH_INDEX_BITS,
    add_width_tables,
    refit_sides,
    refit_widths,
    width_table_nbytes,
)
from kverr.catalog import template
from kverr.evaluation import parse_schemes
from kverr.exceptions import ConfigError
from kverr.memory import ModelShape, account
from kverr.quant import PerChannel, float_format, int_format
from kverr.quant.packing import packed_nbytes
from kverr.quant.reference import codes_nbytes

QUERIES = 32


@pytest.fixture(scope="module")
def fitted(tiny_capture):
    """A config calibrated with floor-0 templates on the tiny capture (sinks 4, pre-RoPE keys)."""
    cap, _, loaded = tiny_capture
    D = loaded.head_dim
    cands = (int_format(2, PerChannel(None)), template(1.5, D), template(2.5, D), float_format("fp16"))
    cfg = calibrate(cap, CalibrationConfig(budgets=2.5, context=160, options=(OuterOption(sinks=4, key_pre_rope=True),),
                                           cands_k=cands, cands_v=cands, queries=QUERIES, objective="rel"),
                    workers=1).config
    assert refit_sides(cfg, loaded.n_layers, loaded.n_kv_heads), "the test needs formats with fitted widths"
    return cfg


def _sides(cfg, loaded):
    return {(l, h, w): cfg.format_for(l, h, w) for l in range(loaded.n_layers)
            for h in range(loaded.n_kv_heads) for w in "kv"}


def test_refit_on_the_calibration_text_gives_the_calibrators_widths(tiny_capture, fitted):
    """Same prompt, queries, sinks and weights as the calibrator: the greedy allocation within the
    bytes the fitted widths took retraces the calibrator's (each of its moves fit that budget too),
    wherever the fitted widths reach the template's floor (0 bits); every other format is kept."""
    cap, _, loaded = tiny_capture
    before, after = _sides(fitted, loaded), _sides(refit_widths(fitted, cap, queries=QUERIES), loaded)
    compared = 0
    for side, f in before.items():
        if f.channel_bits is None:
            assert after[side] == f
        elif min(f.channel_bits) == 0:
            assert after[side].channel_bits == f.channel_bits, side
            compared += 1
    assert compared


def test_refit_follows_the_prompt_within_the_fitted_bytes(tiny_capture, fitted):
    """On another prompt some widths move; none takes more code bytes than the calibrated widths,
    and the width tables each sequence stores are counted as its metadata."""
    from kverr.capturing import capture, load_text, tokenize

    cap, _, loaded = tiny_capture
    ids = tokenize(loaded.tokenizer, load_text("pydoc"), 120, 4000)
    refit = refit_widths(fitted, capture(loaded, ids))
    assert refit.provenance["refit_widths"] == {"prompt_tokens": 120, "queries_per_layer": QUERIES,
                                                "refit": len(refit_sides(fitted, loaded.n_layers, loaded.n_kv_heads))}
    before, after = _sides(fitted, loaded), _sides(refit, loaded)
    moved = 0
    for side, f in before.items():
        g = after[side]
        if f.channel_bits is None:
            assert g == f
            continue
        assert g.with_bits(2) == f.with_bits(2)  # only the widths change
        assert codes_nbytes(g, loaded.head_dim) <= codes_nbytes(f, loaded.head_dim)
        moved += g.channel_bits != f.channel_bits
    assert moved
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    n_sides = len(refit_sides(fitted, loaded.n_layers, loaded.n_kv_heads))
    assert (width_table_nbytes(fitted, loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
            == n_sides * packed_nbytes(loaded.head_dim, WIDTH_INDEX_BITS))
    for batch in (1, 3):
        plain, rep = account(refit, shape, 160, batch=batch), account(refit, shape, 160, batch=batch)
        add_width_tables(rep, refit)
        assert rep.total_bytes - plain.total_bytes == batch * n_sides * packed_nbytes(loaded.head_dim, WIDTH_INDEX_BITS)
        assert rep.totals.scales - plain.totals.scales == rep.total_bytes - plain.total_bytes
    assert account(refit, shape, 160).totals.payload <= account(fitted, shape, 160).totals.payload


def test_refit_refuses_a_prompt_of_another_model_or_of_sinks_only(tiny_capture, fitted):
    cap, _, _ = tiny_capture
    with pytest.raises(ConfigError, match="beyond the config's 4 sinks"):
        refit_widths(fitted, cap.isel(token=slice(0, 4)))
    with pytest.raises(Exception, match="layer"):
        refit_widths(fitted, cap.isel(layer=slice(0, 1)))


def test_memory_counts_the_width_tables_of_a_config_calibrated_to_refit(tiny_capture, fitted, tmp_path, capsys):
    """`kverr memory` adds every sequence's width tables to a config calibrated with refit widths
    (the bytes its budget held), leaves them out of one calibrated without, and follows
    --refit-widths / --no-refit-widths when given."""
    import json

    from kverr.cli import main

    _, _, loaded = tiny_capture
    L, H, D = loaded.n_layers, loaded.n_kv_heads, loaded.head_dim
    plain_prov = {k: v for k, v in fitted.provenance.items() if k != "refit_widths"}
    refit = fitted.with_(name="r", provenance={**plain_prov, "refit_widths": True}).save(tmp_path / "r.json")
    plain = fitted.with_(name="p", provenance=plain_prov).save(tmp_path / "p.json")
    tables = width_table_nbytes(fitted, L, H, D)
    assert tables > 0

    def total(path, *flags, batch, base):
        assert main(["memory", str(path), *flags, "--shape", f"{L},{H},{D}", "--tokens", "160",
                     "--batch", str(batch), "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["refit_width_tables"] == (rep["total_bytes"] != base)
        return rep["total_bytes"]

    for batch in (1, 3):
        base = account(fitted, ModelShape(L, H, D), 160, batch=batch).total_bytes
        at = dict(batch=batch, base=base)
        assert total(refit, **at) == total(plain, "--refit-widths", **at) == base + batch * tables
        assert total(plain, **at) == total(refit, "--no-refit-widths", **at) == base


def test_evaluate_refit_widths_adds_a_refit_scheme(tmp_path, fitted):
    path = fitted.with_(name="fit").save(tmp_path / "fit.json")
    names = [s.name for s in parse_schemes(["fp16"], [str(path)], refit=True)]
    assert names == ["fp16", "fit", "fit+refit"]
    assert [s.refit for s in parse_schemes([], [str(path)], refit=True)] == [False, True]
    with pytest.raises(ConfigError, match="no scheme has per-channel widths"):
        parse_schemes(["fp16"], refit=True)


def test_evaluate_runs_the_refit_scheme_and_counts_its_tables(tiny_capture, fitted, tmp_path):
    """One segment: the refit scheme is measured beside the config, its bytes are the refit
    config's with the width tables."""
    from kverr.capturing import load_text
    from kverr.evaluation import evaluate

    cap, _, loaded = tiny_capture
    schemes = parse_schemes([], [str(fitted.with_(name="fit").save(tmp_path / "fit.json"))], refit=True)
    df = evaluate(loaded, load_text("pydoc"), schemes, prefill=(96,), decode=8, segments=1, offset=0,
                  greedy_steps=0, progress=False).set_index("scheme")
    shape = ModelShape(loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    tables = width_table_nbytes(fitted, loaded.n_layers, loaded.n_kv_heads, loaded.head_dim)
    assert df.loc["fit+refit", "cache_bytes"] - tables <= df.loc["fit", "cache_bytes"] == account(fitted, shape, 104,
                                                                                                 prefill_quantized=96).total_bytes
    assert df.loc["fit+refit", "measured_cache_bytes"] <= df.loc["fit", "measured_cache_bytes"]
    assert df.loc["fit+refit", "mean_kl"] >= 0.0
