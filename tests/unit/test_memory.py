"""Memory accounting: measured weight bytes, estimates from configs, and the fit check."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config

from specchat.engine.config import QuantMode
from specchat.engine.errors import OutOfMemoryError
from specchat.engine.model import quant
from specchat.engine.weights import memory

CPU = torch.device("cpu")
GiB = 2**30


def tiny_config(**overrides: object) -> LlamaConfig:
    kwargs: dict[str, object] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_model(config: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def qwen15_config() -> Qwen2Config:
    """Qwen2.5-Coder-1.5B's shape (the default target), tied as the original release."""
    return Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    )


def test_weight_bytes_counts_tied_weights_once() -> None:
    untied = tiny_model(tiny_config())
    n = sum(p.numel() for p in untied.parameters())
    rotary = sum(b.nbytes for b in untied.buffers())  # inv_freq, 2 x 8 float32
    assert rotary == 64
    assert memory.weight_bytes(untied) == 4 * n + rotary
    tied = tiny_model(tiny_config(tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert memory.weight_bytes(tied) == 4 * (n - 256 * 64) + rotary
    assert memory.weight_bytes(tied.to(torch.bfloat16)) == 2 * (n - 256 * 64) + rotary // 2


@pytest.mark.parametrize("mode", [QuantMode.NONE, QuantMode.INT8, QuantMode.INT4, QuantMode.W8A8])
@pytest.mark.parametrize("tied", [False, True])
def test_estimate_equals_measured_post_load(mode: QuantMode, tied: bool) -> None:
    config = tiny_config(tie_word_embeddings=tied)
    model = quant.apply(tiny_model(config), mode, group_size=32)
    measured = memory.weight_bytes(model)
    assert measured == memory.estimate_load_bytes(config, mode, torch.float32, group_size=32)
    if mode is not QuantMode.NONE:
        assert measured < memory.estimate_load_bytes(config, QuantMode.NONE, torch.float32)


def test_packed_buffers_are_counted_at_their_size() -> None:
    layer = quant.apply(
        nn.Sequential(nn.Linear(256, 64, bias=False)), QuantMode.INT4, group_size=64
    )
    # 256 * 64 weights at 4 bits + (256 / 64 groups) * 64 outputs * (bf16 scale + bf16 zero)
    assert memory.weight_bytes(layer) == 256 * 64 // 2 + 4 * 64 * 4
    layer8 = quant.apply(nn.Sequential(nn.Linear(256, 64, bias=True)), QuantMode.INT8)
    assert memory.weight_bytes(layer8) == 256 * 64 + 64 * 2 + 64 * 4  # int8, bf16 scales, bias


@pytest.mark.parametrize("mode", [QuantMode.BNB_NF4, QuantMode.BNB_INT8])
def test_estimate_close_to_measured_bitsandbytes(mode: QuantMode, tmp_path: Path) -> None:
    config = tiny_config(hidden_size=128, intermediate_size=256)
    tiny_model(config).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, **quant.load_kwargs(mode, CPU)
        )
    measured = memory.weight_bytes(model)
    estimated = memory.estimate_load_bytes(config, mode, torch.float32)
    assert abs(measured - estimated) <= 0.01 * estimated + 2048, (measured, estimated)
    assert measured < memory.weight_bytes(tiny_model(config))


def test_estimate_of_the_default_target_shape() -> None:
    h, i, v, layers, kv = 1536, 8960, 151936, 28, 256
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (biased), o
    params = v * h + layers * per_layer + h  # tied lm_head, final norm
    rotary = 2 * 64 * 4  # inv_freq and original_inv_freq, float32
    config = qwen15_config()
    float_bytes = 2 * params + rotary
    assert memory.estimate_load_bytes(config, QuantMode.NONE, torch.bfloat16) == float_bytes
    int4 = memory.estimate_load_bytes(config, QuantMode.INT4, torch.bfloat16)
    assert GiB * 1.1 < int4 < GiB * 1.4  # quantized lm_head beside the bf16 embedding
    nohead = memory.estimate_load_bytes(config, QuantMode.INT4, torch.bfloat16, lm_head=False)
    assert nohead < int4  # tied: leaving the head float costs nothing extra
    # post-load modes pass through the float model
    assert memory.estimate_peak_bytes(config, QuantMode.INT4, torch.bfloat16) == float_bytes


def test_kv_bytes_per_token_matches_a_real_cache() -> None:
    config = tiny_config()
    model = tiny_model(config)
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.arange(10)[None], cache=cache, use_cache=True)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == 10 * memory.kv_bytes_per_token(config, torch.float32)
    # 2 * 28 layers * 2 KV heads * 128 head_dim * 2 bytes
    assert memory.kv_bytes_per_token(qwen15_config(), torch.bfloat16) == 28_672


def test_check_fits_uses_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(available=3 * GiB)
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: fake)
    memory.check_fits(2 * GiB, CPU)
    with pytest.raises(OutOfMemoryError) as info:
        memory.check_fits(int(4.5 * GiB), CPU, what="target + draft + KV cache")
    assert info.value.message == (
        "loading target + draft + KV cache needs ~4.5 GiB, 3.0 GiB RAM available"
    )
    assert "int4" in info.value.hint


def test_check_fits_uses_free_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB, 80 * GiB))
    with pytest.raises(OutOfMemoryError, match=r"~2\.0 GiB, 1\.0 GiB GPU memory available"):
        memory.check_fits(2 * GiB, torch.device("cuda", 0), what="the target")
