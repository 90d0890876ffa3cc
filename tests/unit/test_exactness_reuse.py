"""A chat template keeps the conversation a prefix of the next turn: turn 2 reuses all of turn 1.

With a ChatML template (Qwen's layout) a turn's prompt is the conversation
so far, then the new user message and the glue around it. When the reply's
tokens are what the next rendering holds (the tiny ChatML tokenizer has one
token per character, so they always are), the caches hold turn 1 whole and
turn 2 prefills only the new message and its glue. The tiny tokenizers
without a template never reach this: their rendering joins turns with
newlines that the cached tokens lack.
"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import TokenEvent, TurnFinished, TurnStarted
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import chatml_tokenizer, loaded, tiny_llama

FIRST, SECOND = "Tell me a story.", "And then?"


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    """Seed 5: a reply of varied characters and no special tokens (checked below)."""
    return tiny_llama(seed=5, layers=4, tokenizer=chatml_tokenizer())


def chat(target: torch.nn.Module) -> ChatSession:
    tok = chatml_tokenizer()
    draft = layer_truncated(target, 2)
    return ChatSession(loaded(target, tokenizer=tok), loaded(draft, "draft", tokenizer=tok))


def turn(session: ChatSession, prompt: str, cfg: DecodeConfig) -> tuple[TurnStarted, list[int]]:
    events = list(session.stream(prompt, cfg))
    started, done = events[0], events[-1]
    assert isinstance(started, TurnStarted) and isinstance(done, TurnFinished), events[-1]
    return started, [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.SPEC])
def test_turn_two_reuses_all_of_turn_one_and_answers_as_a_fresh_session(
    target: torch.nn.Module, mode: Mode
) -> None:
    """Greedy, 24 tokens a reply, K = 3 with a 2-of-4-layer draft in spec mode."""
    tok = chatml_tokenizer()
    cfg = DecodeConfig(mode=mode, k=3, max_new_tokens=24)
    session = chat(target)
    assert session.has_template
    started1, reply1 = turn(session, FIRST, cfg)
    assert started1.new_prompt_tokens == started1.prompt_tokens  # nothing cached yet
    # The precondition of full reuse: a reply of ordinary characters, cut by the limit
    # (no <|im_end|>), which the template closes with <|im_end|> in the next rendering.
    assert len(reply1) == 24 and min(reply1) >= len(tok.all_special_ids), reply1
    assert len(set(reply1)) > 3, "a reply of one repeated character shows little"
    turn1 = session.tokens  # turn 1's prompt and reply: what the caches follow
    assert len(turn1) == started1.prompt_tokens + 24

    started2, reply2 = turn(session, SECOND, cfg)
    glue = f"<|im_end|>\n<|im_start|>user\n{SECOND}<|im_end|>\n<|im_start|>assistant\n"
    new = tok(glue, add_special_tokens=False)["input_ids"]
    assert session.tokens[: len(turn1)] == turn1
    assert started2.prompt_tokens == len(turn1) + len(new)
    assert started2.new_prompt_tokens == len(new), (
        f"turn 2 prefilled {started2.new_prompt_tokens} tokens; the new message and its "
        f"glue are {len(new)}: {len(turn1) + len(new) - started2.new_prompt_tokens} of "
        f"turn 1's {len(turn1)} were reused"
    )

    fresh = chat(target)
    fresh.reset(session.messages[:2])
    started_fresh, reply_fresh = turn(fresh, SECOND, cfg)
    assert started_fresh.new_prompt_tokens == started_fresh.prompt_tokens == started2.prompt_tokens
    assert reply2 == reply_fresh
