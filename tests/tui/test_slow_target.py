"""The app on a real engine whose target is slow: Qwen2.5-Coder-7B's widths (three decoder
layers, random w4a8 weights, the tiny tokenizer's ids) drafted by a 0.5B-shaped model.
While it decodes, the panels follow the rounds, keys are handled, and Esc ends the reply:
each checked while the reply is still streaming, so a UI thread that waited for the
engine would fail here rather than be slow."""

from __future__ import annotations

from typing import Any

from tui_helpers import SIZE, make_app, ready, wait_until

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import Cancelled
from specchat.engine.tools import shaped
from specchat.engine.weights.loading import LoadedModel
from specchat.tui.panels import AcceptancePanel, DevicesPanel
from tests.tinymodels import loaded, native_or_skip, tiny_tokenizer

MAX_TOKENS = 1000  # far more than the test lets it write: the reply must still be going


def _text(widget: Any) -> str:
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(widget.render())
    return console.export_text()


async def test_panels_keys_and_cancel_work_while_a_slow_target_decodes(monkeypatch: Any) -> None:
    vocab = len(tiny_tokenizer())
    target = shaped.build(shaped.SHAPES["7b"], 3, vocab=vocab, seed=0, std=0.05)
    draft = shaped.build(shaped.SHAPES["0.5b"], 2, vocab=vocab, seed=1, std=0.05)
    # no id ends the reply: a random model could say </s> at any point
    monkeypatch.setattr(LoadedModel, "eos_ids", property(lambda self: frozenset()))
    session = ChatSession(loaded(target), loaded(draft, "draft"))
    native_or_skip(session.target_runner)
    decode = DecodeConfig(mode=Mode.SPEC, k=3, compose=False, max_new_tokens=MAX_TOKENS, seed=0)
    app = make_app(session, decode=decode)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"Once upon a time", "enter")
        reply_views = lambda: list(app.query("ReplyView"))  # noqa: E731
        await wait_until(pilot, lambda: bool(reply_views()) and len(reply_views()[0].tokens) >= 8, timeout=60)
        reply = reply_views()[0]
        acceptance = app.query_one(AcceptancePanel)
        await wait_until(pilot, lambda: "drafts" in _text(acceptance), timeout=30)
        seen = _text(acceptance)
        # the panel follows the rounds as they come
        await wait_until(pilot, lambda: _text(acceptance) != seen, timeout=30)
        assert not reply.finished
        # a key is handled between rounds
        devices = app.query_one(DevicesPanel)
        assert not devices.display
        await pilot.press("f4")
        await wait_until(pilot, lambda: bool(devices.display), timeout=10)
        assert not reply.finished
        # and Esc ends the reply at the next round, keeping what came
        await pilot.press("escape")
        await wait_until(pilot, lambda: reply.finished, timeout=30)
        assert isinstance(reply.outcome, Cancelled)
        assert 8 <= len(reply.tokens) < MAX_TOKENS
        assert app._busy is None
