"""ChatSession: multi-turn cache reuse, streaming text, stops, cancellation, failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.text import IncrementalDecoder, held_back
from specchat.engine.events import (
    Cancelled,
    Failed,
    Notice,
    Provenance,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from tests.tinymodels import loaded, native_or_skip, tiny_llama, tiny_tokenizer
from tests.tinymodels import pair_session as make
from tests.tinymodels import turn_finished as finished


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, max_positions=256)


def tokens_of(events: list[object]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_event_order_of_a_turn(target: torch.nn.Module) -> None:
    events = list(make(target).stream("hello", DecodeConfig(max_new_tokens=12, k=3)))
    assert isinstance(events[0], TurnStarted)
    assert isinstance(events[-1], TurnFinished)
    # Each RoundEvent closes the tokens of its round.
    current = 1
    for e in events[1:-1]:
        if isinstance(e, TokenEvent):
            assert e.round == current
        elif isinstance(e, RoundEvent):
            assert e.round == current
            current += 1
    stats = finished(events).stats
    assert stats.tokens == 12 and stats.rounds == current - 1
    assert stats.text == "".join(e.text for e in events if isinstance(e, TokenEvent))


def test_a_speculative_reply_starts_as_a_plain_one(target: torch.nn.Module) -> None:
    """The first token comes from the target alone, before the draft has read the prompt;
    the draft catches up before the second round, which speculates."""
    session = make(target)
    assert session.drafter is not None
    draft = session.drafter.runner  # type: ignore[attr-defined]
    events = session.stream("Once upon a time", DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=12))
    first = next(e for e in events if isinstance(e, TokenEvent))
    assert first.provenance is Provenance.TARGET and first.round == 1
    assert draft.cached == 0  # the draft's prefill has not run yet
    rest = list(events)
    assert draft.cached > 0
    assert any(isinstance(e, TokenEvent) and e.provenance is not Provenance.TARGET for e in rest)


def test_multi_turn_reuse_equals_full_prefill(target: torch.nn.Module) -> None:
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=16)
    reused = make(target)
    list(reused.stream("Once upon a time", cfg))
    second = list(reused.stream("def add(a, b):", cfg))
    started = second[0]
    assert isinstance(started, TurnStarted)
    assert started.new_prompt_tokens < started.prompt_tokens  # only the new part was prefilled

    fresh = make(target)
    list(fresh.stream("Once upon a time", cfg))
    fresh.tokens = []  # forget the caches: the next turn re-prefills everything
    fresh.target_runner.reset()
    assert fresh.drafter is not None
    fresh.drafter.reset()
    again = list(fresh.stream("def add(a, b):", cfg))
    assert (
        isinstance(again[0], TurnStarted) and again[0].new_prompt_tokens == again[0].prompt_tokens
    )
    assert tokens_of(second) == tokens_of(again)
    assert len(reused.messages) == 4


def test_a_conversation_can_start_from_earlier_turns(target: torch.nn.Module) -> None:
    """reset(history) answers as if those turns had been chatted: same prompt, same reply."""
    cfg = DecodeConfig(mode=Mode.PLAIN, max_new_tokens=10)
    chatted = make(target)
    list(chatted.stream("Once upon a time", cfg))
    earlier = chatted.messages
    want = tokens_of(list(chatted.stream("def add(a, b):", cfg)))

    restored = make(target)
    restored.reset(earlier)
    assert restored.messages == earlier
    assert tokens_of(list(restored.stream("def add(a, b):", cfg))) == want
    restored.reset()
    assert restored.messages == ()
    with pytest.raises(ValueError, match="roles"):
        restored.reset([("system", "be brief")])


def test_streamed_text_handles_split_multibyte_characters() -> None:
    tok = tiny_tokenizer()
    text = "Café 東京 🙂 naïve"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # byte-level: characters split over tokens
    dec = IncrementalDecoder(tok)
    pieces = [dec.add(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_generated_text_is_the_decoded_reply(target: torch.nn.Module) -> None:
    events = list(make(target).stream("emoji 🙂", DecodeConfig(max_new_tokens=48, k=2)))
    ids = tokens_of(events)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert finished(events).stats.text == streamed
    # A character the limit cut in half is no text yet: only it may be missing.
    decoded = tiny_tokenizer().decode(ids, skip_special_tokens=True)
    assert decoded.startswith(streamed) and set(decoded[len(streamed) :]) <= {"\ufffd"}


def test_stop_string_cuts_the_reply(target: torch.nn.Module) -> None:
    base = finished(
        list(make(target).stream("Once upon a time", DecodeConfig(max_new_tokens=40)))
    ).stats.text
    stop = base[10:13]
    assert stop and stop in base
    events = list(
        make(target).stream("Once upon a time", DecodeConfig(max_new_tokens=40, stop=(stop,)))
    )
    stats = finished(events).stats
    assert stats.stop_reason == "stop_string"
    assert stats.text == base[: base.index(stop)]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == stats.text


def test_held_back_prefix() -> None:
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0


def test_cancel_between_rounds_keeps_the_session_usable(target: torch.nn.Module) -> None:
    s = make(target)
    cancel = threading.Event()
    events = []
    for e in s.stream("Once upon a time", DecodeConfig(max_new_tokens=60, k=2), cancel):
        events.append(e)
        if isinstance(e, RoundEvent) and e.round == 3:
            cancel.set()
    assert isinstance(events[-1], Cancelled)
    assert 0 < events[-1].tokens < 60
    assert s.messages[-1] == ("assistant", events[-1].text)
    after = list(s.stream("and then?", DecodeConfig(max_new_tokens=8)))
    assert finished(after).stats.tokens == 8


def test_prompt_longer_than_the_context(target: torch.nn.Module) -> None:
    s = make(target)
    events = list(s.stream("word " * 400, DecodeConfig(max_new_tokens=8)))
    assert isinstance(events[-1], Failed)
    assert "context holds 256" in events[-1].message and events[-1].hint
    assert s.messages == ()  # the failed turn is not kept; the session stays usable
    assert finished(list(s.stream("hello", DecodeConfig(max_new_tokens=4)))).stats.tokens == 4


def test_old_turns_leave_the_window_when_the_context_fills(target: torch.nn.Module) -> None:
    s = make(target, system_prompt="sys")
    cfg = DecodeConfig(max_new_tokens=20)
    notices: list[Notice] = []
    for i in range(6):
        events = list(s.stream(f"turn {i}: " + "story " * 20, cfg))
        assert isinstance(events[-1], TurnFinished)
        notices += [e for e in events if isinstance(e, Notice)]
    assert any("out of the model's view" in n.message for n in notices)
    assert len(s.messages) == 12  # the conversation keeps every turn
    assert s.messages[-2][1].startswith("turn 5")
    started = [e for e in events if isinstance(e, TurnStarted)][0]
    assert started.prompt_tokens <= 256 - 20


def test_out_of_memory_becomes_a_message(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make(target)
    real = s.target_runner.feed
    calls = {"n": 0}

    def flaky(*a: object, **kw: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(s.target_runner, "feed", flaky)
    events = list(s.stream("hello", DecodeConfig(max_new_tokens=20, k=2)))
    assert isinstance(events[-1], Failed) and "out of memory" in events[-1].message
    assert s.messages == ()
    assert finished(list(s.stream("hello", DecodeConfig(max_new_tokens=5)))).stats.tokens == 5


def test_spec_without_a_draft_says_so(target: torch.nn.Module) -> None:
    s = ChatSession(loaded(target))
    events = list(s.stream("hi", DecodeConfig(mode=Mode.SPEC, max_new_tokens=4)))
    assert any(isinstance(e, Notice) and "no draft" in e.message for e in events)
    assert finished(events).stats.mode is Mode.PLAIN


def test_regenerate_replaces_the_last_reply(target: torch.nn.Module) -> None:
    s = make(target)
    first = finished(list(s.stream("hello", DecodeConfig(max_new_tokens=10)))).stats.text
    again = finished(
        list(s.regenerate(DecodeConfig(mode=Mode.PLAIN, max_new_tokens=10)))
    ).stats.text
    assert again == first  # greedy: the same reply
    assert len(s.messages) == 2


def test_no_chat_template_is_stated(target: torch.nn.Module) -> None:
    s = make(target)
    assert not s.has_template
    assert any("no chat template" in n for n in s.ready.notes)


def test_ready_states_forced_siblings(target: torch.nn.Module) -> None:
    """The Ready line on trees says what --siblings forces, not what the controller would
    choose at the measured costs."""
    s = make(target)

    def trees() -> str:
        return next(n for n in s.ready.notes if n.startswith("draft trees"))

    if trees().startswith("draft trees off: the target's attention"):
        pytest.skip("this target's attention scores no trees")
    assert "--siblings 0: chains only" in trees()  # the controller's choice, and the way out
    for forced, said in [(0, "off (--siblings 0)"), (1, "at depth 1,"), (3, "at depths 1..3,")]:
        s.forced_siblings = forced
        s.ready = s._make_ready()
        assert said in trees() and "acceptance is at most" not in trees()


def test_a_cpu_target_without_the_native_decoder_says_why(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_or_skip(make(target).target_runner)
    assert not any("not natively" in n for n in make(target).ready.notes)
    monkeypatch.setenv("SPECCHAT_NATIVE_DECODER", "0")
    notes = make(target).ready.notes
    assert any("not natively: turned off by SPECCHAT_NATIVE_DECODER=0" in n for n in notes)


def test_measured_costs_leave_the_session_as_new(target: torch.nn.Module) -> None:
    """measure_costs times passes on scratch tokens; the first turn is then exactly as without."""
    plain = make(target)
    measured = make(target)
    costs = measured.measure_costs(k=3, repeats=1)
    assert costs.target_step_ms and costs.target_step_ms > 0
    assert costs.draft_step_ms and costs.draft_step_ms > 0
    assert set(costs.verify_at) == {1, 3} and all(v > 0 for v in costs.verify_at.values())
    assert measured.tokens == [] and measured.target_runner.cached == 0
    assert any("verify K=3" in n for n in measured.ready.notes)
    cfg = DecodeConfig(max_new_tokens=10, k=2)
    assert tokens_of(list(measured.stream("hello", cfg))) == tokens_of(
        list(plain.stream("hello", cfg))
    )


def test_costs_at_load_are_timed_in_turns_and_a_bigger_pass_never_costs_less(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every timing of c and v in turns (drift hits them alike); a 2-row pass timed under a
    step, or a k+1-row pass under the 2-row one, is the machine's drift and is floored."""
    from specchat.engine.decode import costs as costs_mod

    session = make(target)
    calls: list[tuple[str, int]] = []
    # ms by (model, rows): the 2-row pass under a step and the 4-row one under the 2-row one
    scripted = {("target", 1): 100.0, ("target", 2): 91.0, ("target", 4): 85.0}

    def timer(runner: object, repeats: int) -> object:
        who = "target" if runner is session.target_runner else "draft"

        def timed(n: int) -> float:
            calls.append((who, n))
            return scripted.get((who, n), 30.0 + n)

        return timed

    monkeypatch.setattr(costs_mod, "pass_timer", timer)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert session.drafter is not None
    measured = costs_mod.measure_costs(session.target_runner, session.drafter.runner, k=3)
    turn = [("target", 1), ("target", 2), ("target", 4), ("draft", 1)]
    assert calls[: 3 * len(turn)] == turn * costs_mod.COST_TURNS
    assert measured.verify_at == {1: 1.0, 3: 1.0}
    assert measured.verify_slope == 0.0


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_steps_on_one_thread_take_one_token_passes_only(
    target: torch.nn.Module, two_threads: None
) -> None:
    """A runner whose steps run on one thread feeds one token on one thread and a block on
    all of them, puts the count back, and computes the same logits."""
    session = make(target)
    runner = session.target_runner
    seen: list[tuple[int, int]] = []
    feed = runner._feed

    def spy(ids: torch.Tensor, n: int, keep: int) -> torch.Tensor:
        seen.append((n, torch.get_num_threads()))
        return feed(ids, n, keep)

    runner._feed = spy  # type: ignore[method-assign]
    ids = [3, 9, 14, 7, 22, 5]
    runner.feed(ids[:4])
    want = [runner.feed([ids[4]]), runner.feed(ids[5:], keep=1)]
    runner.steps_on_one_thread = True
    runner.crop_to(4)
    got = [runner.feed([ids[4]]), runner.feed(ids[5:], keep=1)]
    runner.crop_to(4)
    block = runner.feed(ids[4:], keep=2)
    assert torch.get_num_threads() == 2
    assert seen == [(4, 2), (1, 2), (1, 2), (1, 1), (1, 1), (2, 2)]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert torch.equal(block[0], got[0][0])


