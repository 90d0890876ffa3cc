"""The quantized replacements for `nn.Linear`, and how each quantizes its weights.

One module per kernel (engine/model/quant.py says which mode uses which, and when
it can run): `Int8WeightOnlyLinear` and `Int4WeightOnlyLinear` (torch's CPU
kernels), `Int8DynamicLinear` (fbgemm's integer GEMM), `W4A8Linear` (specchat's
own kernel, engine/model/csrc/w4a8.cpp), and `SharedInputGroup`, which runs
sibling Linears that read one input (q/k/v, gate/up) as one GEMM. Each computes
every output row from its own input row only, so a row scores the same in a
verify block as alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..errors import QuantizationError
from . import cpu

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm CPU kernel accepts

_COMPUTE_DTYPE = torch.bfloat16  # activations of the int8 / int4 CPU kernels (fp32: 5-14x slower)
W8A8_WEIGHT_MAX = (
    63  # weights on a 7-bit grid so activations can keep 8 bits (docs/quantization.md)
)
_ROWS_PER_CHUNK = 8192  # quantize large weights (the lm_head) in slices to bound peak memory


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
    computes each output row from its own input row only. `group` is the number of
    inputs sharing a weight scale and minimum: 32 (w4a8), or 128 (w4a8-g128, the range
    searched per group), where the kernel reads 0.53 bytes a weight instead of 0.625.
    """

    packed: torch.Tensor  # [N/8, K/32, 128] uint8: two 4-bit codes a byte
    scales: torch.Tensor  # [N/8, K/group, 8] float16
    mins: torch.Tensor  # [N/8, K/group, 8] float16

    def __init__(
        self,
        linear: nn.Linear,
        prepacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        group: int = 32,
    ) -> None:
        from . import native

        native.load("w4a8")  # once per process; raises QuantizationError with the reason
        super().__init__(linear)
        packed, scales, mins = prepacked or pack_w4a8(linear.weight.detach(), group)
        self.group = linear.in_features // scales.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def stacked(cls, linears: list[nn.Linear], group: int = 32) -> W4A8Linear | None:
        """One module over the linears' rows stacked, packed member by member.

        Packing is row-local in groups of 8, so when every member but the last
        fills whole groups the stack's packing is the members' packings one after
        the other, without a float copy of the stacked weights (2.6 s of the 1.5B
        target's load). None where a member's rows end inside a group.
        """
        if any(m.out_features % _W4A8_ROWS for m in linears[:-1]):
            return None
        parts = [pack_w4a8(m.weight.detach(), group) for m in linears]
        rows = sum(m.out_features for m in linears)
        shell = nn.Linear(linears[0].in_features, rows, bias=False, device="meta")  # shape only
        packed, scales, mins = (torch.cat([p[j] for p in parts]) for j in range(3))
        return cls(shell, (packed, scales, mins), group)

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.specchat.w4a8_linear(
            x2, self.packed, self.scales, self.mins, self.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 weights in groups of {self.group}, int8 activations"
        )


W4A8_GROUP = 32  # input channels sharing one weight scale and minimum (and one activation scale)
W4A8_IN_MULTIPLE = W4A8_GROUP  # the kernel walks whole groups
# Weight groups the kernel reads: the activations' 32, or 32 * 2^s sharing one scale and
# minimum. Wider groups try this many ranges, each 5% narrower (w4a8-g128 on the 0.5B
# draft: 84.4% of the target's tokens guessed, against 83.3% with the full range alone;
# w4a8, groups of 32: 85.8%).
W4A8_SHRINKS = {32: 1, 64: 10, 128: 10}
_W4A8_ROWS = 8  # output rows the kernel interleaves


