"""The self-speculative draft: the target's first E layers draft, the full target verifies."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.early_exit import SelfSpecDrafter
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.speculative import plain_step, speculative_round
from specchat.engine.events import Provenance, TokenEvent, TurnFinished
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import loaded, tiny_llama

PROMPTS = ("Once upon a time", "def add(a, b):")
N = 16


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, max_positions=256)


def chat(target: torch.nn.Module, cfg: DecodeConfig) -> tuple[list[TokenEvent], list[TurnFinished]]:
    """Two turns through ChatSession (the second reuses the first's cache)."""
    session = ChatSession(loaded(target))
    tokens: list[TokenEvent] = []
    done: list[TurnFinished] = []
    for prompt in PROMPTS:
        for ev in session.stream(prompt, cfg):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            elif isinstance(ev, TurnFinished):
                done.append(ev)
    assert len(done) == len(PROMPTS)
    return tokens, done


@pytest.fixture(scope="module")
def plain(target: torch.nn.Module) -> list[int]:
    tokens, _ = chat(target, DecodeConfig(mode=Mode.PLAIN, max_new_tokens=N))
    return [t.token_id for t in tokens]


A, C, B = Provenance.ACCEPTED, Provenance.CORRECTED, Provenance.BONUS


# What each run must show (greedy and seeded, so fixed): drafts accepted and refused, and a
# bonus where K = 1. The first layer alone never agrees with the full target here.
@pytest.mark.parametrize(
    ("k", "exit_layer", "must"),
    [(1, 2, {A, C, B}), (3, 2, {A, C}), (5, 2, {A, C}), (4, 1, {C}), (2, 3, {A, C})],
)
def test_greedy_self_spec_equals_plain_greedy(
    target: torch.nn.Module, plain: list[int], k: int, exit_layer: int, must: set[Provenance]
) -> None:
    cfg = DecodeConfig(mode=Mode.SELF_SPEC, k=k, exit_layer=exit_layer, max_new_tokens=N)
    tokens, done = chat(target, cfg)
    assert [t.token_id for t in tokens] == plain
    assert all(d.stats.mode is Mode.SELF_SPEC for d in done)
    assert all(d.stats.drafted > 0 for d in done)
    kinds = {t.provenance for t in tokens}
    assert must <= kinds, f"missing {must - kinds}"
    assert kinds <= {
        Provenance.ACCEPTED,
        Provenance.CORRECTED,
        Provenance.BONUS,
        Provenance.TARGET,  # the controller may fall back to plain steps
    }


def test_adaptive_k_and_default_depth(target: torch.nn.Module, plain: list[int]) -> None:
    tokens, _ = chat(target, DecodeConfig(mode=Mode.SELF_SPEC, max_new_tokens=N))
    assert [t.token_id for t in tokens] == plain


def test_full_depth_draft_is_always_accepted(target: torch.nn.Module, plain: list[int]) -> None:
    """E = L drafts with the target itself: every greedy draft token is accepted."""
    tokens, done = chat(
        target, DecodeConfig(mode=Mode.SELF_SPEC, k=3, exit_layer=4, max_new_tokens=N)
    )
    assert [t.token_id for t in tokens] == plain
    assert all(d.stats.acceptance_rate == 1.0 for d in done)


@pytest.mark.parametrize("shared", [True, False])
def test_both_cache_designs_keep_the_target_cache_whole(
    target: torch.nn.Module, shared: bool
) -> None:
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = SelfSpecDrafter(loaded(target), 2, runner=runner if shared else None)
    cfg = DecodeConfig(mode=Mode.SELF_SPEC)
    seq = [1, 40, 41, 42, 43]
    runner.prefill(seq)
    ref_runner = ModelRunner(target, torch.device("cpu"))
    ref = list(seq)
    ref_runner.prefill(ref)
    while len(seq) < 5 + N:
        res = speculative_round(runner, drafter, seq, 3, cfg, None)
        seq += [e.token_id for e in res.tokens]
        assert [layer.get_seq_length() for layer in runner.cache.layers] == [runner.cached] * 4
        if not shared:
            assert drafter.cached <= len(seq)
    while len(ref) < len(seq):
        ref.append(plain_step(ref_runner, ref, cfg, None).tokens[0].token_id)
    assert seq == ref


def test_sampled_self_spec_is_seeded(target: torch.nn.Module) -> None:
    cfg = DecodeConfig(
        mode=Mode.SELF_SPEC, k=3, exit_layer=2, temperature=0.9, seed=3, max_new_tokens=12
    )
    a, _ = chat(target, cfg)
    b, _ = chat(target, cfg)
    assert [t.token_id for t in a] == [t.token_id for t in b]


def test_exit_layer_is_checked(target: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="exit_layer"):
        SelfSpecDrafter(loaded(target), 0)
    with pytest.raises(ValueError, match="exit_layer"):
        SelfSpecDrafter(loaded(target), 5)
