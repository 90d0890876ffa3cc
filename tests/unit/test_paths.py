"""Every cache and config location comes from engine/paths.py, so they all agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.engine import paths
from specchat.engine.decode import exit_policy
from specchat.engine.model import native
from specchat.engine.weights import fetch, packed


def test_models_kernels_and_calibrations_share_the_xdg_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With XDG_CACHE_HOME set, calibrations used to land in ~/.cache while the models
    went to $XDG_CACHE_HOME: each kind of file now sits under the one cache root."""
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "specchat"
    assert paths.cache_root() == root
    assert fetch.model_dir("some-model") == root / "models" / "some-model"
    assert exit_policy.calibration_path("abc") == root / "calibration" / "abc.json"
    assert native.build_dir("w4a8").parent == root / "kernels"
    monkeypatch.setenv(packed.ENV, "1")
    where = packed.entry("ab" * 32)
    assert where is not None and where.folder.parent == root / "packed"
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "own"))
    assert exit_policy.calibration_path("abc") == tmp_path / "own" / "calibration" / "abc.json"
    assert native.build_dir("w4a8").parent == tmp_path / "own" / "kernels"


def test_an_explicit_folder_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "env"))
    assert exit_policy.calibration_path("k", tmp_path / "arg") == tmp_path / "arg" / "calibration" / "k.json"
    assert fetch.model_dir("m", tmp_path / "arg") == tmp_path / "arg" / "models" / "m"


def test_the_settings_file_follows_xdg_config_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(paths.CONFIG_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert paths.config_path() == tmp_path / "specchat" / "config.toml"


def test_no_module_but_paths_reads_the_cache_environment() -> None:
    engine = Path(paths.__file__).parent
    readers = [
        p.relative_to(engine)
        for p in engine.rglob("*.py")
        if p.name != "paths.py"
        and any(v in p.read_text(encoding="utf-8") for v in ('"SPECCHAT_CACHE"', '"XDG_CACHE_HOME"', '"XDG_CONFIG_HOME"'))
    ]
    assert readers == []
