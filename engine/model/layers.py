"""A Llama-style decoder run layer by layer, for passes that stop or start mid-model.

Early exit (decode/early_exit.py) runs the target's first layers, reads the LM
head at an exit point and fills the skipped layers' K/V; the self-speculative
draft runs the first E layers; calibration (tools/calibration.py) records every
exit point. They share this stack; its layer ranges run in the runner's native
decoder call where it has one (model/decoder.py), so a pass through all layers
gives the model's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..errors import EngineError
from .attention import MAX_ROWWISE
from .decoder import native_decoder
from .runner import ModelRunner


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerStack:
    """A Llama-style decoder (Llama, Qwen2, Qwen3, Mistral) run layer by layer.

    Layers are called exactly as `LlamaModel.forward` / `Qwen2Model.forward`
    call them, so a pass through all layers gives the model's own numbers.
    """

    def __init__(self, model: Any, runner: ModelRunner | None = None) -> None:
        """`runner`: the runner over `model` whose native decoder to share (else one is built)."""
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed):
            raise EngineError(
                f"early exit needs a Llama-style decoder; {type(model).__name__} is not one",
                hint="use plain or speculative decoding with this model",
            )
        attn = inner.layers[0].self_attn
        if not all(hasattr(attn, n) for n in ("k_proj", "v_proj", "head_dim")):
            raise EngineError(
                f"early exit cannot fill the K/V of {type(attn).__name__} layers",
                hint="use plain or speculative decoding with this model",
            )
        self.model = model
        self.config = model.config
        self.inner = inner
        self.layers = list(inner.layers)
        self.num_layers = int(model.config.num_hidden_layers)
        self.head = model.get_output_embeddings()
        types = getattr(model.config, "layer_types", None)
        self.layer_types: list[str] = list(types or ["full_attention"] * self.num_layers)
        # Layer ranges in one native call where possible (engine/model/decoder.py): bit-identical.
        # The runner's, when it serves the same model: steppers are made every turn.
        if runner is not None and runner.model is model:
            self.native = runner.native
        else:
            self.native, _ = native_decoder(model)

    def begin(self, ids: Tensor, cache: DynamicCache, past: int) -> Pass:
        """Embed ids [S] at positions past..past+S-1; rotary for the pass."""
        n = int(ids.shape[-1])
        h = self.inner.embed_tokens(ids.view(1, n))  # [1, S, H]
        pos = torch.arange(past, past + n, device=h.device).view(1, n)  # [1, S]
        rope = self.inner.rotary_emb(h, pos)  # (cos, sin), each [1, S, D]
        # With the native decoder the model scores short blocks row by row, which takes
        # no mask (engine/model/attention.py): skip making one, ~1 ms of Python a step.
        short = self.native is not None and n <= MAX_ROWWISE
        masks = dict.fromkeys(self.layer_types) if short else self._masks(h, pos, cache)
        return Pass(h, pos, rope, masks, cache, past)

    def run(self, p: Pass, start: int, stop: int) -> Tensor:
        """Layers start..stop-1 (0-based); appends their K/V to p.cache; returns p.h [1, S, H]."""
        run = range(start, stop)
        if self.native is not None and self.native.usable(p.cache, p.past, p.h.shape[1], run):
            p.h = self.native.layers(p.h, p.rope, p.cache, p.past, run)
            return p.h
        for i in run:
            p.h = self.layers[i](
                p.h,
                attention_mask=p.masks[self.layer_types[i]],
                position_embeddings=p.rope,
                position_ids=p.pos,
                cache=p.cache,
                use_cache=True,
            )
        return p.h

    def _masks(self, h: Tensor, pos: Tensor, cache: DynamicCache) -> dict[str, Any]:
        """The attention masks the modules take, as the model's forward makes them."""
        args = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": None,
            "cache": cache,
            "position_ids": pos,
        }
        masks = {"full_attention": create_causal_mask(**args)}  # type: ignore[arg-type]
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)  # type: ignore[arg-type]
        return masks

    def logits(self, h: Tensor) -> Tensor:
        """Final norm and LM head: h [..., H] -> logits [..., V]."""
        out: Tensor = self.head(self.inner.norm(h))
        return out

    def kv_fill(self, p: Pass, start: int) -> None:
        """Give layers start..L-1 K/V for p's positions from p.h (CALM state propagation).

        For each skipped layer: input_layernorm, k_proj / v_proj (k_norm where
        the model has one), rotary on K, append to that layer's cache.
        """
        cos, sin = (t.unsqueeze(1) for t in p.rope)  # [1, 1, S, D]
        for i in range(start, self.num_layers):
            layer = self.layers[i]
            attn = layer.self_attn
            x = layer.input_layernorm(p.h)  # [1, S, H]
            shape = (*x.shape[:-1], -1, attn.head_dim)
            k = attn.k_proj(x).view(shape)  # [1, S, Hkv, D]
            k_norm = getattr(attn, "k_norm", None)
            if k_norm is not None:
                k = k_norm(k)
            k = k.transpose(1, 2)  # [1, Hkv, S, D]
            v = attn.v_proj(x).view(shape).transpose(1, 2)  # [1, Hkv, S, D]
            k = k * cos + _rotate_half(k) * sin
            p.cache.update(k, v, i)

    def layer_params(self) -> tuple[int, int, int]:
        """(one decoder layer, the LM head, one layer's K/V fill) in parameters: a cost proxy."""
        layer = self.layers[0]
        attn = layer.self_attn
        n_layer = sum(t.numel() for t in layer.parameters())
        n_head = sum(t.numel() for t in self.head.parameters())
        n_fill = sum(
            t.numel()
            for m in (layer.input_layernorm, attn.k_proj, attn.v_proj)
            for t in m.parameters()
        )
        return n_layer, n_head, n_fill


@dataclass(slots=True)
class Pass:
    h: Tensor  # [1, S, H] the residual stream
    pos: Tensor  # [1, S]
    rope: tuple[Tensor, Tensor]
    masks: dict[str, Any]  # by layer type
    cache: DynamicCache
    past: int  # positions cached before this pass


def crop_layers(cache: DynamicCache, layers: range, n: int) -> None:
    """Keep the first n positions of the given cache layers only."""
    for i in layers:
        if i < len(cache.layers):
            layer: Any = cache.layers[i]
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)
