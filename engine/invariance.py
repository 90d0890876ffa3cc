"""Batch invariance: a token's logits do not depend on how many tokens are fed with it.

Greedy speculative decoding emits the target's argmax at every position, so
its output equals plain greedy output token for token exactly when the target
scores a token in a verify block of K+1 bit for bit as it scores it alone in
a one-token step. Three parts of a pass could break that:

- attention: scored row by row, as the one-token step does
  (engine/attention.py; the native decoder does the same);
- quantized projections (w4a8, w8a8, int8, int4): their kernels compute each
  output row from its own input row only (engine/quant.py);
- float projections and approximate elementwise functions, here. A float
  GEMM is not batch-invariant on the CPU: MKL blocks the reduction
  differently for one row and for several (one row alone against the same
  row in a block of 5: up to 2e-6 apart at 288x288 on a Xeon with AVX-512
  and MKL 2024.2, tests/unit/test_batch_invariance.py). Nor is silu: ATen
  runs a tensor's elements in vectors and the remainder one by one, and the
  two round differently, so an element's value depends on where it falls in
  the whole block. Three layers of a tiny model grow that to 5e-6 in the
  logits, and a near-tie then picks different tokens in plain and in
  speculative decoding. `RowsApart` runs each such call of a short block one
  row at a time, through the very call (`F.linear` on a fresh [1, 1, K] row)
  the one-token step makes, so every row is bit-identical to the step's.

What remains is exact whatever the row count: gathers, adds, products,
divisions and square roots (correctly rounded in vector and scalar code
alike), the RMSNorm's mean (ATen reduces each row of fewer than 32,768
values alone, in one order), and attention, scored per row.

The price is the weights' bytes: a verify block of K+1 rows reads each float
projection's weights K+1 times instead of once (quantized projections are
untouched). Blocks longer than `MAX_ROWWISE` (prompts; a prompt is prefilled
the same way in every mode) keep the batched calls, as they keep the batched
attention.

`plan(model)` decides, once per model, whether a runner takes this path and
says in one sentence what holds: greedy speculative output token-identical
to plain by design, or only exact in distribution and equal up to
floating-point ties, and why (`Exactness.reason`).
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

from .attention import MAX_ROWWISE, NAME
from .quant import (
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    W4A8Linear,
    _QuantizedLinear,
)

ENV = "SPECCHAT_ROWS_APART"  # "0": a short block takes one call per op (to measure the cost)
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


def dense_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear one row at a time: x [..., K] -> [..., N], each row as a one-token step makes it."""
    return apart(F.linear, x, weight, bias)


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
    """While active (this thread), float `F.linear` calls and the elementwise functions
    above, over up to MAX_ROWWISE rows, run one row at a time (`apart`); every other
    call runs as it would."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.pop("input")
            if _short(x):
                return apart(F.linear, x, *args[1:], **kwargs)
        elif func in _ELEMENTWISE and args and _short(args[0]):
            if kwargs.get("inplace"):  # F.silu(x, inplace=True)
                return args[0].copy_(apart(func, *args, **{**kwargs, "inplace": False}))
            return apart(func, *args, **kwargs)
        return func(*args, **kwargs)


def _short(x: Any) -> bool:
    """A float tensor of 1..MAX_ROWWISE rows (its last dimension is a row)."""
    return (
        isinstance(x, Tensor)
        and x.is_floating_point()
        and x.dim() >= 1
        and x.shape[-1] > 0
        and 0 < x.numel() // x.shape[-1] <= MAX_ROWWISE
    )


def enabled() -> bool:
    """Whether a short block may run its calls row by row (SPECCHAT_ROWS_APART=0 says no)."""
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True, slots=True)
class Exactness:
    """What a runner guarantees about greedy speculative output, and why."""

    identical: bool  # greedy spec == plain token for token, by design
    rows_apart: bool  # a short block's float projections and elementwise functions, row by row
    reason: str  # one sentence for the session's notes and `specchat ab`'s report

    def __str__(self) -> str:
        return self.reason


TIES = "exact in distribution, equal to plain up to floating-point ties"


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
    device = _device(model)
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    if arch not in CHECKED:
        blockers.insert(0, f"{arch} models are not checked op by op for row invariance")
    if getattr(config, "hidden_size", 0) >= _SERIAL_REDUCTION:
        blockers.append("a norm's row is too long to be reduced in one order")
    if device.type != "cpu":
        blockers.insert(0, f"on {device.type} the GEMM kernels are chosen by the number of rows")
    if getattr(config, "_attn_implementation", None) != NAME:
        blockers.insert(0, "attention is not scored row by row (engine/attention.py)")
    if blockers:
        return Exactness(False, False, f"{TIES}: {blockers[0]}")
    if not enabled():
        return Exactness(False, False, f"{TIES}: a verify block takes one call per op ({ENV}=0)")
    how = ["attention, silu and the rotary tables take each row of a verify block alone"]
    if dense:
        dtypes = "/".join(sorted(dense))
        how.append(
            f"so do the {dtypes} projections, as a one-token step runs them (each row reads "
            "their weights again)"
        )
    if kernels:
        how.append(f"the {'/'.join(sorted(kernels))} kernels compute each row from its own row")
    return Exactness(
        True,
        True,
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
