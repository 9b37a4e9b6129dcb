"""Ahead-of-time compilation of the kernel specialisations for Hopper (sm_90) and Ampere (sm_80)
on this CPU-only machine: the interpreter accepts code the GPU compiler rejects, so every
specialisation the calibrator can emit must also compile to a cubin. Resource usage is read from
the cubin with cuobjdump; the decode kernel must not spill (no stack, no local memory).

Runs in a subprocess (the compiler must not see TRITON_INTERPRET=1). The full sweep (every
element format x every granularity, head dim 128) is committed in bench/results/aot-*.txt.
"""

from __future__ import annotations

import pytest

from kverr.gpu.aot import compile_in_subprocess, formats, table


def _check(rows, arch, strict=True):
    assert rows, "nothing compiled"
    assert {r.arch for r in rows} == {arch}
    stores = [r for r in rows if r.kernel == "quant_store"]
    decodes = [r for r in rows if r.kernel.startswith(("decode", "prefill"))]
    int8_window = [r for r in rows if r.spec.endswith("int8 window")]
    assert len(stores) - sum(r.kernel == "quant_store" for r in int8_window) == len(formats(False))
    assert len(decodes) >= 2 * len(formats(False))
    assert any(r.kernel.startswith("prefill") for r in rows) and any("pre-RoPE" in r.spec for r in rows)
    # an int8 window: the store kernel's window read (one token, and channel blocks), decode and prefill tails
    assert {r.kernel for r in int8_window} == {"quant_store", "decode_tail", "prefill_tail"}
    assert sum(r.kernel == "quant_store" for r in int8_window) >= 2
    spilling = [r for r in decodes if (r.spills if strict else r.local > 0)]
    assert not spilling, "decode/prefill spills:\n" + table(spilling)
    assert all(r.registers <= 255 for r in rows)


def test_aot_sm90_every_kernel_specialisation():
    rows = compile_in_subprocess(90, D=64)
    _check(rows, 90)


@pytest.mark.slow
def test_aot_sm80_every_kernel_specialisation():
    rows = compile_in_subprocess(80, D=128)
    _check(rows, 80)
