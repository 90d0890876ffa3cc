"""Row-wise attention: a token verified in a block scores bit for bit as it would alone."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.config import QuantMode
from specchat.engine.model import attention, quant
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import tiny_llama


def sequential_and_block(
    runner: ModelRunner, prompt: list[int], n: int
) -> tuple[list, torch.Tensor]:
    runner.feed(prompt)
    tokens, logits = [prompt[-1] + 1], []
    for _ in range(n):
        step = runner.feed([tokens[-1]])[-1]
        logits.append(step)
        tokens.append(int(step.argmax()))
    runner.crop_to(len(prompt))
    return logits, runner.feed(tokens[:n], keep=n)


@pytest.mark.parametrize("mode", [QuantMode.NONE, QuantMode.INT8, QuantMode.INT4, QuantMode.W8A8])
def test_block_rows_equal_single_steps(mode: QuantMode) -> None:
    """Bit for bit: quantized kernels compute each row alone; float32 projections (MKL's
    GEMM, ~1e-6 apart in a block) run a block one row at a time (engine/model/invariance.py)."""
    model = quant.apply(tiny_llama(seed=3, layers=3), mode)
    runner = ModelRunner(model, torch.device("cpu"))
    assert model.config._attn_implementation == attention.NAME
    steps, block = sequential_and_block(runner, list(range(5, 40)), 7)
    for i, step in enumerate(steps):
        assert torch.equal(block[i], step), f"row {i} differs by {(block[i] - step).abs().max()}"


def test_usual_sdpa_is_not_row_invariant() -> None:
    """The control: the same model and tokens through transformers' own SDPA path differ."""
    model = quant.apply(tiny_llama(seed=3, layers=3), QuantMode.W8A8)
    runner = ModelRunner(model, torch.device("cpu"))
    model.set_attn_implementation("sdpa")
    steps, block = sequential_and_block(runner, list(range(5, 40)), 7)
    assert any(not torch.equal(block[i], step) for i, step in enumerate(steps))


def test_long_blocks_take_the_usual_path() -> None:
    """A prompt longer than MAX_ROWWISE is one attention call per layer, and agrees closely."""
    model = tiny_llama(seed=3, layers=2)
    n = attention.MAX_ROWWISE + 8
    ids = torch.arange(1, n + 1).view(1, n)
    with torch.no_grad():
        usual = model(ids).logits
        attention.use_rowwise_attention(model)
        rowwise = model(ids).logits
    torch.testing.assert_close(rowwise, usual)


def test_sliding_window_models_are_left_alone() -> None:
    model = tiny_llama(seed=3, layers=2)
    model.config.use_sliding_window = True
    model.config.sliding_window = 16
    assert not attention.use_rowwise_attention(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("new", [1, 5, attention.MAX_ROWWISE, attention.MAX_ROWWISE + 1, 2 * attention.MAX_ROWWISE + 7])
def test_a_block_fed_after_a_cache_equals_a_fresh_prefill(new: int) -> None:
    """Prompt-sized blocks after a cache (a conversation's next turn) keep the causal mask right.

    Without a mask function registered for the row-wise attention, a block longer
    than MAX_ROWWISE after 10 cached tokens was scored with a top-left mask:
    logits off by ~6 on this model.
    """
    model = tiny_llama(seed=3, layers=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (10 + new,), generator=g).tolist()
    other = ids[:10] + torch.randint(3, 200, (15,), generator=g).tolist()
    runner = ModelRunner(model, torch.device("cpu"))
    assert model.config._attn_implementation == attention.NAME
    runner.forward(other)
    runner.crop_to(10)  # the shared prefix stays cached
    continued = runner.forward(ids, keep=new)
    fresh = ModelRunner(model, torch.device("cpu")).forward(ids, keep=new)
    torch.testing.assert_close(continued, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_len", [1, 7, 300])
def test_one_query_matmuls_agree_with_sdpa(kv_len: int) -> None:
    """The single-query path (two matmuls over grouped heads) computes SDPA's result."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(kv_len)
    module = torch.nn.Module()
    module.num_key_value_groups = 3  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    q = torch.randn(1, 6, 1, 16)
    k, v = torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
    kwargs = {"scaling": 16**-0.5, "dropout": 0.0}
    assert attention._plain_attention(module, kwargs)
    got = attention._one_query(module, q, k, v, kwargs)
    want, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not attention._plain_attention(module, {**kwargs, "softcap": 30.0})


def test_short_rows_score_on_one_thread_and_the_count_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of up to ONE_THREAD_KEYS keys run their matmuls on one thread (waking a second
    costs more than they do); the caller's thread count is back after, and the bits are those
    of the threaded computation."""
    seen: list[int] = []
    real = attention._one_query

    def spy(*args: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(*args)  # type: ignore[arg-type]

    model = tiny_llama(seed=4, layers=2)
    runner = ModelRunner(model, torch.device("cpu"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(attention, "_one_query", spy)
        runner.native = None  # transformers' modules, where rowwise_sdpa runs
        one = runner.feed(list(range(5, 30)), keep=25)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(attention, "ONE_THREAD_KEYS", 0)  # every row on the caller's threads
        runner.reset()
        threaded = runner.feed(list(range(5, 30)), keep=25)
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, threaded)
