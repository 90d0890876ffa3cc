"""Batch invariance (engine/model/invariance.py): a row fed in a block scores as it does alone.

The first tests measure what breaks it on this CPU: a float GEMM and silu give
a row other bits in a block than alone; the fixed-order kernel does not. The
rest feed float models through ModelRunner (the native decoder and
transformers' modules, by either path: the fixed-order kernel, or rows apart
through ATen) and require each row of a verify block to equal the one-token
step's logits with torch.equal, and greedy speculative output to equal plain
output on a model built to be full of near-ties, where rounding decides most
choices.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.pytorch_utils import Conv1D

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import TokenEvent
from specchat.engine.model import decoder, invariance, quant
from specchat.engine.model.attention import MAX_ROWWISE
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import loaded, native_or_skip, perturbed, tiny_llama

ROWS = 5  # a verify block of K=4 drafts


def alone_and_in_a_block(f: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f on each row of x [1, M, D] alone (a fresh tensor, as a step has it), and on x whole."""
    alone = torch.cat([f(x[:, r : r + 1].clone()) for r in range(x.shape[1])], dim=1)  # type: ignore[operator]
    return alone, f(x)  # type: ignore[operator]


def test_a_float_gemm_gives_a_row_other_bits_in_a_block() -> None:
    """The measurement: F.linear on one row vs the same row among 5, float32 (MKL here)."""
    gen = torch.Generator().manual_seed(0)
    worst = {}
    for k, n in ((64, 64), (288, 288), (1536, 1536)):
        w = torch.randn(n, k, generator=gen) * k**-0.5
        x = torch.randn(1, ROWS, k, generator=gen)
        alone, block = alone_and_in_a_block(lambda t, w=w: F.linear(t, w), x)  # type: ignore[misc]
        worst[(k, n)] = float((alone - block).abs().max())
        # The row-wise path gives every row its one-row bits.
        assert torch.equal(invariance.dense_rows(x, w), alone)
    if not any(worst.values()):
        pytest.skip(f"this CPU's GEMM happens to be batch-invariant at these shapes: {worst}")
    print(f"max |row alone - row in a block of {ROWS}|: {worst}")


def test_silu_gives_an_element_other_bits_by_where_it_falls() -> None:
    """Vectorized silu and its scalar tail round differently: [7, 172] as rows vs as a block."""
    x = torch.randn(1, 7, 172, generator=torch.Generator().manual_seed(0)) * 3
    alone, block = alone_and_in_a_block(F.silu, x)
    with invariance.RowsApart():
        apart = F.silu(x)
    assert torch.equal(apart, alone)
    if torch.equal(alone, block):
        pytest.skip("this CPU's silu rounds the same in vector and scalar code here")


FIXED_ISA = invariance.fixed_kernel()
needs_fixed = pytest.mark.skipif(
    FIXED_ISA not in ("avx512", "avx2"), reason=f"{FIXED_ISA} (the engine takes rows apart here)"
)


@needs_fixed
def test_the_fixed_kernel_gives_a_row_the_same_bits_in_any_block() -> None:
    """Any row count up to MAX_ROWWISE, odd shapes, bias or not, 1 or 2 threads: equal bits,
    and as accurate as MKL's GEMM against float64."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    for k, n in ((64, 64), (7, 5), (17, 33), (172, 72), (899, 1031), (1536, 1536)):
        w = torch.randn(n, k, generator=gen) * k**-0.5
        x = torch.randn(1, MAX_ROWWISE, k, generator=gen)
        for bias in (None, torch.randn(n, generator=gen)):
            block = invariance.fixed_linear(x, w, bias)  # [1, 32, N]
            for m in (1, 2, 3, 5, 8, 9, 31):
                assert torch.equal(invariance.fixed_linear(x[:, :m], w, bias), block[:, :m])
            alone = torch.cat(
                [invariance.fixed_linear(x[:, r : r + 1].clone(), w, bias) for r in range(5)], 1
            )
            assert torch.equal(alone, block[:, :5])
            try:
                torch.set_num_threads(3 - threads if threads <= 2 else 1)
                assert torch.equal(invariance.fixed_linear(x, w, bias), block)
            finally:
                torch.set_num_threads(threads)
            exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            mkl = float((F.linear(x, w, bias) - exact).abs().max())
            assert float((block - exact).abs().max()) <= 2 * mkl + 1e-6, (k, n)


def tiny_qwen2() -> Qwen2ForCausalLM:
    """q/k/v biases and a tied head: F.linear with a bias, and the embedding as the head."""
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=200,  # not a multiple of 32: silu's scalar tail moves with the rows
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return model


MODELS = {
    "llama": lambda: tiny_llama(seed=3, layers=3),
    "llama-odd-widths": lambda: tiny_llama(seed=3, layers=3, hidden=72, intermediate=172),
    "llama-wide": lambda: tiny_llama(seed=3, layers=2, hidden=512, intermediate=1376),
    "qwen2-biases-tied-head": tiny_qwen2,
}


@pytest.fixture(params=["fixed", "apart"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fixed-order kernel (where this CPU has one), or rows apart through ATen."""
    if request.param == "fixed" and FIXED_ISA not in ("avx512", "avx2"):
        pytest.skip(FIXED_ISA)
    monkeypatch.setenv(invariance.ENV, "1" if request.param == "fixed" else "apart")
    return str(request.param)


