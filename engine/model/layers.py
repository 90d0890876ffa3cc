"""A Llama-style decoder run as embed -> layers -> head: the one path specchat runs a
model's layers by.

The runner's decode steps and verify blocks (`forward`, model/runner.py) run all
layers; early exit (decode/early_exit.py) runs the target's first layers, reads the
LM head at an exit point and fills the skipped layers' K/V; the self-speculative
draft runs the first E layers; calibration (tools/calibration.py) records every
exit point. Layer ranges run in one native call where the model has a native
decoder (model/decoder.py, the layers' kernel), else through transformers' layer
modules, called as the model's own forward calls them: a pass through all layers
gives the model's own numbers either way. (A conversation's first pass, blocks
longer than MAX_ROWWISE and architectures without a native decoder take
transformers' whole-model forward instead: model/runner.py.)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..errors import EngineError
from .attention import MAX_ROWWISE
from .decoder import NativeDecoder, native_decoder
from .invariance import BATCHED, Exactness, RowsApart


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerStack:
    """A Llama-style decoder (Llama, Qwen2, Qwen3, Mistral) run layer by layer.

    Layers are called exactly as `LlamaModel.forward` / `Qwen2Model.forward`
    call them, so a pass through all layers gives the model's own numbers.
    """

    def __init__(
        self, model: Any, native: NativeDecoder | None | Literal["build"] = "build"
    ) -> None:
        """`native`: the model's native decoder to run layer ranges with (a runner's, shared),
        None for transformers' modules only, or "build" to make one here."""
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
        # A runner's, when given: steppers are made every turn.
        self.native = native_decoder(model)[0] if native == "build" else native

    def begin(
        self, ids: Tensor, cache: DynamicCache, past: int, depths: Tensor | None = None
    ) -> Pass:
        """Embed ids [S] at positions past..past+S-1 (a draft tree's: past + depths [S]);
        rotary for the pass."""
        n = int(ids.shape[-1])
        h = self.inner.embed_tokens(ids.view(1, n))  # [1, S, H]
        pos = torch.arange(past, past + n, device=h.device).view(1, n)  # [1, S]
        if depths is not None:
            pos = (past + depths.to(h.device)).view(1, n)
        rope = self.inner.rotary_emb(h, pos)  # (cos, sin), each [1, S, D]
        # With the native decoder the model scores short blocks row by row, which takes
        # no mask (engine/model/attention.py): skip making one, ~1 ms of Python a step.
        short = self.native is not None and n <= MAX_ROWWISE
        masks = dict.fromkeys(self.layer_types) if short else self._masks(h, pos, cache)
        return Pass(h, pos, rope, masks, cache, past)

    def forward(
        self, ids: Tensor, cache: DynamicCache, past: int, keep: int, exactness: Exactness
    ) -> Tensor:
        """All layers on ids [n] after `past` cached tokens: logits of the last `keep` [keep, V].

        A decode step or a verify block: the float projections and silu of the
        embedding, rotary tables, final norm and LM head take a block's rows as
        `exactness` plans (one at a time where a block must score as steps do),
        and so do the native layers.
        """
        return self.forward_capturing(ids, cache, past, keep, exactness, ())[0]

    def forward_capturing(
        self,
        ids: Tensor,
        cache: DynamicCache,
        past: int,
        keep: int,
        exactness: Exactness,
        capture: tuple[int, ...],
        parents: tuple[int, ...] = (),
    ) -> tuple[Tensor, Tensor | None]:
        """`forward`, and the residual stream entering each layer in `capture`, side by
        side for every fed row: (logits [keep, V], features [n, len(capture) * H] or None).

        The layers run in ranges split at the captured layers: the same operations
        as one call, so the logits keep their bits. `parents`: the rows are a draft
        tree (native layers only: decoder.py), row i at its depth.
        """
        n = int(ids.shape[-1])
        taken: dict[int, Tensor] = {}
        depths = tree_depths(parents) if parents else None
        with RowsApart(exactness.fixed) if RowsApart.needed(exactness, n) else nullcontext():
            p = self.begin(ids, cache, past, depths)
            p.parents = parents
            start = 0
            for stop in sorted(set(capture)):
                h = self.run(p, start, stop, exactness.rows) if stop > start else p.h
                taken[stop] = h[0]
                start = stop
            h = self.run(p, start, self.num_layers, exactness.rows)
            logits: Tensor = self.head(self.inner.norm(h)[:, -keep:])
        feats = torch.cat([taken[i] for i in capture], dim=-1) if capture else None
        return logits[0], feats

    def run(self, p: Pass, start: int, stop: int, rows: int = BATCHED) -> Tensor:
        """Layers start..stop-1 (0-based); appends their K/V to p.cache; returns p.h [1, S, H].

        `rows`: how the native layers take a block's float projections and silu
        (engine/model/invariance.py); the default is transformers' modules' way.
        """
        run = range(start, stop)
        if self.native is not None and self.native.usable(p.cache, p.past, p.h.shape[1], run):
            p.h = self.native.layers(p.h, p.rope, p.cache, p.past, run, rows, p.parents)
            return p.h
        if p.parents:
            raise EngineError("a draft tree is verified by the native decoder only")
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
    parents: tuple[int, ...] = ()  # a draft tree's rows (decoder.py), else a chain


def tree_paths(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each tree row's path from row 0, itself last, or () where it is rows 0..i as in a
    chain (csrc/decoder.cpp's tree_paths)."""
    full: list[tuple[int, ...]] = []
    for i, parent in enumerate(parents):
        full.append((*full[parent], i) if i else (0,))
    return tuple(() if p == tuple(range(len(p))) else p for p in full)


def tree_depths(parents: tuple[int, ...]) -> Tensor:
    """[S] each tree row's depth below row 0 (parents[i] < i; row 0's is -1)."""
    depth = [0] * len(parents)
    for i, parent in enumerate(parents[1:], start=1):
        depth[i] = depth[parent] + 1
    return torch.tensor(depth, dtype=torch.long)


def crop_layers(cache: DynamicCache, layers: range, n: int) -> None:
    """Keep the first n positions of the given cache layers only."""
    for i in layers:
        if i < len(cache.layers):
            layer: Any = cache.layers[i]
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)
