"""Chat settings kept between runs in a TOML file.

The file is `$SPECCHAT_CONFIG` if set, else
`$XDG_CONFIG_HOME/specchat/config.toml` (default `~/.config/specchat/`).
Command-line flags override it. A file that is not valid TOML gives a
message and the defaults, and is then left alone: nothing is written over
it until the user fixes or removes it. A single bad value is reported and
replaced by its default; the rest of the file still applies.

    theme = "specchat-dark"
    view = "markdown"              # or "tokens": how finished replies show
    panels = ["acceptance", "latency"]

    [models]                       # optional; --target / --draft override
    target = "..."
    draft = "..."

    [decode]
    mode = "spec"                  # plain | spec | eagle | lookup | self-spec | early-exit
    k = "auto"                     # or an integer
    temperature = 0.0
    top_p = 1.0
    top_k = 0
    max_new_tokens = 2048          # reply limit; a reply it cuts says so and can continue
    exit_budget = 0.95
    seed = 1234                    # optional
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.paths import config_path
from specchat.themes import DEFAULT_THEME

PANELS = ("acceptance", "latency", "devices", "early-exit")
VIEWS = ("markdown", "tokens")

# A chat reply runs to its end of sequence (or the end of the context): the
# limit only guards against a model that rambles. `specchat generate` and the
# benchmarks keep DecodeConfig's shorter default.
CHAT_MAX_NEW_TOKENS = 2048

# [decode] keys and the DecodeConfig field each one sets.
_DECODE_KEYS = (
    "mode",
    "k",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "exit_budget",
    "exit_threshold",
    "exit_layer",
    "seed",
)


@dataclass
class Settings:
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(max_new_tokens=CHAT_MAX_NEW_TOKENS))
    theme: str = DEFAULT_THEME
    view: str = "markdown"
    panels: tuple[str, ...] = ("acceptance", "latency")
    target: str | None = None
    draft: str | None = None


def decode_to_toml(cfg: DecodeConfig) -> dict[str, Any]:
    """The [decode] table for a config (None values left out)."""
    out: dict[str, Any] = {
        "mode": cfg.mode.value,
        "k": "auto" if cfg.k is None else cfg.k,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "exit_budget": cfg.exit_budget,
    }
    for key in ("exit_threshold", "exit_layer", "seed"):
        value = getattr(cfg, key)
        if value is not None:
            out[key] = value
    return out


def _decode_value(key: str, value: Any) -> Any:
    if key == "mode":
        return Mode(value)
    if key == "k":
        if value in ("auto", None):
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"k must be \"auto\" or an integer, got {value!r}")
        return value
    if key in ("temperature", "top_p", "exit_budget", "exit_threshold"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


class SettingsStore:
    """Reads and updates the settings file. `problems` lists what was wrong with it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or config_path()
        self.problems: list[str] = []
        self.corrupt = False

    def load(self) -> Settings:
        self.problems = []
        self.corrupt = False
        settings = Settings()
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return settings
        except OSError as exc:
            self.corrupt = True
            self.problems.append(f"cannot read {self.path}: {exc.strerror or exc}; using defaults")
            return settings
        try:
            data = tomllib.loads(raw)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            self.corrupt = True
            self.problems.append(
                f"{self.path} is not valid TOML ({exc}); using defaults. "
                "Settings will not be saved until the file is fixed or removed."
            )
            return settings
        return self._apply(data, settings)

    def _apply(self, data: dict[str, Any], s: Settings) -> Settings:
        theme = data.get("theme")
        if theme is not None:
            if isinstance(theme, str) and theme:
                s.theme = theme
            else:
                self.problems.append(f"theme must be a name, got {theme!r}")
        view = data.get("view")
        if view is not None:
            if view in VIEWS:
                s.view = view
            else:
                self.problems.append(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
        panels = data.get("panels")
        if panels is not None:
            if isinstance(panels, list) and all(p in PANELS for p in panels):
                s.panels = tuple(dict.fromkeys(panels))
            else:
                self.problems.append(f"panels must list some of {', '.join(PANELS)}, got {panels!r}")
        models = data.get("models", {})
        if isinstance(models, dict):
            for role in ("target", "draft"):
                value = models.get(role)
                if value is None:
                    continue
                if isinstance(value, str) and value:
                    setattr(s, role, value)
                else:
                    self.problems.append(f"models.{role} must be a model name, got {value!r}")
        else:
            self.problems.append("[models] must be a table")
        decode = data.get("decode", {})
        if not isinstance(decode, dict):
            self.problems.append("[decode] must be a table")
            return s
        cfg = s.decode
        for key, value in decode.items():
            if key not in _DECODE_KEYS:
                self.problems.append(f"decode.{key} is not a setting; ignored")
                continue
            try:
                cfg = cfg.with_(**{key: _decode_value(key, value)})
            except (ValueError, TypeError) as exc:
                self.problems.append(f"decode.{key}: {exc}; using {getattr(cfg, key)!r}")
        s.decode = cfg
        return s

    def save(self, changes: dict[str, Any]) -> bool:
        """Merge `changes` (top-level keys; "decode" and "models" are merged as tables) into the file.

        Keys the user set by hand are kept; a value None removes its key.
        Returns False, writing nothing, when the file on disk is unreadable or
        not valid TOML (it is never replaced silently).
        """
        try:
            data = tomllib.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            data = {}
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            self.corrupt = True
            return False
        self.corrupt = False
        for key, value in changes.items():
            if isinstance(value, dict):
                table = data.get(key)
                table = dict(table) if isinstance(table, dict) else {}
                for sub, sub_value in value.items():
                    if sub_value is None:
                        table.pop(sub, None)
                    else:
                        table[sub] = sub_value
                data[key] = table
            elif value is None:
                data.pop(key, None)
            else:
                data[key] = list(value) if isinstance(value, tuple) else value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".toml", dir=self.path.parent)
            with os.fdopen(fd, "wb") as fh:
                tomli_w.dump(data, fh)
            os.replace(tmp, self.path)
        except OSError:
            return False
        return True
