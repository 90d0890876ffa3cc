"""`specchat train-draft` end to end on the real tiny model, as a user runs it.

The command trains a head for stories260k (5 layers, float32, one thread) within 40
seconds: greedy replies, a second round of sampled ones, standard-library answers,
training, validation, the head saved in the speculators layout. The test then loads
that head as the chat does and checks that greedy eagle decoding equals plain decoding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specchat.engine.config import DecodeConfig, Mode, ModelSpec
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import RoundEvent, TokenEvent
from specchat.engine.model.eagle_io import load_head
from specchat.engine.tools.train_draft import DataStore, split, weights_id
from specchat.engine.weights.loading import load_model
from tests.stories import STORIES, needs_stories

pytestmark = needs_stories


def test_train_draft_on_real_weights_saves_a_head_the_chat_decodes_exactly_with(tmp_path: Path) -> None:
    out = tmp_path / "head"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SPECCHAT_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable, "-m", "specchat.tui.cli", "train-draft", "--target", str(STORIES),
        "--minutes", "0.67", "--threads", "1", "--reply-tokens", "24", "--reply-rounds", "2",
        "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert "sampled (seed 1)" in run.stderr  # the second round's progress line

    # Both rounds asked every training prompt; the data says so and holds both replies.
    seqs, state = DataStore(out / "work").load()
    train_prompts = len(split()[0])
    assert state["asked"] == 2 * train_prompts
    replies = [s for s in seqs if s.reply and not s.held_out]
    assert len(replies) > train_prompts  # empty replies are skipped, so not exactly twice
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"

    # The target as the command loaded it: the head is keyed by its weights' SHA-256.
    target = load_model(ModelSpec(str(STORIES)), "target", cache_dir=tmp_path / "cache")
    head = load_head(out, target_sha256=weights_id(target), target_config=target.model.config)

    cfg = DecodeConfig(mode=Mode.EAGLE, max_new_tokens=32, k=3, compose=False)
    for prompt in ("Once upon a time", "Tom had a big red ball."):
        plain = [e.token_id for e in ChatSession(target).stream(prompt, cfg.with_(mode=Mode.PLAIN)) if isinstance(e, TokenEvent)]
        events = list(ChatSession(target, head=head).stream(prompt, cfg))
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == plain
        assert any(isinstance(e, RoundEvent) and e.k and e.drafter == "draft head" for e in events)
