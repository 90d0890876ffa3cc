"""One assistant reply: tokens styled by provenance, or rendered Markdown."""

from __future__ import annotations

from collections.abc import Iterable

from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Markdown, Static

from specchat.engine.config import DecodeConfig
from specchat.engine.events import (
    Cancelled,
    Failed,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)

from .tokens import TOKEN_COMPONENTS, cursor_style, provenance_styles, token_css


class TokenBody(Static):
    """The reply's tokens as one Text, each span styled by provenance and tagged with its index."""

    COMPONENT_CLASSES = TOKEN_COMPONENTS
    DEFAULT_CSS = token_css("TokenBody")

    class Clicked(Message):
        """A token was clicked."""

        def __init__(self, body: TokenBody, index: int) -> None:
            super().__init__()
            self.body = body
            self.index = index

    def __init__(self, reply: ReplyView, **kwargs: object) -> None:
        super().__init__("", **kwargs)  # type: ignore[arg-type]
        self.reply = reply

    def render(self) -> Text:
        reply = self.reply
        styles = provenance_styles(self)
        cursor = reply.cursor
        out = Text(end="")
        for i, tok in enumerate(reply.tokens):
            style = styles[tok.provenance] + Style(meta={"token": i})
            if i == cursor:
                text = tok.text
                if text == "" or text.isspace():
                    # make an empty or blank token visible while it is selected
                    marker = "∅" if text == "" else text.replace("\n", "⏎\n").replace(" ", "␣")
                    out.append(marker, style + cursor_style(self))
                else:
                    out.append(text, style + cursor_style(self))
            elif tok.text:
                out.append(tok.text, style)
        if not reply.tokens and not reply.finished:
            out.append("…", Style(dim=True))
        return out

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token") if event.style else None
        if isinstance(index, int):
            event.stop()
            self.post_message(self.Clicked(self, index))


class ReplyView(Vertical):
    """An assistant reply, streamed a round at a time.

    While streaming, or in the tokens view, or while a token is selected, it
    shows the styled tokens; once finished, the Markdown view renders the text.
    """

    DEFAULT_CSS = """
    ReplyView { height: auto; }
    ReplyView > TokenBody { height: auto; }
    ReplyView > Markdown { height: auto; margin: 0; padding: 0; }
    ReplyView > .reply-header { height: 1; }
    ReplyView > .reply-status { height: auto; }
    """

    def __init__(self, reply_id: int, *, label: str = "assistant", view: str = "markdown") -> None:
        super().__init__(classes="reply")
        self.reply_id = reply_id
        self.label = label
        self.view = view
        self.tokens: list[TokenEvent] = []
        self.rounds: dict[int, RoundEvent] = {}
        self.started: TurnStarted | None = None
        self.outcome: TurnFinished | Cancelled | Failed | None = None
        self.config: DecodeConfig | None = None
        self.cursor: int | None = None
        self.ab_of: ReplyView | None = None  # set on the plain reply of an A/B comparison
        self._markdown_text: str | None = None
        self._mounted = False

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="reply-header", markup=False)
        yield TokenBody(self)
        yield Markdown("", open_links=False)
        yield Static("", classes="reply-status", markup=False)

    def on_mount(self) -> None:
        self._mounted = True  # `is_mounted` only turns true after this handler
        self._sync()

    # -- state -----------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def round_of(self, index: int) -> RoundEvent | None:
        if not 0 <= index < len(self.tokens):
            return None
        return self.rounds.get(self.tokens[index].round)

    def start(self, started: TurnStarted) -> None:
        self.started = started
        self._sync()

    def add_rounds(self, rounds: Iterable[tuple[tuple[TokenEvent, ...], RoundEvent | None]]) -> None:
        """Take a batch of rounds (tokens, then the round record or None); one redraw."""
        for tokens, rnd in rounds:
            self.tokens.extend(tokens)
            if rnd is not None:
                self.rounds[rnd.round] = rnd
        self._sync()

    def finish(self, outcome: TurnFinished | Cancelled | Failed) -> None:
        self.outcome = outcome
        self.set_class(isinstance(outcome, Cancelled), "-cancelled")
        self.set_class(isinstance(outcome, Failed), "-failed")
        self._sync()

    def _status(self) -> Text:
        outcome = self.outcome
        if isinstance(outcome, Cancelled):
            return Text(f"■ stopped after {len(self.tokens)} tokens", style="italic")
        if isinstance(outcome, Failed):
            msg = Text(f"✖ {outcome.message}", style="bold")
            if outcome.hint:
                msg.append(f"\n  {outcome.hint}", style="italic")
            return msg
        return Text("")

    def _sync(self) -> None:
        """Bring the children up to date (messages may arrive before they are mounted)."""
        if not self._mounted:
            return
        try:
            self.query_one(".reply-header", Static).update(self._header())
            status = self.query_one(".reply-status", Static)
            status.update(self._status())
            status.display = self.outcome is not None and not isinstance(self.outcome, TurnFinished)
            self.query_one(TokenBody).refresh(layout=True)
        except NoMatches:
            return
        self._apply_view()

    # -- view ------------------------------------------------------------

    def set_view(self, view: str) -> None:
        self.view = view
        self._apply_view()

    def set_cursor(self, index: int | None) -> None:
        if index is not None and self.tokens:
            index = max(0, min(index, len(self.tokens) - 1))
        elif not self.tokens:
            index = None
        self.cursor = index
        self._sync()

    @property
    def showing_tokens(self) -> bool:
        return not self.finished or self.view == "tokens" or self.cursor is not None or not self.tokens

    def _apply_view(self) -> None:
        if not self._mounted:
            return
        tokens = self.showing_tokens
        try:
            body = self.query_one(TokenBody)
            md = self.query_one(Markdown)
        except NoMatches:
            return
        body.display = tokens
        md.display = not tokens
        if not tokens:
            text = self.text
            if text != self._markdown_text:
                self._markdown_text = text
                md.update(text)

    def _header(self) -> Text:
        parts = [self.label]
        cfg_mode = None
        if self.started is not None:
            cfg_mode = self.started.mode.value
        elif self.config is not None:
            cfg_mode = self.config.mode.value
        if cfg_mode:
            parts.append(cfg_mode)
        out = self.outcome
        if isinstance(out, TurnFinished):
            s = out.stats
            parts.append(f"{s.tokens} tok")
            parts.append(f"{s.tokens_per_s:.1f} tok/s")
            parts.append(f"TTFT {s.ttft_s * 1000:.0f} ms")
            if s.acceptance_rate is not None:
                parts.append(f"α {s.acceptance_rate:.0%}")
            if s.fallbacks:
                parts.append(f"{len(s.fallbacks)} fallback{'s' if len(s.fallbacks) > 1 else ''}")
        elif out is None:
            parts.append(f"{len(self.tokens)} tok ●")
        else:
            parts.append(f"{len(self.tokens)} tok")
        return Text(" · ".join(parts), style="bold")

    def set_label(self, label: str) -> None:
        self.label = label
        self._sync()
