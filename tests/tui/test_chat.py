"""Pilot tests: the chat driven like a user would, on replayed traces."""

from __future__ import annotations

import dataclasses
import io
import threading
from typing import Any

from rich.console import Console
from rich.text import Text
from textual import events
from textual.color import Color
from textual.widgets import ProgressBar
from tui_helpers import (
    FIXED_SAMPLE,
    SIZE,
    TRACE,
    ExplodingSession,
    GatedSession,
    make_app,
    ready,
    run_from_palette,
    send,
    wait_until,
)

from specchat.engine.config import Mode
from specchat.engine.errors import EngineError
from specchat.engine.events import LoadProgress, Provenance, RoundEvent, TokenEvent, TurnFinished
from specchat.engine.tools.replay import ReplaySession
from specchat.tui.messages import RoundsCompleted, SystemSampled
from specchat.tui.panels import AcceptancePanel, DevicesPanel, EarlyExitPanel, LatencyPanel
from specchat.tui.widgets.inspector import Inspector
from specchat.tui.widgets.prompt import PromptInput
from specchat.tui.widgets.reply import ReplyView, TokenBody
from specchat.tui.widgets.status import LoadView, StatusLine
from specchat.tui.widgets.token_body import TokenBlock
from specchat.tui.widgets.transcript import Note, Transcript


def plain(renderable: Any, width: int = 56) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def recorded_turn(turn: int, mode: Mode) -> list[Any]:
    """The events of one recorded turn of TRACE."""
    out: list[Any] = []
    inside = False
    for ev in TRACE:
        name = type(ev).__name__
        if name == "TurnStarted":
            inside = ev.turn == turn and ev.mode is mode
        if inside:
            out.append(ev)
    return out


def replies(app: Any) -> list[ReplyView]:
    return list(app.query(ReplyView))


async def test_streams_every_round_in_batches_and_styles_by_provenance() -> None:
    messages: list[Any] = []
    app = make_app()
    async with app.run_test(size=SIZE, message_hook=messages.append) as pilot:
        await ready(pilot)
        await send(pilot, "What is speculative decoding?")
        (reply,) = replies(app)
        recorded = recorded_turn(1, Mode.SPEC)
        expected = [e for e in recorded if isinstance(e, TokenEvent)]
        untimed = [
            dataclasses.replace(t, t=0.0) for t in reply.tokens
        ]  # the replay re-times tokens
        assert untimed == [dataclasses.replace(t, t=0.0) for t in expected]
        assert isinstance(reply.outcome, TurnFinished)
        batches = [m for m in messages if isinstance(m, RoundsCompleted)]
        streamed = [r for m in batches for r in m.rounds]
        # every round once, in order, each with its own tokens; fewer messages than rounds is fine
        assert [rnd for _, rnd in streamed] == [e for e in recorded if isinstance(e, RoundEvent)]
        for tokens, rnd in streamed:
            assert rnd is not None and {t.round for t in tokens} == {rnd.round}
        assert len(streamed) == reply.outcome.stats.rounds
        assert batches, "no batch reached the UI"
        assert len(batches) <= len(streamed)
        assert app.state.metrics.rounds == reply.outcome.stats.rounds
        # Markdown by default once finished; ctrl+t shows the tokens
        assert not reply.showing_tokens
        await pilot.press("ctrl+t")
        assert reply.showing_tokens
        body = reply.query_one(TokenBody)
        shown = [p.content for p in body.query(TokenBlock)]  # a widget per block of paragraphs
        assert all(isinstance(p, Text) for p in shown)
        text = Text("\n").join(shown)
        assert text.plain == reply.text
        spans = [s for s in text.spans if s.style.meta.get("token") is not None]
        by_index = {s.style.meta["token"]: s.style for s in spans}
        expect_style = {
            Provenance.ACCEPTED: ("underline",),
            Provenance.CORRECTED: ("bold", "underline"),
            Provenance.BONUS: ("bold",),
        }
        seen = set()
        for i, tok in enumerate(reply.tokens):
            if not tok.text:
                continue  # an incomplete multi-byte piece draws nothing
            style = by_index[i]
            var = app.theme_variables[f"token-{tok.provenance.value}"]
            assert style.color is not None
            assert style.color.triplet == Color.parse(var).rgb
            for attr in expect_style.get(tok.provenance, ()):
                assert getattr(style, attr), (tok.provenance, attr)
            if tok.provenance is Provenance.ACCEPTED:
                assert not style.bold
            seen.add(tok.provenance)
        assert seen == {Provenance.ACCEPTED, Provenance.CORRECTED, Provenance.BONUS}


