"""Loading choices that need no weights: devices, dtypes, automatic quantization."""

from __future__ import annotations

import argparse

import pytest
import torch

from specchat.engine import loading
from specchat.engine.config import QuantMode
from specchat.engine.errors import ModelLoadError
from specchat.engine.loading import (
    _approx_params,
    default_quant,
    default_quants,
    pick_device,
    pick_dtype,
)
from specchat.tui.commands import common


def test_default_quant_by_device_and_role() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_quant("target", cpu, 1_500_000_000) is QuantMode.W4A8  # x86 with AVX2
    assert default_quant("draft", cpu, 500_000_000) is QuantMode.W4A8
    assert default_quants("target", cpu, 1_500_000_000)[1:] == (QuantMode.W8A8, QuantMode.INT8)
    assert default_quant("target", cuda, 1_500_000_000) is QuantMode.BNB_NF4
    assert default_quant("draft", cuda, 500_000_000) is QuantMode.BNB_NF4
    assert default_quant("target", cpu, 292_800) is QuantMode.NONE


def test_default_quant_without_fbgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from specchat.engine import native

    monkeypatch.setattr(native, "cpu_supports", lambda kernel: "not x86")
    monkeypatch.setattr(loading, "has_fbgemm", lambda: False)
    cpu = torch.device("cpu")
    assert default_quant("target", cpu, 1_500_000_000) is QuantMode.INT8
    assert default_quant("draft", cpu, 500_000_000) is QuantMode.INT4


def test_automatic_quantization_falls_back_when_the_kernel_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No compiler: w4a8 is passed over for w8a8, and the load says why."""
    from transformers import LlamaConfig

    from specchat.engine import native
    from specchat.engine.errors import QuantizationError

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

    from specchat.engine import memory
    from specchat.engine.errors import OutOfMemoryError
    from specchat.engine.loading import _check_memory

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=320)
    _check_memory(cfg, QuantMode.NONE, torch.float32, torch.device("cpu"), "the target")
    monkeypatch.setattr(memory, "available_bytes", lambda _device: 1000)
    with pytest.raises(OutOfMemoryError, match="loading the target needs"):
        _check_memory(cfg, QuantMode.NONE, torch.float32, torch.device("cpu"), "the target")
