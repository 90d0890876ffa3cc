"""The prompt line, with a history browsed by ↑ / ↓."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input


class PromptInput(Input):
    """An Input that remembers what was sent (also failed and cancelled prompts)."""

    BINDINGS = [
        Binding("up", "history(-1)", "Older prompt", show=False),
        Binding("down", "history(1)", "Newer prompt", show=False),
    ]

    def __init__(self, history: list[str] | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.history: list[str] = list(history or [])
        self._index: int | None = None  # position while browsing
        self._draft = ""  # what was typed before browsing
        self._blink_held: bool | None = None  # cursor_blink before hold_still(True)

    def remember(self, prompt: str) -> None:
        """Add a prompt to the history (not twice in a row) and stop browsing."""
        if prompt and (not self.history or self.history[-1] != prompt):
            self.history.append(prompt)
        self._index = None

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        if self._index is None:
            if step > 0:
                return
            self._draft = self.value
            self._index = len(self.history) - 1
        else:
            self._index += step
        if self._index < 0:
            self._index = 0
        if self._index >= len(self.history):
            self._index = None
            self.value = self._draft
        else:
            self.value = self.history[self._index]
        self.cursor_position = len(self.value)

    def hold_still(self, still: bool) -> None:
        """Stop the cursor blinking while a reply streams (each blink is a frame on the UI thread); then as before."""
        if still == (self._blink_held is not None):
            return
        if still:
            self._blink_held = self.cursor_blink
            self.cursor_blink = False
            return
        self.cursor_blink, self._blink_held = bool(self._blink_held), None
        if self.cursor_blink:
            # Textual resumes the timer at any phase, and even without focus
            if self.has_focus:
                self._restart_blink()
            else:
                self._pause_blink()

    def restore(self, prompt: str) -> None:
        """Put a prompt back into an empty input (after a failed turn)."""
        if not self.value:
            self.value = prompt
            self.cursor_position = len(prompt)
