"""Prompt-lookup drafting: the n-gram index, and exactness of the decoding it drafts for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.lookup import LookupDrafter
from specchat.engine.decode.sampling import logits_to_probs
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.speculative import speculative_round
from specchat.engine.events import Provenance, RoundEvent, TokenEvent, TurnFinished
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import loaded, tiny_llama, tiny_tokenizer


def reference_match(seq: list[int], k: int, min_n: int = 2, max_n: int = 3) -> list[int]:
    """Brute force: the longest suffix n-gram, its latest earlier occurrence, what followed it."""
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suffix = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == suffix:
                # what followed it, and past the sequence's end what would follow if the
                # text went on repeating itself from there
                ext = list(seq)
                while len(ext) < end + k:
                    ext.append(ext[len(ext) - (len(seq) - end)])
                return ext[end : end + k]
    return []


def test_the_longest_suffix_and_its_latest_occurrence_win() -> None:
    d = LookupDrafter(vocab=100)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0..2, followed by 9; (2, 3) alone last occurred at 4..5 (then 8)
    assert d.match(seq, 3) == [9, 2, 3]
    assert d.match([5, 6, 2, 3, 8, 2, 3], 2) == [8, 2]  # latest earlier (2, 3), not the first
    assert d.match([1, 2, 3, 4], 4) == []  # nothing repeats
    assert LookupDrafter(vocab=100, min_ngram=1).match([4, 1, 5, 1], 2) == [5, 1]
    assert d.match([4, 1, 5, 1], 2) == []  # one-token matches are off by default
    # A loop: (1, 2) last ended 2 tokens back, so the copy runs on over its own tokens.
    assert d.match([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert d.match([3, 3, 3], 4) == [3, 3, 3, 3]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=6),
    st.integers(1, 6),
)
def test_the_incremental_index_equals_a_fresh_search(chunks: list[list[int]], k: int) -> None:
    """Growing the sequence chunk by chunk (and changing its history) never serves a stale match."""
    d = LookupDrafter(vocab=10)
    seq: list[int] = []
    for i, chunk in enumerate(chunks):
        if i == 3 and seq:
            seq = seq[: len(seq) // 2]  # another history: a regenerated reply
        seq = seq + chunk
        assert d.match(seq, k) == reference_match(seq, k)


def test_propose_gives_one_hot_drafts_without_vocabulary_rows() -> None:
    d = LookupDrafter(vocab=50)
    prop = d.propose([3, 4, 7, 3, 4], 4, DecodeConfig(), None)
    assert prop.ids.tolist() == [7, 3, 4, 7]  # the copy runs on over its own tokens
    assert prop.logits is None and prop.probs is None  # one-hot: the round needs no [k, V] rows
    prop = d.propose([1, 2, 3], 4, DecodeConfig(), None)
    assert prop.ids.shape == (0,) and prop.n == 0


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4)


REPEATING = "one two three four one two three four one two three four one two"


def test_greedy_lookup_equals_plain(target: torch.nn.Module) -> None:
    def run(mode: Mode, k: int | None) -> tuple[list[int], list[object]]:
        s = ChatSession(loaded(target))
        events = list(s.stream(REPEATING, DecodeConfig(mode=mode, k=k, max_new_tokens=48)))
        return [e.token_id for e in events if isinstance(e, TokenEvent)], events

    plain, _ = run(Mode.PLAIN, None)
    for k in (None, 3):
        lookup, events = run(Mode.LOOKUP, k)
        assert lookup == plain
        rounds = [e for e in events if isinstance(e, RoundEvent)]
        drafted = [r for r in rounds if r.k]
        assert drafted, "no round drafted: the test did not exercise lookup"
        assert all(r.mode is Mode.LOOKUP for r in drafted)
        assert all(r.mode is Mode.PLAIN for r in rounds if not r.k)  # nothing matched: a plain step
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        # Greedy and fixed: the first token is the target's alone, copies are accepted
        # whole (bonus), plain steps where nothing matched (K=3: 22 accepted, 22 bonus,
        # 4 target). A refused copy is in tests/integration/test_stories_engine.py.
        assert tokens[0].provenance is Provenance.TARGET
        assert {t.provenance for t in tokens} >= {
            Provenance.ACCEPTED,
            Provenance.BONUS,
            Provenance.TARGET,
        }
        assert all(t.p_draft == pytest.approx(1.0) for t in tokens if t.provenance is Provenance.ACCEPTED)
        (done,) = [e for e in events if isinstance(e, TurnFinished)]
        assert done.stats.mode is Mode.LOOKUP and done.stats.drafted == sum(r.k for r in drafted)


def test_a_loop_is_copied_in_runs_longer_than_the_planned_k(target: torch.nn.Module) -> None:
    """The tiny model's greedy reply falls into a loop: copies of it, taken whole, double
    (the overlapping copy drafts as far as asked) past the controller's K bound, and the
    reply is still plain's."""
    cfg = DecodeConfig(max_new_tokens=96)
    plain = ChatSession(loaded(target)).stream(REPEATING, cfg.with_(mode=Mode.PLAIN))
    events = list(ChatSession(loaded(target)).stream(REPEATING, cfg.with_(mode=Mode.LOOKUP)))
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [
        e.token_id for e in plain if isinstance(e, TokenEvent)
    ]
    ks = [e.k for e in events if isinstance(e, RoundEvent) and e.k]
    assert max(ks) > cfg.k_max, ks
    assert any(b == 2 * a for a, b in zip(ks, ks[1:], strict=False)), ks
    # The panel's K is the one the next round drafts, a run's included (not the plan's);
    # the reply's last round drafts only what the token budget leaves.
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    long = [(a.next_k, b.k) for a, b in zip(rounds, rounds[1:], strict=False) if b.k > cfg.k_max]
    assert len(long) >= 2 and all(said == ran for said, ran in long[:-1]), long
    assert long[-1][0] >= long[-1][1], long


