"""Test configuration shared by every test module.

Triton kernels run in the interpreter when no GPU is present. The variable must be set before
any kernel module is imported, which is why it is set here, at collection time.
"""

from __future__ import annotations

import os


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests: deterministic in CI, a bit more thorough locally when asked.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("KVERR_HYPOTHESIS_PROFILE", "ci"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random tiny Llama saved once per session: ``(directory, LoadedModel)``; tests read it and
    leave it as it is."""
    from kverr.capturing import load_model
    from kverr.capturing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "m", "llama")
    return path, load_model(str(path))
