"""The study helpers: sweep over configs, rank agreement, disagreements, figures."""

from __future__ import annotations

import numpy as np
import pytest

from kverr.error.study import disagreements, head_table, layer_table_frame, rank_agreement, sweep

from test_error_xr import synthetic_capture


@pytest.fixture(scope="module")
def sw():
    cap = synthetic_capture(n_layers=2, T=96)
    return sweep(cap, ["fp16", "int8-token", "q8_0", "q4_0", "fp8-e4m3-head"], queries=24,
                 scheduler="synchronous")


def test_sweep_has_a_config_dim(sw):
    assert list(sw["config"].values) == ["fp16", "int8-token", "q8_0", "q4_0", "fp8-e4m3-head"]
    assert sw["kl"].dims == ("config", "layer", "q_head", "query")
    # every cached byte counts: 96 tokens fill two 64-token pages, so fp16 costs > 16 bits
    bits = sw["effective_bits"].to_series()
    assert bits["fp16"] >= 16 and bits["q4_0"] < bits["q8_0"] < bits["fp16"]
    lt = layer_table_frame(sw)
    assert len(lt) == 10
    # more bits, less damage (a sanity anchor, not the study's claim)
    l0 = lt[lt.layer == 0].set_index("config")
    assert l0.loc["q4_0", "out_rel_err"] > l0.loc["q8_0", "out_rel_err"] > l0.loc["fp16", "out_rel_err"]
    np.testing.assert_allclose(lt.key_share + lt.value_share + lt.cross_share, 1.0, rtol=1e-12)
    ht = head_table(sw)
    assert len(ht) == 5 * 2 * 2


def test_rank_agreement_and_disagreements_are_consistent(sw):
    ra = rank_agreement(sw)
    assert list(ra.index) == ["layer 0", "layer 1", "pooled layers", "pooled heads"]
    assert ra.loc["pooled layers", "n"] == 8
    vals = ra.drop(columns="n").values
    assert np.all((vals >= -1) & (vals <= 1) | np.isnan(vals))
    d = disagreements(sw, by="recon_mse", against="out_rel_err")
    lt = layer_table_frame(sw)
    lt = lt[lt.config != "fp16"]
    # count discordant pairs directly
    n = 0
    for _, g in lt.groupby("layer"):
        r = g.to_dict("records")
        n += sum(a["recon_mse"] < b["recon_mse"] and a["out_rel_err"] > b["out_rel_err"]
                 for a in r for b in r)
    assert len(d) == n
    if n:
        assert np.all(d.against_ratio.values >= 1)
        # a perfect rank correlation in a layer means no disagreement there
        for layer in d.layer.unique():
            assert ra.loc[f"layer {layer}", "rho(recon_mse, out_rel_err)"] < 1


def test_figures_build(sw):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from kverr.error.figures import first_order_figure, margin_figure, rank_figure, share_heatmaps

    for fig in (share_heatmaps(sw.sel(config="q4_0")), margin_figure(sw.sel(config="q4_0")),
                first_order_figure(sw), rank_figure(layer_table_frame(sw))):
        assert fig.axes
        matplotlib.pyplot.close(fig)
