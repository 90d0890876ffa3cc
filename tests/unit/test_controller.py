"""The adaptive K controller: the speedup model and its decisions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specchat.engine.config import MAX_K, DecodeConfig, Mode
from specchat.engine.decode.controller import Controller
from specchat.engine.decode.costs import Costs


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
    assert reasons and "fallback to plain" in reasons[-1] and "x < 0.95" in reasons[-1]


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


def test_verify_cost_uses_measured_points_then_interpolates() -> None:
    costs = Costs(target_step_ms=100, draft_step_ms=40, verify_slope=0.25, verify_at={1: 1.1, 4: 2.0})
    assert costs.verify_ratio(1) == 1.1 and costs.verify_ratio(4) == 2.0
    assert costs.verify_ratio(2) == pytest.approx(1.1 + 0.9 / 3)
    assert costs.verify_ratio(6) == pytest.approx(2.0 + 2 * 0.25)  # past the last point: the slope
    assert Costs(verify_slope=0.1).verify_ratio(3) == pytest.approx(1.3)  # nothing measured


def test_first_round_k_comes_from_the_measured_costs() -> None:
    """A CPU pair (c=0.4, verifying 5 tokens costs 2 steps) starts at K=1, a cheap draft higher."""
    cpu = Controller(DecodeConfig(), Costs(100, 40, 0.25, {1: 1.1, 4: 2.0}))
    assert cpu.next() == (Mode.SPEC, 1)
    cheap = Controller(DecodeConfig(k_max=8), Costs(100, 5, 0.02))
    assert cheap.next()[1] >= 3
    assert Controller(DecodeConfig()).k == 4  # no costs measured yet: the default
    assert Controller(DecodeConfig(k=3), Costs(100, 40, 0.25, {1: 1.1})).k == 3  # forced


def test_rounds_measure_the_verify_cost_at_their_k() -> None:
    ctrl = Controller(DecodeConfig(k=2), Costs(100, 40, 0.25, {1: 1.1, 4: 2.0}))
    ctrl.observe_round(2, 2, 80, 130)
    assert ctrl.costs.verify_at[2] == pytest.approx(1.3)


def test_acceptance_forgets_per_draft_token_not_per_round() -> None:
    """Ten accepted drafts move the estimate as far in ten K=1 rounds as in two K=5 rounds."""
    costs = {1: 1.1, 5: 2.2}
    small = Controller(DecodeConfig(k=1), Costs(100, 40, 0.25, dict(costs)), alpha0=0.5)
    big = Controller(DecodeConfig(k=5), Costs(100, 40, 0.25, dict(costs)), alpha0=0.5)
    feed(small, 1, 1, 10, 40, 110)
    feed(big, 5, 5, 2, 40, 220)
    assert small.alpha == pytest.approx(big.alpha)
    assert small.alpha == pytest.approx(1 - 0.5 * Controller.MEMORY**10)


def probe(ctrl: Controller, accepted: int) -> str:
    """Run plain tokens until the controller probes, then one K=1 round; return its reasons."""
    steps = 0
    while ctrl.next()[0] is Mode.PLAIN:
        ctrl.observe_plain(100)
        steps += 1
        assert steps <= Controller.PROBE_AFTER_MAX
    reasons = [ctrl.take_reason() or ""]
    ctrl.observe_round(1, accepted, 40, 122)
    reasons.append(ctrl.take_reason() or "")
    return " | ".join(reasons) + f" | after {steps}"


def test_a_failed_probe_doubles_the_wait_and_a_good_one_resets_it() -> None:
    ctrl = Controller(DecodeConfig(k_max=1), Costs(100, 40, 0.25, {1: 1.22}))
    feed(ctrl, 1, 0, 10, 40, 122)  # nothing accepted: plain
    assert ctrl.mode is Mode.PLAIN
    assert "probing again in 24 tokens" in (ctrl.take_reason() or "")
    first = probe(ctrl, 0)
    assert "after 24" in first and "probing again in 48 tokens" in first
    second = probe(ctrl, 0)
    assert "after 48" in second and "probing again in 96 tokens" in second
    assert "probing again in 96 tokens" in probe(ctrl, 0)  # capped
    resumed = probe(ctrl, 1)
    assert "speculation pays again" in resumed and ctrl.mode is Mode.SPEC
    feed(ctrl, 1, 0, 10, 40, 122)
    assert "probing again in 24 tokens" in (ctrl.take_reason() or "")


# -- draft trees: a second guess beside the chain where the verify pass stays flat ----------


def test_a_tree_pays_where_verify_rows_are_nearly_free_and_acceptance_is_middling() -> None:
    """α 0.6 and β 0.45: with a verify pass near one step at any size (a GPU, c 0.1) the
    controller hangs a second guess beside its drafts; with this CPU class's steep passes
    (AVX2 Zen 3: v(2..5) 1.15-2.22, c 0.44) it keeps a chain."""
    flat = Controller(DecodeConfig(), Costs(100, 10, 0.01), alpha0=0.6, tree=True)
    assert flat.siblings >= 1
    k, s = flat.k, flat.siblings
    assert flat.speedup(k, s) > flat.speedup(k, 0)
    steep = Costs(100, 44, 0.3, {1: 1.15, 2: 1.55, 3: 1.61, 4: 2.22})
    assert Controller(DecodeConfig(), steep, alpha0=0.6, tree=True).siblings == 0
    assert Controller(DecodeConfig(), Costs(100, 10, 0.01), alpha0=0.6).siblings == 0  # no tree
    off = Controller(DecodeConfig(siblings=0), Costs(100, 10, 0.01), alpha0=0.6, tree=True)
    assert off.siblings == 0 and not off.tree  # --siblings 0
    fixed = Controller(DecodeConfig(k=3, siblings=2), steep, tree=True)
    assert (fixed.k, fixed.siblings) == (3, 2)  # forced, whatever it costs
    assert Controller(DecodeConfig(k=1, siblings=3), steep, tree=True).siblings == 1  # K deep


def test_rounds_that_end_on_a_guess_raise_beta_and_refusals_lower_it() -> None:
    ctrl = Controller(DecodeConfig(k=2, siblings=2), Costs(100, 10, 0.01), tree=True)
    before = ctrl.beta
    for _ in range(10):  # the chain refused at depth 1, its second guess taken
        ctrl.observe_round(2, 1, 20, 105, siblings=2, off_chain=True)
    assert ctrl.beta > 0.8 > before
    assert ctrl.alpha < 0.3  # the chain's own drafts were refused every time
    assert ctrl.costs.verify_at[4] == pytest.approx(1.05)  # priced at its 4 drafts
    for _ in range(10):  # refused, and so was the guess
        ctrl.observe_round(2, 0, 20, 105, siblings=2)
    assert ctrl.beta < 0.4
    beta = ctrl.beta
    ctrl.observe_round(2, 2, 20, 105, siblings=2)  # all accepted: no guess was tried
    ctrl.observe_round(2, 1, 20, 105, siblings=1)  # refused below the guessed depth
    assert ctrl.beta == beta


def test_the_load_says_up_to_which_acceptance_trees_pay() -> None:
    """trees_pay_below, what Ready states: with verify rows near one step and a draft at
    c 0.1 the second guess is chosen up to α 0.68 (β at its prior 0.45, 10% better than the
    best chain); with AVX2 Zen 3's steep verify passes (c 0.44) at no acceptance."""
    from specchat.engine.decode.controller import trees_pay_below

    assert trees_pay_below(Costs(100, 10, 0.01)) == pytest.approx(0.68)
    assert trees_pay_below(Costs(100, 44, 0.3, {1: 1.15, 2: 1.55, 3: 1.61, 4: 2.22})) is None


