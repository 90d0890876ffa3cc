"""A draft LM head over a shortlist of the vocabulary.

The 0.5B default draft spends about 136M of its parameters on a
151,936 x 896 output projection: on a memory-bound CPU that is a fifth of
its per-token cost. A draft only has to propose likely tokens, so its head
can score a shortlist: the N ids most frequent in the Python standard
library's sources, counted with the draft's own tokenizer (text every machine
running specchat has: code, comments and docstrings), then by id where the
count ties or is zero (byte-level BPE vocabularies number tokens in merge
order, so low ids are the frequent ones), plus every special and added token.
By id alone, code tokens above id 32k were lost: on the default pair's dev
and edit prompts the 32k shortlist kept the draft's argmax on the target's
token at 0.825 of positions ranked, 0.803 by id, 0.861 with the whole head
(docs/performance.md, step 32). The count is made once per tokenizer and
Python and kept in the cache (`<cache>/vocab-ranks/`). Tokens outside the
shortlist get probability 0 in the draft; speculative sampling stays exact
because the target verifies every token and the residual
max(0, p_target - p_draft) covers what the draft cannot propose
(Leviathan et al. 2023).
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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


def shortlist_ids(vocab: int, keep: int, extra: Iterable[int] = (), ranking: Tensor | None = None) -> Tensor:
    """The first `keep` ids of `ranking` (all ids, most wanted first; None: by id) plus
    `extra` (special and added tokens), within the vocabulary, sorted."""
    order = torch.arange(vocab) if ranking is None else ranking[ranking < vocab]
    base = order[: min(keep, vocab)].to(torch.long)
    more = torch.tensor([i for i in extra if 0 <= i < vocab], dtype=torch.long)
    return torch.unique(torch.cat([base, more]))


# The corpus: the standard library's own modules, not its tests (generated data, odd
# encodings) or the IDE's; ~11 MB of text, ~2.9M tokens, ~4 s to count on one core.
_LEFT_OUT = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _LEFT_OUT & set(p.relative_to(root).parts))


def token_ranking(
    tokenizer: Any, vocab: int, cache_dir: Path | str | None = None, counting: Callable[[], None] | None = None
) -> Tensor:
    """Every id below `vocab`, most frequent first in the standard library's sources as
    `tokenizer` splits them; ties (and ids never seen) by lower id. Kept in the cache
    by the tokenizer's vocabulary and the Python version (whose library it counts);
    `counting` is called before a count that is not."""
    from .. import paths

    entries = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(entries, ensure_ascii=False).encode())
    digest.update(f"{vocab} {sys.version_info[:2]}".encode())
    path = paths.cache_root(cache_dir) / "vocab-ranks" / f"{digest.hexdigest()[:20]}.pt"
    try:
        ranking = torch.load(path, weights_only=True)
        if isinstance(ranking, Tensor) and ranking.numel() == vocab:
            return ranking.to(torch.long)
    except Exception:  # absent, or torn (the unpickler raises its own kinds): counted again
        pass
    if counting is not None:
        counting()
    counts = torch.zeros(vocab, dtype=torch.float64)
    files = corpus_files()
    for start in range(0, len(files), 64):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[start : start + 64]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            seen = torch.tensor(ids, dtype=torch.long)
            seen = seen[seen < vocab]
            counts.index_add_(0, seen, torch.ones(seen.numel(), dtype=torch.float64))
    ranking = torch.argsort(-counts, stable=True)  # ties: lower id first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(ranking.to(torch.int32), tmp)
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: counted again next time
    return ranking


def apply_shortlist(model: PreTrainedModel, ids: Tensor) -> int:
    """Replace the model's output projection by a shortlist head over `ids`; returns the
    shortlist size.

    A model whose head is tied to its input embeddings gets its own (smaller)
    copy; the embeddings stay whole.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError("the model's output projection is not a Linear layer")
    new = ShortlistHead(head, ids)
    model.set_output_embeddings(new)
    model.config.tie_word_embeddings = False
    return int(ids.numel())
