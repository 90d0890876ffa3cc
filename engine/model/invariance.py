"""Batch invariance: a token's logits do not depend on how many tokens are fed with it.

Greedy speculative decoding emits the target's argmax at every position, so
its output equals plain greedy output token for token exactly when the target
scores a token in a verify block of K+1 bit for bit as it scores it alone in
a one-token step. Three parts of a pass could break that:

- attention: scored row by row, as the one-token step does
  (engine/model/attention.py; the native decoder does the same);
- quantized projections (w4a8, w8a8, int8, int4): their kernels compute each
  output row from its own input row only (engine/model/quant.py);
- float projections and approximate elementwise functions, here. A float
  GEMM is not batch-invariant on the CPU: MKL reduces a row in another order
  alone than among others (one row alone against the same row in a block of
  5: 5e-7 apart at 64x64 to 1536x1536 on a Xeon with AVX-512 and MKL 2024.2,
  tests/unit/test_batch_invariance.py). Nor is silu: ATen runs a tensor's
  elements in vectors and the remainder one by one, and the two round
  differently, so an element's value depends on where it falls in the block.
  Three layers of a tiny model grow that to 5e-6 in the logits, and a
  near-tie then picks different tokens in plain and in speculative decoding.

Two ways out, both giving every row of a block the bits of a one-token step:

- the fixed-order kernel (`FIXED`, csrc/decoder.cpp's fixed_linear): a
  float32 GEMM whose every output is reduced in one order whatever the
  number of rows. Steps and blocks both run it; a step costs what MKL's
  costs, and a block reads each weight once: a verify block of 5 costs ~1.6
  steps, less than MKL's batched GEMM (~2; docs/performance.md). It needs an
  x86-64 CPU with AVX2 and FMA (AVX-512 where there is one, chosen at run
  time) and the native library;
- rows apart (`APART`, the fallback, and for bfloat16 / float16): each row
  of a block through the very call a step makes (`F.linear` on a fresh
  [1, 1, K] row). Exact anywhere, but a block of K+1 rows reads the
  projections' weights K+1 times.

silu and the rotary tables' cos and sin take the rows apart either way.
What remains is exact whatever the row count: gathers, adds, products,
divisions and square roots (correctly rounded in vector and scalar code
alike), the RMSNorm's mean (ATen reduces each row of fewer than 32,768
values alone, in one order), and attention, scored per row. Blocks longer
than `MAX_ROWWISE` (prompts; a prompt is prefilled the same way in every
mode) keep the batched calls, as they keep the batched attention.

`plan(model)` decides, once per model, which way a runner takes and says in
one sentence what holds: greedy speculative output token-identical to plain
by design, or only exact in distribution and equal up to floating-point
ties, and why (`Exactness.reason`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..errors import QuantizationError
from .attention import MAX_ROWWISE, NAME
from .qlinear import (
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    W4A8Linear,
    _QuantizedLinear,
)

# "0": a block takes one call per op, as transformers' modules do (not batch-invariant;
# to measure what invariance costs); "apart": rows apart even where the fixed kernel runs.
ENV = "SPECCHAT_ROWS_APART"
BATCHED, APART, FIXED = 0, 1, 2  # how a short block runs; csrc/decoder.cpp's Rows
# The architectures whose forward was checked op by op (the tests run them): their
# only calls that round by row count are the ones RowsApart takes apart.
CHECKED = ("llama", "qwen2")
_SERIAL_REDUCTION = 32768  # ATen's grain: a reduction over one row this long splits across threads
_KERNELS = {  # the quantized modules whose kernels compute each row from its own row
    W4A8Linear: "w4a8",
    Int8DynamicLinear: "w8a8",
    Int8WeightOnlyLinear: "int8",
    Int4WeightOnlyLinear: "int4",
}
TIES = "exact in distribution, equal to plain up to floating-point ties"


def apart(func: Callable[..., Tensor], x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """func(x, *args, **kwargs) with x [..., D] taken one row of D at a time.

    Every row goes alone, copied to a tensor of its own (offset 0, aligned as
    any fresh tensor), in the shape a one-token step passes: [1, ..., 1, D].
    """
    d = x.shape[-1]
    one = (1,) * (x.dim() - 1) + (d,)
    rows = x.reshape(-1, d)  # [M, D]
    out = [func(rows[r : r + 1].reshape(one).clone(), *args, **kwargs) for r in range(len(rows))]
    y = out[0] if len(out) == 1 else torch.cat(out, dim=-2 if x.dim() > 1 else 0)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dense_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear one row at a time: x [..., K] -> [..., N], each row as a one-token step makes it."""
    return apart(F.linear, x, weight, bias)


def fixed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), float32, each output reduced in one fixed order."""
    out: Tensor = torch.ops.specchat.fixed_linear(x, weight, bias)
    return out


def fixed_kernel() -> str:
    """The fixed-order kernel's instruction set here ("avx512", "avx2"), or why there is none."""
    from . import native

    try:
        native.load("decoder")
        isa = str(torch.ops.specchat.fixed_linear_isa())
    except QuantizationError as exc:  # no compiler, or the build failed: says why
        return f"no fixed-order kernel: {exc.message}"
    except (RuntimeError, AttributeError) as exc:  # a library without the op
        return f"no fixed-order kernel: {str(exc).strip().splitlines()[0]}"
    return isa or "no fixed-order kernel: it needs an x86-64 CPU with AVX2 and FMA"


