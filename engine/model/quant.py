"""Weight quantization: one handler per `QuantMode`.

Every handler takes the same three steps, in the manner of gpt-fast's
`quantize.py`, and the loader calls all three for every mode:

    check(config, device)   refuse, with a reason, what cannot work here
    load_kwargs(device)     extra `from_pretrained` arguments (load-time modes)
    apply(model)            swap `nn.Linear` modules after loading (post-load modes)

A step that means nothing for a mode is a no-op: `load_kwargs` returns `{}`
for post-load modes and `apply` returns the model untouched for load-time
modes.

Modes:

- `none`: weights as loaded (bf16 / float16 / float32).
- `bnb-nf4`, `bnb-int8`: bitsandbytes 4-bit NormalFloat and LLM.int8() through
  transformers' `BitsAndBytesConfig`, quantized while loading. bitsandbytes
  0.50 runs both on the CPU as well as on CUDA (on a CPU without AVX512-BF16
  it dequantizes to the compute dtype and calls a float matmul, so it saves
  memory, not time). On an AVX512-BF16 CPU it repacks each 4-bit layer for its
  own kernel on first use, which takes in_features % 64 == 0 and
  out_features % 32 == 0 only; `apply` keeps other layers on the dequantizing
  path, so bnb-nf4 loads any shape on any CPU.
- `int8`: weight-only int8, one symmetric scale per output channel, through
  torch's `_weight_int8pack_mm` CPU kernel (activations in bf16). fbgemm's
  dynamic int8 is faster but quantizes activations too, which costs as many
  greedy flips as int4; torchao's weight-only int8 dequantizes the whole
  weight on every call on the CPU. Figures in docs/quantization.md.
- `int4`: weight-only int4, asymmetric scales and zeros per group of input
  channels, through torch's tinygemm CPU kernels
  (`_convert_weight_to_int4pack_for_cpu`, `_weight_int4pack_mm_for_cpu`).
- `w8a8`: the `int8` weights, and activations quantized to 8 bits per token,
  through fbgemm's integer GEMM (`quantized::linear_dynamic`): 2-4x faster
  than the weight-only kernels on AVX2, and a block of K+1 tokens costs little
  more than one. Needs fbgemm: an x86 torch build and an AVX2 CPU. fbgemm
  picks one activation range for the whole input; each row is first mapped
  affinely onto [0, 1] (its own min to 0, its own max to exactly 1), so that
  shared range is [0, 1] whatever the other rows hold, and the map is undone
  on the output (`Int8DynamicLinear`).
- `w4a8`: int4 weights with a scale and a minimum per group of 32 input
  channels, activations quantized to int8 per 32 values, through specchat's
  own AVX2 kernel (csrc/w4a8.cpp, compiled on first use by engine/model/native.py;
  x86-64 with AVX2, FMA and F16C, and a C++ compiler), which takes an AVX512-VNNI
  path for blocks of 2+ rows where the CPU has it (the same bits, chosen at run time).
  Half the bytes of int8 per token and a kernel that streams them: 2-3x
  fbgemm's speed on one layer at one row, ~1.5x per decode step of the 1.5B;
  a block of K+1 rows costs more than fbgemm's,
  since the int4 groups cost a float scale per 32 products (`W4A8Linear`).

All the post-load kernels compute every output row from its own input row
only (checked bit for bit in the tests), so a quantized target gives the same
logits for a token whether it is verified in a block of K+1 or decoded alone:
speculative decoding stays exact with respect to the target as loaded.

Which modes run here is decided from the CPU's own flags (engine/model/cpu.py) and
from what the libraries will do on it; a mode that cannot run is refused by
`check` with a `QuantizationError` and a hint, never left to crash in a library.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import W4A8_GROUPS, QuantMode
from ..errors import QuantizationError
from . import cpu
from .qlinear import (
    INT4_GROUP_SIZES,
    INT8_IN_MULTIPLE,
    W4A8_IN_MULTIPLE,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    SharedInputGroup,
    W4A8Linear,
)

DEFAULT_GROUP_SIZE = 32  # same kernel speed as 64 or 128, fewer greedy flips (docs/quantization.md)
QUANTIZE_LM_HEAD = True  # post-load modes quantize the output projection unless told not to

BNB_BLOCK_SIZE = 64  # bitsandbytes 4-bit block of weights sharing one absmax
StepProgress = Callable[[int, int], None]  # (modules done, modules in all)


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True, slots=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    is_lm_head: bool


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The model `config` describes, on the meta device: shapes without memory or time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)
    return model


def linear_shapes(config: PretrainedConfig) -> list[LinearShape]:
    """Every nn.Linear of the model `config` describes, lm_head included and marked."""
    model = meta_model(config)
    head = _output_embeddings(model)
    return [
        LinearShape(name, m.in_features, m.out_features, m is head)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _bnb_packs_4bit_for_cpu() -> bool:
    """Whether bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU kernel here.

    bitsandbytes' own answer (it asks the CPU in its native library), so the
    decision is the one it will take. That layout needs in_features % 64 == 0
    and out_features % 32 == 0; without AVX512-BF16, bitsandbytes dequantizes
    and any shape works.
    """
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


# bitsandbytes' per-layer switch: Linear4bit packs for its CPU kernel on first use when it is set.
BNB_PACK_SWITCH = "support_avx512bf16_for_cpu"
BNB_PACK_ROWS = 32  # output rows bitsandbytes' CPU layout interleaves


def _bnb_can_keep_layers_unpacked() -> bool:
    """Whether this bitsandbytes has the per-layer switch `apply` turns off for odd shapes."""
    try:
        from bitsandbytes.nn import Linear4bit

        return hasattr(Linear4bit(64, BNB_PACK_ROWS, bias=False), BNB_PACK_SWITCH)
    except Exception:  # an unknown bitsandbytes: treat it as unable
        return False


def bnb_cpu_packable(in_features: int, out_features: int, block_size: int = BNB_BLOCK_SIZE) -> bool:
    """Whether bitsandbytes' packed CPU layout takes a [out_features, in_features] weight."""
    return in_features % block_size == 0 and out_features % BNB_PACK_ROWS == 0


