"""One decoding round: plain, or draft K -> verify K+1 in one target pass -> accept.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the draft
proposes d_1..d_K from its distributions p_draft_i; the target scores all K+1
positions in one forward pass giving p_target_1..p_target_{K+1}. Draft token
d_i is accepted with probability min(1, p_target_i(d_i) / p_draft_i(d_i)); at
the first rejection the target's token is resampled from the normalised
residual max(0, p_target_i - p_draft_i); when all K are accepted, a bonus
token comes from p_target_{K+1}. The emitted tokens are then distributed
exactly as the target's own samples. Greedy decoding (temperature 0) accepts
while the target's argmax equals the draft token, which makes its output
identical to plain greedy decoding.

Both caches are rolled back to the accepted length at the end of the round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .config import DecodeConfig
from .events import Provenance
from .runner import ModelRunner
from .sampling import align_vocab, logits_to_probs, residual, sample, token_probs


@dataclass(slots=True)
class Emitted:
    """A token of a round before it becomes a TokenEvent (no text yet)."""

    token_id: int
    provenance: Provenance
    position: int | None = None
    p_target: float | None = None
    p_draft: float | None = None
    rejected_id: int | None = None
    exit_layer: int | None = None
    confidence: float | None = None


@dataclass(slots=True)
class RoundResult:
    tokens: list[Emitted]
    k: int  # draft tokens proposed (0 for a plain step)
    accepted: int  # draft tokens accepted
    draft_ms: float
    verify_ms: float
    layers_run: list[int] = field(default_factory=list)  # per emitted token, when known


class Drafter(Protocol):
    """Proposes draft tokens; the two-model draft and the self-speculative draft implement it."""

    name: str

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """Draft up to k tokens after seq.

        Returns (ids [n] long, logits [n, V] of the draft at each drafted
        position), n <= k; n = 0 makes the round a plain step.
        """
        ...

    def rollback(self, n: int) -> None:
        """Keep the draft's cache for the first n tokens of the sequence only."""
        ...

    def catch_up(self, seq: list[int]) -> None:
        """Feed what the draft has not seen of seq[:-1] (tokens decoded while not drafting)."""
        ...

    def reset(self) -> None: ...


class ModelDrafter:
    """A separate (smaller) draft model with its own KV cache."""

    def __init__(self, runner: ModelRunner, name: str = "draft") -> None:
        self.runner = runner
        self.name = name

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        rows: list[Tensor] = []
        ids: list[Tensor] = []
        logits = self.runner.forward(seq, keep=1)[-1]  # [V]
        for i in range(k):
            rows.append(logits)
            if cfg.greedy:
                tok = torch.argmax(logits, dim=-1)
            else:
                probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                tok = sample(probs, generator)
            ids.append(tok)
            if i + 1 < k:
                # Token stays on the device: no host sync inside the draft loop.
                logits = self.runner.feed(tok.view(1), keep=1)[-1]
        return torch.stack(ids), torch.stack(rows)  # [k], [k, V]

    def rollback(self, n: int) -> None:
        self.runner.crop_to(n)

    # Pending tokens a round feeds in propose's first pass rather than in catch_up:
    # after a round the draft lacks at most its last draft and the bonus token, and
    # one pass over 2 tokens costs ~1.1 draft steps where two passes cost 2.
    PENDING_IN_PROPOSE = 2

    def catch_up(self, seq: list[int]) -> None:
        """Feed a long stretch the draft missed (plain rounds) before the timed draft."""
        if len(seq) - self.runner.cached > self.PENDING_IN_PROPOSE:
            self.runner.prefill(seq)

    def reset(self) -> None:
        self.runner.reset()


