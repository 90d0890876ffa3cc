"""The real tiny model in ../shared/models/stories260k (skip with a reason when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORIES = Path(
    os.environ.get("SPECCHAT_STORIES260K", ROOT.parent / "shared" / "models" / "stories260k")
)

needs_stories = pytest.mark.skipif(
    not (STORIES / "model.safetensors").is_file(),
    reason=f"real tiny model not found at {STORIES} (the shared models folder is absent)",
)


def load_stories() -> tuple[object, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return model.requires_grad_(False), tok
