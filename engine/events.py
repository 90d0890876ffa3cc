"""The engine -> UI contract.

Events are frozen, slotted dataclasses holding only str, int, float, bool,
None, enums, tuples, and other such event records: no tensors, no UI types.
They cross threads cheaply, tests compare them with `==`, and every event
round-trips through JSON (`to_dict` / `from_dict`), which is how
`specchat generate --json` writes a trace and how a trace is replayed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, Union

from .config import Mode


class Provenance(StrEnum):
    """Where an emitted token came from."""

    ACCEPTED = "accepted"  # a draft token the target accepted
    CORRECTED = "corrected"  # the target's token after it refused a draft token
    BONUS = "bonus"  # the target's extra token when all K drafts were accepted
    EARLY_EXIT = "early-exit"  # the target stopped at an intermediate layer
    TARGET = "target"  # plain target decoding
    REMOTE = "remote"  # a served engine's token: its API does not say which were drafted


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One emitted token.

    `text` is what this token adds to the reply; it may be "" while a
    multi-byte character is incomplete (the next token then carries it).
    `p_target` / `p_draft` are the probabilities of the emitted token under
    each model's (temperature/top-k/top-p processed) distribution; None where
    not computed.
    """

    token_id: int
    text: str
    provenance: Provenance
    round: int
    position: int | None = None  # index in the draft block
    p_target: float | None = None
    p_draft: float | None = None
    exit_layer: int | None = None  # EARLY_EXIT only
    confidence: float | None = None  # EARLY_EXIT only
    # CORRECTED: the refused draft token; ACCEPTED from a tree's second guess: the first
    # guess, the chain's, which the target refused
    rejected_id: int | None = None
    rejected_text: str | None = None
    t: float = 0.0  # time.perf_counter() at emission
    # A served engine's most likely tokens at this step, (text, probability), best first,
    # where it returned logprobs; token_id is -1 where the server gives no id (vLLM, SGLang).
    alternatives: tuple[tuple[str, float], ...] = ()
    # ACCEPTED in a draft tree's round: which of the draft's guesses at its depth the
    # target took (1 its first, the chain's; 2 its second, beside the chain); else None.
    draft_rank: int | None = None


@dataclass(frozen=True, slots=True)
class RoundEvent:
    """One decoding round: sent after the round's TokenEvents.

    For plain and early-exit rounds `k` is 0 and `draft_ms` is 0;
    `verify_ms` is then the target's step time. For a served engine (Mode.REMOTE)
    a round is one chunk of its stream: `k` 0, `verify_ms` the gap since the
    previous chunk; its acceptance comes in `ServerStats`.
    """

    round: int
    mode: Mode
    k: int
    accepted: int
    draft_ms: float
    verify_ms: float
    fallback_reason: str | None = None  # set when the controller changed mode or K
    next_mode: Mode | None = None  # the mode the controller chose for the next round
    next_k: int | None = None
    # One plain target step as the controller measures it (speculative modes): the
    # unit in which the draft cost c and the verify cost v are stated.
    target_step_ms: float | None = None
    # Which drafter proposed this round's drafts ("lookup", the draft model's name,
    # "self-spec E=7"); None for a round without drafts.
    drafter: str | None = None
    # A draft tree's round: the draft's other guesses verified beside its k drafts
    # (engine/decode/tree.py); 0 for a chain.
    siblings: int = 0
    # The draft reading what it missed (a copy's tokens, a plain stretch) before this
    # round's drafts: a pass outside draft_ms; 0 when it had nothing to read.
    catch_up_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class ServerStats:
    """What a served engine says of its speculative decoding during one reply.

    Counts are the reply's own where the server reports them per request
    (`source` "timings": llama.cpp's server), else the growth of its metrics
    counters since the reply started (`source` "metrics"), which counts other
    requests too when they ran meanwhile (`scope` "server-wide"). None: the server
    does not expose that figure. `speculative` False: the server decodes without
    drafts (it said so); None: it does not say.
    """

    kind: str  # "vllm" | "sglang" | "llama.cpp" | "openai" (an unknown OpenAI-compatible server)
    source: str  # "timings" | "metrics" | "none"
    scope: str = "reply"  # "reply" | "server-wide"
    speculative: bool | None = None
    drafts: int | None = None  # verification steps that checked drafts
    draft_tokens: int | None = None
    accepted: int | None = None
    accepted_per_position: tuple[int, ...] = ()  # accepted tokens at draft position 1, 2, ...
    accept_length: float | None = None  # the server's own mean accepted length (SGLang's gauge)
    accept_rate: float | None = None  # the server's own acceptance rate (SGLang's gauge)
    kv_cache_usage: float | None = None  # 0..1 of the server's KV cache
    running: int | None = None  # requests the server was decoding at the last sample
    final: bool = False  # taken after the reply ended
    t: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_tokens or self.accepted is None:
            return self.accept_rate
        return self.accepted / self.draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification step: the accepted drafts plus the target's own token."""
        if self.drafts and self.accepted is not None:
            return 1.0 + self.accepted / self.drafts
        return self.accept_length

    def by_position(self) -> list[float]:
        """Share of the drafts whose token at position i was accepted, as vLLM and
        llama.cpp state it (accepted at i / drafts). Not the chat's conditional rate:
        a server's drafts vary in length, and how many reached position i it does not say."""
        if not self.accepted_per_position or not self.drafts:
            return []
        return [n / self.drafts for n in self.accepted_per_position]


