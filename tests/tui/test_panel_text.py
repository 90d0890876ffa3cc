"""The panels' key/value rows and histograms draw what Rich's Table.grid drew, cell for cell."""

from __future__ import annotations

import random
from typing import Any

from rich.console import Console
from rich.table import Table

from specchat.tui.panels.base import bar, histogram, key_values

WORDS = [
    "rate",
    "71.6%",
    "(48/67",
    "drafts)",
    "spec",
    "·",
    "K",
    "2",
    "round",
    "5:",
    "acceptance",
    "0.54",
    "below",
    "0.80",
    "over",
    "the",
    "last",
    "8",
    "rounds;",
    "falling",
    "back",
    "to",
    "plain",
    "n/a",
    "12.6",
    "ms",
    "█▎····",
    "α",
    "—",
]
KEYS = [
    "rate",
    "mean length",
    "controller",
    "fallback",
    "p50 / p95",
    "first token",
    "round 25",
    "x",
]


def table_key_values(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, value)
    return grid


def table_histogram(rows: list[tuple[str, int]]) -> Table:
    top = max(n for _, n in rows)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for label, n in rows:
        grid.add_row(label, bar(n / top if top else 0.0), str(n))
    return grid


def cells(renderable: Any, width: int) -> list[list[tuple[str, bool]]]:
    """Each line as (character, bold) cells; unstyled trailing blanks dropped (they draw nothing)."""
    console = Console(width=width, color_system="truecolor")
    out = []
    for line in console.render_lines(renderable, console.options, pad=False):
        row = [(ch, bool(seg.style and seg.style.bold)) for seg in line for ch in seg.text]
        while row and row[-1] == (" ", False):
            row.pop()
        out.append(row)
    return out


def test_key_values_and_histogram_match_the_table_layout() -> None:
    rng = random.Random(0)  # 300 random panels, widths 30..60 cells; every one must match
    for _ in range(300):
        rows = [
            (rng.choice(KEYS), " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 18))))
            for _ in range(rng.randint(1, 6))
        ]
        counts = [(str(i), rng.randint(0, 30)) for i in range(rng.randint(1, 8))]
        width = rng.randint(30, 60)
        assert cells(key_values(rows), width) == cells(table_key_values(rows), width), (rows, width)
        assert cells(histogram(counts), width) == cells(table_histogram(counts), width), (
            counts,
            width,
        )
