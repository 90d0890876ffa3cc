"""The prompt line, with a history browsed by ↑ / ↓.

A pasted text keeps every line: the line shows each line break as ↵ and the
prompt sent has them back (Textual's Input keeps a paste's first line only, and
a chat about code is mostly pasted code)."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.widgets import Input

NEWLINE = "↵"  # a line break of the prompt, as the one-line input shows it


def fold(prompt: str) -> str:
    """The prompt as the line shows it: line breaks as NEWLINE."""
    return prompt.replace("\r\n", "\n").replace("\r", "\n").replace("\n", NEWLINE)


def unfold(line: str) -> str:
    """The prompt a line holds: NEWLINE back to line breaks."""
    return line.replace(NEWLINE, "\n")


class PromptInput(Input):
    """An Input that remembers what was sent (also failed and cancelled prompts), and keeps
    every line of a paste. `value` is the line as shown; `prompt` the text it sends."""

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

    @property
    def prompt(self) -> str:
        return unfold(self.value)

    def show(self, prompt: str) -> None:
        """Put a prompt in the line, the cursor at its end."""
        self.value = fold(prompt)
        self.cursor_position = len(self.value)

    def _on_paste(self, event: events.Paste) -> None:
        event.prevent_default()  # Input's own handler would insert the first line again
        if event.text:
            text = fold(event.text)
            if self.selection.is_empty:
                self.insert_text_at_cursor(text)
            else:
                self.replace(text, *self.selection)
        event.stop()

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
            self.cursor_position = len(self.value)
        else:
            self.show(self.history[self._index])

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
            self.show(prompt)
