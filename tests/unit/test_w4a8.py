"""The w4a8 kernel (engine/model/csrc/w4a8.cpp) against the same arithmetic written in torch.

The reference dequantizes the int4 codes and quantizes activations to int8 per 32
values exactly as the kernel does, so the two differ only by float summation order:
a kernel bug (a wrong nibble, layout, scale or row) shows as an error of ~1e-1 or
more, summation order as ~1e-6.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from specchat.engine.errors import QuantizationError
from specchat.engine.model import cpu, native, qlinear, quant

pytestmark = pytest.mark.skipif(
    native.cpu_supports("w4a8") is not None, reason=str(native.cpu_supports("w4a8"))
)


@pytest.fixture(scope="module")
def built() -> None:
    """The kernel, compiled once per machine; its tests skip with the reason where it cannot be
    (no compiler, no ninja)."""
    reason = native.unavailable("w4a8")
    if reason:
        pytest.skip(f"the w4a8 kernel cannot be built here: {reason}")


needs_kernel = pytest.mark.usefixtures("built")
GROUPS = sorted(qlinear.W4A8_SHRINKS)  # the weight groups the kernel reads: 32, 64, 128


def reference(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """What the kernel computes, in float64: dequantized int4 weights times int8 activations."""
    codes, scales, mins = qlinear.quantize_w4a8(weight, group)
    n, k = weight.shape
    w = codes.double().reshape(n, k // group, group) * scales.double()[..., None]
    w = w + mins.double()[..., None]
    g = qlinear.W4A8_GROUP  # activations: one scale per 32 values whatever the weights' group
    xb = x.double().reshape(x.shape[0], k // g, g)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    d = (amax.float() / 127).double()  # the kernel's scale: float32 amax / 127
    # 127 / amax as one correctly rounded float32 division, as the kernel does it: a python
    # number over a tensor is reciprocal-then-multiply in torch, two roundings, and a
    # product that lands on a tie (x * inv = 80.5 against 80.50001) then rounds the
    # other way (seed 660, M=3 N=23 K=288 found it).
    inv = torch.where(
        amax > 0,
        (torch.full_like(amax, 127.0).float() / amax.float()).double(),
        torch.zeros_like(amax),
    )
    qa = torch.round((xb.float() * inv.float()).double())  # round half to even, as vroundps
    xa = (qa * d).reshape(x.shape[0], k)
    return xa @ w.reshape(n, k).T


def kernel(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    packed, scales, mins = qlinear.pack_w4a8(weight, group)
    return torch.ops.specchat.w4a8_linear(x.contiguous(), packed, scales, mins, weight.shape[0])


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 19),
    n=st.integers(1, 37),
    blocks=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    group=st.sampled_from(GROUPS),
)
@example(m=3, n=23, blocks=9, seed=660, group=32)  # an activation on a rounding tie (see reference)
@example(m=2, n=17, blocks=3, seed=1, group=128)  # w4a8-g128: a scale serves four blocks
@example(m=1, n=1, blocks=2, seed=3647, group=128)  # one output of 0.0016 from terms of 14.8
def test_kernel_equals_the_reference_arithmetic(
    m: int, n: int, blocks: int, seed: int, group: int
) -> None:
    """Any rows M (1..19 covers every rows-per-pass variant of either path: AVX2 takes 4, 3, 2
    or 1 rows a pass, AVX512-VNNI 8 down to 1), any N (padding to 8 rows; an odd number of row
    groups leaves the VNNI path's last group to the AVX2 code), any weight group."""
    gen = torch.Generator().manual_seed(seed)
    k = group * blocks
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : k // 2] = 0.0  # an all-zero activation group: scale 0, no division by zero
    got = kernel(x, weight, group).double()
    want = reference(x, weight, group)
    # Relative to the size of the terms summed, not of the sum: float32 accumulation errs
    # by ~1e-8 of sum |x w|, and an output that cancels to a tiny value (M=N=1 has no
    # other output to scale by) is still exact to that.
    size = max(float(want.abs().max()), float((x.double().abs() @ weight.double().abs().T).max()), 1e-12)
    err = float((got - want).abs().max()) / size
    assert err < 1e-5, f"M={m} N={n} K={k} G={group}: max error {err:.2e} of the largest sum of |x w|"


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 37),
    blocks=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    group=st.sampled_from(GROUPS),
)
def test_the_native_packer_equals_the_reference_byte_for_byte(
    n: int, blocks: int, seed: int, dtype: torch.dtype, group: int
) -> None:
    """Codes, scales and minimums, padding rows included; odd groups too (constant, huge, tiny,
    an outlier that the wider groups' range search narrows away from)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, group * blocks, generator=gen) * torch.rand(n, 1, generator=gen)
    weight[0, :group] = 0.25  # a constant group: its scale is float16's least, not 0
    weight[-1, -group:] *= 1e4  # large values: the float16 scale rounds
    if n > 2:
        weight[1] *= 1e-6  # tiny values: subnormal float16 scales
    if n > 3:
        weight[2, 3] = 40.0  # an outlier
    weight = weight.to(dtype)
    got = qlinear.pack_w4a8(weight, group)
    want = qlinear.pack_w4a8_reference(weight, group)
    for name, g, w in zip(("packed", "scales", "mins"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name


@needs_kernel
def test_a_group_packed_member_by_member_equals_the_packed_stack() -> None:
    """What the shared-input group's shortcut builds is the float stack's packing, byte for byte."""
    torch.manual_seed(5)
    members = [nn.Linear(64, n, bias=False) for n in (48, 16, 21)]  # the last ends mid-group
    fast = qlinear.W4A8Linear.stacked(members)
    assert fast is not None and fast.out_features == 85
    stack = nn.Linear(64, 85, bias=False)
    with torch.no_grad():
        stack.weight.copy_(torch.cat([m.weight for m in members]))
    slow = qlinear.W4A8Linear(stack)
    for name in ("packed", "scales", "mins"):
        assert torch.equal(
            getattr(fast, name).view(torch.uint8), getattr(slow, name).view(torch.uint8)
        )
    # a member ending inside a group of 8 rows: no shortcut, the float stack is packed
    assert qlinear.W4A8Linear.stacked([nn.Linear(64, 20), nn.Linear(64, 16)]) is None


def test_a_wide_group_searches_its_range_and_never_does_worse_than_the_full_one() -> None:
    """w4a8-g128: each group's range is the full one or a narrower one with less squared error.
    One outlier in a group of 128 stretches every step; the search narrows the range there."""
    torch.manual_seed(3)
    weight = torch.randn(16, 512) * 0.02
    weight[5, 7] = 0.5  # an outlier in row 5's first group

    def errors(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        w = codes.float().reshape(16, 4, 128) * scales.float()[..., None] + mins.float()[..., None]
        return (w - weight.reshape(16, 4, 128)).pow(2).sum(-1)

    full_range = weight.reshape(16, 4, 128)
    lo, hi = full_range.amin(-1), full_range.amax(-1)
    mins = lo.half()
    scales = ((hi - mins.float()) / 15).clamp(min=2**-24).half()
    codes = ((full_range - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
    searched = errors(*qlinear.quantize_w4a8(weight, 128))
    full = errors(codes.reshape(16, 512), scales, mins)
    assert (searched <= full * (1 + 1e-6)).all()
    assert searched.sum() < 0.9 * full.sum()  # narrower ranges pay on Gaussian weights
    assert qlinear.quantize_w4a8(weight, 128)[2][5, 0] > lo[5, 0]  # the outlier's group narrowed


@needs_kernel
def test_a_weight_group_the_kernel_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="groups are 32, 64, 128"):
        qlinear.pack_w4a8(torch.randn(8, 192), 96)
    with pytest.raises(ValueError, match="divisible by 128, not 192"):
        qlinear.pack_w4a8(torch.randn(8, 192), 128)
    packed, scales, mins = qlinear.pack_w4a8(torch.randn(8, 384), 128)
    with pytest.raises(RuntimeError, match="power of two"):  # 3 blocks a group
        torch.ops.specchat.w4a8_linear(torch.randn(1, 384), packed, scales[:, :1], mins[:, :1], 8)


def test_codes_use_the_full_grid_and_reconstruct_the_extremes() -> None:
    weight = torch.randn(8, 128)
    codes, scales, mins = qlinear.quantize_w4a8(weight)
    assert codes.min() == 0 and codes.max() == 15
    assert scales.dtype == mins.dtype == torch.float16
    w = codes.float().reshape(8, 4, 32) * scales.float()[..., None] + mins.float()[..., None]
    err = (w.reshape(8, 128) - weight).abs().reshape(8, 4, 32).amax(-1)
    assert (err <= scales.float() * 0.5 + 1e-3).all()  # within half a step (+ float16 rounding)


@needs_kernel
def test_layer_matches_float_linear_closely() -> None:
    """Quantization error on a realistic layer: int4 weights bound it (measured 0.06 relative)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = qlinear.W4A8Linear(linear)
    x = torch.randn(3, 256)
    with torch.no_grad():
        rel = float((layer(x) - linear(x)).norm() / linear(x).norm())
    assert rel < 0.1


