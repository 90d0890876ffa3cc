"""A target of Qwen2.5-Coder-7B's widths with a draft of the 0.5B's (two decoder layers each,
random weights in w4a8, the tiny tokenizer's 320 ids): the chat decodes and speculates
with them, and greedy speculation equals plain decoding token for token."""

from __future__ import annotations

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import TokenEvent
from specchat.engine.tools import shaped
from tests.tinymodels import loaded, native_or_skip, tiny_tokenizer, turn_finished


def test_a_7b_shaped_target_speculates_with_a_0_5b_shaped_draft_exactly() -> None:
    vocab = len(tiny_tokenizer())
    target = shaped.build(shaped.SHAPES["7b"], 2, vocab=vocab, seed=0, std=0.05)
    draft = shaped.build(shaped.SHAPES["0.5b"], 2, vocab=vocab, seed=1, std=0.05)
    assert target.config.hidden_size == 3584 and target.config.intermediate_size == 18944
    session = ChatSession(loaded(target), loaded(draft, "draft"))
    native_or_skip(session.target_runner)
    replies = {}
    for mode in (Mode.PLAIN, Mode.SPEC):
        session.reset()
        cfg = DecodeConfig(mode=mode, k=3, compose=False, max_new_tokens=12, seed=0)
        events = list(session.stream("Once upon a time", cfg))
        replies[mode] = [e.token_id for e in events if isinstance(e, TokenEvent)]
        stats = turn_finished(events).stats
        assert 0 < stats.tokens <= 12
        if mode is Mode.SPEC:
            assert stats.drafted > 0 and stats.rounds < stats.tokens + 1  # the draft model ran
    assert replies[Mode.SPEC] == replies[Mode.PLAIN]
    assert session.target_runner.exactness.identical