def test_trees_follow_the_drafter_and_the_verify_pass_bound() -> None:
    """A turn that drafts ahead plans chains (the draft ahead keeps a chain of its own), and
    takes trees again when it drafts serially; a forced --siblings stops where a verify
    pass would pass MAX_ROWWISE rows; the hysteresis compares what plans are chosen by."""
    from specchat.engine.model.attention import MAX_ROWWISE

    flat = Costs(100, 10, 0.01)
    ctrl = Controller(DecodeConfig(), flat, alpha0=0.5, tree=True)
    assert ctrl.siblings >= 1
    ctrl.use_costs(Costs(100, 10, 0.01), tree=False)  # the draft now runs ahead
    assert ctrl.siblings == 0 and not ctrl.tree
    ctrl.use_costs(Costs(100, 10, 0.01), tree=True)  # serial again
    assert ctrl.tree and ctrl.siblings >= 1
    deep = Controller(DecodeConfig(k=MAX_ROWWISE - 2, siblings=8), flat, tree=True)
    assert deep.siblings == 1  # 1 + K + 1 rows
    off = Controller(DecodeConfig(siblings=0), flat, alpha0=0.5, tree=True)
    off.use_costs(Costs(100, 10, 0.01), tree=True)
    assert not off.tree and off.siblings == 0  # --siblings 0 holds


