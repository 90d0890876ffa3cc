"""Composed drafting in spec mode: prompt lookup first, the draft model where it finds nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import Provenance, RoundEvent, TokenEvent
from tests.tinymodels import pair_session, tiny_llama, turn_finished

# The tiny models repeat themselves: a prompt that repeats gives the lookup matches.
REPEATING = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4)


def run(target: torch.nn.Module, cfg: DecodeConfig) -> list[object]:
    return list(pair_session(target).stream(REPEATING, cfg))


def drafters(events: list[object]) -> set[str | None]:
    return {e.drafter for e in events if isinstance(e, RoundEvent) and e.k}


@pytest.fixture
def copies_when_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy the lookup finds is taken (where the copies' controller lets it), whatever
    the model's round would bring: the tiny draft model agrees with its target so often that
    the choice between them (tested on its own below) would leave these tests no copies."""
    monkeypatch.setattr(ChatSession, "_copy_pays_more", staticmethod(lambda turn: True))


def test_spec_drafts_by_lookup_where_it_matches_and_by_the_model_elsewhere(
    target: torch.nn.Module, copies_when_found: None
) -> None:
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=48)
    composed = run(target, cfg)
    assert drafters(composed) == {"lookup", "tiny-draft"}
    alone = run(target, cfg.with_(compose=False))
    assert drafters(alone) == {"tiny-draft"}
    plain = run(target, cfg.with_(mode=Mode.PLAIN))
    ids = [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in (composed, alone, plain)]
    assert ids[0] == ids[1] == ids[2]  # greedy: whoever drafts, the target's tokens


def test_the_draft_model_catches_up_on_what_lookup_drafted(
    target: torch.nn.Module, copies_when_found: None
) -> None:
    """A model-drafted round's p_draft (of the accepted or the corrected token) is what the
    draft model gives after the whole prefix, lookup rounds included (a draft left behind
    would score another prefix)."""
    s = pair_session(target)
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=64)
    # On this prompt lookup and the model take turns (MMMMMMMLMMMMMMMMLMLL...).
    events = list(s.stream("def add(a, b):\n    return a + b\n", cfg))
    assert turn_finished(events).stats.tokens == 64
    by_round = {e.round: e.drafter for e in events if isinstance(e, RoundEvent)}
    reply = [e for e in events if isinstance(e, TokenEvent)]
    prompt = s.tokens[: len(s.tokens) - len(reply)]
    draft = s.draft.model if s.draft is not None else None
    assert draft is not None
    checked = 0
    lookup_seen = False
    for j, tok in enumerate(reply):
        lookup_seen |= by_round[tok.round] == "lookup"
        if by_round[tok.round] != "tiny-draft" or tok.provenance is Provenance.BONUS:
            continue
        prefix = torch.tensor([prompt + [t.token_id for t in reply[:j]]])
        with torch.inference_mode():
            want = torch.softmax(draft(prefix).logits[0, -1].float(), -1)[tok.token_id]
        assert tok.p_draft == pytest.approx(float(want), rel=1e-4, abs=1e-6)
        checked += lookup_seen  # after a lookup round: the catch-up
    assert checked >= 10


def test_a_copy_is_taken_only_where_it_is_expected_to_pay_more_than_the_models_round(
    target: torch.nn.Module,
) -> None:
    """The composed round compares the two controllers' best expected speedups: a copy whose
    acceptance is low gives way to a draft model that agrees with its target; the same copy
    is taken once the model's controller has fallen back to plain."""
    from types import SimpleNamespace

    from specchat.engine.decode.controller import Controller
    from specchat.engine.decode.costs import Costs

    cfg = DecodeConfig(mode=Mode.SPEC)

    def costs(draft_ms: float) -> Costs:  # c = draft_ms / 50; verify 1.05 steps at K=1, 1.2 at 4
        return Costs(draft_step_ms=draft_ms, target_step_ms=50.0, verify_at={1: 1.05, 4: 1.2})

    model = Controller(cfg, costs(20.0), alpha0=0.8)  # c 0.4, α 0.8
    copier = Controller(cfg, costs(0.0), alpha0=0.2)  # free drafts, α 0.2
    turn = SimpleNamespace(controller=model, copier=copier)
    # The premise, by Leviathan et al.'s E(K) / (K·c + v(K)): both pay against plain, the
    # model more. K=2: (1 + .8 + .64) / (0.8 + 1.1) = 1.284; K=1: 1.2 / 1.05 = 1.143.
    assert model.best() == (2, pytest.approx(2.44 / 1.9))
    assert copier.best() == (1, pytest.approx(1.2 / 1.05))
    assert not ChatSession._copy_pays_more(turn)  # type: ignore[arg-type]
    sure = SimpleNamespace(controller=model, copier=Controller(cfg, costs(0.0), alpha0=0.9))
    assert ChatSession._copy_pays_more(sure)  # type: ignore[arg-type]
    model.mode = Mode.PLAIN
    assert ChatSession._copy_pays_more(turn)  # type: ignore[arg-type]


