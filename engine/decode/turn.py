"""One reply's state while it decodes: what it runs with (`Turn`) and what it counted
(`Tally`, turned into the TurnStats of TurnFinished)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import SPECULATIVE_MODES, DecodeConfig, Mode
from ..events import TokenEvent, TurnStats
from .ahead import AheadDrafter
from .compose import ComposedDrafter
from .controller import Controller
from .early_exit import EarlyExitStepper
from .speculative import Drafter, RoundResult
from .text import IncrementalDecoder, ReplyFilter


@dataclass(slots=True)
class Turn:
    """What one reply decodes with, set up by `_begin`."""

    cfg: DecodeConfig
    run_mode: Mode  # the mode asked for, or PLAIN where it cannot run
    drafter: Drafter | None
    composed: ComposedDrafter | None  # the drafter, when spec composes lookup and the model
    early_exit: EarlyExitStepper | None
    controller: Controller  # K and fallback for the turn's drafter
    copier: Controller | None  # composed spec: prices the rounds that copy the conversation
    seq: list[int]  # the conversation's tokens, the reply appended as it is decoded
    earlier: str  # the text of a continued reply decoded before
    continuing: bool
    decoder: IncrementalDecoder
    reply: ReplyFilter[TokenEvent]
    generator: torch.Generator
    # The draft model drafting on its own core, where this turn may (decode/ahead.py):
    # whether it does now, whether the session chooses round by round, the serial drafter
    # it gives way to, and the round before which the way stays as it is.
    ahead: AheadDrafter | None = None
    ahead_on: bool = False
    ahead_auto: bool = False
    serial: Drafter | None = None
    switch_at: int = 6
    switched_at: int = 0  # the round of the last change of way, and the drafts tallied then
    drafted_at: int = 0
    ahead_refuted: bool = False  # running ahead starved this turn: serial to its end
    # Composed spec: tokens copied since the last round the lookup did not draft, and
    # whether the draft model has drafted this turn (its first read is the prompt's).
    copied: int = 0
    model_drafted: bool = False
    tally: Tally = field(default_factory=lambda: Tally())

    @property
    def speculative(self) -> bool:
        return self.run_mode in SPECULATIVE_MODES


@dataclass(slots=True)
class Tally:
    """A reply's counters, turned into TurnStats at its end."""

    generated: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    early_exits: int = 0
    layers_total: int = 0
    layers_known: int = 0
    t_first: float | None = None
    fallbacks: list[str] = field(default_factory=list)

    def round(self, res: RoundResult, reason: str | None) -> None:
        self.rounds += 1
        if res.k:
            self.spec_rounds += 1
            self.drafted += res.k
            self.accepted += res.accepted
        if reason:
            self.fallbacks.append(reason)

    def token(self, res: RoundResult, i: int) -> None:
        self.generated += 1
        if res.layers_run:
            self.layers_total += res.layers_run[i]
            self.layers_known += 1
        if res.tokens[i].exit_layer is not None:
            self.early_exits += 1

    def stats(
        self, t_start: float, mode: Mode, optimizations: list[str], stop_reason: str, text: str
    ) -> TurnStats:
        seconds = time.perf_counter() - t_start
        return TurnStats(
            tokens=self.generated,
            seconds=seconds,
            tokens_per_s=self.generated / seconds if seconds > 0 else 0.0,
            ttft_s=self.t_first - t_start if self.t_first is not None else seconds,
            rounds=self.rounds,
            drafted=self.drafted,
            accepted=self.accepted,
            acceptance_rate=self.accepted / self.drafted if self.drafted else None,
            mean_accepted_length=(self.accepted + self.spec_rounds) / self.spec_rounds
            if self.spec_rounds
            else None,
            mode=mode,
            optimizations=tuple(optimizations),
            fallbacks=tuple(self.fallbacks),
            stop_reason=stop_reason,
            text=text,
            early_exits=self.early_exits,
            mean_layers=self.layers_total / self.layers_known if self.layers_known else None,
        )