# Elementwise functions whose vectorized and scalar code round differently: ATen runs a
# tensor's elements in vectors of 2x16 (AVX-512) and the rest one by one, so an element's
# result depends on where it falls in the whole tensor (silu: 4 of 1,204 elements of a
# [7, 172] block differ from the same rows alone). Add, mul, div and sqrt round exactly
# either way and need nothing.
_ELEMENTWISE = frozenset(
    {
        F.silu,
        F.gelu,
        torch.sigmoid,
        torch.Tensor.sigmoid,
        torch.tanh,
        torch.Tensor.tanh,
        torch.exp,
        torch.Tensor.exp,
        torch.cos,
        torch.Tensor.cos,
        torch.sin,
        torch.Tensor.sin,
    }
)


class RowsApart(TorchFunctionMode):
    """While active (this thread), what a short block computes by row count gets each row
    a step's bits: float32 `F.linear` through the fixed-order kernel (`fixed`; one row
    too), other `F.linear` calls and the elementwise functions above one row at a time.
    Every other call runs as it would."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed

    @staticmethod
    def needed(exactness: Exactness, n: int) -> bool:
        """Whether a feed of n tokens must run under the mode (else it computes as a step)."""
        return exactness.rows_apart and 0 < n <= MAX_ROWWISE and (n > 1 or exactness.fixed)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = _rows(x)
            if self.fixed and 0 < rows <= MAX_ROWWISE and _float32(x, weight):
                return fixed_linear(x, weight, bias)
            if 1 < rows <= MAX_ROWWISE:
                return apart(F.linear, x, weight, bias)
        elif func in _ELEMENTWISE and args and 1 < _rows(args[0]) <= MAX_ROWWISE:
            if kwargs.get("inplace"):  # F.silu(x, inplace=True)
                return args[0].copy_(apart(func, *args, **{**kwargs, "inplace": False}))
            return apart(func, *args, **kwargs)
        return func(*args, **kwargs)


def _rows(x: Any) -> int:
    """How many rows (of its last dimension) a float tensor holds; 0 for anything else."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1 or not x.shape[-1]:
        return 0
    return x.numel() // x.shape[-1]


def _float32(x: Tensor, weight: Any) -> bool:
    return (
        x.dtype == torch.float32
        and type(weight) in (Tensor, nn.Parameter)
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and x.device.type == "cpu"
    )


@dataclass(frozen=True, slots=True)
class Exactness:
    """What a runner guarantees about greedy speculative output, and why."""

    identical: bool  # greedy spec == plain token for token, by design
    rows: int  # how a short block runs: BATCHED, APART or FIXED
    reason: str  # one sentence for the session's notes and `specchat ab`'s report

    @property
    def rows_apart(self) -> bool:
        """Whether short blocks run the invariant way (APART or FIXED)."""
        return self.rows != BATCHED

    @property
    def fixed(self) -> bool:
        """Whether float32 projections run the fixed-order kernel (one-token steps too)."""
        return self.rows == FIXED

    def __str__(self) -> str:
        return self.reason


def plan(model: nn.Module) -> Exactness:
    """Whether `model`'s logits are batch-invariant, by which path, and the sentence saying so."""
    dense: set[str] = set()  # dtypes of the float projections
    kernels: set[str] = set()
    blockers: list[str] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            dense.add(str(module.weight.dtype).removeprefix("torch."))
        elif type(module) in _KERNELS:
            kernels.add(_KERNELS[type(module)])
        elif isinstance(module, _QuantizedLinear) or (
            not isinstance(module, nn.Embedding) and _holds_a_matrix(module)
        ):
            blockers.append(f"{name} ({type(module).__name__}) is not known to compute rows alone")
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    if arch not in CHECKED:
        blockers.insert(0, f"{arch} models are not checked op by op for row invariance")
    if getattr(config, "hidden_size", 0) >= _SERIAL_REDUCTION:
        blockers.append("a norm's row is too long to be reduced in one order")
    device = _device(model)
    if device.type != "cpu":
        blockers.insert(0, f"on {device.type} the GEMM kernels are chosen by the number of rows")
    if getattr(config, "_attn_implementation", None) != NAME:
        blockers.insert(0, "attention is not scored row by row (engine/model/attention.py)")
    if blockers:
        return Exactness(False, BATCHED, f"{TIES}: {blockers[0]}")
    setting = os.environ.get(ENV, "1")
    if setting == "0":
        return Exactness(False, BATCHED, f"{TIES}: a verify block takes one call per op ({ENV}=0)")
    rows, how = (
        APART,
        ["attention, silu and the rotary tables take each row of a verify block alone"],
    )
    if "float32" in dense:
        isa = fixed_kernel() if setting != "apart" else f"rows apart by {ENV}=apart"
        if isa in ("avx512", "avx2"):
            rows = FIXED
            how.append(
                f"the float32 projections run a fixed-order kernel ({isa}) that reduces each "
                "row in one order whatever the block (each weight read once per block)"
            )
        else:
            how.append(
                "the float32 projections take a verify block one row at a time, as a one-token "
                f"step does (each row reads their weights again; {isa})"
            )
    others = sorted(dense - {"float32"})
    if others:
        how.append(
            f"the {'/'.join(others)} projections take a verify block one row at a time, as a "
            "one-token step does (each row reads their weights again)"
        )
    if kernels:
        how.append(f"the {'/'.join(sorted(kernels))} kernels compute each row from its own row")
    return Exactness(
        True,
        rows,
        "greedy speculative output is token-identical to plain by design on the CPU: "
        + "; ".join(how),
    )


def _holds_a_matrix(module: nn.Module) -> bool:
    """A module with a weight of its own of 2 or more dimensions (a projection of some kind)."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.dim() >= 2 for t in own)


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")
