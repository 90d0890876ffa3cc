"""float32 on real weights (stories260k): speculation equals plain decoding bit for bit.

Token identity alone would pass by luck here: rounding differences of ~1e-6
rarely flip a greedy choice on this model. So these tests also compare what
rounding does move: each verify-block row's logits against the one-token
step's (torch.equal), and the target probability of every emitted token,
which is computed from the logits of its own row. With float projections fed
as a whole block through MKL, both differ in the low bits (p_target by ~2e-6
on these prompts); through the fixed-order kernel or with rows apart, they
are equal.
"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import TokenEvent
from specchat.engine.model import decoder, invariance
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import layer_truncated
from tests.stories import load_stories, needs_stories
from tests.tinymodels import loaded, native_or_skip

pytestmark = needs_stories

PROMPTS = [
    "Once upon a time",
    "Tom and Lily went to the park",
    "The little dog",
    "One day, a bird",
    "Sue had a red ball",
]
MODES = [
    (Mode.SPEC, {"k": 4}),
    (Mode.SPEC, {"k": None}),  # the controller's K
    (Mode.SELF_SPEC, {"k": 3, "exit_layer": 2}),
    (Mode.LOOKUP, {"k": 3}),
]


@pytest.fixture(scope="module")
def stories() -> tuple[torch.nn.Module, object]:
    model, tok = load_stories()
    assert next(model.parameters()).dtype == torch.float32  # type: ignore[attr-defined]
    return model, tok  # type: ignore[return-value]


@pytest.mark.parametrize("setting", ["1", "apart"], ids=["default", "rows-apart"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
def test_verify_block_rows_equal_one_token_steps(
    stories: tuple, native: bool, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By the fixed-order kernel where this CPU has one (default), and by rows apart."""
    monkeypatch.setenv(invariance.ENV, setting)
    model, _ = stories
    runner = ModelRunner(model, torch.device("cpu"))
    assert runner.exactness.identical, runner.exactness
    if native:
        native_or_skip(runner)
    else:
        runner.native = None
    prompt = list(range(20, 60))
    for n in (2, 5, 9, 32):
        runner.reset()
        runner.feed(prompt)
        tokens = [(13 * i + 5) % 500 + 3 for i in range(n)]
        steps = [runner.feed([t])[-1] for t in tokens]
        runner.crop_to(len(prompt))
        block = runner.feed(tokens, keep=n)  # [n, V]: a verify pass keeps k+1 rows
        for i, step in enumerate(steps):
            assert torch.equal(block[i], step), (n, i, float((block[i] - step).abs().max()))


def greedy(
    model: torch.nn.Module, tok: object, prompt: str, mode: Mode, **kw: object
) -> tuple[list[int], list[float | None]]:
    draft = None
    if mode is Mode.SPEC:
        draft = loaded(layer_truncated(model, 4), "draft", tokenizer=tok)
    session = ChatSession(loaded(model, tokenizer=tok), draft)
    cfg = DecodeConfig(mode=mode, max_new_tokens=64, **kw)  # type: ignore[arg-type]
    events = [e for e in session.stream(prompt, cfg) if isinstance(e, TokenEvent)]
    return [e.token_id for e in events], [e.p_target for e in events]


@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
def test_greedy_speculation_equals_plain_token_and_probability(
    stories: tuple, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec, self-spec and lookup against plain over 5 prompts, 64 tokens each.

    p_target comes from softmax over the 512-token vocabulary of the token's own
    row; ATen reduces rows that short one at a time, in one order, so equal
    logits give equal probabilities and a difference in the logits shows.
    """
    model, tok = stories
    if not native:
        monkeypatch.setenv(decoder.ENV, "0")
    for prompt in PROMPTS:
        plain_ids, plain_p = greedy(model, tok, prompt, Mode.PLAIN)
        for mode, kw in MODES:
            ids, p = greedy(model, tok, prompt, mode, **kw)
            assert ids == plain_ids, (prompt, mode, kw)
            assert p == plain_p, (prompt, mode, kw)


def test_ab_says_identity_is_guaranteed_and_holds_it(stories: tuple) -> None:
    """`specchat ab` on float32: identity by design, and a near-tie would not be excused."""
    from rich.console import Console

    from specchat.engine.tools.ab import run_ab
    from specchat.engine.tools.bench_runs import BenchPrompt
    from specchat.tui.commands.ab import print_ab

    model, tok = stories
    draft = loaded(layer_truncated(model, 4), "draft", tokenizer=tok)
    session = ChatSession(loaded(model, tokenizer=tok), draft)
    prompts = [BenchPrompt(f"p{i}", "chat", p) for i, p in enumerate(PROMPTS[:2])]
    result = run_ab(session, prompts, "plain", "spec", max_new_tokens=24)
    assert result.identity and "float32" in result.identity_reason
    assert result.ok and all(c.verdict == "identical" for c in result.comparisons)
    console = Console(record=True, width=200)
    print_ab(result.to_dict(), tok, console)
    assert "token identity guaranteed" in console.export_text()
    result.comparisons[0].verdict = "near-tie"  # what a tie broken differently would show
    assert not result.ok
    baseline = run_ab(session, prompts[:1], "plain", "hf-generate", max_new_tokens=8)
    assert not baseline.identity and "up to floating-point ties" in baseline.identity_reason
