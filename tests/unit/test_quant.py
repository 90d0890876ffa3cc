"""Quantization modes on tiny random Llama models built in code (seeded, no downloads).

Tolerances are relative logit errors, ||logits_q - logits_float|| / ||logits_float||,
over a prompt plus six greedy tokens. On this model (seed 0, weights N(0, 0.1))
they measure: int8 0.018, int4 (group 32) 0.20, bnb-int8 0.026, bnb-nf4 0.22, w8a8 0.039.
Each bound below leaves a margin of about 1.6x; a packing or scale mistake
gives errors of order 1.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specchat.engine.config import QuantMode
from specchat.engine.errors import QuantizationError
from specchat.engine.model import cpu, qlinear, quant

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
TOLERANCE = {
    QuantMode.NONE: 0.0,
    QuantMode.INT8: 0.03,
    QuantMode.INT4: 0.32,
    QuantMode.BNB_INT8: 0.04,
    QuantMode.BNB_NF4: 0.35,
    QuantMode.W8A8: 0.063,
    QuantMode.W4A8: 0.32,
    QuantMode.W4A8_G128: 0.32,
}
PROMPT = [[1, 17, 42, 99, 7, 123]]
NEW_TOKENS = 6


def tiny_config(hidden: int = 64, intermediate: int = 128, **overrides: object) -> LlamaConfig:
    kwargs: dict[str, object] = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Larger weights than the 0.02 default init, so logits are not all near zero.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return model


# Modes whose groups span more inputs than the tiny model's 64 get one with inputs of 128.
WIDE = {QuantMode.W4A8_G128: dict(hidden=128, intermediate=256)}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, shape in (("tiny", {}), ("wide", dict(hidden=128, intermediate=256))):
        dirs[name] = tmp_path_factory.mktemp(f"{name}-llama")
        tiny_model(tiny_config(**shape)).save_pretrained(dirs[name])  # type: ignore[arg-type]
    return dirs


@pytest.fixture(scope="module")
def float_dir(float_dirs: dict[str, Path]) -> Path:
    return float_dirs["tiny"]


def skip_unless_it_runs_here(mode: QuantMode) -> None:
    """Skip, with the product's own reason, a mode this machine cannot run (fbgemm needs an
    x86 AVX2 CPU; the w4a8 kernel also needs a compiler: checking builds it once)."""
    try:
        quant.check(mode, tiny_config(**WIDE.get(mode, {})), CPU)  # type: ignore[arg-type]
    except QuantizationError as exc:
        pytest.skip(f"{mode} does not run here ({cpu.features().summary()}): {exc.message}")


def load(path: Path, mode: QuantMode, group_size: int = 32) -> nn.Module:
    config = LlamaConfig.from_pretrained(path)
    quant.check(mode, config, CPU, group_size=group_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' dtype-cast notices
        model = LlamaForCausalLM.from_pretrained(
            path, dtype=torch.float32, **quant.load_kwargs(mode, CPU)
        ).eval()
    return quant.apply(model, mode, group_size=group_size)


@torch.no_grad()
def greedy(model: nn.Module, n: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with a KV cache; returns the new tokens and all logits [T, V]."""
    cache = DynamicCache()
    ids = torch.tensor(PROMPT)
    logits = [model(ids, cache=cache, use_cache=True).logits[0]]  # [P, V]
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(logits[-1][-1].argmax()))
        step = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0]
        logits.append(step)  # [1, V]
    return tokens, torch.cat(logits).float()


# --------------------------------------------------------------------------- modes


