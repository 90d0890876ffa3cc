"""Rolling statistics from events: hand-computed cases and a few properties."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import (
    Provenance,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from specchat.engine.metrics import (
    DecodeMetrics,
    expected_speedup,
    expected_tokens,
    percentile,
)
from specchat.engine.tools.replay import ReplaySession, synthesize_trace, synthesize_turn


def spec_round(
    m: DecodeMetrics,
    rnd: int,
    k: int,
    accepted: int,
    t: float,
    *,
    draft_ms: float = 8.0,
    verify_ms: float = 20.0,
    reason: str | None = None,
) -> None:
    """Feed one speculative round: `accepted` drafts, then a corrected or bonus token."""
    for pos in range(accepted):
        m.observe(TokenEvent(100 + pos, "a", Provenance.ACCEPTED, rnd, pos, 0.9, 0.8, t=t))
    prov = Provenance.BONUS if accepted == k else Provenance.CORRECTED
    m.observe(TokenEvent(200, "b", prov, rnd, accepted, 0.5, None, t=t))
    m.observe(RoundEvent(rnd, Mode.SPEC, k, accepted, draft_ms, verify_ms, reason))


def test_percentile_matches_numpy_linear() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 90, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_expected_speedup_matches_the_paper_formula() -> None:
    a, k, c = 0.8, 4, 0.1
    assert expected_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


def test_expected_speedup_formula_and_limits() -> None:
    # (1 - 0.8^5) / ((1 - 0.8)(4 * 0.1 + 1)) = 0.67232 / 0.28
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # every draft refused
    assert expected_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)  # the alpha -> 1 limit
    assert expected_speedup(0.999999, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-4)
    assert expected_speedup(0.8, 4, 0.1, v=2.0) == pytest.approx(0.67232 / 0.2 / 2.4)
    with pytest.raises(ValueError):
        expected_speedup(1.5, 4, 0.1)


def test_acceptance_by_position_and_histogram() -> None:
    m = DecodeMetrics()
    m.observe(TurnStarted(1, 10, 10, Mode.SPEC), now=0.0)
    spec_round(m, 0, 4, 4, 0.1)
    spec_round(m, 1, 4, 1, 0.2)
    spec_round(m, 2, 4, 0, 0.3)
    spec_round(m, 3, 2, 2, 0.4)
    assert m.drafted == 14
    assert m.accepted == 7
    assert m.acceptance_rate == pytest.approx(7 / 14)
    # position 1 reached by all 4 rounds, passed by 3; position 2 reached by the rounds
    # that accepted >= 1 and drafted >= 2 (3 of them), passed by 2; positions 3 and 4
    # reached only by the first round, which accepted them.
    assert m.acceptance_by_position() == pytest.approx([3 / 4, 2 / 3, 1.0, 1.0])
    assert m.accepted_length_histogram() == [1, 1, 1, 0, 1]
    # tokens per speculative round: (5 + 2 + 1 + 3) / 4
    assert m.mean_accepted_length == pytest.approx(11 / 4)
    assert m.provenance[Provenance.BONUS] == 2
    assert m.provenance[Provenance.CORRECTED] == 2


def test_controller_state_and_fallbacks() -> None:
    m = DecodeMetrics()
    assert m.current_k is None and m.current_mode is None
    m.observe(RoundEvent(0, Mode.SPEC, 4, 1, 8.0, 20.0))
    assert m.current_k == 4
    m.observe(RoundEvent(1, Mode.SPEC, 4, 0, 8.0, 20.0, "acceptance low: K 4 -> 2", Mode.SPEC, 2))
    assert m.current_k == 2
    m.observe(RoundEvent(2, Mode.SPEC, 2, 0, 4.0, 20.0, "still low: plain", Mode.PLAIN, 0))
    assert m.current_mode is Mode.PLAIN
    assert m.last_fallback == (2, "still low: plain")
    assert len(m.fallbacks) == 2


def test_latency_ttft_and_tokens_per_s() -> None:
    m = DecodeMetrics()
    m.observe(TurnStarted(1, 10, 10, Mode.SPEC), now=10.0)
    spec_round(m, 0, 2, 2, 10.100, draft_ms=10, verify_ms=20)  # 3 tokens, first round: 30 ms / 3
    spec_round(m, 1, 2, 0, 10.130)  # 1 token, 30 ms after the previous emission
    assert m.ttft_s == pytest.approx(0.100)
    assert list(m.token_latencies_ms) == pytest.approx([10.0, 10.0, 10.0, 30.0])
    assert m.p50_ms == pytest.approx(10.0)
    assert m.p95_ms == pytest.approx(float(np.percentile([10, 10, 10, 30], 95)))
    assert m.tokens_per_s == pytest.approx(4 / 0.130)
    assert m.draft_share == pytest.approx(18 / 58)  # draft 10 + 8, verify 20 + 20
    # c: draft per drafted token (18 / 4) over verify per round (40 / 2)
    assert m.cost_ratio == pytest.approx((18 / 4) / 20)


def test_costs_are_in_target_steps_when_the_engine_sends_the_step() -> None:
    """A CPU-like pair: verify 2 tokens in 24 ms where a plain step takes 20; draft 8 ms."""
    m = DecodeMetrics()
    for rnd, accepted in enumerate((1, 1, 0, 1)):
        m.observe(RoundEvent(rnd, Mode.SPEC, 1, accepted, 8.0, 24.0, target_step_ms=20.0))
    assert m.cost_ratio == pytest.approx(8 / 20)
    assert m.verify_ratio == pytest.approx(24 / 20)
    # alpha 3/4 at K=1: E = 1.75 tokens for 0.4 + 1.2 steps, not the v=1 formula's 1.25x
    assert m.expected_speedup() == pytest.approx(1.75 / 1.6)
    assert m.expected_speedup() == pytest.approx(expected_speedup(0.75, 1, 0.4, 1.2))
    without = DecodeMetrics()  # an engine that does not send the step: the verify pass is the unit
    without.observe(RoundEvent(0, Mode.SPEC, 1, 1, 8.0, 24.0))
    assert without.verify_ratio is None and without.cost_ratio == pytest.approx(8 / 24)


def test_the_verify_cost_is_taken_at_the_k_it_prices() -> None:
    """Passes at K=1 cost 1.2 steps and at K=4 2.0: each K is priced with its own."""
    m = DecodeMetrics()
    m.observe(RoundEvent(0, Mode.SPEC, 1, 1, 8.0, 24.0, target_step_ms=20.0))
    m.observe(RoundEvent(1, Mode.SPEC, 4, 4, 32.0, 40.0, target_step_ms=20.0))
    assert m.current_k == 4
    assert m.verify_ratio == pytest.approx(2.0)
    assert m.verify_ratio_at(1) == pytest.approx(1.2)
    assert m.verify_ratio_at(3) == pytest.approx(1.6)  # never ran: the mean of all passes
    alpha, c = m.acceptance_rate, m.cost_ratio
    assert alpha is not None and c is not None
    assert m.expected_speedup(1) == pytest.approx(expected_speedup(alpha, 1, c, 1.2))
    assert m.expected_speedup() == pytest.approx(expected_speedup(alpha, 4, c, 2.0))


def test_turn_finished_is_authoritative() -> None:
    events = synthesize_turn("one two three four five six seven", seed=3)
    finished = events[-1]
    assert isinstance(finished, TurnFinished)
    m = DecodeMetrics()
    m.observe_all(events)
    assert m.ttft_s == finished.stats.ttft_s
    assert m.tokens_per_s == finished.stats.tokens_per_s
    assert m.tokens == finished.stats.tokens
    assert m.acceptance_rate == pytest.approx(finished.stats.acceptance_rate)
    assert m.mean_accepted_length == pytest.approx(finished.stats.mean_accepted_length)


def test_early_exit_statistics() -> None:
    m = DecodeMetrics()
    layers = [4, 6, None, 4, None]
    for i, layer in enumerate(layers):
        if layer is None:
            m.observe(TokenEvent(i, "x", Provenance.TARGET, i, t=1.0 + i))
        else:
            m.observe(
                TokenEvent(
                    i, "x", Provenance.EARLY_EXIT, i, exit_layer=layer, confidence=0.9, t=1.0 + i
                )
            )
        m.observe(RoundEvent(i, Mode.EARLY_EXIT, 0, 0, 0.0, 10.0))
    assert m.exit_rate == pytest.approx(3 / 5)
    assert m.exit_layer_histogram() == {4: 2, 6: 1}
    assert m.mean_layers(12) == pytest.approx((4 + 6 + 4 + 12 + 12) / 5)
    assert m.mean_exit_confidence == pytest.approx(0.9)
    assert DecodeMetrics().exit_rate is None


def test_replayed_trace_summary_is_json_and_consistent() -> None:
    session = ReplaySession(synthesize_trace(modes=(Mode.SPEC,)))
    m = DecodeMetrics()
    for _ in range(3):
        m.observe_all(session.stream("q", DecodeConfig()))
    summary = m.summary()
    json.dumps(summary)
    assert summary["turns"] == 3
    assert summary["tokens"] == sum(summary["provenance"].values())
    assert sum(summary["accepted_length_histogram"]) == m.spec_rounds
    assert summary["expected_speedup"] is not None and summary["expected_speedup"] > 1.0


def test_reset_forgets() -> None:
    m = DecodeMetrics()
    spec_round(m, 0, 4, 3, 1.0)
    m.reset()
    assert m.tokens == 0 and m.acceptance_rate is None and not m.token_latencies_ms


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=40))
def test_acceptance_properties(rounds: list[tuple[int, int]]) -> None:
    """For any rounds: rates lie in [0, 1], histogram counts every round, and the
    product of the per-position rates up to i is the share of rounds accepting >= i."""
    m = DecodeMetrics()
    for i, (k, acc) in enumerate(rounds):
        spec_round(m, i, k, min(acc, k), float(i + 1))
    rate = m.acceptance_rate
    assert rate is not None and 0.0 <= rate <= 1.0
    assert sum(m.accepted_length_histogram()) == len(rounds)
    by_pos = m.acceptance_by_position()
    assert all(r is None or 0.0 <= r <= 1.0 for r in by_pos)
    if all(k >= len(by_pos) for k, _ in rounds):  # every round drafted every position
        share = 1.0
        for i, r in enumerate(by_pos, 1):
            share *= r or 0.0
            expect = sum(1 for k, a in rounds if min(a, k) >= i) / len(rounds)
            assert math.isclose(share, expect, rel_tol=1e-9, abs_tol=1e-12)


def test_draft_trees_are_counted_by_round_and_by_second_guess() -> None:
    """A tree round (siblings > 0) whose second token came from the draft's second guess."""
    m = DecodeMetrics()
    m.observe(TokenEvent(5, "a", Provenance.ACCEPTED, 1, position=0, draft_rank=1))
    m.observe(TokenEvent(6, "b", Provenance.ACCEPTED, 1, position=1, draft_rank=2))
    m.observe(TokenEvent(7, "c", Provenance.BONUS, 1, position=2))
    m.observe(RoundEvent(1, Mode.SPEC, 3, 2, 8.0, 20.0, siblings=2))
    m.observe(TokenEvent(8, "d", Provenance.CORRECTED, 2, position=0))
    m.observe(RoundEvent(2, Mode.SPEC, 3, 0, 8.0, 20.0))
    assert (m.tree_rounds, m.second_guesses, m.spec_rounds) == (1, 1, 2)
