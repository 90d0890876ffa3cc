"""The conversation: prompts, replies, notes; and the token cursor of the inspector.

Focus the transcript (F6, Tab, or a click on a token) to inspect tokens:

    ←/→   previous / next token        ↑/↓   previous / next round
    home/end  first / last token       pgup/pgdn  previous / next reply
    v     Markdown ⇄ tokens            esc   back to the prompt
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.geometry import Region
from textual.message import Message
from textual.widgets import Static

from .reply import ReplyView, TokenBody


class UserMessage(Static):
    """A prompt as the user sent it."""

    def __init__(self, prompt: str) -> None:
        super().__init__(Text(prompt), classes="user", markup=False)
        self.prompt = prompt


class Note(Static):
    """A line from the app itself: a notice, a warning or an error with its hint."""

    def __init__(self, message: str, hint: str = "", *, level: str = "info") -> None:
        text = Text(message, style="bold" if level == "error" else "")
        if hint:
            text.append(f"\n{hint}", style="italic")
        super().__init__(text, classes=f"note -{level}", markup=False)
        self.message = message
        self.hint = hint
        self.level = level


class Transcript(VerticalScroll, can_focus=True):
    """Scrolls the conversation; while focused it moves the token cursor."""

    BINDINGS = [
        Binding("left", "move(-1)", "Token ←", show=False),
        Binding("right", "move(1)", "Token →", show=False),
        Binding("up", "move_round(-1)", "Round ↑", show=False),
        Binding("down", "move_round(1)", "Round ↓", show=False),
        Binding("home", "first", "First token", show=False),
        Binding("end", "last", "Last token", show=False),
        Binding("pageup,[", "move_reply(-1)", "Prev reply", show=False),
        Binding("pagedown,]", "move_reply(1)", "Next reply", show=False),
        Binding("v", "toggle_reply_view", "View", show=False),
        Binding("escape", "leave", "Back to prompt"),
    ]

    class Selected(Message):
        """The token cursor moved (or left: `reply` None)."""

        def __init__(self, reply: ReplyView | None, index: int | None) -> None:
            super().__init__()
            self.reply = reply
            self.index = index

    class Leave(Message):
        """The user asked to go back to the prompt."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.selected: ReplyView | None = None

    def on_mount(self) -> None:
        self.anchor()

    # -- replies ---------------------------------------------------------

    @property
    def replies(self) -> list[ReplyView]:
        return list(self.query(ReplyView))

    def select(self, reply: ReplyView | None, index: int | None) -> None:
        """Put the cursor on token `index` of `reply` (None clears it)."""
        if self.selected is not None and self.selected is not reply:
            self.selected.set_cursor(None)
        self.selected = reply
        if reply is not None:
            reply.set_cursor(index)
            self.call_after_refresh(self._scroll_to_cursor)
            self.post_message(self.Selected(reply, reply.cursor))
        else:
            self.post_message(self.Selected(None, None))

    def clear_selection(self) -> None:
        self.select(None, None)

    def select_last(self) -> None:
        """Select the last token of the last reply that has tokens."""
        for reply in reversed(self.replies):
            if reply.tokens:
                self.select(reply, len(reply.tokens) - 1)
                return
        self.select(None, None)

    def _scroll_to_cursor(self) -> None:
        reply = self.selected
        if reply is None or reply.cursor is None or not reply.is_mounted:
            return
        body = reply.query_one(TokenBody)
        width = max(1, body.content_region.width)
        prefix = Text("".join(t.text for t in reply.tokens[: reply.cursor]) or " ")
        line = len(prefix.wrap(self.app.console, width)) - 1
        y = body.region.y - self.region.y + int(self.scroll_y) + line
        self.release_anchor()
        self.scroll_to_region(Region(0, y, 1, 1), animate=False, immediate=True)

    # -- actions ---------------------------------------------------------

    def _current(self) -> tuple[ReplyView, int] | None:
        reply = self.selected
        if reply is None or reply.cursor is None:
            self.select_last()
            return None
        return reply, reply.cursor

    def action_move(self, step: int) -> None:
        cur = self._current()
        if cur is not None:
            self.select(cur[0], cur[1] + step)

    def action_move_round(self, step: int) -> None:
        cur = self._current()
        if cur is None:
            return
        reply, index = cur
        rnd = reply.tokens[index].round
        i = index
        if step < 0:
            # to the first token of this round, or of the previous one when already there
            while i > 0 and reply.tokens[i - 1].round == rnd:
                i -= 1
            if i == index and i > 0:
                i -= 1
                prev = reply.tokens[i].round
                while i > 0 and reply.tokens[i - 1].round == prev:
                    i -= 1
        else:
            while i < len(reply.tokens) - 1 and reply.tokens[i].round == rnd:
                i += 1
        self.select(reply, i)

    def action_first(self) -> None:
        cur = self._current()
        if cur is not None:
            self.select(cur[0], 0)

    def action_last(self) -> None:
        cur = self._current()
        if cur is not None:
            self.select(cur[0], len(cur[0].tokens) - 1)

    def action_move_reply(self, step: int) -> None:
        replies = [r for r in self.replies if r.tokens]
        if not replies:
            return
        current = self.selected
        pos = replies.index(current) + step if current in replies else len(replies) - 1
        pos = max(0, min(pos, len(replies) - 1))
        self.select(replies[pos], 0)

    def action_toggle_reply_view(self) -> None:
        reply = self.selected
        if reply is not None and reply.finished:
            reply.set_view("tokens" if reply.view == "markdown" else "markdown")

    def action_leave(self) -> None:
        self.post_message(self.Leave())

    # -- focus and mouse -------------------------------------------------

    def on_focus(self) -> None:
        if self.selected is None or self.selected.cursor is None:
            self.select_last()

    def on_token_body_clicked(self, message: TokenBody.Clicked) -> None:
        message.stop()
        self.focus()
        if isinstance(message.body.reply, ReplyView):
            self.select(message.body.reply, message.index)

    def on_blur(self) -> None:
        self.clear_selection()
