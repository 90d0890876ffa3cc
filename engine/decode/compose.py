"""Drafters that compose: prompt lookup first, the draft model where lookup finds nothing.

A lookup draft costs next to nothing and is often long and right when the
reply copies the conversation (code under edit, names, the question's own
words); the draft model costs c of a target step per token but drafts
anywhere. `ComposedDrafter` asks the lookup first and, only when it finds no
earlier occurrence of the sequence's last n-gram, the model. Each round has
one proposer, named in `Proposal.source` (and so in the round's event), and
the speculative rule is the one its proposal needs (one-hot for a copy), so
the round stays exact whichever drafted.

The session asks `copies(seq)` before a round: a copy's round is priced by
a controller of its own (a copy costs nothing to draft and is often long),
the model's rounds by the draft model's controller, so neither's costs and
acceptance blur the other's.

The model is kept in step lazily: a round the lookup drafted leaves it
behind, and its `catch_up` feeds the missed tokens before the next round it
drafts (outside the timed draft, as after a plain stretch).
"""

from __future__ import annotations

import torch

from ..config import MAX_K, DecodeConfig
from .lookup import LookupDrafter
from .speculative import Drafter, Proposal


class ComposedDrafter:
    """Lookup, else `model`; implements `Drafter`."""

    def __init__(self, lookup: LookupDrafter, model: Drafter) -> None:
        self.lookup = lookup
        self.model = model
        self.name = f"lookup, else {model.name}"
        self._copied: tuple[int, list[int]] | None = None  # (len(seq), what lookup found)

    def copies(self, seq: list[int]) -> bool:
        """Whether the lookup has a draft after seq (kept for this round's propose)."""
        if self._copied is None or self._copied[0] != len(seq):
            self._copied = (len(seq), self.lookup.match(seq, MAX_K))
        return bool(self._copied[1])

    def catch_up(self, seq: list[int]) -> None:
        """Bring the model up only if it will draft (catch-up is untimed)."""
        if not self.copies(seq):
            self.model.catch_up(seq)

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        found = self._copied[1] if self.copies(seq) and self._copied is not None else []
        self._copied = None
        if found:
            ids = torch.tensor(found[:k], dtype=torch.long, device=self.lookup.device)
            return Proposal(ids, source=self.lookup.name)
        self.model.catch_up(seq)  # no-op when catch_up already did it
        prop = self.model.propose(seq, k, cfg, generator)
        prop.source = self.model.name
        return prop

    def rollback(self, n: int) -> None:
        self.lookup.rollback(n)
        self.model.rollback(n)

    def reset(self) -> None:
        self._copied = None
        self.lookup.reset()
        self.model.reset()