@pytest.mark.parametrize("mode", list(QuantMode))
def test_mode_loads_decodes_and_stays_close(float_dirs: dict[str, Path], mode: QuantMode) -> None:
    skip_unless_it_runs_here(mode)
    float_dir = float_dirs["wide" if mode in WIDE else "tiny"]
    reference = LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    model = load(float_dir, mode)
    # Decode the float model's own tokens, so both see the same sequence.
    tokens, ref_logits = greedy(reference)
    cache = DynamicCache()
    with torch.no_grad():
        ids = torch.tensor([PROMPT[0] + tokens])
        full = model(ids, cache=cache, use_cache=True).logits[0].float()  # [P + n, V]
    rel = float((full[: ref_logits.shape[0]] - ref_logits).norm() / ref_logits.norm())
    assert rel <= TOLERANCE[mode] + 1e-4, f"{mode}: relative logit error {rel:.4f}"
    # The quantized model decodes with a cache too, and cropping the cache rolls it back.
    q_tokens, q_logits = greedy(model)
    assert len(q_tokens) == NEW_TOKENS and torch.isfinite(q_logits).all()
    cache.crop(-3)
    assert cache.get_seq_length() == ids.shape[1] - 3
    with torch.no_grad():
        again = model(ids[:, -3:], cache=cache, use_cache=True).logits[0].float()
    if mode in (QuantMode.W8A8, QuantMode.W4A8, QuantMode.W4A8_G128):
        # transformers' attention sums 3 query rows in another order than 12, and a last-bit
        # difference can move an activation across an int8 rounding step: one step of one
        # block (w4a8-g128 here: 0.04 of logits up to 4.1). A cache that did not roll back
        # would be off by the whole logits. (The engine's own attention is row-wise exact.)
        rel = float((again - full[-3:]).norm() / full[-3:].norm())
        assert rel < 0.02, f"{mode}: the cropped cache's logits are {rel:.4f} off"
    else:
        torch.testing.assert_close(again, full[-3:], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "mode", [QuantMode.INT8, QuantMode.INT4, QuantMode.W8A8, QuantMode.W4A8, QuantMode.W4A8_G128]
)
def test_quantized_linears_are_batch_invariant(mode: QuantMode) -> None:
    """A token's output must not depend on the other tokens of the block (verify vs decode).

    Rows of very different ranges and offsets, one with an outlier: a shared
    activation scale (fbgemm's own choice) would change every other row.
    """
    skip_unless_it_runs_here(mode)
    torch.manual_seed(1)
    model = quant.apply(nn.Sequential(nn.Linear(256, 96, bias=True)), mode, group_size=64)
    x = torch.randn(9, 256) * torch.logspace(-2, 2, 9)[:, None] + torch.randn(9, 1)
    x[4, 17] = 300.0
    block = model(x)
    rows = torch.cat([model(x[i : i + 1]) for i in range(9)])
    assert torch.equal(block, rows)
    assert torch.equal(model(x[2:7]), block[2:7])
    assert torch.equal(model(x[2:5]), block[2:5])


def test_w8a8_per_token_activation_error_bound() -> None:
    """Activations are quantized per token: a row of small values keeps its precision next
    to a row with an outlier (one scale for the block would round it all to zero).
    Measured: 0.012 and 0.008 relative error per row."""
    skip_unless_it_runs_here(QuantMode.W8A8)
    torch.manual_seed(3)
    linear = nn.Linear(256, 64, bias=False)
    q, scales = qlinear.quantize_int8(linear.weight.detach(), qlinear.W8A8_WEIGHT_MAX)
    weight = q.float() * scales.float()[:, None]  # what the kernel multiplies by
    layer = quant.apply(nn.Sequential(linear), QuantMode.W8A8)
    x = torch.randn(2, 256)
    x[0] *= 1e-3
    x[1, 5] = 1e4
    with torch.no_grad():
        got = layer(x)
    ref = x @ weight.t()
    for row in range(2):
        rel = float((got[row] - ref[row]).norm() / ref[row].norm())
        assert rel < 0.03, f"row {row}: relative error {rel:.4f}"


@torch.no_grad()
def dequantized(layer: nn.Module, in_features: int) -> torch.Tensor:
    """The weight [N, K] a quantized layer multiplies by: its output on the identity."""
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    return layer(eye).float().t()


