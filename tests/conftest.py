"""Fixtures shared by the test suites."""

from __future__ import annotations

import os

# Idle OpenMP threads must not spin while another test process or thread needs
# the core (read at torch import, so set before any test module imports torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A test sees the load it asks for (its stages, its quantization), not packed weights an
# earlier test or run left in the cache; test_packed.py turns the cache on in its own folder.
os.environ.setdefault("SPECCHAT_PACKED_CACHE", "0")

from pathlib import Path

import pytest
from hypothesis import settings

# Property tests explore new examples on a developer's runs and keep the ones that fail
# (hypothesis' example database); under CI every run draws the same examples, so a
# submission's result does not hang on which random inputs one run happened to draw.
# A failure there prints the example's blob to reproduce it with @reproduce_failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("SPECCHAT_HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache of its own; the hub is marked offline so nothing goes out."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECCHAT_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="session")
def stories260k_dir() -> Path:
    """The real tiny test model (../shared/models/stories260k); skips when it is absent."""
    from specchat.engine.weights import registry

    folder = registry.get("stories260k").local_folder()
    if folder is None or not (folder / "config.json").is_file():
        pytest.skip(f"stories260k not found at {folder} (set SPECCHAT_STORIES260K)")
    return folder


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Tiny models run fastest on one thread; two threads contend badly on a shared 2-core box."""
    import torch

    torch.set_num_threads(1)
