"""Every folder and file specchat keeps outside the project, in one place.

- the cache (`cache_root`): `$SPECCHAT_CACHE`, else `$XDG_CACHE_HOME/specchat`, else
  `~/.cache/specchat`. It holds the converted models (`models/<name>`), the built
  kernels (`kernels/<kernel>-<key>`), early-exit calibrations
  (`calibration/<weights key>.json`), quantized models kept for the next start
  (`packed/<weights sha256>-<code key>/`), draft heads trained by `specchat train-draft`
  (`heads/<weights sha256[:20]>/`) and the file-hash memo (`hashes.json`).
- the settings file (`config_path`): `$SPECCHAT_CONFIG`, else
  `$XDG_CONFIG_HOME/specchat/config.toml`, else `~/.config/specchat/config.toml`.

An explicit folder (`--cache-dir`) wins over the environment wherever one is taken.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECCHAT_CACHE"
CONFIG_ENV = "SPECCHAT_CONFIG"


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache folder: the argument, else $SPECCHAT_CACHE, else $XDG_CACHE_HOME/specchat."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specchat"


def models_dir(cache_dir: Path | str | None = None) -> Path:
    return cache_root(cache_dir) / "models"


def kernels_dir(cache_dir: Path | str | None = None) -> Path:
    return cache_root(cache_dir) / "kernels"


def calibration_dir(cache_dir: Path | str | None = None) -> Path:
    return cache_root(cache_dir) / "calibration"


def packed_dir(cache_dir: Path | str | None = None) -> Path:
    return cache_root(cache_dir) / "packed"


def heads_dir(cache_dir: Path | str | None = None) -> Path:
    """Draft heads trained here, one folder per target's weights (`<sha256[:20]>`)."""
    return cache_root(cache_dir) / "heads"


def hash_memo(cache_dir: Path | str | None = None) -> Path:
    return cache_root(cache_dir) / "hashes.json"


def config_path() -> Path:
    """The settings file: $SPECCHAT_CONFIG, else $XDG_CONFIG_HOME/specchat/config.toml."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "specchat" / "config.toml"
