"""The decoder kernel's one-query attention (csrc/decoder.cpp `attend`): what it computes,
and that a row's bits do not depend on the rows beside it (a verify block's row against the
step at its position), the property greedy exactness rests on."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.model import attention, native

# (query heads, key heads, head dimension): the default pair's (12/2/128, 14/2/64), one key
# head per query head, and widths whose values take fewer than 8 vectors a pass.
SHAPES = [(12, 2, 128), (14, 2, 64), (4, 4, 8), (8, 2, 16), (9, 1, 24)]
KEYS = [1, 7, 8, 9, 63, 65, 200]  # first row's keys: every tail of a group of 8
ROWS = [1, 2, 5, 9]


@pytest.fixture(scope="module", autouse=True)
def attend_kernel() -> None:
    reason = native.unavailable("decoder")
    if reason:
        pytest.skip(f"the decoder kernel cannot be built here: {reason}")
    native.load("decoder")
    probe = torch.zeros(1, 2, 1, 8)
    if not torch.ops.specchat.attend_takes(probe, probe, probe):
        pytest.skip("attend runs on x86 CPUs with AVX2 and FMA (off: SPECCHAT_FIXED_ISA=none, SPECCHAT_ATTEND=aten)")


def reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scaling: float) -> torch.Tensor:
    """float64 softmax(q k^T * scaling) v, row r against keys [0, first + r): [1, M, H, D]."""
    h, m, d = q.shape[1], q.shape[2], q.shape[3]
    h_kv = key.shape[1]
    rows = []
    for r in range(m):
        n = first + r
        qr = q[:, :, r : r + 1].double().reshape(1, h_kv, h // h_kv, d)
        scores = qr @ key[:, :, :n].double().transpose(-1, -2) * scaling
        rows.append((torch.softmax(scores, -1) @ value[:, :, :n].double()).reshape(1, 1, h, d))
    return torch.cat(rows, 1)


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_attend_is_softmax_attention_and_a_row_alone_equals_it_in_a_block(
    heads: int, kv_heads: int, dim: int
) -> None:
    gen = torch.Generator().manual_seed(7)
    for first in KEYS:
        for m in ROWS:
            cap = first + m + 3  # a cache buffer longer than the keys, as the engine's
            key = torch.randn(1, kv_heads, cap, dim, generator=gen) * 2
            value = torch.randn(1, kv_heads, cap, dim, generator=gen)
            q = torch.randn(1, heads, m, dim, generator=gen) * 2
            scaling = dim**-0.5
            out = torch.ops.specchat.attend(q, key, value, first, scaling)
            assert out.shape == (1, m, heads, dim)
            # float32 against float64: the exponential is ~1 ulp, the sums fused
            torch.testing.assert_close(out.double(), reference(q, key, value, first, scaling), rtol=0, atol=2e-5)
            for r in range(m):
                n = first + r
                alone = torch.ops.specchat.attend(
                    q[:, :, r : r + 1].contiguous(), key[:, :, :n], value[:, :, :n], n, scaling
                )
                assert torch.equal(alone[0, 0], out[0, r]), (first, m, r)


def test_the_module_path_scores_a_row_with_the_same_code() -> None:
    """engine/attention.py's one-query form calls attend where the kernel takes the tensors,
    so transformers' modules and the native decoder give a row the same bits."""
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(1, 2, 40, 64, generator=gen)
    value = torch.randn(1, 2, 40, 64, generator=gen)
    q = torch.randn(1, 14, 1, 64, generator=gen)
    module = torch.nn.Module()
    got = attention._one_query(module, q, key, value, {"scaling": 0.125})
    want = torch.ops.specchat.attend(q, key, value, 40, 0.125)
    assert torch.equal(got, want)
    # Where attend does not take them (float64 here), the matmuls run, to the same values.
    ref = attention._one_query(module, q.double(), key.double(), value.double(), {"scaling": 0.125})
    torch.testing.assert_close(ref, want.double(), rtol=0, atol=1e-5)


def test_a_long_cache_split_over_threads_gives_the_same_bits() -> None:
    """From 1,024 keys the key heads run on threads of their own (kSplitKeys): which thread
    scores a head never changes a value, and every row still matches the reference."""
    gen = torch.Generator().manual_seed(5)
    first, m = 1100, 3
    key = torch.randn(1, 2, first + m, 64, generator=gen)
    value = torch.randn(1, 2, first + m, 64, generator=gen)
    q = torch.randn(1, 14, m, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = torch.ops.specchat.attend(q, key, value, first, 0.125)
        torch.set_num_threads(1)
        alone = torch.ops.specchat.attend(q, key, value, first, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, alone)
    torch.testing.assert_close(split.double(), reference(q, key, value, first, 0.125), rtol=0, atol=2e-5)
