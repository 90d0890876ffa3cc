"""Draft trees: the draft's next guesses verified beside its chain (SpecInfer, EAGLE-2).

A chain of K drafts gives the target one guess per depth. Where the target
refuses the draft's first guess, its token is often the draft's second (half
the 0.5B draft's misses on the dev prompts: docs/performance.md, step 20).
`add_siblings` hangs the draft's next `width - 1` guesses beside the chain at
depths 1..S, taken from the distributions the chain was drafted from (no
extra draft pass). The target scores the whole tree in one pass, each row over
the cache and its own path (`ModelRunner.feed_tree`: the bits the chain along
that path gets), and the round keeps the longest accepted path
(Miao et al. 2024, SpecInfer; Li et al. 2024, EAGLE-2).

Greedy: a node is accepted when the target's argmax after its parent is its
token. A node's children are distinct tokens, so at most one is accepted at
each depth and the path is unique; the output stays plain greedy's.

Sampled: recursive rejection sampling (Jeon et al. 2024, "Recursive
Speculative Decoding"). At a node the children are tried in order, each drawn
from the draft's distribution q without the children before it: child x is
accepted with probability min(1, p_target(x) / q(x)); refused, p_target
becomes the residual norm(max(0, p_target - q)) and q loses x (renormalised:
what the next child was drawn from). Each step is Leviathan et al.'s rule
with the proposal its candidate was drawn from, so the emitted tokens follow
the target's distribution whatever the tree holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import DecodeConfig
from .sampling import logits_to_probs, residual, sample

WIDTH = 2  # guesses per depth: the draft's first (the chain's) and its second


def add_siblings(
    ids: Tensor,
    logits: Tensor,
    probs: Tensor | None,
    depth: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None,
    width: int = WIDTH,
) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, ...]]:
    """A chain ids [K] drafted from logits [K, V] (probs [K, V]: the processed rows it was
    sampled from, sampled decoding) with `width - 1` more guesses at depths 1..depth:
    (ids [n], logits [n, V], probs [n, V] or None, parents [n]); node i's parent is node
    parents[i], -1 the sequence's last token. The chain stays nodes 0..K-1; a guess
    beside chain node i carries node i's rows (the distribution it was drawn from)."""
    k = int(ids.shape[0])
    parents = [i - 1 for i in range(k)]
    extra: list[Tensor] = []
    rows: list[int] = []
    for i in range(min(depth, k)):
        if cfg.greedy:
            others = logits[i].clone()  # [V]
            others[ids[i]] = float("-inf")
            picks = torch.topk(others, width - 1).indices  # the next best guesses
        else:
            q = probs[i] if probs is not None else logits_to_probs(
                logits[i], cfg.temperature, cfg.top_k, cfg.top_p
            )
            left = q.clone()
            left[ids[i]] = 0.0
            room = min(width - 1, int((left > 0).sum()))  # top-k / top-p may leave none
            if room == 0:
                continue
            # Without replacement: each guess from q without the chain's token and the
            # guesses before it, as `walk_sampled` renormalises q when it refuses one.
            picks = torch.multinomial(left, room, replacement=False, generator=generator)
        extra.append(picks)
        rows += [i] * int(picks.shape[0])
        parents += [i - 1] * int(picks.shape[0])
    if not extra:
        return ids, logits, probs, tuple(parents)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return (
        torch.cat([ids, *extra]),
        torch.cat([logits, logits.index_select(0, index)]),
        torch.cat([probs, probs.index_select(0, index)]) if probs is not None else None,
        tuple(parents),
    )


@dataclass(frozen=True, slots=True)
class Walk:
    """Where a tree round ends: the accepted nodes root to leaf, the round's last token
    (a correction, or the bonus after a node without children) and the block row it
    comes from (0: the sequence's last token, node i: row i + 1)."""

    path: list[int]
    last: int
    row: int
    bonus: bool  # the path ended at a node with no children: nothing was refused there


def children_of(parents: tuple[int, ...]) -> list[list[int]]:
    """By block row (0: the sequence's last token, node i: i + 1), the nodes below it in order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        kids[parent + 1].append(node)
    return kids


def walk_greedy(argmax: list[int], ids: list[int], parents: tuple[int, ...]) -> Walk:
    """argmax[r]: the target's token after block row r. Follows the child the target picks."""
    kids = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        want = argmax[row]
        nxt = next((c for c in kids[row] if ids[c] == want), None)
        if nxt is None:
            return Walk(path, want, row, not kids[row])
        path.append(nxt)
        row = nxt + 1


def walk_sampled(
    p_target: Tensor,
    p_draft: Tensor,
    ids: list[int],
    parents: tuple[int, ...],
    generator: torch.Generator | None,
) -> Walk:
    """Recursive rejection sampling down the tree. p_target [T, V]: the target's processed
    distribution after each block row; p_draft [n, V]: each node's draft distribution
    before its siblings were taken out (a node's children share their parent's)."""
    kids = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        p = p_target[row]
        tried = kids[row]
        if not tried:  # all drafts along the path accepted: the bonus
            return Walk(path, int(sample(p, generator)), row, True)
        q = p_draft[tried[0]]
        taken = None
        for c in tried:
            x = ids[c]
            u = float(torch.rand((), generator=generator))
            if u * float(q[x]) < float(p[x]):
                taken = c
                break
            p = residual(p, q)  # what the target still owes after refusing x
            q = q.clone()
            q[x] = 0.0
            mass = float(q.sum())
            if mass <= 0.0:
                break
            q = q / mass  # what the next child was drawn from
        if taken is None:
            return Walk(path, int(sample(p, generator)), row, False)
        path.append(taken)
        row = taken + 1


def chain_prefix(path: list[int]) -> int:
    """How many of the path's first nodes are the chain's (nodes 0, 1, ...): the draft's
    own cache holds those and must keep no more."""
    n = 0
    while n < len(path) and path[n] == n:
        n += 1
    return n
