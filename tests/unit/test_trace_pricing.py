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


def _prompt(prompt: list[int], reply: list[int], match: list[int]) -> dict:
    return {"ids": prompt + reply, "prompt_tokens": len(prompt), "match": match}


FEED = {1: 1.0, 48: 1.0}  # a catch-up pass of any length: one step


def test_composition_without_a_copy_prices_as_the_model_alone(trace: ModuleType) -> None:
    # No 2-gram of the reply occurred before: the lookup never drafts, so composed is the
    # model's rounds exactly, and lookup alone is plain decoding.
    rng = random.Random(1)
    prompt = list(range(1000, 1040))
    reply = list(range(2000, 2120))
    match = [int(rng.random() < 0.8) for _ in reply]
    p = _prompt(prompt, reply, match)
    verify = {k: 1.0 + 0.1 * k for k in range(1, 9)}
    cheap = {1: 0.4, 48: 0.4}  # a pass costs a draft step, however long: reads pay back
    model, _ = trace.replay_composed(p, "model", 0.4, verify, cheap)
    composed, rounds = trace.replay_composed(p, "composed", 0.4, verify, cheap)
    lookup, _ = trace.replay_composed(p, "lookup", 0.4, verify, cheap)
    assert rounds["copy"] == 0 and composed == pytest.approx(model)
    assert lookup == pytest.approx(1.0)
    # A prompt read dearer than the model's rounds can save in 120 tokens (40 + 0.8 a
    # token: 72 steps): composed declines it, as the session does, and runs plain.
    dear = {1: 0.4, 24: 19.2, 48: 38.4}
    declined, rounds = trace.replay_composed(p, "composed", 0.4, verify, dear)
    assert rounds["model"] == 0 and declined == pytest.approx(1.0)
    assert trace.replay_composed(p, "model", 0.4, verify, dear)[0] < 1.0


def test_a_reply_that_copies_the_prompt_is_drafted_by_the_lookup(trace: ModuleType) -> None:
    # The reply repeats the prompt and the draft model never agrees: copies carry the
    # reply, the model's rounds lose (a draft that is always refused costs c and v).
    prompt = list(range(1000, 1120))
    reply = prompt[:100]
    p = _prompt(prompt, reply, [0] * len(reply))
    verify = {k: 1.0 + 0.05 * k for k in range(1, 9)}
    model, _ = trace.replay_composed(p, "model", 0.4, verify, FEED)
    composed, rounds = trace.replay_composed(p, "composed", 0.4, verify, FEED)
    assert model < 1.0 < composed
    assert rounds["copy"] > 0 and rounds["copy_accepted"] == rounds["copy_drafted"]
