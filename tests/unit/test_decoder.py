"""The native decoder (engine/model/decoder.py) against transformers' modules, bit for bit.

Each case runs two ModelRunners over the same model, one through the native
decoder and one through the modules, feeds both the same prompt, decode steps
and verify blocks, and asserts equal logits (torch.equal, not a tolerance) and
equal cache contents. A wrong operation, order or argument anywhere in the
C++ layer shows as a difference of 1e-7 or more and fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.model import decoder, native, qlinear, quant
from specchat.engine.model.cpu import fbgemm_unavailable
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import has_fbgemm
from tests.stories import load_stories, needs_stories
from tests.tinymodels import tiny_llama


@pytest.fixture(scope="module")
def decoder_kernel() -> None:
    """The decoder kernel, compiled once per machine (any CPU, but a C++ compiler); the tests
    that compare against it skip with the reason where it cannot be built."""
    reason = native.unavailable("decoder")
    if reason:
        pytest.skip(f"the decoder kernel cannot be built here: {reason}")


needs_decoder = pytest.mark.usefixtures("decoder_kernel")


def tiny_qwen2(dtype: torch.dtype = torch.float32, hidden: int = 128) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():  # q/k/v biases that matter
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return model.to(dtype)


def pair(model: torch.nn.Module) -> tuple[ModelRunner, ModelRunner]:
    fast = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    assert fast.native is not None, fast.native_off
    slow = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    slow.native = None
    return fast, slow


def same_everywhere(model: torch.nn.Module, prompt: list[int]) -> None:
    fast, slow = pair(model)
    for r in (fast, slow):
        r.feed(prompt)  # the prompt takes the modules' path in both
    tok = prompt[-1]
    for _ in range(6):  # decode steps
        a, b = fast.feed([tok])[-1], slow.feed([tok])[-1]
        assert torch.equal(a, b), (a - b).abs().max()
        tok = int(a.argmax())
    base = fast.cached
    for n in (2, 5, 9):  # verify blocks, rolled back as a refused draft would be
        block = [(tok + 7 * i) % 250 + 3 for i in range(n)]
        a, b = fast.feed(block, keep=n), slow.feed(block, keep=n)
        assert torch.equal(a, b), (n, (a - b).abs().max())
        fast.crop_to(base + 1)
        slow.crop_to(base + 1)
    a, b = fast.feed([5, 6])[-1], slow.feed([5, 6])[-1]  # after a crop: overwrites
    assert torch.equal(a, b)
    for la, lb in zip(fast.cache.layers, slow.cache.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@needs_decoder
def test_llama_float32_is_bit_identical() -> None:
    same_everywhere(tiny_llama(), list(range(3, 40)))


@needs_decoder
def test_qwen2_with_biases_and_tied_head_is_bit_identical() -> None:
    same_everywhere(tiny_qwen2(), list(range(3, 40)))


@needs_decoder
def test_bfloat16_is_bit_identical() -> None:
    same_everywhere(tiny_qwen2(torch.bfloat16), list(range(3, 40)))


@needs_decoder
def test_cache_growth_inside_a_native_pass() -> None:
    """A prompt that fills the first buffer, then steps that make it double."""
    model = tiny_llama()
    fast, slow = pair(model)
    prompt = list(range(3, 3 + 250))
    fast.feed(prompt)
    slow.feed(prompt)
    for tok in range(10, 20):  # crosses 256, the first capacity
        assert torch.equal(fast.feed([tok], keep=1), slow.feed([tok], keep=1))


@needs_decoder
def test_w4a8_groups_are_bit_identical() -> None:
    """Quantized q/k/v and gate/up groups (with Qwen2's biases on the group's parts)."""
    reason = native.unavailable("w4a8")  # x86 with AVX2, and a compiler
    if reason:
        pytest.skip(f"the w4a8 kernel cannot be used here: {reason}")
    model = quant.apply(tiny_qwen2(hidden=128), QuantMode.W4A8, lm_head=False)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, qlinear.SharedInputMember)
    same_everywhere(model, list(range(3, 40)))


def test_a_prompt_takes_one_torch_thread_only_where_every_projection_is_w4a8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner runs a prompt's small ops on one torch thread (`kernel_only`) only where
    the w4a8 kernel, which keeps its own threads, computes every projection, the LM head's
    included: a float head would then read its weights on one thread. Its logits do not
    change, and short blocks after the first pass go native as before."""
    reason = native.unavailable("w4a8")
    if reason:
        pytest.skip(f"the w4a8 kernel cannot be used here: {reason}")
    body_only = quant.apply(tiny_qwen2(hidden=128), QuantMode.W4A8, lm_head=False)
    assert not ModelRunner(body_only, torch.device("cpu")).kernel_only
    assert not ModelRunner(tiny_qwen2(hidden=128), torch.device("cpu")).kernel_only
    model = quant.apply(tiny_qwen2(hidden=128), QuantMode.W4A8, lm_head=True)
    runner = ModelRunner(model, torch.device("cpu"))
    assert runner.kernel_only
    seen: list[bool] = []
    real = native.small_ops_on_one_thread

    def spy(on: bool = True):  # type: ignore[no-untyped-def]
        seen.append(on)
        return real(on)

    monkeypatch.setattr("specchat.engine.model.runner.small_ops_on_one_thread", spy)
    prompt = list(range(3, 40))
    alone = runner.feed(prompt, keep=3)
    runner.reset()
    runner.kernel_only = False
    assert torch.equal(runner.feed(prompt, keep=3), alone)
    assert seen == [True, False]