def test_int8_per_channel_error_bound() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(128, 48, bias=False)
    layer = qlinear.Int8WeightOnlyLinear(linear)
    w = linear.weight.detach()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    err = (dequantized(layer, 128) - w).abs()
    assert bool((err <= step / 2 + w.abs() / 128 + 1e-6).all())  # rounding + bf16 output


@pytest.mark.parametrize("group_size", qlinear.INT4_GROUP_SIZES)
def test_int4_grouped_error_bound(group_size: int) -> None:
    torch.manual_seed(3)
    linear = nn.Linear(256, 32, bias=False)
    layer = qlinear.Int4WeightOnlyLinear(linear, group_size)
    w = linear.weight.detach()
    groups = w.reshape(32, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [N, G]
    bound = step.repeat_interleave(group_size, dim=1)
    err = (dequantized(layer, 256) - w).abs()
    assert bool((err <= bound / 2 * 1.02 + w.abs() / 128 + 1e-6).all())


def test_int4_packing_in_slices_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    w = torch.randn(208, 64)  # three slices of 64 rows and one of 16
    whole = qlinear.quantize_int4(w, 32)
    monkeypatch.setattr(qlinear, "_ROWS_PER_CHUNK", 64)
    sliced = qlinear.quantize_int4(w, 32)
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])


def test_apply_lm_head_choice_and_tied_embedding() -> None:
    config = tiny_config(tie_word_embeddings=True)
    kept = quant.apply(tiny_model(config), QuantMode.INT8, lm_head=False)
    assert isinstance(kept.lm_head, nn.Linear)
    assert kept.lm_head.weight is kept.model.embed_tokens.weight
    assert not any(isinstance(m, nn.Linear) for n, m in kept.named_modules() if n != "lm_head")

    model = tiny_model(config)
    embedding = model.model.embed_tokens.weight.detach().clone()
    quant.apply(model, QuantMode.INT4, lm_head=True, group_size=32)
    assert isinstance(model.lm_head, qlinear.Int4WeightOnlyLinear)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # embedding untouched
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_load_kwargs_per_mode() -> None:
    for mode in (QuantMode.NONE, QuantMode.INT8, QuantMode.INT4):
        assert quant.load_kwargs(mode, CPU) == {}
        assert not quant.is_load_time(mode)
    nf4 = quant.load_kwargs(QuantMode.BNB_NF4, CPU)
    assert nf4["device_map"] == {"": "cpu"}
    assert nf4["quantization_config"].load_in_4bit
    assert nf4["quantization_config"].bnb_4bit_quant_type == "nf4"
    int8 = quant.load_kwargs(QuantMode.BNB_INT8, torch.device("cuda", 1))
    assert int8["device_map"] == {"": "cuda:1"} and int8["quantization_config"].load_in_8bit
    assert quant.is_load_time(QuantMode.BNB_NF4) and quant.is_load_time(QuantMode.BNB_INT8)


def test_apply_leaves_load_time_modes_alone() -> None:
    model = tiny_model(tiny_config())
    for mode in (QuantMode.NONE, QuantMode.BNB_NF4, QuantMode.BNB_INT8):
        assert quant.apply(model, mode) is model
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 2 * 7 + 1


# --------------------------------------------------------------------------- refusals


def linear4bits(model: nn.Module) -> dict[str, Any]:
    """bitsandbytes' 4-bit layers by name."""
    from bitsandbytes.nn import Linear4bit

    return {n: m for n, m in model.named_modules() if isinstance(m, Linear4bit)}


def test_bitsandbytes_packs_exactly_where_the_cpu_has_avx512_bf16() -> None:
    """The product asks bitsandbytes what it will do; the tests pick branches from the CPU's
    flags. Both must agree, or a branch below would be tested on the wrong machine."""
    assert quant._bnb_packs_4bit_for_cpu() == cpu.features().avx512_bf16, cpu.features().summary()