def test_sampled_lookup_follows_the_target_distribution() -> None:
    """The first token of a round drafted by lookup vs the target's next-token law.

    The sequence ends with an n-gram seen before, so lookup drafts the token
    that followed it; temperature 1.5 and top-k 12 flatten the tiny model.
    Seed 7, N = 3,000 rounds with K = 2, chi-square fails below p = 1e-3;
    the drafted token must be both accepted and refused within the sample.
    """
    tgt = tiny_llama(seed=0, layers=2)
    runner = ModelRunner(tgt, torch.device("cpu"))
    cfg = DecodeConfig(temperature=1.5, top_k=12)
    context = tiny_tokenizer()("Once upon a time", add_special_tokens=False)["input_ids"]

    def law(seq: list[int]) -> np.ndarray:
        runner.reset()
        return logits_to_probs(runner.forward(seq)[-1], cfg.temperature, cfg.top_k).double().numpy()

    # a copied token the target gives a fair chance: accepted sometimes, refused sometimes
    candidates = np.argsort(-law(context[-2:] + [0] + context))[:12]
    for m in candidates:
        seq = context[-2:] + [int(m)] + context
        expected = law(seq)
        if 0.1 < expected[m] < 0.9:
            break
    else:
        pytest.fail("no candidate token with 0.1 < p < 0.9")
    drafter = LookupDrafter(runner.vocab)
    assert drafter.match(seq, 2)[0] == m
    g = torch.Generator().manual_seed(7)
    n = 3000
    firsts = [speculative_round(runner, drafter, seq, 2, cfg, g).tokens[0].token_id for _ in range(n)]
    counts = np.bincount(firsts, minlength=len(expected))
    assert 0 < counts[m] < n
    support = np.flatnonzero(expected > 0)
    assert counts[expected == 0].sum() == 0
    exp = expected[support] / expected[support].sum() * n
    assert chisquare(counts[support], exp).pvalue > 1e-3
