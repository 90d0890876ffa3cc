"""Helpers for the pilot and snapshot tests: the app on replayed traces, never on real models."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from textual.pilot import Pilot

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import Provenance, RoundEvent, SystemSample, TokenEvent, TurnStarted
from specchat.engine.tools.replay import ReplaySession, synthesize_trace
from specchat.tui.app import SpecChatApp

SIZE = (160, 48)

# Three replies, each recorded in spec, plain and early-exit mode (deterministic).
TRACE = synthesize_trace(modes=(Mode.SPEC, Mode.PLAIN, Mode.EARLY_EXIT), seed=0)

FIXED_SAMPLE = SystemSample(
    cpu_percent_per_core=(37.5, 62.5),
    process_cpu_percent=88.0,
    rss_bytes=512 * 2**20,
    draft_device="cpu",
    target_device="cpu",
)


def make_app(backend: Any = None, **kwargs: Any) -> SpecChatApp:
    session = backend if backend is not None else ReplaySession(TRACE)
    kwargs.setdefault("sample_system", False)
    return SpecChatApp(lambda progress: session, **kwargs)


async def wait_until(pilot: Pilot, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def run_from_palette(pilot: Pilot, text: str) -> None:
    """Open the command palette, type `text` and press Enter once the palette's highlighted
    hit is the command that starts with it (results come in batches, later on a loaded
    machine: Enter before them only highlights)."""
    from textual.command import CommandList, CommandPalette

    app = pilot.app
    await pilot.press("ctrl+p")
    await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette))
    await pilot.press(*text)

    def chosen() -> bool:
        hits = app.screen.query_one(CommandList)
        i = hits.highlighted
        hit = getattr(hits.get_option_at_index(i), "hit", None) if i is not None else None
        return hit is not None and (hit.text or "").startswith(text)

    await wait_until(pilot, chosen)
    await pilot.press("enter")


async def ready(pilot: Pilot) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.backend is not None or app.load_error is not None)  # type: ignore[attr-defined]
    await pilot.pause()


async def send(pilot: Pilot, text: str) -> None:
    """Type a prompt, press enter, and wait for the reply to end and the panels to redraw."""
    app = pilot.app
    await pilot.press(*text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: app._busy is None)  # type: ignore[attr-defined]
    await pilot.pause()
    app._refresh_panels()  # type: ignore[attr-defined]
    await pilot.pause()


class GatedSession:
    """A replay that stops after each round until the test lets it go on."""

    def __init__(self, inner: ReplaySession) -> None:
        self.inner = inner
        self.ready = inner.ready
        self.gate = threading.Semaphore(0)
        self.rounds_out = 0

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def _gated(self, events: Iterator[Any], cancel: threading.Event | None) -> Iterator[Any]:
        for ev in events:
            yield ev
            if isinstance(ev, RoundEvent):
                self.rounds_out += 1
                while not self.gate.acquire(timeout=0.02):
                    if cancel is not None and cancel.is_set():
                        break

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        return self._gated(self.inner.stream(prompt, config, cancel), cancel)

    def regenerate(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        return self._gated(self.inner.regenerate(config, cancel), cancel)

    def continue_reply(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        return self._gated(self.inner.continue_reply(config, cancel), cancel)

    @property
    def can_continue(self) -> bool:
        return self.inner.can_continue

    def reset(self) -> None:
        self.inner.reset()

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        return self.inner.messages


class ExplodingSession:
    """A backend whose stream raises in the middle of a reply (a bug in the engine)."""

    def __init__(self) -> None:
        self.ready = ReplaySession(TRACE).ready
        self.calls = 0

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        self.calls += 1
        yield TurnStarted(1, 5, 5, config.mode)
        yield TokenEvent(1, "Hel", Provenance.TARGET, 0, t=1.0)
        yield RoundEvent(0, config.mode, 0, 0, 0.0, 5.0)
        raise RuntimeError("tensor on fire")

    def regenerate(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        return self.stream("", config, cancel)

    def continue_reply(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        return self.stream("", config, cancel)

    @property
    def can_continue(self) -> bool:
        return False

    def reset(self) -> None:
        pass

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        return ()
