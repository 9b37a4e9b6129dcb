"""Calibration for vLLM: only what vLLM serves, the same objective, the best skip layers."""

from __future__ import annotations

import numpy as np
import pytest
from captures import synthetic_capture

from kverr.calibration import CalibrationConfig, predict
from kverr.calibration.target import (
    calibrate_for_vllm,
    cheapest_bits,
    project_to_vllm,
    vllm_families,
)
from kverr.engines.vllm import export_vllm, serving
from kverr.engines.vllm_dtypes import TURBOQUANT_EDGE_LAYERS
from kverr.exceptions import ConfigError

N_LAYERS, N_KV, D = 6, 2, 64
BUDGETS = (8.1, 8.6, 10.0, 12.5)


@pytest.fixture(scope="module")
def capture():
    return synthetic_capture(n_layers=N_LAYERS, n_kv=N_KV, n_tokens=128, head_dim=D, outlier_channel=3)


@pytest.fixture(scope="module")
def result(capture):
    return calibrate_for_vllm(capture, CalibrationConfig(budgets=BUDGETS, objective="rel", queries=16))


def test_every_choice_is_served_by_vllm_within_its_budget(result):
    skipped = []
    for b in BUDGETS:
        cfg = result.configs[b]
        plan = serving(cfg, N_LAYERS, N_KV)  # raises if vLLM could not serve it
        pv = cfg.provenance
        assert pv["effective_bits"] <= b
        assert (plan.kv_cache_dtype, list(plan.skip_layers)) == (pv["kv_cache_dtype"], pv["kv_cache_dtype_skip_layers"])
        skipped.append(set(plan.skip_layers))
    assert all(a <= b for a, b in zip(skipped, skipped[1:]))  # a larger budget keeps at least as many layers


def test_the_choice_is_the_least_damage_the_budget_allows(result):
    t = result.table
    for b in BUDGETS:
        ok = t[(t.budget_bits == b) & (t.skip_rule == "calibrated") & t.feasible]
        assert result.configs[b].provenance["predicted_damage"] == pytest.approx(ok.predicted.min(), rel=1e-12)


def test_predicted_damage_is_the_objectives(result, capture):
    """The search adds per-layer damage of single-format configs; predict() on the chosen config
    (each layer in its own format) computes the same sums in another order."""
    for b in BUDGETS:
        cfg = result.configs[b]
        assert predict(capture, cfg, queries=16)["total"] == pytest.approx(cfg.provenance["predicted_damage"], rel=1e-9)


