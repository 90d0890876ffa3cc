"""Draft trees (engine/decode/tree.py): the target scores each path as the chain along it
would, greedy trees decode what plain greedy decodes, sampled trees follow the target's
distribution at every position of a round."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, QuantMode
from specchat.engine.decode import tree
from specchat.engine.decode.speculative import ModelDrafter, plain_step, speculative_round
from specchat.engine.model import native, quant
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import native_or_skip, perturbed, tiny_llama
from tests.unit.test_exactness_rounds import ALPHA, Rounds, position_test

CPU = torch.device("cpu")
PROMPT = [1, 5, 9, 3, 7, 11, 4, 8]
# Block rows: 0 the sequence's last token; a chain of 3 (rows 1-3); a guess beside each
# chain row (rows 4-6), and one below a guess (row 7): every path shape a tree can have.
IDS = [23, 40, 41, 42, 50, 51, 52, 60]
PARENTS = (-1, 0, 1, 2, 0, 1, 2, 4)
PATHS = {4: [0, 4], 5: [0, 1, 5], 6: [0, 1, 2, 6], 7: [0, 4, 7], 3: [0, 1, 2, 3]}


def tree_against_chains(model: torch.nn.Module, native_path: bool = True) -> None:
    runner = ModelRunner(model, CPU)  # type: ignore[arg-type]
    if native_path:
        native_or_skip(runner)
    else:
        runner.native = None  # transformers' modules, row-wise attention (GPUs take this path)
    runner.feed(list(range(3, 12)))  # the prompt (modules), then one native step
    runner.feed([19])
    base = runner.cached
    assert runner.takes_tree(len(IDS))
    scored = runner.feed_tree(torch.tensor(IDS), PARENTS)  # [8, V]
    for row, path in PATHS.items():
        runner.crop_to(base)
        chain = runner.feed([IDS[j] for j in path], keep=len(path))
        for j, r in enumerate(path):
            assert torch.equal(chain[j], scored[r]), (row, j, (chain[j] - scored[r]).abs().max())
    # The path kept: the cache then steps as the chain's does, bit for bit.
    for path in PATHS.values():
        runner.crop_to(base)
        runner.feed_tree(torch.tensor(IDS), PARENTS)
        runner.keep_path(base, path)
        assert runner.cached == base + len(path)
        after_tree = runner.feed([7])[-1]
        runner.crop_to(base)
        runner.feed([IDS[j] for j in path])
        assert torch.equal(after_tree, runner.feed([7])[-1])


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "modules"])
def test_each_tree_row_scores_as_the_chain_along_its_path(native_path: bool) -> None:
    """Float32 Llama (4 layers; the native decoder, then transformers' modules): every row
    of an 8-row tree equals the same token's row in a chain verify of its path
    (torch.equal), and keep_path leaves the cache the chain would have."""
    tree_against_chains(tiny_llama(), native_path)


def test_each_tree_row_scores_as_the_chain_along_its_path_in_w4a8() -> None:
    """The same with the w4a8 kernel (q/k/v and gate/up groups, the LM head quantized)."""
    reason = native.unavailable("w4a8")
    if reason:
        pytest.skip(f"the w4a8 kernel cannot be used here: {reason}")
    tree_against_chains(quant.apply(tiny_llama(hidden=128), QuantMode.W4A8, lm_head=True))


def test_the_kept_path_hands_a_head_the_features_a_chain_would() -> None:
    """A runner capturing features for a draft head (layers 1 and 3): after feed_tree and
    keep_path, the features handed over are those of the kept rows, at their positions,
    bit for bit what a chain verify of the path hands over; none during feed_tree."""
    runner = ModelRunner(tiny_llama(), CPU)
    native_or_skip(runner)
    got: list[tuple[int, torch.Tensor]] = []
    runner.feed(list(range(3, 12)))
    runner.feed([19])
    base = runner.cached
    runner.capture = (1, 3)
    runner.on_features = lambda start, feats: got.append((start, feats))
    for path in PATHS.values():
        runner.crop_to(base)
        runner.feed_tree(torch.tensor(IDS), PARENTS)
        assert not got
        runner.keep_path(base, path)
        (start, tree_feats), = got
        got.clear()
        runner.crop_to(base)
        runner.feed([IDS[j] for j in path], keep=len(path))
        (chain_start, chain_feats), = got
        got.clear()
        assert start == chain_start == base and torch.equal(tree_feats, chain_feats)


def test_a_tree_needs_attention_that_scores_rows_by_their_paths() -> None:
    """Without the native decoder and with transformers' own SDPA (a sliding-window model
    keeps it), no tree is taken; before the conversation's first pass, none either."""
    runner = ModelRunner(tiny_llama(), CPU)
    assert not runner.takes_tree(3)  # nothing cached yet
    runner.feed([3, 4, 5])
    assert runner.takes_tree(3) and not runner.takes_tree(40)  # rows past MAX_ROWWISE
    runner.native = None
    runner.model.config._attn_implementation = "sdpa"
    assert not runner.scores_trees and not runner.takes_tree(3)


