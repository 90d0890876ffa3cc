"""Speculative decoding on tiny models built in code: exactness and cache rollback."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.speculative import ModelDrafter, speculative_round
from specchat.engine.events import Provenance, RoundEvent, TokenEvent, TurnFinished
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import loaded, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4)


def session(target: torch.nn.Module, draft: torch.nn.Module | None = None) -> ChatSession:
    d = draft if draft is not None else layer_truncated(target, 3)
    return ChatSession(loaded(target), loaded(d, "draft"))


def reply(s: ChatSession, prompt: str, **cfg: object) -> tuple[list[int], list[object]]:
    events = list(s.stream(prompt, DecodeConfig(**cfg)))  # type: ignore[arg-type]
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return tokens, events


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_spec_equals_plain(target: torch.nn.Module, k: int) -> None:
    plain, _ = reply(session(target), "Once upon a time", mode=Mode.PLAIN, max_new_tokens=40)
    spec, events = reply(
        session(target), "Once upon a time", mode=Mode.SPEC, k=k, max_new_tokens=40
    )
    assert spec == plain
    assert len(plain) == 40
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert all(r.k <= k for r in rounds) and any(r.k == k for r in rounds)


def test_greedy_adaptive_k_equals_plain_with_a_different_random_draft(
    target: torch.nn.Module,
) -> None:
    # A draft that knows nothing of the target: acceptance near zero, output still exact.
    other = tiny_llama(seed=7, layers=2)
    plain, _ = reply(session(target, other), "def add(a, b):", mode=Mode.PLAIN, max_new_tokens=30)
    spec, events = reply(
        session(target, other), "def add(a, b):", mode=Mode.SPEC, max_new_tokens=30
    )
    assert spec == plain


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_k_beyond_the_remaining_budget(target: torch.nn.Module, budget: int) -> None:
    plain, _ = reply(session(target), "The quick brown fox", mode=Mode.PLAIN, max_new_tokens=budget)
    spec, _ = reply(
        session(target), "The quick brown fox", mode=Mode.SPEC, k=8, max_new_tokens=budget
    )
    assert spec == plain and len(spec) == budget


def test_eos_inside_a_draft_block(target: torch.nn.Module) -> None:
    plain, _ = reply(session(target), "Once upon a time", mode=Mode.PLAIN, max_new_tokens=30)
    eos = plain[6]  # pretend the 7th token is an end of sequence
    first = plain.index(eos)
    results = []
    for mode in (Mode.PLAIN, Mode.SPEC):
        s = session(target)
        s.eos = frozenset({eos})
        tokens, events = reply(s, "Once upon a time", mode=mode, k=8, max_new_tokens=30)
        stats = [e for e in events if isinstance(e, TurnFinished)][0].stats
        assert stats.stop_reason == "eos"
        results.append(tokens)
    assert results[0] == results[1] == plain[: first + 1]


def test_one_token_prompt(target: torch.nn.Module) -> None:
    tok = tiny_tokenizer()
    assert len(tok("a", add_special_tokens=False)["input_ids"]) == 1
    plain, _ = reply(session(target), "a", mode=Mode.PLAIN, max_new_tokens=20)
    spec, _ = reply(session(target), "a", mode=Mode.SPEC, k=4, max_new_tokens=20)
    assert spec == plain


def test_provenance_and_probabilities(target: torch.nn.Module) -> None:
    _, events = reply(session(target), "Once upon a time", mode=Mode.SPEC, k=3, max_new_tokens=40)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    kinds = {t.provenance for t in tokens}
    # Greedy and seeded: the first token is the target's alone, then all three kinds of
    # a round.
    assert tokens[0].provenance is Provenance.TARGET
    assert kinds == {Provenance.ACCEPTED, Provenance.CORRECTED, Provenance.BONUS, Provenance.TARGET}
    assert sum(t.provenance is Provenance.TARGET for t in tokens) == 1
    for t in tokens:
        assert t.p_target is not None and 0.0 < t.p_target <= 1.0
        if t.provenance is Provenance.CORRECTED:
            assert t.rejected_id is not None and t.rejected_id != t.token_id
            assert t.rejected_text is not None
        if t.provenance is Provenance.ACCEPTED:
            assert t.p_draft is not None
    # Each round's events: its tokens, then one RoundEvent whose counts match.
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    for r in rounds:
        in_round = [t for t in tokens if t.round == r.round]
        assert sum(t.provenance is Provenance.ACCEPTED for t in in_round) == r.accepted


@pytest.mark.parametrize("quant_mode", [QuantMode.NONE, QuantMode.INT8, QuantMode.W8A8])
def test_cache_rollback_equals_fresh_forward(quant_mode: QuantMode) -> None:
    """After a round that refuses drafts, both caches hold the accepted prefix and nothing else.

    Every runner here is batch-invariant (engine/model/invariance.py: quantized kernels
    compute each row alone; float32 verify blocks run the fixed-order kernel or
    one row at a time), so a token's logits do not depend on how many tokens
    were fed with it, and the rolled-back caches must give, bit for bit, the
    logits of a fresh forward.
    """
    from specchat.engine.model import quant

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert torch.equal(a, b), f"differs by {(a - b).abs().max()}"

    target = quant.apply(tiny_llama(seed=0, layers=4), quant_mode)
    # The draft shares the target's first 3 layers, and with them the row-wise attention
    # the target's runner turns on (a truncated copy's layers read the original's config).
    draft = layer_truncated(target, 3)
    tok = tiny_tokenizer()
    seq = tok("Speculative decoding drafts tokens", add_special_tokens=False)["input_ids"]
    cpu = torch.device("cpu")
    runner = ModelRunner(target, cpu)
    drafter = ModelDrafter(ModelRunner(draft, cpu))
    runner.prefill(seq)
    untouched = len(seq) - 1  # the round re-feeds the last token of seq, then the drafts
    before = [
        (layer.keys[:, :, :untouched].clone(), layer.values[:, :, :untouched].clone())
        for layer in runner.cache.layers
    ]
    res = speculative_round(runner, drafter, seq, 5, DecodeConfig(), None)
    assert 0 < res.accepted < 5, "the round must refuse a draft after accepting some"
    assert runner.cached == len(seq) + res.accepted
    assert drafter.runner.cached == len(seq) + res.accepted
    for layer, (keys, values) in zip(runner.cache.layers, before, strict=True):
        assert layer.get_seq_length() == runner.cached
        assert torch.equal(layer.keys[:, :, :untouched], keys)
        assert torch.equal(layer.values[:, :, :untouched], values)
    new_seq = seq + [e.token_id for e in res.tokens]
    same(runner.forward(new_seq)[-1], ModelRunner(target, cpu).forward(new_seq)[-1])
    same(drafter.runner.forward(new_seq)[-1], ModelRunner(draft, cpu).forward(new_seq)[-1])
    # And an explicit crop back to a shorter prefix.
    runner.crop_to(len(seq) - 2)
    same(runner.forward(seq)[-1], ModelRunner(target, cpu).forward(seq)[-1])


@pytest.mark.parametrize(
    ("target_quant", "draft_quant"),
    [("int8", "int4"), ("int4", "int8"), ("w8a8", "w8a8"), ("w8a8", "int4")],
)
def test_greedy_spec_with_quantized_models_equals_plain_of_the_same_target(
    target_quant: str, draft_quant: str
) -> None:
    """Exact with respect to the target as loaded: both arms use the same quantized target."""
    from specchat.engine.config import QuantMode
    from specchat.engine.model import quant

    target = quant.apply(tiny_llama(seed=0, layers=4), QuantMode(target_quant))
    draft = quant.apply(layer_truncated(tiny_llama(seed=0, layers=4), 3), QuantMode(draft_quant))
    outs = {}
    for mode in (Mode.PLAIN, Mode.SPEC):
        s = ChatSession(loaded(target), loaded(draft, "draft"))
        events = list(s.stream("Once upon a time", DecodeConfig(mode=mode, k=3, max_new_tokens=32)))
        outs[mode] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert outs[Mode.SPEC] == outs[Mode.PLAIN]
    assert len(outs[Mode.PLAIN]) >= 16  # a real stretch of text (w8a8-w8a8 ends at 16)


def test_draft_catch_up_is_not_timed_as_drafting(target: torch.nn.Module) -> None:
    """After tokens decoded without drafting, the draft catches up before the timed draft
    step: draft_ms stays the cost of k draft steps, not of a 40-token prefill."""
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = ModelDrafter(ModelRunner(tiny_llama(seed=3, layers=2), torch.device("cpu")))
    seq = list(range(3, 44))
    calls: list[tuple[str, int]] = []
    catch_up, propose = drafter.catch_up, drafter.propose

    def recording_catch_up(s: list[int]) -> None:
        catch_up(s)
        calls.append(("catch_up", drafter.runner.cached))

    def recording_propose(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(("propose", drafter.runner.cached))
        return propose(*args)  # type: ignore[arg-type]

    drafter.catch_up = recording_catch_up  # type: ignore[method-assign]
    drafter.propose = recording_propose  # type: ignore[method-assign]
    speculative_round(runner, drafter, seq, 3, DecodeConfig(), None)
    assert calls == [("catch_up", len(seq) - 1), ("propose", len(seq) - 1)]


def test_a_rounds_own_pending_tokens_go_into_the_drafts_first_pass(target: torch.nn.Module) -> None:
    """After a round the draft lacks its last draft and the bonus token: those two are fed in
    propose's first pass (one pass of 2 tokens), not by catch_up as a separate pass; so is
    a short stretch (a copy) up to FOLDED_ROWS past them. A longer one is fed by catch_up."""
    drafter = ModelDrafter(ModelRunner(tiny_llama(seed=3, layers=2), torch.device("cpu")))
    seq = list(range(3, 20))
    drafter.runner.forward(seq)  # as propose leaves it: all of seq cached
    drafter.catch_up(seq + [5, 6])  # two pending tokens: left to propose
    assert drafter.runner.cached == len(seq)
    short = [5, 6] + [7] * (drafter.FOLDED_ROWS - 1)  # FOLDED_ROWS unread: still left to propose
    drafter.catch_up(seq + short)
    assert drafter.runner.cached == len(seq)
    drafter.catch_up(seq + short + [8])  # a longer stretch: fed now, all but the last
    assert drafter.runner.cached == len(seq) + len(short)