def test_bnb_nf4_keeps_layers_the_packed_kernel_cannot_take_off_it(tmp_path: Path) -> None:
    """On an AVX512-BF16 CPU bitsandbytes sets its per-layer switch on every 4-bit layer and,
    on the first call, repacks the weights for its kernel; for a 96-wide layer that repacking
    fails inside bitsandbytes (`shape '[96, 1]' is invalid for input of size 144`, a
    reshape, before any BF16 instruction). Here the switch is set as bitsandbytes sets it
    there, so the crash is the real one on any CPU: `apply` must turn it off for those layers."""
    tiny_model(tiny_config(hidden=96, intermediate=160)).save_pretrained(tmp_path)
    config = LlamaConfig.from_pretrained(tmp_path)
    quant.check(QuantMode.BNB_NF4, config, CPU)  # any shape is accepted: apply copes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, **quant.load_kwargs(QuantMode.BNB_NF4, CPU)
        ).eval()
    layers = linear4bits(model)
    assert len(layers) == 2 * 7
    for module in layers.values():  # as on an AVX512-BF16 CPU
        setattr(module, quant.BNB_PACK_SWITCH, True)
    quant.apply(model, QuantMode.BNB_NF4)
    assert not any(getattr(m, quant.BNB_PACK_SWITCH) for m in layers.values())
    tokens, logits = greedy(model, n=2)
    assert len(tokens) == 2 and torch.isfinite(logits).all()


def test_bnb_nf4_packs_what_it_can_and_runs_any_shape(tmp_path: Path) -> None:
    """Mixed shapes: q/k/v/o and gate/up (in 128, out 128/64/96) fit bitsandbytes' packed
    CPU layout, down_proj (in 96) does not. Each layer's switch says whether bitsandbytes
    will pack it on this CPU; the model loads and decodes on every CPU."""
    tiny_model(tiny_config(hidden=128, intermediate=96)).save_pretrained(tmp_path)
    model = load(tmp_path, QuantMode.BNB_NF4)
    packs_here = quant._bnb_packs_4bit_for_cpu()
    layers = linear4bits(model)
    for name, module in layers.items():
        fits = quant.bnb_cpu_packable(module.in_features, module.out_features)
        assert fits == (not name.endswith("down_proj")), name
        assert bool(getattr(module, quant.BNB_PACK_SWITCH)) == (packs_here and fits), name
    tokens, logits = greedy(model, n=2)
    assert len(tokens) == 2 and torch.isfinite(logits).all()
    if packs_here:  # AVX512-BF16: the fitting layers now run on bitsandbytes' own kernel
        for name, module in layers.items():
            packed = bool(getattr(module.weight.quant_state, "packing_format_for_cpu", False))
            assert packed == (not name.endswith("down_proj")), name


@pytest.mark.skipif(
    not cpu.features().avx512_bf16,
    reason=f"bitsandbytes repacks 4-bit weights only on AVX512-BF16 ({cpu.features().summary()})",
)
def test_bnb_nf4_packed_layers_match_the_dequantizing_path(float_dir: Path) -> None:
    """On an AVX512-BF16 CPU every layer of the tiny model fits the packed layout, and each
    packed layer (bitsandbytes' bf16 kernel) gives what the same 4-bit weights give on the
    dequantizing path, within bf16 activation rounding.

    Compared layer by layer: through the whole random tiny model a 0.3% difference per
    layer grows to ~60% of the logits (measured on an AMD EPYC with AVX512-BF16), as any
    perturbation does there, so the model's logits cannot tell a right kernel from a wrong
    one; a layout or scale error gives a relative difference near 1 at its own layer.
    """
    packed = load(float_dir, QuantMode.BNB_NF4)
    unpacked = load(float_dir, QuantMode.BNB_NF4)
    for module in linear4bits(unpacked).values():
        setattr(module, quant.BNB_PACK_SWITCH, False)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    pairs = zip(linear4bits(packed).items(), linear4bits(unpacked).values(), strict=True)
    for (name, mine), theirs in pairs:
        x = torch.randn(1, 3, mine.in_features, generator=gen)
        with torch.inference_mode():
            got, want = mine(x), theirs(x)
        assert getattr(mine.weight.quant_state, "packing_format_for_cpu", False), name
        assert not getattr(theirs.weight.quant_state, "packing_format_for_cpu", False), name
        rel = float((got - want).norm() / want.norm())
        assert rel <= 1e-2, f"{name}: packed kernel {rel:.4f} off the dequantizing path"
        worst = max(worst, rel)
    tokens, logits = greedy(packed, n=2)
    assert len(tokens) == 2 and torch.isfinite(logits).all()
    print(f"packed bnb-nf4 layers, worst relative difference: {worst:.4f}")