async def test_tokens_appear_while_streaming_and_cancel_keeps_the_session() -> None:
    gated = GatedSession(ReplaySession(TRACE))
    app = make_app(gated)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"first", "enter")
        await wait_until(
            pilot,
            lambda: gated.rounds_out >= 1 and bool(replies(app)) and bool(replies(app)[0].tokens),
        )
        reply = replies(app)[0]
        n1 = len(reply.tokens)
        assert not reply.finished and reply.showing_tokens
        assert "generating" in app.query_one("StatusLine").state
        gated.release()
        await wait_until(pilot, lambda: len(reply.tokens) > n1)
        # esc stops the reply; what came stays
        await pilot.press("escape")
        await wait_until(pilot, lambda: reply.finished)
        assert type(reply.outcome).__name__ == "Cancelled"
        assert reply.tokens and reply.has_class("-cancelled")
        assert app._busy is None
        # the session still answers; the cancelled prompt is in the history
        gated.release(1000)
        await send(pilot, "second")
        assert isinstance(replies(app)[-1].outcome, TurnFinished)
        assert app.query_one(PromptInput).history == ["first", "second"]


async def test_rounds_wait_for_the_next_redraw_and_the_end_shows_them_all(monkeypatch: Any) -> None:
    monkeypatch.setattr("specchat.tui.app.LONGEST_WAIT", 3600.0)
    gated = GatedSession(ReplaySession(TRACE))
    app = make_app(gated, redraw_interval=3600.0)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"first", "enter")
        # the first rounds show at once
        await wait_until(pilot, lambda: bool(replies(app)) and bool(replies(app)[0].tokens))
        reply = replies(app)[0]
        shown = len(reply.tokens)
        # later rounds wait in the open batch until the next redraw (an hour away here)
        gated.release(3)
        await wait_until(pilot, lambda: gated.rounds_out >= 4)
        await pilot.pause(0.1)
        assert len(reply.tokens) == shown and not reply.finished
        # the end of the reply takes everything still batched: nothing is lost
        gated.release(1000)
        await wait_until(pilot, lambda: reply.finished)
        assert isinstance(reply.outcome, TurnFinished)
        assert len(reply.tokens) == reply.outcome.stats.tokens
        assert len(reply.rounds) == app.state.metrics.rounds == reply.outcome.stats.rounds


async def test_a_theme_change_restyles_the_tokens_on_screen() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is speculative decoding?")
        await pilot.press("ctrl+t")
        (reply,) = replies(app)
        body = reply.query_one(TokenBody)

        def first_colour() -> tuple[int, int, int]:
            text = body.query(TokenBlock).first().content
            assert isinstance(text, Text)
            span = next(s for s in text.spans if s.style.meta.get("token") == 0)
            return span.style.color.triplet  # type: ignore[union-attr, return-value]

        provenance = reply.tokens[0].provenance.value
        assert first_colour() == Color.parse(app.theme_variables[f"token-{provenance}"]).rgb
        before = first_colour()
        app.theme = "specchat-light"
        await pilot.pause()
        await pilot.pause()
        after = Color.parse(app.theme_variables[f"token-{provenance}"]).rgb
        assert after != before  # the two themes colour this provenance differently
        assert first_colour() == after


