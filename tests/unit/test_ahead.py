"""The draft running ahead on a core of its own (engine/decode/ahead.py): exact, aligned,
stopped at every turn's end, failures reported, sampled turns left serial, and the load's
choice made from what it predicts."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode import costs as costs_module
from specchat.engine.decode.ahead import AheadDrafter, predict_ahead_ms
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import Cancelled, Failed, RoundEvent, TokenEvent
from tests.tinymodels import loaded, tiny_llama
from tests.tinymodels import pair_session as make
from tests.tinymodels import turn_finished as finished

PROMPTS = ["hello", "Once upon a time", "the cat sat on the mat and"]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, max_positions=256)


def tokens_of(events: list[object]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def ahead_session(target: torch.nn.Module, draft: torch.nn.Module | None = None) -> ChatSession:
    session = (
        make(target) if draft is None else ChatSession(loaded(target), loaded(draft, "draft"))
    )
    session.set_ahead(True)
    assert session._ahead is not None
    session._ahead.min_ready = 2  # rounds that take drafts whatever the threads' timing
    return session


@pytest.mark.parametrize("compose", [True, False])
def test_greedy_spec_drafted_ahead_equals_plain_over_turns(
    target: torch.nn.Module, compose: bool
) -> None:
    """Three turns of one conversation, the draft ahead, token for token as plain decoding;
    the worker is gone after every turn and the thread count is back."""
    threads = torch.get_num_threads()
    ahead, plain = ahead_session(target), make(target)
    for prompt in PROMPTS:
        cfg = DecodeConfig(max_new_tokens=24, compose=compose)
        got = list(ahead.stream(prompt, cfg))
        want = list(plain.stream(prompt, cfg.with_(mode=Mode.PLAIN)))
        assert tokens_of(got) == tokens_of(want)
        assert ahead._ahead is not None and not ahead._ahead.running
        assert torch.get_num_threads() == threads
        assert ahead.tokens == plain.tokens
    assert not [t for t in threading.enumerate() if t.name == "specchat-draft"]


def test_a_draft_equal_to_the_target_has_every_draft_accepted(target: torch.nn.Module) -> None:
    """The chain is aligned with the sequence it extends: a draft that is the target itself
    proposes the target's own tokens, so every draft a round takes is accepted. (A chain
    off by one position would have almost none accepted.)"""
    session = ahead_session(target, copy.deepcopy(target))
    events = list(session.stream("hello", DecodeConfig(max_new_tokens=40, compose=False)))
    rounds = [e for e in events if isinstance(e, RoundEvent) and e.k]
    assert rounds, "no round took a draft"
    assert sum(e.accepted for e in rounds) == sum(e.k for e in rounds)
    assert finished(events).stats.tokens == 40


def test_a_refused_draft_voids_the_chain_after_it(target: torch.nn.Module) -> None:
    """With a weaker draft some drafts are refused: what was drafted after them is dropped,
    never proposed, and the reply is still plain decoding's."""
    session = ahead_session(target)
    events = list(session.stream("Once upon a time", DecodeConfig(max_new_tokens=40, compose=False)))
    rounds = [e for e in events if isinstance(e, RoundEvent) and e.k]
    assert any(e.accepted < e.k for e in rounds)
    assert session._ahead is not None and session._ahead.voided > 0
    plain = make(target)
    assert tokens_of(events) == tokens_of(
        list(plain.stream("Once upon a time", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=40)))
    )


def test_cancel_stops_the_worker_and_the_next_turn_is_exact(target: torch.nn.Module) -> None:
    session, plain = ahead_session(target), make(target)
    cancel = threading.Event()
    events = []
    for e in session.stream("hello", DecodeConfig(max_new_tokens=40), cancel):
        events.append(e)
        if isinstance(e, RoundEvent) and e.round == 3:
            cancel.set()
    assert isinstance(events[-1], Cancelled)
    assert session._ahead is not None and not session._ahead.running
    # The cancelled reply stays in the conversation; plain decoding of the same one agrees.
    plain._messages[:] = session._messages
    plain.tokens = []
    cfg = DecodeConfig(max_new_tokens=16)
    assert tokens_of(list(session.stream("and then", cfg))) == tokens_of(
        list(plain.stream("and then", cfg.with_(mode=Mode.PLAIN)))
    )


