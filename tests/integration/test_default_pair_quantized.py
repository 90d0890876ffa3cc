"""The embedded default pair as `specchat` runs it on a CPU: the automatic quantization
(w4a8 target and draft on x86 with AVX2), greedy speculative output equal to plain output
of the same quantized target. Its own module, so the float32 pair of test_default_pair_spec.py
is released before this one loads.
"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.events import RoundEvent, TokenEvent
from specchat.engine.weights import loading
from tests.integration.test_default_pair_spec import PROMPT, load_pair, reply

pytestmark = pytest.mark.slow


def test_greedy_speculative_equals_plain_with_the_default_quantization() -> None:
    session = load_pair(None)
    cpu = torch.device("cpu")
    assert session.target.info.quant == loading.default_quant("target", cpu, 1_500_000_000)
    assert session.draft is not None
    assert session.draft.info.quant == loading.default_quant("draft", cpu, 500_000_000)
    plain, p = reply(session, DecodeConfig(mode=Mode.PLAIN, max_new_tokens=32))
    spec, s = reply(session, DecodeConfig(mode=Mode.SPEC, k=4, max_new_tokens=32))
    assert spec == plain
    assert len(plain) == 32
    assert "is_palindrome" in p.stats.text
    assert s.stats.acceptance_rate is not None and s.stats.acceptance_rate > 0.5
    # The draft ahead on a core of its own (engine/decode/ahead.py), whatever the load chose.
    chose = session.drafts_ahead
    session.set_ahead(True)
    try:
        ahead, a = reply(session, DecodeConfig(mode=Mode.SPEC, max_new_tokens=32))
    finally:
        session.set_ahead(chose)
    assert ahead == plain
    assert a.stats.acceptance_rate is not None and a.stats.acceptance_rate > 0.5
    # Draft trees: the draft's second guess beside its first three (engine/decode/tree.py);
    # a turn that asks for them drafts serially, whatever the way ahead was set to.
    session.set_ahead(True)
    session.reset()
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, siblings=3, max_new_tokens=32)
    events = list(session.stream(PROMPT, cfg))
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == plain
    assert any(isinstance(e, RoundEvent) and e.siblings == 3 for e in events)
    session.set_ahead(chose)
    # A prompt's small ops on one torch thread, the kernel on all (runner.kernel_only): on
    # the real widths (45 x 8,960 values, which torch splits over its threads) the same bits.
    runner = session.target_runner
    assert runner.kernel_only
    prompt = [(37 * i) % 5000 + 100 for i in range(45)]
    logits = []
    for alone in (True, False):
        runner.kernel_only = alone
        runner.reset()
        logits.append(runner.feed(prompt, keep=4))
    runner.kernel_only = True
    runner.reset()
    assert torch.equal(logits[0], logits[1])
    print(
        f"\n{session.target.info.quant}: plain {p.stats.tokens_per_s:.2f} tok/s, "
        f"spec {s.stats.tokens_per_s:.2f} tok/s, acceptance {s.stats.acceptance_rate:.2f}"
    )
