"""A/B quality protocol: does mode B produce what mode A produces?

Greedy (temperature 0), per prompt, same seed, each run from a fresh
conversation with empty caches:

- token-identical or not;
- at the first divergence, the target's own view of the common prefix: one
  full forward pass (no KV cache) over prompt + common prefix gives the
  logits there; the margin between its two top tokens tells numerics from a
  bug. A near-tie (margin under `tie_threshold`) is a rounding question that
  batched verification and single-token steps may answer differently where
  the target is not batch-invariant (below); a wide margin means one mode did
  not emit the target's token, which for a lossless mode is a bug;
- agreement: the fraction of each run's tokens that equal the full target's
  greedy choice given that run's own prefix (teacher forcing, one forward
  pass per run). Lossless modes score 1 up to near-ties; for early exit
  (lossy by design) it is the quality figure (CALM's consistency with the
  full model, Schuster et al. 2022).

Where the two must be token-identical: greedy plain, spec, self-spec and
lookup against each other when the target's logits are batch-invariant (the
runner's `exactness`, engine/model/invariance.py: on the CPU, Llama/Qwen2, float32,
bfloat16 or w4a8/w8a8/int8/int4, native decoder or transformers' modules).
There any divergence is a bug, near-tie or not. Elsewhere (CUDA, other
architectures, transformers' generate as a baseline) speculation is exact in
distribution and equal to plain up to floating-point ties: a divergence at a
near-tie is numerics. The report says which holds and why, and gives the
target's top-2 margin at every divergence.

Sampled decoding cannot be compared token by token. `distribution_check`
compares the empirical distribution of the first `n_tokens` tokens over many
seeds: a chi-square homogeneity test at significance `alpha` (a correct
sampler fails it with probability alpha) and the total variation distance.
Speculative sampling must reproduce the target distribution exactly
(Leviathan et al. 2023; Chen et al. 2023), so spec vs plain must pass.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import DecodeConfig, Mode
from ..events import TokenEvent, TurnFinished
from ..metrics import first_divergence
from ..model.invariance import TIES
from .bench import environment, model_record
from .bench_runs import (
    BASELINES,
    SESSION_ARMS,
    BenchPrompt,
    Memory,
    RunRecord,
    arm_config,
    fresh_conversation,
    run_hf_arm,
    run_session_arm,
)
from .bench_stats import chi_square_homogeneity, total_variation

if TYPE_CHECKING:
    from ..decode.session import ChatSession

LOSSY = frozenset({Mode.EARLY_EXIT.value})

# Logit margins below which a divergence counts as numerics. float32 rounding
# moves logits by ~1e-5 relative (1e-4 absolute at typical magnitudes), so
# 0.01 is generous yet far below the margins of real choices; bfloat16 keeps
# 8 mantissa bits (0.4% relative: ~0.1 on a logit of 20, more after many
# layers), and weight quantization perturbs logits at least as much.
TIE_THRESHOLDS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.5}
QUANTIZED_TIE_THRESHOLD = 0.5


def default_tie_threshold(session: ChatSession) -> float:
    info = session.target.info
    if info.quant != "none":
        return QUANTIZED_TIE_THRESHOLD
    return TIE_THRESHOLDS.get(info.dtype, 0.5)


@dataclass(slots=True)
class Comparison:
    """A against B on one prompt."""

    prompt_id: str
    kind: str
    status: str  # "identical" | "diverged" | "unavailable" | "failed"
    tokens_a: list[int] = field(default_factory=list)
    tokens_b: list[int] = field(default_factory=list)
    text_a: str = ""
    text_b: str = ""
    first_divergence: int | None = None
    token_a: int | None = None  # A's token at the divergence (None: A had stopped)
    token_b: int | None = None
    top1: int | None = None  # the target's top two tokens after the common prefix
    top2: int | None = None
    top2_margin: float | None = None  # logit(top1) - logit(top2)
    ab_margin: float | None = None  # logit(token_a) - logit(token_b)
    verdict: str = ""
    agreement_a: float | None = None  # teacher-forced agreement with the full target
    agreement_b: float | None = None
    error: str | None = None


@dataclass(slots=True)
class DistributionCheck:
    """Sampled A vs sampled B over many seeds, on the first `n_tokens` tokens."""

    prompt_id: str
    a: str
    b: str
    seeds: int
    n_tokens: int
    temperature: float
    top_k: int
    top_p: float
    alpha: float
    counts_a: dict[str, int]
    counts_b: dict[str, int]
    labels: dict[str, str]  # category -> decoded text
    total_variation: float
    chi2: float
    dof: int
    p_value: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha


@dataclass(slots=True)
class ABResult:
    a: str
    b: str
    config: dict[str, Any]
    models: dict[str, Any]
    environment: dict[str, Any]
    tie_threshold: float
    comparisons: list[Comparison]
    distribution: DistributionCheck | None = None
    seconds: float = 0.0
    identity: bool = False  # greedy A and B must be token-identical here (by design)
    identity_reason: str = ""  # where and why, or why only up to floating-point ties

    @property
    def lossless(self) -> bool:
        return self.a not in LOSSY and self.b not in LOSSY

    def counts(self) -> dict[str, int]:
        c = Counter(x.verdict for x in self.comparisons)
        return dict(c)

    @property
    def ok(self) -> bool:
        """Every prompt compared, no unexplained divergence, no failed distribution check."""
        bad = {"failed", "unavailable"}
        if self.lossless and self.config["greedy"]:
            bad |= {"wide margin", "length differs"}
        if self.identity:  # no ties to break differently: any divergence is a bug
            bad |= {"near-tie"}
        if any(c.verdict in bad for c in self.comparisons):
            return False
        return self.distribution is None or self.distribution.passed

    def to_dict(self) -> dict[str, Any]:
        comps = [asdict(c) for c in self.comparisons]
        agree_b = [c.agreement_b for c in self.comparisons if c.agreement_b is not None]
        dist = None
        if self.distribution is not None:
            dist = asdict(self.distribution)
            dist["passed"] = self.distribution.passed
        return {
            "a": self.a,
            "b": self.b,
            "lossless": self.lossless,
            "ok": self.ok,
            "config": self.config,
            "models": self.models,
            "environment": self.environment,
            "tie_threshold": self.tie_threshold,
            "identity": {"guaranteed": self.identity, "reason": self.identity_reason},
            "verdicts": self.counts(),
            "identical": sum(c.status == "identical" for c in self.comparisons),
            "compared": sum(c.status in ("identical", "diverged") for c in self.comparisons),
            "mean_agreement_b": sum(agree_b) / len(agree_b) if agree_b else None,
            "comparisons": comps,
            "distribution": dist,
            "seconds": self.seconds,
        }

    def write_json(self, path: str | Path) -> Path:
        import json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def identity(session: ChatSession, a: str, b: str, greedy: bool) -> tuple[bool, str]:
    """Whether greedy A and B must be token-identical on this session, and the sentence why."""
    if not greedy:
        return False, "sampled decoding: compared in distribution, not token by token"
    for arm in (a, b):
        if arm in LOSSY:
            return False, f"{arm} is lossy by design"
        if arm in BASELINES:
            return False, (
                f"{TIES}: {arm} runs transformers' own generate, whose passes are not "
                "batch-invariant"
            )
    exactness = getattr(getattr(session, "target_runner", None), "exactness", None)
    if exactness is None:
        return False, f"{TIES}: this session does not say whether its target is batch-invariant"
    return exactness.identical, exactness.reason


def _check_arm(arm: str) -> None:
    if arm not in SESSION_ARMS and arm not in BASELINES:
        raise ValueError(f"unknown mode {arm!r}; choose from {SESSION_ARMS + BASELINES}")


def _run(
    session: ChatSession,
    p: BenchPrompt,
    arm: str,
    cfg: DecodeConfig,
    system: str | None,
    memory: Memory,
) -> RunRecord:
    fresh_conversation(session, p, system)
    rec = RunRecord(arm, p.id, p.kind, 0, 0, 0)
    if arm in BASELINES:
        return run_hf_arm(session, p, arm, cfg, rec, memory, cfg.seed)
    return run_session_arm(session, p, arm, cfg, rec, memory)


@torch.inference_mode()
def target_logits(session: ChatSession, ids: Sequence[int]) -> torch.Tensor:
    """The target's logits [len(ids), V] in float32, one full pass without a cache."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=session.target.device)
    out = session.target.model(input_ids=x, use_cache=False)
    return out.logits[0].float()