def test_a_fresh_session_weighs_its_first_copies_as_free_drafts(target: torch.nn.Module) -> None:
    """The copies' controller starts knowing a copy costs no draft step. Unknown, it priced
    every copy at plain's 1x until a copy was measured, which in a session that had run no
    lookup turn never happened: against any draft model that paid, composed spec ran as the
    draft model alone (the default pair's edits, AMX Xeon: 0 copies in 182 rounds)."""
    from types import SimpleNamespace

    from specchat.engine.decode.controller import Controller
    from specchat.engine.decode.costs import Costs

    session = pair_session(target)
    session.costs = Costs(100.0, 20.0, 0.2, {1: 1.2, 4: 2.0})  # as a load measures them
    cfg = DecodeConfig(mode=Mode.SPEC)
    model = Controller(cfg, session._costs_for(Mode.SPEC))
    copier = Controller(cfg, session._costs_for(Mode.LOOKUP))
    assert model.best()[1] > 1.0  # the draft model pays at the prior acceptance
    # At the same prior, a free draft pays more: K=1 1.7 / 1.2 against 1.7 / 1.4.
    assert copier.costs.ratio() == 0.0 and copier.best()[1] > model.best()[1]
    turn = SimpleNamespace(controller=model, copier=copier)
    assert ChatSession._copy_pays_more(turn)  # type: ignore[arg-type]


def test_a_seed_and_a_fixed_k_give_the_same_composed_reply_whatever_the_costs(
    target: torch.nn.Module,
) -> None:
    """Sampled, with K fixed, a composed round takes every copy it finds: which drafter
    proposes (and so how the seed's draws are spent) never rests on measured times. Two
    sessions whose draft costs 0.01 and 0.99 of a target step agree round for round."""
    from specchat.engine.decode.costs import Costs

    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=40, temperature=0.8, seed=11)
    got = []
    for draft_ms in (1.0, 99.0):
        s = pair_session(target)
        s.costs = Costs(100.0, draft_ms, 0.05, {1: 1.05, 3: 1.1})
        events = list(s.stream(REPEATING, cfg))
        rounds = [(e.drafter, e.k, e.accepted) for e in events if isinstance(e, RoundEvent)]
        got.append((rounds, [e.token_id for e in events if isinstance(e, TokenEvent)]))
    assert "lookup" in {d for d, _, _ in got[0][0]}, "no copy was found: the test proves nothing"
    assert got[0] == got[1]


def test_the_bench_runs_spec_alone_as_the_draft_model_without_lookup() -> None:
    from specchat.engine.config import SPEC_ALONE
    from specchat.engine.tools.bench_runs import SESSION_ARMS, arm_config

    assert SPEC_ALONE in SESSION_ARMS
    alone = arm_config(SPEC_ALONE, DecodeConfig(k=2))
    assert alone.mode is Mode.SPEC and not alone.compose and alone.k == 2
    assert arm_config("spec", DecodeConfig()).compose


def test_the_models_rounds_are_told_what_the_copies_cost_it(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, copies_when_found: None
) -> None:
    """Every token a copy emitted reaches the model's controller before the model's next
    chance to draft (observe_copies), and each catch-up pass after the prompt's prices a
    row with the rows it read (observe_catch_up). Here every read past a round's two rows
    takes a pass of its own (FOLDED_ROWS 1): the tiny replies' copies are short."""
    from specchat.engine.decode.controller import Controller
    from specchat.engine.decode.speculative import ModelDrafter

    monkeypatch.setattr(ModelDrafter, "FOLDED_ROWS", 1)
    copies: list[int] = []
    reads: list[int] = []
    monkeypatch.setattr(Controller, "observe_copies", lambda self, n: copies.append(n))
    monkeypatch.setattr(Controller, "observe_catch_up", lambda self, n, ms: reads.append(n))
    session = pair_session(target)
    assert isinstance(session.drafter, ModelDrafter)
    runner = session.drafter.runner
    fed: list[int] = []  # the rows each catch-up pass of the draft read
    prefill = runner.prefill

    def counted(seq: list[int], prompt: bool = False) -> None:
        fed.append(len(seq) - 1 - runner.cached)
        prefill(seq, prompt)

    monkeypatch.setattr(runner, "prefill", counted)
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=64)
    events = list(session.stream("def add(a, b):\n    return a + b\n", cfg))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    per_round = [sum(isinstance(e, TokenEvent) and e.round == r.round for e in events) for r in rounds]
    copied, expected = 0, []
    # The first round is the target's alone; the last may be a plain step whoever had drafts.
    for r, n in zip(rounds[1:-1], per_round[1:-1], strict=True):
        if r.drafter == "lookup":
            copied += n
        else:
            expected.append(copied)
            copied = 0
    assert copies[: len(expected)] == expected and sum(copies) >= 10
    # The first pass read the prompt; every later one was priced with what it read.
    assert len(fed) >= 3 and fed[1:] == reads
    timed = [r.catch_up_ms for r in rounds if r.drafter == "tiny-draft"]
    assert sum(ms > 0 for ms in timed) >= len(fed)


