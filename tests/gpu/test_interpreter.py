"""kverr.gpu.interpreter: triton's interpreter patches its language once per launch, not once per
helper call, and computes the same."""

from __future__ import annotations

import pytest

from kverr.gpu.interpreter import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's patch step (TRITON_INTERPRET=1)")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _plus_one(x):
    return x + 1.0


@triton.jit
def _count_kernel(out_ptr, N: tl.constexpr):
    acc = tl.zeros((16,), dtype=tl.float32)  # a helper of triton's standard library (it reads tl.core)
    for _ in range(N):
        acc = _plus_one(acc) * 2.0 - _plus_one(acc)  # acc + 1, through two helper calls
    tl.store(out_ptr + tl.arange(0, 16), acc)


def _patches_of(n: int, monkeypatch) -> int:
    """Attributes the interpreter sets on the language while running ``_count_kernel`` with ``n``
    iterations (each iteration calls a helper twice); checks its result."""
    import torch
    import triton.runtime.interpreter as ti

    calls = []
    set_attr = ti._LangPatchScope.set_attr

    def counting(self, obj, name, value):
        calls.append(name)
        return set_attr(self, obj, name, value)

    monkeypatch.setattr(ti._LangPatchScope, "set_attr", counting)
    out = torch.zeros(16)
    _count_kernel[(1,)](out, N=n)
    monkeypatch.undo()
    assert torch.equal(out, torch.full((16,), float(n)))
    return len(calls)


def test_helpers_inside_a_launch_do_not_patch_the_language_again(monkeypatch):
    import triton.runtime.interpreter as ti

    from kverr.gpu import interpreter

    if not interpreter.install():
        pytest.skip("this triton's interpreter has no patch step of that kind to wrap (it runs as shipped)")
    store, where = tl.store, tl.where
    _patches_of(1, monkeypatch)  # the first launch in a process patches a few attributes more, once
    few, many = _patches_of(2, monkeypatch), _patches_of(12, monkeypatch)
    assert few == many > 0  # without it, 20 more helper calls would patch the whole language 20 times more
    # the launch restored the language and left no state for the next one
    assert tl.store is store and tl.where is where
    assert interpreter._STATE["depth"] == 0 and not interpreter._STATE["patched"]
    assert ti._patch_lang.__module__ == "kverr.gpu.interpreter"