def test_greedy_siblings_are_the_drafts_next_guesses() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 4.0, 1.0]])
    ids = logits.argmax(-1)
    out_ids, rows, probs, parents = tree.add_siblings(ids, logits, None, 2, DecodeConfig(), None)
    assert out_ids.tolist() == [1, 0, 2, 2]  # the chain, then each depth's second best
    assert parents == (-1, 0, -1, 0)
    assert torch.equal(rows[2], logits[0]) and torch.equal(rows[3], logits[1])
    assert probs is None


def test_sampled_siblings_are_never_the_chains_token() -> None:
    cfg = DecodeConfig(temperature=1.0, top_k=3)
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    for _ in range(200):
        ids = torch.multinomial(probs[0], 1, generator=g)
        out, _, _, parents = tree.add_siblings(ids, probs.log(), probs, 1, cfg, g, width=3)
        assert len(set(out.tolist())) == 3 and 3 not in out.tolist() and parents == (-1, -1, -1)


def test_the_greedy_walk_takes_the_targets_pick() -> None:
    ids = [40, 41, 42, 50, 51, 52]
    parents = (-1, 0, 1, -1, 0, 1)
    # The target takes 40, then 51 (beside 41), then 9 after it: 51 is a leaf.
    walk = tree.walk_greedy([40, 51, 0, 0, 0, 9, 0], ids, parents)
    assert (walk.path, walk.last, walk.row, walk.bonus) == ([0, 4], 9, 5, True)
    assert tree.chain_prefix(walk.path) == 1
    walk = tree.walk_greedy([7, 0, 0, 0, 0, 0, 0], ids, parents)  # neither guess at depth 1
    assert (walk.path, walk.last, walk.bonus) == ([], 7, False)


def decode(
    target: torch.nn.Module, draft: torch.nn.Module | None, siblings: int, n: int,
    native_path: bool = True,
) -> tuple[list[int], int]:
    """n greedy tokens after PROMPT: plain steps (draft None) or rounds of K = 3 with
    guesses beside depths 1..siblings; (tokens, rounds that ended on a guess)."""
    cfg = DecodeConfig(temperature=0.0)
    runner = ModelRunner(target, CPU)  # type: ignore[arg-type]
    if not native_path:
        runner.native = None
    seq, off = list(PROMPT), 0
    drafter = ModelDrafter(ModelRunner(draft, CPU)) if draft is not None else None  # type: ignore[arg-type]
    while len(seq) < len(PROMPT) + n:
        if drafter is None:
            seq.append(plain_step(runner, seq, cfg, None).tokens[0].token_id)
            continue
        res = speculative_round(runner, drafter, seq, 3, cfg, None, siblings=siblings)
        off += res.off_chain
        assert res.siblings == siblings  # one guess beside each of the first depths
        seq += [e.token_id for e in res.tokens]
    return seq[len(PROMPT) : len(PROMPT) + n], off


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "modules"])
def test_greedy_trees_decode_what_plain_greedy_decodes(native_path: bool) -> None:
    """A 2-layer target and its copy with head noise of std 0.6 as the draft: 80 greedy
    tokens through rounds of K = 3 with guesses beside 1, 2 and 3 depths equal plain
    greedy's; 3 rounds at least end on a guess (the path a chain cannot take)."""
    target = tiny_llama(seed=0, layers=2)
    if native_path:
        native_or_skip(ModelRunner(target, CPU))
    draft = perturbed(target, 0.6, seed=1)
    plain, _ = decode(target, None, 0, 80)
    for siblings in (1, 2, 3):
        out, off = decode(target, draft, siblings, 80, native_path)
        assert out == plain, siblings
        assert off >= 3, f"siblings={siblings}: only {off} rounds ended on a guess"


