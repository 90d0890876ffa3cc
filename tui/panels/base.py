"""What the side panels share: the state they read and small text helpers.

`key_values` and `histogram` draw what a `Table.grid(padding=(0, 1))` drew,
cell for cell, without Rich's table layout: the panels redraw while a reply
streams, and a table took milliseconds of the UI thread each time it was
measured or painted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from ..redraw import redraw
from ..state import ChatState

BAR_WIDTH = 16
HOLD_LINES = 2  # while a reply streams, a panel's height grows this many lines at a time


def pct(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value * 100:.{digits}f}%"


def ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def nbytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    """A bar of `width` cells; eighths give sub-cell precision."""
    if fraction is None:
        return " " * width
    fraction = max(0.0, min(1.0, fraction))
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[rest] if rest else ""
    return ("█" * full + partial).ljust(width, "·")


class Histogram:
    """label │ bar │ count rows, bars scaled to the largest count."""

    def __init__(self, rows: Sequence[tuple[str, int]], width: int = BAR_WIDTH) -> None:
        top = max((n for _, n in rows), default=0)
        self.rows = [(label, bar(n / top if top else 0.0, width), str(n)) for label, n in rows]
        self.label_width = max((cell_len(label) for label, _, _ in self.rows), default=0)
        self.count_width = max((len(count) for _, _, count in self.rows), default=0)
        self.width = self.label_width + 1 + width + 1 + self.count_width

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.width, self.width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterable[Segment]:
        space = Segment(" ")
        for label, bars, count in self.rows:
            yield Segment(" " * (self.label_width - cell_len(label)) + label)
            yield space
            yield Segment(bars)
            yield space
            yield Segment(count.rjust(self.count_width))
            yield Segment.line()


def histogram(rows: Sequence[tuple[str, int]], width: int = BAR_WIDTH) -> Histogram:
    """label │ bar │ count, bars scaled to the largest count."""
    return Histogram(rows, width)


class KeyValues:
    """key value rows: keys bold in a column as wide as the longest, values wrapped after it."""

    BOLD = Style(bold=True)

    def __init__(self, rows: Sequence[tuple[str, str | Text]]) -> None:
        self.rows = [(key, value if isinstance(value, Text) else Text(value)) for key, value in rows]
        self.key_width = max((cell_len(key) for key, _ in self.rows), default=0)

    def _value_widths(self) -> tuple[int, int]:
        """The widest value line and the widest word of any value, in cells."""
        widest = longest_word = 0
        for _, value in self.rows:
            for line in value.plain.split("\n"):
                widest = max(widest, cell_len(line))
                longest_word = max([longest_word, *(cell_len(w) for w in line.split())])
        return widest, longest_word

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest, longest_word = self._value_widths()
        return Measurement(self.key_width + 1 + longest_word, self.key_width + 1 + widest)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterable[Segment]:
        widest, _ = self._value_widths()
        width = max(1, min(widest, options.max_width - self.key_width - 1))
        key_cell = self.key_width + 1
        for key, value in self.rows:
            lines = value.wrap(console, width, justify="left", overflow="ellipsis") or [Text()]
            for i, line in enumerate(lines):
                text = key if i == 0 else ""
                yield Segment(text + " " * (key_cell - cell_len(text)), self.BOLD)
                line.pad_right(width - line.cell_len)
                yield from line.render(console)
                yield Segment.line()


def key_values(rows: Sequence[tuple[str, str | Text]]) -> KeyValues:
    return KeyValues(rows)


class Panel(Widget):
    """A side panel drawn from the app's `ChatState`; `refresh_from` redraws it."""

    TITLE = ""
    KEY = ""  # the settings name: acceptance, latency, devices, early-exit

    def __init__(self, state: ChatState, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.state = state
        self.border_title = self.TITLE

    def refresh_from(self, state: ChatState, streaming: bool = False) -> None:
        """Redraw from `state`; while a reply streams the panel does not shrink (no layout for a line less)."""
        self.state = state
        redraw(self, HOLD_LINES if streaming else 0)
