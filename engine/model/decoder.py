"""Decode steps and verify blocks through one native call per pass (engine/model/csrc/decoder.cpp).

Between its matrix products, a decode step of the 1.5B target makes ~1,400
small tensor operations (norms, rotary, attention, residuals, views). Issued
from Python through transformers' modules they took ~50 ms of a ~160 ms w4a8
step on one core: more than the GEMMs of the 0.5B draft. `NativeDecoder` runs
the decoder layers in C++: the same ATen operations in the same order with
the same arguments, so its outputs are bit-identical to the modules' (tested
on every supported architecture and projection kind); only the interpreter
is gone. The embedding, the rotary tables, the final norm and the LM head
stay with the modules, which also keep serving prompts (long blocks) and
whatever the native path does not support.

In `feed`, a verify block's rows get the one-token steps' bits: float32
projections run the fixed-order kernel (steps too), other float projections
and silu take the rows one at a time, and so do the rotary tables and the LM
head (engine/model/invariance.py). Outside `feed` (the early-exit stack's layer
ranges) the layers compute a block as transformers' modules do.

Supported: Llama and Qwen2 (RMSNorm, rotary, grouped-query attention with
optional q/k/v biases, SwiGLU), full attention scored row by row
(engine/model/attention.py), a cache of `GrowingLayer`s, and projections that are
float `nn.Linear`s, w4a8 or w8a8 (alone or as a shared-input group), or
int8 / int4 weight-only. Not bitsandbytes (CUDA). Anything else
gets `None` from `native_decoder` with the reason, and runs as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from ..errors import QuantizationError
from .attention import MAX_ROWWISE, NAME
from .invariance import BATCHED, Exactness, plan
from .kv_cache import GrowingLayer
from .qlinear import (
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    SharedInputMember,
    W4A8Linear,
    _QuantizedLinear,
)

log = logging.getLogger(__name__)

ENV = "SPECCHAT_NATIVE_DECODER"  # "0" turns the native path off (for A/B runs)
ARCHITECTURES = ("llama", "qwen2")
_DENSE, _W4A8, _INT8, _INT4, _W8A8 = 0, 1, 2, 3, 4  # engine/model/csrc/decoder.cpp's Kind
_STAGES = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class Unsupported(Exception):
    """Why a model cannot take the native path."""


def native_decoder(
    model: PreTrainedModel, exactness: Exactness | None = None
) -> tuple[NativeDecoder | None, str]:
    """The native decoder for `model`, or None and why not (never raises).

    `exactness`: how `feed` runs a block's float projections and silu (default:
    engine/model/invariance.py's plan for the model).
    """
    if os.environ.get(ENV, "1") == "0":
        return None, f"turned off by {ENV}=0"
    try:
        return NativeDecoder(model, exactness or plan(model)), ""
    except Unsupported as exc:
        return None, str(exc)
    except (QuantizationError, RuntimeError) as exc:  # not built; or refused by the C++ side
        log.warning("native decoder unavailable: %s", exc)
        return None, str(exc).strip().splitlines()[0]


class NativeDecoder:
    def __init__(self, model: PreTrainedModel, exactness: Exactness) -> None:
        config = model.config
        if config.model_type not in ARCHITECTURES:
            raise Unsupported(f"no native decoder for {config.model_type} models")
        if model.device.type != "cpu":  # the same ATen calls would run, but untested there
            raise Unsupported(f"the native decoder runs on the CPU, not {model.device.type}")
        if getattr(config, "_attn_implementation", None) != NAME:
            raise Unsupported("the model does not use row-wise attention")
        if getattr(config, "hidden_act", None) != "silu":
            raise Unsupported(f"activation {config.hidden_act!r}, not silu")
        inner: Any = model.model
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, attr):
                raise Unsupported(f"the model has no {attr}")
        steps = [_layer_steps(layer) for layer in inner.layers]  # raises Unsupported

        from . import native

        if any(kind == _W4A8 for layer in steps for _, kind, *_ in layer[1]):
            native.load("w4a8")
        native.load("decoder")
        self._impl: Any = torch.classes.specchat.Decoder()  # type: ignore[attr-defined]
        self.exactness = exactness
        for args, projections in steps:
            self._impl.add_layer(*args)
            for projection in projections:
                self._impl.add_projection(*projection[:-1])
                packed = projection[-1]
                if packed is not None:  # w8a8: fbgemm's weights, an object of their own
                    self._impl.attach_packed(*packed)
        self.model = model
        self.config = config
        self.inner = inner
        self.num_layers = len(steps)

    def usable(self, cache: DynamicCache, past: int, n: int, layers: range | None = None) -> bool:
        """Whether n new tokens after `past` can go native through `layers` (default: all).

        The layers' caches must be `GrowingLayer`s holding exactly `past` positions
        (the first pass of a conversation, which creates them, takes the modules).
        """
        if not 0 < n <= MAX_ROWWISE or past <= 0 or len(cache.layers) != self.num_layers:
            return False
        if self.config._attn_implementation != NAME:  # switched since: the modules decide
            return False
        for i in layers if layers is not None else range(self.num_layers):
            layer = cache.layers[i]
            if type(layer) is not GrowingLayer or layer.get_seq_length() != past:
                return False
        return True

    def layers(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: DynamicCache,
        past: int,
        run: range,
        rows: int = BATCHED,
        parents: tuple[int, ...] = (),
    ) -> Tensor:
        """Layers `run` (consecutive) on h [1, n, H]: their output; appends their K/V.

        `rows`: how float projections and silu take the rows (engine/model/invariance.py):
        `feed` passes its plan's; the default is transformers' layer modules' way
        (the early-exit stack runs both, and must match them). `parents`: a draft tree's
        (row i's parent row, -1 for row 0; `rope` at each row's depth), else a chain.
        """
        end = past + int(h.shape[1])
        layers: list[GrowingLayer] = [cache.layers[i] for i in run]  # type: ignore[misc]
        buffers = [layer.reserve(end) for layer in layers]
        keys, values = [k for k, _ in buffers], [v for _, v in buffers]
        out: Tensor = self._impl.forward(
            h, *rope, keys, values, past, run.start, rows, list(parents)
        )
        for layer in layers:
            layer.set_length(end)
        return out


def _layer_steps(layer: nn.Module) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    """add_layer's arguments and, per projection, add_projection's and attach_packed's (or None)."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    norms: list[Any] = [
        getattr(layer, a, None) for a in ("input_layernorm", "post_attention_layernorm")
    ]
    if attn is None or mlp is None or any(n is None for n in norms):
        raise Unsupported(f"{type(layer).__name__} is not a Llama-style decoder layer")
    for norm in norms:
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            raise Unsupported(f"{type(norm).__name__} is not an RMSNorm")
    for extra in ("q_norm", "k_norm", "sinks"):
        if getattr(attn, extra, None) is not None:
            raise Unsupported(f"attention with {extra}")
    heads = attn.config.num_attention_heads
    kv_heads = attn.config.num_key_value_heads
    args = (
        norms[0].weight,
        float(norms[0].variance_epsilon),
        norms[1].weight,
        float(norms[1].variance_epsilon),
        heads,
        kv_heads,
        int(attn.head_dim),
        float(attn.scaling),
    )
    projections = []
    for stage, names in enumerate(_STAGES):
        owner = mlp if stage >= 2 else attn
        modules = [getattr(owner, name, None) for name in names]
        projections += _stage(stage, names, modules)
    return args, projections