def test_a_failing_draft_becomes_a_message_and_the_session_goes_on(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = ahead_session(target)
    drafter = session._ahead
    assert drafter is not None

    def broken(seq: list[int]) -> torch.Tensor:
        raise RuntimeError("draft weights went away")

    monkeypatch.setattr(drafter, "_next_row", broken)
    events = list(session.stream("hello", DecodeConfig(max_new_tokens=16, compose=False)))
    failed = [e for e in events if isinstance(e, Failed)]
    assert failed and "draft weights went away" in failed[0].message
    assert not drafter.running
    monkeypatch.undo()
    plain = make(target)
    cfg = DecodeConfig(max_new_tokens=12)
    assert tokens_of(list(session.stream("hello", cfg))) == tokens_of(
        list(plain.stream("hello", cfg.with_(mode=Mode.PLAIN)))
    )


def test_sampled_turns_draft_serially_and_reproduce_with_a_seed(target: torch.nn.Module) -> None:
    """How many drafts a round takes ahead depends on timing, so sampled turns (a seed and a
    fixed K give the same reply) never run ahead: they equal a serial session's."""
    ahead, serial = ahead_session(target), make(target)
    cfg = DecodeConfig(max_new_tokens=20, temperature=0.8, seed=7, k=2)
    got = list(ahead.stream("hello", cfg))
    assert ahead._ahead is not None and ahead._ahead.drafted == 0
    assert tokens_of(got) == tokens_of(list(serial.stream("hello", cfg)))


def test_the_ahead_flag_turns_it_off_per_turn(target: torch.nn.Module) -> None:
    session = ahead_session(target)
    list(session.stream("hello", DecodeConfig(max_new_tokens=12, ahead=False)))
    assert session._ahead is not None and session._ahead.drafted == 0
    list(session.stream("more", DecodeConfig(max_new_tokens=12)))
    assert session._ahead.drafted > 0


def test_the_drafter_refuses_sampled_proposals(target: torch.nn.Module) -> None:
    session = make(target)
    drafter = AheadDrafter(session.drafter)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="greedy"):
        drafter.propose([1, 2, 3], 2, DecodeConfig(temperature=1.0), None)
    assert not drafter.running


def test_the_pipeline_prediction() -> None:
    """Nothing accepted: a token a target step. A free draft and free verify rows: tokens
    come as fast as the chain allows. Slower drafts and dearer rows cost more."""
    flat = lambda k: 1.0  # noqa: E731
    assert predict_ahead_ms(0.0, 40.0, flat, 10.0) == pytest.approx(40.0)
    fast = predict_ahead_ms(1.0, 40.0, flat, 1e-3, k_max=4)
    assert fast == pytest.approx(40.0 / 5, rel=0.01)  # four drafts and the next checked
    at = [predict_ahead_ms(0.8, 40.0, flat, d) for d in (5.0, 15.0, 40.0)]
    assert at[0] < at[1] < at[2]
    dear = predict_ahead_ms(0.8, 40.0, lambda k: 1.0 + 0.2 * k, 15.0)
    assert dear > at[1]
    assert predict_ahead_ms(0.8, 40.0, flat, 15.0) == at[1]  # a fixed seed


@pytest.mark.parametrize("forced", ["on", "off", "auto"])
def test_the_load_decides_from_its_prediction_and_says_so(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, forced: str
) -> None:
    monkeypatch.setenv("SPECCHAT_AHEAD", forced)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        session = make(target)
        session.measure_costs(k=2, repeats=1)
    finally:
        torch.set_num_threads(before)
    figures = session._ahead_costs
    assert figures is not None and len(figures.grid) == len(costs_module.AHEAD_GRID)
    assert all(serial > 0 and ahead > 0 for _, serial, ahead in figures.grid)
    pays = figures.from_alpha is not None
    want = {"on": True, "off": False, "auto": pays}[forced]
    assert session.drafts_ahead is want
    note = next(n for n in session.ready.notes if "a token predicted" in n)
    assert note.startswith("the draft runs ahead" if want else "the draft drafts, then")
    # Each figure next to the way it belongs to (one read "serial: <ahead's> against <serial's>").
    serial, ahead = figures.at(costs_module.AHEAD_ALPHA)
    assert f"{serial:.1f} ms serially, {ahead:.1f} ms with the draft ahead" in note, note
    assert ("SPECCHAT_AHEAD" in note) is (forced != "auto")
    assert session.tokens == [] and session.target_runner.cached == 0


