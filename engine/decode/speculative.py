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

A round asks the host for its results once (one `.tolist()`), whatever K:
acceptance, the correction or bonus token and every probability shown in the
inspector are computed on the device first. A token's logits do not depend on
how many tokens are verified with it only while the block stays on the
row-wise attention path, so K is bounded by `config.MAX_K`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..config import DecodeConfig
from ..events import Provenance, TokenEvent
from ..model.attention import one_thread
from ..model.runner import ModelRunner
from .sampling import (
    align_vocab,
    argmax,
    logits_to_probs,
    residual,
    residual_one_hot,
    sample,
    token_probs,
)
from .tree import add_siblings, chain_prefix, children_of, walk_greedy, walk_sampled


def emitted(token_id: int, provenance: Provenance, **facts: Any) -> TokenEvent:
    """A token of a round: its TokenEvent before the session gives it its text, round and
    time (`facts`: position, p_target, p_draft, exit_layer, confidence, rejected_id)."""
    return TokenEvent(token_id, "", provenance, 0, **facts)


@dataclass(slots=True)
class RoundResult:
    tokens: list[TokenEvent]  # text, round and time filled in by the session
    k: int  # draft tokens proposed (0 for a plain step)
    accepted: int  # draft tokens accepted
    draft_ms: float
    verify_ms: float
    layers_run: list[int] = field(default_factory=list)  # per emitted token, when known
    drafter: str | None = None  # who proposed the drafts (k > 0)
    siblings: int = 0  # a tree's guesses beside the k chain drafts (engine/decode/tree.py)
    off_chain: bool = False  # the accepted path ended on one of them
    guessed: bool = False  # the depth the chain was refused at had one (tried, taken or not)
    catch_up_ms: float = 0.0  # the draft reading what it missed, before the drafts


@dataclass(slots=True)
class Proposal:
    """What a drafter proposes for one round: n <= k tokens and the distributions they came from.

    `logits` None means one-hot drafts (a lookup copies tokens: p_draft is 1 on
    each proposed token). `probs` is the processed distribution the tokens were
    sampled from (sampled decoding), so the round need not compute it again.
    Rows cover the target's vocabulary: ids the target lacks are never drafted.
    """

    ids: Tensor  # [n] long
    logits: Tensor | None = None  # [n, V]
    probs: Tensor | None = None  # [n, V] float32, sampled decoding only
    source: str | None = None  # who proposed them, where a drafter composes several

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])


class Drafter(Protocol):
    """Proposes draft tokens: the draft model, the self-speculative layers, prompt lookup."""

    name: str

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        """Draft up to k tokens after seq; n = 0 makes the round a plain step."""
        ...

    def rollback(self, n: int) -> None:
        """Keep the draft's cache for the first n tokens of the sequence only."""
        ...

    def catch_up(self, seq: list[int]) -> None:
        """Feed what the draft has not seen of seq[:-1] (tokens decoded while not drafting)."""
        ...

    def reset(self) -> None: ...


def draft_chain(
    first: Tensor,
    step: Callable[[Tensor], Tensor],
    k: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None,
    vocab: int | None = None,
) -> Proposal:
    """k tokens drafted one at a time: `first` is the draft's logits [Vd] after seq,
    `step(tok [1])` feeds a drafted token and returns the next logits [Vd].

    Each row is fitted to the target's `vocab` before the token is chosen, so a
    draft with a larger vocabulary samples from the very distribution the
    acceptance test then uses. Tokens stay on the device: no host sync here.
    """
    rows: list[Tensor] = []
    probs: list[Tensor] = []
    ids: list[Tensor] = []
    logits = first
    for i in range(k):
        logits = align_vocab(logits, vocab or logits.shape[-1])  # [V]
        rows.append(logits)
        if cfg.greedy:
            tok = argmax(logits).to(logits.device)
        else:
            with on_logits(logits):
                p = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                tok = sample(p, generator)
            probs.append(p)
        ids.append(tok)
        if i + 1 < k:
            logits = step(tok.view(1))
    return Proposal(torch.stack(ids), torch.stack(rows), torch.stack(probs) if probs else None)


