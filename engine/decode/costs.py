"""What a round costs, in the unit the user reasons in: one plain target step.

`Costs` holds the measured target step, draft step and verify passes (the
controller keeps learning into it); `measure_costs` times them once at load,
on scratch tokens, so the first round's K comes from this machine's figures.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..metrics import expected_speedup
from ..model import native
from ..model.eagle import EagleHead, HeadCache
from ..model.runner import ModelRunner
from .ahead import predict_ahead_ms
from .sampling import argmax
from .speculative import ModelDrafter, on_logits


@dataclass(slots=True)
class Costs:
    """Measured step costs in milliseconds (exponential moving averages)."""

    target_step_ms: float | None = None  # one plain target step
    draft_step_ms: float | None = None  # one draft step
    verify_slope: float = 0.05  # v(K) = 1 + slope·K, fitted from verify passes
    # v(K) measured at these K. On a CPU v is not linear in K (a 2-token pass can
    # cost 1.1 steps and a 5-token one 2), so measured points beat the slope.
    verify_at: dict[int, float] = field(default_factory=dict)
    # The draft's one-token steps on one thread, where measured faster than on all (with
    # both timings, ms), else None: see ModelRunner.steps_on_one_thread.
    draft_one_thread: tuple[float, float] | None = None
    # A catch-up pass of the draft over n tokens it missed (a prompt, a copy, a plain
    # stretch) costs catch_up_pass_ms + n·catch_up_row_ms: the pass reads the weights
    # once, each row adds its arithmetic (a Zen 3: 17 + 3.5 ms a row for the 0.5B).
    catch_up_row_ms: float | None = None
    catch_up_pass_ms: float = 0.0

    def ratio(self) -> float | None:
        if self.target_step_ms and self.draft_step_ms is not None:
            return self.draft_step_ms / self.target_step_ms
        return None

    def catch_up_ratio(self, rows: int) -> float:
        """A catch-up pass over `rows` tokens in target steps (0 for none, or until measured)."""
        if rows <= 0 or not self.target_step_ms or self.catch_up_row_ms is None:
            return 0.0
        return (self.catch_up_pass_ms + rows * self.catch_up_row_ms) / self.target_step_ms

    def read_ratio(self, rows: int) -> float:
        """The draft reading `rows` tokens it missed, in target steps: their rows alone where
        they ride in its first draft pass (up to ModelDrafter.FOLDED_ROWS), else a catch-up
        pass."""
        if rows > ModelDrafter.FOLDED_ROWS:
            return self.catch_up_ratio(rows)
        return self.folded_ms(rows) / self.target_step_ms if self.target_step_ms else 0.0

    def folded_ms(self, rows: int) -> float:
        """What `rows` tokens read in the first draft pass add to it (0 until measured)."""
        return max(rows, 0) * (self.catch_up_row_ms or 0.0)

    def verify_ratio(self, k: int) -> float:
        """v(K): measured, else interpolated between measured K (v(0) = 1), else the slope."""
        if k in self.verify_at:
            return self.verify_at[k]
        below = max((j for j in self.verify_at if j < k), default=0)
        above = min((j for j in self.verify_at if j > k), default=None)
        v_below = self.verify_at.get(below, 1.0)
        if above is None:
            return v_below + self.verify_slope * (k - below)
        return v_below + (self.verify_at[above] - v_below) * (k - below) / (above - below)


SCRATCH = [int(i) % 64 + 3 for i in range(24)]  # the tokens costs are timed after


def pass_timer(runner: ModelRunner, repeats: int) -> Callable[[int], float]:
    """Median ms (after a warm-up) of `repeats` passes over n new tokens after SCRATCH[:-1],
    which the runner prefills once here."""
    runner.reset()
    runner.prefill(SCRATCH)  # caches SCRATCH[:-1]
    base = runner.cached

    def timed(n_new: int) -> float:
        runner.crop_to(base)
        start = time.perf_counter()
        runner.feed(SCRATCH[-1:] * n_new, keep=n_new)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return (time.perf_counter() - start) * 1e3

    def median(n_new: int) -> float:
        timed(n_new)  # warm-up
        values = sorted(timed(n_new) for _ in range(repeats))
        return values[len(values) // 2]

    return median


# The target's step, its 2-row and k+1-row verify passes and the draft's step are timed in
# this many turns.
COST_TURNS = 3

# A catch-up pass is timed at load over this many rows and over one: the two points of
# its cost line (a pass over 8 and 48 rows of the 0.5B on a Zen 3 lie within 10% of it).
CATCH_UP_ROWS = 24


def measure_costs(target: ModelRunner, draft: ModelRunner, k: int = 4, repeats: int = 3) -> Costs:
    """Time one target step, verify passes of 2 and k+1 tokens, one draft step and a draft
    pass over CATCH_UP_ROWS rows (medians of `repeats` after a warm-up, each model
    prefilled once). Leaves both caches empty.

    On a CPU with several threads the draft's step is timed on one thread too, in turns
    with all of them; `draft_one_thread` says when one thread was clearly faster (the
    caller then sets the draft runner's `steps_on_one_thread`)."""
    def timer(runner: ModelRunner) -> Callable[[int], float]:
        return pass_timer(runner, repeats)

    on_target = timer(target)
    on_draft = timer(draft)
    # The steps and both verify passes in turns, so drift in the machine's speed hits them
    # alike: c and v decide whether the draft runs at all and how long a pass is worth. One
    # after the other on a shared 2-core VM, c came out 0.31 at one load and 0.38 at the next
    # (docs/performance.md, step 39), and the k+1-row verify, whose slope prices every longer
    # pass, 2.38 steps where the passes cost 1.6 (step 40).
    steps, twos, blocks, drafts = [], [], [], []
    for _ in range(COST_TURNS):
        steps.append(on_target(1))
        twos.append(on_target(2))  # K=1: on a CPU often the best K
        blocks.append(on_target(k + 1))
        drafts.append(on_draft(1))
    step = statistics.median(steps)
    # A pass over more rows does a step's work and more: a ratio under the one before it is
    # the machine's drift between the timings (one load: verify K=1 at 0.91 steps).
    verify_one = max(statistics.median(twos), step)
    verify = max(statistics.median(blocks), verify_one)
    draft_step = statistics.median(drafts)
    catch_up_row = max(0.0, (on_draft(CATCH_UP_ROWS) - draft_step) / (CATCH_UP_ROWS - 1))
    catch_up_pass = max(0.0, draft_step - catch_up_row)
    one_thread = None
    if torch.get_num_threads() > 1 and draft.device.type == "cpu":
        every, alone = list(drafts), []
        for _ in range(2):  # in turns, so drift in the machine's speed hits both alike
            draft.steps_on_one_thread = True
            alone.append(on_draft(1))
            draft.steps_on_one_thread = False
            every.append(on_draft(1))
        draft_step, one = statistics.median(every), statistics.median(alone)
        if one < draft_step * ONE_THREAD_GAIN:
            one_thread, draft_step = (one, draft_step), one
    target.reset()
    draft.reset()
    return Costs(
        target_step_ms=step,
        draft_step_ms=draft_step,
        verify_slope=max(0.0, (verify / step - 1.0) / k),
        verify_at={1: verify_one / step, k: verify / step},
        draft_one_thread=one_thread,
        catch_up_row_ms=catch_up_row,
        catch_up_pass_ms=catch_up_pass,
    )


# A 2-row block leaves the VNNI code for the AVX2 code only where that is faster than this
# share of the VNNI code's time at load. The bits are the same either way, and a wrong pick
# costs a few percent of a 2-row pass, so the bar is low: the medians of 6 turns (~1.5 s of
# the default pair's load) tell Zen 4's 6% apart, one pass at a time does not.
TWO_ROWS_GAIN = 0.99
# One-row calls (every plain step and every draft step) leave the AVX2 code for the VNNI
# code only where that makes the target's step and the draft's together faster than this
# share of their time on the AVX2 code. At one row the VNNI code is 8% slower for the 0.5B
# on Zen 5 (docs/performance.md, step 23) and within 2% on Zen 4 (step 22), but faster on
# an AMX Xeon: the 0.5B draft's step 18.3 -> 16.8 ms, the 1.5B's 55.4 -> 53.5 (step 42).
ONE_ROW_GAIN = 0.98


def choose_vnni_rows(
    target: ModelRunner, draft: ModelRunner | None = None, repeats: int = 1, turns: int = 6
) -> str | None:
    """On the w4a8 kernel's VNNI or AMX path, choose the fewest rows a call on several
    threads takes the VNNI code from, by timing both codes in turns (so drift in the
    machine's speed hits both alike): one-row steps of the target and the draft (where
    there is one) move to the VNNI code where it is clearly faster (an AMX Xeon); else
    2-row passes (a K=1 verify; the draft's first pass after a round it drafted whole)
    keep the AVX2 code where that is clearly faster (Zen 4's target: 1.10 against 1.16
    steps). From then on `native.w4a8_set_vnni_min_rows` says it.
    Returns what was chosen, for Ready, or None where nothing was measured (another path)."""
    if native.w4a8_path() not in ("avx512vnni", "amx"):
        return None
    least = native.W4A8_VNNI_MIN_ROWS
    runners = [target] if draft is None else [target, draft]
    timers = [pass_timer(runner, repeats) for runner in runners]

    def in_turns(rows: int, vnni_from: int, avx2_from: int) -> tuple[float, float]:
        """Median ms of every runner's pass over `rows` rows together, on each code."""
        vnni: list[float] = []
        avx2: list[float] = []
        for _ in range(turns):
            native.w4a8_set_vnni_min_rows(vnni_from)
            vnni.append(sum(timed(rows) for timed in timers))
            native.w4a8_set_vnni_min_rows(avx2_from)
            avx2.append(sum(timed(rows) for timed in timers))
        return statistics.median(vnni), statistics.median(avx2)

    try:
        on_vnni, on_avx2 = in_turns(1, 1, least)
        steps = "the target's and the draft's one-row steps" if draft else "one-row steps"
        if on_vnni < on_avx2 * ONE_ROW_GAIN:
            why = f"from one row, measured faster: {steps} {on_vnni:.1f} against {on_avx2:.1f} ms"
            native.w4a8_set_vnni_min_rows(1, why)
            return why
        ones = f"{steps} {on_avx2:.1f} ms on the AVX2 code, {on_vnni:.1f} on it"
        # a K=1 verify, and the draft's first pass after a round it drafted whole
        on_vnni, on_avx2 = in_turns(2, least, max(least, 3))
    finally:
        for runner in runners:
            runner.reset()
    if on_avx2 < on_vnni * TWO_ROWS_GAIN:
        why = f"2-row passes on the AVX2 code, measured faster: {on_avx2:.1f} against {on_vnni:.1f} ms"
        native.w4a8_set_vnni_min_rows(max(least, 3), f"{ones}; {why}")
    else:
        why = f"2-row passes {on_vnni:.1f} ms on it, {on_avx2:.1f} on the AVX2 code"
        native.w4a8_set_vnni_min_rows(least, f"{ones}; {why}")
    return f"{ones}; {why}"


# Whether the draft runs ahead on a core of its own (decode/ahead.py) is decided round by round
# from what both ways are predicted to cost a token at the acceptance the turn measures, and
# only for a clear gain (either way: hysteresis). Ready states it at this acceptance (the
# default pair's on chat and code prompts: 0.8-0.86).
AHEAD_ALPHA = 0.8
AHEAD_GAIN = 0.95
AHEAD_GRID = tuple(round(0.3 + 0.02 * i, 2) for i in range(35))  # α = 0.30 .. 0.98


@dataclass(slots=True)
class AheadCosts:
    """The target's passes on all threads but one while the draft steps on that one
    (decode/ahead.py), and what a token is predicted to cost that way and the serial way
    at each acceptance of AHEAD_GRID: (α, serial ms, ahead ms)."""

    costs: Costs  # what the controller of rounds drafted ahead starts from
    alone_ms: float  # the target's step alone, on every thread
    draft_ms: float  # the draft's step on its own thread, beside the target's passes
    grid: tuple[tuple[float, float, float], ...]

    def at(self, alpha: float) -> tuple[float, float]:
        """(serial, ahead) ms a token predicted at the grid's acceptance nearest alpha."""
        _, serial, ahead = min(self.grid, key=lambda row: abs(row[0] - alpha))
        return serial, ahead

    def prefers(self, alpha: float, now: bool) -> bool:
        """Whether rounds at acceptance alpha should draft ahead, `now` being the current way:
        a change needs a gain of 1 - AHEAD_GAIN, so noise in alpha does not flip it."""
        serial, ahead = self.at(alpha)
        return ahead < serial / AHEAD_GAIN if now else ahead < serial * AHEAD_GAIN

    @property
    def from_alpha(self) -> float | None:
        """The least acceptance at which running ahead pays, None if none does."""
        return next((a for a, serial, ahead in self.grid if ahead < serial * AHEAD_GAIN), None)

    def describe(self, way: str) -> str:
        """What greedy spec turns do (`way`: auto, on or off) and the figures it chose by."""
        beside = self.costs.target_step_ms or 0.0
        serial, ahead = self.at(AHEAD_ALPHA)
        start = self.from_alpha
        if way == "on":
            verdict = "the draft runs ahead on a core of its own (SPECCHAT_AHEAD=on)"
        elif way == "off" or start is None:
            verdict = "the draft drafts, then the target verifies" + (
                " (SPECCHAT_AHEAD=off)" if way == "off" else ""
            )
        else:
            verdict = f"the draft runs ahead on a core of its own where acceptance is {start:.2f}+"
        return (
            f"{verdict}: a token predicted at α={AHEAD_ALPHA} to take {serial:.1f} ms serially, "
            f"{ahead:.1f} ms with the draft ahead; beside the draft the target's step takes {beside:.1f} ms "
            f"({self.alone_ms:.1f} alone), verify K=1: {self.costs.verify_ratio(1):.2f}, "
            f"K=4: {self.costs.verify_ratio(4):.2f} steps; the draft's step {self.draft_ms:.1f} ms"
        )


def measure_ahead(
    target: ModelRunner, draft: ModelRunner, serial: Costs, k: int = 4, repeats: int = 3
) -> AheadCosts:
    """Time the target's passes of 1, 2 and k+1 tokens on all threads but one while another
    thread runs draft steps without pause, as a turn drafted ahead runs them, and predict
    both ways' cost a token from these and the `serial` costs. Leaves both caches empty and
    this thread's torch threads as they were."""
    stop = threading.Event()
    draft_times: list[float] = []

    def draft_steps() -> None:
        torch.set_num_threads(1)
        draft.reset()
        draft.prefill(SCRATCH)
        start = draft.cached
        while not stop.is_set():
            draft.crop_to(start)
            t0 = time.perf_counter()
            draft.feed(SCRATCH[-1:], keep=1)
            draft_times.append((time.perf_counter() - t0) * 1e3)

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before - 1))
    helper = threading.Thread(target=draft_steps, name="specchat-measure-draft", daemon=True)
    helper.start()
    try:
        # Two streams on one memory bus time less steadily than one: at least five of each.
        median = pass_timer(target, max(repeats, 5))
        step = median(1)
        verify = {j: median(j + 1) / step for j in (1, k)}
    finally:
        stop.set()
        helper.join()
        torch.set_num_threads(before)
        target.reset()
        draft.reset()
    beside = Costs(
        target_step_ms=step,
        draft_step_ms=0.0,  # off the round: the draft ran meanwhile
        verify_slope=max(0.0, (verify[k] - 1.0) / k),
        verify_at=verify,
    )
    settled = draft_times[len(draft_times) // 4 :] or draft_times or [float("inf")]
    draft_ms = statistics.median(settled)
    assert serial.target_step_ms is not None and serial.draft_step_ms is not None
    c = serial.draft_step_ms / serial.target_step_ms
    grid = tuple(
        (
            alpha,
            serial.target_step_ms
            / max(expected_speedup(alpha, j, c, serial.verify_ratio(j)) for j in range(1, 9)),
            predict_ahead_ms(alpha, step, beside.verify_ratio, draft_ms, k, tokens=1500),
        )
        for alpha in AHEAD_GRID
    )
    return AheadCosts(beside, serial.target_step_ms, draft_ms, grid)


# The draft's steps move to one thread only for a clear gain: a wrong choice from a noisy
# measurement costs the whole session, a missed 3% costs little.
ONE_THREAD_GAIN = 0.97


MAX_K_HEAD = 6  # verify costs measured for the head: K = 1..6


def measure_head_cost(
    head: EagleHead, runner: ModelRunner, embed: torch.nn.Module, repeats: int = 5
) -> tuple[float, float, dict[int, float]]:
    """(one head draft step ms, one target decode step ms, verify of K drafts in target
    steps for K = 1..MAX_K_HEAD), medians of `repeats`, on a 64-token context."""
    dev = head.norm.weight.device
    ids = list(range(1, 65))
    runner.reset()
    runner.feed(ids, keep=1)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def target_pass(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        runner.feed(list(range(3, 3 + n)), keep=n)
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        runner.crop_to(len(ids))
        return ms

    def median(f: Callable[[], float]) -> float:
        return sorted(f() for _ in range(repeats))[repeats // 2]

    cache = HeadCache()
    with torch.inference_mode():
        feats = torch.zeros(63, head.fc.in_features, device=dev)
        head.step(embed(torch.tensor(ids[1:], device=dev)).float(), feats, cache)
        state = torch.zeros(1, head.config.hidden_size, device=dev)
        tok = torch.tensor([7], device=dev)

        def head_step() -> float:
            sync()
            t0 = time.perf_counter()
            _out, logits = head.step(embed(tok).float(), state, cache)
            with on_logits(logits):  # as the head's proposals fill the row (HeadDrafter)
                row = head.to_target_logits(logits)
            argmax(row).item()
            ms = (time.perf_counter() - t0) * 1e3
            cache.crop(63)
            return ms

        target_ms = median(lambda: target_pass(1))
        verify = {}
        for k in range(1, MAX_K_HEAD + 1):
            verify[k] = median(functools.partial(target_pass, k + 1)) / target_ms
        head_ms = median(head_step)
    runner.reset()
    return head_ms, target_ms, verify
