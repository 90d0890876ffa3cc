"""Loading choices that need no weights: devices, dtypes, automatic quantization."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.errors import ModelLoadError
from specchat.engine.events import LoadProgress
from specchat.engine.model import cpu
from specchat.engine.weights import loading
from specchat.engine.weights.loading import (
    _approx_params,
    default_quant,
    default_quants,
    pick_device,
    pick_dtype,
)
from specchat.tui.commands import common

# What three kinds of machine report (engine/model/cpu.py), to decide as each of them would.
ARM = cpu.detect(
    machine="aarch64", cpuinfo="processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"
)
X86_NO_AVX2 = cpu.detect(
    machine="x86_64", cpuinfo="flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx\n"
)
AVX2_ONLY = cpu.detect(
    machine="x86_64", cpuinfo="flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2\n"
)
TORCH_HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


def test_default_quant_on_cuda_and_for_small_models() -> None:
    cpu_device, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_quant("target", cuda, 1_500_000_000) is QuantMode.BNB_NF4
    assert default_quant("draft", cuda, 500_000_000) is QuantMode.BNB_NF4
    assert default_quant("target", cpu_device, 292_800) is QuantMode.NONE


@pytest.mark.skipif(not cpu.features().avx2, reason=f"no AVX2 here: {cpu.features().summary()}")
def test_default_quant_on_this_avx2_cpu() -> None:
    """The machine's own answer: w4a8 first, then w8a8 where torch has fbgemm, then int8."""
    cpu_device = torch.device("cpu")
    assert default_quant("target", cpu_device, 1_500_000_000) is QuantMode.W4A8
    assert default_quant("draft", cpu_device, 500_000_000) is QuantMode.W4A8_G128
    then = (QuantMode.W8A8,) if TORCH_HAS_FBGEMM else ()
    assert default_quants("target", cpu_device, 1_500_000_000)[1:] == (*then, QuantMode.INT8)


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        (ARM, (QuantMode.INT8,)),
        (X86_NO_AVX2, (QuantMode.INT8,)),
        (AVX2_ONLY, (QuantMode.W4A8, QuantMode.W8A8, QuantMode.INT8)),
    ],
    ids=["arm", "x86-without-avx2", "avx2-only"],
)
def test_default_quant_by_what_the_cpu_reports(
    monkeypatch: pytest.MonkeyPatch, machine: cpu.CpuFeatures, expected: tuple[QuantMode, ...]
) -> None:
    """Every choice follows from the CPU's flags; fbgemm also needs a torch built with it."""
    monkeypatch.setattr(cpu, "features", lambda: machine)
    if not TORCH_HAS_FBGEMM:
        expected = tuple(m for m in expected if m is not QuantMode.W8A8)
    cpu_device = torch.device("cpu")
    assert default_quants("target", cpu_device, 1_500_000_000) == expected
    draft = tuple(QuantMode.INT4 if m is QuantMode.INT8 else m for m in expected)
    if QuantMode.W4A8 in draft:  # the draft reads the kernel's wider groups first
        draft = (QuantMode.W4A8_G128, *draft)
    assert default_quants("draft", cpu_device, 500_000_000) == draft
    everything = default_quants("target", cpu_device, 1_500_000_000, runnable_only=False)
    assert everything == (QuantMode.W4A8, QuantMode.W8A8, QuantMode.INT8)


def test_automatic_quantization_says_why_a_cpu_without_the_kernels_gets_int8(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On an ARM CPU the load passes over w4a8 and w8a8 with their reasons, and nothing starts
    a compiler. (The CPU is ARM as the product sees it; int8 runs through ATen anywhere.)"""
    from specchat.engine.model import native
    from tests.tinymodels import tiny_llama, tiny_tokenizer

    tiny_llama(layers=1).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(cpu, "features", lambda: ARM)
    monkeypatch.setattr(loading, "_approx_params", lambda config: 1_500_000_000)
    monkeypatch.setattr(loading, "_build_decoder", lambda config, device, report: None)
    monkeypatch.setattr(native, "is_built", lambda kernel: False)  # a new machine
    monkeypatch.setattr(native, "_built", {})  # nothing loaded in this process either
    events: list[LoadProgress] = []
    spec = ModelSpec(str(tmp_path), None, dtype="float32", device="cpu")
    loaded = loading.load_model(spec, "target", progress=events.append)
    assert loaded.info.quant == QuantMode.INT8.value
    details = [e.detail for e in events if e.stage == "quantize" and e.done == 0]
    assert details[0] == "w4a8: the w4a8 kernel is for x86-64 CPUs; this is aarch64; using w8a8"
    assert details[1].startswith("w8a8: w8a8 needs fbgemm: ") and details[1].endswith("using int8")
    assert not any(e.stage == "build" for e in events)  # no "compiling" for a kernel it cannot run


def test_automatic_quantization_falls_back_when_the_kernel_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No compiler: w4a8 is passed over for w8a8, and the load says why."""
    from transformers import LlamaConfig

    from specchat.engine.errors import QuantizationError
    from specchat.engine.model import native

    def no_compiler(kernel: str) -> None:
        raise QuantizationError("could not build the w4a8 kernel: g++: not found")

    monkeypatch.setattr(native, "load", no_compiler)
    monkeypatch.setattr(native, "is_built", lambda kernel: True)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    events: list = []
    modes = (QuantMode.W4A8, QuantMode.W8A8)
    chosen = loading._first_that_fits(modes, config, torch.device("cpu"), events.append)
    assert chosen is QuantMode.W8A8
    assert any("g++: not found; using w8a8" in e.detail for e in events)


def test_approx_params_of_the_default_target_shape() -> None:
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, vocab_size=151936
    )
    params = _approx_params(cfg)
    assert params > 1.5e9 and params < 2.0e9


def test_cpu_dtype_and_missing_cuda() -> None:
    assert pick_dtype("auto", torch.device("cpu")) is torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            pick_device("cuda")


def test_cli_quant_flags_mean_auto_unless_given() -> None:
    p = argparse.ArgumentParser()
    common.add_model_args(p)
    target, draft = common.model_specs(p.parse_args([]))
    assert target.quant is None and draft is not None and draft.quant is None
    target, draft = common.model_specs(p.parse_args(["--target-quant", "none", "--draft", "none"]))
    assert target.quant is QuantMode.NONE and draft is None


def test_a_model_that_cannot_fit_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from specchat.engine.errors import OutOfMemoryError
    from specchat.engine.weights import memory
    from specchat.engine.weights.loading import _check_memory

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=320)
    _check_memory(cfg, QuantMode.NONE, torch.float32, torch.device("cpu"), "the target")
    monkeypatch.setattr(memory, "available_bytes", lambda _device: 1000)
    with pytest.raises(OutOfMemoryError, match="loading the target needs"):
        _check_memory(cfg, QuantMode.NONE, torch.float32, torch.device("cpu"), "the target")
