"""GrowingLayer keeps exactly what transformers' DynamicLayer keeps, without a copy per token."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from specchat.engine.model import kv_cache
from specchat.engine.model.kv_cache import GrowingLayer, new_cache

# an operation: feed n new positions (n > 0) or crop n (n < 0)
OPS = st.lists(st.integers(-40, 300).filter(lambda n: n != 0), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_growing_layer_equals_dynamic_layer(ops: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = GrowingLayer(), DynamicLayer()
    for n in ops:
        if n > 0:
            k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
            got, want = ours.update(k, v), theirs.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            drop = min(-n, theirs.get_seq_length())
            if drop:
                ours.crop(-drop)
                theirs.crop(-drop)
        assert ours.get_seq_length() == theirs.get_seq_length()
        if theirs.get_seq_length():
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_growing_layer_writes_in_place_and_doubles() -> None:
    layer = GrowingLayer()
    layer.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4))
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(kv_cache.MIN_CAPACITY - 10):
        layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == buffer  # no copy while there was room
    layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert layer._k is not None and layer._k.shape[-2] == 2 * kv_cache.MIN_CAPACITY
    assert layer.get_seq_length() == kv_cache.MIN_CAPACITY + 1


def test_new_cache_swaps_full_attention_layers_only() -> None:
    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    cache = new_cache(config)
    assert len(cache.layers) == 3 and all(type(layer) is GrowingLayer for layer in cache.layers)
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 16
    mixed = new_cache(config)
    assert [type(layer) is GrowingLayer for layer in mixed.layers] == [True, False, True]
