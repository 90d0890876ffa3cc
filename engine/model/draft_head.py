"""A draft LM head over a shortlist of the vocabulary.

The 0.5B default draft spends about 136M of its parameters on a
151,936 x 896 output projection: on a memory-bound CPU that is a fifth of
its per-token cost. A draft only has to propose likely tokens, so its head
can score a shortlist: the first N token ids (byte-level BPE vocabularies
number tokens in merge order, so low ids are the frequent ones) plus every
special and added token. Tokens outside the shortlist get probability 0 in
the draft; speculative sampling stays exact because the target verifies
every token and the residual max(0, p_target - p_draft) covers what the
draft cannot propose (Leviathan et al. 2023).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel


class ShortlistHead(nn.Module):
    """Scores only `ids`; every other token gets -inf. Output keeps the full vocabulary."""

    def __init__(self, head: nn.Linear, ids: Tensor) -> None:
        super().__init__()
        self.vocab = int(head.weight.shape[0])
        ids = torch.unique(ids.to(torch.long)).sort().values
        self.register_buffer("ids", ids.to(head.weight.device), persistent=False)
        self.proj = nn.Linear(head.in_features, len(ids), bias=head.bias is not None)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[ids])  # [N, H]
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[ids])
        self.proj.to(head.weight.dtype)
        self.proj.requires_grad_(False)

    def forward(self, hidden: Tensor) -> Tensor:
        small = self.proj(hidden)  # [..., N]
        out = small.new_full((*small.shape[:-1], self.vocab), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.ids, small)

    def extra_repr(self) -> str:
        return f"shortlist={self.proj.out_features} of {self.vocab}"


def shortlist_ids(vocab: int, keep: int, extra: Iterable[int] = ()) -> Tensor:
    """The first `keep` ids plus `extra` (special and added tokens), within the vocabulary."""
    base = torch.arange(min(keep, vocab))
    more = torch.tensor([i for i in extra if 0 <= i < vocab], dtype=torch.long)
    return torch.unique(torch.cat([base, more]))


def apply_shortlist(model: PreTrainedModel, keep: int, extra: Iterable[int] = ()) -> int:
    """Replace the model's output projection by a shortlist head; returns the shortlist size.

    A model whose head is tied to its input embeddings gets its own (smaller)
    copy; the embeddings stay whole.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError("the model's output projection is not a Linear layer")
    ids = shortlist_ids(int(head.weight.shape[0]), keep, extra)
    new = ShortlistHead(head, ids)
    model.set_output_embeddings(new)
    model.config.tie_word_embeddings = False
    return int(ids.numel())
