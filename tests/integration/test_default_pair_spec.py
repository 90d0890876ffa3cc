"""The embedded default pair, end to end: speculative greedy output equals plain, acceptance is high.

Float32 on the CPU (exactness needs it); 32 new tokens of a code prompt.
test_default_pair_quantized.py does the same with the default quantization.
Needs the pair in the cache (the test command runs `specchat models fetch`
first); skips with the reason otherwise.
"""

from __future__ import annotations

import pytest

from specchat.engine.config import DecodeConfig, Mode, ModelSpec, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.errors import FetchError
from specchat.engine.events import TokenEvent, TurnFinished
from specchat.engine.weights import fetch, registry

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function is_palindrome(s) that ignores case and punctuation."


def load_pair(quant: QuantMode | None) -> ChatSession:
    target, draft = registry.DEFAULT_PAIR
    try:
        for name in (target, draft):
            fetch.resolve(name, fetch=False)
    except FetchError as exc:
        pytest.skip(f"default pair not cached: {exc.message}")
    return ChatSession.load(
        ModelSpec(target, quant, dtype="float32"), ModelSpec(draft, quant, dtype="float32")
    )


@pytest.fixture(scope="module")
def session() -> ChatSession:
    return load_pair(QuantMode.NONE)


def reply(session: ChatSession, cfg: DecodeConfig) -> tuple[list[int], TurnFinished]:
    session.reset()
    events = list(session.stream(PROMPT, cfg))
    fin = events[-1]
    assert isinstance(fin, TurnFinished), fin
    return [e.token_id for e in events if isinstance(e, TokenEvent)], fin


def test_greedy_speculative_equals_plain_on_the_default_pair(session: ChatSession) -> None:
    plain, p = reply(session, DecodeConfig(mode=Mode.PLAIN, max_new_tokens=32))
    spec, s = reply(session, DecodeConfig(mode=Mode.SPEC, k=4, max_new_tokens=32))
    assert spec == plain
    assert len(plain) == 32
    assert "is_palindrome" in p.stats.text  # the reply opens with prose, then the code
    assert s.stats.acceptance_rate is not None and s.stats.acceptance_rate > 0.5
    print(
        f"\nplain {p.stats.tokens_per_s:.2f} tok/s, spec {s.stats.tokens_per_s:.2f} tok/s, "
        f"acceptance {s.stats.acceptance_rate:.2f}, tokens/round {s.stats.mean_accepted_length:.2f}"
    )


@pytest.fixture(scope="module")
def plain_reply(session: ChatSession) -> list[int]:
    return reply(session, DecodeConfig(mode=Mode.PLAIN, max_new_tokens=32))[0]


@pytest.mark.parametrize("mode", [Mode.LOOKUP, Mode.SELF_SPEC])
def test_every_lossless_mode_equals_plain_in_float32_by_design(
    session: ChatSession, plain_reply: list[int], mode: Mode
) -> None:
    """Not by luck: the target's runner states that its verify blocks score as its steps."""
    assert session.target_runner.exactness.identical, session.target_runner.exactness.reason
    got, fin = reply(session, DecodeConfig(mode=mode, k=4, max_new_tokens=32))
    assert got == plain_reply
    if mode is Mode.SELF_SPEC:  # self-spec drafts every round; lookup only where it matches
        assert fin.stats.rounds < 32