@needs_kernel
def test_kernel_refuses_mismatched_weights() -> None:
    packed, scales, mins = qlinear.pack_w4a8(torch.randn(8, 128))
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.specchat.w4a8_linear(torch.randn(1, 192), packed, scales, mins, 8)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.specchat.w4a8_linear(torch.randn(1, 128), packed, scales.float(), mins, 8)


@pytest.mark.parametrize(
    ("mode", "hidden", "multiple", "hint"),
    [(quant.QuantMode.W4A8, 80, 32, "w8a8"), (quant.QuantMode.W4A8_G128, 96, 128, "w4a8 or")],
)
def test_in_features_the_kernel_cannot_walk_are_refused_with_a_reason(
    mode: quant.QuantMode, hidden: int, multiple: int, hint: str
) -> None:
    """w4a8 walks blocks of 32 inputs, w4a8-g128 groups of 128 (and points to w4a8)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    with pytest.raises(QuantizationError, match=f"multiple of {multiple}; .* has {hidden}") as err:
        quant.check(mode, config, torch.device("cpu"))
    assert hint in (err.value.hint or "")


def test_a_machine_without_a_compiler_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: the error names what is missing and the modes that need nothing."""
    from torch.utils import cpp_extension

    def fail(**_kwargs: object) -> None:
        raise RuntimeError("Error building extension 'specchat_w4a8'\ng++: not found")

    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_failed", {})
    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(QuantizationError) as info:
        native.load("w4a8")
    assert "could not build the w4a8 kernel: g++: not found" in info.value.message
    assert "C++ compiler" in info.value.hint and "w8a8" in info.value.hint