# -- spec composed with lookup: the draft model reads what each copy added ------------------


def composed_controller() -> Controller:
    """A draft that pays alone: c 0.3, v(1) 1.2, α 0.85 gives 1.85 / 1.5 = 1.23x at K=1;
    the draft reads a missed token in 0.08 of a target step."""
    return Controller(
        DecodeConfig(k_max=1), Costs(100, 30, 0.2, {1: 1.2}, catch_up_row_ms=8), alpha0=0.85
    )


def test_copies_between_the_models_rounds_are_priced_until_it_falls_back() -> None:
    ctrl = composed_controller()
    assert ctrl.speedup(1) == pytest.approx(1.85 / 1.5)
    ctrl.observe_copies(0)
    assert ctrl.mode is Mode.SPEC and ctrl.catch_up_steps == 0.0
    # Seven tokens copied before each of the model's rounds: o = 7 x 0.08 = 0.56 steps,
    # 1.85 / 2.06 = 0.90x, under the fallback threshold.
    for _ in range(12):
        ctrl.observe_copies(7)
        if ctrl.mode is Mode.PLAIN:
            break
    assert ctrl.mode is Mode.PLAIN
    assert 0.3 < ctrl.catch_up_steps <= 0.56
    reason = ctrl.take_reason() or ""
    assert "fallback to plain" in reason and "catch-up 0." in reason


def test_the_model_comes_back_when_the_reply_stops_copying() -> None:
    ctrl = composed_controller()
    for _ in range(12):
        ctrl.observe_copies(7)
    assert ctrl.mode is Mode.PLAIN
    ctrl.take_reason()
    # New text: plain steps with nothing copied between them, then the probe.
    while ctrl.next()[0] is Mode.PLAIN:
        ctrl.observe_copies(0)
        ctrl.observe_plain(100)
    assert ctrl.catch_up_steps < 0.1  # 24 rounds without a copy: 0.9^24 of the old count
    ctrl.observe_round(1, 1, 30, 120)
    assert ctrl.mode is Mode.SPEC
    assert "speculation pays again" in (ctrl.take_reason() or "")


def test_a_catch_up_pass_prices_a_row_past_the_pass_itself() -> None:
    ctrl = Controller(DecodeConfig(), Costs(100, 30, catch_up_row_ms=8, catch_up_pass_ms=20))
    assert ctrl.costs.catch_up_ratio(10) == pytest.approx((20 + 80) / 100)
    assert ctrl.costs.catch_up_ratio(0) == 0.0
    ctrl.observe_catch_up(10, 320.0)  # 30 ms a row past the pass's 20
    assert ctrl.costs.catch_up_row_ms == pytest.approx(0.7 * 8 + 0.3 * 30)
    ctrl.observe_catch_up(0, 5.0)  # nothing read: no price
    assert ctrl.costs.catch_up_row_ms == pytest.approx(0.7 * 8 + 0.3 * 30)
    unknown = Controller(DecodeConfig(), Costs(100, 30))
    unknown.observe_copies(20)
    assert unknown.catch_up_steps == 0.0  # no row measured: nothing priced


def test_a_long_read_is_made_only_where_the_reply_can_pay_it_back() -> None:
    """1.23x at K=1 saves 1 - 1/1.23 = 0.19 steps a token; reading 200 tokens costs
    (20 + 200·4) / 100 = 8.2 steps: it pays back over 44 tokens, not over 40."""
    costs = Costs(100, 30, 0.2, {1: 1.2}, catch_up_row_ms=4, catch_up_pass_ms=20)
    gain = 1 - 1 / (1.85 / 1.5)
    ctrl = Controller(DecodeConfig(k_max=1), costs, alpha0=0.85)
    assert ctrl.pays_to_read(200, 45) and ctrl.mode is Mode.SPEC
    assert 8.2 / gain == pytest.approx(43.3, abs=0.1)
    assert not ctrl.pays_to_read(200, 40)
    assert ctrl.mode is Mode.PLAIN
    reason = ctrl.take_reason() or ""
    assert "read of 200 tokens (8.2 steps) would not pay back in the 40 tokens" in reason
    assert "probing again in 24 tokens" in reason
    # At the probe the stretch is read again or not; refused, the wait doubles.
    for _ in range(Controller.PROBE_AFTER):
        assert ctrl.next()[0] is Mode.PLAIN
        ctrl.observe_plain(100)
    assert ctrl.next()[0] is Mode.SPEC
    ctrl.take_reason()
    assert not ctrl.pays_to_read(24, 2)
    assert "probing again in 48 tokens" in (ctrl.take_reason() or "")
    forced = Controller(DecodeConfig(k=1), costs, alpha0=0.85)
    assert forced.pays_to_read(200, 1)  # a fixed K is the user's choice


