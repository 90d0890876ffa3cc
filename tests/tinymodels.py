"""Tiny models and a tokenizer built in code: fast, no downloads, fixed seeds."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specchat.engine.config import QuantMode
from specchat.engine.weights.loading import LoadedModel, describe

if TYPE_CHECKING:
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.events import TurnFinished
    from specchat.engine.model.runner import ModelRunner

CORPUS = [
    "Once upon a time there was a little robot who loved to read.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Café, naïve, 東京, emoji 🙂!",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
]


@functools.cache
def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE (so multi-byte characters split over tokens) with <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


# Qwen's ChatML layout: each message as <|im_start|>role\ncontent<|im_end|>\n, and
# add_generation_prompt opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.cache
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline, the ChatML specials, a chat template.

    Any sequence of character tokens decodes to text that encodes back to the
    same ids, so a reply's tokens are what the next turn's rendering holds:
    the conversation so far is a prefix of every later turn's prompt.
    <|im_end|> ends a reply (eos).
    """
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama(
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    vocab: int | None = None,
    intermediate: int = 128,
    max_positions: int = 256,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> LlamaForCausalLM:
    tok = tokenizer or tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,  # the default 0.02 makes a random model repeat one token
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Sharper logits (top-1 around 0.2), so greedy paths are rarely near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.requires_grad_(False)


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of model whose LM head has Gaussian noise of std `scale` added (seeded).

    A draft close to its target but not equal to it: acceptance well above a
    random draft's, with tokens the target alone would never propose.
    """
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = copy.lm_head.weight
        head.add_(scale * torch.randn(head.shape, generator=gen))
    return copy.requires_grad_(False)


def widened(model: LlamaForCausalLM, extra: int) -> LlamaForCausalLM:
    """model with `extra` token ids appended, each scoring twice what one of its ids scores.

    Extra id vocab + i has twice the head row (and the embedding) of id i, so
    it outranks id i wherever that id scores above 0: the extra ids carry
    much of the mass. On the first vocab_size ids it computes what model
    computes; fitted to model's vocabulary (the extra ids cut), its
    distribution is model's.
    """
    vocab = int(model.config.vocab_size)
    config = model.config.to_dict()
    config["vocab_size"] = vocab + extra
    wide = LlamaForCausalLM(LlamaConfig(**config)).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in wide.state_dict().items():
            if tensor.shape == state[name].shape:
                tensor.copy_(state[name])
            else:  # the embedding and the head: the first `vocab` rows are model's
                tensor[:vocab] = state[name]
                tensor[vocab:] = 2 * state[name][:extra]
    return wide.requires_grad_(False)


def loaded(model: torch.nn.Module, role: str = "target", tokenizer: object = None) -> LoadedModel:
    tok = tokenizer or tiny_tokenizer()
    device = torch.device("cpu")
    dtype = next(model.parameters()).dtype
    info = describe(model, role, f"tiny-{role}", "code", device, dtype, QuantMode.NONE)  # type: ignore[arg-type]
    return LoadedModel(model, tok, device, dtype, info)  # type: ignore[arg-type]


def pair_session(target: torch.nn.Module, **kw: object) -> ChatSession:
    """A chat session on `target`, drafted by its own first two layers."""
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.weights.loading import layer_truncated

    return ChatSession(loaded(target), loaded(layer_truncated(target, 2), "draft"), **kw)  # type: ignore[arg-type]


def turn_finished(events: list[object]) -> TurnFinished:
    """The one TurnFinished of a turn's events."""
    from specchat.engine.events import TurnFinished

    (last,) = [e for e in events if isinstance(e, TurnFinished)]
    return last


class ConstantCoin:
    """torch, except that torch.rand gives u = value: a wrong acceptance test injected."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    def rand(self, *size: int, device: object = None, **_: object) -> torch.Tensor:
        return torch.full(size, self.value, device=device)  # type: ignore[arg-type]


def native_or_skip(runner: ModelRunner) -> None:
    """Fail if the runner lacks a native decoder this machine can build; skip, with the
    reason, where the decoder kernel cannot be built (no compiler, an ARM CPU)."""
    import pytest

    from specchat.engine.model import native

    if runner.native is None and (why := native.unavailable("decoder")):
        pytest.skip(f"the native decoder cannot run here: {why}")
    assert runner.native is not None, runner.native_off
