"""A reply's tokens styled by provenance, drawn a block of paragraphs per widget.

A streaming reply only changes at its end. Drawn as one Text, every redraw
wrapped and painted the whole reply again: work on the UI thread that grows
with the reply, while the engine waits for the GIL. One widget per paragraph
(the text up to a newline) made every new line a mount, and every layout
cost grow with the widgets on screen. Here each widget (a `TokenBlock`) holds
up to BLOCK_PARAGRAPHS paragraphs: finished blocks keep their rendering, a
redraw appends the new tokens to the last block and repaints only that one,
and the last block of a streaming reply reserves its height RESERVE_LINES
lines at a time, so most new lines repaint without laying the screen out.
The screen shows the same lines as one Text would wrap to, since a newline
starts a new line either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from rich.style import Style
from rich.text import Text
from textual import events
from textual.containers import Vertical
from textual.geometry import Size
from textual.message import Message
from textual.reactive import Reactive
from textual.widgets import Static

from specchat.engine.events import Provenance, TokenEvent

from ..redraw import redraw, release
from .tokens import TOKEN_COMPONENTS, cursor_style, provenance_styles, token_css


class TokenSource(Protocol):
    """What the body draws from (the reply it belongs to): its tokens, the inspector's
    cursor, and whether the reply has finished streaming."""

    tokens: list[TokenEvent]
    cursor: int | None

    @property
    def finished(self) -> bool: ...


PLACEHOLDER = Text("…", style=Style(dim=True), end="")
BLOCK_PARAGRAPHS = 8  # paragraphs per widget
RESERVE_LINES = 6  # the last block of a streaming reply grows this many lines at a time


def extend_paragraphs(
    paragraphs: list[Text],
    tokens: Sequence[TokenEvent],
    start: int,
    styles: dict[Provenance, Style],
    cursor: int | None = None,
    cursor_on: Style | None = None,
) -> None:
    """Append `tokens` (numbered from `start`) to `paragraphs`, opening a new one at each newline.

    Each piece is styled by provenance and tagged with its token index (for
    clicks). The token under `cursor` gets `cursor_on`, and an empty or blank
    one a visible marker.
    """
    if not paragraphs:
        paragraphs.append(Text(end=""))
    for i, tok in enumerate(tokens, start):
        style = styles[tok.provenance] + Style(meta={"token": i})
        text = tok.text
        if i == cursor:
            if text == "" or text.isspace():
                # make an empty or blank token visible while it is selected
                text = "∅" if text == "" else text.replace("\n", "⏎\n").replace(" ", "␣")
            style += cursor_on or Style()
        if not text:
            continue
        first, *rest = text.split("\n")
        if first:
            paragraphs[-1].append(first, style)
        for piece in rest:
            paragraphs.append(Text(end=""))
            if piece:
                paragraphs[-1].append(piece, style)


# Textual lays the whole screen out a second time, in the next frame, when a
# widget's virtual (scrollable) size changes. These widgets do not scroll and
# have just been laid out at their new size: a repaint is all they need.
STILL_VIRTUAL_SIZE: Reactive[Size] = Reactive(Size(0, 0), layout=False)


class TokenBlock(Static):
    """Up to BLOCK_PARAGRAPHS paragraphs of a reply's tokens, newlines between them."""

    DEFAULT_CSS = "TokenBlock { height: auto; }"
    virtual_size = STILL_VIRTUAL_SIZE