def test_a_read_is_priced_with_the_first_pass_a_round_pays() -> None:
    """A draft step of 0.2 (one row, one thread) but a first pass over a round's two pending
    rows of 0.5 (20 + 2·15 ms): at K=1 and α 0.85 a round brings 1.85 tokens for 1.7 steps,
    not 1.4, so reading 100 tokens (15.2 steps) does not pay back in 150 tokens (gain 12.2)
    though it would at the one-row step (gain 36.5)."""
    costs = Costs(100, 20, 0.2, {1: 1.2}, catch_up_row_ms=15, catch_up_pass_ms=20)
    ctrl = Controller(DecodeConfig(k_max=1), costs, alpha0=0.85)
    assert ctrl.speedup(1) == pytest.approx(1.85 / 1.4)
    assert not ctrl.pays_to_read(100, 150)
    assert "at 1.09x (K=1, gain 12.2 steps)" in (ctrl.take_reason() or "")
    cheap = Controller(DecodeConfig(k_max=1), replace(costs, catch_up_row_ms=1.0), alpha0=0.85)
    assert cheap.pays_to_read(100, 150)



def copier(cfg: DecodeConfig | None = None, slope: float = 0.02) -> Controller:
    """A copier as the session makes one: drafts that cost nothing; verify rows past the
    first at `slope` steps each (0.02: nearly flat, as on a GPU)."""
    costs = Costs(100, 0.0, slope, {1: 1.0 + slope, 4: 1.0 + 4 * slope})
    return Controller(cfg or DecodeConfig(), costs, runs=True)


def copy_round(ctl: Controller, k: int, accepted: int) -> None:
    """A copy round whose verify pass took what the controller's costs say it takes."""
    ctl.observe_round(k, accepted, 0.0, 100 * ctl.costs.verify_ratio(k))


def test_a_copy_taken_whole_is_continued_at_twice_its_length_up_to_max_k() -> None:
    ctl = copier()
    _, k = ctl.next()
    assert ctl.run_k(k) == k  # nothing running yet: the planned K
    ks = [k]
    for _ in range(6):
        copy_round(ctl, ks[-1], ks[-1])
        ks.append(ctl.run_k(ctl.next()[1]))
    assert ks[1] == 2 * k and ks[2] == min(MAX_K, 4 * k)  # doubling where rows cost little...
    assert ks[-1] == MAX_K  # ...then held at MAX_K


def test_a_run_stops_growing_where_a_longer_pass_costs_more_than_it_brings() -> None:
    # An AVX2 CPU's verify costs (Zen 4 on the AVX2 code, docs/performance.md step 40): a
    # pass over 17 rows, taken whole, yields 2.9 tokens a step, no more than one over 9.
    ctl = copier()
    ctl.costs.verify_at = {1: 1.15, 4: 1.98, 8: 3.1, 16: 5.9, 31: 10.34}
    k = ctl.run_k(ctl.next()[1])
    for _ in range(6):
        copy_round(ctl, k, k)
        k = ctl.run_k(ctl.next()[1])
    assert k == 8
    v = ctl.costs.verify_ratio
    assert (2 * k + 1) / v(2 * k) < Controller.RUN_GAIN * (k + 1) / v(k)


def test_a_run_ends_at_a_refusal_a_plain_step_or_another_round() -> None:
    planned = copier().next()[1]
    for end in ("refused", "plain", "break"):
        ctl = copier()
        copy_round(ctl, planned, planned)
        assert ctl.run_k(ctl.next()[1]) == 2 * planned
        if end == "refused":
            copy_round(ctl, 2 * planned, 2 * planned - 1)
        elif end == "plain":
            ctl.observe_plain(100)
        else:
            ctl.break_run()
        _, k = ctl.next()
        assert ctl.run_k(k) == k <= DecodeConfig().k_max, end


def test_runs_are_a_copiers_and_a_fixed_k_stays_fixed() -> None:
    model = Controller(DecodeConfig(), Costs(100, 30.0, 0.02, {1: 1.02, 4: 1.08}))
    fixed = copier(DecodeConfig(k=3))
    for ctl in (model, fixed):
        _, k = ctl.next()
        ctl.observe_round(k, k, 30.0 * k, 100 * ctl.costs.verify_ratio(k))
        _, k = ctl.next()
        assert ctl.run_k(k) == k
    assert fixed.run_k(fixed.next()[1]) == 3