async def test_inspector_shows_where_a_token_came_from() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        reply = replies(app)[0]
        inspector = app.query_one(Inspector)
        assert not inspector.display
        await pilot.press("f6")
        await pilot.pause()
        transcript = app.query_one(Transcript)
        assert transcript.has_focus and inspector.display
        assert inspector.index == len(reply.tokens) - 1
        await pilot.press("home")
        assert inspector.token == reply.tokens[0] and reply.showing_tokens
        await pilot.press("right", "right")
        assert inspector.index == 2
        await pilot.press("down")  # to the next round
        assert reply.tokens[inspector.index].round == reply.tokens[2].round + 1
        # a corrected token names the refused draft
        i = next(i for i, t in enumerate(reply.tokens) if t.provenance is Provenance.CORRECTED)
        transcript.select(reply, i)
        await pilot.pause()
        text = plain(inspector.render())
        tok = reply.tokens[i]
        assert "CORRECTED" in text and "refused" in text
        assert f"id {tok.rejected_id}" in text
        assert f"{tok.p_target:.4f}" in text and f"{tok.p_draft:.4f}" in text
        assert f"K {reply.rounds[tok.round].k}" in text
        # esc goes back to the prompt and hides the inspector
        await pilot.press("escape")
        await pilot.pause()
        assert app.query_one(PromptInput).has_focus and not inspector.display
        assert reply.cursor is None


