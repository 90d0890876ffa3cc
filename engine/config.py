"""Frozen configuration for loading models and decoding.

Every choice is explicit: the quantization mode is an enum, never guessed
from a file name; the decode mode is an enum the controller may change only
with a stated reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum


class Mode(StrEnum):
    """How the next tokens are produced."""

    PLAIN = "plain"  # target alone, one token per forward pass
    SPEC = "spec"  # draft model proposes K tokens, target verifies them in one pass
    SELF_SPEC = "self-spec"  # the target's own first E layers draft, the full target verifies
    EARLY_EXIT = "early-exit"  # target alone, may stop at an intermediate layer (lossy)
    LOOKUP = "lookup"  # drafts copied from earlier in the conversation (n-gram match), no draft model
    EAGLE = "eagle"  # a trained head on the target's own hidden states drafts (EAGLE-3), the target verifies
    REMOTE = "remote"  # a served engine decodes, speculating as it was started to (engine/remote)


LOCAL_MODES = tuple(m for m in Mode if m is not Mode.REMOTE)  # what the local engine runs


SPECULATIVE_MODES = frozenset({Mode.SPEC, Mode.SELF_SPEC, Mode.LOOKUP, Mode.EAGLE})  # draft, then verify

# The bench's names for spec with one of its parts turned off: the DecodeConfig fields.
SPEC_VARIANTS: dict[str, dict[str, object]] = {
    "spec-alone": {"compose": False},  # the draft model alone, without lookup first
    "spec-serial": {"ahead": False},  # drafting then verifying in turns, never ahead
    "spec-chain": {"siblings": 0},  # chains of drafts only, never a draft tree
}
SPEC_ALONE, SPEC_SERIAL, SPEC_CHAIN = SPEC_VARIANTS

# The most draft tokens a round verifies. A verify block is the last token plus K
# drafts, and a token scores exactly as it would alone only while the block takes
# the row-wise attention path (engine/model/attention.py, MAX_ROWWISE = 32 rows).
MAX_K = 31


class QuantMode(StrEnum):
    """Weight quantization of one model."""

    NONE = "none"  # bf16 / float16 / float32 as loaded
    BNB_NF4 = "bnb-nf4"  # bitsandbytes 4-bit NormalFloat
    BNB_INT8 = "bnb-int8"  # bitsandbytes LLM.int8()
    INT8 = "int8"  # weight-only int8 (per-channel scales), fast on the CPU
    INT4 = "int4"  # weight-only int4 (grouped scales), CPU
    W8A8 = "w8a8"  # int8 weights and per-token int8 activations (fbgemm), x86 CPUs
    W4A8 = "w4a8"  # int4 weights (groups of 32), int8 activations: own AVX2 kernel, x86 CPUs
    W4A8_G128 = "w4a8-g128"  # the same kernel, a scale and minimum per 128 weights: 15% fewer bytes


W4A8_MODES = frozenset({QuantMode.W4A8, QuantMode.W4A8_G128})  # run by the w4a8 kernel
W4A8_GROUPS = {QuantMode.W4A8: 32, QuantMode.W4A8_G128: 128}  # inputs sharing a weight scale


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one model comes from and how to hold it.

    `source` is a preset name, a Hugging Face model id, a local model folder,
    or a path to a `.gguf` file.
    """

    source: str
    quant: QuantMode | None = QuantMode.NONE  # None: chosen per device (loading.default_quant)
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    head_shortlist: int = 0  # draft only: score the N most frequent token ids (+ specials); 0 = all


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Sampling and speculation settings of one reply.

    temperature 0 means greedy. `k=None` lets the controller choose K within
    [k_min, k_max]; an int forces it.
    """

    mode: Mode = Mode.SPEC
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    k: int | None = None
    k_min: int = 1
    k_max: int = 8
    max_new_tokens: int = 256
    # spec: prompt lookup drafts first, the draft model where it finds nothing
    # (engine/decode/compose.py); False: the draft model alone, for its own acceptance.
    compose: bool = True
    # greedy spec: the draft model drafts on a core of its own while the target verifies,
    # where the load measured that it pays (engine/decode/ahead.py); False: draft, then verify.
    ahead: bool = True
    # spec with the draft model, serial: the draft's second guess verified beside its first
    # at depths 1..siblings, a draft tree (engine/decode/tree.py). None: the controller
    # chooses where the measured costs say it pays; 0: a chain alone.
    siblings: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    # early exit (lossy) and self-speculation (lossless)
    exit_threshold: float | None = None  # None: use the calibrated thresholds
    exit_budget: float = 0.95  # target top-1 agreement kept by calibration
    exit_layer: int | None = None  # self-spec draft depth; None: a quarter of the layers

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.k is not None and not 1 <= self.k <= MAX_K:
            raise ValueError(f"k must be in 1..{MAX_K}, got {self.k}")
        if not 1 <= self.k_min <= self.k_max <= MAX_K:
            raise ValueError(
                f"need 1 <= k_min <= k_max <= {MAX_K}, got {self.k_min}, {self.k_max}"
            )
        if self.siblings is not None and not 0 <= self.siblings <= MAX_K:
            raise ValueError(f"siblings must be in 0..{MAX_K}, got {self.siblings}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes: object) -> DecodeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]
