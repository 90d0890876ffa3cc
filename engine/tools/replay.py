"""Replay a recorded trace as a `ChatBackend`, and synthesise realistic traces.

A trace is JSONL: one `events.to_dict` object per line, the format
`specchat generate --json` writes. Events before the first `TurnStarted`
(LoadProgress, Ready, Notice) form the preamble; each `TurnStarted` opens a
turn that ends with TurnFinished, Cancelled or Failed.

Turns are grouped by `TurnStarted.turn`: several recordings of the same turn
in different modes (say, the same prompt generated with `--mode spec` and
`--mode plain`) are variants of one reply. `stream()` replays the next
group, choosing the variant recorded in the requested mode; `regenerate()`
replays the current group again. Plain decoding can always be derived from
a recorded turn (same tokens, all from the target, one per round), which is
exact for the lossless modes. A requested mode with no recording is
announced with a Notice and the group's first variant is replayed.

A replay honours `DecodeConfig.max_new_tokens` as the engine does: a turn
longer than the limit stops there with stop_reason "max_tokens", and
`continue_reply()` plays the rest of the same recording, up to the limit again.

Timestamps are re-based so that a replayed turn starts at the `stream()`
call; the gaps between them stay as recorded, so statistics computed from a
replay are the recorded ones whatever the replay speed.

`python -m specchat.engine.tools.replay OUT.jsonl` writes a demo trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config import DecodeConfig, Mode
from ..errors import EngineError
from ..events import (
    Cancelled,
    Event,
    Failed,
    LoadProgress,
    ModelInfo,
    Notice,
    Provenance,
    Ready,
    RoundEvent,
    SystemSample,
    TokenEvent,
    TurnFinished,
    TurnStarted,
    TurnStats,
    from_dict,
    to_dict,
)

_TERMINAL = (TurnFinished, Cancelled, Failed)

# -- trace files -----------------------------------------------------------


def read_trace(path: str | Path) -> list[Any]:
    """Events of a JSONL trace. Raises EngineError naming the bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EngineError(
            f"Cannot read the trace {path}: {exc.strerror or exc}",
            "Check the path; `specchat generate --json > trace.jsonl` records one.",
        ) from None
    events: list[Any] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError(
                f"{path.name} line {no} is not an event: {exc}",
                "A trace holds one JSON event per line, as `specchat generate --json` writes.",
            ) from None
    return events


def write_trace(path: str | Path, events: Iterable[Any]) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for event in events:
            fh.write(json.dumps(to_dict(event), ensure_ascii=False) + "\n")


def split_turns(events: Iterable[Any]) -> tuple[list[Any], list[list[Any]]]:
    """(preamble, turns). A turn runs from TurnStarted to its terminal event."""
    preamble: list[Any] = []
    turns: list[list[Any]] = []
    current: list[Any] | None = None
    for ev in events:
        if isinstance(ev, SystemSample):
            continue
        if isinstance(ev, TurnStarted):
            current = [ev]
            turns.append(current)
        elif current is not None:
            current.append(ev)
            if isinstance(ev, _TERMINAL):
                current = None
        else:
            preamble.append(ev)
    return preamble, turns


def as_plain(turn: Sequence[Any]) -> list[Any]:
    """The same reply as plain target decoding: every token TARGET, one round each."""
    out: list[Any] = []
    tokens = [e for e in turn if isinstance(e, TokenEvent)]
    verify = [e.verify_ms for e in turn if isinstance(e, RoundEvent)]
    step_ms = (sum(verify) / len(verify)) if verify else 20.0
    start = next((e for e in turn if isinstance(e, TurnStarted)), None)
    t = tokens[0].t if tokens else 0.0
    if start is not None:
        out.append(dataclasses.replace(start, mode=Mode.PLAIN))
    for i, tok in enumerate(tokens):
        if i:
            t += step_ms / 1000.0
        out.append(
            TokenEvent(tok.token_id, tok.text, Provenance.TARGET, i, p_target=tok.p_target, t=t)
        )
        out.append(RoundEvent(i, Mode.PLAIN, 0, 0, 0.0, step_ms))
    end = next((e for e in turn if isinstance(e, _TERMINAL)), None)
    if isinstance(end, TurnFinished):
        s = end.stats
        ttft = s.ttft_s
        seconds = ttft + step_ms * max(0, len(tokens) - 1) / 1000.0
        out.append(
            TurnFinished(
                dataclasses.replace(
                    s,
                    seconds=seconds,
                    tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0,
                    rounds=len(tokens),
                    drafted=0,
                    accepted=0,
                    acceptance_rate=None,
                    mean_accepted_length=None,
                    mode=Mode.PLAIN,
                    optimizations=(),
                    fallbacks=(),
                    early_exits=0,
                    mean_layers=None,
                )
            )
        )
    elif end is not None:
        out.append(end)
    return out


