"""The format catalog: calibration and ahead-of-time compilation read the same list."""

from __future__ import annotations

import pytest

from kverr import catalog as cat
from kverr.config import PRESETS, named_presets
from kverr.gpu import aot
from kverr.gpu.spec import kernel_spec


def test_calibration_candidates_are_the_catalogs():
    from kverr.calibration import candidates

    assert candidates.default_candidates is cat.default_candidates
    assert candidates.CALIBRATION_MSE_CLIP is cat.CALIBRATION_MSE_CLIP
    for budget in (2.5, 5.0):
        assert set(candidates.candidates_for_budget(budget, 64)) <= set(cat.catalog(64))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_format_offered_has_a_kernel_and_is_compiled_ahead_of_time(head_dim):
    fmts = cat.catalog(head_dim)
    assert len(fmts) == len(set(fmts))
    assert set(cat.preset_formats()) <= set(fmts) and set(cat.window_formats()) <= set(fmts)
    assert {f for c in PRESETS.values() for _, f in c._all_formats()} == set(cat.preset_formats())
    compiled = {kernel_spec(f, head_dim, 64) for f in aot.formats(True, 64, head_dim)}
    missing = [f.label() for f in fmts if kernel_spec(f, head_dim, 64) not in compiled]
    assert missing == []
    # the serving engines' formats run on the kernels too, their arithmetic options included
    engines = {f for c in named_presets().values() for _, f in c._all_formats()} - set(fmts)
    assert engines and all(kernel_spec(f, head_dim, 64) in compiled for f in engines)
