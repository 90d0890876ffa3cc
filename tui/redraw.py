"""Redraw a widget without laying out the whole screen when its height stays the same.

`refresh(layout=True)` makes Textual arrange every widget on the screen again
(and paint all of it): about 30 ms on a 160×45 terminal, spent on the UI
thread while the engine waits for the GIL and a core. A streaming reply or a
live panel keeps its height on most redraws, so measure the new height first
(one render, which Textual keeps for the paint) and repaint in place when it
has not changed.

A widget that only grows while it streams can also reserve its height in
steps (`reserve`): its box is held at a multiple of that many lines
(`min-height`), so only one line in `reserve` lays the screen out; the
blank lines it holds fill as text arrives. `release` gives the exact height
back once it stops growing.

Only for widgets whose `render` gives their whole content (not containers).
"""

from __future__ import annotations

from textual.widget import Widget


def redraw(widget: Widget, reserve: int = 0) -> None:
    """Repaint a leaf widget with `height: auto`; lay out again only if its box must change.

    `reserve` > 0: the box grows in steps of `reserve` lines and does not
    shrink; the first redraw without it gives the exact height back.
    """
    if not widget.is_mounted or not widget.display:
        widget.refresh(layout=True)
        return
    size = widget.content_size
    if size.width <= 0:
        widget.refresh(layout=True)
        return
    widget.refresh()
    height = widget.get_content_height(size, widget.app.size, size.width)
    if reserve > 0:
        if height > size.height or widget.styles.inline.min_height is None:
            widget.styles.min_height = -(-max(height, 1) // reserve) * reserve  # lays out
    elif widget.styles.inline.min_height is not None:
        release(widget)
    elif height != size.height:
        widget.refresh(layout=True)


def release(widget: Widget) -> None:
    """Drop a height reserved by `redraw(..., reserve=...)`: the box fits its content again."""
    if widget.styles.inline.min_height is not None:
        widget.styles.min_height = None  # lays out
