"""Attention that gives a query row the same result alone or in a verify block.

Speculative decoding is exact only if the target scores a token the same way
whether it is verified in a block of K+1 or decoded alone. transformers' SDPA
path does not: one query runs with the grouped-query heads packed into rows,
a block runs with a causal mask or `is_causal`, and the CPU kernels reduce
over the keys in another order. The logits differ by ~1e-5 in float32, which
rarely matters; quantized activations (bf16 casts, w8a8's 8-bit rows) turn
that into differences of 0.06-0.9 and flip greedy choices at near-ties
(measured: 6 of 10 dev prompts diverged with a w8a8 target).

`rowwise_sdpa` scores each query row of a short block as the one-token step
would: the same call, one query, the keys up to that row's position, no
mask. Blocks longer than `MAX_ROWWISE` (prompts) take the usual path, with
the mask transformers makes for SDPA; a prompt is prefilled the same way in
every mode. Where the decoder kernel runs, that call is its `attend`
(csrc/decoder.cpp), which the native decoder makes for a whole block at once
with the same bits a row; elsewhere two small matmuls a row.

Valid for what the engine runs: one sequence, no padding, full causal
attention. `use_rowwise_attention` leaves other models (sliding windows,
other attention kinds) as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..config import MAX_K

NAME = "specchat_rowwise_sdpa"
# Up to this many keys a query row is scored on one thread. Its two matmuls are microseconds
# of arithmetic, and at two threads each wakes a sleeping worker (OMP_WAIT_POLICY=PASSIVE):
# 218 against 27 us a row at 70 keys, 332 against 184 at 1,024, even at 2,048, and two threads
# win from 4,096 on (AMD EPYC Zen 4, torch 2.13; the same bits either way). Decided by the
# row's own key count, so a verify block's row and the plain step at its position agree.
# csrc/decoder.cpp's kOneThreadKeys is the same number.
ONE_THREAD_KEYS = 2048
MAX_ROWWISE = 32  # longer blocks are prompts, not verify blocks
assert MAX_K + 1 <= MAX_ROWWISE, "every verify block must score row by row"


# A draft tree's rows while transformers' modules verify it (model/runner.py `feed_tree`):
# each row's path from row 0, itself last, or () where that is rows 0..i, as in a chain.
_TREE: contextvars.ContextVar[tuple[tuple[int, ...], ...]] = contextvars.ContextVar(
    "specchat_tree", default=()
)


@contextlib.contextmanager
def tree_rows(paths: tuple[tuple[int, ...], ...]) -> Iterator[None]:
    """Inside, a short block's rows are a draft tree's: row i sees the cache and paths[i]."""
    token = _TREE.set(paths)
    try:
        yield
    finally:
        _TREE.reset(token)


def rowwise_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q_len, D]
    key: torch.Tensor,  # [B, H_kv, kv_len, D], the cache included
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > MAX_ROWWISE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    one = _one_query if _plain_attention(module, kwargs) else _one_query_sdpa
    paths = _TREE.get()
    past = kv_len - q_len
    block: tuple[torch.Tensor, torch.Tensor] | None = None
    rows = []
    for i in range(q_len):
        path = paths[i] if paths else ()
        end = kv_len - (q_len - 1 - i)  # row i sees the keys up to its own position
        if path:  # a tree row off the chain: its path's K/V in the slots a chain holds them in
            if block is None:
                block = key[:, :, past:].clone(), value[:, :, past:].clone()
            index = torch.tensor(path, device=key.device)
            end = past + len(path)
            key[:, :, past:end] = block[0][:, :, index]
            value[:, :, past:end] = block[1][:, :, index]
        with one_thread(end <= ONE_THREAD_KEYS):
            rows.append(one(module, query[:, :, i : i + 1], key[:, :, :end], value[:, :, :end], kwargs))
        if path and block is not None:
            key[:, :, past:end] = block[0][:, :, : len(path)]
            value[:, :, past:end] = block[1][:, :, : len(path)]
    return (rows[0] if q_len == 1 else torch.cat(rows, dim=1)), None


@contextlib.contextmanager
def one_thread(on: bool = True) -> Iterator[None]:
    """torch's ops run on one thread inside (when `on`); the thread count is put back after."""
    before = torch.get_num_threads()
    if not on or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _plain_attention(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """No softcapping, sinks or dropout: softmax(q k^T * scaling) v is the whole computation."""
    return (
        kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and getattr(module, "sinks", None) is None
        and not kwargs.get("dropout")
        and "scaling" in kwargs
    )


def _one_query(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, 1, D]
    key: torch.Tensor,  # [B, H_kv, T, D]
    value: torch.Tensor,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """One query against T keys as two small matmuls, the query heads grouped by key head.

    torch's CPU SDPA takes its flash kernel for one query, which was 1.2 ms a layer
    at 1,024 cached tokens on the 1.5B target (6x what the matmuls cost), the
    largest cost after the GEMMs at long contexts. Returns [B, 1, H, D]. Where the
    decoder kernel runs (float32 on an x86 CPU with AVX2), its `attend` scores the row
    instead, as the native decoder does: ~2x faster than the matmuls at 200 keys, and
    the two paths give the same bits.
    """
    if _attend_takes(query, key, value):  # the native decoder's own code for a row
        return torch.ops.specchat.attend(query, key, value, key.shape[2], kwargs["scaling"])
    b, h, _, d = query.shape
    h_kv = key.shape[1]
    q = query.reshape(b, h_kv, h // h_kv, d)  # head j*rep+r reads key head j, as repeat_kv
    scores = torch.matmul(q, key.transpose(-1, -2)) * kwargs["scaling"]  # [B, H_kv, rep, T]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, H_kv, rep, D]
    return out.reshape(b, 1, h, d)


_ATTEND: list[bool] = []  # whether the decoder kernel loaded, decided once a process


def _attend_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether csrc/decoder.cpp's `attend` scores this row (the kernel built and loaded, and
    it takes these tensors: the native decoder asks the same question)."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    if not _ATTEND:
        from ..errors import QuantizationError
        from . import native

        try:
            native.load("decoder")
            _ATTEND.append(True)
        except QuantizationError:
            _ATTEND.append(False)
    return _ATTEND[0] and bool(torch.ops.specchat.attend_takes(query, key, value))


def _one_query_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    out, _ = sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return out  # [B, 1, H, D]


AttentionInterface.register(NAME, rowwise_sdpa)
# The masks SDPA gets. Without a mask function of its own, transformers builds no
# mask for a custom attention, and a long block fed after a cache (a prompt that
# continues a conversation) was then scored with a top-left causal mask.
AttentionMaskInterface.register(NAME, sdpa_mask)


def supports_rowwise(model: PreTrainedModel) -> bool:
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    layer_types = getattr(config, "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


def use_rowwise_attention(model: PreTrainedModel) -> bool:
    """Switch a loaded model to row-wise attention where that is valid; True if switched."""
    if not supports_rowwise(model):
        return False
    model.set_attn_implementation(NAME)
    # Layers shared with another model (a draft made of a target's first layers) read
    # that model's config: shared layers have one attention path, and row-wise is valid
    # for both, so the other config switches too (else the copy's blocks took SDPA).
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig) and config is not model.config:
            config._attn_implementation = NAME
    return True


@contextlib.contextmanager
def padded_batches(model: PreTrainedModel) -> Iterator[None]:
    """Inside, the model attends as transformers' SDPA does, with the padding mask: for a
    batch of sequences of several lengths (train-draft's replies), which the row-wise
    path, made for one sequence, does not take. The path each config had is put back."""
    configs = [model.config] + [
        c for m in model.modules()
        if isinstance(c := getattr(m, "config", None), PretrainedConfig) and c is not model.config
    ]
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            if c._attn_implementation == NAME:
                c._attn_implementation = "sdpa"
        yield
    finally:
        for c, impl in zip(configs, before, strict=True):
            c._attn_implementation = impl
