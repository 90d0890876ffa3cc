"""Drafters that compose: prompt lookup first, the draft model where lookup finds nothing.

A lookup draft costs next to nothing and is often long and right when the
reply copies the conversation (code under edit, names, the question's own
words); the draft model costs c of a target step per token but drafts
anywhere. `ComposedDrafter` asks the lookup first and, only when it finds no
earlier occurrence of the sequence's last n-gram, the model. Each round has
one proposer, named in `Proposal.source` (and so in the round's event), and
the speculative rule is the one its proposal needs (one-hot for a copy), so
the round stays exact whichever drafted.

The model is kept in step lazily: a round the lookup drafted leaves it
behind, and its `catch_up` feeds the missed tokens before the next round it
drafts (outside the timed draft, as after a plain stretch).
"""

from __future__ import annotations

import torch

from .config import MAX_K, DecodeConfig
from .lookup import LookupDrafter
from .speculative import Drafter, Proposal


class ComposedDrafter:
    """Lookup, else `model`; implements `Drafter`."""

    def __init__(self, lookup: LookupDrafter, model: Drafter) -> None:
        self.lookup = lookup
        self.model = model
        self.name = f"lookup, else {model.name}"
        self._copied: tuple[int, list[int]] | None = None  # (len(seq), what lookup found)

    def catch_up(self, seq: list[int]) -> None:
        """Look up first (untimed, as catch-up is); bring the model up only if it will draft."""
        found = self.lookup.match(seq, MAX_K)
        self._copied = (len(seq), found)
        if not found:
            self.model.catch_up(seq)

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        copied = self._copied
        self._copied = None
        found = copied[1] if copied is not None and copied[0] == len(seq) else None
        if found is None:
            found = self.lookup.match(seq, k)
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
