"""The serving-cost model (kverr.cost, ``kverr plan``): bytes against hand counts and against the
memory accounting, launch groups, the split rule, the time model's arithmetic, the command line."""

from __future__ import annotations

import json

import pytest

from kverr.config import PRESETS, CacheConfig, Override
from kverr.cost import (
    DECODE_KINDS,
    GPUS,
    OVERHEADS,
    Gpu,
    decode_splits,
    fp16_step,
    speedups,
    step_cost,
)
from kverr.exceptions import ConfigError, ShapeError
from kverr.memory import DEFAULT_SHAPE, ModelShape, account
from kverr.quant import PerToken, PerTokenGroup, int_format

SHAPE = ModelShape(2, 2, 64, name="small", n_q_heads=4)
T, B = 300, 3


def _per_layer(plan, kind):
    return {lc.layer: lc.bytes_by_kind()[kind] for lc in plan.layers}


def test_bytes_equal_hand_counts_int8_token():
    """int8 per token, asymmetric, fp16 scale and zero, no window: every token quantized."""
    plan = step_cost(PRESETS["int8-token"], SHAPE, T, B)
    codes = B * 2 * T * 64  # sequences x kv heads x tokens x channels, one byte each
    meta = B * 2 * T * 2  # one fp16 scale (and one zero) per token and head
    for kind, want in (("codes", codes), ("scales", meta), ("zeros", meta), ("window", 0), ("rope", 0)):
        assert _per_layer(plan, kind) == {0: 2 * want, 1: 2 * want}, kind  # K and V


