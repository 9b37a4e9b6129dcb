"""The papers' emulated peers in ``kverr evaluate``: those fitted offline need the calibration
capture; all run beside each other and count their own bytes."""

from __future__ import annotations

import math

import pytest

from kverr.engines.emulated import emulated_peers
from kverr.evaluation import evaluate, parse_schemes
from kverr.exceptions import ConfigError
from kverr.peers import kvquant, oscar
from kverr.peers import turboquant as tq
from tests.captures import synthetic_capture

PAPERS = [*tq.VARIANTS, *oscar.VARIANTS, *kvquant.VARIANTS]


def _capture_of(lm, n_layers, n_tokens):
    """A synthetic capture recorded as the tiny model's (its weights' hash), of ``n_layers`` layers."""
    s = lm.shape
    ds = synthetic_capture(n_layers=n_layers, n_q=lm.model.config.num_attention_heads, n_kv=s.n_kv_heads,
                           head_dim=s.head_dim, n_tokens=n_tokens)
    ds.attrs["weights_sha256"] = lm.weights_sha256
    return ds


def test_every_paper_peer_is_registered_and_the_fitted_ones_need_a_capture():
    peers = emulated_peers()
    assert set(PAPERS) <= set(peers)
    for name in PAPERS:
        fitted = name.startswith(("oscar", "kvquant"))
        assert (peers[name].fit is not None) == fitted
        if fitted:
            with pytest.raises(ConfigError, match="--calibration"):
                parse_schemes([name])


def test_the_paper_peers_run_in_evaluate(tiny_llama, tmp_path):
    from kverr.capturing.text import Text
    from kverr.io import write_dataset

    _, lm = tiny_llama
    s = lm.shape
    cap = write_dataset(_capture_of(lm, s.n_layers, 128), tmp_path / "cal.zarr")
    text = Text(text=" ".join(["cache key value softmax token layer"] * 60), source="words", sha256="0" * 64)
    names = ["turboquant-2.5", "oscar-int2-s4r32", "kvquant-2bit-1pct"]
    df = evaluate(lm, text, parse_schemes(names, calibration=str(cap)), prefill=[48], decode=16, segments=1,
                  offset=0, progress=False).set_index("scheme")
    for name in names:
        row = df.loc[name]
        want = emulated_peers()[name].account(s, 64).effective_bits
        assert row["kind"] == "emulated" and row["mean_kl"] > 0 and not math.isnan(want)
        assert row["effective_bits"] == pytest.approx(want)


def test_a_capture_of_another_model_or_shape_is_refused(tiny_llama, tmp_path):
    from kverr.capturing.text import Text
    from kverr.io import write_dataset

    _, lm = tiny_llama
    s = lm.shape
    cap = write_dataset(_capture_of(lm, s.n_layers + 1, 32), tmp_path / "cal.zarr")
    text = Text(text=" ".join(["cache key value"] * 60), source="words", sha256="0" * 64)
    with pytest.raises(ConfigError, match="layers, kv heads, head dim"):
        evaluate(lm, text, parse_schemes(["oscar-int2"], calibration=str(cap)), prefill=[16], decode=4,
                 segments=1, offset=0, progress=False)
    other = write_dataset(synthetic_capture(n_layers=s.n_layers, n_q=lm.model.config.num_attention_heads,
                                            n_kv=s.n_kv_heads, head_dim=s.head_dim, n_tokens=32), tmp_path / "o.zarr")
    with pytest.raises(ConfigError, match="capture of another model"):
        evaluate(lm, text, parse_schemes(["oscar-int2"], calibration=str(other)), prefill=[16], decode=4,
                 segments=1, offset=0, progress=False)