def test_a_short_copy_rides_in_the_drafts_first_pass_priced_as_a_read(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, copies_when_found: None
) -> None:
    """The tokens a copy left the draft behind by (up to FOLDED_ROWS) go in its first draft
    pass, not a catch-up pass of their own; the round moves their rows' price from its
    draft time to its catch-up, and no row is learnt from that price."""
    from specchat.engine.decode.controller import Controller
    from specchat.engine.decode.costs import Costs
    from specchat.engine.decode.speculative import ModelDrafter

    session = pair_session(target)
    assert isinstance(session.drafter, ModelDrafter)
    runner = session.drafter.runner
    passes: list[int] = []  # the rows each catch-up pass read
    prefill = runner.prefill

    def counted(seq: list[int], prompt: bool = False) -> None:
        passes.append(len(seq) - 1 - runner.cached)
        prefill(seq, prompt)

    monkeypatch.setattr(runner, "prefill", counted)
    learnt: list[int] = []
    monkeypatch.setattr(Controller, "observe_catch_up", lambda self, n, ms: learnt.append(n))
    row_ms = 0.1  # a row's price: a few of them stay below a tiny draft pass (~1.5 ms)
    monkeypatch.setattr(Costs, "folded_ms", lambda self, rows: rows * row_ms)
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=64)
    events = list(session.stream(CODE, cfg))
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    # After a copy, the model's round read 2..FOLDED_ROWS tokens beyond the round's two.
    after_copy = [
        r for prev, r in zip(rounds, rounds[1:], strict=False)
        if prev.drafter == "lookup" and r.drafter == "tiny-draft"
    ]
    assert len(after_copy) >= 2
    assert passes == [p for p in passes if p > ModelDrafter.FOLDED_ROWS]  # the prompt's, if any
    assert learnt == []
    # A read is priced at its rows, on top of the timed no-op catch-up call: microseconds,
    # unless the machine paused the test there (a loaded CI box), so a round whose no-op
    # took more than a fifth of a row's price (20 us) is left out, and most rounds must count.
    read = [r for r in after_copy if r.catch_up_ms >= 0.05]
    assert read
    exact = []
    for r in read:
        rows = round(r.catch_up_ms / row_ms)
        if rows >= 2 and 0 <= r.catch_up_ms - rows * row_ms < 0.2 * row_ms:
            assert r.draft_ms > 0
            exact.append(rows)
    assert exact and 2 * len(exact) >= len(read)
    assert all(rows <= ModelDrafter.FOLDED_ROWS for rows in exact)
    plain = plain_tokens(target, cfg)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == plain


def reasons(events: list[object]) -> list[str]:
    return [e.fallback_reason for e in events if isinstance(e, RoundEvent) and e.fallback_reason]


CODE = "def add(a, b):\n    return a + b\n"


def plain_tokens(target: torch.nn.Module, cfg: DecodeConfig) -> list[int]:
    """The target's own tokens for CODE at cfg's budget."""
    events = pair_session(target).stream(CODE, cfg.with_(mode=Mode.PLAIN))
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def priced_session(target: torch.nn.Module, *, row_ms: float, pass_ms: float) -> ChatSession:
    """A session at fixed costs: a step 100 ms, c 0.2, v(1) 1.2, v(4) 2.0, and a catch-up
    pass of pass_ms + row_ms a row."""
    from specchat.engine.decode.costs import Costs

    s = pair_session(target)
    s.costs = Costs(
        100.0, 20.0, 0.2, {1: 1.2, 4: 2.0}, catch_up_row_ms=row_ms, catch_up_pass_ms=pass_ms
    )
    return s


