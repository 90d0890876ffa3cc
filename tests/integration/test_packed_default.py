"""The packed-weight cache on the embedded default draft (Qwen2.5-Coder-0.5B, w4a8 where
the kernel runs, else the automatic mode): the second load comes from the cache, with
the same logits bit for bit and the same tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from specchat.engine import paths
from specchat.engine.config import ModelSpec
from specchat.engine.errors import FetchError
from specchat.engine.events import LoadProgress
from specchat.engine.weights import fetch, packed, registry
from specchat.engine.weights.loading import load_model

pytestmark = pytest.mark.slow


def test_the_default_draft_loads_from_the_packed_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = registry.DEFAULT_PAIR[1]
    try:
        fetch.resolve(name, fetch=False)
    except FetchError as exc:
        pytest.skip(f"default pair not cached: {exc.message}")
    monkeypatch.setenv(packed.ENV, "1")
    monkeypatch.setattr(paths, "packed_dir", lambda cache_dir=None: tmp_path / "packed")
    runs = []
    for _ in range(2):
        events: list[LoadProgress] = []
        t0 = time.perf_counter()
        got = load_model(ModelSpec(name, None, dtype="float32"), "draft", progress=events.append)
        runs.append((got, events, time.perf_counter() - t0))
    (first, e1, t1), (second, e2, t2) = runs
    assert any(e.stage == "quantize" for e in e1) and any(e.stage == "cache" and "kept" in e.detail for e in e1)
    assert not any(e.stage == "quantize" for e in e2)
    assert any("packed weights from the cache" in e.detail for e in e2)
    ids = first.tokenizer("def is_palindrome(s):", return_tensors="pt")["input_ids"]
    assert second.tokenizer("def is_palindrome(s):", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert second.info == first.info
    print(f"\n{first.info.quant} {name}: first load {t1:.1f} s (packed and kept), second {t2:.1f} s")
