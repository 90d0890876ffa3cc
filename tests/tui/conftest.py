"""Fixtures of the UI tests: a steady cursor, and a settings file of each test's own."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from textual.widgets import Input


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run `async def` tests (Textual pilots) in a fresh event loop, without a plugin."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{n: pyfuncitem.funcargs[n] for n in names}))
    return True


@pytest.fixture(autouse=True)
def no_cursor_blink(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady cursor: snapshots and timings do not depend on the blink phase."""
    monkeypatch.setattr(Input.cursor_blink, "_default", False)


@pytest.fixture(autouse=True)
def isolated_config(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test gets its own settings file location; the user's is never touched."""
    path = tmp_path / "config" / "config.toml"
    monkeypatch.setenv("SPECCHAT_CONFIG", str(path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return path
