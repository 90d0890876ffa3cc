"""Rolling statistics of a decoding session, fed with engine events.

Pure Python and headless: the chat's side panels and `specchat bench` read
the same numbers from the same class.

    metrics = DecodeMetrics()
    for event in session.stream(prompt, config):
        metrics.observe(event)
    metrics.acceptance_rate, metrics.p50_ms, metrics.expected_speedup()

Definitions (speculative decoding as in Leviathan et al. 2023, Chen et al. 2023):

- acceptance rate alpha = accepted draft tokens / drafted tokens, over the
  speculative rounds (k > 0);
- mean accepted length = tokens emitted per speculative round (the accepted
  drafts plus the target's corrected or bonus token), as in `TurnStats`;
- acceptance at draft position i = P(draft i accepted | drafts 1..i-1 accepted)
  = rounds with accepted >= i / rounds with accepted >= i-1 and k >= i;
- per-token latency: the wall-clock gap between a round's emission and the
  previous round's, divided by the tokens the round emitted (the first round
  of a reply counts its draft + verify time; prefill is time to first token);
- target step: one plain target step as the engine's controller measures it
  (`RoundEvent.target_step_ms`), the unit of the two costs below;
- cost ratio c = draft time per drafted token / target step;
- verify cost v = target verify time per speculative round / target step
  (about 1 on a GPU; on a CPU a pass over K+1 tokens costs more than one step);
- expected speedup at alpha, K, c and v: E(K) / (K c + v), with
  E(K) = (1 - alpha^(K+1)) / (1 - alpha) tokens per round.
  Without a target step (events from an engine that does not send it) the
  verify pass stands in for it: v = 1 and c is taken against the verify time.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import Mode
from .events import (
    Cancelled,
    Failed,
    Provenance,
    RoundEvent,
    ServerStats,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def expected_tokens(alpha: float, k: int) -> float:
    """E(K): tokens a round of k drafts emits on average at per-token acceptance `alpha`."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_tree(alpha: float, k: int, beta: float, siblings: int) -> float:
    """E(K) for a chain of k with the draft's second guess beside depths 1..siblings
    (engine/decode/tree.py): where the chain is refused at depth i <= siblings (reached
    with probability alpha^(i-1), refused 1 - alpha), the guess is taken with
    probability `beta` and adds one token, itself, before the round's last."""
    reach = sum(alpha ** (i - 1) for i in range(1, min(siblings, k) + 1))
    return expected_tokens(alpha, k) + beta * (1.0 - alpha) * reach


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected walltime improvement of speculative decoding over plain decoding.

    Leviathan et al. 2023, Theorem 3.8, with the verify pass priced: with
    acceptance rate `alpha`, `k` drafted tokens per round, cost ratio `c` (one
    draft step over one target step) and `v` the cost of verifying k+1 tokens
    in one pass (in target steps), the speedup is E(k) / (k c + v). At v = 1
    this is the paper's (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); at
    alpha = 1, (k + 1) / (k c + v).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    if v <= 0:
        raise ValueError(f"v must be > 0, got {v}")
    return expected_tokens(alpha, k) / (k * c + v)


def count_round(reached: Counter[int], passed: Counter[int], k: int, accepted: int) -> None:
    """Add one speculative round of k drafts, `accepted` of them accepted, to the
    per-position tallies: position i is reached when drafts 1..i-1 were accepted."""
    for i in range(1, min(k, accepted + 1) + 1):
        reached[i] += 1
        if accepted >= i:
            passed[i] += 1


def by_position(reached: Counter[int], passed: Counter[int]) -> list[float | None]:
    """Index i: acceptance at draft position i + 1, given the earlier drafts were accepted."""
    if not reached:
        return []
    return [passed[i] / reached[i] if reached[i] else None for i in range(1, max(reached) + 1)]


# Draft positions the panels show one by one; past them, positions are pooled in bands that
# double (9-16, 17-32): a copier's runs draft up to MAX_K tokens (decode/controller.py).
SINGLE_POSITIONS = 8


def _bands(top: int, single: int) -> list[tuple[int, int]]:
    """(first, last) of each band covering 1..top: one position each up to `single`."""
    out, lo = [], 1
    while lo <= top:
        hi = lo if lo <= single else min(top, 2 * (lo - 1))
        out.append((lo, hi))
        lo = hi + 1
    return out


def _band_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def position_bands(
    reached: Counter[int], passed: Counter[int], single: int = SINGLE_POSITIONS
) -> list[tuple[str, float | None]]:
    """(label, acceptance) for each draft position up to `single`, pooled over each band past
    it (the drafts accepted there over the drafts that reached it)."""
    if not reached:
        return []
    out: list[tuple[str, float | None]] = []
    for lo, hi in _bands(max(reached), single):
        r = sum(reached[i] for i in range(lo, hi + 1))
        p = sum(passed[i] for i in range(lo, hi + 1))
        out.append((_band_label(lo, hi), p / r if r else None))
    return out