def test_bytes_equal_hand_counts_kivi_2():
    """kivi-2: keys int2 per channel over 32-token blocks, values int2 per token in groups of 32,
    a 128-token fp16 window; 300 tokens."""
    plan = step_cost(PRESETS["kivi-2"], SHAPE, T, B)
    rows = B * 2
    # keys: 172 tokens past the window, whole 32-token blocks quantized: 160; 140 stay fp16
    k_codes, k_meta, k_win = rows * 160 * 16, rows * (160 // 32) * 64 * 2, rows * 140 * 64 * 2
    # values: per token, so all 172 are quantized; 2 groups of 32 channels -> 2 fp16 scales a token
    v_codes, v_meta, v_win = rows * 172 * 16, rows * 172 * 2 * 2, rows * 128 * 64 * 2
    for kind, want in (("codes", k_codes + v_codes), ("scales", k_meta + v_meta), ("zeros", k_meta + v_meta),
                       ("window", k_win + v_win)):
        assert _per_layer(plan, kind) == {0: want, 1: want}, kind
    lc = plan.layers[0]
    # one launch group; splits min(2*132 SMs / (3*2 programs), 300/32 tiles) = 10
    assert lc.groups == 1 and lc.splits == 10
    # query rows read by the 10 main and the tail programs; partials written and merged
    nsp = 11
    assert lc.bytes_by_kind()["query"] == B * 4 * 64 * 2 * nsp
    assert lc.bytes_by_kind()["partials"] == 2 * B * 4 * nsp * 66 * 4 + B * 4 * 64 * 2
    # main + tail + merge; stores every 32nd step (keys) and every step (values); 2 host
    # operations per (K|V, head group) writing the new row into the window
    assert lc.n_launches == pytest.approx(3 + 1 / 32 + 1 + 2 * 2)


@pytest.mark.parametrize("name,group", [("nvfp4", 16), ("mxfp4", 32)])
def test_bytes_equal_hand_counts_microscaling(name, group):
    """fp4 codes (half a byte an element) and one one-byte scale per group of channels, no window."""
    plan = step_cost(PRESETS[name], SHAPE, T, B)
    codes = B * 2 * T * 64 // 2
    scales = B * 2 * T * (64 // group)
    for kind, want in (("codes", codes), ("scales", scales), ("zeros", 0), ("window", 0)):
        assert _per_layer(plan, kind) == {0: 2 * want, 1: 2 * want}, kind


def test_static_bytes_of_per_channel_widths_equal_hand_counts():
    """Keys with a width per channel (static channel scales) and int8-token values: each program
    reads the keys' fp16 scale and zero per channel and their int32 unpack word per channel."""
    from kverr.quant import PerChannel, QuantFormat

    widths = (0, 2, 3, 4, 8, 2, 3, 2) * 8
    kf = QuantFormat("int", 8, False, PerChannel(None), "fp16", channel_bits=widths)
    cfg = CacheConfig(k=kf, v=int_format(8, PerToken()), page_size=16)
    plan = step_cost(cfg, SHAPE, T, B)
    lc = plan.layers[0]
    per_program = 64 * (2 + 2) + 64 * 4  # scale + zero, then the unpack word, per channel
    assert lc.bytes_by_kind()["static"] == 2 * per_program * B * (lc.splits + 1)  # 2 kv heads; main + tail
    # codes: per row, the planes of each width in whole bytes (2: 24 ch -> 6, 3: 16 -> 4 + 2, 4: 8 -> 4, 8: 8 -> 8)
    k_codes = B * 2 * T * (6 + 6 + 4 + 8)
    assert lc.bytes_by_kind()["codes"] == k_codes + B * 2 * T * 64


def test_rope_bytes_equal_hand_counts():
    """Pre-RoPE keys: every launch group reads an fp32 cos and sin half-row (D/2 values each) per
    key position, quantized or not, whatever the batch; values and post-RoPE keys read none."""
    cfg = PRESETS["int8-token"].with_(key_pre_rope=True, window=16)
    two = cfg.with_(heads={(0, 1): Override(k=int_format(4, PerTokenGroup(32)))})
    for c, groups in ((cfg, {0: 1, 1: 1}), (two, {0: 2, 1: 1})):
        plan = step_cost(c, SHAPE, T, B)
        assert {lc.layer: lc.groups for lc in plan.layers} == groups
        assert _per_layer(plan, "rope") == {layer: g * T * 2 * 32 * 4 for layer, g in groups.items()}
    assert _per_layer(step_cost(PRESETS["int8-token"].with_(window=16), SHAPE, T, B), "rope") == {0: 0, 1: 0}


def test_plan_bytes_are_the_cache_bytes_less_what_is_never_read():
    """Codes, scales, zeros and full-precision rows are the memory accounting's, page rounding
    and padding left out; for every preset and a calibrated config of the default model."""
    cfgs = [PRESETS[n] for n in PRESETS] + [CacheConfig.load("data/configs/calibrated-3b.json")]
    for cfg in cfgs:
        for tokens, batch in ((1, 1), (200, 2), (4096, 3)):
            plan = step_cost(cfg, DEFAULT_SHAPE, tokens, batch)
            mem = account(cfg, DEFAULT_SHAPE, tokens, batch=batch).totals
            by = plan.bytes_by_kind()
            assert by["codes"] == mem.payload and by["scales"] == mem.scales and by["zeros"] == mem.zeros, cfg.name
            assert by["window"] == mem.sinks + mem.window, cfg.name


def test_a_sliding_layer_reads_its_window_only():
    """Layer 0 slides with a window of 256 tokens: at 4096 tokens its codes and window rows are
    those of a 256-token full layer (int8 per token, a 16-token window: 240 quantized, 16 fp16),
    and its fp16 reference reads 256 tokens; layer 1, full, reads all 4096; the totals are still
    memory's (a sliding layer's memory is its window too)."""
    cfg = PRESETS["int8-token"].with_(window=16)
    sliding = ModelShape(2, 2, 64, n_q_heads=4, sliding_windows=(256, 0))
    plan, short = step_cost(cfg, sliding, 4096, B), step_cost(cfg, SHAPE, 256, B)
    long = step_cost(cfg, SHAPE, 4096, B)
    for kind in ("codes", "scales", "window"):
        assert _per_layer(plan, kind)[0] == _per_layer(short, kind)[0] and _per_layer(plan, kind)[1] == _per_layer(long, kind)[1]
    assert _per_layer(plan, "codes")[0] == 2 * B * 2 * 240 * 64 and _per_layer(plan, "window")[0] == 2 * B * 2 * 16 * 64 * 2
    mem = account(cfg, sliding, 4096, batch=B).totals
    by = plan.bytes_by_kind()
    assert by["codes"] == mem.payload and by["window"] == mem.sinks + mem.window
    ref = _per_layer(fp16_step(sliding, 4096, B), "codes")
    assert ref == {0: 2 * B * 2 * 256 * 64 * 2, 1: 2 * B * 2 * 4096 * 64 * 2}


def test_launch_groups_are_the_distinct_pairs_and_cost_launches():
    i8, i4 = int_format(8, PerToken()), int_format(4, PerTokenGroup(32))
    one = CacheConfig(k=i4, v=i4, window=16)
    # head 0 differs in its key format, head 1 in its value format: three groups in layer 0
    mixed = one.with_(heads={(0, 0): Override(k=i8), (0, 1): Override(v=i8)})
    shape = ModelShape(2, 3, 64, n_q_heads=6)
    assert [h for *_, h in mixed.launch_groups(0, 3)] == [[0], [1], [2]]
    assert [h for *_, h in mixed.launch_groups(1, 3)] == [[0, 1, 2]]
    a, b = step_cost(one, shape, 500, 2), step_cost(mixed, shape, 500, 2)
    assert [lc.groups for lc in b.layers] == [3, 1]
    decode = lambda lc: sum(ln.count for ln in lc.launches if ln.kind in DECODE_KINDS)  # noqa: E731
    assert decode(a.layers[0]) == 3 and decode(b.layers[0]) == 2 * 3 + 1
    # more groups: more launches, never fewer seconds
    assert b.seconds(True) > a.seconds(True) and b.seconds(False) > a.seconds(False)


def test_split_rule():
    assert decode_splits(1, 8, 32768, 132, 16) == 33  # ceil(264 / 8)
    assert decode_splits(64, 8, 32768, 132, 16) == 1
    assert decode_splits(1, 8, 40, 132, 16) == 3  # at most one chunk per tile
    assert decode_splits(1, 8, 0, 132, 16) == 0


def test_time_model_arithmetic():
    """With no launch cost and one rate, a step is its bytes over the bandwidth: fp16 reads
    twice int8's codes, and the predicted speedups follow."""
    gpu = Gpu("ideal", 1e12, 1e30, 1e30, 132, "test")
    free = OVERHEADS.__class__(launch_device=0.0, triton_host=0.0, torch_host=0.0)
    plan = step_cost(PRESETS["int8-token"], SHAPE, T, B, gpu, overheads=free)
    assert plan.seconds(True) == pytest.approx(plan.total_bytes / 1e12)
    ref = fp16_step(SHAPE, T, B, gpu, overheads=free)
    assert ref.bytes_by_kind()["codes"] == 2 * 2 * B * 2 * T * 64 * 2  # layers x K,V x rows x tokens x D x 2 B
    sp = speedups(PRESETS["int8-token"], SHAPE, gpu, tokens=(T,), batches=(B,), overheads=free)
    assert sp[(T, B)] == pytest.approx(ref.total_bytes / plan.total_bytes)
    # launch costs: graphs pay each launch's device cost once
    costly = OVERHEADS.__class__(launch_device=1e-3, triton_host=0.0, torch_host=0.0)
    p2 = step_cost(PRESETS["int8-token"], SHAPE, T, B, gpu, overheads=costly)
    assert p2.seconds(True) - plan.seconds(True) == pytest.approx(1e-3 * p2.launches)
    # an int8 window receives the new rows with one launch per K|V and layer
    c8 = PRESETS["kivi-2"].with_(window_dtype="int8")
    p3 = step_cost(c8, SHAPE, T, B, gpu, overheads=costly)
    assert sum(ln.count for lc in p3.layers for ln in lc.launches if ln.kind == "receive") == 2 * 2


def test_bad_input():
    with pytest.raises(ShapeError, match="query heads"):
        step_cost(PRESETS["fp16"], ModelShape(2, 2, 64), 10)
    with pytest.raises(ShapeError, match="tokens=0"):
        step_cost(PRESETS["fp16"], SHAPE, 0)
    with pytest.raises(ConfigError, match="gpu='v100'"):
        step_cost(PRESETS["fp16"], SHAPE, 10, gpu="v100")
    with pytest.raises(ShapeError, match="multiple of n_kv_heads"):
        ModelShape(2, 2, 64, n_q_heads=3)
    assert set(GPUS) == {"h200", "h100", "a100"}


def test_cli_plan(capsys):
    from kverr.cli import main

    assert main(["plan", "kivi-2", "--tokens", "4096", "--batch", "16", "--total-only"]) == 0
    out = capsys.readouterr().out
    assert "30 layers x 3 kv heads x head dim 64, 9 query heads" in out and "fp16 reference" in out
    assert "predicted speedup of attention over fp16 (CUDA graphs)" in out and "131,072" in out
    assert main(["plan", "data/configs/calibrated-3b.json", "--tokens", "1280", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["layers"]) == 30 and d["fp16"]["seconds_graphs"] > 0
    assert main(["plan", "int8-token", "--shape", "32,8,128,32", "--tokens", "10000", "--total-only"]) == 0
    assert "beyond" not in capsys.readouterr().out
    assert main(["plan", "int8-token", "--tokens", "10000", "--total-only"]) == 0
    assert "beyond the model's context of 8192" in capsys.readouterr().out
    assert main(["plan", "int8-token", "--shape", "32,8,128", "--tokens", "100"]) == 2
    assert "query heads" in capsys.readouterr().err
