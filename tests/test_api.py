"""``import kverr as kv``: every public name resolves, lazily, to the one definition."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kverr

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(kverr._EXPORTS))
def test_each_name_is_the_definition_in_its_module(name):
    module, attr = kverr._EXPORTS[name]
    assert getattr(kverr, name) is getattr(importlib.import_module(module), attr)
    assert name in dir(kverr) and name in kverr.__all__


def test_no_public_name_is_shadowed_by_a_submodule():
    # Importing a submodule sets it as an attribute of the package; a function of the same name
    # would be replaced by the module the first time anything imported it.
    submodules = {m.name for m in pkgutil.iter_modules(kverr.__path__)}
    assert not submodules & set(kverr._EXPORTS), submodules & set(kverr._EXPORTS)


def test_import_kverr_needs_neither_xarray_nor_transformers_nor_triton():
    code = ("import sys, kverr; kverr.CacheConfig; kverr.quantize; "
            "print(sorted(m for m in ('xarray', 'dask', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kverr.nope  # noqa: B018


def test_module_docstring_example_runs():
    # The example at the top of kverr/__init__.py, on the committed capture.
    import kverr as kv

    ds = kv.open_capture(ROOT / "data" / "smollm2-pydoc-512.zarr")
    cfg = kv.resolve("kivi-4")
    assert kv.account(cfg, ds.kv.shape, tokens=4096).effective_bits > 4
    dec = kv.decompose(ds, cfg, queries=8, layers=[int(ds.layer[0])]).compute()
    assert {"key_share", "value_share", "cross_share"} <= set(dec.data_vars)
    k_hat = kv.reconstruct(ds.k.sel(layer=0).values, cfg, layer=0, which="k")
    assert tuple(k_hat.shape) == ds.k.sel(layer=0).shape
