"""Messages the worker threads post to the app, each wrapping engine events.

Workers only ever call `post_message` with these (thread-safe); all widget
state changes happen in the handlers, on the UI thread. Generation hands
rounds over in `RoundsCompleted` batches: one message per redraw of the
reply, never one per token (nor, on a fast model, one per round).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from textual.message import Message

from specchat.engine.config import DecodeConfig
from specchat.engine.events import (
    Cancelled,
    Failed,
    LoadProgress,
    Notice,
    Ready,
    RoundEvent,
    ServerStats,
    SystemSample,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from specchat.engine.protocol import ChatBackend


@dataclass
class LoadUpdated(Message):
    """A model loading stage progressed. A newer update of the same stage replaces a queued one."""

    progress: LoadProgress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadUpdated) and message.progress.stage == self.progress.stage


@dataclass
class BackendReady(Message):
    """The session is loaded and can take prompts."""

    backend: ChatBackend
    ready: Ready


@dataclass
class BackendFailed(Message):
    """Loading failed; `hint` says what to do."""

    message: str
    hint: str = ""


@dataclass
class GenerationStarted(Message):
    """The engine began reply `reply_id`; `submitted` is the perf_counter time of the request."""

    reply_id: int
    started: TurnStarted
    submitted: float


# One decoding round as the UI receives it: its tokens, then its record (None
# when the stream ended mid-round; those tokens are still shown).
StreamedRound = tuple[tuple[TokenEvent, ...], RoundEvent | None]


class RoundsCompleted(Message):
    """Decoding rounds of reply `reply_id`, in order, handed over as one batch.

    The generate worker posts a batch and keeps adding rounds to it until the
    UI thread takes it (at most one redraw per interval); the next round
    opens a new batch. Every round arrives once, in order; the number of
    messages follows the redraw rate, not the decoding rate.
    """

    def __init__(self, reply_id: int) -> None:
        super().__init__()
        self.reply_id = reply_id
        self._lock = threading.Lock()
        self._rounds: list[StreamedRound] = []
        self._taken = False

    def add(self, tokens: tuple[TokenEvent, ...], rnd: RoundEvent | None) -> bool:
        """Worker side: add a round; False once the UI has taken the batch (open a new one)."""
        with self._lock:
            if self._taken:
                return False
            self._rounds.append((tokens, rnd))
            return True

    def take(self) -> tuple[StreamedRound, ...]:
        """UI side: close the batch and return its rounds."""
        with self._lock:
            self._taken = True
            return tuple(self._rounds)

    @property
    def rounds(self) -> tuple[StreamedRound, ...]:
        with self._lock:
            return tuple(self._rounds)


@dataclass
class EngineNotice(Message):
    """Something the engine wants the user to know, not an error."""

    reply_id: int | None
    notice: Notice


@dataclass
class GenerationEnded(Message):
    """Reply `reply_id` is over: finished, cancelled or failed."""

    reply_id: int
    outcome: TurnFinished | Cancelled | Failed
    config: DecodeConfig


@dataclass
class SystemSampled(Message):
    """A CPU/GPU sample from the probe thread; a newer one replaces a queued one."""

    sample: SystemSample

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SystemSampled)


@dataclass
class ServerSampled(Message):
    """A served engine's figures for reply `reply_id`; a newer one replaces a queued one."""

    reply_id: int
    stats: ServerStats

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ServerSampled) and not message.stats.final
