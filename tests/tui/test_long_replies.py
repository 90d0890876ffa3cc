"""Long replies: the reply limit is shown and set, a reply it cuts says so, ctrl+o continues it."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static
from tui_helpers import (
    SIZE,
    TRACE,
    GatedSession,
    make_app,
    ready,
    run_from_palette,
    send,
    wait_until,
)

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import Cancelled, Provenance, TokenEvent, TurnFinished
from specchat.engine.tools.replay import ReplaySession
from specchat.tui.settings import CHAT_MAX_NEW_TOKENS
from specchat.tui.widgets.reply import ReplyView
from specchat.tui.widgets.status import StatusLine


def replies(app: Any) -> list[ReplyView]:
    return list(app.query(ReplyView))


def recorded_text(turn: int) -> str:
    """The whole text of turn `turn` of TRACE, as recorded in spec mode."""
    ends = [e for e in TRACE if isinstance(e, TurnFinished) and e.stats.mode is Mode.SPEC]
    return ends[turn - 1].stats.text


def recorded_tokens(turn: int) -> list[TokenEvent]:
    out: list[TokenEvent] = []
    inside = False
    for ev in TRACE:
        if type(ev).__name__ == "TurnStarted":
            inside = ev.turn == turn and ev.mode is Mode.SPEC
        elif inside and isinstance(ev, TokenEvent):
            out.append(ev)
    return out


def status_line(reply: ReplyView) -> str | None:
    """The line under a reply, or None while it is hidden."""
    status = reply.query_one(".reply-status", Static)
    return str(status.content) if status.display else None


def continue_offered(app: Any) -> bool:
    """Whether the footer shows ctrl+o and the palette offers to continue."""
    footer = app.screen.active_bindings.get("ctrl+o")
    shown = footer is not None and footer.binding.show
    palette = any(c.title.startswith("Continue") for c in app.get_system_commands(app.screen))
    assert shown == palette
    return shown


def notices(app: Any) -> list[str]:
    return [n.message for n in app._notifications]


async def test_the_chat_answers_to_the_end_and_shows_the_limit() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert f"limit {CHAT_MAX_NEW_TOKENS} tok" in app.query_one(StatusLine).decode
        await send(pilot, "q")
        (reply,) = replies(app)
        assert session.calls[-1][2].max_new_tokens == CHAT_MAX_NEW_TOKENS
        assert isinstance(reply.outcome, TurnFinished) and reply.outcome.stats.stop_reason == "eos"
        assert reply.text == recorded_text(1)
        assert not reply.cut and status_line(reply) is None  # an answer that ended says nothing
        assert not continue_offered(app)
        # nothing to continue: a gentle notice, no call into the engine
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert any("Nothing to continue" in m for m in notices(app))
        assert [kind for kind, _, _ in session.calls] == ["stream"]
        assert app._busy is None and reply.outcome.stats.stop_reason == "eos"


async def test_the_limit_key_and_palette_reach_the_next_reply() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")  # 2048 -> 4096
        assert app.state.decode.max_new_tokens == 4096
        assert "limit 4096 tok" in app.query_one(StatusLine).decode
        await pilot.press("ctrl+l")  # 4096 -> 8192
        await pilot.press("ctrl+l")  # from the largest, back to the smallest
        assert app.state.decode.max_new_tokens == 256
        # the palette
        await run_from_palette(pilot, "Reply limit: 512")
        await wait_until(pilot, lambda: app.state.decode.max_new_tokens == 512)
        assert "limit 512 tok" in app.query_one(StatusLine).decode
        await send(pilot, "q")
        assert session.calls[-1][2].max_new_tokens == 512


async def test_a_cut_reply_says_so_and_ctrl_o_continues_it_in_place() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session, decode=DecodeConfig(max_new_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "limit 12 tok" in app.query_one(StatusLine).decode
        await send(pilot, "Tell me everything")
        (reply,) = replies(app)
        tokens = recorded_tokens(1)
        assert isinstance(reply.outcome, TurnFinished)
        assert reply.outcome.stats.stop_reason == "max_tokens"
        assert reply.cut and reply.has_class("-cut")
        assert reply.text == "".join(t.text for t in tokens[:12])
        assert status_line(reply) == "✂ cut at the reply limit of 12 tokens · ctrl+o continues"
        assert continue_offered(app)

        # ctrl+o: the continuation streams into the same widget, and is cut again
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app._busy is None and reply.finished)
        assert session.calls[-1][0] == "continue"
        assert replies(app) == [reply]
        assert [t.token_id for t in reply.tokens] == [t.token_id for t in tokens[:24]]
        assert [t.provenance for t in reply.tokens] == [t.provenance for t in tokens[:24]]
        assert reply.text == "".join(t.text for t in tokens[:24])
        assert reply.outcome.stats.text == reply.text  # the engine's whole reply
        assert "24 tok" in str(reply.query_one(".reply-header", Static).content)
        assert status_line(reply) == "✂ cut at the reply limit of 12 tokens · ctrl+o continues"

        # a higher limit, then ctrl+o: the reply runs to its end and the notice goes
        await app.run_action("set_decode('limit', 256)")
        await pilot.pause()
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app._busy is None and reply.finished)
        kind, prompt, cfg = session.calls[-1]
        assert (kind, prompt, cfg.max_new_tokens) == ("continue", None, 256)
        assert isinstance(reply.outcome, TurnFinished) and reply.outcome.stats.stop_reason == "eos"
        assert reply.text == recorded_text(1) == reply.outcome.stats.text
        assert len(reply.tokens) == len(tokens)
        assert not reply.cut and not reply.has_class("-cut") and status_line(reply) is None
        assert not continue_offered(app)
        assert session.messages == (("user", "Tell me everything"), ("assistant", recorded_text(1)))
        # the Markdown view renders the whole reply
        assert not reply.showing_tokens


async def test_only_the_last_cut_reply_offers_to_continue() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session, decode=DecodeConfig(max_new_tokens=5))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await send(pilot, "two")
        first, second = replies(app)
        assert first.cut and second.cut
        assert status_line(first) == "✂ cut at the reply limit of 5 tokens"
        assert status_line(second) == "✂ cut at the reply limit of 5 tokens · ctrl+o continues"
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app._busy is None and second.finished)
        assert len(first.tokens) == 5 and len(second.tokens) == 10
        assert second.text == "".join(t.text for t in recorded_tokens(2)[:10])


async def test_esc_stops_a_continuation_and_ctrl_o_waits_for_a_streaming_reply() -> None:
    gated = GatedSession(ReplaySession(TRACE))
    app = make_app(gated, decode=DecodeConfig(max_new_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"first", "enter")
        await wait_until(pilot, lambda: gated.rounds_out >= 1)
        # a reply in flight is not continued: a notice, and it streams on
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert any("streaming" in m for m in notices(app))
        assert not continue_offered(app)
        gated.release(100)
        await wait_until(pilot, lambda: app._busy is None)
        while gated.gate.acquire(blocking=False):
            pass  # the continuation waits after its first round again
        (reply,) = replies(app)
        assert reply.cut
        before = reply.text
        rounds_before = gated.rounds_out

        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: gated.rounds_out > rounds_before and len(reply.tokens) > 6)
        await pilot.pause(0.1)
        assert not reply.finished and reply.showing_tokens and status_line(reply) is None
        assert "generating" in app.query_one(StatusLine).state
        await pilot.press("escape")
        await wait_until(pilot, lambda: reply.finished)
        assert isinstance(reply.outcome, Cancelled)
        assert reply.outcome.text == reply.text == gated.messages[-1][1]
        assert reply.text.startswith(before) and len(reply.text) > len(before)
        assert status_line(reply) == f"■ stopped after {len(reply.tokens)} tokens"
        assert not reply.cut and not gated.can_continue
        # stopped, it can no longer be continued
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert any("Nothing to continue" in m for m in notices(app))
        assert app._busy is None
        assert all(t.provenance is not Provenance.TARGET for t in reply.tokens)  # still spec
