"""Adaptive K and fallback to plain decoding, each change with a stated reason.

With per-token acceptance rate α, a round that drafts K tokens emits on
average E(K) = (1 - α^(K+1)) / (1 - α) tokens (Leviathan et al. 2023, eq. 1).
Its cost, in units of one plain target step, is K·c + v(K), where c is the
draft/target cost ratio of one step and v(K) the cost of verifying K+1
positions in one pass (v ≈ 1 on a GPU; above 1 on a CPU, measured per K). The expected
speedup is S(K) = E(K) / (K·c + v(K)); with v = 1 this is the paper's
(1 - α^(K+1)) / ((1 - α)(K·c + 1)).

The controller picks the K that maximises S within [k_min, k_max], drops to
plain decoding when the best S is clearly below 1, and probes speculation
again after a number of plain tokens, since acceptance changes with the text.

With draft trees allowed (engine/decode/tree.py), the choice is (K, S): the
draft's second guess beside depths 1..S adds the tokens a refused first guess
would have cost, with probability β (measured on the rounds that tried one),
and the verify pass grows to K + S drafts: S = 0 wherever a bigger pass costs
more than the guesses bring, which is everywhere the verify pass grows steeply.

Composed with prompt lookup (compose.py), the draft model must also read what
each copy added before it drafts again: a catch-up pass that a copy-heavy reply
pays between most of the model's rounds. Its price o, the mean cost of the
catch-up the copies left before each round the model could draft (a pass over
n tokens costs a + b·n, both measured), is added to every round's cost:
S(K) = E(K) / (K·c + v(K) + o). The copies are counted at every round the
lookup does not draft, the model's or a plain step, so the estimate follows the
text through a fallback too. And a long read (the prompt, before the model's
first round; a plain stretch, before a probe) is an investment: it is made only
where the gain per token, 1 - 1/S, over the tokens the reply may still take
pays it back (`pays_to_read`); composed spec decodes with copies and plain
steps otherwise.

Copies come in runs: a reply that re-types code or quotes a passage follows its
source for dozens of tokens, then leaves it. A per-token α prices a copy as if
each token were a fresh guess, which keeps K near what a model's draft would
get; so a copier (`runs`) drafts twice the last copy's length after a copy the
target took whole, up to MAX_K, and goes back to the planned K at the first
refusal or break (docs/performance.md, step 40).

Acceptance is estimated per draft token tried, not per round, so the estimate
remembers as much text at K=1 as at K=8; a fallback needs S below 0.95, not 1,
because coming back costs the draft a catch-up pass over the plain stretch;
and a probe that fails doubles the wait for the next one. Tuned on greedy
acceptance traces of the default pair (docs/performance.md, step 15).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import MAX_K, DecodeConfig, Mode
from ..metrics import expected_speedup, expected_tokens_tree
from ..model.attention import MAX_ROWWISE
from .costs import Costs


def _ema(old: float | None, new: float, w: float = 0.3) -> float:
    return new if old is None else (1 - w) * old + w * new


class Controller:
    """Chooses (mode, K) for each round of a speculative reply."""

    PROBE_AFTER = 24  # plain tokens before speculation is tried again...
    PROBE_AFTER_MAX = 96  # ...doubling after each probe that falls back, up to this
    MEMORY = 0.9  # weight of the past per draft token tried: ~the last 10 count
    FALLBACK_BELOW = 0.95  # the expected speedup under which plain decoding takes over
    PROBE_TRIALS = 2.0  # a probe restarts from the prior α worth 2 trials: its rounds decide
    HYSTERESIS = 0.05  # change K only for a 5% better expected speedup
    SIBLINGS_MAX = 4  # depths a tree may hang a second guess beside
    # The prior share of the chain's refusals that the draft's second guess covers: 0.49
    # for the 0.5B draft on the dev prompts (docs/performance.md, step 20); worth 4 trials.
    BETA0 = 0.45
    BETA_TRIALS = 4.0
    # A tree must beat the best chain by 10% to be chosen. The speedup model overrates
    # trees: replayed on 14 recorded replies of the default pair (scripts/accept_trace.py,
    # docs/performance.md step 26), trees chosen at any gain lost 1-5% against chains on
    # this CPU class's costs and on flat (GPU-like) ones; with the margin they are taken
    # only where acceptance is low, where a second guess covers most.
    TREE_MARGIN = 0.10
    # A copier doubles a run's K only where the longer pass, taken whole, yields this many
    # times the tokens a step: replayed on the code-edit prompts' traces (scripts/
    # accept_trace.py), 1.0 lost 2% against no runs at an AVX2 CPU's verify costs and 1.1
    # none, and both gained 5-6% at Zen 4's (docs/performance.md, step 40).
    RUN_GAIN = 1.10

    def __init__(
        self,
        cfg: DecodeConfig,
        costs: Costs | None = None,
        alpha0: float = 0.7,
        tree: bool = False,
        runs: bool = False,
        label: str = "",
    ) -> None:
        """`tree`: the drafter and the target can take a draft tree (then cfg.siblings,
        or the controller's choice where it is None, says how many depths). `runs`: the
        drafts are copies, and a copy taken whole is continued at twice its length
        (`run_k`). `label` heads every reason it gives ("copies": the composed turn's
        second controller, whose c = 0 would read as a free draft model)."""
        self.cfg = cfg
        self.label = label
        self.costs = costs or Costs()
        # Acceptance as decayed counts of accepted drafts and of trials; the prior
        # weighs as much as a full memory of trials.
        self._alpha0 = alpha0
        self._trials = 1.0 / (1.0 - self.MEMORY)
        self._acc = alpha0 * self._trials
        self._beta_trials = self.BETA_TRIALS
        self._beta_hits = self.BETA0 * self.BETA_TRIALS
        # Composed spec: the catch-up (target steps) the copies left before each round the
        # lookup did not draft, as decayed sums like α's; none observed: none priced.
        self._copy_reads = 0.0
        self._copy_gaps = 0.0
        self.tree = tree and cfg.siblings != 0
        self.runs = runs
        self._run = 0  # the K a copy that continues a run takes (0: none running)
        # Depths with a second guess: fixed by cfg.siblings, else chosen with K (best()).
        self.k = cfg.k if cfg.k is not None else min(max(4, cfg.k_min), cfg.k_max)
        self.siblings = self._fixed_siblings(self.k)
        self.mode = Mode.SPEC
        self._plain_since_probe = 0
        self._probe_after = self.PROBE_AFTER
        self._probing = False
        self._pending_reason: str | None = None
        if self.adaptive and self.costs.ratio() is not None:
            # The first round already uses the measured costs (and the prior α):
            # on a CPU where verifying 5 tokens costs 2 steps, K=1 is the best start.
            self.k, self.siblings = self._plan()[:2]

    @property
    def alpha(self) -> float:
        return self._acc / self._trials if self._trials else 0.0

    @property
    def beta(self) -> float:
        """The share of refused first guesses whose depth's second guess the target took."""
        return self._beta_hits / self._beta_trials if self._beta_trials else 0.0

    @property
    def catch_up_steps(self) -> float:
        """o: the draft's expected catch-up over copied tokens before a round, in target
        steps (0 where nothing is copied or a caught-up row's cost is not known yet)."""
        if not self._copy_gaps:
            return 0.0
        return self._copy_reads / self._copy_gaps

    @property
    def probing(self) -> bool:
        """The round now is a probe after a plain stretch (until its observation)."""
        return self._probing

    @property
    def choose_siblings(self) -> bool:
        return self.tree and self.cfg.siblings is None

    @property
    def adaptive(self) -> bool:
        return self.cfg.k is None

    def next(self) -> tuple[Mode, int]:
        """Mode and K for the next round."""
        if not self.adaptive:
            return Mode.SPEC, self.k
        if self.mode is Mode.PLAIN:
            if self._plain_since_probe >= self._probe_after:
                self._pending_reason = (
                    f"probe: speculating again after {self._plain_since_probe} plain tokens "
                    f"to re-measure acceptance (K={self.k})"
                )
                self._plain_since_probe = 0
                self._probing = True
                self._trials = self.PROBE_TRIALS
                self._acc = self._alpha0 * self._trials
                return Mode.SPEC, self.k
            return Mode.PLAIN, 0
        return Mode.SPEC, self.k

    def use_costs(self, costs: Costs, tree: bool | None = None) -> None:
        """Price the next rounds with other costs (the draft ahead or serial), and say
        whether their drafter can draft trees (None: as before); K re-planned."""
        self.costs = costs
        if tree is not None:
            self.tree = tree and self.cfg.siblings != 0
            self.siblings = self._fixed_siblings(self.k)
        if self.adaptive:
            self._replan()

    def take_reason(self) -> str | None:
        reason, self._pending_reason = self._pending_reason, None
        return f"{self.label}: {reason}" if reason and self.label else reason

    def observe_plain(self, step_ms: float) -> None:
        self.costs.target_step_ms = _ema(self.costs.target_step_ms, step_ms)
        self._plain_since_probe += 1
        self._run = 0

    def run_k(self, k: int) -> int:
        """The K for a copier's next round: `k` as planned, or more where the last round was
        a copy the target took whole (a run: twice its length, up to MAX_K). Adaptive only:
        a fixed K stays fixed."""
        return max(k, self._run) if k and self.runs and self.adaptive else k

    def _run_after(self, k: int) -> int:
        """The K of the copy after one of k drafts the target took whole: twice k where one pass
        over 2k drafts, taken whole, yields RUN_GAIN times the tokens a step a pass over k
        does, else k again (the margin: a copy may break partway). Where verify rows cost
        little past the first (VNNI, AMX, a GPU) runs grow to MAX_K; where a pass's cost
        climbs with its rows (AVX2: 9 rows 3.1 steps, 17 rows 5.9) they stop sooner."""
        longer = min(MAX_K, 2 * k)
        v = self.costs.verify_ratio
        return longer if (longer + 1) / v(longer) >= self.RUN_GAIN * (k + 1) / v(k) else k

    def break_run(self) -> None:
        """A round that did not copy came between: the next copy starts a run afresh."""
        self._run = 0

    def observe_copies(self, copied: int) -> None:
        """Composed spec, at each round the lookup does not draft: the tokens copied since
        the last such round (what the draft model reads before it drafts again)."""
        # Up to two rows ride in the draft's next pass at no cost of their own; a short copy
        # rides there too, at its rows' cost; a long one takes a catch-up pass.
        read = self.costs.read_ratio(copied) if copied > 1 else 0.0
        self._copy_reads = self.MEMORY * self._copy_reads + read
        self._copy_gaps = self.MEMORY * self._copy_gaps + 1.0
        # A copy makes the next round dearer: re-plan now. Without one the price only
        # falls, and the round's own observation re-plans (the first round of a reply
        # always runs, as a measurement).
        if copied and self.adaptive and self.mode is Mode.SPEC and self.costs.ratio() is not None:
            self._replan()

    def observe_catch_up(self, rows: int, ms: float) -> None:
        """A catch-up pass of the draft over `rows` tokens it missed took `ms`: the cost of a
        row, past the pass's own (measured at load)."""
        if rows > 0:
            row = max(0.0, ms - self.costs.catch_up_pass_ms) / rows
            self.costs.catch_up_row_ms = _ema(self.costs.catch_up_row_ms, row)

    def pays_to_read(self, rows: int, remaining: int, left: str = "left", folded: bool = False) -> bool:
        """Whether the draft reading `rows` tokens it has not seen (a prompt, a plain stretch)
        pays back within the `remaining` tokens the reply may take (`left` names them in
        the reason): the best round's gain a token, 1 - 1/S, times those tokens, against
        the read. If not, plain decoding until the next probe, with the reason."""
        read = self.costs.read_ratio(rows) if folded else self.costs.catch_up_ratio(rows)
        if not self.adaptive or not read or self.costs.ratio() is None:
            return True
        k, s = self._best_in_flight()
        gain = max(0.0, 1.0 - 1.0 / s) * remaining if s > 0 else 0.0
        if gain >= read:
            return True
        if self._probing:
            self._probe_after = min(self.PROBE_AFTER_MAX, 2 * self._probe_after)
        self._probing = False
        self.mode = Mode.PLAIN
        self._plain_since_probe = 0
        self._pending_reason = (
            f"plain: the draft's read of {rows} tokens ({read:.1f} steps) would not pay back "
            f"in the {remaining} tokens {left} at {s:.2f}x (K={k}, gain {gain:.1f} steps); "
            f"probing again in {self._probe_after} tokens"
        )
        return False

    def _best_in_flight(self) -> tuple[int, float]:
        """The best chain's K and speedup as a round pays them before any was measured: its
        first draft pass reads the two rows the last round left (priced as a catch-up pass
        over two: on one thread a draft step is cheaper than that pass on all), the rest are
        steps. A Zen 3's 0.5B: c 0.30 a step at load, 0.48 the first pass, 0.47 in flight.
        Once c is learnt in flight it holds the first pass's share already, so K > 1 is
        priced on the dear side here: a read is declined, if wrongly, for a lower gain."""
        c = self.costs.ratio() or 0.0
        first = max(c, self.costs.catch_up_ratio(2))
        alpha = min(self.alpha, 0.99)
        options = [
            (
                expected_speedup(alpha, k, 0.0, 1.0)  # E(K)
                / (first + (k - 1) * c + self.costs.verify_ratio(k) + self.catch_up_steps),
                k,
            )
            for k in range(self.cfg.k_min, self.cfg.k_max + 1)
        ]
        s, k = max(options)
        return k, s

    def observe_round(
        self,
        k: int,
        accepted: int,
        draft_ms: float,
        verify_ms: float,
        siblings: int = 0,
        off_chain: bool = False,
        guessed: bool | None = None,
    ) -> None:
        """Update α, β and the costs from one speculative round, then re-plan. A tree's
        round: `siblings` guesses verified beside the k drafts, `off_chain` when the
        accepted path ended on one (then `accepted` counts it), `guessed` whether the
        depth the chain was refused at had one (None: where siblings sit at depths 1..S)."""
        chain = accepted - int(off_chain)  # the chain's own drafts the target accepted
        # The round's draft tokens in order: the accepted ones, then the rejected one.
        for hit in [1.0] * chain + [0.0] * (chain < k):
            self._acc = self.MEMORY * self._acc + hit
            self._trials = self.MEMORY * self._trials + 1.0
        if guessed is None:
            guessed = bool(siblings) and chain < min(k, siblings)
        if guessed:  # the refused depth had a second guess
            self._beta_hits = self.MEMORY * self._beta_hits + float(off_chain)
            self._beta_trials = self.MEMORY * self._beta_trials + 1.0
        if self.runs:
            self._run = self._run_after(k) if k and accepted == k and not siblings else 0
        if k > 0:
            self.costs.draft_step_ms = _ema(self.costs.draft_step_ms, draft_ms / k)
        step = self.costs.target_step_ms
        n = k + siblings  # the drafts the pass verified
        if step:
            slope = max(0.0, (verify_ms / step - 1.0) / n)
            self.costs.verify_slope = _ema(self.costs.verify_slope, slope, 0.2)
            self.costs.verify_at[n] = _ema(self.costs.verify_at.get(n), verify_ms / step, 0.2)
        else:
            # No plain step measured yet: take the verify pass as an upper bound of a step.
            self.costs.target_step_ms = verify_ms
        if self.adaptive:
            self._replan()

    def best(self) -> tuple[int, float]:
        """The best K and its expected speedup (with the best siblings for it)."""
        k, _, s = self._plan()
        return k, s

    def speedup(self, k: int, siblings: int = 0) -> float:
        """Expected speedup of a round of k drafts with a second guess beside `siblings`."""
        c = self.costs.ratio() or 0.0
        alpha = min(self.alpha, 0.99)
        # The catch-up rides in the verify term: one more fixed cost a round.
        catch_up = self.catch_up_steps
        if not siblings:
            return expected_speedup(alpha, k, c, self.costs.verify_ratio(k) + catch_up)
        tokens = expected_tokens_tree(alpha, k, self.beta, siblings)
        return tokens / (k * c + self.costs.verify_ratio(k + siblings) + catch_up)

    def _fixed_siblings(self, k: int) -> int:
        """cfg.siblings where trees may be drafted (or 0), as deep as K and a verify pass
        of MAX_ROWWISE rows allow."""
        if not self.tree:
            return 0
        return max(0, min(self.cfg.siblings or 0, k, MAX_ROWWISE - 1 - k))

    def _score(self, k: int, siblings: int) -> float:
        """What a plan is chosen by: its expected speedup, a tree's less the margin."""
        margin = 1.0 + self.TREE_MARGIN if siblings and self.choose_siblings else 1.0
        return self.speedup(k, siblings) / margin

    def _plan(self) -> tuple[int, int, float]:
        """(K, siblings, expected speedup): the best within the config's bounds (a verify
        pass of at most MAX_ROWWISE rows)."""
        if self.costs.ratio() is None:
            return self.k, self.siblings, 1.0
        options = []
        for k in range(self.cfg.k_min, self.cfg.k_max + 1):
            most = min(k, self.SIBLINGS_MAX, MAX_ROWWISE - 1 - k)
            depths = range(max(most, 0) + 1) if self.choose_siblings else [self._fixed_siblings(k)]
            options += [(self._score(k, s), -s, k) for s in depths]
        _, minus_s, k = max(options)  # ties: fewer siblings
        return k, -minus_s, self.speedup(k, -minus_s)

    def _replan(self) -> None:
        c = self.costs.ratio()
        if c is None:
            return
        k, sib, s = self._plan()
        n = k + sib
        facts = f"α={self.alpha:.2f}, c={c:.2f}, v({n})={self.costs.verify_ratio(n):.2f}"
        if sib:
            facts += f", β={self.beta:.2f}"
        if self.catch_up_steps >= 0.01:
            facts += f", catch-up {self.catch_up_steps:.2f}"
        probed, self._probing = self._probing, False
        if s < self.FALLBACK_BELOW:
            if probed:
                self._probe_after = min(self.PROBE_AFTER_MAX, 2 * self._probe_after)
            self.mode = Mode.PLAIN
            self._plain_since_probe = 0
            self._pending_reason = (
                f"fallback to plain: best expected speedup {s:.2f}x < {self.FALLBACK_BELOW} "
                f"at K={k} ({facts}); probing again in {self._probe_after} tokens"
            )
            self.k, self.siblings = k, sib
            return
        self._probe_after = self.PROBE_AFTER
        if self.mode is Mode.PLAIN:
            self.mode = Mode.SPEC
            self._pending_reason = (
                f"speculation pays again: {s:.2f}x expected at K={_shape(k, sib)} ({facts})"
            )
        elif (k, sib) != (self.k, self.siblings):
            if self._score(k, sib) < self._score(self.k, self.siblings) * (1 + self.HYSTERESIS):
                return  # not worth a change: K would flap on noise
            self._pending_reason = (
                f"K {_shape(self.k, self.siblings)}->{_shape(k, sib)}: expected speedup "
                f"{s:.2f}x ({facts})"
            )
        self.k, self.siblings = k, sib


def _shape(k: int, siblings: int) -> str:
    """'2', or '2 + 1 sibling' for a tree with a second guess beside the first draft."""
    if not siblings:
        return str(k)
    return f"{k} + {siblings} sibling{'s' if siblings > 1 else ''}"


def trees_pay_below(costs: Costs, cfg: DecodeConfig | None = None) -> float | None:
    """The highest acceptance (0.30-0.99) at which the controller would speculate with the
    draft's second guess beside its chain at these costs, β at its prior; None if at none."""
    cfg = cfg or DecodeConfig()
    edge = None
    for percent in range(30, 100):
        alpha = percent / 100
        ctl = Controller(cfg, replace(costs, verify_at=dict(costs.verify_at)), alpha, tree=True)
        _, siblings, speedup = ctl._plan()
        if siblings and speedup >= Controller.FALLBACK_BELOW:
            edge = alpha
    return edge
