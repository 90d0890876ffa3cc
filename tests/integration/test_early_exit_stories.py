"""Early exit and self-speculation on the real tiny model (stories260k, 5 layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.exit_policy import load_calibration, policy_for
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import Provenance, TokenEvent, TurnFinished
from specchat.engine.tools.calibration import collect
from specchat.engine.weights.loading import LoadedModel, describe
from tests.stories import STORIES, load_stories, needs_stories

pytestmark = [needs_stories, pytest.mark.slow]

STORY_PROMPTS = (
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball. He liked to",
    "One day, a cat and a dog went to the park.",
    "The sun was shining and the birds",
)


@pytest.fixture(scope="module")
def stories() -> LoadedModel:
    model, tok = load_stories()
    cpu = torch.device("cpu")
    info = describe(
        model, "target", "stories260k", str(STORIES), cpu, torch.float32, QuantMode.NONE
    )  # type: ignore[arg-type]
    return LoadedModel(model, tok, cpu, torch.float32, info)  # type: ignore[arg-type]


def reply(
    session: ChatSession, prompt: str, cfg: DecodeConfig
) -> tuple[list[TokenEvent], TurnFinished]:
    events = list(session.stream(prompt, cfg))
    (done,) = [e for e in events if isinstance(e, TurnFinished)]
    return [e for e in events if isinstance(e, TokenEvent)], done


def test_calibrate_then_exit(stories: LoadedModel, tmp_cache: Path) -> None:
    chats = [[{"role": "user", "content": p}] for p in STORY_PROMPTS]
    cal = collect(stories, chats, layers=(2, 3, 4), new_tokens=32)
    cal.save()
    loaded_cal = load_calibration(stories)
    assert loaded_cal is not None and loaded_cal.positions == cal.positions
    # Deeper exit layers agree more often with the final layer.
    agree = [float(cal.records[layer].agree.mean()) for layer in cal.layers]
    assert agree == sorted(agree) and agree[-1] > agree[0]
    for budget in (0.5, 0.8, 0.95):
        s = loaded_cal.summary(budget)
        assert s.agreement >= budget, s
    raw = [loaded_cal.thresholds(b) for b in (0.5, 0.8, 0.95)]
    assert all(
        lo <= hi for a, b in zip(raw, raw[1:], strict=False) for lo, hi in zip(a, b, strict=True)
    )

    session = ChatSession(stories)
    cfg = DecodeConfig(mode=Mode.EARLY_EXIT, max_new_tokens=24, exit_budget=0.5)
    assert policy_for(session.target, cfg).source == "calibrated"
    tokens, done = reply(session, "Once upon a time", cfg)
    assert done.stats.early_exits == sum(t.provenance is Provenance.EARLY_EXIT for t in tokens)
    assert done.stats.mean_layers is not None and done.stats.mean_layers <= 5.0

    # A threshold given on the command line overrides the calibration: exits happen and say where.
    cfg = cfg.with_(exit_threshold=0.3)
    tokens, done = reply(session, "Tom went to the park.", cfg)
    exits = [t for t in tokens if t.provenance is Provenance.EARLY_EXIT]
    assert exits and done.stats.early_exits == len(exits)
    assert all(
        t.exit_layer in (2, 3, 4) and t.confidence is not None and t.confidence >= 0.3
        for t in exits
    )
    assert done.stats.mean_layers is not None and done.stats.mean_layers < 5.0


def test_self_spec_greedy_equals_plain_greedy(stories: LoadedModel) -> None:
    def run(cfg: DecodeConfig) -> list[int]:
        session = ChatSession(stories)
        out: list[int] = []
        for prompt in STORY_PROMPTS[:2]:
            tokens, _ = reply(session, prompt, cfg)
            out += [t.token_id for t in tokens]
        return out

    plain = run(DecodeConfig(mode=Mode.PLAIN, max_new_tokens=32))
    for k, layer in ((2, 3), (4, 4), (3, 2)):
        cfg = DecodeConfig(mode=Mode.SELF_SPEC, k=k, exit_layer=layer, max_new_tokens=32)
        assert run(cfg) == plain, (k, layer)