class ModelDrafter:
    """A separate (smaller) draft model with its own KV cache."""

    def __init__(self, runner: ModelRunner, name: str = "draft", vocab: int | None = None) -> None:
        self.runner = runner
        self.name = name
        self.vocab = vocab  # the target's; None: the draft's own

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        first = self.runner.forward(seq, keep=1)[-1]  # [Vd]
        return draft_chain(
            first, lambda tok: self.runner.feed(tok, keep=1)[-1], k, cfg, generator, self.vocab
        )

    def rollback(self, n: int) -> None:
        self.runner.crop_to(n)

    # Pending tokens a round feeds in propose's first pass rather than in catch_up:
    # after a round the draft lacks at most its last draft and the bonus token, and
    # one pass over 2 tokens costs ~1.1 draft steps where two passes cost 2.
    PENDING_IN_PROPOSE = 2
    # Tokens past those that the draft missed (a copy, a short plain stretch) and reads in
    # its first draft pass rather than in a catch-up pass of their own: a pass reads the
    # weights once, and each row adds only its arithmetic (~1.5 ms for the 0.5B on an AMX
    # Xeon, 3.5 on a Zen 3, against ~17 for the pass). Past this a read is a prompt or a
    # long stretch, timed on its own.
    FOLDED_ROWS = 16

    def unread(self, seq: list[int]) -> int:
        """Tokens of seq the draft reads before it drafts, past the two a round leaves (0
        where there are no more): in propose's first pass up to FOLDED_ROWS, else in
        a catch-up pass of their own."""
        missed = len(seq) - self.runner.cached
        return missed - 1 if missed > self.PENDING_IN_PROPOSE else 0

    def folds(self, seq: list[int]) -> bool:
        """Whether what the draft lacks of seq rides in propose's first pass: a short stretch
        (a copy, a few plain rounds) after the draft has read the conversation; a first read
        into an empty cache is a pass of its own, priced at load."""
        return self.runner.cached > 0 and 0 < self.unread(seq) <= self.FOLDED_ROWS

    def catch_up(self, seq: list[int]) -> None:
        """Feed a stretch the draft missed (a prompt, plain rounds, a long copy) before the
        timed draft, unless it folds: a pass reads the draft's weights once, so a copy of 5
        read apart cost a second pass a round (AMX Xeon: a 20-35 ms catch-up before a 20 ms
        first pass)."""
        if self.unread(seq) and not self.folds(seq):
            self.runner.prefill(seq, prompt=True)  # a draft's rows need no step's bits

    def reset(self) -> None:
        self.runner.reset()