def test_a_way_that_is_no_way_is_refused(target: torch.nn.Module) -> None:
    from specchat.engine.errors import EngineError

    with pytest.raises(EngineError, match="none of auto, on, off"):
        make(target).set_ahead("sometimes")


def grid(pays_from: float) -> tuple[tuple[float, float, float], ...]:
    """Serial 30 ms a token everywhere; ahead 20 ms from `pays_from` on, 40 below."""
    return tuple(
        (a, 30.0, 20.0 if a >= pays_from else 40.0) for a in costs_module.AHEAD_GRID
    )


def test_the_choice_follows_acceptance_with_a_margin() -> None:
    figures = costs_module.AheadCosts(costs_module.Costs(40.0, 0.0), 40.0, 10.0, grid(0.7))
    assert figures.from_alpha == 0.7
    assert figures.prefers(0.9, now=False) and not figures.prefers(0.5, now=True)
    assert figures.at(0.71) == (30.0, 20.0)
    close = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0), 40.0, 10.0,
        tuple((a, 30.0, 29.0) for a in costs_module.AHEAD_GRID),
    )
    # 3% better is inside the margin: no change either way
    assert not close.prefers(0.8, now=False) and close.prefers(0.8, now=True)
    never = costs_module.AheadCosts(costs_module.Costs(40.0, 0.0), 40.0, 10.0, grid(2.0))
    assert never.from_alpha is None


def test_a_turn_changes_way_and_stays_exact(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Auto: the way changes every few rounds (a choice that always wants the other way),
    the worker starts and stops with it, the reasons say so, and the reply is plain's.
    The controller never falls back to plain here: it would from the tiny model's measured
    timings on a busy machine, and a turn that no longer drafts keeps its way."""
    from specchat.engine.decode.controller import Controller

    monkeypatch.setattr(Controller, "FALLBACK_BELOW", 0.0)
    session = make(target)
    session._ahead_costs = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0, verify_at={1: 1.2}), 40.0, 10.0, grid(0.0)
    )
    session.set_ahead("auto")
    assert session.drafts_ahead
    monkeypatch.setattr(costs_module.AheadCosts, "prefers", lambda self, alpha, now: not now)
    threads = torch.get_num_threads()
    events = list(session.stream("Once upon a time", DecodeConfig(max_new_tokens=60)))
    reasons = [e.fallback_reason for e in events if isinstance(e, RoundEvent) and e.fallback_reason]
    assert any(r.startswith("the draft runs ahead") for r in reasons), reasons
    assert any(r.startswith("the draft drafts, then") for r in reasons), reasons
    assert session._ahead is not None and not session._ahead.running
    assert torch.get_num_threads() == threads
    plain = make(target)
    assert tokens_of(events) == tokens_of(
        list(plain.stream("Once upon a time", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=60)))
    )


def test_figures_that_pay_nowhere_leave_auto_serial(target: torch.nn.Module) -> None:
    session = make(target)
    session._ahead_costs = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0), 40.0, 10.0, grid(2.0)
    )
    session.set_ahead("auto")
    assert not session.drafts_ahead
    assert any(n.startswith("the draft drafts, then") for n in session.ready.notes)


def test_a_draft_that_cannot_keep_up_ends_running_ahead_for_the_turn(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Figures that say ahead pays everywhere, a draft too slow to have anything ready:
    after AHEAD_STARVED_ROUNDS rounds the turn goes serial for good, says why, stays exact.
    (The draft model alone: such a turn starts ahead; a composed one starts serially.)"""
    import time

    session = make(target)
    session._ahead_costs = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0, verify_at={1: 1.2}), 40.0, 10.0, grid(0.0)
    )
    session.set_ahead("auto")
    drafter = session._ahead
    assert drafter is not None
    next_row = drafter._next_row

    def slow(seq: list[int]) -> torch.Tensor:
        time.sleep(0.5)
        return next_row(seq)

    monkeypatch.setattr(drafter, "_next_row", slow)
    cfg = DecodeConfig(max_new_tokens=40, compose=False)
    events = list(session.stream("Once upon a time", cfg))
    reasons = [e.fallback_reason for e in events if isinstance(e, RoundEvent) and e.fallback_reason]
    assert any("does not keep up" in r for r in reasons), reasons
    assert not any(r.startswith("the draft runs ahead") for r in reasons)
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert sum(e.k for e in rounds[ChatSession.AHEAD_STARVED_ROUNDS + 1 :]) > 0  # serial drafts
    plain = make(target)
    assert tokens_of(events) == tokens_of(
        list(plain.stream("Once upon a time", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=40)))
    )