def _stage(stage: int, names: tuple[str, ...], modules: list[Any]) -> list[tuple[Any, ...]]:
    """One projection per module, or one for a shared-input group that serves them in order."""
    group: Any = modules[0].group if isinstance(modules[0], SharedInputMember) else None
    if (
        group is not None
        and len(group.sizes) == len(modules)
        and all(
            isinstance(m, SharedInputMember) and m.group is group and m.index == i
            for i, m in enumerate(modules)
        )
    ):
        biases = [group._buffers[f"bias{i}"] for i in range(len(modules))]
        return [_projection(stage, group.linear, list(group.sizes), biases, names[0])]
    return [
        _projection(stage, m, [_out_features(m, name)], [None], name)
        for m, name in zip(modules, names, strict=True)
    ]


def _out_features(module: Any, name: str) -> int:
    if module is None:
        raise Unsupported(f"no {name}")
    out = getattr(module, "out_features", None)
    if not isinstance(out, int):
        raise Unsupported(f"{name} is a {type(module).__name__}")
    return out


def _projection(
    stage: int, module: Any, sizes: list[int], part_bias: list[Tensor | None], name: str
) -> tuple[Any, ...]:
    empty = torch.empty(0)
    parts = [empty if b is None else b for b in part_bias]
    bias = [] if getattr(module, "bias", None) is None else [module.bias]
    shape = (int(module.in_features), int(module.out_features))
    if type(module) is nn.Linear:
        return (stage, _DENSE, [module.weight], 0, bias, *shape, sizes, parts, None)
    kind, tensors, group = _quantized(module, name)
    if isinstance(module, _QuantizedLinear) and module.compute_dtype != _COMPUTE[kind]:
        raise Unsupported(f"{name} computes in {module.compute_dtype}")
    packed = (module._packed, bool(module.reduce_range)) if kind == _W8A8 else None
    return (stage, kind, tensors, group, bias, *shape, sizes, parts, packed)


_COMPUTE = {  # the dtype each kind's kernel takes, as in the C++
    _W4A8: torch.float32,
    _INT8: torch.bfloat16,
    _INT4: torch.bfloat16,
    _W8A8: torch.float32,
}


def _quantized(module: Any, name: str) -> tuple[int, list[Tensor], int]:
    """The C++ kind of a quantized projection, its tensors, and int4's group size."""
    if type(module) is W4A8Linear:
        return _W4A8, [module.packed, module.scales, module.mins], 0
    if type(module) is Int8WeightOnlyLinear:
        return _INT8, [module.weight_int8, module.scales], 0
    if type(module) is Int4WeightOnlyLinear:
        return _INT4, [module.weight_int4pack, module.scales_and_zeros], module.group_size
    if type(module) is Int8DynamicLinear:
        return _W8A8, [module.weight_sums], 0
    raise Unsupported(f"{name} is a {type(module).__name__}")