class TokenBody(Vertical):
    """The reply's tokens; each span styled by provenance and tagged with its index.

    `sync()` brings it up to date with its reply: while the reply streams it
    appends; when the token cursor moves or the styles change (theme, CSS) it
    builds the paragraphs again and repaints those that differ.
    """

    COMPONENT_CLASSES = TOKEN_COMPONENTS
    DEFAULT_CSS = token_css("TokenBody") + "\nTokenBody { height: auto; }"
    virtual_size = STILL_VIRTUAL_SIZE

    class Clicked(Message):
        """A token was clicked."""

        def __init__(self, body: TokenBody, index: int) -> None:
            super().__init__()
            self.body = body
            self.index = index

    def __init__(self, reply: TokenSource, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reply = reply
        self._styles: dict[Provenance, Style] | None = None
        self._paragraphs: list[Text] = []  # what the blocks show
        self._widgets: list[TokenBlock] = []  # block b shows paragraphs [b·BLOCK_PARAGRAPHS, (b+1)·BLOCK_PARAGRAPHS)
        self._built: int | None = None  # tokens in _paragraphs when built by appending, else None
        self._cursor: int | None = None  # the cursor _paragraphs were built with
        self._mounted = False

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._restyle())
        self._mounted = True  # `is_mounted` only turns true after this handler
        self.sync()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        if self._mounted:
            self.call_later(self._restyle)

    def _restyle(self) -> None:
        if self._styles is not None and provenance_styles(self) != self._styles:
            self._styles = None
            self.sync()

    @property
    def text(self) -> Text:
        """The styled text of the paragraphs as shown, newlines between them."""
        return Text("\n", end="").join(self._paragraphs)

    def sync(self) -> None:
        """Show the reply's tokens, cursor and styles; repaint only the blocks that changed."""
        if not self._mounted:
            return
        reply = self.reply
        tokens = reply.tokens
        cursor = reply.cursor
        restyled = self._styles is None
        if self._styles is None:
            self._styles = provenance_styles(self)
        styles = self._styles
        if not tokens:
            self._show([Text(end="")] if reply.finished else [PLACEHOLDER.copy()])
            self._built = None
        elif not restyled and cursor is None and self._cursor is None and self._built is not None:
            if self._built < len(tokens):
                first = len(self._paragraphs) - 1
                extend_paragraphs(self._paragraphs, tokens[self._built :], self._built, styles)
                self._built = len(tokens)
                self._update(range(first, len(self._paragraphs)))
        else:
            paragraphs: list[Text] = []
            extend_paragraphs(paragraphs, tokens, 0, styles, cursor, cursor_style(self))
            self._show(paragraphs)
            self._built = len(tokens) if cursor is None else None
        self._cursor = cursor
        if reply.finished and self._widgets:
            release(self._widgets[-1])

    def _show(self, paragraphs: list[Text]) -> None:
        old = self._paragraphs
        self._paragraphs = paragraphs
        changed = [i for i, p in enumerate(paragraphs) if i >= len(old) or p != old[i]]
        if len(paragraphs) < len(old):
            changed.append(len(paragraphs) - 1)  # the new last block may have lost paragraphs
        blocks = -(-len(paragraphs) // BLOCK_PARAGRAPHS)
        extra = self._widgets[blocks:]
        if extra:
            del self._widgets[blocks:]
            self.remove_children(extra)
        self._update(changed)

    def _update(self, indices: Iterable[int]) -> None:
        """Redraw the blocks that hold these paragraphs; mount the blocks that are new."""
        paragraphs = self._paragraphs
        last = (len(paragraphs) - 1) // BLOCK_PARAGRAPHS
        reserve = 0 if self.reply.finished else RESERVE_LINES
        new: list[TokenBlock] = []
        for b in sorted({i // BLOCK_PARAGRAPHS for i in indices}):
            start = b * BLOCK_PARAGRAPHS
            text = Text("\n", end="").join(paragraphs[start : start + BLOCK_PARAGRAPHS])
            if b < len(self._widgets):
                widget = self._widgets[b]
                widget.update(text, layout=False)
                redraw(widget, reserve if b == last else 0)
            else:
                if self._widgets and b == len(self._widgets):
                    release(self._widgets[-1])  # no longer the last: its exact height
                widget = TokenBlock(text, markup=False)
                if reserve and b == last:
                    widget.styles.min_height = RESERVE_LINES
                self._widgets.append(widget)
                new.append(widget)
        if new:
            self.mount_all(new)

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token") if event.style else None
        if isinstance(index, int):
            event.stop()
            self.post_message(self.Clicked(self, index))