@needs_kernel
def test_loading_says_when_it_compiles_the_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first load on a machine compiles for ~30 s: the load screen must say why it waits."""
    from specchat.engine.config import ModelSpec, QuantMode
    from specchat.engine.events import LoadProgress
    from specchat.engine.weights.loading import load_model
    from tests.tinymodels import tiny_llama, tiny_tokenizer

    tiny_llama(layers=2).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(native, "is_built", lambda kernel: False)  # as on a new machine
    events: list[LoadProgress] = []
    spec = ModelSpec(str(tmp_path), QuantMode.W4A8, dtype="float32", device="cpu")
    loaded = load_model(spec, "target", progress=events.append)
    builds = [(e.done, e.total, e.detail.split()[0]) for e in events if e.stage == "build"]
    # indeterminate while compiling, then done; the decoder kernel (engine/model/decoder.py) after
    assert builds == [(0, None, "w4a8"), (1, 1, "w4a8"), (0, None, "decoder"), (1, 1, "decoder")]
    stages = [e.stage for e in events]
    assert stages.index("build") < stages.index("load")
    assert any(isinstance(m, qlinear.W4A8Linear) for m in loaded.model.modules())


# --------------------------------------------------------------------------- the two paths

VNNI_MISSING = native.w4a8_choice("auto")[0] not in ("avx512vnni", "amx")
AMX_MISSING = native.w4a8_choice("auto")[0] != "amx"


@pytest.fixture
def path_restored() -> object:
    """Puts back the path this machine chose, whatever the test set."""
    yield
    native.w4a8_use("auto")


@needs_kernel
@pytest.mark.skipif(VNNI_MISSING, reason=f"no AVX512-VNNI here ({cpu.features().summary()})")
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 19),
    n=st.integers(1, 70),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    group=st.sampled_from(GROUPS),
)
@example(m=5, n=24, blocks=48, seed=0, group=32)  # a verify block of 5 on 3 row groups (odd: one left over)
@example(m=17, n=16, blocks=1, seed=1, group=32)  # two passes of 8 rows and one of 1
@example(m=3, n=40, blocks=7, seed=2, group=128)  # w4a8-g128, the 0.5B's 896 inputs
def test_the_vnni_and_amx_paths_give_the_avx2_paths_bits(
    m: int, n: int, blocks: int, seed: int, group: int
) -> None:
    """Same integer block sums, same float steps in the same order: the paths agree bit for
    bit, so a machine's choice changes no token (greedy identity and the packed cache hold).
    AMX where this CPU has it and the OS grants it (passes of up to 16 rows: m 17..19 take
    two, the second reading padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    k = group * blocks if group > 32 else 32 * blocks
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    x[0, :32] = 0.0
    packed, scales, mins = qlinear.pack_w4a8(weight, group)
    out = {}
    paths = ["avx2", "avx512vnni"] + ([] if AMX_MISSING else ["amx"])
    try:
        for path in paths:
            # VNNI (AMX) code for every M, on one thread too
            used = native.w4a8_use(path, vnni_min_rows=1, vnni_min_rows_one_thread=1, amx_min_rows=1)
            assert used == path
            out[path] = torch.ops.specchat.w4a8_linear(x, packed, scales, mins, n)
            # and each row alone, as a decode step computes it
            alone = [
                torch.ops.specchat.w4a8_linear(x[i : i + 1], packed, scales, mins, n)
                for i in range(m)
            ]
            assert torch.equal(torch.cat(alone), out[path]), (
                f"{path}: a row depends on its neighbours"
            )
    finally:
        native.w4a8_use("auto")
    for path in paths[1:]:
        assert torch.equal(out["avx2"], out[path]), path


@needs_kernel
@pytest.mark.skipif(VNNI_MISSING, reason=f"no AVX512-VNNI here ({cpu.features().summary()})")
def test_a_call_on_one_thread_keeps_short_blocks_on_the_avx2_code(path_restored: object) -> None:
    """The VNNI code takes blocks from W4A8_VNNI_MIN_ROWS rows on several threads and from
    W4A8_VNNI_MIN_ROWS_ONE_THREAD on one (a 2-row block: 1.18 against 1.48 steps on Zen 5)."""
    native.w4a8_use("avx512vnni")
    before = torch.get_num_threads()
    takes = torch.ops.specchat.w4a8_takes_vnni
    try:
        torch.set_num_threads(2)
        assert [takes(m) for m in (1, 2, 3, 4)] == [False, True, True, True]
        torch.set_num_threads(1)
        assert [takes(m) for m in (1, 2, 3, 4)] == [False, False, False, True]
    finally:
        torch.set_num_threads(before)
    native.w4a8_use("avx2")
    assert not takes(8)


# ms of a pass by (rows, code) for the target and the draft: (VNNI, AVX2).
CHOICES = {
    # the 1.5B's and 0.5B's steps on an AMX Xeon: one row faster on VNNI (step 42)
    "one row on vnni": ({1: (53.5, 55.4), 2: (53.5, 55.6)}, {1: (16.8, 18.3), 2: (17.0, 18.7)}),
    # only the draft's step gains: together 66.5 against 68.0 ms, 2.2% faster
    "the draft's gain counts": ({1: (50.0, 50.0), 2: (54.0, 55.0)}, {1: (16.5, 18.0), 2: (18, 18)}),
    # Zen 4: one row alike, a 2-row block faster on the AVX2 code (1.10 against 1.16 steps)
    "2 rows on avx2": ({1: (50.0, 50.0), 2: (58.0, 55.0)}, {1: (17.0, 17.0), 2: (19.0, 19.0)}),
    "vnni from 2 rows": ({1: (50.0, 50.0), 2: (53.0, 55.0)}, {1: (17.0, 17.0), 2: (19.0, 19.0)}),
    # the target's 2-row pass alike, the draft's faster on the AVX2 code: the sum decides
    "the draft's 2 rows count": ({1: (50.0, 50.0), 2: (55.0, 55.0)}, {1: (17, 17), 2: (20, 18)}),
    "neither clearly": ({1: (50.0, 49.6), 2: (55.0, 54.6)}, {1: (17.0, 16.9), 2: (19.0, 19.0)}),
}


@needs_kernel
@pytest.mark.skipif(VNNI_MISSING, reason=f"no AVX512-VNNI here ({cpu.features().summary()})")
@pytest.mark.parametrize("case", list(CHOICES))
def test_the_load_puts_short_calls_on_the_code_it_measured_faster(
    case: str, path_restored: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-row steps of the target and the draft are timed with both codes in turns and move
    to the VNNI code only where their sum is more than 2% faster there; else their 2-row
    passes move to the AVX2 code only where their sum is more than 1% faster. Ready's kernel line says
    what was measured. Each pass is priced by the code the kernel would run it on, as the
    kernel itself reports."""
    from specchat.engine.decode import costs

    native.w4a8_use("avx512vnni")
    takes = torch.ops.specchat.w4a8_takes_vnni
    target_ms, draft_ms = CHOICES[case]

    class Runner:
        def __init__(self, ms: dict[int, tuple[float, float]]) -> None:
            self.ms = ms

        def reset(self) -> None:
            pass

    def timer(runner: Runner, repeats: int) -> object:
        return lambda rows: runner.ms[rows][0 if takes(rows) else 1]

    monkeypatch.setattr(costs, "pass_timer", timer)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # one thread keeps blocks under 4 rows on AVX2 anyway
        said = costs.choose_vnni_rows(Runner(target_ms), Runner(draft_ms))  # type: ignore[arg-type]
        chosen = [takes(m) for m in (1, 2, 3)]
        torch.set_num_threads(1)
        assert not takes(1) and not takes(3), "a call on one thread keeps short blocks on AVX2"
    finally:
        torch.set_num_threads(before)
    want = {
        "one row on vnni": [True, True, True],
        "the draft's gain counts": [True, True, True],
        "2 rows on avx2": [False, False, True],
        "vnni from 2 rows": [False, True, True],
        "the draft's 2 rows count": [False, False, True],
        "neither clearly": [False, True, True],
    }[case]
    assert chosen == want
    assert said is not None and said in str(native.w4a8_describe())
    assert ("from one row, measured faster" in said) == want[0]
    assert ("2-row passes on the AVX2 code, measured faster" in said) == (not want[1])
    native.w4a8_use("avx2")  # another path: nothing to time
    assert costs.choose_vnni_rows(Runner(target_ms)) is None  # type: ignore[arg-type]


def test_the_path_is_chosen_from_the_cpu_and_said() -> None:
    """auto takes VNNI where the CPU has it with AVX-512 F, BW and VL; a forced path the CPU
    lacks, or a name that is none, is refused with what to do."""
    from specchat.engine.model.cpu import CpuFeatures

    zen4 = CpuFeatures(
        "x86_64",
        frozenset({"avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni"}),
        "test",
    )
    zen3 = CpuFeatures("x86_64", frozenset({"avx2", "fma3", "f16c"}), "test")
    no_vl = CpuFeatures("x86_64", zen4.flags - {"avx512_vl"}, "test")
    assert native.w4a8_choice("auto", zen4) == ("avx512vnni", "this CPU has AVX512-VNNI")
    assert native.w4a8_choice("", zen3)[0] == "avx2"
    assert native.w4a8_choice("auto", no_vl)[0] == "avx2"
    assert native.w4a8_choice("AVX2", zen4) == ("avx2", "SPECCHAT_W4A8=avx2")
    with pytest.raises(QuantizationError, match="no AVX512-VNNI") as info:
        native.w4a8_choice("avx512vnni", zen3)
    assert "avx2" in info.value.hint
    with pytest.raises(QuantizationError, match="names no w4a8 path"):
        native.w4a8_choice("sse9", zen4)
    spr = CpuFeatures("x86_64", zen4.flags | {"amx_tile", "amx_int8", "amx_bf16"}, "test")
    assert native.w4a8_choice("auto", spr) == ("amx", "this CPU has AMX-INT8")
    assert native.w4a8_choice("avx512vnni", spr)[0] == "avx512vnni"
    with pytest.raises(QuantizationError, match="no AMX-INT8") as info:
        native.w4a8_choice("amx", zen4)
    assert "avx512vnni" in info.value.hint
    # AMX tiles without AVX512-VNNI (no such CPU, but the kernel's AMX code uses both)
    assert native.w4a8_choice("auto", CpuFeatures("x86_64", spr.flags - {"avx512_vnni"}, "test"))[0] == "avx2"


@needs_kernel
def test_the_loaded_kernel_says_its_path(path_restored: object) -> None:
    chosen = native.w4a8_choice("auto")[0]
    assert native.w4a8_path() == chosen
    line = native.w4a8_describe()
    assert line is not None and f"{native.W4A8_NAMES[chosen]} path" in line
    native.w4a8_use("avx2")
    assert native.w4a8_path() == "avx2" and "AVX2 path (SPECCHAT_W4A8=avx2" in str(
        native.w4a8_describe()
    )


@needs_kernel
@pytest.mark.skipif(not VNNI_MISSING, reason="this CPU has AVX512-VNNI: the kernel takes the path")
def test_the_kernel_refuses_vnni_on_a_cpu_without_it(path_restored: object) -> None:
    """The kernel checks the CPU itself: a wrong choice is an error, not an illegal instruction."""
    with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
        torch.ops.specchat.w4a8_set_path(1, 4)
    assert native.w4a8_path() == "avx2"


@needs_kernel
@pytest.mark.skipif(not AMX_MISSING, reason="this CPU has AMX and the OS grants it: the kernel takes the path")
def test_the_kernel_refuses_amx_where_it_cannot_run(path_restored: object) -> None:
    """No AMX-INT8 on the CPU (or no tile state from the OS): an error, not a fault."""
    with pytest.raises(RuntimeError, match="AMX"):
        torch.ops.specchat.w4a8_set_path(2, 2, 4, 4)
    assert torch.ops.specchat.w4a8_amx_permitted() is False


@needs_kernel
@pytest.mark.skipif(AMX_MISSING, reason=f"no AMX-INT8 here ({cpu.features().summary()})")
def test_on_the_amx_path_short_blocks_keep_the_vnni_code(path_restored: object) -> None:
    """AMX takes calls from W4A8_AMX_MIN_ROWS rows; shorter ones run the VNNI code by its own
    rules (one row: AVX2), all the same bits."""
    native.w4a8_use("amx")
    amx, vnni = torch.ops.specchat.w4a8_takes_amx, torch.ops.specchat.w4a8_takes_vnni
    least = native.W4A8_AMX_MIN_ROWS
    assert not amx(least - 1) and amx(least) and amx(44)
    assert not vnni(1) and vnni(max(native.W4A8_VNNI_MIN_ROWS, native.W4A8_VNNI_MIN_ROWS_ONE_THREAD))
    assert "AMX path" in str(native.w4a8_describe())


@needs_kernel
@pytest.mark.skipif(VNNI_MISSING, reason=f"no AVX512-VNNI here ({cpu.features().summary()})")
def test_where_the_os_refuses_amx_auto_takes_vnni_and_says_why(
    path_restored: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU with AMX-INT8 whose OS (or VM) grants no tile state: auto runs the VNNI code and
    the Ready line says why; asking for amx by name is refused with what to do."""
    from specchat.engine.model.cpu import CpuFeatures

    have = cpu.features()
    spr = CpuFeatures(have.machine, have.flags | {"amx_tile", "amx_int8"}, "test")
    monkeypatch.setattr(native.cpu, "features", lambda: spr)
    monkeypatch.setattr(native, "_amx_granted", lambda: False)
    assert native.w4a8_use("auto") == "avx512vnni"
    assert "did not grant this process AMX's tile state" in str(native.w4a8_describe())
    with pytest.raises(QuantizationError, match="tile state") as info:
        native.w4a8_use("amx")
    assert "avx512vnni" in info.value.hint
    # (path_restored, set up first, puts this CPU's own choice back after monkeypatch's undo)


@needs_kernel
def test_a_bad_path_in_the_environment_is_refused_at_load() -> None:
    """$SPECCHAT_W4A8 naming no path fails the kernel's load with the message, in a fresh process."""
    import subprocess
    import sys

    code = (
        "from specchat.engine.errors import QuantizationError\n"
        "from specchat.engine.model import native\n"
        "try:\n    native.load('w4a8')\nexcept QuantizationError as e:\n    print('refused:', e.message)\n"
        "else:\n    print('loaded', native.w4a8_path())\n"
    )
    env = {**os.environ, "SPECCHAT_W4A8": "sse9"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert "refused: SPECCHAT_W4A8='sse9' names no w4a8 path" in out.stdout, out.stderr[-2000:]


@needs_kernel
def test_a_bench_config_without_a_path_takes_the_environments(
    monkeypatch: pytest.MonkeyPatch, path_restored: object
) -> None:
    """bench --configs w4a8,w4a8~avx2: the config that names no path runs on $SPECCHAT_W4A8's
    choice (else this CPU's), the other on its own, switched before each of their runs."""
    from specchat.engine.tools.bench import use_w4a8_path
    from specchat.engine.tools.bench_runs import parse_config_spec

    auto, avx2 = parse_config_spec("w4a8"), parse_config_spec("w4a8~avx2")
    use_w4a8_path(avx2)
    assert native.w4a8_path() == "avx2"
    use_w4a8_path(auto)
    assert native.w4a8_path() == native.w4a8_choice("auto")[0]
    monkeypatch.setenv(native.W4A8_ENV, "avx2")
    use_w4a8_path(auto)
    assert native.w4a8_path() == "avx2"


@needs_kernel
def test_a_bench_config_s_runs_keep_the_rows_its_load_chose(path_restored: object) -> None:
    """bench --configs w4a8,w4a8~avx2: switching to the other config's path resets the rows
    the VNNI code starts from; the auto config's runs get back those its load measured,
    and only a path chosen from the CPU lets a load choose them (Ready's line says it)."""
    from specchat.engine.tools.bench import use_w4a8_path
    from specchat.engine.tools.bench_runs import parse_config_spec

    auto, avx2 = parse_config_spec("w4a8"), parse_config_spec("w4a8~avx2")
    use_w4a8_path(auto)
    assert native.w4a8_auto() == (os.environ.get(native.W4A8_ENV, "auto") in ("", "auto"))
    native.w4a8_set_vnni_min_rows(1, "from one row, measured faster")
    chosen = native.w4a8_vnni_rows()
    use_w4a8_path(avx2)
    assert not native.w4a8_auto()
    assert native.w4a8_vnni_rows() == (native.W4A8_VNNI_MIN_ROWS, "")
    use_w4a8_path(auto, chosen)
    assert native.w4a8_vnni_rows() == (1, "from one row, measured faster")
    if native.w4a8_path() != "avx2":
        assert "from one row, measured faster" in str(native.w4a8_describe())


def _fork_child_call(conn: object, x: torch.Tensor, packed: tuple[torch.Tensor, ...], n: int) -> None:
    # Plain lists back: sending a tensor copies it through an OpenMP region, and GNU OpenMP
    # hangs in a child forked from a parent that ran one (libgomp's own limit, not this one).
    torch.set_num_threads(2)
    conn.send(torch.ops.specchat.w4a8_linear(x, *packed, n).tolist())  # type: ignore[attr-defined]


@needs_kernel
def test_the_kernels_helper_threads_change_no_bit_and_survive_concurrency_and_fork(
    path_restored: object,
) -> None:
    """The kernel splits a call over helper threads of its own (csrc/w4a8.cpp, Helpers): an
    output's value must not depend on how many took part, on how the chunks were dealt
    (a range a thread, taking others' from their backs, or one shared counter), on a
    second caller arriving while
    the helpers are busy (it computes alone), or on a forked child (which has no helpers and
    must start its own rather than wait for threads that are not there)."""
    import concurrent.futures
    import multiprocessing

    gen = torch.Generator().manual_seed(5)
    n, k = 4864, 896  # the 0.5B's gate/up half: ~150 chunks, so every helper claims some
    weight = torch.randn(n, k, generator=gen) * 0.05
    packed = qlinear.pack_w4a8(weight, 128)
    xs = [torch.randn(m, k, generator=gen) for m in (1, 2, 5, 17)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [torch.ops.specchat.w4a8_linear(x, *packed, n) for x in xs]
        for threads in (2, 5):  # 5 on any machine: more helpers than cores
            torch.set_num_threads(threads)
            # chunks dealt a range a thread (the default), then from one shared counter
            for split in (1, 0):
                torch.ops.specchat.w4a8_set_split(split)  # type: ignore[attr-defined]
                for x, want in zip(xs, alone, strict=True):
                    for _ in range(3):
                        assert torch.equal(torch.ops.specchat.w4a8_linear(x, *packed, n), want)
            torch.ops.specchat.w4a8_set_split(1)  # type: ignore[attr-defined]
            # torch on one thread, the kernel told to take `threads` (a prompt's small ops)
            torch.set_num_threads(1)
            torch.ops.specchat.w4a8_set_threads(threads)  # type: ignore[attr-defined]
            try:
                for x, want in zip(xs, alone, strict=True):
                    assert torch.equal(torch.ops.specchat.w4a8_linear(x, *packed, n), want)
            finally:
                torch.ops.specchat.w4a8_set_threads(0)  # type: ignore[attr-defined]
        torch.set_num_threads(2)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: torch.ops.specchat.w4a8_linear(xs[i % 4], *packed, n), range(64)))
        for i, y in enumerate(got):
            assert torch.equal(y, alone[i % 4]), f"call {i}, made beside three other callers"
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        child = ctx.Process(target=_fork_child_call, args=(there, xs[2], packed, n))
        child.start()
        assert here.poll(60), "a forked child's call did not finish (waiting for its parent's helpers?)"
        assert torch.equal(torch.tensor(here.recv()), alone[2])
        child.join(10)
    finally:
        torch.ops.specchat.w4a8_set_split(1)  # type: ignore[attr-defined]
        torch.set_num_threads(before)


@needs_kernel
def test_small_ops_on_one_thread_keep_the_kernels_threads_for_the_caller_alone() -> None:
    """`small_ops_on_one_thread`: torch's count is 1 inside, the w4a8 kernel told to take
    what torch had, for the calling thread only (another thread's calls keep following
    its own torch count), and both are put back, also when the body raises."""
    import threading

    from specchat.engine.model.native import small_ops_on_one_thread

    ops = torch.ops.specchat
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        with pytest.raises(RuntimeError, match="body"), small_ops_on_one_thread():
            assert torch.get_num_threads() == 1
            assert ops.w4a8_set_threads(2) == 2  # what the context set, read back
            other = threading.Thread(target=lambda: seen.append(ops.w4a8_set_threads(0)))
            other.start()
            other.join()
            raise RuntimeError("body")
        assert seen == [0], "the kernel's thread count leaked to another thread"
        assert torch.get_num_threads() == 2
        assert ops.w4a8_set_threads(0) == 0, "the kernel's thread count was not put back"
        with small_ops_on_one_thread(False):
            assert torch.get_num_threads() == 2
    finally:
        ops.w4a8_set_threads(0)
        torch.set_num_threads(before)
