"""Ahead-of-time compilation of the kernel specialisations for Hopper (sm_90) and Ampere (sm_80)
on this CPU-only machine: the interpreter accepts code the GPU compiler rejects, so the
specialisations the calibrator can emit must also compile to a cubin. Resource usage is read from
the cubin with cuobjdump; the decode kernel must not spill (no stack, no local memory).

Runs in a subprocess (the compiler must not see TRITON_INTERPRET=1). The whole sweep (1237
specialisations: every element format x every granularity, head dim 128) takes minutes per
architecture; it is the documented ``python -m kverr.gpu.aot --full`` command, whose tables are
committed in bench/results/aot-*.txt. Here each architecture compiles a covering subset of that
sweep: every value of every constexpr of each kernel in at least one specialisation.
"""

from __future__ import annotations

import pytest

from kverr.gpu.aot import compile_in_subprocess, covering, specialisations, table


def _features(jobs):
    return {(kernel, key, value) for kernel, _, _, _, cx in jobs for key, value in cx.items()}


@pytest.mark.parametrize("D", [64, 128])
def test_the_covering_subset_has_every_code_path_of_the_full_sweep(D):
    jobs = specialisations(full=True, D=D)
    cover = covering(jobs)
    assert _features(cover) == _features(jobs)
    assert len(cover) < len(jobs) // 8  # the point of it: minutes -> seconds
    assert {k for k, *_ in cover} == {"quant_store", "decode", "decode_tail", "prefill", "prefill_tail"}
    # the heaviest branches are in: rotations, keys before RoPE, int8 windows, static scales
    cx = [c for *_, c in cover]
    assert any(c.get("K_ROT") and c.get("K_PRE") for c in cx)
    assert {k for k, _, _, _, c in cover if c.get("FP_Q")} == {"quant_store", "decode_tail", "prefill_tail"}
    assert any(c.get("K_STATIC") for c in cx) and any(c.get("ROT") for c in cx)


def _check(rows, jobs, arch):
    assert [(r.kernel, r.spec) for r in rows] == [(j[0], j[1]) for j in jobs]
    assert {r.arch for r in rows} == {arch}
    decodes = [r for r in rows if r.kernel.startswith(("decode", "prefill"))]
    spilling = [r for r in decodes if r.spills]
    assert not spilling, "decode/prefill spills:\n" + table(spilling)
    assert all(0 < r.registers <= 255 for r in rows)


def test_aot_sm90_covering_subset_at_the_bundled_models_head_dim():
    rows = compile_in_subprocess(90, full=True, cover=True, D=64)
    _check(rows, covering(specialisations(full=True, D=64)), 90)


@pytest.mark.slow
def test_aot_sm80_covering_subset_at_head_dim_128():
    rows = compile_in_subprocess(80, full=True, cover=True, D=128)
    _check(rows, covering(specialisations(full=True, D=128)), 80)
