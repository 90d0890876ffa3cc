"""The draft model running ahead on a core of its own, while the target verifies.

On a CPU a decode step of the target is bound by what one core reads: the
1.5B's one-token step takes as long on one thread as on two, and the 0.5B
draft's step is faster on one. Two cores then serve best as two streams:
the target's passes on one, the draft on the other, both at once (measured
at load: each runs within a few percent of its speed alone). `AheadDrafter`
keeps drafting a chain past the sequence the target has committed, and each
round takes the drafts that are ready by then (none: the round is a plain
step) without waiting for them, so the draft's cost leaves the round.

What the drafts are conditioned on is tracked exactly. The chain extends
`base`, the sequence last committed; a round that accepts every draft it took
leaves the rest of the chain standing (the target's bonus token is checked
against the chain's next draft when the next round begins), a refused draft
voids everything drafted after it, and a draft computed for a sequence that
was voided meanwhile is dropped (`_epoch`). The draft only proposes; the
target's verify pass decides every token, so greedy output equals plain
decoding whatever the draft did or how far it got.

Greedy decoding only: how many drafts a round takes depends on timing, and
a sampled reply with a fixed seed and K must be the same reply every run, so
the session drafts sampled turns the serial way (decode/speculative.py).

The worker owns the draft's runner while it runs (`start` .. `stop`): the
session's thread never touches that cache in between, and `stop` leaves it
holding a prefix of the committed sequence, as a serial drafter would.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from ..config import MAX_K, DecodeConfig
from ..model.native import prompt_rows
from .sampling import align_vocab, argmax
from .speculative import ModelDrafter, Proposal


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed (the worker asks every step)
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class AheadDrafter:
    """A `ModelDrafter`'s model drafting on its own thread; implements `Drafter`."""

    def __init__(self, inner: ModelDrafter, lead: int = 8) -> None:
        self.inner = inner
        self.runner = inner.runner
        self.name = inner.name
        # How far past the committed sequence the chain may run: a round takes at most
        # MAX_K drafts, and drafts beyond what the next rounds take are wasted work
        # after a refusal.
        self.lead = max(1, min(lead, MAX_K))
        self._cv = threading.Condition()
        self._base: list[int] = []  # the committed sequence the chain extends
        self._chain: list[int] = []  # drafts after base, in order
        self._rows: list[Tensor] = []  # the draft's logits for each, over the target's vocab
        self._epoch = 0  # bumped whenever the chain is voided
        self._held = True  # nothing to draft until the next round says where it stands
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._given = 0  # len(seq) + drafts handed out by the last propose
        self._fed: list[int] = []  # what the draft's cache holds (the worker's own)
        self._threads_before: int | None = None
        # Drafts a round waits for when fewer are ready (0: never waits). Waiting costs the
        # target's core its time, so the engine does not; tests do, for rounds that do not
        # depend on how fast each thread happened to run.
        self.min_ready = 0
        self.drafted = 0  # drafts computed this turn (for the round's facts and the tests)
        self.voided = 0  # of those, drafts thrown away unread

    # -- lifecycle --------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, seq: list[int]) -> None:
        """Begin drafting after seq on a thread of its own; this thread's torch ops give one
        thread up until `stop` (that core is the draft's). The cache holds a prefix of seq."""
        if self._thread is not None:
            self.follow(seq)
            return
        self._fed = list(seq[: self.runner.cached])
        self._base, self._chain, self._rows = list(seq), [], []
        self._given, self._held, self._stopping, self._error = len(seq), False, False, None
        self.drafted = self.voided = 0
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, self._threads_before - 1))
        self._thread = threading.Thread(target=self._work, name="specchat-draft", daemon=True)
        self._thread.start()

    def stop(self, seq: list[int] | None = None) -> None:
        """End the worker (after its current pass) and give this thread its torch threads back;
        the draft's cache is cut to what it shares with seq (the committed sequence)."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        thread.join()
        self._thread = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        keep = common_prefix_len(self._fed, seq) if seq is not None else 0
        self.runner.crop_to(keep)
        self._fed = self._fed[:keep]
        self._base, self._chain, self._rows = [], [], []
        self._epoch += 1
        self._held = True

    # -- Drafter --------------------------------------------------------------

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        """The drafts ready after seq, at most k, without waiting (none: a plain step)."""
        if not cfg.greedy:
            raise ValueError("the draft runs ahead for greedy decoding only")
        if self._thread is None:
            self.start(seq)
        with self._cv:
            self._raise_failure()
            self._follow(seq)
            want = min(k, self.min_ready, self.lead)
            while len(self._chain) < want and self._error is None:
                self._cv.wait()
            self._raise_failure()
            n = min(k, len(self._chain))
            ids, rows = self._chain[:n], self._rows[:n]
            self._given = len(seq) + n
        device = self.runner.device
        if not n:
            return Proposal(torch.zeros(0, dtype=torch.long, device=device))
        return Proposal(torch.tensor(ids, dtype=torch.long, device=device), torch.stack(rows))

    def follow(self, seq: list[int]) -> None:
        """The committed sequence is now seq: keep the drafts that extend it, void the rest."""
        with self._cv:
            self._raise_failure()
            self._follow(seq)

    def rollback(self, n: int) -> None:
        """The first n tokens stand. Running: drafts past n are void unless every draft handed
        out was accepted (then the chain may continue past the target's next token). Stopped:
        the cache keeps its first n tokens."""
        if self._thread is None:
            self.runner.crop_to(n)
            del self._fed[n:]
            return
        with self._cv:
            if n >= self._given:
                return
            drop = n - len(self._base)
            if drop >= 0:
                self.voided += len(self._chain) - drop
                del self._chain[drop:], self._rows[drop:]
            else:
                self.voided += len(self._chain)
                self._base, self._chain, self._rows = self._base[:n], [], []
            self._epoch += 1
            self._held = True  # the round's last token comes with the next sequence

    def catch_up(self, seq: list[int]) -> None:
        """Nothing to do here: the worker catches up on its own thread."""

    def reset(self) -> None:
        self.stop()
        self.runner.reset()
        self._fed = []

    # -- the worker ---------------------------------------------------------------

    def _follow(self, seq: list[int]) -> None:
        """(Under the lock.) Re-base the chain on seq."""
        base, chain = self._base, self._chain
        extra = len(seq) - len(base)
        if (
            0 <= extra <= len(chain)
            and seq[: len(base)] == base
            and seq[len(base) :] == chain[:extra]
        ):
            del chain[:extra], self._rows[:extra]
        else:
            self.voided += len(chain)
            self._chain, self._rows = [], []
            self._epoch += 1
        self._base = list(seq)
        self._held = False
        self._cv.notify_all()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the draft model failed: {error}") from error

    def _work(self) -> None:
        torch.set_num_threads(1)
        try:
            while True:
                with self._cv:
                    while not self._stopping and (self._held or len(self._chain) >= self.lead):
                        self._cv.wait()
                    if self._stopping:
                        return
                    seq = self._base + self._chain
                    epoch = self._epoch
                row = self._next_row(seq)
                token = int(argmax(row))
                with self._cv:
                    self.drafted += 1
                    if epoch == self._epoch:
                        self._chain.append(token)
                        self._rows.append(row)
                        self._cv.notify_all()
                    else:
                        self.voided += 1
        except BaseException as exc:  # handed to the session's thread by the next propose
            with self._cv:
                self._error = exc
                self._held = True
                self._cv.notify_all()

    @torch.inference_mode()
    def _next_row(self, seq: list[int]) -> Tensor:
        """The draft's logits after seq [V], feeding what its cache lacks."""
        keep = min(common_prefix_len(self._fed, seq), len(seq) - 1)
        self.runner.crop_to(keep)
        del self._fed[keep:]
        new = seq[keep:]
        # A read (the prompt, a copy) may take a prompt's code: a draft's rows need no step's
        # bits. A one-row step never does, so it skips the flag's two kernel calls.
        with prompt_rows() if len(new) > 1 else nullcontext():
            logits = self.runner.feed(new, keep=1)[-1]
        self._fed = list(seq)
        return align_vocab(logits, self.inner.vocab or logits.shape[-1])


@contextmanager
def ahead_of(drafter: AheadDrafter | None, seq: list[int]) -> Iterator[None]:
    """Stop `drafter`'s worker on the way out, whatever ends the turn (seq: the turn's
    committed sequence, which grows in place)."""
    try:
        yield
    finally:
        if drafter is not None:
            drafter.stop(seq)


def predict_ahead_ms(
    alpha: float,
    step_ms: float,
    verify: Callable[[int], float],
    draft_ms: float,
    k_max: int = 4,
    tokens: int = 4000,
) -> float:
    """Milliseconds a token when the draft runs ahead, by playing the pipeline out.

    The target's passes run back to back: each takes the drafts ready when it
    starts (at most k_max) and costs `verify(k)` steps for k drafts (`step_ms`
    for none), both as measured beside the draft; the draft makes one token
    every `draft_ms` along a chain that a refusal voids (its next token then
    comes `draft_ms` after the pass). Each draft is the target's token with
    probability alpha, independently (a fixed seed: the same costs give the
    same answer). What this leaves out (copies, short replies) it leaves out
    of the serial estimate too, so the two compare.
    """
    rng = random.Random(0)
    t = 0.0
    done = 0
    ready: list[float] = []  # when each draft of the standing chain is (or will be) ready
    restart = 0.0  # when the draft began the standing chain
    while done < tokens:
        while len(ready) < k_max + 8:  # the chain as the draft extends it, in time
            ready.append((ready[-1] if ready else restart) + draft_ms)
        k = min(k_max, sum(1 for r in ready if r <= t))
        t += step_ms * (verify(k) if k else 1.0)
        checked = k + (1 if ready[k] <= t else 0)  # the pass's last row checks one more
        hits = 0
        while hits < checked and rng.random() < alpha:
            hits += 1
        if hits == checked == k + 1:  # every draft stood, and the next one too
            done += hits
            del ready[:hits]
        else:
            done += hits + 1
            ready, restart = [], t
    return t / done
