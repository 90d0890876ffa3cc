"""The top line: which models, how replies are decoded, and what the engine is doing."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import ProgressBar, Static

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import LoadProgress


def describe_decode(cfg: DecodeConfig, server: str | None = None) -> str:
    """The settings the next reply decodes with; the exit budget only where it applies.
    On a served engine (`server`: its kind) the mode and K are the server's."""
    k = "auto" if cfg.k is None else str(cfg.k)
    temp = "greedy" if cfg.greedy else f"T {cfg.temperature:g}"
    head = [f"served by {server}"] if server else [f"mode {cfg.mode.value}", f"K {k}"]
    parts = [*head, temp, f"top-p {cfg.top_p:g}"]
    if cfg.mode is Mode.EARLY_EXIT:
        parts.append(f"exit budget {cfg.exit_budget:g}")
    parts.append(f"limit {cfg.max_new_tokens} tok")
    return " · ".join(parts)


class StatusLine(Widget):
    """specchat · models · decode settings · state.

    On a narrow terminal the decode settings give way (cut with an ellipsis)
    so that the state, "generating… (esc stops)" say, always shows.
    """

    DEFAULT_CSS = "StatusLine { height: 1; }"

    models: reactive[str] = reactive("no model yet")
    state: reactive[str] = reactive("starting")
    decode: reactive[str] = reactive("")

    def render(self) -> Text:
        out = Text(" specchat ", style="bold reverse", end="")
        out.append(f" {self.models} ")
        middle = Text("│", style="dim", end="")
        middle.append(f" {self.decode} ")
        tail = Text("│", style="dim", end="")
        tail.append(f" {self.state}", style="bold")
        room = self.size.width - out.cell_len - tail.cell_len
        if self.size.width and room < middle.cell_len:
            middle.truncate(room - 1, overflow="ellipsis")  # the last cell: a space before the │
            middle.append(" ")
        if room > 2:
            out.append_text(middle)
        out.append_text(tail)
        return out


def _amount(value: int, unit: str) -> str:
    if unit == "B":
        for suffix, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{value} B"
    return str(value)


def describe_progress(p: LoadProgress) -> str:
    text = p.stage
    if p.detail:
        text += f" {p.detail}"
    if p.total:
        text += f": {_amount(p.done, p.unit)} / {_amount(p.total, p.unit)}"
    elif p.done:
        text += f": {_amount(p.done, p.unit)}"
    return text


class LoadView(Vertical):
    """Model fetch and load progress, one stage at a time."""

    DEFAULT_CSS = """
    LoadView { height: auto; }
    LoadView > Static { height: auto; }
    """

    def compose(self):  # type: ignore[no-untyped-def]
        yield Static("Loading the models…", id="load-label", markup=False)
        yield ProgressBar(total=None, show_eta=False, id="load-bar")

    def update_progress(self, p: LoadProgress) -> None:
        self.query_one("#load-label", Static).update(describe_progress(p))
        bar = self.query_one(ProgressBar)
        if p.total:
            bar.update(total=p.total, progress=min(p.done, p.total))
        else:
            bar.update(total=None)