@dataclass(frozen=True, slots=True)
class SystemSample:
    """A CPU/GPU sample; None means not available on this machine."""

    cpu_percent_per_core: tuple[float, ...]
    process_cpu_percent: float
    rss_bytes: int
    gpu_util_percent: float | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    gpu_name: str | None = None
    draft_device: str | None = None
    target_device: str | None = None
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """Progress of a load stage (fetch, join, verify, convert, load, ...)."""

    stage: str
    done: int
    total: int | None = None  # None: unknown
    unit: str = ""  # "B" for bytes, "" for steps
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What was loaded for one role (target or draft)."""

    role: str  # "target" | "draft"
    name: str
    source: str
    device: str
    dtype: str
    quant: str
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    layers: int
    context_length: int


@dataclass(frozen=True, slots=True)
class Ready:
    """Models are loaded; the session can take a prompt."""

    summary: str
    target: ModelInfo
    draft: ModelInfo | None = None
    chat_template: bool = True
    load_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    draft_head: str | None = None  # the draft head --mode eagle drafts with (None: no head)
    server: str | None = None  # a served engine's kind and URL ("llama.cpp http://…"); None: local


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the user should know that is not an error (a policy applied)."""

    message: str
    level: str = "info"  # "info" | "warning"


@dataclass(frozen=True, slots=True)
class TurnStarted:
    turn: int
    prompt_tokens: int  # whole conversation as the model sees it
    new_prompt_tokens: int  # the part that had to be prefilled
    mode: Mode
    prefill_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TurnStats:
    """Trace attributes of one reply."""

    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_s: float  # prompt submitted -> first token emitted
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float | None  # accepted / drafted; None without drafts
    mean_accepted_length: float | None  # tokens emitted per speculative round
    mode: Mode
    optimizations: tuple[str, ...]
    fallbacks: tuple[str, ...]
    stop_reason: str  # "eos" | "max_tokens" | "stop_string" | "context" | "cancelled"
    text: str
    early_exits: int = 0
    mean_layers: float | None = None  # average target layers executed per token
    server: ServerStats | None = None  # a served engine's figures for this reply (Mode.REMOTE)


@dataclass(frozen=True, slots=True)
class TurnFinished:
    stats: TurnStats


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The reply was cancelled; what was produced so far stays in the conversation."""

    tokens: int
    text: str = ""


@dataclass(frozen=True, slots=True)
class Failed:
    """Something went wrong; `hint` says what the user can do about it."""

    message: str
    hint: str = ""


Event = Union[  # noqa: UP007 - a runtime union, used by from_dict
    TokenEvent,
    RoundEvent,
    ServerStats,
    SystemSample,
    LoadProgress,
    Ready,
    Notice,
    TurnStarted,
    TurnFinished,
    Cancelled,
    Failed,
]

_EVENT_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (*typing.get_args(Event), ModelInfo, TurnStats)
}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def to_dict(event: Any) -> dict[str, Any]:
    """A JSON-ready dict with a "type" key naming the event class."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in dataclasses.fields(event):
        out[f.name] = _plain(getattr(event, f.name))
    return out


def _revive(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _revive(args[0], value) if len(args) == 1 else value
    if origin is tuple:
        (inner, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_revive(inner, v) for v in value)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(value)
    if isinstance(value, dict) and "type" in value:
        return from_dict(value)
    return value


def from_dict(data: dict[str, Any]) -> Any:
    """Inverse of `to_dict`."""
    cls = _EVENT_TYPES[data["type"]]
    hints = typing.get_type_hints(cls)
    kwargs = {
        f.name: _revive(hints[f.name], data[f.name])
        for f in dataclasses.fields(cls)
        if f.name in data
    }
    return cls(**kwargs)