@needs_decoder
@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.INT4])
def test_weight_only_int8_and_int4_are_bit_identical(mode: QuantMode) -> None:
    """bfloat16 activations inside, float32 outside, as the modules do."""
    model = quant.apply(tiny_llama(hidden=128), mode, lm_head=False, group_size=32)
    assert not isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    same_everywhere(model, list(range(3, 40)))


@needs_decoder
@pytest.mark.skipif(not has_fbgemm(), reason=f"w8a8 needs fbgemm: {fbgemm_unavailable()}")
def test_w8a8_groups_are_bit_identical() -> None:
    """fbgemm's packed weights reach the C++ as the object the modules call."""
    model = quant.apply(tiny_qwen2(hidden=128), QuantMode.W8A8, lm_head=False)
    assert isinstance(model.model.layers[0].self_attn.q_proj, qlinear.SharedInputMember)
    same_everywhere(model, list(range(3, 40)))


def test_unsupported_projections_say_why_and_keep_the_modules_path() -> None:
    model = tiny_llama(hidden=64)
    with torch.no_grad():  # a projection kind the native decoder does not know
        mlp = model.model.layers[1].mlp
        mlp.down_proj = torch.nn.Sequential(mlp.down_proj)
    runner = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    assert runner.native is None
    assert "down_proj is a Sequential" in runner.native_off
    runner.feed(list(range(3, 20)))
    assert runner.feed([4]).shape == (1, runner.vocab)


def test_the_environment_can_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decoder.ENV, "0")
    runner = ModelRunner(tiny_llama(), torch.device("cpu"))  # type: ignore[arg-type]
    assert runner.native is None and decoder.ENV in runner.native_off


@needs_decoder
def test_first_pass_and_long_blocks_take_the_modules_path() -> None:
    fast, _ = pair(tiny_llama())
    assert fast.native is not None
    assert not fast.native.usable(fast.cache, 0, 1)  # nothing cached yet
    fast.feed(list(range(3, 10)))
    assert fast.native.usable(fast.cache, fast.cached, 1)
    assert not fast.native.usable(fast.cache, fast.cached, 64)  # a prompt
    fast.model.set_attn_implementation("sdpa")  # switched after the runner was made
    assert not fast.native.usable(fast.cache, fast.cached, 1)


@needs_decoder
@needs_stories
def test_real_weights_are_bit_identical() -> None:
    model, tok = load_stories()
    prompt = tok("Once upon a time, there was a little")["input_ids"]  # type: ignore[index]
    same_everywhere(model, prompt)  # type: ignore[arg-type]


def test_other_architectures_are_refused() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, hidden_act="gelu",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    runner = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    assert runner.native is None and "gelu" in runner.native_off


