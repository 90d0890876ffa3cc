"""A .gguf file's tensors one at a time, under their transformers names, dequantized.

transformers' GGUF loader dequantizes every tensor of the file to float32 before the
model is built: a 7B Q4_K_M file (4.4 GB) becomes 30 GB, more than a 24 GiB machine
has. Here the file is memory-mapped (gguf's reader), and a tensor is dequantized only
when the streamed loader asks for it, with the same pieces transformers uses: gguf's
`dequantize`, the name map from gguf's tensor-name tables to the model's parameters,
and the architecture's tensor processor (Llama's q/k rows are permuted back).
So the float weights a piece gets are exactly those transformers' whole load gives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


class GgufCheckpoint:
    """The `stream._Checkpoint` interface over one .gguf file, for `model`'s parameter names."""

    def __init__(self, path: Path, model: nn.Module, config: Any) -> None:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self._reader = GGUFReader(str(path))  # memory-mapped: nothing is read yet
        architecture = str(read_field(self._reader, "general.architecture")[0])
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        self._mapping: dict[str, str] = get_gguf_hf_weights_map(model, self._processor)
        self._tensors = {}
        for tensor in self._reader.tensors:
            name = self._mapping.get(tensor.name)
            if name is not None:
                self._tensors[name] = tensor

    def position(self, names: list[str]) -> tuple[int, int]:
        """Where the first of `names` lies in the file (pieces are read front to back)."""
        offsets = [int(self._tensors[n].data_offset) for n in names if n in self._tensors]
        return (0, min(offsets)) if offsets else (1 << 30, 0)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def quant_types(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds (for the load's report)."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    def get(self, name: str) -> torch.Tensor:
        """The parameter `name`, float32 (as gguf dequantizes every type)."""
        from gguf import dequantize

        if name not in self._tensors:
            raise KeyError(f"the GGUF file has no tensor for {name}")
        tensor = self._tensors[name]
        weights = _dequantized(tensor, dequantize)
        result = self._processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=self._mapping, parsed_parameters={}
        )
        # copied only where it is a view of the read-only mapped file (F32 tensors): a
        # dequantized array is already the process's own
        return torch.from_numpy(np.require(result.weights, np.float32, ["C", "W"]))


CHUNK_VALUES = 1 << 22  # values dequantized at a time: gguf's block functions' intermediates stay small


def _dequantized(tensor: Any, dequantize: Any) -> np.ndarray:
    """gguf's dequantization of `tensor`, a few million values at a time.

    `gguf.dequantize` walks a tensor 16 rows at a time, each slice a memmap object:
    on a 7B file most of its time went to that walk (8 s of 23 s on four 7B layers),
    not to the arithmetic. Here the same per-type block functions (`dequantize_rows`
    of gguf.quants' Q4_K, Q6_K, ...) run over chunks of CHUNK_VALUES on a plain view of
    the mapped bytes: each value is computed by the same operations, so the result is
    the same array.
    """
    from gguf import quants

    kind = getattr(quants, tensor.tensor_type.name, None)
    raw = np.asarray(tensor.data)  # a plain ndarray over the mapped bytes (no copy)
    if kind is None or not hasattr(kind, "dequantize_rows") or raw.ndim != 2:
        return np.asarray(dequantize(tensor.data, tensor.tensor_type))
    values_per_row = int(np.prod(tensor.shape)) // raw.shape[0]
    step = max(1, CHUNK_VALUES // values_per_row)
    out = np.empty((raw.shape[0], values_per_row), np.float32)
    for start in range(0, raw.shape[0], step):
        out[start : start + step] = kind.dequantize_rows(raw[start : start + step])
    return out
