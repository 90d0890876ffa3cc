"""scripts/accept_trace.py's offline pricing of chains, sibling trees and full trees."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "accept_trace.py"


@pytest.fixture(scope="module")
def trace() -> ModuleType:
    spec = importlib.util.spec_from_file_location("accept_trace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLAT = {n: 1.0 for n in range(1, 40)}  # every verify pass and draft pass one step


def test_a_fully_accepted_chain_emits_k_plus_one_a_round(trace: ModuleType) -> None:
    # 12 positions, K=2, free drafts: four rounds of three tokens at one step each.
    assert trace.replay_tree([0] * 12, 2, 0, 1, 0.0, 1.0) == pytest.approx(3.0)
    assert trace.replay_full_tree([0] * 12, [1, 1], 0.0, FLAT, FLAT) == pytest.approx(3.0)


def test_width_one_trees_are_the_chain(trace: ModuleType) -> None:
    rng = random.Random(0)
    ranks = [rng.choice([0, 0, 0, 1, 2, 5]) for _ in range(300)]
    for k in (1, 2, 4):
        chain = trace.replay_tree(ranks, k, 0, 1, 0.3, 1.5)
        assert trace.replay_tree(ranks, k, k, 1, 0.3, 1.5) == pytest.approx(chain)
        same = {n: 1.5 for n in range(1, 40)}
        assert trace.replay_full_tree(ranks, [1] * k, 0.3, same, FLAT) == pytest.approx(chain)


def test_a_sibling_holding_the_target_token_is_accepted_with_a_bonus(trace: ModuleType) -> None:
    # The draft's 2nd guess is right everywhere: K=1 is corrected every round, a
    # sibling at depth 1 is taken with the bonus after it, and a full tree keeps
    # going under each sibling.
    ranks = [1] * 40
    assert trace.replay_tree(ranks, 1, 0, 1, 0.0, 1.0) == pytest.approx(1.0)
    assert trace.replay_tree(ranks, 1, 1, 2, 0.0, 1.0) == pytest.approx(2.0)
    assert trace.replay_full_tree(ranks, [2], 0.0, FLAT, FLAT) == pytest.approx(2.0)
    three = trace.replay_full_tree(ranks, [2, 2], 0.0, FLAT, FLAT)
    assert three == pytest.approx(40 / 14)  # 13 rounds of three tokens, then a plain step
    # A third guess is beyond width 2.
    assert trace.replay_tree([2] * 40, 1, 1, 2, 0.0, 1.0) == pytest.approx(1.0)
    # Priced rows make the tree lose where its rows cost more than its tokens.
    assert trace.replay_tree(ranks, 1, 1, 2, 0.0, 2.5) < 1.0
