"""``ds.kv``: capture metadata with its fallbacks, on the committed capture and edited copies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kverr.dims import LAYER
from kverr.io import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-pydoc-512.zarr"


@pytest.fixture(scope="module")
def ds():
    return open_capture(DATA)


def test_recorded_metadata(ds):
    kv = ds.kv
    assert kv.n_layers == int(ds.attrs["model_n_layers"]) == 30
    assert (kv.n_kv_heads, kv.n_q_heads, kv.head_dim) == (3, 9, 64)
    assert kv.rope == json.loads(ds.attrs["rope"])
    assert kv.attn_scale(kv.layers[-1]) == float(ds["attn_scale"].values[-1])
    np.testing.assert_array_equal(kv.positions, ds["position"].values)
    assert kv.shape.n_layers == 30 and kv.provenance["n_layers"] == 30


def test_fallbacks_for_a_subset_without_recorded_attrs(ds):
    # Keep the first two captured layers and drop what older captures lacked: the model's layer count is one
    # past the highest layer index (not the dataset's layer size), and the scale is 1/sqrt(d).
    sub = ds.isel({LAYER: [0, 1]}).drop_vars(["attn_scale", "position"])
    sub.attrs = {k: v for k, v in sub.attrs.items() if k not in ("model_n_layers", "rope")}
    layer = int(sub[LAYER].values[1])
    assert sub.kv.layers == [int(x) for x in ds[LAYER].values[[0, 1]]]
    assert sub.kv.n_layers == layer + 1
    assert sub.kv.attn_scale(layer) == 1 / math.sqrt(64)
    assert sub.kv.rope is None
    np.testing.assert_array_equal(sub.kv.positions, np.arange(sub.sizes["token"]))
    assert sub.kv.sliding_window(layer) == 0 and not sub.kv.has_sliding_window