def test_a_prompt_read_that_cannot_pay_back_leaves_copies_and_plain_steps(
    target: torch.nn.Module,
) -> None:
    """At costs where the draft's read of the prompt outweighs what its rounds could save in
    the reply's budget, spec composed decodes as lookup alone: copies and plain steps, the
    target's tokens all the same, and says why; where the read is free the model drafts."""
    cfg = DecodeConfig(mode=Mode.SPEC, max_new_tokens=48)
    plain = plain_tokens(target, cfg)
    got = {}
    for name, pass_ms in (("dear", 5000.0), ("free", 0.0)):
        s = priced_session(target, row_ms=0.0, pass_ms=pass_ms)
        events = list(s.stream(CODE, cfg))
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == plain
        got[name] = events
    assert drafters(got["dear"]) == {"lookup"}
    assert any("the draft's read of" in r and "would not pay back" in r for r in reasons(got["dear"]))
    assert "tiny-draft" in drafters(got["free"])
    assert not any("would not pay back" in r for r in reasons(got["free"]))


def test_the_read_pays_back_in_the_length_this_sessions_replies_run(
    target: torch.nn.Module,
) -> None:
    """Weighed against a budget of 400 tokens, the draft's read of the prompt (0.2 of a
    step a row) pays and the model drafts; where this session's replies ran 8 tokens when
    they ended of themselves, the same read is weighed against those and declined, with
    the reason; the tokens are plain's either way."""
    cfg = DecodeConfig(mode=Mode.SPEC, max_new_tokens=400)
    plain = plain_tokens(target, cfg)
    got = {}
    for name, typical in (("budget", None), ("short replies", 8.0)):
        s = priced_session(target, row_ms=20.0, pass_ms=0.0)
        s._reply_tokens = typical
        got[name] = list(s.stream(CODE, cfg))
        assert [e.token_id for e in got[name] if isinstance(e, TokenEvent)] == plain
    assert "tiny-draft" in drafters(got["budget"])
    assert not any("would not pay back" in r for r in reasons(got["budget"]))
    assert "tiny-draft" not in drafters(got["short replies"])
    said = reasons(got["short replies"])
    assert any("a reply here has left (replies ran 8 tokens)" in r for r in said), said


def test_the_typical_reply_length_is_kept_from_replies_that_ended_of_themselves(
    target: torch.nn.Module,
) -> None:
    s = pair_session(target)
    s._remember_length("max_tokens", 500)  # cut by the budget: says nothing of the length
    assert s._reply_tokens is None
    s._remember_length("eos", 40)
    s._remember_length("stop_string", 20)
    assert s._reply_tokens == pytest.approx(30.0)
    s._remember_length("cancelled", 2)
    assert s._reply_tokens == pytest.approx(30.0)
    s.reset()  # a new conversation with the same user: kept
    assert s._reply_tokens == pytest.approx(30.0)
    s.reset(drop_caches=True)  # a benchmark's cold start: forgotten
    assert s._reply_tokens is None


def test_a_benchmarks_cold_start_starts_from_the_costs_the_first_turn_had(
    target: torch.nn.Module,
) -> None:
    """Turns teach the session's costs (the draft's step, the verify passes, a lookup's own);
    a new conversation keeps them, but a benchmark's cold start restores the costs its first
    turn started from, so no arm of a bench starts from what another arm's runs learnt. A
    new measurement is what later cold starts restore."""
    s = priced_session(target, row_ms=2.0, pass_ms=10.0)
    first = copy.deepcopy(s.costs)
    cfg = DecodeConfig(mode=Mode.SPEC, max_new_tokens=24)
    for mode in (Mode.SPEC, Mode.LOOKUP):
        list(s.stream(REPEATING, cfg.with_(mode=mode)))
    learnt = copy.deepcopy(s.costs)
    assert learnt != first and s._mode_costs  # the turns taught the costs
    s.reset()  # the same user's new conversation: kept
    assert s.costs == learnt
    s.reset(drop_caches=True)
    assert s.costs == first and not s._mode_costs
    list(s.stream(REPEATING, cfg))  # a second cold run learns again, from the same start
    s.reset(drop_caches=True)
    assert s.costs == first
    measured = copy.deepcopy(s.measure_costs(k=2, repeats=1))
    list(s.stream(REPEATING, cfg))
    assert s.costs != measured
    s.reset(drop_caches=True)
    assert s.costs == measured


def test_the_copies_controller_names_itself_in_its_reasons(target: torch.nn.Module) -> None:
    """Composed, the copies have a controller of their own (its c is 0): each of its
    reasons says "copies:", so the acceptance panel's line ("K 4->8: ... c=0.00") does not
    read as the draft model's; the model's controller says nothing of the kind."""
    cfg = DecodeConfig(mode=Mode.SPEC, max_new_tokens=64)
    events = list(pair_session(target).stream(REPEATING, cfg))
    said = [
        (e.drafter, e.fallback_reason)
        for e in events
        if isinstance(e, RoundEvent) and e.fallback_reason
    ]
    copies = [r for d, r in said if d == "lookup"]
    model = [r for d, r in said if d != "lookup"]
    assert copies and all(r.startswith("copies: ") for r in copies), said
    assert model and not any(r.startswith("copies") for r in model), said
