"""Latency: per-token sparkline, percentiles, time to first token, and the speculative cost model."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Sparkline

from ..redraw import redraw
from ..state import ChatState
from .base import HOLD_LINES, KeyValues, Panel, bar, key_values, ms, pct

SPARK_POINTS = 64
RECENT_ROUNDS = 3


class _LatencyText(Widget):
    DEFAULT_CSS = "_LatencyText { height: auto; }"

    def __init__(self, state: ChatState, part: str) -> None:
        super().__init__()
        self.state = state
        self.part = part

    def render(self) -> Group | KeyValues:
        m = self.state.metrics
        remote = self.state.ready is not None and bool(self.state.ready.server)
        if self.part == "head" and remote:
            return key_values(
                [
                    ("inter-token", f"{ms(m.p50_ms)} / {ms(m.p95_ms)} p50 / p95 (stream gaps)"),
                    ("first token", "n/a" if m.ttft_s is None else ms(m.ttft_s * 1000)),
                    ("tokens/s", "n/a" if m.tokens_per_s is None else f"{m.tokens_per_s:.1f}"),
                ]
            )
        if remote:
            return self._remote_rounds()
        if self.part == "head":
            return key_values(
                [
                    ("p50 / p95", f"{ms(m.p50_ms)} / {ms(m.p95_ms)} per token"),
                    ("first token", "n/a" if m.ttft_s is None else ms(m.ttft_s * 1000)),
                    ("tokens/s", "n/a" if m.tokens_per_s is None else f"{m.tokens_per_s:.1f}"),
                ]
            )
        share = m.draft_share
        rows: list[tuple[str, str | Text]] = [
            ("draft / round", ms(m.mean_draft_ms)),
            ("verify / round", ms(m.mean_verify_ms)),
            ("draft share", f"{bar(share, 10)} {pct(share)}" if share is not None else "n/a"),
        ]
        for r in list(m.round_timings)[-RECENT_ROUNDS:]:
            what = f"{r.accepted}/{r.k} ok" if r.k else r.mode.value
            read = f"catch-up {r.catch_up_ms:.1f} + " if r.catch_up_ms >= 0.05 else ""
            rows.append(
                (f"round {r.round}", f"{read}draft {r.draft_ms:.1f} + verify {r.verify_ms:.1f} ms · {what}")
            )
        c = m.cost_ratio
        alpha = m.acceptance_rate
        k = m.current_k
        rows.append(("cost ratio c", "n/a" if c is None else f"{c:.3f}"))
        v = m.verify_ratio
        if v is not None:
            rows.append(("verify cost v", f"{v:.2f} steps"))
        speedup = m.expected_speedup()
        if speedup is None:
            rows.append(("expected", "n/a (needs speculative rounds)"))
        else:
            at = f"α {alpha:.2f}, K {k}, c {c:.2f}" + (f", v {v:.2f}" if v is not None else "")
            rows.append(("expected", f"{speedup:.2f}× at {at}"))
        formula = "(1−α^(K+1)) / ((1−α)(K·c+v))" if v is not None else "(1−α^(K+1)) / ((1−α)(K·c+1))"
        return Group(key_values(rows), Text(f"speedup = {formula}", style="italic"))


    def _remote_rounds(self) -> Group:
        m = self.state.metrics
        bursts = m.stream_bursts()
        rows: list[tuple[str, str | Text]] = []
        if bursts is None:
            rows.append(("bursts", "n/a (no reply yet)"))
        else:
            n, tokens = bursts
            rows.append(("bursts", f"{n} · {tokens / n:.2f} tokens each"))
        note = ("A server that verifies drafts sends one verify step's tokens back to back: "
                "tokens per burst is its accepted length as this client sees it.")  # fmt: skip
        return Group(key_values(rows), Text(note, style="italic"))


class LatencyPanel(Panel):
    TITLE = "Latency"
    KEY = "latency"

    DEFAULT_CSS = """
    LatencyPanel { height: auto; layout: vertical; }
    LatencyPanel > Sparkline { height: 2; margin: 0 0 1 0; }
    """

    def compose(self) -> ComposeResult:
        yield _LatencyText(self.state, "head")
        yield Sparkline([], id="latency-spark")
        yield _LatencyText(self.state, "rounds")

    def refresh_from(self, state: ChatState, streaming: bool = False) -> None:
        self.state = state
        data = list(state.metrics.token_latencies_ms)[-SPARK_POINTS:]
        self.query_one(Sparkline).data = data
        for part in self.query(_LatencyText):
            part.state = state
            redraw(part, HOLD_LINES if streaming else 0)
