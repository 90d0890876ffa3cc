"""How much memory models and their KV caches take, and whether it is there.

Two models plus their KV caches can exhaust memory that held one, so the
loader adds the estimates of target, draft and KV cache and asks `check_fits`
once before loading anything.

Estimates come from the model's shapes (built on the meta device from its
config: no weights read) and the bytes each quantization mode stores per
weight:

    none       itemsize(dtype) per weight
    bnb-nf4    1/2 byte per Linear weight + a float32 absmax per 64 weights
    bnb-int8   1 byte per Linear weight + a float32 scale per output channel
    int8       1 byte per Linear weight + a bf16 scale per output channel
    int4       1/2 byte per Linear weight + bf16 scale and zero per group
    w8a8       1 byte per Linear weight (fbgemm's packed copy) + scale, zero point, row sum
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import W4A8_GROUPS, W4A8_MODES, QuantMode
from ..errors import OutOfMemoryError
from ..model.quant import (
    BNB_BLOCK_SIZE,
    DEFAULT_GROUP_SIZE,
    QUANTIZE_LM_HEAD,
    LinearShape,
    linear_shapes,
    meta_model,
)

GiB = 2**30


# --------------------------------------------------------------------------- measured


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by a model's weights: parameters, buffers and quantization state.

    Counts each storage once (tied embeddings, views), packed int8/int4
    buffers at their real size, and the bitsandbytes state that hangs off a
    parameter rather than being one (4-bit absmax and code, 8-bit row scales).
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _weight_tensors(model):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    # Weights a kernel library packed into its own objects (w8a8's fbgemm), not tensors.
    total += sum(int(getattr(m, "packed_bytes", 0)) for m in model.modules())
    return total


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for p in model.parameters():
        yield p
        yield from _bnb_state(p)
    yield from model.buffers()


def _bnb_state(p: torch.Tensor) -> Iterator[torch.Tensor]:
    scb = getattr(p, "SCB", None)  # bitsandbytes Int8Params: float32 scale per row
    if isinstance(scb, torch.Tensor):
        yield scb
    state = getattr(p, "quant_state", None)  # bitsandbytes Params4bit
    while state is not None:
        for name in ("absmax", "code", "offset"):
            t = getattr(state, name, None)
            if isinstance(t, torch.Tensor):
                yield t
        state = getattr(state, "state2", None)  # nested (double) quantization


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token adds: 2 (K and V) * layers * kv_heads * head_dim * itemsize."""
    c = _text_config(config)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return 2 * int(c.num_hidden_layers) * kv_heads * head_dim * _itemsize(dtype)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- estimated