def accept_or_resample(
    p_target: Tensor, p_draft: Tensor, draft_ids: Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """The speculative sampling rule on processed distributions.

    p_target [k+1, V], p_draft [k, V], draft_ids [k]. Returns (n accepted,
    the round's last token): the residual sample at the first rejection, or
    the bonus sample from p_target[k] when all k drafts are accepted.
    """
    k = int(draft_ids.shape[0])
    idx = torch.arange(k, device=draft_ids.device)
    pt = p_target[idx, draft_ids]  # p_target_i(d_i)  [k]
    pd = p_draft[idx, draft_ids]  # p_draft_i(d_i)   [k]
    u = torch.rand(k, device=draft_ids.device, generator=generator)
    accept = (u * pd <= pt).tolist()  # u < min(1, p_target/p_draft); one host sync
    n_acc = accept.index(False) if False in accept else k
    if n_acc < k:
        return n_acc, int(sample(residual(p_target[n_acc], p_draft[n_acc]), generator))
    return k, int(sample(p_target[k], generator))


def _now() -> float:
    return time.perf_counter()


def plain_step(
    target: ModelRunner, seq: list[int], cfg: DecodeConfig, generator: torch.Generator | None
) -> RoundResult:
    """One target forward, one token (Provenance.TARGET)."""
    t0 = _now()
    logits = target.forward(seq, keep=1)[-1]  # [V]
    if cfg.greedy:
        tok = int(torch.argmax(logits))
        p = float(token_probs(logits.view(1, -1), torch.tensor([tok], device=logits.device))[0])
    else:
        probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        tok = int(sample(probs, generator))
        p = float(probs[tok])
    ms = (_now() - t0) * 1e3
    return RoundResult([Emitted(tok, Provenance.TARGET, p_target=p)], 0, 0, 0.0, ms)


def speculative_round(
    target: ModelRunner,
    drafter: Drafter,
    seq: list[int],
    k: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None,
) -> RoundResult:
    """Draft k tokens, verify them in one target pass, accept, roll both caches back."""
    n0 = len(seq)
    # 0. After a stretch of plain rounds the draft has tokens to catch up on: a one-off
    # cost, kept out of draft_ms, which the controller reads as k per-token draft steps
    # (counted in, it made every probe after a plain stretch look too dear to keep).
    drafter.catch_up(seq)
    # 1. Draft: d_1..d_k and the draft's logits at each position.
    t0 = _now()
    draft_ids, draft_logits = drafter.propose(seq, k, cfg, generator)  # [k], [k, Vd]
    k = int(draft_ids.shape[0])  # a lookup draft may find fewer, or none: then a plain step
    t1 = _now()
    # 2. Verify: one target pass over (pending tokens + d_1..d_k), keeping k+1 rows.
    target.crop_to(n0 - 1)
    pending = torch.tensor(seq[target.cached :], dtype=torch.long, device=target.device)
    target_logits = target.feed(torch.cat([pending, draft_ids.to(target.device)]), keep=k + 1)
    draft_logits = align_vocab(draft_logits.to(target_logits.device), target_logits.shape[-1])
    d = draft_ids.to(target_logits.device)
    idx = torch.arange(k, device=d.device)

    # 3. Accept / resample / bonus.
    if cfg.greedy:
        target_argmax = torch.argmax(target_logits, dim=-1)  # [k+1]
        matches = (target_argmax[:k] == d).tolist()  # the round's one host sync
        n_acc = matches.index(False) if False in matches else k
        extra = int(target_argmax[n_acc])
        p_t = token_probs(
            target_logits[: n_acc + 1], torch.cat([d[:n_acc], target_argmax[n_acc : n_acc + 1]])
        )
        p_d_acc = token_probs(draft_logits[:n_acc], d[:n_acc]) if n_acc else None
        p_d_extra = (
            float(token_probs(draft_logits[n_acc : n_acc + 1], target_argmax[n_acc : n_acc + 1])[0])
            if n_acc < k
            else None
        )
    else:
        p_target = logits_to_probs(target_logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [k+1, V]
        p_draft = logits_to_probs(draft_logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [k, V]
        n_acc, extra = accept_or_resample(p_target, p_draft, d, generator)
        p_d_extra = float(p_draft[n_acc, extra]) if n_acc < k else None
        p_t = torch.cat([p_target[idx[:n_acc], d[:n_acc]], p_target[n_acc, extra].view(1)])
        p_d_acc = p_draft[idx[:n_acc], d[:n_acc]] if n_acc else None
    t2 = _now()

    d_list = d[:n_acc].tolist()
    p_t_list = p_t.tolist()
    p_d_list = p_d_acc.tolist() if p_d_acc is not None else []
    tokens = [
        Emitted(tok, Provenance.ACCEPTED, position=i, p_target=p_t_list[i], p_draft=p_d_list[i])
        for i, tok in enumerate(d_list)
    ]
    if n_acc < k:
        tokens.append(
            Emitted(
                extra,
                Provenance.CORRECTED,
                position=n_acc,
                p_target=p_t_list[n_acc],
                p_draft=p_d_extra,
                rejected_id=int(d[n_acc]),
            )
        )
    elif k:
        tokens.append(Emitted(extra, Provenance.BONUS, position=k, p_target=p_t_list[n_acc]))
    else:
        tokens.append(Emitted(extra, Provenance.TARGET, p_target=p_t_list[0]))

    # 4. Roll back to the accepted length: the caches hold seq + accepted drafts;
    # the round's last token is fed at the start of the next round.
    target.crop_to(n0 + n_acc)
    drafter.rollback(n0 + n_acc)
    return RoundResult(tokens, k, n_acc, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
