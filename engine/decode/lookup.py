"""Prompt-lookup drafting: draft tokens copied from earlier in the conversation.

A chat about code repeats itself: identifiers, whole lines of the code under
discussion, the question's own words. When the last few tokens of the
sequence occurred before, the tokens that followed them then are a draft
that costs no model at all (Saxena 2023, "prompt lookup decoding"; the same
idea as llama.cpp's lookup decoding and vLLM's n-gram proposer). The target
verifies the draft as it verifies a draft model's, so greedy output is
unchanged and sampled output keeps the target's distribution: the draft's
distribution is one-hot on the copied token, so a draft token is accepted
with probability p_target(token), and a rejection resamples from p_target
without that token.

The drafter keeps an index from each n-gram (MIN_NGRAM to MAX_NGRAM tokens)
to the end of its latest occurrence, extended as the sequence grows, so a
lookup costs a few dictionary reads whatever the context length. When
nothing matches, it proposes no tokens and the round is a plain step. A
match that ends a few tokens back is copied on over its own tokens (LZ77's
overlapping copy), so a reply caught in a loop is drafted as far ahead as
the round asks; how far a copier asks is the controller's (`runs`).
"""

from __future__ import annotations

import torch

from ..config import DecodeConfig
from .speculative import Proposal

MAX_NGRAM = 3  # the longest suffix looked up first: the most specific context
MIN_NGRAM = 2  # one-token matches are mostly frequent tokens: drafts that verification rejects


class LookupDrafter:
    """Drafts by copying what followed the latest earlier occurrence of the sequence's last n-gram."""

    name = "lookup"

    def __init__(
        self,
        vocab: int,
        device: torch.device | str = "cpu",
        *,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab = vocab
        self.device = torch.device(device)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []  # the sequence the index describes
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence

    # -- the index -----------------------------------------------------------

    def _sync(self, seq: list[int]) -> None:
        """Index every n-gram that ends before the last position of seq."""
        known = len(self._tokens)  # n-grams ending at positions <= known are in the index
        if known >= len(seq) or seq[:known] != self._tokens:
            self.reset()  # another history (new conversation, regenerated reply)
            known = 0
        # n-grams ending at position e (exclusive), for e < len(seq): the one ending at
        # len(seq) is the suffix itself, whose earlier occurrence the lookup wants.
        for end in range(max(known + 1, 1), len(seq)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._ends[tuple(seq[end - n : end])] = end
        self._tokens = seq[: len(seq) - 1]

    def match(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of seq's longest matching
        suffix. Where that occurrence ends within the last k tokens, the copy runs on over its
        own tokens, as LZ77 copies an overlapping match: a reply caught in a loop of period d
        is drafted k tokens ahead, not d."""
        self._sync(seq)
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            end = self._ends.get(tuple(seq[-n:]))
            if end is not None:
                out = seq[end : end + k]
                period = len(seq) - end
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

    # -- Drafter -------------------------------------------------------------

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        """The copied tokens as one-hot drafts: no [k, V] rows are built."""
        ids = self.match(seq, k)
        return Proposal(torch.tensor(ids, dtype=torch.long, device=self.device))

    def rollback(self, n: int) -> None:
        return None  # the index follows the sequence it is given

    def catch_up(self, seq: list[int]) -> None:
        return None

    def reset(self) -> None:
        self._tokens = []
        self._ends = {}
