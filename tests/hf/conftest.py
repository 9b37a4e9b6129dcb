"""The small random transformers model the cache tests run inside (built once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from kverr.capturing import load_model
    from kverr.capturing.tiny import make_tiny_model

    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama")))