async def test_inspector_names_the_drafter_of_a_composed_round() -> None:
    """In spec mode lookup and the draft model take turns: the inspector says which drafted."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        inspector = app.query_one(Inspector)
        tok = TokenEvent(7, "x", Provenance.ACCEPTED, round=1, position=0, p_target=0.9, p_draft=1.0)
        for drafter, copied in (("lookup", True), ("Qwen2.5-Coder-0.5B-Instruct", False)):
            rnd = RoundEvent(1, Mode.SPEC, k=3, accepted=1, draft_ms=0.1, verify_ms=9.0, drafter=drafter)
            inspector.show(tok, 0, 1, rnd)
            text = plain(inspector.render())
            assert f"drafted by {drafter}" in text
            assert ("copied from earlier" in text) is copied


async def test_inspector_early_exit_token_and_mouse_click() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f7", "f7")  # spec -> self-spec -> early-exit
        assert app.state.decode.mode is Mode.EARLY_EXIT
        await send(pilot, "q")
        reply = replies(app)[0]
        assert reply.started is not None and reply.started.mode is Mode.EARLY_EXIT
        await pilot.press("ctrl+t")
        await pilot.pause()
        # click the first character of the reply: token 0
        body = reply.query_one(TokenBody)
        await pilot.click(body, offset=(0, 0))
        await pilot.pause()
        assert app.query_one(Transcript).has_focus
        assert reply.cursor == 0
        # click further along the first line
        col = 12
        upto = 0
        idx = 0
        for idx, t in enumerate(reply.tokens):  # noqa: B007 - idx is the token under the column
            upto += len(t.text)
            if upto > col:
                break
        await pilot.click(body, offset=(col, 0))
        await pilot.pause()
        assert reply.cursor == idx
        i = next(i for i, t in enumerate(reply.tokens) if t.provenance is Provenance.EARLY_EXIT)
        app.query_one(Transcript).select(reply, i)
        await pilot.pause()
        text = plain(app.query_one(Inspector).render())
        tok = reply.tokens[i]
        assert "EARLY EXIT" in text and f"exit layer {tok.exit_layer}" in " ".join(text.split())
        assert f"{tok.confidence:.4f}" in text


async def test_mode_k_temperature_switches_reach_the_next_stream() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f7")  # self-spec
        await pilot.press("f8", "f8")  # K auto -> 1 -> 2
        await pilot.press("f9")  # temperature 0 -> 0.3
        await pilot.press("shift+f9")  # top-p 1 -> 0.95
        await pilot.press("shift+f5")  # budget 0.95 -> 0.9
        await send(pilot, "q")
        kind, prompt, cfg = session.calls[-1]
        assert (kind, prompt) == ("stream", "q")
        assert cfg.mode is Mode.SELF_SPEC and cfg.k == 2
        assert cfg.temperature == 0.3 and cfg.top_p == 0.95 and cfg.exit_budget == 0.9
        assert cfg.seed is not None  # sampling turns get a seed A/B can reuse
        # ctrl+g rolls back to plain, and again restores the mode before
        await pilot.press("ctrl+g")
        assert app.state.decode.mode is Mode.PLAIN
        await send(pilot, "r")
        assert session.calls[-1][2].mode is Mode.PLAIN
        assert all(t.provenance is Provenance.TARGET for t in replies(app)[-1].tokens)
        await pilot.press("ctrl+g")
        assert app.state.decode.mode is Mode.SELF_SPEC
        assert "mode self-spec" in app.query_one("StatusLine").decode


async def test_panels_show_the_measured_values() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        stats = replies(app)[0].outcome.stats
        acc = plain(app.query_one(AcceptancePanel).render())
        assert f"{stats.acceptance_rate * 100:.1f}%" in acc
        assert f"({stats.accepted}/{stats.drafted} drafts)" in acc
        assert f"{stats.mean_accepted_length:.2f} tokens / round" in acc
        fb = app.state.metrics.last_fallback
        assert fb is not None and f"round {fb[0]}" in acc
        latency = app.query_one(LatencyPanel)
        head = " ".join(plain(w.render()) for w in latency.query("_LatencyText"))
        assert f"{stats.ttft_s * 1000:.1f} ms" in head or f"{stats.ttft_s * 1000:.0f} ms" in head
        assert f"{stats.tokens_per_s:.1f}" in head
        assert "expected" in head and "×" in head
        assert latency.query_one("Sparkline").data
        # devices and early exit: off by default, toggled with f4 / f5
        devices = app.query_one(DevicesPanel)
        assert not devices.display
        await pilot.press("f4", "f5")
        app.post_message(SystemSampled(FIXED_SAMPLE))
        await pilot.pause()
        dev = plain(devices.render())
        assert "cpu0" in dev and "37.5%" in dev and "GPU" in dev and "n/a" in dev
        assert "512.0 MiB" in dev
        assert "draft" in dev and "target" in dev
        gpu = dataclasses.replace(
            FIXED_SAMPLE,
            gpu_util_percent=42.0,
            gpu_mem_used_bytes=3 * 2**30,
            gpu_mem_total_bytes=80 * 2**30,
            gpu_name="Fake H100",
        )
        app.post_message(SystemSampled(gpu))
        await pilot.pause()
        dev = plain(devices.render(), width=80)
        assert "Fake H100 · util 42% · 3.0 GiB / 80.0 GiB" in dev
        await pilot.press("f7", "f7")
        await send(pilot, "ee")
        ee_stats = replies(app)[-1].outcome.stats
        ee = plain(app.query_one(EarlyExitPanel).render())
        assert f"({ee_stats.early_exits} tokens)" in ee
        assert "95% top-1 agreement" in ee
        assert "L4" in ee


async def test_ab_compares_with_plain_decoding() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f7", "f7")  # early exit: lossy, so the plain reply differs
        await send(pilot, "q")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: len(replies(app)) == 2 and replies(app)[1].finished)
        await pilot.pause()
        kind, _, cfg = session.calls[-1]
        assert kind == "regenerate" and cfg.mode is Mode.PLAIN
        a, b = replies(app)
        assert b.ab_of is a and a.label.startswith("A")
        result = app.state.ab
        assert result is not None and not result.identical
        at = result.diverge_at
        assert [t.token_id for t in a.tokens[:at]] == [t.token_id for t in b.tokens[:at]]
        assert a.tokens[at].token_id != b.tokens[at].token_id
        notes = [n.message for n in app.query(Note)]
        assert any(f"first divergence at token {at + 1}" in n for n in notes)
        ee = plain(app.query_one(EarlyExitPanel).render())
        assert "realised" in ee


async def test_new_conversation_clears_and_resets_the_session() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await send(pilot, "two")
        first_text = replies(app)[0].text
        assert len(session.messages) == 4
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert replies(app) == []
        assert app.state.metrics.tokens == 0
        await send(pilot, "again")
        assert session.messages[0] == ("user", "again") and len(session.messages) == 2
        assert replies(app)[0].text == first_text  # the replay starts over too


async def test_history_and_failed_turns_keep_the_prompt() -> None:
    app = make_app(ExplodingSession())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "boom")
        reply = replies(app)[0]
        assert type(reply.outcome).__name__ == "Failed"
        assert "Unexpected error: RuntimeError: tensor on fire" in reply.outcome.message
        assert reply.tokens  # what came before the error stays on screen
        prompt = app.query_one(PromptInput)
        assert prompt.value == "boom"  # restored for another try
        prompt.value = ""
        await send(pilot, "second")
        await pilot.press("up")
        assert prompt.value == "second"
        await pilot.press("up")
        assert prompt.value == "boom"
        await pilot.press("up")
        assert prompt.value == "boom"
        await pilot.press("down", "down")
        assert prompt.value in ("", "second")  # back to the (restored) draft


async def test_a_pasted_text_is_sent_with_every_line() -> None:
    session = ReplaySession(TRACE)
    app = make_app(session)
    code = "Rename cnt to count:\n\ndef f(text):\n    cnt = {}\r\n    return cnt\n"
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        await pilot.press(*"see: ")
        app.post_message(events.Paste(code))
        await pilot.pause()
        assert prompt.value == "see: Rename cnt to count:↵↵def f(text):↵    cnt = {}↵    return cnt↵"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app._busy is None)
        want = "see: Rename cnt to count:\n\ndef f(text):\n    cnt = {}\n    return cnt"
        assert session.messages[0] == ("user", want)
        assert prompt.value == "" and prompt.history == [want]
        await pilot.press("up")
        assert prompt.value == "see: Rename cnt to count:↵↵def f(text):↵    cnt = {}↵    return cnt"
        assert prompt.prompt == want


async def test_load_failure_is_a_message_not_a_traceback() -> None:
    def loader(progress: Any) -> Any:
        raise EngineError("No model named 'nope'.", "Run `specchat models` to list the presets.")

    from specchat.tui.app import SpecChatApp

    app = SpecChatApp(loader, sample_system=False)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        notes = list(app.query(Note))
        assert any(
            n.level == "error" and "nope" in n.message and "specchat models" in n.hint
            for n in notes
        )
        await pilot.press(*"hello", "enter")
        await pilot.pause()
        assert app.query_one(PromptInput).value == "hello"  # not cleared
        assert app.query_one("StatusLine").state == "no model"

    def broken(progress: Any) -> Any:
        raise ZeroDivisionError("oops")

    app = SpecChatApp(broken, sample_system=False)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert any(
            "Loading failed unexpectedly: ZeroDivisionError" in n.message for n in app.query(Note)
        )


async def test_load_progress_paints_before_the_model_is_ready() -> None:
    go = threading.Event()

    def loader(progress: Any) -> Any:
        progress(LoadProgress("fetch", 50, 100, "B", "target"))
        go.wait(10)
        return ReplaySession(TRACE)

    from specchat.tui.app import SpecChatApp

    app = SpecChatApp(loader, sample_system=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: "fetch" in app.query_one(StatusLine).state)
        assert "50 B / 100 B" in app.query_one(StatusLine).state
        bar = app.query_one(LoadView).query_one(ProgressBar)
        assert (bar.progress, bar.total) == (50, 100)
        await pilot.press(*"early", "enter")  # too soon: the prompt stays
        await pilot.pause()
        assert app.query_one(PromptInput).value == "early"
        go.set()
        await ready(pilot)
        assert not app.query(LoadView)
        assert app.query_one(StatusLine).state == "ready"
        await pilot.press("enter")
        await wait_until(pilot, lambda: bool(replies(app)) and replies(app)[0].finished)


async def test_palette_has_every_action() -> None:
    from specchat.tui import actions

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for a in (*actions.ACTIONS, *actions.PALETTE_ONLY):
            if a.action == "continue_reply":
                continue  # offered only while a cut reply can go on (test_long_replies)
            assert any(t.startswith(a.title) for t in titles), a.title
        shown = {b.key for b in app.BINDINGS if getattr(b, "show", False)}
        assert {"escape", "ctrl+n", "ctrl+r", "f2", "f6", "f7", "ctrl+g"} <= shown
        # run one through the palette
        await run_from_palette(pilot, "Mode: plain")
        await wait_until(pilot, lambda: app.state.decode.mode is Mode.PLAIN)


async def test_an_exception_escaping_a_worker_becomes_a_message() -> None:
    from specchat.tui.app import SpecChatApp

    app = SpecChatApp(lambda progress: object(), sample_system=False)  # no `ready`: AttributeError
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: any(n.level == "error" for n in app.query(Note)))
        note = next(n for n in app.query(Note) if n.level == "error")
        assert "Unexpected error in load: AttributeError" in note.message


def test_missing_engine_session_is_a_message(monkeypatch: Any) -> None:
    import sys

    import pytest

    from specchat.tui.cli import build_parser
    from specchat.tui.commands import chat

    monkeypatch.setitem(sys.modules, "specchat.engine.decode.session", None)
    args = build_parser().parse_args(["chat", "--target", "x", "--draft", "none"])
    with pytest.raises(EngineError, match="not available") as info:
        chat._engine_loader(args)(lambda p: None)
    assert "--replay" in info.value.hint


async def test_a_streaming_reply_reserves_lines_in_steps_and_gives_them_back(monkeypatch: Any) -> None:
    """The last block holds its height in steps (few layouts); every other block, and the end, fit exactly."""
    monkeypatch.setattr("specchat.tui.widgets.token_body.BLOCK_PARAGRAPHS", 2)
    monkeypatch.setattr("specchat.tui.widgets.token_body.RESERVE_LINES", 3)
    gated = GatedSession(ReplaySession(TRACE))
    app = make_app(gated, redraw_interval=0.001)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        prompt.cursor_blink = True  # this suite's fixture keeps it off
        await pilot.press(*"first", "enter")
        await wait_until(pilot, lambda: bool(replies(app)) and bool(replies(app)[0].tokens))
        reply = replies(app)[0]
        body = reply.query_one(TokenBody)
        seen_reserved = False
        while True:
            await pilot.pause()
            if reply.finished:
                break
            blocks = list(body.query(TokenBlock))
            assert not prompt.cursor_blink  # no blink frames while a reply streams
            for block in blocks[:-1]:
                assert block.styles.inline.min_height is None
                assert block.size.height == block.get_content_height(block.size, app.size, block.size.width)
            last = blocks[-1]
            if last.size.height:
                lines = last.get_content_height(last.size, app.size, last.size.width)
                assert last.size.height % 3 == 0 and last.size.height >= lines
                seen_reserved = seen_reserved or last.size.height > lines
            gated.release()
        assert seen_reserved, "no blank line was ever held: the test did not exercise reservation"
        await wait_until(pilot, lambda: app._busy is None)
        assert prompt.cursor_blink
        await pilot.press("ctrl+t")  # the tokens view of the finished reply
        await pilot.pause()
        blocks = list(body.query(TokenBlock))
        assert len(blocks) == -(-len(reply.text.split("\n")) // 2)
        for block in blocks:
            assert block.styles.inline.min_height is None
            assert block.size.height == block.get_content_height(block.size, app.size, block.size.width)
        assert Text("\n").join([b.content for b in blocks]).plain == reply.text  # type: ignore[misc]


async def test_the_inspector_says_a_lookup_draft_was_copied() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        inspector = app.query_one(Inspector)
        tok = TokenEvent(7, "x", Provenance.ACCEPTED, round=3, position=0, p_target=0.8, p_draft=1.0)
        for mode, copied in ((Mode.LOOKUP, True), (Mode.SPEC, False)):
            inspector.show(tok, 0, 1, RoundEvent(3, mode, 2, 1, 0.1, 180.0))
            text = plain(inspector.render(), width=160)
            assert ("copied from earlier in the conversation" in text) is copied
            assert f"{mode.value} · K 2 · accepted 1" in text