def test_bnb_nf4_refuses_odd_shapes_where_packing_cannot_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bitsandbytes without the per-layer switch, on an AVX512-BF16 CPU: the check refuses
    the shapes its packed layout cannot take, before anything is loaded."""
    config = tiny_config(hidden=96, intermediate=192)
    monkeypatch.setattr(quant, "_bnb_packs_4bit_for_cpu", lambda: True)
    monkeypatch.setattr(quant, "_bnb_can_keep_layers_unpacked", lambda: False)
    with pytest.raises(QuantizationError, match="multiple of 64") as info:
        quant.check(QuantMode.BNB_NF4, config, CPU)
    assert "is 96 -> " in info.value.message and "AVX512-BF16" in info.value.message
    assert info.value.hint
    quant.check(QuantMode.BNB_NF4, tiny_config(), CPU)  # 64 / 128 pass
    quant.check(QuantMode.BNB_INT8, config, CPU)  # 8-bit has no such rule


def test_this_bitsandbytes_can_keep_a_layer_unpacked() -> None:
    """The switch `apply` turns off exists in the bitsandbytes installed (else the check refuses)."""
    assert quant._bnb_can_keep_layers_unpacked()


def test_a_cpu_without_the_kernels_is_refused_with_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an ARM CPU (as the product sees it) w8a8 and w4a8 say why and what to use instead,
    at the check and when a module is built directly, instead of failing inside torch."""
    from specchat.engine.model import native

    arm = cpu.detect(machine="aarch64", cpuinfo="processor\t: 0\nFeatures\t: fp asimd\n")
    monkeypatch.setattr(cpu, "features", lambda: arm)
    monkeypatch.setattr(native, "_built", {})  # nothing loaded in this process
    with pytest.raises(QuantizationError, match="w8a8 needs fbgemm") as info:
        quant.check(QuantMode.W8A8, tiny_config(), CPU)
    assert "int8" in info.value.hint
    with pytest.raises(QuantizationError, match="w8a8 cannot run here"):
        qlinear.Int8DynamicLinear(nn.Linear(64, 16))
    with pytest.raises(QuantizationError, match="for x86-64 CPUs; this is aarch64") as info:
        quant.check(QuantMode.W4A8, tiny_config(), CPU)
    assert info.value.hint == "use int8 or int4"
    quant.check(QuantMode.INT8, tiny_config(), CPU)  # ATen's kernels: any CPU
    quant.check(QuantMode.INT4, tiny_config(), CPU)


@pytest.mark.parametrize("mode", [QuantMode.BNB_NF4, QuantMode.BNB_INT8])
def test_cuda_mode_without_cuda(monkeypatch: pytest.MonkeyPatch, mode: QuantMode) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantizationError, match="needs CUDA"):
        quant.check(mode, tiny_config(), CUDA)


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.INT4])
def test_cpu_modes_refuse_cuda(mode: QuantMode) -> None:
    with pytest.raises(QuantizationError, match="runs on the cpu only") as info:
        quant.check(mode, tiny_config(), CUDA)
    assert "bnb-nf4" in info.value.hint


def test_bnb_needs_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_installed", lambda package: package != "accelerate")
    with pytest.raises(QuantizationError, match="'accelerate'"):
        quant.check(QuantMode.BNB_INT8, tiny_config(), CPU)