def test_a_prompt_read_that_cannot_pay_back_keeps_a_composed_turn_serial(
    target: torch.nn.Module,
) -> None:
    """Running ahead, the draft would read the prompt on a core the target's steps lose: at
    costs where that read cannot pay back in the reply's budget, the composed turn starts
    serial, never drafts with the model, and says why; it stays exact."""
    session = make(target)
    session.costs = costs_module.Costs(
        100.0, 20.0, 0.2, {1: 1.2, 4: 2.0}, catch_up_row_ms=0.0, catch_up_pass_ms=5000.0
    )
    session._ahead_costs = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0, verify_at={1: 1.2}), 40.0, 10.0, grid(0.0)
    )
    session.set_ahead("auto")
    assert session.drafts_ahead
    events = list(session.stream("Once upon a time", DecodeConfig(max_new_tokens=40)))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert {e.drafter for e in rounds if e.k} <= {"lookup"}
    reasons = [e.fallback_reason for e in rounds if e.fallback_reason]
    assert any("would not pay back" in r for r in reasons), reasons
    assert not any(r.startswith("the draft runs ahead") for r in reasons)
    assert session._ahead is not None and session._ahead.runner.cached == 0  # never read
    plain = make(target)
    assert tokens_of(events) == tokens_of(
        list(plain.stream("Once upon a time", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=40)))
    )


def test_a_composed_turn_starts_serially_and_goes_ahead_on_what_its_rounds_measure(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Figures that say ahead pays at any acceptance, a read that pays: a composed auto
    turn still starts serially (the draft reads the prompt in its first round, on every
    core) and goes ahead only at its first choice, after AHEAD_SWITCH_ROUNDS rounds, saying
    so with the acceptance it measured; the reply stays plain's. The controller never
    falls back to plain here: it did from the tiny model's measured timings on a Zen 3
    (c 0.48, v(1) 1.33 at α 0.46: 0.81x), and a turn that no longer drafts keeps its way."""
    from specchat.engine.decode.controller import Controller

    monkeypatch.setattr(Controller, "FALLBACK_BELOW", 0.0)
    session = make(target)
    session._ahead_costs = costs_module.AheadCosts(
        costs_module.Costs(40.0, 0.0, verify_at={1: 1.2}), 40.0, 10.0, grid(0.0)
    )
    session.set_ahead("auto")
    assert session.drafts_ahead and session._ahead is not None
    session._ahead.min_ready = 2  # rounds that take drafts whatever the threads' timing
    events = list(session.stream("Once upon a time", DecodeConfig(max_new_tokens=60)))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    went = [
        i
        for i, e in enumerate(rounds)
        if (e.fallback_reason or "").startswith("the draft runs ahead")
    ]
    assert went and went[0] >= ChatSession.AHEAD_SWITCH_ROUNDS, [e.fallback_reason for e in rounds]
    assert "α=" in (rounds[went[0]].fallback_reason or "")
    plain = make(target)
    assert tokens_of(events) == tokens_of(
        list(plain.stream("Once upon a time", DecodeConfig(mode=Mode.PLAIN, max_new_tokens=60)))
    )