def runner_for(model: torch.nn.Module, native: bool) -> ModelRunner:
    runner = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    if native:
        native_or_skip(runner)
    else:
        runner.native = None  # transformers' modules
    return runner


def steps_and_block(
    runner: ModelRunner, prompt: list[int], n: int, keep: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of n tokens fed one by one after the prompt, and of the same n fed as one block."""
    runner.reset()
    if prompt:
        runner.feed(prompt)
    tokens = [(7 * i + 11) % 250 + 3 for i in range(n)]
    steps = [runner.feed([t])[-1] for t in tokens]
    runner.crop_to(len(prompt))
    return steps[n - keep :], runner.feed(tokens, keep=keep)


@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_row_of_a_verify_block_equals_its_step(name: str, native: bool, path: str) -> None:
    """keep = k+1 rows of a block against one-token feeds, bit for bit, float32."""
    runner = runner_for(MODELS[name](), native)
    assert runner.exactness.identical, runner.exactness
    assert runner.exactness.rows == (invariance.FIXED if path == "fixed" else invariance.APART)
    for n in (2, ROWS, 9, MAX_ROWWISE):
        steps, block = steps_and_block(runner, list(range(5, 40)), n, keep=n)
        for i, step in enumerate(steps):
            assert torch.equal(block[i], step), (n, i, float((block[i] - step).abs().max()))
    # A plain step with pending tokens keeps one row; a first pass has no cache at all.
    steps, block = steps_and_block(runner, list(range(5, 40)), 3, keep=1)
    assert torch.equal(block[0], steps[0])
    steps, block = steps_and_block(runner, [], ROWS, keep=ROWS)
    for i, step in enumerate(steps):
        assert torch.equal(block[i], step), (i, float((block[i] - step).abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
def test_half_precision_rows_equal_their_steps_too(native: bool, dtype: torch.dtype) -> None:
    """No fixed kernel for 16-bit floats: rows apart. Without, bfloat16 blocks differ by up
    to 0.13 here. A row taken apart must also have a step's strides: on a Xeon with
    AVX512-FP16 and AMX (MKL 2024.2) a float16 row whose size-1 dimension kept the block's
    stride came out 0.006 off its step in the LM head's input (csrc/decoder.cpp row_alone)."""
    model = tiny_llama(seed=3, layers=3, hidden=256, intermediate=688).to(dtype)
    runner = runner_for(model, native)
    name = str(dtype).removeprefix("torch.")
    assert runner.exactness.rows == invariance.APART and name in runner.exactness.reason
    steps, block = steps_and_block(runner, list(range(5, 40)), ROWS, keep=ROWS)
    for i, step in enumerate(steps):
        assert torch.equal(block[i], step), i


def test_turned_off_a_block_is_one_gemm_and_rows_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECCHAT_ROWS_APART=0 (to measure the cost): the runner says so, and rows drift."""
    monkeypatch.setenv(invariance.ENV, "0")
    runner = runner_for(tiny_llama(seed=3, layers=3), native=True)
    assert not runner.exactness.identical and not runner.exactness.rows_apart
    assert (
        "floating-point ties" in runner.exactness.reason
        and invariance.ENV in runner.exactness.reason
    )
    steps, block = steps_and_block(runner, list(range(5, 40)), ROWS, keep=ROWS)
    assert any(not torch.equal(block[i], s) for i, s in enumerate(steps))


def test_the_plan_names_the_path_or_why_not() -> None:
    dense = invariance.plan(runner_for(tiny_llama(), native=True).model)
    assert dense.identical and "token-identical" in dense.reason and "float32" in dense.reason
    if dense.fixed:
        assert f"fixed-order kernel ({FIXED_ISA})" in dense.reason
    else:
        assert "one row at a time" in dense.reason and FIXED_ISA in dense.reason
    model = quant.apply(tiny_llama(hidden=64), QuantMode.W8A8)
    runner = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    assert runner.exactness.identical and "w8a8 kernels" in runner.exactness.reason
    assert "float32" not in runner.exactness.reason  # no float projection left
    usual = tiny_llama()  # never given to a runner: transformers' SDPA
    assert not invariance.plan(usual).identical
    assert "attention is not scored row by row" in invariance.plan(usual).reason
    model = tiny_llama(hidden=64, intermediate=128)
    model.model.layers[1].mlp.down_proj = Conv1D(64, 128)  # GPT-2's projection: addmm
    exactness = ModelRunner(model, torch.device("cpu")).exactness  # type: ignore[arg-type]
    assert not exactness.identical and not exactness.rows_apart
    assert "down_proj (Conv1D) is not known to compute rows alone" in exactness.reason


# Greedy decoding on a model full of near-ties. The LM head's odd rows copy the even
# rows plus noise of 1e-7: the top two logits are nearly always such a pair, 1e-6 or
# so apart, and rounding decides between them. Measured without rows apart (this
# CPU, 4 prompts x 32 tokens): 11 of 12 runs of spec, self-spec and lookup left plain.
PROMPTS = ("Once upon a time", "def add(a, b):", "The quick brown fox", "Speculative decoding")


def near_ties(delta: float = 1e-7) -> torch.nn.Module:
    model = tiny_llama(seed=0, layers=3, hidden=64, intermediate=172)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = model.lm_head.weight  # [V, H]
        odd = w[1::2]
        odd.copy_(w[0::2][: len(odd)] + delta * torch.randn(odd.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def tie_target() -> torch.nn.Module:
    return near_ties()


def greedy(target: torch.nn.Module, prompt: str, mode: Mode, **kw: object) -> list[int]:
    draft = loaded(perturbed(target, 0.3), "draft") if mode is Mode.SPEC else None
    session = ChatSession(loaded(target), draft)
    cfg = DecodeConfig(mode=mode, max_new_tokens=32, **kw)  # type: ignore[arg-type]
    return [e.token_id for e in session.stream(prompt, cfg) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
@pytest.mark.parametrize(
    ("mode", "kw"),
    [
        (Mode.SPEC, {"k": 4}),
        (Mode.SELF_SPEC, {"k": 3, "exit_layer": 1}),
        (Mode.LOOKUP, {"k": 3}),
    ],
    ids=["spec", "self-spec", "lookup"],
)
def test_greedy_speculation_equals_plain_on_near_ties(
    tie_target: torch.nn.Module,
    mode: Mode,
    kw: dict[str, object],
    native: bool,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not native:
        monkeypatch.setenv(decoder.ENV, "0")
    for prompt in PROMPTS:
        plain = greedy(tie_target, prompt, Mode.PLAIN)
        assert greedy(tie_target, prompt, mode, **kw) == plain, prompt


CHECK_IN_A_CHILD = """
import torch, torch.nn.functional as F
from specchat.engine.model import invariance
from tests.tinymodels import tiny_llama
from tests.unit.test_batch_invariance import runner_for, steps_and_block
print(invariance.fixed_kernel())
gen = torch.Generator().manual_seed(0)
for k, n in ((7, 5), (172, 72), (899, 1031)):
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(1, 9, k, generator=gen)
    if invariance.fixed_kernel() == "avx2":
        block = invariance.fixed_linear(x, w, b)
        assert all(torch.equal(invariance.fixed_linear(x[:, :m], w, b), block[:, :m]) for m in range(1, 10))
        exact = F.linear(x.double(), w.double(), b.double())
        assert float((block - exact).abs().max()) <= 2 * float((F.linear(x, w, b) - exact).abs().max()) + 1e-6
runner = runner_for(tiny_llama(seed=3, layers=2, hidden=72, intermediate=172), native=True)
print(runner.exactness.rows, runner.exactness.reason)
steps, block = steps_and_block(runner, list(range(5, 40)), 5, keep=5)
assert all(torch.equal(block[i], s) for i, s in enumerate(steps))
"""


@pytest.mark.parametrize("isa", ["avx2", "none"])
def test_a_cpu_with_less_takes_the_avx2_kernel_or_rows_apart(isa: str) -> None:
    """SPECCHAT_FIXED_ISA asks the library for less than this CPU has: the AVX2 tiles
    (exact and invariant too), or no kernel at all (then rows apart, and the reason says so)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if FIXED_ISA not in ("avx512", "avx2") or (isa == "avx2" and FIXED_ISA != "avx512"):
        pytest.skip(f"this CPU has nothing more to step down from: {FIXED_ISA}")
    env = {**os.environ, "SPECCHAT_FIXED_ISA": isa, invariance.ENV: "1"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", CHECK_IN_A_CHILD], env=env, cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, rows = out.stdout.splitlines()[:2]
    if isa == "avx2":
        assert first == "avx2" and rows.startswith(f"{invariance.FIXED} ") and "(avx2)" in rows
    else:
        assert first.startswith("no fixed-order kernel") and rows.startswith(f"{invariance.APART} ")
        assert "one row at a time" in rows