def test_int4_group_size_rules() -> None:
    with pytest.raises(QuantizationError, match=r"one of \(32, 64, 128, 256\), got 48"):
        quant.check(QuantMode.INT4, tiny_config(), CPU, group_size=48)
    with pytest.raises(QuantizationError, match="group size 128; .* has 64"):
        quant.check(QuantMode.INT4, tiny_config(), CPU, group_size=128)
    config = tiny_config(hidden=96, intermediate=192)
    with pytest.raises(QuantizationError, match="group size 64; .* has 96"):
        quant.check(QuantMode.INT4, config, CPU, group_size=64)
    quant.check(QuantMode.INT4, config, CPU, group_size=32)
    odd_vocab = tiny_config(vocab_size=250)
    with pytest.raises(QuantizationError, match="multiple of 16; lm_head has 250"):
        quant.check(QuantMode.INT4, odd_vocab, CPU, group_size=32)
    quant.check(QuantMode.INT4, odd_vocab, CPU, group_size=32, lm_head=False)


def test_int8_needs_in_features_multiple_of_16() -> None:
    with pytest.raises(QuantizationError, match="multiple of 16; .* has 100"):
        quant.check(QuantMode.INT8, tiny_config(intermediate=100), CPU)
    # apply refuses too, instead of letting the kernel crash the process
    with pytest.raises(QuantizationError, match="got 100"):
        quant.apply(nn.Sequential(nn.Linear(100, 16)), QuantMode.INT8)
    with pytest.raises(QuantizationError, match="got group 64 for 96 -> 16"):
        quant.apply(nn.Sequential(nn.Linear(96, 16)), QuantMode.INT4, group_size=64)


def test_w8a8_shared_input_group_equals_separate_projections() -> None:
    """q/k/v (and gate/up) run as one GEMM; each part equals its own w8a8 Linear bit for bit,
    whatever order the parts are asked for in, and a new input is never served stale parts."""
    skip_unless_it_runs_here(QuantMode.W8A8)
    torch.manual_seed(4)
    projections = [nn.Linear(64, n, bias=b) for n, b in ((64, True), (32, True), (32, False))]
    separate = [qlinear.Int8DynamicLinear(m) for m in projections]
    group = qlinear.SharedInputGroup(projections, qlinear.Int8DynamicLinear)
    members = [group.member(i) for i in range(3)]
    x, other = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        for order in ((0, 1, 2), (2, 0, 1), (1, 1, 0, 2)):
            for i in order:
                assert torch.equal(members[i](x), separate[i](x))
        assert torch.equal(members[0](x), separate[0](x))
        assert torch.equal(members[1](other), separate[1](other))  # x's parts are not reused
        assert torch.equal(members[2](x), separate[2](x))


def test_w8a8_fuses_llama_projections(float_dir: Path) -> None:
    skip_unless_it_runs_here(QuantMode.W8A8)
    model = load(float_dir, QuantMode.W8A8)
    layer = model.model.layers[0]
    q, k, v = layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj
    assert isinstance(q, qlinear.SharedInputMember) and q.group is k.group is v.group
    assert layer.mlp.gate_proj.group is layer.mlp.up_proj.group
    assert isinstance(layer.mlp.down_proj, qlinear.Int8DynamicLinear)