def agreement(logits: torch.Tensor, prompt_len: int, tokens: Sequence[int]) -> float | None:
    """Fraction of `tokens` equal to the target's argmax given their own prefix.

    `logits` [prompt_len + len(tokens) (- 1), V] come from prompt + tokens.
    """
    if not tokens:
        return None
    rows = logits[prompt_len - 1 : prompt_len - 1 + len(tokens)]  # [T, V]
    chosen = torch.argmax(rows, dim=-1).tolist()
    return sum(int(c == t) for c, t in zip(chosen, tokens, strict=False)) / len(tokens)


def compare(
    session: ChatSession,
    prompt_ids: list[int],
    ra: RunRecord,
    rb: RunRecord,
    tie_threshold: float,
    lossy: bool,
) -> Comparison:
    c = Comparison(ra.prompt_id, ra.kind, "diverged", ra.tokens, rb.tokens, ra.text, rb.text)
    for r in (ra, rb):
        if not r.ok:
            c.status, c.verdict, c.error = r.status, r.status, f"{r.arm}: {r.error}"
            return c
    n = len(prompt_ids)
    logits_a = target_logits(session, prompt_ids + ra.tokens)  # [n + Ta, V]
    logits_b = target_logits(session, prompt_ids + rb.tokens)
    c.agreement_a = agreement(logits_a, n, ra.tokens)
    c.agreement_b = agreement(logits_b, n, rb.tokens)
    d = first_divergence(ra.tokens, rb.tokens)
    if d is None:
        c.status = c.verdict = "identical"
        return c
    c.first_divergence = d
    c.token_a = ra.tokens[d] if d < len(ra.tokens) else None
    c.token_b = rb.tokens[d] if d < len(rb.tokens) else None
    row = logits_b[n - 1 + d] if c.token_b is not None else logits_a[n - 1 + d]  # [V]
    top = torch.topk(row, 2)
    c.top1, c.top2 = int(top.indices[0]), int(top.indices[1])
    c.top2_margin = float(top.values[0] - top.values[1])
    if c.token_a is not None and c.token_b is not None:
        c.ab_margin = float(row[c.token_a] - row[c.token_b])
    if lossy:
        c.verdict = "lossy (expected)"
    elif c.token_a is None or c.token_b is None:
        c.verdict = "length differs"
    elif c.top2_margin <= tie_threshold and {c.token_a, c.token_b} <= {c.top1, c.top2}:
        c.verdict = "near-tie"
    else:
        c.verdict = "wide margin"
    return c