def test_a_failed_build_is_reported_and_decoding_still_works(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from specchat.engine.errors import QuantizationError
    from specchat.engine.events import LoadProgress
    from specchat.engine.weights.loading import load_model
    from tests.tinymodels import tiny_tokenizer

    tiny_llama(layers=2).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)

    def no_compiler(kernel: str) -> None:
        raise QuantizationError(f"could not build the {kernel} kernel: g++: not found")

    monkeypatch.setattr(native, "is_built", lambda kernel: False)
    monkeypatch.setattr(native, "load", no_compiler)
    events: list[LoadProgress] = []
    spec = ModelSpec(str(tmp_path), QuantMode.NONE, dtype="float32", device="cpu")
    loaded = load_model(spec, "target", progress=events.append)
    last = [e.detail for e in events if e.stage == "build"][-1]
    assert "g++: not found" in last and "using Python" in last
    runner = ModelRunner(loaded.model, loaded.device)
    assert runner.native is None and "g++: not found" in runner.native_off
    runner.feed(list(range(3, 20)))
    assert runner.feed([4]).shape == (1, runner.vocab)


def test_a_machine_without_a_compiler_is_told_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler on PATH: the error says so before ninja runs, and a second load in the
    same process gives the same answer without trying again."""
    from torch.utils import cpp_extension

    from specchat.engine.errors import QuantizationError

    calls: list[object] = []
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_failed", {})
    monkeypatch.setattr(native, "is_built", lambda kernel: False)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.setenv("CXX", "/nonexistent/specchat-test-c++")
    for _ in range(2):
        with pytest.raises(QuantizationError, match="no C[+][+] compiler") as info:
            native.load("decoder")
        assert "/nonexistent/specchat-test-c++" in info.value.message
        assert "C++ compiler" in info.value.hint
    assert calls == []


def test_a_failed_build_names_the_compilers_error() -> None:
    text = (
        "Error building extension 'specchat_decoder': [1/2] c++ -Werror -c decoder.cpp\n"
        "FAILED: decoder.o\ndecoder.cpp:9:10: fatal error: torch/library.h: No such file\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    got = native._build_error(RuntimeError(text))
    assert got == "decoder.cpp:9:10: fatal error: torch/library.h: No such file"
    missing = (
        "Error building extension 'x': [1/2] /opt/c++ -c a.cpp\n"
        "/bin/sh: 1: /opt/c++: not found\nninja: build stopped: subcommand failed."
    )
    assert native._build_error(RuntimeError(missing)) == "/bin/sh: 1: /opt/c++: not found"


@needs_decoder
def test_early_exit_layer_ranges_are_bit_identical() -> None:
    """The early-exit stack runs layer ranges (exit points, the self-speculative draft)."""
    from specchat.engine.model.layers import LayerStack

    model = tiny_llama()
    fast, slow = pair(model)
    stacks = LayerStack(model), LayerStack(model)
    stacks[1].native = None
    assert stacks[0].native is not None
    for r in (fast, slow):
        r.feed(list(range(3, 30)))
    for ids in ([7], [8, 9, 10]):
        outs = []
        for runner, stack in zip((fast, slow), stacks, strict=True):
            with torch.inference_mode():  # as the stepper and the drafter run it
                p = stack.begin(torch.tensor(ids), runner.cache, runner.cached)
                low = stack.run(p, 0, 1).clone()  # up to an exit point ...
                outs.append((low, stack.run(p, 1, 4)))  # ... and on to the top
            runner.cached += len(ids)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for la, lb in zip(fast.cache.layers, slow.cache.layers, strict=True):
        assert torch.equal(la.keys, lb.keys)


def test_a_refusal_from_the_cpp_side_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise RuntimeError("wrong number of weight tensors\nException raised from ...")

    monkeypatch.setattr(decoder, "_layer_steps", refuse)
    runner = ModelRunner(tiny_llama(), torch.device("cpu"))  # type: ignore[arg-type]
    assert runner.native is None and runner.native_off == "wrong number of weight tensors"


@needs_decoder
def test_the_early_exit_stack_shares_its_runners_decoder() -> None:
    """Steppers are made every turn: they must not build a second decoder each time."""
    from specchat.engine.decode.early_exit import EarlyExitStepper
    from specchat.engine.decode.exit_policy import ExitPolicy
    from specchat.engine.model.layers import LayerStack

    model = tiny_llama()
    runner = ModelRunner(model, torch.device("cpu"))  # type: ignore[arg-type]
    stepper = EarlyExitStepper(runner, ExitPolicy.uniform((2,), 0.9))
    assert stepper.stack.native is runner.native is not None
    assert LayerStack(model).native is not runner.native  # no runner: its own
