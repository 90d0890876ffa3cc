"""Redraw a widget without laying out the whole screen when its height stays the same.

`refresh(layout=True)` makes Textual arrange every widget on the screen again
(and a second time in the next frame, as sizes settle): about 10 ms on a
160×45 terminal, spent on the UI thread while the engine waits for the GIL.
A streaming reply or a live panel keeps its height on most redraws, so
measure the new height first (one render, which Textual keeps for the paint)
and repaint in place when it has not changed.

Only for widgets whose `render` gives their whole content (not containers).
"""

from __future__ import annotations

from textual.widget import Widget


def redraw(widget: Widget) -> None:
    """Repaint a leaf widget with `height: auto`; lay out again only if its height changed."""
    if not widget.is_mounted or not widget.display:
        widget.refresh(layout=True)
        return
    size = widget.content_size
    if size.width <= 0:
        widget.refresh(layout=True)
        return
    widget.refresh()
    height = widget.get_content_height(size, widget.app.size, size.width)
    if height != size.height:
        widget.refresh(layout=True)
