"""One assistant reply: tokens styled by provenance, or rendered Markdown.

A reply the reply limit cut says so under its text; the last one can be
continued (ctrl+o), which streams the continuation into the same widget.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.css.query import NoMatches
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

from ..actions import CONTINUE_KEY
from .token_body import STILL_VIRTUAL_SIZE, TokenBody

__all__ = ["ReplyView", "TokenBody"]


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
    virtual_size = STILL_VIRTUAL_SIZE

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
        self.continuable = False  # cut by the limit and still the conversation's last reply
        self.continued = 0  # continuations streamed into this reply
        self._tokens_before = 0  # tokens the engine counted before the continuation streaming now
        self._markdown: Markdown | None = None  # mounted the first time the reply shows as Markdown
        self._markdown_text: str | None = None
        self._mounted = False

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="reply-header", markup=False)
        yield TokenBody(self)
        yield Static("", classes="reply-status", markup=False)

    def on_mount(self) -> None:
        self._mounted = True  # `is_mounted` only turns true after this handler
        self._sync()

    # -- state -----------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def cut(self) -> bool:
        """Whether the reply limit stopped the reply (it may be continued)."""
        out = self.outcome
        return isinstance(out, TurnFinished) and out.stats.stop_reason == "max_tokens"

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
        self.set_class(self.cut, "-cut")
        self._sync()

    def resume(self, config: DecodeConfig) -> None:
        """Stream a continuation of this cut reply: its tokens stay, the new ones follow."""
        if isinstance(self.outcome, TurnFinished):
            self._tokens_before += self.outcome.stats.tokens
        self.outcome = None
        self.config = config
        self.continued += 1
        self.continuable = False
        self.remove_class("-cancelled", "-failed", "-cut")
        self._sync()

    def set_continuable(self, continuable: bool) -> None:
        """Whether the cut notice names the key that continues the reply."""
        if continuable != self.continuable:
            self.continuable = continuable
            self._sync()

    def _status(self) -> Text:
        outcome = self.outcome
        if isinstance(outcome, TurnFinished):
            reason = outcome.stats.stop_reason
            if reason == "max_tokens":
                limit = self.config.max_new_tokens if self.config else outcome.stats.tokens
                msg = Text(f"✂ cut at the reply limit of {limit} tokens", style="italic")
                if self.continuable:
                    msg.append(f" · {CONTINUE_KEY} continues", style="bold")
                return msg
            if reason == "context":
                return Text("✂ cut: the context window is full", style="italic")
            return Text("")
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
            header = self.query_one(".reply-header", Static)
            status = self.query_one(".reply-status", Static)
            body = self.query_one(TokenBody)
        except NoMatches:
            return
        header.update(self._header(), layout=False)  # always one line
        text = self._status()
        show_status = bool(text.plain)
        if show_status or status.display:
            status.update(text)
            status.display = show_status
        body.sync()
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
        except NoMatches:
            return
        body.display = tokens
        md = self._markdown
        if tokens:
            if md is not None:
                md.display = False
            return
        text = self.text
        if md is None:
            # not composed up front: mounting it costs the UI thread at the start of every reply
            self._markdown = Markdown(text, open_links=False)
            self._markdown_text = text
            self.mount(self._markdown, after=body)
            return
        md.display = True
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
            parts.append(f"{self._tokens_before + s.tokens} tok")
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
