"""What the panels read: one object, changed only on the UI thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import Ready, SystemSample, TokenEvent
from specchat.engine.metrics import DecodeMetrics, first_divergence


@dataclass(frozen=True)
class ReplyComparison:
    """The chat's A/B (ctrl+r): reply A as decoded against reply B, plain decoding of the
    same prompt (`specchat ab` compares whole prompt sets: engine/tools/ab.py)."""

    a_mode: Mode
    a_tokens: int
    b_tokens: int
    diverge_at: int | None
    a_piece: str  # token text at the divergence ("" past the end)
    b_piece: str
    a_tokens_per_s: float | None
    b_tokens_per_s: float | None

    @property
    def identical(self) -> bool:
        return self.diverge_at is None

    @property
    def agreement(self) -> float:
        """Share of the plain reply reproduced before the first divergence."""
        if self.b_tokens == 0:
            return 1.0
        return 1.0 if self.diverge_at is None else self.diverge_at / self.b_tokens

    @property
    def speedup(self) -> float | None:
        if self.a_tokens_per_s and self.b_tokens_per_s:
            return self.a_tokens_per_s / self.b_tokens_per_s
        return None

    @classmethod
    def compare(
        cls,
        a: Sequence[TokenEvent],
        b: Sequence[TokenEvent],
        *,
        a_mode: Mode,
        a_tokens_per_s: float | None,
        b_tokens_per_s: float | None,
    ) -> ReplyComparison:
        at = first_divergence([t.token_id for t in a], [t.token_id for t in b])
        a_piece = a[at].text if at is not None and at < len(a) else ""
        b_piece = b[at].text if at is not None and at < len(b) else ""
        return cls(a_mode, len(a), len(b), at, a_piece, b_piece, a_tokens_per_s, b_tokens_per_s)


@dataclass
class ChatState:
    metrics: DecodeMetrics = field(default_factory=DecodeMetrics)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    ready: Ready | None = None
    sample: SystemSample | None = None
    ab: ReplyComparison | None = None
    context_tokens: int = 0  # tokens in the KV cache: prompt so far plus the reply streaming
