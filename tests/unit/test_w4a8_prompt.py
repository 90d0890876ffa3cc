"""A prompt's rows on the w4a8 kernel's bfloat16 tiles (engine/model/native.py `prompt_rows`).

Where the AMX path runs on a CPU with AMX-BF16, a prompt's calls of W4A8_PROMPT_MIN_ROWS
rows or more bring each pair of row groups' weights to bfloat16 once and multiply every
row in bfloat16, summed in float32. The reference below is the same product in float64
from the same bfloat16 values: a wrong nibble, layout, scale or row shows as an error of
the size of the outputs, rounding as ~1e-6 of the summed magnitudes. Elsewhere only the
choice and its refusal are tested (the kernel never runs code the CPU lacks).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.errors import QuantizationError
from specchat.engine.events import TokenEvent
from specchat.engine.model import cpu, native, qlinear, quant
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import loaded, tiny_llama

UNAVAILABLE = native.unavailable("w4a8")  # no compiler, or not x86 with AVX2
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
ON_AMX = UNAVAILABLE is None and native.w4a8_choice("auto")[0] == "amx"
BF16 = ON_AMX and bool(torch.ops.specchat.w4a8_amx_bf16_permitted())
NO_BF16 = f"no AMX-BF16 path here ({cpu.features().summary()})"
GROUPS = sorted(qlinear.W4A8_SHRINKS)


@pytest.fixture
def path_restored() -> object:
    yield
    native.w4a8_use("auto")


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """x and the dequantized weights (code * scale + min, one rounding, then bfloat16) in float64."""
    codes, scales, mins = qlinear.quantize_w4a8(weight, group)
    w = torch.addcmul(
        mins.float().repeat_interleave(group, 1), codes.float(), scales.float().repeat_interleave(group, 1)
    )
    return x.bfloat16().double() @ w.bfloat16().double().T


@pytest.mark.skipif(not BF16, reason=NO_BF16)
@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 90),
    blocks=st.integers(1, 10),
    seed=st.integers(0, 2**16),
    group=st.sampled_from(GROUPS),
)
@example(m=48, n=24, blocks=3, seed=0, group=32)  # three row groups: the quad repeats its last
@example(m=33, n=64, blocks=4, seed=1, group=128)  # a pass of 32 rows, then one of 16 holding 1
@example(m=141, n=40, blocks=2, seed=2, group=32)  # a prompt's length: 4 passes of 32 and one of 16
def test_a_prompts_rows_in_bfloat16_tiles_are_the_product_of_their_bfloat16_values(
    m: int, n: int, blocks: int, seed: int, group: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = group * blocks
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    packed, scales, mins = qlinear.pack_w4a8(weight, group)
    try:
        native.w4a8_use("amx")
        torch.ops.specchat.w4a8_set_prompt_rows(1)  # every call, however short
        with native.prompt_rows():
            assert torch.ops.specchat.w4a8_takes_bf16(m)
            got = torch.ops.specchat.w4a8_linear(x, packed, scales, mins, n)
        steps = torch.ops.specchat.w4a8_linear(x, packed, scales, mins, n)
    finally:
        native.w4a8_use("auto")
    want = bf16_reference(x, weight, group)
    # float32 sums of k products, and a product's bfloat16 value one step off where the
    # float32 dequantization rounds differently from addcmul's: 2^-8 of the magnitudes.
    bound = (x.bfloat16().double().abs() @ weight.double().abs().T) * 2**-8 + 1e-6
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # ... and not a step's bits: the int8 code's answer differs (its activations in int8)
    assert not torch.equal(got, steps)


@pytest.mark.skipif(not BF16, reason=NO_BF16)
def test_only_a_prompts_calls_on_this_thread_take_the_tiles(path_restored: object) -> None:
    """Verify blocks and steps keep a step's bits (greedy speculation equals plain): the
    tiles are for calls inside `prompt_rows`, of W4A8_PROMPT_MIN_ROWS rows or more, on the
    thread that asked, and the flag comes back as it was."""
    native.w4a8_use("auto")
    takes = torch.ops.specchat.w4a8_takes_bf16
    least = native.W4A8_PROMPT_MIN_ROWS
    assert not takes(least) and not takes(500)
    with native.prompt_rows():
        assert takes(least) and takes(500) and not takes(least - 1)
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(bool(takes(500))))
        t.start()
        t.join()
        assert other == [False]
        with native.prompt_rows(False):
            assert takes(least)  # off asks nothing: the outer prompt's rows stay
    assert not takes(least)
    assert f"prompts of {least}+ rows in bfloat16 tiles" in str(native.w4a8_describe())
    native.w4a8_use("avx512vnni")  # the tiles are the AMX path's
    with native.prompt_rows():
        assert not takes(500)
    assert "bfloat16" not in str(native.w4a8_describe())


@pytest.mark.skipif(not ON_AMX, reason=f"no AMX path here ({cpu.features().summary()})")
def test_steps_in_the_environment_keep_a_prompt_on_a_steps_bits(
    monkeypatch: pytest.MonkeyPatch, path_restored: object
) -> None:
    monkeypatch.setenv(native.W4A8_PROMPT_ENV, "steps")
    native.w4a8_use("auto")
    with native.prompt_rows():
        assert not torch.ops.specchat.w4a8_takes_bf16(500)
    assert "bfloat16" not in str(native.w4a8_describe())
    monkeypatch.setenv(native.W4A8_PROMPT_ENV, "fast")
    with pytest.raises(QuantizationError, match="SPECCHAT_W4A8_PROMPT='fast' names no way"):
        native.w4a8_use("auto")
    monkeypatch.delenv(native.W4A8_PROMPT_ENV)


def test_without_the_tiles_the_kernel_refuses_them_with_a_reason(path_restored: object) -> None:
    if BF16:
        pytest.skip("this CPU has AMX-BF16: the kernel takes them")
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        torch.ops.specchat.w4a8_set_prompt_rows(16)
    with native.prompt_rows():
        assert not torch.ops.specchat.w4a8_takes_bf16(500)


def tiny_w4a8(seed: int = 3) -> torch.nn.Module:
    return quant.apply(tiny_llama(seed=seed, hidden=128, intermediate=256), QuantMode.W4A8, lm_head=True)


@pytest.mark.skipif(not BF16, reason=NO_BF16)
def test_a_long_prompt_read_in_tiles_leaves_greedy_speculation_equal_to_plain(
    monkeypatch: pytest.MonkeyPatch, path_restored: object
) -> None:
    """Plain and speculative turns read a prompt alike, so the tiles change no token between
    them; the first step after the prompt shows they ran (its logits differ from a prompt
    read on a step's bits, by rounding)."""
    native.w4a8_use("auto")
    target = tiny_w4a8()
    rng = random.Random(0)  # no repeats for lookup to copy: the draft model drafts
    prompt = " ".join("".join(rng.choices("abcdefghij", k=5)) for _ in range(16))
    session = ChatSession(loaded(target), loaded(tiny_w4a8(seed=4), "draft"))
    ids = session.target.tokenizer(prompt)["input_ids"]
    assert len(ids) >= native.W4A8_PROMPT_MIN_ROWS + 1

    runner = ModelRunner(target, torch.device("cpu"))
    firsts = []
    for tiles in (True, False):
        runner.reset()
        runner.prefill(ids, prompt=tiles)
        firsts.append(runner.feed(ids[-1:], keep=1))
    assert not torch.equal(firsts[0], firsts[1])
    assert float((firsts[0] - firsts[1]).abs().max()) < 0.05 * float(firsts[1].abs().max())

    asked: list[bool] = []  # the prompt's reads, the target's and the draft's
    real = native.prompt_rows

    def spy(on: bool = True):  # type: ignore[no-untyped-def]
        asked.append(on)
        return real(on)

    for where in ("specchat.engine.model.runner", "specchat.engine.decode.ahead"):
        monkeypatch.setattr(f"{where}.prompt_rows", spy)  # the draft's read: serial or ahead
    replies = {}
    for mode in (Mode.PLAIN, Mode.SPEC):
        session.reset(drop_caches=True)  # each turn reads the prompt itself
        cfg = DecodeConfig(mode=mode, k=3, max_new_tokens=24, compose=False)
        events = list(session.stream(prompt, cfg))
        replies[mode] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert len(replies[Mode.PLAIN]) == 24
    assert replies[Mode.SPEC] == replies[Mode.PLAIN]
    assert asked.count(True) >= 3, asked  # plain's prompt, spec's, and the draft's read