# -- sampled trees: every position of a round follows the target ---------------------------

TREE_CFG = DecodeConfig(temperature=1.2, top_k=6, top_p=0.95)
TREE_VOCAB = 16


@pytest.fixture(scope="module")
def tree_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 2-layer target over 16 tokens and a draft off enough (head noise of std 0.2) that
    the chain's first guess is often refused and the second often taken: a third of the
    rounds end on a guess, and every round length is common."""
    target = tiny_llama(seed=0, layers=2, vocab=TREE_VOCAB)
    return target, perturbed(target, 0.2, seed=1)


def tree_rounds(models: tuple[torch.nn.Module, torch.nn.Module], n: int, seed: int) -> tuple[Rounds, int]:
    """n sampled rounds of K = 3 with a guess beside every depth, each from PROMPT."""
    target, draft = models
    runner = ModelRunner(target, CPU)  # type: ignore[arg-type]
    native_or_skip(runner)
    drafter = ModelDrafter(ModelRunner(draft, CPU))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    rounds, off = [], 0
    for _ in range(n):
        res = speculative_round(runner, drafter, PROMPT, 3, TREE_CFG, g, siblings=3)
        assert res.k == 3 and res.siblings >= 1
        off += res.off_chain
        rounds.append([e.token_id for e in res.tokens])
    return rounds, off


def tree_pvalues(rounds: Rounds, target: torch.nn.Module) -> list[tuple[float, int, int]]:
    from tests.unit.test_exactness_rounds import target_law

    law = target_law(target, TREE_CFG)
    return [position_test(rounds, j, law) for j in range(4)]


def test_every_position_of_a_tree_round_follows_the_target(
    tree_models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    """speculative_round with a guess beside each of K = 3 drafts, temperature 1.2, top-k 6,
    top-p 0.95 on both models; seed 11, N = 2,500 rounds from one prompt. The token at
    position j is tested against the target's processed distribution after the prompt
    and the j tokens before it (grouped by that prefix, cells pooled to an expected
    count of 5): p > 1e-3 at every position, 300 rounds at least ending on a guess,
    70% of the rounds reaching each position in groups large enough to test."""
    rounds, off = tree_rounds(tree_models, 2500, seed=11)
    assert off >= 300, f"only {off} rounds ended on a guess"
    for j, (p, used, reached) in enumerate(tree_pvalues(rounds, tree_models[0])):
        assert used >= 0.7 * reached, f"position {j}: only {used} of {reached} rounds tested"
        assert p > ALPHA, f"position {j}: chi-square p = {p:.2e}"


def test_the_tree_statistics_reject_a_walk_that_forgets_the_refused_guess(
    tree_models: tuple[torch.nn.Module, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rounds with the walk broken: after a refused guess the target's
    distribution stays as it was (no residual), so the next guess is accepted too often.
    Same seed and N; some position must give p < 1e-3."""
    monkeypatch.setattr(tree, "residual", lambda p_target, p_draft: p_target)
    rounds, _ = tree_rounds(tree_models, 2500, seed=11)
    pvalues = [p for p, _, _ in tree_pvalues(rounds, tree_models[0])]
    assert min(pvalues) < ALPHA, f"p-values {pvalues}"


