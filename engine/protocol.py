"""The small interface the UI and the headless commands drive.

`ChatSession` implements it on real models; a replay of a recorded trace
implements it too, which is how the UI is tested without torch. The UI holds a
backend by this type and reads nothing else of it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from .config import DecodeConfig
from .events import Event, Ready


class ChatBackend(Protocol):
    ready: Ready
    """What was loaded and how it will decode (models, devices, notes), for the panels."""

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Add a user turn and stream the reply as events.

        Yields TurnStarted, then per round its TokenEvents followed by one
        RoundEvent, and ends with exactly one of TurnFinished, Cancelled or
        Failed. Cancellation is checked between rounds; the session stays
        usable afterwards. Errors are yielded as Failed, not raised.
        """
        ...

    def regenerate(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Drop the last reply and answer the last user turn again."""
        ...

    def continue_reply(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Decode more of the last reply, which the token limit (stop_reason "max_tokens") cut.

        Streams like `stream`: TurnStarted, then TokenEvents carrying only the
        added text and RoundEvents, then one of TurnFinished, Cancelled or
        Failed. TurnFinished.stats.text and Cancelled.text hold the whole
        reply (the earlier part and the continuation); stats.tokens counts the
        tokens of this continuation only, which config.max_new_tokens bounds.
        Yields Failed when the last turn is not a reply the limit cut.
        """
        ...

    @property
    def can_continue(self) -> bool:
        """Whether the last reply was cut by the token limit and can be continued."""
        ...

    def reset(self) -> None:
        """Start a new conversation (keeps the system prompt)."""
        ...

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        """The conversation so far as (role, content) pairs."""
        ...