def _first_bad(
    shapes: list[LinearShape], *, in_multiple: int = 1, out_multiple: int = 1
) -> LinearShape | None:
    for s in shapes:
        if s.in_features % in_multiple or s.out_features % out_multiple:
            return s
    return None


def _require_in_multiple(
    mode: QuantMode, config: PretrainedConfig, lm_head: bool, multiple: int, hint: str
) -> None:
    """Refuse, naming the first offending Linear, unless every in_features is a multiple."""
    bad = _first_bad(_quantized_shapes(config, lm_head), in_multiple=multiple)
    if bad is not None:
        raise QuantizationError(
            f"{mode} needs every Linear's in_features to be a multiple of {multiple}; "
            f"{bad.name} has {bad.in_features}",
            hint=f"{hint} for this model",
        )


# --------------------------------------------------------------------------- the modes
#
# One Handler per mode, flat (gpt-fast's quantize.py keeps one per mode too): the
# three steps are plain functions, and a mode names the ones it needs.

Check = Callable[[PretrainedConfig, torch.device, bool, int], None]  # (config, device, lm_head, group)
LoadKwargs = Callable[[torch.device, "torch.dtype | None"], dict[str, Any]]
Apply = Callable[[nn.Module, bool, int, "StepProgress | None"], nn.Module]


