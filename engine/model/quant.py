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
  x86-64 with AVX2, FMA and F16C, and a C++ compiler).
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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import QuantMode
from ..errors import QuantizationError
from . import cpu

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm CPU kernel accepts
DEFAULT_GROUP_SIZE = 32  # same kernel speed as 64 or 128, fewer greedy flips (docs/quantization.md)
QUANTIZE_LM_HEAD = True  # post-load modes quantize the output projection unless told not to

BNB_BLOCK_SIZE = 64  # bitsandbytes 4-bit block of weights sharing one absmax
_COMPUTE_DTYPE = torch.bfloat16  # activations of the int8 / int4 CPU kernels (fp32: 5-14x slower)
W8A8_WEIGHT_MAX = (
    63  # weights on a 7-bit grid so activations can keep 8 bits (docs/quantization.md)
)
StepProgress = Callable[[int, int], None]  # (modules done, modules in all)
_ROWS_PER_CHUNK = 8192  # quantize large weights (the lm_head) in slices to bound peak memory


# --------------------------------------------------------------------------- modules


class _QuantizedLinear(nn.Module):
    """What every post-load module shares: the Linear's shape and bias, and a forward that
    flattens the input to rows [M, K] in the kernel's dtype, calls `rows`, and restores the
    input's shape and dtype before adding the bias."""

    compute_dtype = torch.float32  # the dtype `rows` takes
    bias: torch.Tensor | None  # [N], in the model's dtype

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        """[M, K] contiguous, in compute_dtype -> [M, N]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., K]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # [M, K]
        y = self.rows(x2).reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


# torch's `_weight_int8pack_mm` CPU kernel segfaults on blocks of several rows when
# in_features is not a multiple of 16 (measured: 168 and 184 with 5 rows on an
# AVX-512 Xeon; one row runs), and a verify block is several rows.
INT8_IN_MULTIPLE = 16


class Int8WeightOnlyLinear(_QuantizedLinear):
    """y = x @ (int8 weight * per-channel scale)^T + bias, via `aten._weight_int8pack_mm`."""

    compute_dtype = _COMPUTE_DTYPE
    weight_int8: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bf16

    def __init__(self, linear: nn.Linear) -> None:
        if linear.in_features % INT8_IN_MULTIPLE:  # else the kernel crashes the process
            raise QuantizationError(
                f"int8 needs in_features % {INT8_IN_MULTIPLE} == 0, got {linear.in_features}"
            )
        super().__init__(linear)
        weight_int8, scales = quantize_int8(linear.weight.detach())
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int4WeightOnlyLinear(_QuantizedLinear):
    """y = x @ dequant(int4 weight)^T + bias, via torch's tinygemm CPU kernel.

    Dequantization, per group of `group_size` input channels:
    w = (q - 8) * scale + zero, q in [0, 15].
    """

    compute_dtype = _COMPUTE_DTYPE
    weight_int4pack: torch.Tensor  # [N, K / 2] uint8, the kernel's packed layout
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] bf16

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        n, k = linear.out_features, linear.in_features
        if group_size not in INT4_GROUP_SIZES or k % group_size or n % 16:
            raise QuantizationError(
                f"int4 needs a group size in {INT4_GROUP_SIZES} dividing in_features and "
                f"out_features % 16 == 0; got group {group_size} for {k} -> {n}"
            )
        super().__init__(linear)
        self.group_size = group_size
        packed, scales_and_zeros = quantize_int4(linear.weight.detach(), group_size)
        self.register_buffer("weight_int4pack", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.weight_int4pack, self.group_size, self.scales_and_zeros
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group_size={self.group_size}"
        )


class Int8DynamicLinear(_QuantizedLinear):
    """y = x @ (int8 weight * per-channel scale)^T + bias, activations int8 per token (fbgemm).

    fbgemm quantizes its whole input with one (scale, zero point) taken from
    the input's min and max. To make that per token, and so batch-invariant,
    each row x is mapped to u = (x - lo) / (hi - lo) with its own lo = min(x),
    hi = max(x): every row then spans exactly [0, 1], fbgemm's range is [0, 1]
    for any batch, and x @ W^T = (hi - lo) * (u @ W^T) + lo * W.sum(1).
    Integer accumulation is exact and the rest is elementwise, so each output
    row depends on its own input row only.
    """

    weight_sums: torch.Tensor  # [N] float32, row sums of the dequantized weight

    def __init__(self, linear: nn.Linear) -> None:
        reason = cpu.fbgemm_unavailable()
        if reason:  # fbgemm would refuse inside torch, or torch would not know the engine
            raise QuantizationError(f"w8a8 cannot run here: {reason}", hint="use int8 or int4")
        super().__init__(linear)
        q, scales = quantize_int8(linear.weight.detach(), W8A8_WEIGHT_MAX)
        scales64 = scales.double()
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        engine = torch.backends.quantized.engine
        with warnings.catch_warnings():  # quantized tensors are deprecated, still the way in
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(q, scales64, zeros, 0)
            try:  # fbgemm's packing, not oneDNN's (2-3x slower at M = 1 here)
                torch.backends.quantized.engine = "fbgemm"
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            finally:
                torch.backends.quantized.engine = engine
        # Without VNNI fbgemm adds pairs of u8 * s8 products in int16 with saturation
        # (`fbgemm_saturates_pair_sums`): 8-bit activations need weights within +-63,
        # 8-bit weights need 7-bit activations (reduce_range). The same grid everywhere,
        # so a model gives the same logits on every x86 CPU.
        self.reduce_range = W8A8_WEIGHT_MAX > 63
        self.packed_bytes = q.numel() + 8 * self.out_features  # fbgemm's copy, not a buffer
        # Integer row sums are exact (|sum| <= 127 K); one rounding when scaled.
        sums = q.sum(dim=1, dtype=torch.int32).double() * scales64
        self.register_buffer("weight_sums", sums.float())

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        lo, hi = torch.aminmax(x2, dim=1, keepdim=True)  # [M, 1]
        span = (hi - lo).clamp_min(1e-30)
        u = (x2 - lo) / span  # min exactly 0, max exactly 1 (x / x == 1 in IEEE)
        y = torch.ops.quantized.linear_dynamic(u, self._packed, self.reduce_range)  # [M, N]
        return torch.addcmul(lo * self.weight_sums, y, span)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "int8 per-channel weights, int8 per-token activations"
        )


def fbgemm_saturates_pair_sums(have: cpu.CpuFeatures | None = None) -> bool:
    """Whether fbgemm's u8 x s8 GEMM adds product pairs in saturating int16 on this CPU.

    fbgemm picks its kernel from the CPU: with AVX512-VNNI, vpdpbusd accumulates
    each group of four products in int32 and nothing saturates; on AVX2 and
    AVX-512 without VNNI, vpmaddubsw sums pairs into int16 with saturation.
    """
    return not (have or cpu.features()).avx512_vnni


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight [N, K] -> (int8 [N, K] in [-qmax, qmax], bf16 scales [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / qmax).clamp(min=1e-10).to(_COMPUTE_DTYPE)  # [N]
    q = (w / scales.float()[:, None]).round().clamp(-qmax, qmax).to(torch.int8)  # [N, K]
    return q, scales


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4: weight [N, K] -> (packed uint8 [N, K/2], [K/g, N, 2] bf16).

    Scales and zeros are rounded to bf16 first and the weights quantized
    against the rounded values, so the kernel dequantizes what was measured.
    """
    n_rows = weight.shape[0]
    packed_parts, sz_parts = [], []
    for start in range(0, n_rows, _ROWS_PER_CHUNK):
        w = weight[start : start + _ROWS_PER_CHUNK].float()  # [n, K]
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)  # [n, G, g]
        w_min, w_max = groups.amin(dim=-1), groups.amax(dim=-1)  # [n, G]
        scales = ((w_max - w_min).clamp(min=1e-6) / 15).to(_COMPUTE_DTYPE)
        zeros = (w_min + scales.float() * 8).to(_COMPUTE_DTYPE)  # the value q = 8 stands for
        lowest = zeros.float() - scales.float() * 8  # the value q = 0 stands for
        q = ((groups - lowest[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
        q = q.to(torch.int32).reshape(n, k)
        packed_parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz_parts.append(torch.stack([scales, zeros], dim=-1))  # [n, G, 2]
    packed = torch.cat(packed_parts)  # [N, K/2]
    scales_and_zeros = torch.cat(sz_parts).transpose(0, 1).contiguous()  # [G, N, 2]
    return packed, scales_and_zeros


class W4A8Linear(_QuantizedLinear):
    """y = x @ (int4 weight, grouped scale and minimum)^T + bias, activations int8 per 32 values.

    The weights live in the kernel's layout (`pack_w4a8`); `torch.ops.specchat.w4a8_linear`
    computes each output row from its own input row only.
    """

    packed: torch.Tensor  # [N/8, K/32, 128] uint8: two 4-bit codes a byte
    scales: torch.Tensor  # [N/8, K/32, 8] float16
    mins: torch.Tensor  # [N/8, K/32, 8] float16

    def __init__(
        self,
        linear: nn.Linear,
        prepacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        from . import native

        native.load("w4a8")  # once per process; raises QuantizationError with the reason
        super().__init__(linear)
        packed, scales, mins = prepacked or pack_w4a8(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def stacked(cls, linears: list[nn.Linear]) -> W4A8Linear | None:
        """One module over the linears' rows stacked, packed member by member.

        Packing is row-local in groups of 8, so when every member but the last
        fills whole groups the stack's packing is the members' packings one after
        the other, without a float copy of the stacked weights (2.6 s of the 1.5B
        target's load). None where a member's rows end inside a group.
        """
        if any(m.out_features % _W4A8_ROWS for m in linears[:-1]):
            return None
        parts = [pack_w4a8(m.weight.detach()) for m in linears]
        rows = sum(m.out_features for m in linears)
        shell = nn.Linear(linears[0].in_features, rows, bias=False, device="meta")  # shape only
        packed, scales, mins = (torch.cat([p[j] for p in parts]) for j in range(3))
        return cls(shell, (packed, scales, mins))

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.specchat.w4a8_linear(
            x2, self.packed, self.scales, self.mins, self.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 weights in groups of {W4A8_GROUP}, int8 activations"
        )


W4A8_GROUP = 32  # input channels sharing one weight scale and minimum (and one activation scale)
W4A8_IN_MULTIPLE = W4A8_GROUP  # the kernel walks whole groups
_W4A8_ROWS = 8  # output rows the kernel interleaves


@torch.no_grad()
def quantize_w4a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of 32: weight [N, K] -> (codes uint8 [N, K] in 0..15, scales, mins [N, K/32]).

    w ~ code * scale + min, min the group's least value and scale its range / 15,
    both float16: they add a quarter to the 4-bit codes' bytes (float32 would add half).
    The codes are taken against the rounded scale and minimum, so the kernel
    dequantizes what was measured.
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // W4A8_GROUP, W4A8_GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    mins = lo.to(torch.float16)
    scales = ((hi - mins.float()) / 15).clamp(min=2**-24).to(torch.float16)  # >= float16's least
    codes = ((groups - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scales, mins


@torch.no_grad()
def pack_w4a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> the kernel's (packed, scales, mins), as `pack_w4a8_reference` packs them.

    The kernel library's own packer does it in one parallel pass: the 1.5B target's
    1.5 G weights pack in ~2 s on two threads, where the reference's tensor
    operations took ~15 s of the model's load.
    """
    from . import native

    n, k = weight.shape
    if k % W4A8_IN_MULTIPLE:
        raise ValueError(f"w4a8 needs in_features divisible by {W4A8_IN_MULTIPLE}, not {k}")
    native.load("w4a8")
    if weight.dtype == torch.float32:
        return tuple(torch.ops.specchat.w4a8_pack(weight.contiguous()))  # type: ignore[return-value]
    step = _ROWS_PER_CHUNK  # a multiple of 8: slices pack into whole row groups
    parts = [
        torch.ops.specchat.w4a8_pack(weight[i : i + step].float().contiguous())
        for i in range(0, n, step)
    ]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]


@torch.no_grad()
def pack_w4a8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> the kernel's (packed [N/8, K/32, 128], scales, mins [N/8, K/32, 8]).

    Rows go in groups of 8 (zero rows pad the last), and a group's 32-input blocks
    follow one another. A block is 4 loads of 32 bytes; in load i, row r holds bytes
    4r..4r+3, byte j carrying code 4i + j in its low nibble and code 16 + 4i + j in its
    high one. Scales and minimums: per row group and block, rows 0-7. Packed in slices
    to bound peak memory.
    """
    n, k = weight.shape
    if k % W4A8_IN_MULTIPLE:
        raise ValueError(f"w4a8 needs in_features divisible by {W4A8_IN_MULTIPLE}, not {k}")
    blocks, rows = k // W4A8_GROUP, _W4A8_ROWS
    packed_parts: list[torch.Tensor] = []
    scale_parts: list[torch.Tensor] = []
    min_parts: list[torch.Tensor] = []
    for start in range(0, n, _ROWS_PER_CHUNK):
        codes, scales, mins = quantize_w4a8(weight[start : start + _ROWS_PER_CHUNK])
        pad = -codes.shape[0] % rows
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            scales = torch.cat([scales, scales.new_zeros(pad, blocks)])
            mins = torch.cat([mins, mins.new_zeros(pad, blocks)])
        groups = codes.shape[0] // rows
        # [group, row, block, half, load, byte] -> [group, block, half, load, row, byte]
        c = codes.reshape(groups, rows, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        packed_parts.append((c[:, :, 0] | (c[:, :, 1] << 4)).reshape(groups, blocks, 4 * rows * 4))
        for parts, t in ((scale_parts, scales), (min_parts, mins)):
            parts.append(t.reshape(groups, rows, blocks).transpose(1, 2))
    return (
        torch.cat(packed_parts).contiguous(),
        torch.cat(scale_parts).contiguous(),
        torch.cat(min_parts).contiguous(),
    )


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


# --------------------------------------------------------------------------- handlers


class Handler(Protocol):
    """The steps every mode takes; see the module docstring."""

    mode: QuantMode
    devices: frozenset[str]  # device types the mode runs on

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None: ...

    def load_kwargs(
        self, device: torch.device, compute_dtype: torch.dtype | None
    ) -> dict[str, Any]: ...

    def apply(
        self, model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None = None
    ) -> nn.Module: ...


class _Handler:
    """What every mode does unless it says otherwise: no checks, no load arguments, no swap."""

    mode: QuantMode
    devices: frozenset[str]

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
        return None

    def load_kwargs(
        self, device: torch.device, compute_dtype: torch.dtype | None
    ) -> dict[str, Any]:
        return {}

    def apply(
        self, model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None = None
    ) -> nn.Module:
        return model


class _AsLoaded(_Handler):
    mode = QuantMode.NONE
    devices = frozenset({"cpu", "cuda"})


class _BitsAndBytes(_Handler):
    """bitsandbytes through transformers: quantized while loading, lm_head left as loaded."""

    devices = frozenset({"cpu", "cuda"})

    def __init__(self, mode: QuantMode) -> None:
        self.mode = mode

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
        for package in ("bitsandbytes", "accelerate"):
            if not _installed(package):
                raise QuantizationError(
                    f"{self.mode} needs the '{package}' package, which is not installed",
                    hint=f"pip install {package}, or choose another --quant",
                )
        if (
            self.mode is QuantMode.BNB_NF4
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

    def load_kwargs(
        self, device: torch.device, compute_dtype: torch.dtype | None
    ) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        if self.mode is QuantMode.BNB_NF4:
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

    def apply(
        self, model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None = None
    ) -> nn.Module:
        """Keep 4-bit layers whose shape bitsandbytes' packed CPU layout cannot take on its
        dequantizing path (it would crash repacking them on an AVX512-BF16 CPU)."""
        if self.mode is not QuantMode.BNB_NF4 or not _installed("bitsandbytes"):
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


class _PostLoad(_Handler):
    """CPU modes that swap each nn.Linear for a quantized module after loading."""

    devices = frozenset({"cpu"})

    def module(self, linear: nn.Linear, group_size: int) -> nn.Module:
        raise NotImplementedError

    def apply(
        self, model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None = None
    ) -> nn.Module:
        linears = list(_linears(model, lm_head))
        for done, (parent, attr, linear) in enumerate(linears, 1):
            setattr(parent, attr, self.module(linear, group_size))
            if progress is not None:
                progress(done, len(linears))
        return model


class _Int8WeightOnly(_PostLoad):
    mode = QuantMode.INT8

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
        _require_in_multiple(
            self.mode, config, lm_head, INT8_IN_MULTIPLE, hint="use bnb-int8 or none"
        )

    def module(self, linear: nn.Linear, group_size: int) -> nn.Module:
        return Int8WeightOnlyLinear(linear)


class _Int4WeightOnly(_PostLoad):
    mode = QuantMode.INT4

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
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

    def module(self, linear: nn.Linear, group_size: int) -> nn.Module:
        return Int4WeightOnlyLinear(linear, group_size)


class _SharedInputs(_PostLoad):
    """Post-load modes whose kernel gains from one call per shared input (SHARED_INPUT_GROUPS)."""

    def stack(self, linears: list[nn.Linear]) -> nn.Module | None:
        """The quantized stack built from the members directly; None: quantize a float stack."""
        return None

    def apply(
        self, model: nn.Module, lm_head: bool, group_size: int, progress: StepProgress | None = None
    ) -> nn.Module:
        groups = _shared_input_groups(model)
        # the groups are a share of the work too: count them in, then the single Linears
        single = sum(1 for _ in _linears(model, lm_head)) - sum(len(a) for _, a in groups)
        total = len(groups) + single
        for done, (parent, attrs) in enumerate(groups, 1):
            group = SharedInputGroup(
                [getattr(parent, a) for a in attrs],
                lambda m: self.module(m, group_size),
                self.stack,
            )
            for index, attr in enumerate(attrs):
                setattr(parent, attr, group.member(index))
            if progress is not None:
                progress(done, total)

        def rest(done: int, _total: int) -> None:
            if progress is not None:
                progress(len(groups) + done, total)

        return super().apply(model, lm_head, group_size, rest)


class _Int8Dynamic(_SharedInputs):
    mode = QuantMode.W8A8

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
        reason = cpu.fbgemm_unavailable()
        if reason:
            raise QuantizationError(f"w8a8 needs fbgemm: {reason}", hint="use int8 or int4")

    def module(self, linear: nn.Linear, group_size: int) -> nn.Module:
        return Int8DynamicLinear(linear)


class _W4A8(_SharedInputs):
    mode = QuantMode.W4A8

    def check(
        self, config: PretrainedConfig, device: torch.device, lm_head: bool, group_size: int
    ) -> None:
        _require_in_multiple(self.mode, config, lm_head, W4A8_IN_MULTIPLE, hint="use w8a8 or int8")
        from . import native

        native.load(NATIVE_KERNEL[self.mode])  # compiles once per machine; raises with the reason

    def module(self, linear: nn.Linear, group_size: int) -> nn.Module:
        return W4A8Linear(linear)

    def stack(self, linears: list[nn.Linear]) -> nn.Module | None:
        return W4A8Linear.stacked(linears)


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


class SharedInputGroup(nn.Module):
    """Several Linears that read the same input, as one quantized GEMM over their stacked rows.

    The first member called with a tensor computes every member's output and
    keeps it until each member has taken its part; a member called with any
    other tensor computes afresh, so the result never depends on call order.
    Each output row still depends on its own input row only.
    """

    def __init__(
        self,
        linears: list[nn.Linear],
        make: Callable[[nn.Linear], nn.Module],
        stack: Callable[[list[nn.Linear]], nn.Module | None] | None = None,
    ) -> None:
        """`make` quantizes the stacked Linear; `stack`, where given and able, builds the
        quantized stack from the members directly (None: it cannot)."""
        super().__init__()
        module = stack(linears) if stack is not None else None
        if module is None:
            rows = sum(m.out_features for m in linears)
            stacked = nn.Linear(linears[0].in_features, rows, bias=False, device="meta")  # no init
            stacked.weight = nn.Parameter(
                torch.cat([m.weight.detach() for m in linears]), requires_grad=False
            )
            module = make(stacked)
        self.linear = module
        self.sizes = [m.out_features for m in linears]
        for i, m in enumerate(linears):
            self.register_buffer(f"bias{i}", None if m.bias is None else m.bias.detach().clone())
        # What the last input produced, in a plain object: nn.Module's own attribute
        # setting and getting cost more than the kernel call for the small projections.
        self._served = _Served()

    def member(self, index: int) -> SharedInputMember:
        return SharedInputMember(self, index)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        served = self._served
        if x is not served.input or index not in served.pending:
            served.parts = self.linear(x).split(self.sizes, dim=-1)
            served.input, served.pending = x, set(range(len(self.sizes)))
        out = served.parts[index]
        served.pending.discard(index)
        if not served.pending:  # everyone served: hold no tensors between calls
            served.input, served.parts = None, ()
        bias: torch.Tensor | None = self._buffers[f"bias{index}"]
        return out if bias is None else out + bias


class _Served:
    __slots__ = ("input", "parts", "pending")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.pending: set[int] = set()


class SharedInputMember(nn.Module):
    """Stands where one Linear of a `SharedInputGroup` stood."""

    def __init__(self, group: SharedInputGroup, index: int) -> None:
        super().__init__()
        self.group = group
        self.index = index
        self.in_features = group.linear.in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of a shared-input GEMM, out_features={self.out_features}"


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


NATIVE_KERNEL = {QuantMode.W4A8: "w4a8"}  # modes that compile a kernel of engine/model/csrc on first use

HANDLERS: dict[QuantMode, Handler] = {
    QuantMode.NONE: _AsLoaded(),
    QuantMode.BNB_NF4: _BitsAndBytes(QuantMode.BNB_NF4),
    QuantMode.BNB_INT8: _BitsAndBytes(QuantMode.BNB_INT8),
    QuantMode.INT8: _Int8WeightOnly(),
    QuantMode.INT4: _Int4WeightOnly(),
    QuantMode.W8A8: _Int8Dynamic(),
    QuantMode.W4A8: _W4A8(),
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
    return isinstance(HANDLERS[mode], _BitsAndBytes)
