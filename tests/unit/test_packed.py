"""The packed-weight cache (engine/weights/packed.py): a second load of the same weights
reads the packed model instead of quantizing (seen in the load's reported stages), gives
the same model bit for bit, and is rebuilt when the weights or the packing code change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from specchat.engine import paths
from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.errors import QuantizationError
from specchat.engine.events import LoadProgress
from specchat.engine.model import quant
from specchat.engine.weights import packed
from specchat.engine.weights.loading import load_model
from tests.ggufs import write_gguf
from tests.tinymodels import tiny_tokenizer

CPU = torch.device("cpu")
PROMPT = torch.tensor([[5, 9, 11, 40, 41, 42, 9, 11]])


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packed.ENV, "1")  # the suite turns it off elsewhere (conftest)


def folder_model(path: Path, seed: int = 1) -> Path:
    config = Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def load(source: Path, mode: QuantMode, cache: Path) -> tuple[object, list[LoadProgress]]:
    events: list[LoadProgress] = []
    got = load_model(ModelSpec(str(source), mode, dtype="float32"), "target", cache_dir=cache, progress=events.append)
    return got, events


def quantized(events: list[LoadProgress]) -> bool:
    return any(e.stage == "quantize" for e in events)


def from_cache(events: list[LoadProgress]) -> bool:
    return any("packed weights from the cache" in e.detail for e in events)


def logits(loaded: object) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(PROMPT).logits  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", [QuantMode.W4A8, QuantMode.W8A8, QuantMode.INT8, QuantMode.INT4])
def test_the_second_load_reads_the_packed_model_and_equals_the_first(tmp_path: Path, mode: QuantMode) -> None:
    source = folder_model(tmp_path / "m")
    try:
        quant.check(mode, Qwen2Config.from_pretrained(source), CPU)
    except QuantizationError as exc:
        pytest.skip(f"{mode} does not run here: {exc.message}")
    cache = tmp_path / "cache"
    first, events = load(source, mode, cache)
    assert quantized(events) and not from_cache(events)
    assert any(e.stage == "cache" and "kept" in e.detail for e in events), [e.detail for e in events]
    second, events = load(source, mode, cache)
    assert from_cache(events) and not quantized(events), [e.detail for e in events]
    assert torch.equal(logits(first), logits(second))
    assert second.info == first.info  # type: ignore[attr-defined]
    assert second.tokenizer.get_vocab() == first.tokenizer.get_vocab()  # type: ignore[attr-defined]


def test_changed_weights_are_packed_again(tmp_path: Path) -> None:
    source = folder_model(tmp_path / "m")
    cache = tmp_path / "cache"
    first, _ = load(source, QuantMode.INT8, cache)
    path = source / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, path, metadata={"format": "pt"})
    second, events = load(source, QuantMode.INT8, cache)
    assert quantized(events) and not from_cache(events)
    assert not torch.equal(logits(first), logits(second))
    assert len(list(paths.packed_dir(cache).iterdir())) == 2  # one entry per weights
    third, events = load(source, QuantMode.INT8, cache)
    assert from_cache(events) and torch.equal(logits(second), logits(third))


def test_a_shortlist_head_is_cut_before_packing_and_kept_per_shortlist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft with a shortlist head streams and packs like the whole model (its logits
    are those of from_pretrained, the head cut, then quantized), and each shortlist is
    kept in the cache apart from the whole head and from other shortlists."""
    from specchat.engine.model import draft_head

    corpus = tmp_path / "corpus.py"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    monkeypatch.setattr(draft_head, "corpus_files", lambda: [corpus])
    source = folder_model(tmp_path / "m")
    cache = tmp_path / "cache"

    def short(keep: int) -> tuple[object, list[LoadProgress]]:
        events: list[LoadProgress] = []
        spec = ModelSpec(str(source), QuantMode.INT8, dtype="float32", head_shortlist=keep)
        return load_model(spec, "draft", cache_dir=cache, progress=events.append), events

    first, events = short(40)
    assert quantized(events) and any("layer by layer" in e.detail for e in events)
    whole = Qwen2ForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tok = first.tokenizer  # type: ignore[attr-defined]
    ranking = draft_head.token_ranking(tok, 320, cache)
    ids = draft_head.shortlist_ids(320, 40, tok.all_special_ids, ranking)
    draft_head.apply_shortlist(whole, ids)
    want = quant.apply(whole, QuantMode.INT8)
    got = logits(first)
    with torch.no_grad():
        assert torch.equal(got, want(PROMPT).logits)
    assert torch.isfinite(got[..., ids]).all() and int(torch.isfinite(got[0, 0]).sum()) == ids.numel()
    again, events = short(40)
    assert from_cache(events) and not quantized(events) and torch.equal(logits(again), got)
    _, events = short(80)
    assert quantized(events)
    _, events = load(source, QuantMode.INT8, cache)
    assert quantized(events)  # the whole head: a file of its own
    (entry_dir,) = paths.packed_dir(cache).iterdir()
    assert len(list(entry_dir.glob("*.pt"))) == 3


