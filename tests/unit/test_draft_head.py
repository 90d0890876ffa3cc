"""A shortlist draft head: cheaper drafts, still exact output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.speculative import accept_or_resample
from specchat.engine.events import TokenEvent
from specchat.engine.model import draft_head
from specchat.engine.model.draft_head import (
    ShortlistHead,
    apply_shortlist,
    shortlist_ids,
    token_ranking,
)
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import loaded, tiny_llama, tiny_tokenizer


def test_shortlist_head_scores_only_its_ids() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    ids = shortlist_ids(50, 10, extra=[42, 49, 99])
    assert ids.tolist() == list(range(10)) + [42, 49]
    short = ShortlistHead(head, ids)
    h = torch.randn(2, 3, 16)
    full, got = head(h), short(h)
    assert got.shape == full.shape
    torch.testing.assert_close(got[..., ids], full[..., ids])
    mask = torch.ones(50, dtype=torch.bool)
    mask[ids] = False
    assert torch.isinf(got[..., mask]).all()


def test_the_ranking_counts_the_library_sources_and_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids by how often the corpus uses them, ties and unseen ids by id; counted once, then
    read from the cache; a torn cache file is counted again."""
    tok = tiny_tokenizer()
    vocab = len(tok)
    source = tmp_path / "corpus.py"
    source.write_text("zq " * 5 + "xv " * 3 + "zq xv kj\n")
    monkeypatch.setattr(draft_head, "corpus_files", lambda: [source])
    counted: list[int] = []
    ranking = token_ranking(tok, vocab, tmp_path, lambda: counted.append(1))
    assert sorted(ranking.tolist()) == list(range(vocab)) and counted == [1]
    counts = torch.bincount(torch.tensor(tok(source.read_text())["input_ids"]), minlength=vocab)
    want = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    assert ranking.tolist() == want
    assert counts[ranking[0]] > counts[ranking[int((counts > 0).sum())]] == 0
    assert torch.equal(token_ranking(tok, vocab, tmp_path, lambda: counted.append(1)), ranking)
    assert counted == [1]  # read from the cache
    (kept,) = (tmp_path / "vocab-ranks").iterdir()
    kept.write_bytes(b"torn")
    assert torch.equal(token_ranking(tok, vocab, tmp_path, lambda: counted.append(1)), ranking)
    assert counted == [1, 1]
    ids = shortlist_ids(vocab, 4, extra=[vocab - 1], ranking=ranking)
    assert ids.tolist() == sorted({*want[:4], vocab - 1})


@pytest.mark.parametrize("keep", [64, 200])
def test_greedy_spec_with_a_shortlist_draft_equals_plain(keep: int) -> None:
    target = tiny_llama(seed=0, layers=4)
    draft = layer_truncated(tiny_llama(seed=0, layers=4), 3)
    apply_shortlist(draft, shortlist_ids(draft.config.vocab_size, keep, extra=[2]))
    outs = {}
    for mode in (Mode.PLAIN, Mode.SPEC):
        s = ChatSession(loaded(target), loaded(draft, "draft"))
        events = list(s.stream("Once upon a time", DecodeConfig(mode=mode, k=3, max_new_tokens=40)))
        outs[mode] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert outs[Mode.SPEC] == outs[Mode.PLAIN]


def test_acceptance_rule_exact_when_the_draft_cannot_propose_some_tokens() -> None:
    """Chi-square, seed 7, N = 20,000, fails below p = 1e-3: tokens 5-7 have p_draft = 0."""
    g = torch.Generator().manual_seed(7)
    p_target = torch.tensor([0.25, 0.20, 0.15, 0.10, 0.10, 0.10, 0.06, 0.04])
    p_draft = torch.tensor([0.40, 0.30, 0.10, 0.10, 0.10, 0.0, 0.0, 0.0])
    n = 20_000
    drafts = torch.multinomial(p_draft, n, replacement=True, generator=g)
    firsts = []
    for i in range(n):
        n_acc, extra = accept_or_resample(
            p_target.expand(2, 8), p_draft.expand(1, 8), drafts[i : i + 1], g
        )
        firsts.append(int(drafts[i]) if n_acc else extra)
    counts = np.bincount(firsts, minlength=8)
    assert (
        chisquare(counts, n * p_target.double().numpy() / float(p_target.double().sum())).pvalue
        > 1e-3
    )