@torch.no_grad()
def quantize_w4a8(
    weight: torch.Tensor, group: int = W4A8_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: weight [N, K] -> (codes uint8 [N, K] in 0..15, scales, mins [N, K/group]).

    w ~ code * scale + min, min the group's least value and scale its range / 15,
    both float16: they add a quarter to the 4-bit codes' bytes (float32 would add half).
    The codes are taken against the rounded scale and minimum, so the kernel
    dequantizes what was measured. Groups wider than 32 also try the range narrowed
    about its middle (W4A8_SHRINKS) and keep the least squared error, the first of equals.
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group, group)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    mid = (lo + hi) / 2
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    best_err = torch.zeros(())
    for j in range(W4A8_SHRINKS[group]):
        keep = torch.tensor(1.0) - torch.tensor(0.05) * torch.tensor(float(j))  # as float32 in C++
        a, b = (lo, hi) if j == 0 else (mid + (lo - mid) * keep, mid + (hi - mid) * keep)
        mins = a.to(torch.float16)
        scales = ((b - mins.float()) / 15).clamp(min=2**-24).to(torch.float16)  # >= float16's least
        d, m = scales.float()[..., None], mins.float()[..., None]
        codes = ((groups - m) / d).round().clamp(0, 15)
        err = (codes * d + m - groups).double().pow(2).sum(-1)
        if best is None:
            best, best_err = (codes, scales, mins), err
            continue
        better = err < best_err
        best = (
            torch.where(better[..., None], codes, best[0]),
            torch.where(better, scales, best[1]),
            torch.where(better, mins, best[2]),
        )
        best_err = torch.minimum(err, best_err)
    assert best is not None
    codes, scales, mins = best
    return codes.to(torch.uint8).reshape(n, k), scales, mins


@torch.no_grad()
def pack_w4a8(
    weight: torch.Tensor, group: int = W4A8_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> the kernel's (packed, scales, mins), as `pack_w4a8_reference` packs them.

    The kernel library's own packer does it in one parallel pass: the 1.5B target's
    1.5 G weights pack in ~2 s on two threads, where the reference's tensor
    operations took ~15 s of the model's load.
    """
    from . import native

    n, k = weight.shape
    _check_w4a8_group(k, group)
    native.load("w4a8")
    shrinks = W4A8_SHRINKS[group]
    if weight.dtype == torch.float32:
        return tuple(torch.ops.specchat.w4a8_pack(weight.contiguous(), group, shrinks))  # type: ignore[return-value]
    step = _ROWS_PER_CHUNK  # a multiple of 8: slices pack into whole row groups
    parts = [
        torch.ops.specchat.w4a8_pack(weight[i : i + step].float().contiguous(), group, shrinks)
        for i in range(0, n, step)
    ]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]


def _check_w4a8_group(k: int, group: int) -> None:
    if group not in W4A8_SHRINKS:
        raise ValueError(
            f"w4a8 weight groups are {', '.join(map(str, W4A8_SHRINKS))} inputs, not {group}"
        )
    if k % group:
        raise ValueError(
            f"w4a8 with groups of {group} needs in_features divisible by {group}, not {k}"
        )


@torch.no_grad()
def pack_w4a8_reference(
    weight: torch.Tensor, group: int = W4A8_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> the kernel's (packed [N/8, K/32, 128], scales, mins [N/8, K/group, 8]).

    Rows go in groups of 8 (zero rows pad the last), and a group's 32-input blocks
    follow one another. A block is 4 loads of 32 bytes; in load i, row r holds bytes
    4r..4r+3, byte j carrying code 4i + j in its low nibble and code 16 + 4i + j in its
    high one. Scales and minimums: per row group and weight group, rows 0-7. Packed in
    slices to bound peak memory.
    """
    n, k = weight.shape
    _check_w4a8_group(k, group)
    blocks, rows = k // W4A8_GROUP, _W4A8_ROWS
    weight_groups = k // group
    packed_parts: list[torch.Tensor] = []
    scale_parts: list[torch.Tensor] = []
    min_parts: list[torch.Tensor] = []
    for start in range(0, n, _ROWS_PER_CHUNK):
        codes, scales, mins = quantize_w4a8(weight[start : start + _ROWS_PER_CHUNK], group)
        pad = -codes.shape[0] % rows
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            scales = torch.cat([scales, scales.new_zeros(pad, weight_groups)])
            mins = torch.cat([mins, mins.new_zeros(pad, weight_groups)])
        groups = codes.shape[0] // rows
        # [group, row, block, half, load, byte] -> [group, block, half, load, row, byte]
        c = codes.reshape(groups, rows, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        packed_parts.append((c[:, :, 0] | (c[:, :, 1] << 4)).reshape(groups, blocks, 4 * rows * 4))
        for parts, t in ((scale_parts, scales), (min_parts, mins)):
            parts.append(t.reshape(groups, rows, weight_groups).transpose(1, 2))
    return (
        torch.cat(packed_parts).contiguous(),
        torch.cat(scale_parts).contiguous(),
        torch.cat(min_parts).contiguous(),
    )


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