def worst_case_for_pair_sums() -> tuple[nn.Linear, torch.Tensor, float]:
    """Every activation code 255 but one, every weight at the grid's edge: a pair of
    products is 2 * 255 * 127 = 64770 > 32767 with 8-bit weights, 32130 with weights
    within +-63. Returns the layer, the input and the exact output."""
    linear = nn.Linear(256, 16, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    x = torch.full((1, 256), 3.0)
    x[0, 0] = -1.0  # u = 1 (code 255) everywhere else
    return linear, x, float(x.sum() * 0.5)


def eight_bit_weights(linear: nn.Linear, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    """The combination W8A8_WEIGHT_MAX rules out: 8-bit weights and 8-bit activations."""
    monkeypatch.setattr(qlinear, "W8A8_WEIGHT_MAX", 127)
    wide = qlinear.Int8DynamicLinear(linear)
    wide.reduce_range = False
    return wide


def test_w8a8_never_saturates_pair_sums() -> None:
    """With weights within +-63 the worst case is right on every CPU fbgemm runs on."""
    skip_unless_it_runs_here(QuantMode.W8A8)
    linear, x, want = worst_case_for_pair_sums()
    with torch.no_grad():
        got = qlinear.Int8DynamicLinear(linear)(x)
    assert torch.allclose(got, torch.full_like(got, want), rtol=0.01)


@pytest.mark.skipif(
    not qlinear.fbgemm_saturates_pair_sums(),
    reason=f"fbgemm accumulates in int32 on AVX512-VNNI ({cpu.features().summary()})",
)
def test_8bit_weights_would_saturate_avx2_pair_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why W8A8_WEIGHT_MAX is 63: without VNNI, fbgemm's int16 pair sums saturate."""
    skip_unless_it_runs_here(QuantMode.W8A8)
    linear, x, want = worst_case_for_pair_sums()
    with torch.no_grad():
        got = eight_bit_weights(linear, monkeypatch)(x)
    assert not torch.allclose(got, torch.full_like(got, want), rtol=0.01)


@pytest.mark.skipif(
    qlinear.fbgemm_saturates_pair_sums(),
    reason=f"no AVX512-VNNI: fbgemm sums pairs in int16 here ({cpu.features().summary()})",
)
def test_vnni_takes_8bit_weights_without_saturating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of `fbgemm_saturates_pair_sums`: on AVX512-VNNI even 8-bit weights
    with 8-bit activations are exact, so the CPU's flag names the kernel fbgemm runs."""
    skip_unless_it_runs_here(QuantMode.W8A8)
    linear, x, want = worst_case_for_pair_sums()
    with torch.no_grad():
        got = eight_bit_weights(linear, monkeypatch)(x)
    assert torch.allclose(got, torch.full_like(got, want), rtol=0.01)


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.INT4, QuantMode.W8A8, QuantMode.W4A8])
def test_post_load_modes_report_progress_to_the_last_module(mode: QuantMode) -> None:
    skip_unless_it_runs_here(mode)
    model = tiny_model(tiny_config())
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    calls: list[tuple[int, int]] = []
    quant.apply(model, mode, progress=lambda done, total: calls.append((done, total)))
    totals = {total for _, total in calls}
    assert len(totals) == 1
    (total,) = totals
    # w8a8 and w4a8 count a fused q/k/v or gate/up group as one step
    fused = mode in (QuantMode.W8A8, QuantMode.W4A8)
    assert total == linears if not fused else total < linears
    assert [done for done, _ in calls] == list(range(1, total + 1))
    assert not any(type(m) is nn.Linear for m in model.modules())  # every Linear replaced


def test_int8_refuses_widths_its_kernel_crashes_on_with_several_rows() -> None:
    """torch's int8 kernel segfaults on a verify block (rows > 1) when in_features % 16 != 0.

    The crash itself runs in a child process (it would take pytest down); the
    check must refuse those widths and keep the ones that run.
    """
    import subprocess
    import sys

    crash = (
        "import torch\n"
        "x = torch.randn(5, {k}).bfloat16()\n"
        "w = torch.randint(-100, 100, (64, {k}), dtype=torch.int8)\n"
        "torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(64).bfloat16())\n"
    )
    ran = subprocess.run([sys.executable, "-c", crash.format(k=176)], timeout=120)
    assert ran.returncode == 0  # a multiple of 16 runs
    with pytest.raises(QuantizationError, match="in_features % 16"):
        qlinear.Int8WeightOnlyLinear(nn.Linear(168, 64))
    config = tiny_config(hidden=64, intermediate=168)
    with pytest.raises(QuantizationError, match="16"):
        quant.check(QuantMode.INT8, config, CPU)
    quant.check(QuantMode.INT8, tiny_config(hidden=64, intermediate=176), CPU)