def accept_or_resample(
    p_target: Tensor, p_draft: Tensor | None, draft_ids: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """The speculative sampling rule on processed distributions, on the device.

    p_target [k+1, V], p_draft [k, V] (None: one-hot drafts), draft_ids [k].
    Draft token d_i is accepted when u_i * p_draft_i(d_i) < p_target_i(d_i),
    u_i ~ U[0, 1): with probability min(1, p_target/p_draft), and never when
    p_target is 0. Returns (n accepted [] long, the round's last token [] long):
    a sample of the residual norm(max(0, p_target - p_draft)) at the first
    rejection, or of p_target[k] (the bonus) when all k are accepted.
    """
    k = int(draft_ids.shape[0])
    idx = torch.arange(k, device=draft_ids.device)
    pt = p_target[idx, draft_ids]  # p_target_i(d_i)  [k]
    if p_draft is None:  # one-hot: p_draft_i = 1 on d_i, so max(0, p_target - p_draft) drops d_i
        pd = torch.ones_like(pt)
        resid = residual_one_hot(p_target[:k], draft_ids)  # [k, V]
    else:
        pd = p_draft[idx, draft_ids]  # p_draft_i(d_i)  [k]
        resid = residual(p_target[:k], p_draft)  # [k, V]
    u = torch.rand(k, device=draft_ids.device, generator=generator)
    accept = (u * pd < pt).long()  # [k]
    n_acc = torch.cumprod(accept, dim=0).sum()  # accepted prefix length []
    rows = torch.cat([resid, p_target[k:]], dim=0)  # row i: where the round ends at i  [k+1, V]
    last = sample(rows.index_select(0, n_acc.view(1)), generator)[0]  # []
    return n_acc, last


def _now() -> float:
    return time.perf_counter()


# A round's work on its logits (argmax, the chosen tokens' probabilities, sampling) runs
# torch's ops on one thread up to this many values, 13 rows of a 152k vocabulary: above
# 32,768 values torch splits an op over its threads, and waking a sleeping worker
# (OMP_WAIT_POLICY=PASSIVE) cost more than the op (a 152k-value logsumexp: 560 us on two
# threads, 222 on one; Zen 3, docs/performance.md, step 39). Which thread computes a value
# does not change it.
ONE_THREAD_LOGITS = 1 << 21


def on_logits(logits: Tensor) -> AbstractContextManager[None]:
    """One torch thread for the work on these logits where that is cheaper (CPU, few rows)."""
    return one_thread(logits.device.type == "cpu" and logits.numel() <= ONE_THREAD_LOGITS)


def plain_step(
    target: ModelRunner, seq: list[int], cfg: DecodeConfig, generator: torch.Generator | None
) -> RoundResult:
    """One target forward, one token (Provenance.TARGET)."""
    t0 = _now()
    logits = target.forward(seq, keep=1)[-1]  # [V]
    with on_logits(logits):
        if cfg.greedy:
            tok_t = argmax(logits).to(logits.device)
            p_t = token_probs(logits.view(1, -1), tok_t.view(1))[0]
        else:
            probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            tok_t = sample(probs, generator)
            p_t = probs[tok_t]
        tok, p = torch.stack([tok_t.double(), p_t.double()]).tolist()  # one host sync
    ms = (_now() - t0) * 1e3
    return RoundResult([emitted(int(tok), Provenance.TARGET, p_target=p)], 0, 0, 0.0, ms)


def speculative_round(
    target: ModelRunner,
    drafter: Drafter,
    seq: list[int],
    k: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None,
    siblings: int = 0,
) -> RoundResult:
    """Draft k tokens, verify them in one target pass, accept, roll both caches back.

    `siblings` > 0: the draft's next guesses at depths 1..siblings are verified beside
    the chain, a draft tree (tree.py), where the drafter gave its distributions and
    the target can score a tree."""
    n0 = len(seq)
    # 0. After a stretch of plain rounds or a copy the draft has tokens to catch up on:
    # timed apart from draft_ms, which the controller reads as k per-token draft steps
    # (counted in, it made every probe after a plain stretch look too dear to keep).
    tc = _now()
    drafter.catch_up(seq)
    # 1. Draft: d_1..d_k and the draft's distribution at each position.
    t0 = _now()
    catch_up_ms = (t0 - tc) * 1e3
    prop = drafter.propose(seq, k, cfg, generator)
    k = prop.n  # a lookup draft may find fewer, or none: then a plain step
    tree = None
    if siblings and k and prop.logits is not None:
        tree = add_siblings(prop.ids, prop.logits, prop.probs, siblings, cfg, generator)
    t1 = _now()
    # 2. Verify: one target pass over (the last token + d_1..d_k), keeping k+1 rows.
    target.prefill(seq)  # the cache holds seq[:-1]
    if tree is not None and len(tree[3]) > k and target.takes_tree(len(tree[3]) + 1):
        ids, logits, probs, parents = tree
        res = _tree_round(
            target, drafter, seq, Proposal(ids, logits, probs, prop.source), parents, k, cfg,
            generator, (t0, t1),
        )
        res.catch_up_ms = catch_up_ms
        return res
    d = prop.ids.to(target.device)  # [k]
    block = torch.cat([torch.tensor(seq[-1:], dtype=torch.long, device=target.device), d])
    target_logits = target.feed(block, keep=k + 1)  # [k+1, V]
    vocab = target_logits.shape[-1]
    dev = target_logits.device
    positions = torch.arange(k + 1, device=dev)

    # 3. Accept / resample / bonus, all on the device.
    with on_logits(target_logits):
        draft_logits = (
            align_vocab(prop.logits.to(dev), vocab) if prop.logits is not None else None
        )  # [k, V]
        if cfg.greedy:
            target_argmax = argmax(target_logits).to(dev)  # [k+1]
            n_acc = torch.cumprod((target_argmax[:k] == d).long(), dim=0).sum()  # []
            last = target_argmax.index_select(0, n_acc.view(1))[0]
            p_target_rows = None
        else:
            p_target_rows = logits_to_probs(target_logits, cfg.temperature, cfg.top_k, cfg.top_p)
            p_draft_rows = _draft_probs(prop, draft_logits, cfg)
            n_acc, last = accept_or_resample(p_target_rows, p_draft_rows, d, generator)
        # The emitted chain: d_1..d_n, then the correction or bonus at position n.
        chain = torch.where(positions < n_acc, torch.cat([d, d.new_zeros(1)]), last)  # [k+1]
        if p_target_rows is None:
            p_t = token_probs(target_logits, chain)  # [k+1]
        else:
            p_t = p_target_rows[positions, chain]
        if draft_logits is None:
            p_d = (chain[:k] == d).double()  # one-hot: 1 on the drafted token
        elif cfg.greedy:
            p_d = token_probs(draft_logits, chain[:k]).double()
        else:
            assert p_draft_rows is not None
            p_d = p_draft_rows[positions[:k], chain[:k]].double()
        packed = torch.cat(  # the round's one host sync
            [n_acc.view(1).double(), chain.double(), p_t.double(), p_d, d.double()]
        ).tolist()
    t2 = _now()

    n = int(packed[0])
    tokens = _round_tokens(packed, k)

    # 4. Roll back to the accepted length: the caches hold seq + accepted drafts;
    # the round's last token is fed at the start of the next round.
    target.crop_to(n0 + n)
    drafter.rollback(n0 + n)
    source = (prop.source or drafter.name) if k else None
    return RoundResult(
        tokens, k, n, (t1 - t0) * 1e3, (t2 - t1) * 1e3, drafter=source, catch_up_ms=catch_up_ms
    )


def _draft_probs(prop: Proposal, draft_logits: Tensor | None, cfg: DecodeConfig) -> Tensor | None:
    """The processed distributions the drafts were sampled from [n, V] (on the logits'
    device), or None for one-hot drafts."""
    if prop.probs is not None:
        return prop.probs.to(draft_logits.device if draft_logits is not None else prop.probs.device)
    if draft_logits is None:
        return None
    return logits_to_probs(draft_logits, cfg.temperature, cfg.top_k, cfg.top_p)


def _tree_round(
    target: ModelRunner,
    drafter: Drafter,
    seq: list[int],
    prop: Proposal,
    parents: tuple[int, ...],
    k: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None,
    times: tuple[float, float],
) -> RoundResult:
    """Verify a draft tree (nodes 0..k-1 the chain, then the guesses beside it) in one
    target pass, walk it (tree.py), keep the accepted path in the target's cache.

    The walk reads the host once (the target's argmax, or the sampled coin flips), and
    the emitted tokens' probabilities once more."""
    n0 = len(seq)
    dev = target.device
    d = prop.ids.to(dev)  # [n]
    block = torch.cat([torch.tensor(seq[-1:], dtype=torch.long, device=dev), d])
    target_logits = target.feed_tree(block, (-1, *(p + 1 for p in parents)))  # [n+1, V]
    assert prop.logits is not None
    draft_logits = align_vocab(prop.logits.to(dev), target_logits.shape[-1])  # [n, V]
    with on_logits(target_logits):
        ids = d.tolist()
        p_target_rows = p_draft_rows = None
        if cfg.greedy:
            walk = walk_greedy(argmax(target_logits).tolist(), ids, parents)
        else:
            p_target_rows = logits_to_probs(target_logits, cfg.temperature, cfg.top_k, cfg.top_p)
            p_draft_rows = _draft_probs(prop, draft_logits, cfg)
            assert p_draft_rows is not None
            walk = walk_sampled(p_target_rows, p_draft_rows, ids, parents, generator)
        path = walk.path
        rows = [0] + [c + 1 for c in path]  # the block rows kept; row j scored emitted token j
        chain = torch.tensor([ids[c] for c in path] + [walk.last], dtype=torch.long, device=dev)
        at = torch.tensor(rows, dtype=torch.long, device=dev)
        nodes = at[1:] - 1
        if p_target_rows is None:
            p_t = token_probs(target_logits[at], chain)
            p_d = token_probs(draft_logits[nodes], chain[:-1]) if path else chain.new_zeros(0)
        else:
            assert p_draft_rows is not None
            p_t = p_target_rows[at, chain]
            p_d = p_draft_rows[nodes, chain[:-1]]
        packed = torch.cat([p_t.double(), p_d.double()]).tolist()  # the round's second host read
    t2 = _now()

    kids = children_of(parents)
    tokens = []
    for j, c in enumerate(path):
        rank = kids[rows[j]].index(c) + 1
        tokens.append(
            emitted(
                ids[c], Provenance.ACCEPTED, position=j, p_target=packed[j],
                p_draft=packed[len(rows) + j], draft_rank=rank,
                # a second guess taken: the first, the chain's, was refused
                rejected_id=ids[kids[rows[j]][0]] if rank > 1 else None,
            )
        )
    n = len(path)
    if walk.bonus:
        tokens.append(emitted(walk.last, Provenance.BONUS, position=n, p_target=packed[n]))
    else:
        refused = ids[kids[walk.row][0]]  # the draft's first guess there
        tokens.append(
            emitted(
                walk.last, Provenance.CORRECTED, position=n, p_target=packed[n],
                rejected_id=refused,
            )
        )
    target.keep_path(n0 - 1, rows)  # seq and the accepted path, in order
    drafter.rollback(n0 + chain_prefix(path))  # the draft's cache followed the chain only
    t0, t1 = times
    return RoundResult(
        tokens, k, n, (t1 - t0) * 1e3, (t2 - t1) * 1e3, drafter=prop.source or drafter.name,
        siblings=len(parents) - k, off_chain=chain_prefix(path) < n,
        guessed=chain_prefix(path) < n or (not walk.bonus and len(kids[walk.row]) > 1),
    )


def _round_tokens(packed: list[float], k: int) -> list[TokenEvent]:
    """The round's tokens from its one host read: [n, chain (k+1), p_target (k+1),
    p_draft (k), drafts (k)]: n accepted drafts, then the correction (the refused
    draft named) or, all k accepted, the bonus; a round without drafts is a plain step."""
    n = int(packed[0])
    chain = [int(x) for x in packed[1 : k + 2]]
    p_t = packed[k + 2 : 2 * k + 3]
    p_d = packed[2 * k + 3 : 3 * k + 3]
    drafts = [int(x) for x in packed[3 * k + 3 :]]
    tokens = [
        emitted(chain[i], Provenance.ACCEPTED, position=i, p_target=p_t[i], p_draft=p_d[i])
        for i in range(n)
    ]
    if n < k:
        tokens.append(
            emitted(
                chain[n], Provenance.CORRECTED, position=n, p_target=p_t[n], p_draft=p_d[n],
                rejected_id=drafts[n],
            )
        )
    elif k:
        tokens.append(emitted(chain[k], Provenance.BONUS, position=k, p_target=p_t[k]))
    else:
        tokens.append(emitted(chain[0], Provenance.TARGET, p_target=p_t[0]))
    return tokens
