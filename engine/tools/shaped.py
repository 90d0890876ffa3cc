"""Models of a real model's shapes with random weights, built straight into a post-load
quantized format: what costs are measured on when the weights are not at hand.

A CPU's cost for a step or a verify block depends on the shapes and the bytes, not
on the values. `build` makes the model on the meta device and gives it weights one
decoder layer at a time, quantizing each before the next, so a 7B or 14B shape needs
its quantized bytes plus one layer in float, never the float model
(scripts/target_sizes.py; tests of the bigger targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from ..config import QuantMode
from ..model import quant

QWEN_VOCAB = 151_936


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool

    def params(self, vocab: int = QWEN_VOCAB) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + vocab * self.hidden * (1 if self.tied else 2)


# Qwen2.5-Coder-{0.5B,1.5B,3B,7B,14B}-Instruct's config.json.
SHAPES = {
    "0.5b": Shape(896, 4864, 24, 14, 2, True),
    "1.5b": Shape(1536, 8960, 28, 12, 2, True),
    "3b": Shape(2048, 11008, 36, 16, 2, True),
    "7b": Shape(3584, 18944, 28, 28, 4, False),
    "14b": Shape(5120, 13824, 48, 40, 8, False),
}


def config(shape: Shape, layers: int | None = None, vocab: int = QWEN_VOCAB) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers if layers is None else layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=shape.tied,
    )


@torch.no_grad()
def _fill(module: nn.Module, gen: torch.Generator, std: float) -> None:
    """Random weights where the module was made on the meta device: norms 1, the rest N(0, std)."""
    module.to_empty(device="cpu")
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


@torch.no_grad()
def build(
    shape: Shape,
    layers: int | None = None,
    *,
    mode: QuantMode = QuantMode.W4A8,
    vocab: int = QWEN_VOCAB,
    seed: int = 0,
    std: float = 0.02,
) -> Qwen2ForCausalLM:
    """A `mode` model of `shape` (its first `layers` decoder layers), one layer at a time."""
    gen = torch.Generator().manual_seed(seed)
    cfg = config(shape, layers, vocab)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    for layer in model.model.layers:
        _fill(layer, gen, std)
        quant.apply(layer, mode, lm_head=False)  # q/k/v and gate/up as one GEMM each
    _fill(model.model.embed_tokens, gen, std)
    _fill(model.model.norm, gen, std)
    model.model.rotary_emb = Qwen2RotaryEmbedding(cfg)  # its buffers are computed, not random
    if shape.tied:
        model.lm_head = nn.Linear(shape.hidden, vocab, bias=False)
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        _fill(model.lm_head, gen, std)
    quant.apply(model, mode)  # what is left: the LM head, as the loader quantizes it
    return model.eval()
