"""What the side panels share: the state they read and small text helpers."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from ..state import ChatState

BAR_WIDTH = 16


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


def histogram(rows: Sequence[tuple[str, int]], width: int = BAR_WIDTH) -> Table:
    """label │ bar │ count, bars scaled to the largest count."""
    top = max((n for _, n in rows), default=0)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for label, n in rows:
        grid.add_row(label, bar(n / top if top else 0.0, width), str(n))
    return grid


def key_values(rows: Sequence[tuple[str, str | Text]]) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, value)
    return grid


class Panel(Widget):
    """A side panel drawn from the app's `ChatState`; `refresh_from` redraws it."""

    TITLE = ""
    KEY = ""  # the settings name: acceptance, latency, devices, early-exit

    def __init__(self, state: ChatState, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.state = state
        self.border_title = self.TITLE

    def refresh_from(self, state: ChatState) -> None:
        self.state = state
        self.refresh(layout=True)