def length_bands(hist: list[int], single: int = SINGLE_POSITIONS) -> list[tuple[str, int]]:
    """(label, rounds) for each accepted length 0..`single`, summed over each band past it."""
    if not hist:
        return []
    return [("0", hist[0])] + [
        (_band_label(lo, hi), sum(hist[lo : hi + 1])) for lo, hi in _bands(len(hist) - 1, single)
    ]


def acceptance_by_position(rounds: Iterable[tuple[int, int]]) -> list[float | None]:
    """`by_position` over (k, accepted) rounds."""
    reached: Counter[int] = Counter()
    passed: Counter[int] = Counter()
    for k, accepted in rounds:
        count_round(reached, passed, k, accepted)
    return by_position(reached, passed)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token id; the shorter length if one reply is a
    prefix of the other and the lengths differ; None if identical."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


@dataclass(frozen=True, slots=True)
class RoundTiming:
    """What the metrics keep of one round."""

    round: int
    mode: Mode
    k: int
    accepted: int
    tokens: int
    draft_ms: float
    verify_ms: float
    catch_up_ms: float = 0.0


class DecodeMetrics:
    """Statistics over the events of a session (or of a benchmark run).

    Counters (acceptance, histograms, early exits) run since the last
    `reset()`; latencies and round timings keep the last `window` values.
    Feed every event to `observe`; events it does not use are ignored.
    """

    def __init__(self, *, window: int = 512) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.reset()

    # -- feeding ---------------------------------------------------------

    def reset(self) -> None:
        """Forget everything (a new conversation)."""
        self.turns = 0
        self.tokens = 0
        self.rounds = 0
        self.provenance: Counter[Provenance] = Counter()
        # speculative rounds
        self.spec_rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.spec_tokens = 0
        self._reached: Counter[int] = (
            Counter()
        )  # position i (1-based) -> rounds with k >= i and accepted >= i-1
        self._passed: Counter[int] = Counter()  # position i -> rounds with accepted >= i
        self._accepted_lengths: Counter[int] = Counter()
        # draft trees: rounds that verified guesses beside the chain, tokens those gave
        self.tree_rounds = 0
        self.second_guesses = 0
        # controller
        self.last_round: RoundEvent | None = None
        self.target_step_ms: float | None = None  # the controller's, from RoundEvent
        self.fallbacks: list[tuple[int, str]] = []
        # latency
        self.token_latencies_ms: deque[float] = deque(maxlen=self.window)
        self.round_timings: deque[RoundTiming] = deque(maxlen=self.window)
        self.ttft_s: float | None = None
        self.tokens_per_s: float | None = None
        self._turn_start: float | None = None
        self._turn_tokens = 0
        self._first_token_t: float | None = None
        self._last_emit_t: float | None = None
        self._turn_finished = False
        # early exit
        self.exit_tokens = 0
        self.exit_mode_tokens = 0
        self.exit_layers: Counter[int] = Counter()
        self._exit_confidence_sum = 0.0
        self._exit_confidence_n = 0
        self._exit_layer_sum = 0
        # tokens of the round in progress
        self._pending: list[TokenEvent] = []
        # a served engine's figures: the reply's latest, and the session's finished replies
        self.server: ServerStats | None = None
        self.server_drafted = 0
        self.server_accepted = 0

    def observe(self, event: object, *, now: float | None = None) -> None:
        """Take one engine event into account.

        `now` is the `time.perf_counter()` value to use for events without a
        timestamp of their own (TurnStarted: when the prompt was submitted);
        it defaults to the current time.
        """
        if isinstance(event, TokenEvent):
            self._on_token(event)
        elif isinstance(event, RoundEvent):
            self._on_round(event)
        elif isinstance(event, ServerStats):
            self.server = event
            if event.final and event.draft_tokens is not None and event.accepted is not None:
                self.server_drafted += event.draft_tokens
                self.server_accepted += event.accepted
        elif isinstance(event, TurnStarted):
            self.start_turn(time.perf_counter() if now is None else now)
        elif isinstance(event, TurnFinished):
            self._on_finished(event)
        elif isinstance(event, Cancelled | Failed):
            self._pending.clear()
            self._turn_finished = True

    def observe_all(self, events: Iterable[object]) -> None:
        for event in events:
            self.observe(event)

    def start_turn(self, t: float) -> None:
        """A reply begins; `t` is when the prompt was submitted (perf_counter)."""
        self.turns += 1
        self._turn_start = t
        self._turn_tokens = 0
        self._first_token_t = None
        self._last_emit_t = None
        self._turn_finished = False
        self.ttft_s = None
        self.tokens_per_s = None
        self._pending.clear()

    def _on_token(self, ev: TokenEvent) -> None:
        self.tokens += 1
        self._turn_tokens += 1
        self.provenance[ev.provenance] += 1
        if ev.draft_rank is not None and ev.draft_rank > 1:
            self.second_guesses += 1
        self._pending.append(ev)
        if ev.t and self._first_token_t is None:
            self._first_token_t = ev.t
            if self._turn_start is not None:
                self.ttft_s = max(0.0, ev.t - self._turn_start)
        if ev.t and self._turn_start is not None:
            elapsed = ev.t - self._turn_start
            if elapsed > 0:
                self.tokens_per_s = self._turn_tokens / elapsed
        if ev.provenance is Provenance.EARLY_EXIT:
            self.exit_tokens += 1
            if ev.exit_layer is not None:
                self.exit_layers[ev.exit_layer] += 1
                self._exit_layer_sum += ev.exit_layer
            if ev.confidence is not None:
                self._exit_confidence_sum += ev.confidence
                self._exit_confidence_n += 1

    def _on_round(self, ev: RoundEvent) -> None:
        tokens = self._pending
        self._pending = []
        n = len(tokens)
        self.rounds += 1
        self.last_round = ev
        if ev.target_step_ms:
            self.target_step_ms = ev.target_step_ms
        if ev.fallback_reason:
            self.fallbacks.append((ev.round, ev.fallback_reason))
        if ev.k > 0:
            self.spec_rounds += 1
            self.drafted += ev.k
            accepted = min(ev.accepted, ev.k)
            self.accepted += accepted
            self.spec_tokens += n if n else accepted + 1
            self._accepted_lengths[accepted] += 1
            count_round(self._reached, self._passed, ev.k, accepted)
            self.tree_rounds += ev.siblings > 0
        if ev.mode is Mode.EARLY_EXIT:
            self.exit_mode_tokens += n
        self.round_timings.append(
            RoundTiming(
                ev.round, ev.mode, ev.k, ev.accepted, n, ev.draft_ms, ev.verify_ms, ev.catch_up_ms
            )
        )
        # per-token latency
        if n:
            emit_t = max(t.t for t in tokens)
            if self._last_emit_t is not None and emit_t > 0:
                gap_ms = (emit_t - self._last_emit_t) * 1000.0
            else:
                gap_ms = ev.draft_ms + ev.verify_ms
            per_token = max(0.0, gap_ms) / n
            self.token_latencies_ms.extend([per_token] * n)
            if emit_t > 0:
                self._last_emit_t = emit_t

    def stream_bursts(self, gap_ms: float = 3.0) -> tuple[int, int] | None:
        """(bursts, tokens) over the kept rounds of a served engine's stream (Mode.REMOTE).

        A server that verifies drafts sends the tokens of one verify step back to back;
        a chunk arriving more than `gap_ms` after the one before starts a new burst, so
        tokens per burst is the accepted length as the client sees it. None without
        remote rounds."""
        remote = [r for r in self.round_timings if r.mode is Mode.REMOTE and r.tokens]
        if not remote:
            return None
        bursts = sum(1 for i, r in enumerate(remote) if i == 0 or r.verify_ms > gap_ms)
        return bursts, sum(r.tokens for r in remote)

    def _on_finished(self, ev: TurnFinished) -> None:
        stats = ev.stats
        self._pending.clear()
        self._turn_finished = True
        # The engine's own accounting is authoritative once the reply is over.
        self.ttft_s = stats.ttft_s
        self.tokens_per_s = stats.tokens_per_s

    # -- acceptance ------------------------------------------------------

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.spec_tokens / self.spec_rounds if self.spec_rounds else None

    def acceptance_by_position(self) -> list[float | None]:
        """Index i: acceptance at draft position i + 1, given the earlier drafts were accepted."""
        return by_position(self._reached, self._passed)

    def acceptance_by_band(self) -> list[tuple[str, float | None]]:
        """`position_bands`: positions one by one, pooled past SINGLE_POSITIONS."""
        return position_bands(self._reached, self._passed)

    def accepted_length_histogram(self) -> list[int]:
        """Index n: speculative rounds in which exactly n drafts were accepted."""
        if not self._accepted_lengths:
            return []
        top = max(self._accepted_lengths)
        return [self._accepted_lengths[n] for n in range(top + 1)]

    # -- controller ------------------------------------------------------

    @property
    def current_mode(self) -> Mode | None:
        r = self.last_round
        if r is None:
            return None
        return r.next_mode or r.mode

    @property
    def current_k(self) -> int | None:
        r = self.last_round
        if r is None:
            return None
        return r.next_k if r.next_k is not None else r.k

    @property
    def last_fallback(self) -> tuple[int, str] | None:
        return self.fallbacks[-1] if self.fallbacks else None

    # -- latency ---------------------------------------------------------

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.token_latencies_ms, 50)

    @property
    def p95_ms(self) -> float | None:
        return percentile(self.token_latencies_ms, 95)

    def _spec_timings(self) -> list[RoundTiming]:
        return [r for r in self.round_timings if r.k > 0]

    @property
    def mean_draft_ms(self) -> float | None:
        spec = self._spec_timings()
        return sum(r.draft_ms for r in spec) / len(spec) if spec else None

    @property
    def mean_verify_ms(self) -> float | None:
        rounds = self.round_timings
        return sum(r.verify_ms for r in rounds) / len(rounds) if rounds else None

    @property
    def draft_share(self) -> float | None:
        """Fraction of decoding time spent in the draft (recent rounds)."""
        draft = sum(r.draft_ms for r in self.round_timings)
        total = draft + sum(r.verify_ms for r in self.round_timings)
        return draft / total if total > 0 else None

    def _spec_means(self) -> tuple[float, float] | None:
        """(draft ms per drafted token, verify ms per round) over the recent speculative rounds."""
        spec = self._spec_timings()
        drafted = sum(r.k for r in spec)
        verify = sum(r.verify_ms for r in spec)
        if not spec or drafted == 0 or verify <= 0:
            return None
        return sum(r.draft_ms for r in spec) / drafted, verify / len(spec)

    @property
    def cost_ratio(self) -> float | None:
        """c: draft time per drafted token over one target step, else over a verify pass."""
        means = self._spec_means()
        if means is None:
            return None
        draft, verify = means
        return draft / (self.target_step_ms or verify)

    def verify_ratio_at(self, k: int | None) -> float | None:
        """v at K=k: target ms per verify pass over one target step, from the recent rounds
        that drafted k (all speculative rounds when none did); None without a step.

        A pass over K+1 tokens costs more the larger K on a CPU, so one mean over
        rounds at several K would misprice each of them.
        """
        spec = self._spec_timings()
        if not spec or not self.target_step_ms:
            return None
        passes = [r.verify_ms for r in spec if r.k == k] or [r.verify_ms for r in spec]
        return sum(passes) / len(passes) / self.target_step_ms

    @property
    def verify_ratio(self) -> float | None:
        """v at the current K (`verify_ratio_at`)."""
        return self.verify_ratio_at(self.current_k)

    def expected_speedup(self, k: int | None = None) -> float | None:
        """Speedup predicted at the measured alpha, c and v, for `k` (default: the current K)."""
        alpha = self.acceptance_rate
        c = self.cost_ratio
        k = self.current_k if k is None else k
        if alpha is None or c is None or not k:
            return None
        return expected_speedup(alpha, k, c, self.verify_ratio_at(k) or 1.0)

    # -- early exit ------------------------------------------------------

    @property
    def exit_rate(self) -> float | None:
        """Early-exit tokens over the tokens decoded in early-exit mode."""
        total = max(self.exit_mode_tokens, self.exit_tokens)
        return self.exit_tokens / total if total else None

    def exit_layer_histogram(self) -> dict[int, int]:
        return dict(sorted(self.exit_layers.items()))

    def mean_layers(self, total_layers: int) -> float | None:
        """Average target layers run per token in early-exit mode (exits count their exit layer)."""
        total = max(self.exit_mode_tokens, self.exit_tokens)
        if not total:
            return None
        full = total - self.exit_tokens
        exited_layers = self._exit_layer_sum + total_layers * (
            self.exit_tokens - sum(self.exit_layers.values())
        )
        return (exited_layers + full * total_layers) / total

    @property
    def mean_exit_confidence(self) -> float | None:
        n = self._exit_confidence_n
        return self._exit_confidence_sum / n if n else None

    # -- export ----------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The numbers as a JSON-ready dict (for `specchat bench`)."""
        return {
            "turns": self.turns,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "provenance": {p.value: n for p, n in self.provenance.items()},
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position(),
            "accepted_length_histogram": self.accepted_length_histogram(),
            "p50_ms": self.p50_ms,
            "p95_ms": self.p95_ms,
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            "mean_draft_ms": self.mean_draft_ms,
            "mean_verify_ms": self.mean_verify_ms,
            "draft_share": self.draft_share,
            "cost_ratio": self.cost_ratio,
            "verify_ratio": self.verify_ratio,
            "expected_speedup": self.expected_speedup(),
            "exit_rate": self.exit_rate,
            "exit_layer_histogram": self.exit_layer_histogram(),
            "fallbacks": [list(f) for f in self.fallbacks],
        }