def _no_check(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
    return None


def _no_kwargs(device: torch.device, compute_dtype: torch.dtype | None) -> dict[str, Any]:
    return {}


def _as_loaded(
    model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None
) -> nn.Module:
    return model


@dataclass(frozen=True)
class Handler:
    """The steps one mode takes; see the module docstring."""

    mode: QuantMode
    devices: frozenset[str]  # device types the mode runs on
    check: Check = _no_check
    load_kwargs: LoadKwargs = _no_kwargs
    apply: Apply = _as_loaded
    load_time: bool = False  # quantized inside from_pretrained (bitsandbytes)


# -- bitsandbytes, through transformers: quantized while loading, lm_head left as loaded


def _check_bnb(mode: QuantMode) -> Check:
    def check(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
        for package in ("bitsandbytes", "accelerate"):
            if not _installed(package):
                raise QuantizationError(
                    f"{mode} needs the '{package}' package, which is not installed",
                    hint=f"pip install {package}, or choose another --quant",
                )
        if (
            mode is QuantMode.BNB_NF4
            and device.type == "cpu"
            and _bnb_packs_4bit_for_cpu()
            and not _bnb_can_keep_layers_unpacked()
        ):
            shapes = [s for s in linear_shapes(config) if not s.is_lm_head]
            bad = _first_bad(shapes, in_multiple=BNB_BLOCK_SIZE, out_multiple=BNB_PACK_ROWS)
            if bad is not None:
                raise QuantizationError(
                    f"bnb-nf4 on this CPU (AVX512-BF16, where bitsandbytes repacks 4-bit "
                    f"weights) needs every Linear's in_features to be a multiple of "
                    f"{BNB_BLOCK_SIZE} and out_features of {BNB_PACK_ROWS}; {bad.name} is "
                    f"{bad.in_features} -> {bad.out_features}",
                    hint="use int4 or int8 on the CPU, or bnb-nf4 on CUDA",
                )

    return check


def _bnb_kwargs(mode: QuantMode) -> LoadKwargs:
    def load_kwargs(device: torch.device, compute_dtype: torch.dtype | None) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        if mode is QuantMode.BNB_NF4:
            if compute_dtype is None:  # bf16 tensor cores on CUDA; fp32 matmul is faster on AVX2
                compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            config = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=compute_dtype,
            )
        else:
            config = BitsAndBytesConfig(load_in_8bit=True)
        target = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
        return {"quantization_config": config, "device_map": {"": target}}

    return load_kwargs


def _bnb_keep_odd_shapes_unpacked(
    model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None
) -> nn.Module:
    """Keep 4-bit layers whose shape bitsandbytes' packed CPU layout cannot take on its
    dequantizing path (it would crash repacking them on an AVX512-BF16 CPU)."""
    if not _installed("bitsandbytes"):
        return model
    from bitsandbytes.nn import Linear4bit

    for name, module in model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        block = int(getattr(state, "blocksize", BNB_BLOCK_SIZE))
        if bnb_cpu_packable(module.in_features, module.out_features, block):
            continue
        if not hasattr(module, BNB_PACK_SWITCH):
            if _bnb_packs_4bit_for_cpu():
                raise QuantizationError(
                    f"bitsandbytes would repack {name} ({module.in_features} -> "
                    f"{module.out_features}) for its CPU kernel, which cannot take that "
                    "shape, and this version cannot be told not to",
                    hint="use int4 or int8 on the CPU, or bnb-nf4 on CUDA",
                )
            continue
        setattr(module, BNB_PACK_SWITCH, False)
    return model


# -- post-load CPU modes: each nn.Linear swapped for a quantized module after loading


def _check_int8(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
    _require_in_multiple(QuantMode.INT8, config, lm_head, INT8_IN_MULTIPLE, hint="use bnb-int8 or none")


def _check_int4(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise QuantizationError(
            f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}",
            hint=f"the default is {DEFAULT_GROUP_SIZE}",
        )
    shapes = _quantized_shapes(config, lm_head)
    bad = _first_bad(shapes, in_multiple=group_size)
    if bad is not None:
        raise QuantizationError(
            f"int4 needs every Linear's in_features to be divisible by the group size "
            f"{group_size}; {bad.name} has {bad.in_features}",
            hint="choose a smaller group size, or int8",
        )
    bad = _first_bad(shapes, out_multiple=16)
    if bad is not None:
        raise QuantizationError(
            f"int4 needs every Linear's out_features to be a multiple of 16; "
            f"{bad.name} has {bad.out_features}",
            hint="use int8 or bnb-nf4 for this model",
        )


def _check_w8a8(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
    reason = cpu.fbgemm_unavailable()
    if reason:
        raise QuantizationError(f"w8a8 needs fbgemm: {reason}", hint="use int8 or int4")


def _check_w4a8(mode: QuantMode) -> Check:
    multiple = max(W4A8_IN_MULTIPLE, W4A8_GROUPS[mode])
    hint = "use w4a8 or w8a8" if mode is not QuantMode.W4A8 else "use w8a8 or int8"

    def check(config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int) -> None:
        _require_in_multiple(mode, config, lm_head, multiple, hint=hint)
        from . import native

        native.load(NATIVE_KERNEL[mode])  # compiles once per machine; raises with the reason

    return check


def _w4a8_handler(mode: QuantMode) -> Handler:
    group = W4A8_GROUPS[mode]
    return Handler(
        mode,
        CPU_ONLY,
        _check_w4a8(mode),
        apply=_swap(
            lambda m, g: W4A8Linear(m, group=group),
            shared=True,
            stack=lambda linears: W4A8Linear.stacked(linears, group),
        ),
    )


Make = Callable[[nn.Linear, int], nn.Module]  # (linear, group size) -> its quantized module
Stack = Callable[[list[nn.Linear]], "nn.Module | None"]  # a quantized stack from the members


def _swap(make: Make, shared: bool = False, stack: Stack | None = None) -> Apply:
    """Replace every nn.Linear (the lm_head only if asked) with make(linear). With `shared`,
    sibling Linears that read one input (SHARED_INPUT_GROUPS) first become one GEMM over
    their stacked rows, built by `stack` where it can, else by make on a float stack."""

    def apply(
        model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None
    ) -> nn.Module:
        groups = _shared_input_groups(model) if shared else []
        # the groups are a share of the work too: count them in, then the single Linears
        single = sum(1 for _ in _linears(model, lm_head)) - sum(len(a) for _, a in groups)
        total = len(groups) + single
        done = 0
        for parent, attrs in groups:
            group = SharedInputGroup(
                [getattr(parent, a) for a in attrs], lambda m: make(m, group_size), stack
            )
            for index, attr in enumerate(attrs):
                setattr(parent, attr, group.member(index))
            done += 1
            if progress is not None:
                progress(done, total)
        for parent, attr, linear in _linears(model, lm_head):  # the groups' members are gone
            setattr(parent, attr, make(linear, group_size))
            done += 1
            if progress is not None:
                progress(done, total)
        return model

    return apply


# Sibling Linears that the Llama-family modeling code calls one after the other on
# the same tensor: one GEMM for each group instead of one per projection.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _shared_input_groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    found: list[tuple[nn.Module, tuple[str, ...]]] = []
    for parent in model.modules():
        for attrs in SHARED_INPUT_GROUPS:
            linears = [getattr(parent, a, None) for a in attrs]
            if all(type(m) is nn.Linear for m in linears) and (
                len({m.in_features for m in linears if m is not None}) == 1
            ):
                found.append((parent, attrs))
    return found


def _quantized_shapes(config: PretrainedConfig, lm_head: bool) -> list[LinearShape]:
    return [s for s in linear_shapes(config) if lm_head or not s.is_lm_head]


def _linears(model: nn.Module, lm_head: bool) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) for each nn.Linear to replace; a list, so replacing is safe."""
    head = _output_embeddings(model)
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear) and (lm_head or child is not head):
                found.append((parent, attr, child))
    return iter(found)


NATIVE_KERNEL = {QuantMode.W4A8: "w4a8", QuantMode.W4A8_G128: "w4a8"}  # modes that compile a kernel of engine/model/csrc on first use

CPU_ONLY = frozenset({"cpu"})
ANY_DEVICE = frozenset({"cpu", "cuda"})
HANDLERS: dict[QuantMode, Handler] = {
    h.mode: h
    for h in (
        Handler(QuantMode.NONE, ANY_DEVICE),
        Handler(
            QuantMode.BNB_NF4,
            ANY_DEVICE,
            _check_bnb(QuantMode.BNB_NF4),
            _bnb_kwargs(QuantMode.BNB_NF4),
            _bnb_keep_odd_shapes_unpacked,
            load_time=True,
        ),
        Handler(
            QuantMode.BNB_INT8,
            ANY_DEVICE,
            _check_bnb(QuantMode.BNB_INT8),
            _bnb_kwargs(QuantMode.BNB_INT8),
            load_time=True,
        ),
        Handler(QuantMode.INT8, CPU_ONLY, _check_int8, apply=_swap(lambda m, g: Int8WeightOnlyLinear(m))),
        Handler(QuantMode.INT4, CPU_ONLY, _check_int4, apply=_swap(Int4WeightOnlyLinear)),
        Handler(
            QuantMode.W8A8, CPU_ONLY, _check_w8a8, apply=_swap(lambda m, g: Int8DynamicLinear(m), shared=True)
        ),
        _w4a8_handler(QuantMode.W4A8),
        _w4a8_handler(QuantMode.W4A8_G128),
    )
}


# --------------------------------------------------------------------------- entry points


def check(
    mode: QuantMode,
    config: PretrainedConfig,
    device: torch.device,
    *,
    lm_head: bool = QUANTIZE_LM_HEAD,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> None:
    """Raise QuantizationError, with a hint, if `mode` cannot work for `config` on `device`.

    Pass the same `lm_head` and `group_size` as to `apply`.
    """
    handler = HANDLERS[mode]
    if device.type not in handler.devices:
        others = " or ".join(m.value for m, h in HANDLERS.items() if device.type in h.devices)
        raise QuantizationError(
            f"{mode} runs on the {' or '.join(sorted(handler.devices))} only, not on {device.type}",
            hint=f"on {device.type} choose {others}",
        )
    if mode is not QuantMode.NONE and device.type == "cuda" and not torch.cuda.is_available():
        raise QuantizationError(
            f"{mode} on {device} needs CUDA, and this machine (or this torch build) has none",
            hint="load on the CPU: bnb-nf4 and bnb-int8 run there too; int8 and int4 are faster",
        )
    handler.check(config, device, lm_head, group_size)


def load_kwargs(
    mode: QuantMode, device: torch.device, *, compute_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Extra `from_pretrained` keyword arguments for `mode` ({} for post-load modes).

    `compute_dtype` is the bnb-nf4 matmul dtype; None picks bf16 on CUDA, float32 on the CPU.
    """
    return HANDLERS[mode].load_kwargs(device, compute_dtype)


def apply(
    model: nn.Module,
    mode: QuantMode,
    *,
    lm_head: bool = QUANTIZE_LM_HEAD,
    group_size: int = DEFAULT_GROUP_SIZE,
    progress: StepProgress | None = None,
) -> nn.Module:
    """Quantize a loaded model in place for post-load modes and return it.

    Replaces every nn.Linear (the output projection only if `lm_head`) with an
    int8 or int4 module; the float weights it replaces are freed unless
    something else holds them (a tied lm_head keeps the embedding's weight).
    Load-time modes and `none` return the model unchanged. `progress(done,
    total)` is called as modules are replaced (packing a 1.5B model for w8a8
    takes tens of seconds).
    """
    return HANDLERS[mode].apply(model, lm_head, group_size, progress)


def is_load_time(mode: QuantMode) -> bool:
    """True for modes that quantize inside `from_pretrained` (bitsandbytes)."""
    return HANDLERS[mode].load_time
