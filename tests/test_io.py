"""Atomic writes, lazy reads and schema checks of capture datasets (no model needed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import kverr.io as kio
from kverr.dims import CAPTURE_VARS, KV_HEAD_OF_Q, SCHEMA_VERSION
from kverr.exceptions import CaptureError, OutputExistsError
from kverr.io import open_capture, validate_capture, write_dataset

from captures import synthetic_capture

REPO = Path(__file__).resolve().parents[1]


def test_round_trip_is_exact_lazy_and_chunked_by_layer(tmp_path):
    ds = synthetic_capture()
    out = write_dataset(ds, tmp_path / "a" / "c.zarr")
    back = open_capture(out)
    for name in CAPTURE_VARS:
        assert back[name].chunks is not None, f"{name} should be dask-backed"
        assert np.array_equal(back[name].values, ds[name].values)
    assert back.k.chunks[0] == (1, 1)
    assert back.k.chunks[2] == (64,)
    assert back.attrs == ds.attrs and back.kv.rope["rope_theta"] == 1e4
    assert list(back[KV_HEAD_OF_Q].values) == [0, 0, 1, 1]
    assert not list(out.parent.glob(".c.zarr.*"))


def test_long_captures_are_also_chunked_by_token(tmp_path, monkeypatch):
    monkeypatch.setattr(kio, "TOKEN_CHUNK", 24)
    back = open_capture(write_dataset(synthetic_capture(n_tokens=64), tmp_path / "c.zarr"))
    assert back.q.chunks[2] == (24, 24, 16)


def test_rewriting_an_opened_capture_rechunks_it(tmp_path, monkeypatch):
    first = open_capture(write_dataset(synthetic_capture(n_tokens=64), tmp_path / "a.zarr"))
    monkeypatch.setattr(kio, "TOKEN_CHUNK", 32)
    second = open_capture(write_dataset(first.isel(layer=[1]), tmp_path / "b.zarr"))
    assert second.k.chunks[2] == (32, 32)
    assert np.array_equal(second.k.values, first.k.values[1:])


def test_existing_output_is_refused_then_replaced_with_overwrite(tmp_path):
    out = write_dataset(synthetic_capture(seed=1), tmp_path / "c.zarr")
    with pytest.raises(OutputExistsError, match="already exists.*--overwrite"):
        write_dataset(synthetic_capture(seed=2), out)
    assert np.array_equal(open_capture(out).k.values, synthetic_capture(seed=1).k.values)
    write_dataset(synthetic_capture(seed=2), out, overwrite=True)
    assert np.array_equal(open_capture(out).k.values, synthetic_capture(seed=2).k.values)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr"]


def test_overwrite_never_deletes_a_directory_of_other_data(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("...")
    with pytest.raises(OutputExistsError, match="not a zarr store"):
        write_dataset(synthetic_capture(), precious, overwrite=True)
    assert (precious / "thesis.tex").exists()


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_interrupted_write_leaves_nothing_at_the_final_path(tmp_path, monkeypatch, exc):
    real = xr.Dataset.to_zarr

    def half_write(self, store, *args, **kwargs):
        real(self[["q"]], store, *args, **kwargs)  # part of the store is on disk...
        raise exc("interrupted")  # ...when the write dies

    monkeypatch.setattr(xr.Dataset, "to_zarr", half_write)
    with pytest.raises(exc):
        write_dataset(synthetic_capture(), tmp_path / "c.zarr")
    assert list(tmp_path.iterdir()) == [], "neither the target nor a temporary store may remain"


def test_interrupted_overwrite_keeps_the_old_capture(tmp_path, monkeypatch):
    out = write_dataset(synthetic_capture(seed=1), tmp_path / "c.zarr")
    monkeypatch.setattr(xr.Dataset, "to_zarr", lambda *a, **k: (_ for _ in ()).throw(Boom()))
    with pytest.raises(Boom):
        write_dataset(synthetic_capture(seed=2), out, overwrite=True)
    assert np.array_equal(open_capture(out).k.values, synthetic_capture(seed=1).k.values)


@pytest.mark.parametrize("when", ["during_write", "before_rename"])
def test_a_killed_writer_never_leaves_a_dataset_at_the_final_path(tmp_path, when):
    """SIGKILL (no cleanup handlers run) mid-write, or after the write before the rename."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / "tests")!r})
        import xarray as xr
        import kverr.io as kio
        from captures import synthetic_capture
        real = xr.Dataset.to_zarr
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        if {when!r} == "during_write":
            def half(self, store, *a, **k):
                real(self[["q", "k"]], store, *a, **k)
                die()
            xr.Dataset.to_zarr = half
        else:
            kio._replace = die
        kio.write_dataset(synthetic_capture(), {str(tmp_path / "c.zarr")!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (tmp_path / "c.zarr").exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".c.zarr.tmp-")
    with pytest.raises(CaptureError, match="no capture"):
        open_capture(tmp_path / "c.zarr")
    # A later write to the same path works normally.
    write_dataset(synthetic_capture(), tmp_path / "c.zarr")
    assert open_capture(tmp_path / "c.zarr").sizes["token"] == 64


def test_open_capture_errors(tmp_path):
    with pytest.raises(CaptureError, match="no capture at"):
        open_capture(tmp_path / "missing.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CaptureError, match="not a zarr store"):
        open_capture(tmp_path / "plain")
    broken = tmp_path / "broken.zarr"
    broken.mkdir()
    (broken / "zarr.json").write_text("{not json")
    with pytest.raises(CaptureError, match="cannot open"):
        open_capture(broken)

    def written(ds, name):
        path = tmp_path / name
        ds.to_zarr(path, consolidated=False)
        return path

    old = synthetic_capture()
    old.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(CaptureError, match="schema version"):
        open_capture(written(old, "v.zarr"))
    with pytest.raises(CaptureError, match="variable 'k_pre'"):
        open_capture(written(synthetic_capture().drop_vars("k_pre"), "nokpre.zarr"))
    with pytest.raises(CaptureError, match="not a kverr capture"):
        open_capture(written(xr.Dataset({"x": ("a", np.zeros(3))}), "other.zarr"))


def test_validate_capture_names_what_is_wrong(tmp_path):
    ds = synthetic_capture()
    validate_capture(ds)
    with pytest.raises(CaptureError, match="dims"):
        validate_capture(ds.assign(k=ds.k.transpose("layer", "token", "kv_head", "channel")))
    bad = ds.copy()
    del bad.attrs["weights_sha256"]
    with pytest.raises(CaptureError, match="weights_sha256"):
        validate_capture(bad)
    with pytest.raises(CaptureError, match=KV_HEAD_OF_Q):
        validate_capture(ds.drop_vars(KV_HEAD_OF_Q))
    with pytest.raises(CaptureError, match="head_dim"):
        validate_capture(ds.assign_attrs(head_dim=8))
    with pytest.raises(CaptureError, match="rope"):
        validate_capture(ds.assign_attrs(rope="{oops"))
    # write_dataset refuses to store a malformed capture.
    with pytest.raises(CaptureError):
        write_dataset(ds.drop_vars("v"), tmp_path / "never.zarr")
    assert not list(tmp_path.iterdir())