def test_calibrated_skip_layers_beat_the_edges_at_equal_memory(result):
    t = result.table
    for (b, dtype), g in t.groupby(["budget_bits", "dtype"]):
        edges = g[g.skip_rule == "turboquant-edges"].iloc[0]
        if dtype.startswith("turboquant_"):
            # vLLM skips the boundary layers itself: there is no other choice of as many, and
            # the calibrated rule keeps them and adds the layers of most damage
            assert g.skip_rule.tolist() == ["calibrated", "turboquant-edges"]
            cal = g[g.skip_rule == "calibrated"].iloc[0]
            assert set(edges.skip_layers) <= set(cal.skip_layers) or not cal.feasible
            continue
        same = g[g.skip_rule == "calibrated-as-many"].iloc[0]
        assert len(edges.skip_layers) == len(same.skip_layers) == 2 * min(TURBOQUANT_EDGE_LAYERS, N_LAYERS // 2)
        assert edges.bytes == same.bytes
        assert same.predicted <= edges.predicted + 1e-15


def test_families_and_infeasible_budgets(capture):
    names = [f.kv_cache_dtype for f in vllm_families(D)]
    assert names.count("fp8") == 2 and "int8_per_token_head" in names and "nvfp4" in names
    assert "turboquant_k8v4" in names
    # the cheapest: nvfp4, 4 bits of codes and an 8-bit scale per 16 channels
    with pytest.raises(ConfigError, match="below every vLLM cache dtype .* costs 4.5000 "):
        calibrate_for_vllm(capture, CalibrationConfig(budgets=(4.25,), objective="rel", queries=16))


def test_a_calibrated_fp8_config_exports_each_layers_own_scale(capture, result, tmp_path):
    from safetensors.numpy import load_file

    from kverr.quant import quantize

    fp8 = [c for c in result.configs.values() if c.provenance["kv_cache_dtype"] == "fp8"]
    assert fp8, "the smallest budget leaves only static fp8"
    cfg = fp8[0]
    ds = capture.assign_attrs(model_n_layers=N_LAYERS, model_id="synthetic", weights_sha256="0" * 64)
    export_vllm(cfg, tmp_path / "v", capture=ds)
    t = load_file(str(tmp_path / "v" / "kv_scales.safetensors"))
    import torch

    for layer in range(N_LAYERS):
        for w in "kv":
            fmt = cfg.format_for(layer, 0, w)
            x = torch.as_tensor(np.asarray(capture[w].sel(layer=layer).values)).half().float()
            want = quantize(x, fmt, page_size=cfg.page_size).scale.float().reshape(-1).numpy()
            np.testing.assert_array_equal(t[f"model.layers.{layer}.self_attn.{w}_scale"], want)


def test_cli_refuses_options_vllm_does_not_serve(tmp_path, capsys):
    from kverr.cli import main

    code = main(["calibrate", "--capture", str(tmp_path / "c.zarr"), "--target", "vllm", "--budget-bits", "9",
                 "--sinks", "4", "--out", str(tmp_path / "x.json")])
    assert code == 2 and "--sinks does not apply" in capsys.readouterr().err
    code = main(["calibrate", "--capture", str(tmp_path / "c.zarr"), "--target", "hf", "--budget-bits", "9",
                 "--window", "64", "--out", str(tmp_path / "x.json")])
    assert code == 2 and "--window does not apply" in capsys.readouterr().err
    code = main(["calibrate", "--capture", str(tmp_path / "c.zarr"), "--target", "vllm", "--budget-bits", "9",
                 "--salient", "8", "--salient-recent", "4", "--out", str(tmp_path / "x.json")])
    assert code == 2 and "--salient, --salient-recent does not apply" in capsys.readouterr().err


def test_projection_within_the_configs_bits_or_to_vllms_cheapest(capture):
    from kverr.config import PRESETS

    settings = CalibrationConfig(budgets=(16.0,), objective="rel", queries=16)
    big = project_to_vllm(capture, PRESETS["fp16"], settings)
    assert big.within_budget and big.bits <= big.original_bits == 16.0
    assert big.original_predicted == pytest.approx(predict(capture, PRESETS["fp16"], queries=16)["total"], rel=1e-12)
    small = project_to_vllm(capture, PRESETS["turboquant-mse-2"], settings)  # 2.25 bits
    assert not small.within_budget and small.original_bits < 4.5
    assert small.bits == pytest.approx(cheapest_bits(capture.kv.shape, 128, settings), abs=1e-12)
    serving(small.config, N_LAYERS, N_KV)
    assert small.config.provenance["predicted_damage"] == small.predicted
    # vLLM's cheapest is nvfp4 everywhere; one bit more buys nothing on six layers (a skipped
    # layer costs (16 - 4.5) / 6 bits)
    assert small.above is None
    # within the 8 bits of static fp8 (here nvfp4 with a layer skipped is the least damaging);
    # within one bit more, int8_per_token_head is less damaging still
    mid = project_to_vllm(capture, PRESETS["fp8-e4m3-tensor"], settings)
    assert mid.within_budget and mid.bits <= mid.original_bits
    up = mid.above
    assert up is not None and up.provenance["predicted_damage"] < mid.predicted
    assert up.provenance["effective_bits"] <= mid.original_bits + 1.0
    serving(up, N_LAYERS, N_KV)


def test_the_report_names_each_choice_and_every_dtype(result):
    from kverr.commands.calibrate import report_vllm

    text = report_vllm(result, {b: f"vllm-{b:g}b.json" for b in BUDGETS})
    for b in BUDGETS:
        pv = result.configs[b].provenance
        assert f"budget {b:g} bits -> vllm-{b:g}b.json: --kv-cache-dtype {pv['kv_cache_dtype']}" in text
    assert text.count("turboquant-edges") == len(BUDGETS) * len(vllm_families(D))


def test_hf_target_chooses_settings_transformers_runs(capture):
    from kverr.calibration.target import calibrate_for_hf, hf_candidates
    from kverr.engines.hf import check_hf

    cands = hf_candidates(D)
    assert "hf-fp8" in cands and "hf-quanto-int2-g32-r0" in cands and "hf-hqq-int8-g64-r128" in cands
    for cfg in cands.values():  # every candidate is one QuantizedCache runs
        check_hf(cfg, N_LAYERS, N_KV, D)
    res = calibrate_for_hf(capture, CalibrationConfig(budgets=(4.0, 9.0), objective="rel", queries=16))
    t = res.table
    for b, cfg in res.configs.items():
        ok = t[t.effective_bits <= b]
        assert cfg.provenance["predicted_damage"] == ok.predicted.min() and cfg.provenance["effective_bits"] <= b
        assert predict(capture, cfg, queries=16)["total"] == pytest.approx(cfg.provenance["predicted_damage"], rel=1e-9)
    with pytest.raises(ConfigError, match="below every QuantizedCache setting"):
        calibrate_for_hf(capture, CalibrationConfig(budgets=(1.0,), objective="rel", queries=16))


def test_engine_targets_average_several_captures(capture, result):
    """On two captures the damage of every choice is the mean of its damage on each (the
    captures counting alike, as ``calibrate`` averages them), and the configs name both."""
    from kverr.calibration.target import calibrate_for_hf

    other = synthetic_capture(n_layers=N_LAYERS, n_kv=N_KV, n_tokens=128, head_dim=D, outlier_channel=5, seed=1)
    settings = CalibrationConfig(budgets=BUDGETS, objective="rel", queries=16)
    both = calibrate_for_vllm([capture, other], settings)
    for b in BUDGETS:
        cfg = both.configs[b]
        each = [predict(c, cfg, queries=16)["total"] for c in (capture, other)]
        assert each[0] != pytest.approx(each[1], rel=1e-3)  # two captures that the mean does not hide
        assert cfg.provenance["predicted_damage"] == pytest.approx(np.mean(each), rel=1e-9)
        assert cfg.provenance["predicted_damage_each"] == pytest.approx(each, rel=1e-9)
        assert len(cfg.provenance["captures"]) == 2
    # a fixed skip rule's rows are each capture's rows averaged
    alone = [result.table, calibrate_for_vllm(other, settings).table]  # result: capture alone, same settings
    edges = [t[t.skip_rule == "turboquant-edges"].set_index(["budget_bits", "dtype"]).predicted for t in alone]
    mixed = both.table[both.table.skip_rule == "turboquant-edges"].set_index(["budget_bits", "dtype"]).predicted
    np.testing.assert_allclose(mixed.values, ((edges[0] + edges[1]) / 2).loc[mixed.index].values, rtol=1e-12)
    hf = calibrate_for_hf([capture, other], CalibrationConfig(budgets=(4.0,), objective="rel", queries=16))
    one = [calibrate_for_hf(c, CalibrationConfig(budgets=(4.0,), objective="rel", queries=16)).table.set_index(
        "candidate").predicted for c in (capture, other)]
    t = hf.table.set_index("candidate").predicted
    cfg = hf.configs[4.0]
    assert cfg.provenance["predicted_damage_each"] == pytest.approx(
        [predict(c, cfg, queries=16)["total"] for c in (capture, other)], rel=1e-9)
    np.testing.assert_allclose(t.values, ((one[0] + one[1]) / 2).loc[t.index].values, rtol=1e-12)
    with pytest.raises(ConfigError, match="hold 128, 96 tokens: give the context"):
        calibrate_for_vllm([capture, other.isel(token=slice(0, 96))], settings)


def test_cli_engine_target_on_two_captures(tmp_path, capsys):
    """``kverr calibrate --target vllm`` and ``hf`` on two captures name both and print the
    choice's damage on each."""
    from kverr.cli import main
    from kverr.config import CacheConfig
    from kverr.io import write_dataset

    paths = []
    for seed in (0, 1):
        p = tmp_path / f"c{seed}.zarr"
        write_dataset(synthetic_capture(n_layers=N_LAYERS, n_kv=N_KV, n_tokens=128, head_dim=D, seed=seed), p)
        paths.append(str(p))
    for target, budget in (("vllm", "10"), ("hf", "9")):
        out = tmp_path / f"{target}.json"
        assert main(["calibrate", "--capture", *paths, "--target", target, "--budget-bits", budget, "--objective",
                     "rel", "--queries", "16", "--out", str(out)]) == 0
        o, _ = capsys.readouterr()
        pv = CacheConfig.load(out).provenance
        assert "averaged over 2 captures" in o and len(pv["captures"]) == 2
        assert "on each capture: " + ", ".join(f"{d:.4g}" for d in pv["predicted_damage_each"]) in o
