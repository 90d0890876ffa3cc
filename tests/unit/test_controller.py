"""The adaptive K controller: the speedup model and its decisions."""

from __future__ import annotations

import pytest

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.controller import Controller, Costs, expected_speedup, expected_tokens


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_expected_speedup_matches_the_paper_formula() -> None:
    a, k, c = 0.8, 4, 0.1
    assert expected_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


def feed(
    ctrl: Controller, k: int, accepted: int, rounds: int, draft_ms: float, verify_ms: float
) -> None:
    for _ in range(rounds):
        ctrl.observe_round(k, accepted, draft_ms * k, verify_ms)


def test_cheap_draft_high_acceptance_grows_k() -> None:
    ctrl = Controller(
        DecodeConfig(k_max=8), Costs(target_step_ms=100, draft_step_ms=5, verify_slope=0.02)
    )
    feed(ctrl, ctrl.k, ctrl.k, 10, 5, 110)  # everything accepted
    mode, k = ctrl.next()
    assert mode is Mode.SPEC and k >= 6


def test_expensive_draft_low_acceptance_falls_back_with_a_reason() -> None:
    ctrl = Controller(DecodeConfig(), Costs(target_step_ms=100, draft_step_ms=65, verify_slope=0.1))
    ctrl.observe_round(4, 0, 4 * 65, 140)
    feed(ctrl, 4, 1, 5, 65, 140)
    assert ctrl.next() == (Mode.PLAIN, 0)
    reasons = []
    while (r := ctrl.take_reason()) is not None:
        reasons.append(r)
    assert reasons and "fallback to plain" in reasons[-1] and "x < 1" in reasons[-1]


def test_probe_after_plain_tokens() -> None:
    ctrl = Controller(DecodeConfig(), Costs(target_step_ms=100, draft_step_ms=65, verify_slope=0.1))
    feed(ctrl, 4, 0, 5, 65, 140)
    assert ctrl.mode is Mode.PLAIN
    for _ in range(Controller.PROBE_AFTER):
        assert ctrl.next()[0] is Mode.PLAIN
        ctrl.observe_plain(100)
    ctrl.take_reason()
    mode, _ = ctrl.next()
    assert mode is Mode.SPEC
    assert "probe" in (ctrl.take_reason() or "")


def test_forced_k_never_changes() -> None:
    ctrl = Controller(DecodeConfig(k=3), Costs(target_step_ms=100, draft_step_ms=90))
    feed(ctrl, 3, 0, 10, 90, 200)
    assert ctrl.next() == (Mode.SPEC, 3)
