"""ReplaySession: a recorded trace played back through the ChatBackend interface."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.errors import EngineError
from specchat.engine.events import (
    Cancelled,
    Failed,
    LoadProgress,
    Notice,
    Provenance,
    Ready,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from specchat.engine.protocol import ChatBackend
from specchat.engine.tools.replay import (
    ReplaySession,
    as_plain,
    read_trace,
    synthesize_trace,
    synthesize_turn,
    tokenize,
    write_trace,
)

SPEC = DecodeConfig()


def test_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    events = synthesize_trace(modes=(Mode.SPEC, Mode.EARLY_EXIT))
    path = tmp_path / "t.jsonl"
    write_trace(path, events)
    assert read_trace(path) == events


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "Notice", "message": "hi"}\nnot json\n')
    with pytest.raises(EngineError, match="line 2"):
        read_trace(path)
    with pytest.raises(EngineError, match="Cannot read"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(EngineError, match="no turn"):
        ReplaySession([Notice("x")])


def test_synthetic_spec_turn_is_realistic() -> None:
    events = synthesize_turn("Voilà, a café " * 6, mode=Mode.SPEC, seed=1, fallback_at=2)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    provs = {t.provenance for t in tokens}
    assert {Provenance.ACCEPTED, Provenance.CORRECTED, Provenance.BONUS} <= provs
    for t in tokens:
        if t.provenance is Provenance.CORRECTED:
            assert t.rejected_id is not None and t.rejected_text
            assert t.rejected_id != t.token_id
    # a multi-byte character split over two tokens: "" then the character
    empties = [i for i, t in enumerate(tokens) if t.text == ""]
    assert empties and all(ord(tokens[i + 1].text[0]) > 127 for i in empties)
    assert "".join(t.text for t in tokens) == "Voilà, a café " * 6
    assert any(r.fallback_reason for r in rounds)
    assert all(r.draft_ms > 0 and r.verify_ms > 0 for r in rounds)
    # each round's tokens come before its RoundEvent
    seen: set[int] = set()
    for e in events:
        if isinstance(e, TokenEvent):
            assert e.round not in seen
        elif isinstance(e, RoundEvent):
            seen.add(e.round)


def test_synthetic_early_exit_turn() -> None:
    events = synthesize_turn(
        "one two three four five six seven eight nine ten " * 3, mode=Mode.EARLY_EXIT, seed=2
    )
    exits = [
        e for e in events if isinstance(e, TokenEvent) and e.provenance is Provenance.EARLY_EXIT
    ]
    assert exits
    assert all(e.exit_layer in (4, 6, 8) and 0.9 <= (e.confidence or 0) <= 1.0 for e in exits)
    assert isinstance(events[-1], TurnFinished) and events[-1].stats.early_exits == len(exits)


def test_tokenize_is_deterministic_and_lossless() -> None:
    text = "Zoë naïve **bold**\n\n```python\nx = 1\n```"
    toks = tokenize(text)
    assert "".join(t for _, t in toks) == text
    assert toks == tokenize(text)


def test_stream_replays_turns_in_order_and_tracks_messages() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    backend: ChatBackend = session  # type-checks as the protocol
    assert backend is session
    assert isinstance(session.ready, Ready) and session.ready.draft is not None
    first = list(session.stream("a", SPEC))
    second = list(session.stream("b", SPEC))
    assert isinstance(first[0], TurnStarted) and first[0].turn == 1
    assert isinstance(second[0], TurnStarted) and second[0].turn == 2
    assert isinstance(first[-1], TurnFinished)
    assert [r for r, _ in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1][1] == first[-1].stats.text
    session.reset()
    assert session.messages == ()
    again = list(session.stream("a", SPEC))
    assert again[-1] == first[-1]  # a new conversation starts from the first recorded turn


def test_mode_variants_plain_derivation_and_notice() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC, Mode.EARLY_EXIT)))
    ee = list(session.stream("a", DecodeConfig(mode=Mode.EARLY_EXIT)))
    assert ee[0].mode is Mode.EARLY_EXIT
    plain = list(session.regenerate(DecodeConfig(mode=Mode.PLAIN)))
    tokens = [e for e in plain if isinstance(e, TokenEvent)]
    assert tokens and all(t.provenance is Provenance.TARGET for t in tokens)
    rounds = [e for e in plain if isinstance(e, RoundEvent)]
    assert len(rounds) == len(tokens) and all(r.k == 0 for r in rounds)
    assert [r for r, _ in session.messages] == ["user", "assistant"]
    self_spec = list(session.stream("b", DecodeConfig(mode=Mode.SELF_SPEC)))
    notices = [e for e in self_spec if isinstance(e, Notice)]
    assert notices and "self-spec" in notices[0].message


def test_as_plain_keeps_the_text() -> None:
    turn = synthesize_turn("keep every word of this reply", seed=5)
    plain = as_plain(turn)
    text = "".join(e.text for e in plain if isinstance(e, TokenEvent))
    assert text == "keep every word of this reply"
    assert plain[-1].stats.mode is Mode.PLAIN and plain[-1].stats.acceptance_rate is None


def test_timestamps_are_rebased_to_the_call() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    before = time.perf_counter()
    events = list(session.stream("a", SPEC))
    first = next(e for e in events if isinstance(e, TokenEvent))
    ttft = events[-1].stats.ttft_s
    # first.t is the call's start + the recorded ttft, and the call started after `before`
    # (by microseconds, or a loaded machine's pause): not the recorded clock's reading.
    assert 0.0 <= first.t - before - ttft < 0.5


def test_cancel_between_rounds_keeps_partial_reply() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    cancel = threading.Event()
    events = []
    for ev in session.stream("a", SPEC, cancel):
        events.append(ev)
        if isinstance(ev, RoundEvent) and ev.round == 1:
            cancel.set()
    end = events[-1]
    assert isinstance(end, Cancelled)
    emitted = [e for e in events if isinstance(e, TokenEvent)]
    assert end.tokens == len(emitted) > 0
    assert all(e.round <= 1 for e in emitted)
    assert session.messages[-1] == ("assistant", end.text)
    # the session stays usable
    assert isinstance(list(session.stream("b", SPEC))[-1], TurnFinished)


def test_paced_replay_waits_and_cancel_interrupts_the_wait() -> None:
    # at pace 0.01 the first round alone would take ~10 s
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)), pace=0.01)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.perf_counter()
    events = list(session.stream("a", SPEC, cancel))
    assert time.perf_counter() - t0 < 2.0
    assert isinstance(events[-1], Cancelled)


def test_paced_replay_follows_recorded_timing() -> None:
    # ~100 tokens: ~1.1 s recorded, ~0.3 s at 4x, so a loaded machine's pause of up to
    # ~0.8 s still reads as faster than real time
    turn = synthesize_turn(" ".join(["a b c d e f g h"] * 12), seed=1)
    recorded = turn[-1].stats.seconds
    assert recorded > 0.8
    session = ReplaySession(turn, pace=4.0)
    t0 = time.perf_counter()
    list(session.stream("a", SPEC))
    took = time.perf_counter() - t0
    assert took >= 0.8 * (recorded - turn[-1].stats.ttft_s) / 4.0
    assert took < recorded  # faster than real time


def test_from_file_replays_load_progress(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, synthesize_trace())
    seen: list[LoadProgress] = []
    session = ReplaySession.from_file(path, pace=None, progress=seen.append)
    assert seen and seen[-1].stage == "load"
    assert session.turns_recorded == 3


def test_regenerate_without_a_turn_fails_cleanly() -> None:
    session = ReplaySession(synthesize_trace())
    events = list(session.regenerate(SPEC))
    assert len(events) == 1 and events[0].__class__.__name__ == "Failed"


def _tokens(events: list) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


def test_the_limit_cuts_a_reply_and_continue_plays_the_rest() -> None:
    whole = list(ReplaySession(synthesize_trace(modes=(Mode.SPEC,))).stream("a", SPEC))
    full_text = whole[-1].stats.text
    n = len(_tokens(whole))
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    assert not session.can_continue
    limit = DecodeConfig(max_new_tokens=10)

    cut = list(session.stream("a", limit))
    end = cut[-1]
    assert isinstance(end, TurnFinished) and end.stats.stop_reason == "max_tokens"
    assert len(_tokens(cut)) == end.stats.tokens == 10
    assert end.stats.text == "".join(t.text for t in _tokens(cut)) == session.messages[-1][1]
    assert full_text.startswith(end.stats.text) and end.stats.text != full_text
    # every round record follows its tokens; a round the limit cut counts only what it kept
    rounds = [e for e in cut if isinstance(e, RoundEvent)]
    assert end.stats.rounds == len(rounds)
    assert end.stats.accepted == sum(r.accepted for r in rounds)
    assert sum(t.provenance is Provenance.ACCEPTED for t in _tokens(cut)) == end.stats.accepted
    assert session.can_continue

    pieces = [end.stats.text]
    played = 10
    while session.can_continue:
        more = list(session.continue_reply(limit))
        assert isinstance(more[0], TurnStarted)
        fin = more[-1]
        assert isinstance(fin, TurnFinished)
        added = _tokens(more)
        assert fin.stats.tokens == len(added) <= 10
        pieces.append("".join(t.text for t in added))
        played += len(added)
        assert fin.stats.text == "".join(pieces) == session.messages[-1][1]
        assert fin.stats.stop_reason == ("eos" if played == n else "max_tokens")
    assert played == n and "".join(pieces) == full_text
    assert [r for r, _ in session.messages] == ["user", "assistant"]  # one reply, grown


def test_continue_without_a_cut_reply_fails_and_a_new_turn_ends_the_cut() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    (failed,) = list(session.continue_reply(SPEC))
    assert isinstance(failed, Failed) and "no cut reply" in failed.message
    list(session.stream("a", SPEC))  # the demo replies end well inside the default limit
    assert not session.can_continue
    assert isinstance(list(session.continue_reply(SPEC))[0], Failed)
    list(session.stream("b", DecodeConfig(max_new_tokens=5)))
    assert session.can_continue
    list(session.stream("c", SPEC))
    assert not session.can_continue
    list(session.regenerate(DecodeConfig(max_new_tokens=5)))
    assert session.can_continue
    session.reset()
    assert not session.can_continue


def test_a_cancelled_continuation_keeps_the_whole_reply_and_cannot_continue() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    first = list(session.stream("a", DecodeConfig(max_new_tokens=6)))[-1].stats.text
    cancel = threading.Event()
    events = []
    for ev in session.continue_reply(SPEC, cancel):
        events.append(ev)
        if isinstance(ev, RoundEvent):
            cancel.set()
    end = events[-1]
    assert isinstance(end, Cancelled)
    assert end.tokens == len(_tokens(events)) > 0
    assert end.text == first + "".join(t.text for t in _tokens(events))
    assert session.messages[-1] == ("assistant", end.text)
    assert not session.can_continue


def test_a_cut_inside_a_character_is_completed_by_the_continuation() -> None:
    turn = synthesize_turn("Voilà café", seed=3)
    tokens = _tokens(turn)
    split = next(i for i, t in enumerate(tokens) if t.text == "")  # "" then "à"
    session = ReplaySession(turn)
    cut = list(session.stream("a", DecodeConfig(max_new_tokens=split + 1)))
    assert cut[-1].stats.text == "".join(t.text for t in tokens[: split + 1])
    rest = list(session.continue_reply(SPEC))
    assert rest[-1].stats.text == "Voilà café"