def test_a_gguf_second_start_parses_nothing_of_the_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry holds the config and tokenizer: GGUF metadata (a 152k vocabulary in a
    real file) is not read again, nor any tensor."""
    import gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, seed=7)
    cache = tmp_path / "cache"
    first, events = load(path, QuantMode.INT8, cache)
    assert quantized(events)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was opened again")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    second, events = load(path, QuantMode.INT8, cache)
    assert from_cache(events)
    assert torch.equal(logits(first), logits(second))
    ids = first.tokenizer("def f(x): return x")["input_ids"]  # type: ignore[attr-defined]
    assert second.tokenizer("def f(x): return x")["input_ids"] == ids  # type: ignore[attr-defined]


def test_a_torn_file_is_packed_again(tmp_path: Path) -> None:
    source = folder_model(tmp_path / "m")
    cache = tmp_path / "cache"
    load(source, QuantMode.INT8, cache)
    (entry_dir,) = paths.packed_dir(cache).iterdir()
    (pt,) = entry_dir.glob("*.pt")
    pt.write_bytes(pt.read_bytes()[:100])
    _, events = load(source, QuantMode.INT8, cache)
    assert quantized(events)
    _, events = load(source, QuantMode.INT8, cache)
    assert from_cache(events)


def test_the_key_follows_the_packing_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = tmp_path / "qlinear.py"
    code.write_text("x = 1\n")
    monkeypatch.setattr(packed, "_CODE", (code,))
    before = packed.code_key()
    code.write_text("x = 2\n")
    assert packed.code_key() != before


def test_the_key_follows_the_kernels_flags_not_the_code_that_packs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The w4a8 kernel packs, so its compiler flags are in the key; the decoder kernel and
    the path choice (native.py) pack nothing, and an edit there keeps every entry."""
    from specchat.engine.model import native

    names = {path.name for path in packed._CODE}
    assert "w4a8.cpp" in names and not names & {"decoder.cpp", "native.py"}
    before = packed.code_key()
    monkeypatch.setitem(native._FLAGS, "w4a8", [*native._FLAGS["w4a8"], "-ffast-math"])
    assert packed.code_key() != before


def test_off_means_off_and_old_entries_age_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = folder_model(tmp_path / "m")
    cache = tmp_path / "cache"
    monkeypatch.setenv(packed.ENV, "0")
    _, events = load(source, QuantMode.INT8, cache)
    assert not paths.packed_dir(cache).exists() and not any(e.stage == "cache" for e in events)
    root = tmp_path / "entries"
    for i in range(6):
        (root / f"e{i}").mkdir(parents=True)
        os.utime(root / f"e{i}", (1000 + i, 1000 + i))
    removed = packed.prune(root, keep=4)
    assert sorted(p.name for p in removed) == ["e0", "e1"]