# -- the backend -----------------------------------------------------------


class ReplaySession:
    """A `ChatBackend` that replays recorded turns.

    `pace`: None replays as fast as possible (tests); 1.0 keeps the recorded
    timing; 2.0 replays twice as fast. Cancellation is honoured between rounds.
    """

    def __init__(
        self,
        events: Iterable[Any],
        *,
        pace: float | None = None,
        name: str = "trace",
    ) -> None:
        preamble, turns = split_turns(events)
        if not turns:
            raise EngineError(
                f"The trace {name} holds no turn.",
                "Record one with `specchat generate --json PROMPT > trace.jsonl`.",
            )
        if pace is not None and pace <= 0:
            raise ValueError(f"pace must be > 0 or None, got {pace}")
        self.name = name
        self.pace = pace
        self.load_events = [e for e in preamble if isinstance(e, LoadProgress)]
        ready = next((e for e in preamble if isinstance(e, Ready)), None)
        self.ready: Ready = ready or _replay_ready(name)
        self._groups: list[list[list[Any]]] = []
        index: dict[int, int] = {}
        for turn in turns:
            number = turn[0].turn
            if number not in index:
                index[number] = len(self._groups)
                self._groups.append([])
            self._groups[index[number]].append(turn)
        self._next = 0
        self._current: int | None = None
        self._turn = 0
        self._messages: list[tuple[str, str]] = []
        self._cut: tuple[int, int] | None = None  # (group, tokens played) of a reply the limit cut
        self.calls: list[tuple[str, str | None, DecodeConfig]] = []  # (kind, prompt, config)

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        pace: float | None = 1.0,
        progress: Callable[[LoadProgress], None] | None = None,
    ) -> ReplaySession:
        session = cls(read_trace(path), pace=pace, name=Path(path).name)
        if progress is not None:
            for ev in session.load_events:
                progress(ev)
        return session

    # ChatBackend --------------------------------------------------------

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._messages)

    @property
    def turns_recorded(self) -> int:
        return len(self._groups)

    @property
    def can_continue(self) -> bool:
        return (
            self._cut is not None and bool(self._messages) and self._messages[-1][0] == "assistant"
        )

    def reset(self) -> None:
        self._messages.clear()
        self._next = 0
        self._current = None
        self._cut = None

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        self.calls.append(("stream", prompt, config))
        group = self._next % len(self._groups)
        self._next += 1
        self._current = group
        self._messages.append(("user", prompt))
        return self._play(group, config, cancel)

    def regenerate(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        self.calls.append(("regenerate", None, config))
        if self._current is None or not self._messages:
            return iter([Failed("There is no reply to regenerate.", "Send a prompt first.")])
        if self._messages[-1][0] == "assistant":
            self._messages.pop()
        return self._play(self._current, config, cancel)

    def continue_reply(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        self.calls.append(("continue", None, config))
        if not self.can_continue or self._cut is None:
            return iter(
                [
                    Failed(
                        "there is no cut reply to continue",
                        hint="only a reply that stopped at the token limit can be continued",
                    )
                ]
            )
        group, skip = self._cut
        return self._play(group, config, cancel, skip=skip, earlier=self._messages[-1][1])

    # replay -------------------------------------------------------------

    def _choose(self, group: int, mode: Mode) -> tuple[list[Any], Notice | None]:
        variants = self._groups[group]
        for turn in variants:
            if turn[0].mode is mode:
                return turn, None
        if mode is Mode.PLAIN:
            return as_plain(variants[0]), None
        first = variants[0]
        return first, Notice(
            f"replay: no turn recorded in {mode.value} mode; replaying the "
            f"{first[0].mode.value} recording",
            "warning",
        )

    def _play(
        self,
        group: int,
        config: DecodeConfig,
        cancel: threading.Event | None,
        *,
        skip: int = 0,
        earlier: str = "",
    ) -> Iterator[Event]:
        """Replay a recorded turn from its token `skip`, at most config.max_new_tokens of it.

        A reply the limit cuts ends like the engine's: TurnFinished with
        stop_reason "max_tokens", and `continue_reply` plays on from there.
        A round the limit cuts keeps its first tokens. `earlier` is the reply
        text played before `skip`; the terminal events carry the whole reply.
        """
        turn, notice = self._choose(group, config.mode)
        self._turn += 1
        self._cut = None
        recorded = [e for e in turn if isinstance(e, TokenEvent)]
        recorded_end = next((e for e in turn if isinstance(e, TurnFinished)), None)
        call_t = time.perf_counter()
        start_t = _recorded_start(turn) if skip == 0 else recorded[skip - 1].t
        shift = call_t - start_t
        limit = config.max_new_tokens
        mode = turn[0].mode
        seen = 0  # tokens of the recording gone by, played or not
        in_round = 0  # of those, in the current round
        played: list[TokenEvent] = []
        rounds: list[RoundEvent] = []
        clock_ms = 0.0
        pending: list[TokenEvent] = []

        def whole() -> str:
            return earlier + "".join(t.text for t in played)

        def keep(text: str) -> None:
            if skip:
                self._messages[-1] = ("assistant", text)
            else:
                self._messages.append(("assistant", text))

        def stats(stop_reason: str) -> TurnStats:
            return _segment_stats(recorded_end, mode, played, rounds, call_t, stop_reason, whole())

        for ev in turn:
            if isinstance(ev, TurnStarted):
                yield dataclasses.replace(ev, turn=self._turn)
                if notice is not None:
                    yield notice
            elif isinstance(ev, TokenEvent):
                seen += 1
                in_round += 1
                if seen > skip and len(played) + len(pending) < limit:
                    pending.append(dataclasses.replace(ev, t=ev.t + shift if ev.t else 0.0))
            elif isinstance(ev, RoundEvent):
                # this round's tokens played before the cut (a continuation resumes mid-round)
                before = max(0, in_round - (seen - skip))
                whole_round = len(pending) == in_round
                in_round = 0
                if seen <= skip:
                    continue  # played before the cut
                if cancel is not None and cancel.is_set():
                    break
                clock_ms += ev.draft_ms + ev.verify_ms
                if self.pace is not None and pending:
                    emit_t = max(t.t for t in pending)
                    offset = (emit_t - call_t) if emit_t else clock_ms / 1000.0
                    due = call_t + offset / self.pace
                    delay = due - time.perf_counter()
                    if delay > 0 and cancel is not None:
                        if cancel.wait(delay):
                            break
                    elif delay > 0:
                        time.sleep(delay)
                if not whole_round:
                    accepted = sum(t.provenance is Provenance.ACCEPTED for t in pending)
                    ev = dataclasses.replace(ev, k=max(accepted, ev.k - before), accepted=accepted)
                yield from pending
                yield ev
                played.extend(pending)
                rounds.append(ev)
                pending = []
                if len(played) >= limit and skip + len(played) < len(recorded):
                    self._cut = (group, skip + len(played))
                    keep(whole())
                    yield TurnFinished(stats("max_tokens"))
                    return
            elif isinstance(ev, _TERMINAL):
                if skip and isinstance(ev, TurnFinished):
                    ev = TurnFinished(stats(ev.stats.stop_reason))
                elif skip and isinstance(ev, Cancelled):
                    ev = Cancelled(len(played), whole())
                if isinstance(ev, TurnFinished | Cancelled):
                    keep(whole())
                yield ev
                return
            else:
                yield ev
        if cancel is not None and cancel.is_set():
            keep(whole())
            yield Cancelled(len(played), whole())
        else:
            yield Failed("The trace ends in the middle of a turn.", "Record the trace again.")


def _segment_stats(
    recorded: TurnFinished | None,
    mode: Mode,
    tokens: Sequence[TokenEvent],
    rounds: Sequence[RoundEvent],
    call_t: float,
    stop_reason: str,
    text: str,
) -> TurnStats:
    """Stats of the part of a recorded turn a replay played, timed on the recording's clock."""
    round_s = [(r.draft_ms + r.verify_ms) / 1000.0 for r in rounds]
    timed = [t for t in tokens if t.t]
    ttft = timed[0].t - call_t if timed else (round_s[0] if round_s else 0.0)
    seconds = timed[-1].t - call_t if timed else sum(round_s)
    drafted = sum(r.k for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    early = [t for t in tokens if t.provenance is Provenance.EARLY_EXIT]
    return TurnStats(
        tokens=len(tokens),
        seconds=seconds,
        tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0,
        ttft_s=ttft,
        rounds=len(rounds),
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=len(tokens) / len(rounds) if drafted and rounds else None,
        mode=mode,
        optimizations=recorded.stats.optimizations if recorded else (),
        fallbacks=tuple(r.fallback_reason for r in rounds if r.fallback_reason),
        stop_reason=stop_reason,
        text=text,
        early_exits=len(early),
        mean_layers=None,  # a part of the turn: the recording holds the layers of the whole
    )


def _recorded_start(turn: Sequence[Any]) -> float:
    """When the recorded turn began, on the recording's clock."""
    tokens = [e for e in turn if isinstance(e, TokenEvent) and e.t]
    if not tokens:
        return 0.0
    first = tokens[0].t
    end = next((e for e in turn if isinstance(e, TurnFinished)), None)
    if end is not None:
        return first - end.stats.ttft_s
    first_round = next((e for e in turn if isinstance(e, RoundEvent)), None)
    return first - ((first_round.draft_ms + first_round.verify_ms) / 1000.0 if first_round else 0.0)


def _replay_ready(name: str) -> Ready:
    info = ModelInfo("target", f"replay of {name}", name, "cpu", "n/a", "none", 0, 0, 0, 0, 0)
    return Ready(f"replay of {name}", info, None)


# -- synthetic traces ------------------------------------------------------

DEMO_REPLIES: tuple[str, ...] = (
    "Speculative decoding lets a **small draft model** guess the next few tokens, "
    "and the *target* model checks them all in one pass:\n\n"
    "1. the draft proposes K tokens;\n"
    "2. the target verifies them at once;\n"
    "3. accepted tokens are kept, the first refused one is replaced.\n\n"
    "The output has exactly the target's distribution, only faster. Voilà, a café-sized speedup.",
    "Here is a tiny example in Python:\n\n"
    "```python\n"
    "def greet(name):\n"
    '    return f"Hello, {name}!"\n'
    "```\n\n"
    'Call `greet("Zoë")` and it returns a friendly greeting.',
    "Early exit stops the target at an intermediate layer when it is already "
    "confident, so easy tokens cost less. It is lossy: the text may differ from "
    "what the full model would say, which is why the budget keeps agreement high.",
)

_PIECE = re.compile(r"\s*\S+|\s+")


def tokenize(text: str) -> list[tuple[int, str]]:
    """Deterministic word-piece tokens (id, text) for synthetic traces.

    Long words are split in two; a non-ASCII character is split over two
    tokens like a byte-level tokenizer does: the first carries "" (the
    character is incomplete), the next carries the character.
    """
    out: list[tuple[int, str]] = []
    for piece in _PIECE.findall(text):
        parts = [piece]
        if len(piece.strip()) > 7:
            cut = len(piece) // 2
            parts = [piece[:cut], piece[cut:]]
        for part in parts:
            buf = ""
            for ch in part:
                if ord(ch) > 127:
                    if buf:
                        out.append((_token_id(buf), buf))
                        buf = ""
                    first_byte = ch.encode("utf-8")[0]
                    out.append((3 + first_byte, ""))
                    out.append((_token_id(ch), ch))
                else:
                    buf += ch
            if buf:
                out.append((_token_id(buf), buf))
    return out


def _token_id(text: str) -> int:
    return 300 + zlib.crc32(text.encode("utf-8")) % 31_700


_DECOY = (" the", " a", " it", ",", " and", " model", " fast", " of")


def _decoy(rng: random.Random, avoid: str) -> tuple[int, str]:
    text = rng.choice([d for d in _DECOY if d != avoid])
    return _token_id(text), text


def synthesize_turn(
    text: str,
    *,
    mode: Mode = Mode.SPEC,
    turn: int = 1,
    seed: int = 0,
    k: int = 4,
    accept: Sequence[float] = (0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35),
    fallback_at: int | None = 5,
    draft_step_ms: float = 4.0,
    target_step_ms: float = 24.0,
    layers: int = 12,
    exit_layers: Sequence[int] = (4, 6, 8),
    exit_rate: float = 0.45,
    t0: float = 1000.0,
    prefill_ms: float = 60.0,
) -> list[Any]:
    """One recorded turn replying `text` in `mode`, with plausible timing.

    Speculative turns accept drafts with the per-position probabilities
    `accept`, emit a CORRECTED token (with the refused draft) on a refusal
    and a BONUS token when all K are accepted; at round `fallback_at` the
    controller lowers K with a stated reason. Early-exit turns exit at one of
    `exit_layers` with probability `exit_rate`. Deterministic for a seed.
    """
    rng = random.Random(seed * 7919 + turn)
    toks = tokenize(text)
    events: list[Any] = [TurnStarted(turn, 40 + 10 * turn, 24, mode, prefill_ms)]
    t = t0 + prefill_ms / 1000.0
    i = rnd = drafted = accepted_total = early = 0
    layer_sum = 0
    fallbacks: list[str] = []
    cur_k = k
    self_spec_depth = max(1, layers // 4)

    def jitter(ms: float) -> float:
        return round(ms * rng.uniform(0.85, 1.2), 3)

    while i < len(toks):
        if mode in (Mode.SPEC, Mode.SELF_SPEC):
            remaining = len(toks) - i
            kk = max(1, min(cur_k, remaining - 1)) if remaining > 1 else 1
            n_acc = 0
            while (
                n_acc < kk
                and n_acc < remaining
                and rng.random() < accept[min(n_acc, len(accept) - 1)]
            ):
                n_acc += 1
            step = draft_step_ms if mode is Mode.SPEC else target_step_ms * self_spec_depth / layers
            draft_ms = jitter(step * kk)
            verify_ms = jitter(target_step_ms * 1.15)
            t += (draft_ms + verify_ms) / 1000.0
            for pos in range(n_acc):
                tid, tt = toks[i]
                p_d = round(rng.uniform(0.3, 0.95), 4)
                p_t = round(min(1.0, p_d * rng.uniform(0.95, 1.4)), 4)
                events.append(TokenEvent(tid, tt, Provenance.ACCEPTED, rnd, pos, p_t, p_d, t=t))
                i += 1
            if i < len(toks):
                tid, tt = toks[i]
                if n_acc == kk:
                    p_t = round(rng.uniform(0.4, 0.99), 4)
                    events.append(TokenEvent(tid, tt, Provenance.BONUS, rnd, kk, p_t, None, t=t))
                else:
                    rid, rtext = _decoy(rng, tt)
                    p_t = round(rng.uniform(0.2, 0.9), 4)
                    p_d = round(rng.uniform(0.01, 0.2), 4)
                    events.append(
                        TokenEvent(
                            tid,
                            tt,
                            Provenance.CORRECTED,
                            rnd,
                            n_acc,
                            p_t,
                            p_d,
                            rejected_id=rid,
                            rejected_text=rtext,
                            t=t,
                        )
                    )
                i += 1
            drafted += kk
            accepted_total += n_acc
            reason = None
            next_k = cur_k
            if fallback_at is not None and rnd == fallback_at and cur_k > 2:
                next_k = cur_k // 2
                rate = accepted_total / drafted if drafted else 0.0
                reason = (
                    f"acceptance {rate:.2f} below 0.80 over {rnd + 1} rounds: K {cur_k} -> {next_k}"
                )
                fallbacks.append(reason)
            events.append(
                RoundEvent(rnd, mode, kk, n_acc, draft_ms, verify_ms, reason, mode, next_k)
            )
            cur_k = next_k
        else:
            tid, tt = toks[i]
            if mode is Mode.EARLY_EXIT and rng.random() < exit_rate:
                layer = rng.choice(list(exit_layers))
                verify_ms = jitter(target_step_ms * layer / layers)
                t += verify_ms / 1000.0
                conf = round(rng.uniform(0.9, 0.995), 4)
                events.append(
                    TokenEvent(
                        tid,
                        tt,
                        Provenance.EARLY_EXIT,
                        rnd,
                        None,
                        round(rng.uniform(0.5, 0.99), 4),
                        None,
                        exit_layer=layer,
                        confidence=conf,
                        t=t,
                    )
                )
                early += 1
                layer_sum += layer
            else:
                verify_ms = jitter(target_step_ms)
                t += verify_ms / 1000.0
                events.append(
                    TokenEvent(
                        tid, tt, Provenance.TARGET, rnd, None, round(rng.uniform(0.3, 0.99), 4), t=t
                    )
                )
                layer_sum += layers
            events.append(RoundEvent(rnd, mode, 0, 0, 0.0, verify_ms))
            i += 1
        rnd += 1
    n = len(toks)
    seconds = t - t0
    first_t = next(e.t for e in events if isinstance(e, TokenEvent))
    spec = mode in (Mode.SPEC, Mode.SELF_SPEC)
    stats = TurnStats(
        tokens=n,
        seconds=round(seconds, 6),
        tokens_per_s=n / seconds,
        ttft_s=first_t - t0,
        rounds=rnd,
        drafted=drafted,
        accepted=accepted_total,
        acceptance_rate=accepted_total / drafted if drafted else None,
        mean_accepted_length=n / rnd if spec and rnd else None,
        mode=mode,
        optimizations=(mode.value,) if mode is not Mode.PLAIN else (),
        fallbacks=tuple(fallbacks),
        stop_reason="eos",
        text="".join(tt for _, tt in toks),
        early_exits=early,
        mean_layers=layer_sum / n if mode is Mode.EARLY_EXIT and n else None,
    )
    events.append(TurnFinished(stats))
    return events


def _lossy(text: str) -> str:
    """The reply as a lossy early exit might phrase it: one word changed past the middle."""
    words = text.split(" ")
    mid = len(words) // 2 + 1
    if mid < len(words):
        words[mid] = "quite" if words[mid] != "quite" else "rather"
    return " ".join(words)


def demo_ready() -> Ready:
    target = ModelInfo(
        "target",
        "demo-target-1.1B",
        "demo/target",
        "cpu",
        "float32",
        "none",
        1_100_000_000,
        4_400_000_000,
        45_056,
        22,
        2048,
    )
    draft = ModelInfo(
        "draft",
        "demo-draft-68M",
        "demo/draft",
        "cpu",
        "float32",
        "none",
        68_000_000,
        272_000_000,
        6_144,
        2,
        2048,
    )
    return Ready(
        "demo-target-1.1B + demo-draft-68M (synthetic trace)", target, draft, load_seconds=3.2
    )


def synthesize_trace(
    *,
    replies: Sequence[str] = DEMO_REPLIES,
    modes: Sequence[Mode] = (Mode.SPEC,),
    seed: int = 0,
    with_preamble: bool = True,
) -> list[Any]:
    """A multi-turn trace: each reply recorded once per mode (early exit made lossy)."""
    events: list[Any] = []
    if with_preamble:
        total = 4_672_000_000
        for done in (0, total // 4, total // 2, total):
            events.append(LoadProgress("fetch", done, total, "B", "demo-target-1.1B"))
        events.append(LoadProgress("load", 2, 2, "", "target and draft"))
        events.append(demo_ready())
    t0 = 1000.0
    for turn, reply in enumerate(replies, 1):
        for mode in modes:
            text = _lossy(reply) if mode is Mode.EARLY_EXIT else reply
            turn_events = synthesize_turn(text, mode=mode, turn=turn, seed=seed, t0=t0)
            events.extend(turn_events)
            t0 += 100.0
    return events


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specchat.engine.tools.replay", description="Write a synthetic demo trace."
    )
    p.add_argument("out", help="JSONL file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes",
        default="spec,plain,early-exit,self-spec",
        help="comma-separated modes recorded for each reply",
    )
    args = p.parse_args(argv)
    modes = [Mode(m.strip()) for m in args.modes.split(",") if m.strip()]
    write_trace(args.out, synthesize_trace(modes=modes, seed=args.seed))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
