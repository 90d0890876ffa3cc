"""Acceptance: how many draft tokens the target keeps, by position, and the controller's choices."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from specchat.engine.metrics import length_bands

from .base import Panel, bar, histogram, key_values, pct


def _position_bars(title: str, rates: list[tuple[str, float | None]]) -> list[object]:
    """A titled bar per draft position or band of positions (none without rates)."""
    if not rates:
        return []
    width = max(3, *(len(label) for label, _ in rates))
    lines = Text()
    for label, rate in rates:
        lines.append(f"{label:>{width}} {bar(rate)} {pct(rate):>5}\n")
    lines.rstrip()
    return [Text(title, style="bold"), lines]


class AcceptancePanel(Panel):
    TITLE = "Acceptance"
    KEY = "acceptance"

    def render(self) -> Group:
        m = self.state.metrics
        ready = self.state.ready
        if ready is not None and ready.server:
            return self._render_server()
        rate = m.acceptance_rate
        mean_len = m.mean_accepted_length
        rows: list[tuple[str, str | Text]] = [
            ("rate", f"{pct(rate, 1)}  ({m.accepted}/{m.drafted} drafts)" if rate is not None else "n/a (no drafts yet)"),
            ("mean length", "n/a" if mean_len is None else f"{mean_len:.2f} tokens / round"),
        ]
        last = m.last_round
        if last is None:
            rows.append(("controller", "n/a"))
        else:
            mode = m.current_mode.value if m.current_mode else last.mode.value
            k = m.current_k
            rows.append(("controller", f"{mode} · K {k if k else '—'}"))
        if m.tree_rounds:
            rows.append((
                "draft trees",
                f"{m.tree_rounds} of {m.spec_rounds} rounds · {m.second_guesses} tokens from a second guess",
            ))
        fb = m.last_fallback
        rows.append(("fallback", "none" if fb is None else f"round {fb[0]}: {fb[1]}"))
        parts: list[object] = [key_values(rows)]
        parts += _position_bars("by draft position", m.acceptance_by_band())
        hist = length_bands(m.accepted_length_histogram())
        if hist:
            parts.append(Text("accepted per round", style="bold"))
            parts.append(histogram(hist))
        return Group(*parts)  # type: ignore[arg-type]

    def _render_server(self) -> Group:
        """A served engine's own figures: from its per-request timings or its metrics."""
        m = self.state.metrics
        s = m.server
        if s is None:
            return Group(Text("waiting for the server's figures…", style="italic"))
        where = "this reply" if s.scope == "reply" else "server-wide (other requests ran)"
        origin = {"timings": "the request's timings", "metrics": "metrics counters",
                  "none": "nothing: no metrics endpoint"}.get(s.source, s.source)  # fmt: skip
        rows: list[tuple[str, str | Text]] = [("server", f"{s.kind} · {where}"), ("from", origin)]
        if s.speculative is False:
            rows.append(("drafts", "none: the server decodes without speculation"))
            return Group(key_values(rows))
        rate = s.acceptance_rate
        rows.append(("rate", "n/a" if rate is None else f"{pct(rate, 1)}  ({s.accepted}/{s.draft_tokens} drafts)"))
        mean = s.mean_accepted_length
        rows.append(("mean length", "n/a" if mean is None else f"{mean:.2f} tokens / verify step"))
        if m.server_drafted:
            rows.append(("session", f"{pct(m.server_accepted / m.server_drafted, 1)} "
                                    f"({m.server_accepted}/{m.server_drafted})"))  # fmt: skip
        parts: list[object] = [key_values(rows)]
        by_pos = [(str(i), r) for i, r in enumerate(s.by_position(), 1)]
        parts += _position_bars("accepted at position, of all drafts", by_pos)
        return Group(*parts)  # type: ignore[arg-type]
