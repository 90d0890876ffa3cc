"""The bigger Qwen2.5-Coder presets (3B, 7B, 14B): hub only, kept as the published GGUF
and loaded from it tensor by tensor; offline they say plainly that they cannot be
fetched, with what to do instead."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.errors import FetchError
from specchat.engine.events import LoadProgress
from specchat.engine.weights import fetch, registry
from specchat.engine.weights.loading import load_model
from tests.ggufs import write_gguf

BIGGER = ("qwen2.5-coder-3b-instruct", "qwen2.5-coder-7b-instruct", "qwen2.5-coder-14b-instruct")


def test_the_bigger_targets_are_presets_of_the_default_pairs_family() -> None:
    sizes = []
    for name in BIGGER:
        preset = registry.get(name)
        assert preset.as_gguf and preset.gguf is not None
        assert preset.gguf.hub_repo.startswith("Qwen/Qwen2.5-Coder-") and preset.gguf.file.endswith("-q4_k_m.gguf")
        assert not preset.gguf.mirror and not preset.gguf.pinned
        assert preset.licence and preset.homepage.startswith("https://huggingface.co/Qwen/")
        sizes.append((preset.params, preset.gguf.approx_size))
    assert sizes == sorted(sizes)
    assert registry.get("qwen2.5-coder-3b-instruct").licence.startswith("Qwen Research")
    assert registry.DEFAULT_PAIR == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def test_offline_a_bigger_target_says_it_cannot_be_fetched_here(
    tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "_hub_cached", lambda source: None)
    with pytest.raises(FetchError) as caught:
        fetch.resolve("qwen2.5-coder-7b-instruct")
    err = caught.value
    assert "cannot be fetched here" in err.message and "not reachable" in err.message
    assert "4.4 GiB" in err.message  # the file's size, so the user knows what to download
    assert "qwen2.5-coder-7b-instruct-q4_k_m.gguf" in err.hint and "--target" in err.hint
    with pytest.raises(FetchError, match="not in the Hugging Face cache"):
        fetch.resolve("qwen2.5-coder-7b-instruct", fetch=False)
    status = fetch.preset_status("qwen2.5-coder-7b-instruct")
    assert status.state == "absent" and "hub only" in status.detail


def test_a_bigger_target_in_the_hub_cache_loads_from_its_gguf(
    tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "hub" / "qwen2.5-coder-3b-instruct-q4_k_m.gguf"
    path.parent.mkdir()
    write_gguf(path, seed=11)
    monkeypatch.setattr(fetch, "_hub_cached", lambda source: path)
    resolved = fetch.resolve("qwen2.5-coder-3b-instruct")
    assert (resolved.pretrained, resolved.gguf_file) == (str(path.parent), path.name)
    assert resolved.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    events: list[LoadProgress] = []
    got = load_model(ModelSpec("qwen2.5-coder-3b-instruct", QuantMode.INT8, dtype="float32"), "target",
                     progress=events.append)  # fmt: skip
    assert any("layer by layer" in e.detail for e in events if e.stage == "quantize")
    assert got.info.name == "Qwen2.5-Coder-3B-Instruct"
    assert fetch.preset_status("qwen2.5-coder-3b-instruct").state == "ready"
    with pytest.raises(FetchError, match="Hugging Face cache"):
        fetch.remove_preset("qwen2.5-coder-3b-instruct")


def test_a_download_that_does_not_match_the_hubs_record_is_refused(
    tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unpinned file is checked against the sha256 the hub records for it."""
    import huggingface_hub

    got = tmp_path / "dl" / "qwen2.5-coder-7b-instruct-q4_k_m.gguf"
    got.parent.mkdir()
    got.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(fetch, "_hub_cached", lambda source: None)
    monkeypatch.setattr(fetch, "_hub_offline", lambda: False)
    monkeypatch.setattr(fetch, "hub_reachable", lambda timeout=2.0: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(got))
    record = SimpleNamespace(lfs=SimpleNamespace(sha256="0" * 64, size=64))
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", lambda self, *a, **k: [record])
    with pytest.raises(FetchError, match="does not match"):
        fetch.resolve("qwen2.5-coder-7b-instruct")
    assert not got.exists()  # a refused download is not left to pass as the model
    got.parent.joinpath(got.name).write_bytes(b"GGUF" + bytes(60))
    good = SimpleNamespace(lfs=SimpleNamespace(sha256=hashlib.sha256(got.read_bytes()).hexdigest(), size=64))
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", lambda self, *a, **k: [good])
    assert fetch.published_gguf(registry.get("qwen2.5-coder-7b-instruct")) == got