@pytest.mark.parametrize("gain", [0.0, 1e9])
def test_the_draft_runs_its_steps_on_one_thread_where_measured_faster(
    target: torch.nn.Module, two_threads: None, monkeypatch: pytest.MonkeyPatch, gain: float
) -> None:
    """The load's measurement decides, the drafter's runner follows, Ready says it; a turn
    after it emits what plain decoding emits either way."""
    from specchat.engine.decode import costs as costs_module

    monkeypatch.setattr(costs_module, "ONE_THREAD_GAIN", gain)  # 0: never faster; 1e9: always
    session = make(target)
    costs = session.measure_costs(k=2, repeats=1)
    assert session.drafter is not None
    on_one = session.drafter.runner.steps_on_one_thread  # type: ignore[attr-defined]
    assert on_one is (gain > 1) and (costs.draft_one_thread is not None) is on_one
    assert any("draft steps on one thread" in n for n in session.ready.notes) is on_one
    if costs.draft_one_thread is not None:
        assert costs.draft_step_ms == costs.draft_one_thread[0]
    cfg = DecodeConfig(max_new_tokens=12, k=2)
    plain = make(target)
    assert tokens_of(list(session.stream("hello", cfg))) == tokens_of(
        list(plain.stream("hello", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=12)))
    )
