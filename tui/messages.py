"""Messages the worker threads post to the app, each wrapping engine events.

Workers only ever call `post_message` with these (thread-safe); all widget
state changes happen in the handlers, on the UI thread. Generation posts one
`RoundCompleted` per round, never one message per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message

from specchat.engine.config import DecodeConfig
from specchat.engine.events import (
    Cancelled,
    Failed,
    LoadProgress,
    Notice,
    Ready,
    RoundEvent,
    SystemSample,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)


@dataclass
class LoadUpdated(Message):
    """A model loading stage progressed. A newer update of the same stage replaces a queued one."""

    progress: LoadProgress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadUpdated) and message.progress.stage == self.progress.stage


@dataclass
class BackendReady(Message):
    """The session is loaded and can take prompts."""

    backend: Any  # a ChatBackend
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


@dataclass
class RoundCompleted(Message):
    """One decoding round of reply `reply_id`: its tokens, then the round record.

    `round` is None when tokens arrive without a closing round (the stream
    ended mid-round); those tokens are still shown.
    """

    reply_id: int
    tokens: tuple[TokenEvent, ...]
    round: RoundEvent | None


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