def test_a_spec_turn_with_trees_streams_plains_tokens_and_says_where_guesses_won() -> None:
    """ChatSession, spec with the draft model alone and K = 3, a second guess beside depths
    1 and 2 (--siblings 2), greedy, 64 tokens: the tokens equal plain's; every model round
    verified its 2 guesses (RoundEvent.siblings); tokens the tree's guesses gave carry
    draft_rank 2, and at least one does. The bench's spec-chain arm turns trees off."""
    from specchat.engine.config import SPEC_CHAIN, Mode
    from specchat.engine.events import RoundEvent, TokenEvent
    from specchat.engine.tools.bench_runs import arm_config
    from tests.tinymodels import pair_session

    target = tiny_llama(seed=0, layers=4)
    native_or_skip(ModelRunner(target, CPU))
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, siblings=2, compose=False, max_new_tokens=64)
    text = "Once upon a time there was a little robot"
    events = list(pair_session(target).stream(text, cfg))
    plain = list(pair_session(target).stream(text, cfg.with_(mode=Mode.PLAIN)))
    tokens = [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in (events, plain)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 64
    rounds = [e for e in events if isinstance(e, RoundEvent) and e.k == 3]
    assert rounds and all(e.siblings == 2 for e in rounds)
    ranked = [e for e in events if isinstance(e, TokenEvent) and e.draft_rank]
    assert 2 in {e.draft_rank for e in ranked} and {e.draft_rank for e in ranked} <= {1, 2}
    for e in ranked:  # a second guess names the first, refused; a first guess nothing
        assert (e.rejected_id is not None) == (e.draft_rank == 2) and e.rejected_id != e.token_id
        assert (e.rejected_text is not None) == (e.draft_rank == 2)
    assert arm_config(SPEC_CHAIN, cfg).siblings == 0


def test_greedy_eagle_with_trees_decodes_what_plain_decodes() -> None:
    """--mode eagle with a random head (40 draft ids) and a second guess beside 2 of its 3
    drafts: plain's 40 tokens over two turns; its rounds verified the guesses."""
    from specchat.engine.config import Mode
    from specchat.engine.events import RoundEvent, TokenEvent
    from tests.tinymodels import chatml_tokenizer
    from tests.unit.test_eagle_head import random_head, session

    target = tiny_llama(seed=0, layers=4, tokenizer=chatml_tokenizer())
    native_or_skip(ModelRunner(target, CPU))
    cfg = DecodeConfig(mode=Mode.EAGLE, k=3, siblings=2, compose=False, max_new_tokens=40)
    chat, ref = session(target, random_head(target)), session(target, None)
    for prompt in ("one two three four one two", "three four"):
        events = list(chat.stream(prompt, cfg))
        plain = list(ref.stream(prompt, cfg.with_(mode=Mode.PLAIN)))
        ids = [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in (events, plain)]
        assert ids[0] == ids[1]
        assert any(isinstance(e, RoundEvent) and e.siblings == 2 for e in events)


def test_a_head_keeps_the_features_of_a_path_that_ended_on_a_second_guess() -> None:
    """After a tree round the target's cache holds the whole accepted path, and its features
    came with keep_path; the head's rollback to the chain's part must not drop them (else
    its catch_up runs the target again over the guess, a pass the round never priced)."""
    from specchat.engine.decode.head import HeadDrafter
    from tests.tinymodels import chatml_tokenizer
    from tests.unit.test_eagle_head import random_head

    target = tiny_llama(seed=0, layers=4, tokenizer=chatml_tokenizer())
    runner = ModelRunner(target, CPU)
    native_or_skip(runner)
    drafter = HeadDrafter(random_head(target), runner)
    seq = list(range(3, 15))
    runner.prefill(seq)  # features for seq[:-1]
    base = runner.cached
    runner.feed_tree(torch.tensor([seq[-1], 40, 41, 50]), (-1, 0, 1, 0))
    runner.keep_path(base, [0, 3])  # the path: the guess beside the first draft
    assert drafter.fresh == runner.cached == base + 2
    drafter.rollback(len(seq) + 0)  # the chain's part of the path: none of its drafts
    assert drafter.fresh == runner.cached  # the guess's features stay
    passes = []
    real = runner.feed
    runner.feed = lambda *a, **kw: passes.append(a) or real(*a, **kw)  # type: ignore[method-assign]
    drafter.catch_up([*seq, 50, 7])
    assert passes == []  # no target pass: the features were there