def estimate_load_bytes(
    config: PretrainedConfig,
    mode: QuantMode,
    dtype: torch.dtype,
    *,
    lm_head: bool = QUANTIZE_LM_HEAD,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """Bytes the model's weights hold once loaded with `mode` (`dtype` for what stays float).

    This is what adds up across target, draft and KV cache. Loading passes
    through a higher peak (see `estimate_peak_bytes`).
    """
    float_other, shapes, tied_head, buffers = _split(config)
    size = _itemsize(dtype)
    total = float_other * size + buffers
    for s in shapes:
        quantized = _is_quantized(mode, s, lm_head)
        if s.is_lm_head and tied_head and not quantized:
            continue  # shares the embedding, counted with the other float weights
        if quantized:
            total += _quantized_bytes(mode, s, group_size)
        else:
            total += s.in_features * s.out_features * size
    return total


def estimate_peak_bytes(
    config: PretrainedConfig,
    mode: QuantMode,
    dtype: torch.dtype,
    *,
    lm_head: bool = QUANTIZE_LM_HEAD,
    group_size: int = DEFAULT_GROUP_SIZE,
    streamed: bool = False,
) -> int:
    """The most the weights hold while loading: post-load modes (int8, int4) first hold
    the whole float model, or, `streamed` (weights/stream.py), the quantized model and one
    piece in float (a decoder layer, or the embedding or LM head); bitsandbytes holds one
    float weight beside the quantized ones."""
    resident = estimate_load_bytes(config, mode, dtype, lm_head=lm_head, group_size=group_size)
    if mode is QuantMode.NONE:
        return resident
    if streamed:
        _, shapes, _, _ = _split(config)
        layer = sum(s.in_features * s.out_features for s in shapes if ".layers.0." in s.name)
        largest = max([layer, *(s.in_features * s.out_features for s in shapes if s.is_lm_head)])
        return resident + largest * _itemsize(dtype)
    float_model = estimate_load_bytes(config, QuantMode.NONE, dtype)
    if mode in (QuantMode.BNB_NF4, QuantMode.BNB_INT8):
        _, shapes, _, _ = _split(config)
        largest = max(s.in_features * s.out_features for s in shapes) * _itemsize(dtype)
        return resident + largest
    return max(float_model, resident)


def _split(config: PretrainedConfig) -> tuple[int, list[LinearShape], bool, int]:
    """(weights outside nn.Linear, the Linear shapes, whether lm_head shares the embedding,
    bytes of buffers such as rotary frequencies)."""
    model = meta_model(config)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    head_weight = getattr(_embeddings(model, "get_output_embeddings"), "weight", None)
    input_weight = getattr(_embeddings(model, "get_input_embeddings"), "weight", None)
    tied = head_weight is not None and head_weight is input_weight
    other = 0
    for p in model.parameters():  # parameters() yields a shared tensor once
        if id(p) not in linear_weights or (tied and p is head_weight):
            other += p.numel()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # `other` holds biases (float in every mode) and, when tied, the shared embedding.
    return other, linear_shapes(config), tied, buffers


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    found = get() if callable(get) else None
    return found if isinstance(found, nn.Module) else None


def _is_quantized(mode: QuantMode, s: LinearShape, lm_head: bool) -> bool:
    if mode is QuantMode.NONE:
        return False
    if mode in (QuantMode.BNB_NF4, QuantMode.BNB_INT8):
        return not s.is_lm_head  # transformers leaves the output projection unquantized
    return lm_head or not s.is_lm_head


def _quantized_bytes(mode: QuantMode, s: LinearShape, group_size: int) -> int:
    n, k = s.out_features, s.in_features
    if mode is QuantMode.BNB_NF4:
        return (n * k + 1) // 2 + 4 * -(-n * k // BNB_BLOCK_SIZE)
    if mode is QuantMode.BNB_INT8:
        return n * k + 4 * n
    if mode is QuantMode.INT8:
        return n * k + 2 * n
    if mode is QuantMode.W8A8:
        return n * k + 12 * n  # fbgemm's packed copy (+ scales, zero points) and row sums
    if mode in W4A8_MODES:  # codes, float16 scale and minimum per group, rows padded to 8
        rows = -(-n // 8) * 8
        return rows * k // 2 + rows * (k // W4A8_GROUPS[mode]) * 4
    if mode is QuantMode.INT4:
        return n * k // 2 + (k // group_size) * n * 2 * 2
    raise AssertionError(mode)


# --------------------------------------------------------------------------- available


def available_bytes(device: torch.device) -> int:
    """Free memory on `device`: psutil's available RAM on the CPU, the driver's on CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def check_fits(needed_bytes: int, device: torch.device, what: str = "the models") -> None:
    """Raise OutOfMemoryError if `needed_bytes` exceed what `device` has free now."""
    available = available_bytes(device)
    if needed_bytes > available:
        where = "GPU memory" if device.type == "cuda" else "RAM"
        raise OutOfMemoryError(
            f"loading {what} needs ~{needed_bytes / GiB:.1f} GiB, "
            f"{available / GiB:.1f} GiB {where} available",
            hint="quantize (int8 or int4 on the CPU, bnb-nf4 on CUDA), use a smaller "
            "draft, shorten the context, or close other programs",
        )
