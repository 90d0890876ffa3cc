"""The default pair as fetched into the cache: files verify, tokenizers agree, the draft writes code.

Needs `specchat models fetch` to have run (the test command does it first);
skips otherwise. Kept light: one 8-token greedy generation on the 0.5B.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specchat.engine.errors import FetchError
from specchat.engine.weights import fetch, registry

pytestmark = pytest.mark.slow

TARGET, DRAFT = registry.DEFAULT_PAIR


def _folder(name: str) -> Path:
    try:
        return Path(fetch.resolve(name, fetch=False).pretrained)
    except FetchError as exc:
        pytest.skip(f"{exc.message}; {exc.hint}")


@pytest.mark.parametrize("name", registry.DEFAULT_PAIR)
def test_cached_files_verify(name: str) -> None:
    _folder(name)
    lines = fetch.verify_preset(name)
    assert "files match their sha256" in lines[0]


def test_target_and_draft_share_one_tokenizer() -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    target, draft = _folder(TARGET), _folder(DRAFT)
    tok_t = AutoTokenizer.from_pretrained(target)
    tok_d = AutoTokenizer.from_pretrained(draft)
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert tok_t.all_special_tokens == tok_d.all_special_tokens
    assert (tok_t.eos_token, tok_t.pad_token) == (tok_d.eos_token, tok_d.pad_token)
    assert tok_t.eos_token == "<|im_end|>"
    # The two GGUFs' chat templates differ only in the tool-calling section
    # (one writes the JSON example with doubled braces); conversations render
    # identically. The loader applies the target's template.
    assert tok_t.chat_template and tok_d.chat_template
    chat = [
        {"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": "Reverse a list in Python."},
        {"role": "assistant", "content": "Use `xs[::-1]`."},
        {"role": "user", "content": "In place?"},
    ]
    render = {"add_generation_prompt": True, "tokenize": False}
    assert tok_t.apply_chat_template(chat, **render) == tok_d.apply_chat_template(chat, **render)
    assert tok_t.apply_chat_template(chat[1:2], **render).startswith("<|im_start|>system\n")
    text = "def add(a: int, b: int) -> int:\n    return a + b  # ünïcode ✓"
    assert tok_t(text)["input_ids"] == tok_d(text)["input_ids"]
    # the models' output rows index the same vocabulary
    assert (
        AutoConfig.from_pretrained(target).vocab_size
        == AutoConfig.from_pretrained(draft).vocab_size
    )
    eos_t = GenerationConfig.from_pretrained(target).eos_token_id
    eos_d = GenerationConfig.from_pretrained(draft).eos_token_id
    assert (
        eos_t == eos_d == [tok_t.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    )


def test_draft_writes_code_greedily() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _folder(DRAFT)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    reload_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(folder)
    assert next(model.parameters()).dtype == torch.bfloat16
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"reload {reload_s:.2f} s; greedy 8 tokens: {text!r}")
    assert text.strip()
    assert out.shape[1] - ids.shape[1] == 8