def run_ab(
    session: ChatSession,
    prompts: Sequence[BenchPrompt],
    a: str,
    b: str,
    *,
    config: DecodeConfig | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
    tie_threshold: float | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ABResult:
    """Run A and B on every prompt (same seed) and compare them token by token."""
    _check_arm(a)
    _check_arm(b)
    cfg = (config or DecodeConfig()).with_(stop=(), seed=seed)
    if max_new_tokens is not None:
        cfg = cfg.with_(max_new_tokens=max_new_tokens)
    tie = default_tie_threshold(session) if tie_threshold is None else tie_threshold
    same, why = identity(session, a, b, cfg.greedy)
    memory = Memory(session.target.device)
    system = session.system_prompt
    lossy = a in LOSSY or b in LOSSY
    t0 = time.perf_counter()
    comps: list[Comparison] = []
    try:
        for i, p in enumerate(prompts):
            if progress:
                progress(i, len(prompts), p.id)
            ra = _run(session, p, a, cfg, system, memory)
            rb = _run(session, p, b, cfg, system, memory)
            fresh_conversation(session, p, system)
            prompt_ids = session.render(p.messages)
            comps.append(compare(session, prompt_ids, ra, rb, tie, lossy))
        if progress:
            progress(len(prompts), len(prompts), "")
    finally:
        session.system_prompt = system
        session.reset()
    return ABResult(
        a=a,
        b=b,
        config={
            "prompts": [p.id for p in prompts],
            "seed": seed,
            "greedy": cfg.greedy,
            "decode": {
                k: (v.value if isinstance(v, Mode) else v)
                for k, v in asdict(cfg).items()
                if k != "mode"
            },
        },
        models=model_record(session),
        environment=environment(session),
        tie_threshold=tie,
        comparisons=comps,
        seconds=time.perf_counter() - t0,
        identity=same,
        identity_reason=why,
    )


def _first_tokens(
    session: ChatSession, prompt: BenchPrompt, cfg: DecodeConfig, n_tokens: int
) -> tuple[int, ...]:
    """The first n_tokens of one sampled reply, or an error if the mode did not run."""
    out: list[int] = []
    session.reset(prompt.history)
    for ev in session.stream(prompt.prompt, cfg.with_(max_new_tokens=n_tokens)):
        if isinstance(ev, TokenEvent):
            out.append(ev.token_id)
        elif isinstance(ev, TurnFinished) and ev.stats.mode is not cfg.mode:
            raise ValueError(f"mode {cfg.mode.value} is not available: {ev.stats.mode.value} ran")
    return tuple(out)


def distribution_check(
    session: ChatSession,
    prompt: BenchPrompt,
    a: str = "plain",
    b: str = "spec",
    *,
    seeds: int = 200,
    n_tokens: int = 2,
    config: DecodeConfig | None = None,
    alpha: float = 0.01,
    first_seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
) -> DistributionCheck:
    """Compare sampled A and B on the first n_tokens tokens over `seeds` seeds each.

    Runs alternate A, B with the same seed. The session's cached prefix is
    reused between runs (the prompt is the same; correctness does not depend
    on it). `config` must sample (temperature > 0; default 1.0).
    """
    for arm in (a, b):
        if arm not in SESSION_ARMS:
            raise ValueError(f"the distribution check runs session modes, not {arm!r}")
    cfg = (config or DecodeConfig(temperature=1.0)).with_(stop=())
    if cfg.greedy:
        raise ValueError("the distribution check needs temperature > 0")
    if seeds < 2:
        raise ValueError("seeds must be >= 2")
    system = session.system_prompt
    if prompt.system is not None:
        session.system_prompt = prompt.system
    counts: dict[str, Counter[tuple[int, ...]]] = {a: Counter(), b: Counter()}
    t0 = time.perf_counter()
    try:
        for s in range(first_seed, first_seed + seeds):
            if progress:
                progress(s - first_seed, seeds, prompt.id)
            for arm in (a, b):
                run_cfg = arm_config(arm, cfg).with_(seed=s)
                counts[arm][_first_tokens(session, prompt, run_cfg, n_tokens)] += 1
    finally:
        session.system_prompt = system
        session.reset()
    ca, cb = counts[a], counts[b]
    stat, dof, p = chi_square_homogeneity(ca, cb)

    def key(t: tuple[int, ...]) -> str:
        return " ".join(str(i) for i in t)

    labels = {key(t): session.tokenizer.decode(list(t)) for t in set(ca) | set(cb)}
    return DistributionCheck(
        prompt_id=prompt.id,
        a=a,
        b=b,
        seeds=seeds,
        n_tokens=n_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        alpha=alpha,
        counts_a={key(t): n for t, n in ca.most_common()},
        counts_b={key(t): n for t, n in cb.most_common()},
        labels=labels,
        total_variation=total_variation(ca, cb),
        chi2=stat,
        dof=dof,
        p_value=p,
        seconds=time.perf_counter() - t0,
    )
