"""Load a safetensors checkpoint into a post-load quantized model, one piece at a time.

transformers' `from_pretrained` holds every weight in the load dtype before specchat
quantizes the model: a 7B target in float32 is 30 GB, more than a 24 GiB machine
has, for weights that end at 0.625 bytes each in w4a8. Here the model is made on
the meta device, and each piece (the embedding, every decoder layer, the final norm,
the LM head) is read from the files and quantized before the next is read: at most
one piece's float weights are alive beside the quantized model.

The result equals `from_pretrained(dtype) + quant.apply(mode)` bit for bit: the same
float values (a checkpoint's bf16 widened to float32 exactly) go through the same
quantization. Llama-style decoders (Llama, Qwen2) on the CPU take this path, from
a folder of .safetensors files or from one .gguf file (gguf_file.py dequantizes its
tensors one at a time); `unstreamable` says why another model does not, and the
loader then uses `from_pretrained`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from ..config import QuantMode
from ..model import quant

STREAMED_ARCHITECTURES = ("llama", "qwen2")
POST_LOAD = (QuantMode.INT8, QuantMode.INT4, QuantMode.W8A8, QuantMode.W4A8, QuantMode.W4A8_G128)

Progress = Callable[[int, int], None]  # (pieces done, pieces in all)


def unstreamable(
    pretrained: str, gguf_file: str | None, config: Any, mode: QuantMode, device: torch.device
) -> str | None:
    """Why the model cannot be loaded piece by piece (None: it can)."""
    if mode not in POST_LOAD:
        return f"{mode} quantizes inside from_pretrained" if mode is not QuantMode.NONE else "no quantization"
    if device.type != "cpu":
        return f"post-load quantization runs on the CPU, not {device.type}"
    if getattr(config, "model_type", None) not in STREAMED_ARCHITECTURES:
        return f"no piece-by-piece load for {getattr(config, 'model_type', '?')} models"
    folder = Path(pretrained)
    if gguf_file:
        return None if (folder / gguf_file).is_file() else f"no file {folder / gguf_file}"
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return "not a local folder of .safetensors files"
    return None


class _Checkpoint:
    """Tensors of a folder's .safetensors files by name, read one at a time."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Any] = {}
        self._where: dict[str, tuple[int, int]] = {}  # name -> (file number, byte offset)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            paths = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            paths = sorted(folder.glob("*.safetensors"))
        for number, path in enumerate(paths):
            handle = safe_open(str(path), "pt")
            for name, offset in _offsets(path).items():
                self._files[name] = handle
                self._where[name] = (number, offset)

    def position(self, names: list[str]) -> tuple[int, int]:
        """Where the first of `names` lies in the files: pieces read in this order read
        the files front to back (a cold disk serves that ~6x faster than jumps)."""
        return min((self._where[n] for n in names if n in self._where), default=(1 << 30, 0))

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"the checkpoint has no tensor {name}")
        tensor: torch.Tensor = self._files[name].get_tensor(name)
        return tensor


def read_tensor(folder: Path | str, name: str) -> torch.Tensor:
    """One tensor of a model folder's safetensors files, as stored (KeyError if absent)."""
    return _Checkpoint(Path(folder)).get(name)


def _offsets(path: Path) -> dict[str, int]:
    """Each tensor's byte offset in a .safetensors file, from its header."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


@torch.no_grad()
def _fill(module: nn.Module, prefix: str, checkpoint: _Checkpoint, dtype: torch.dtype) -> None:
    """Allocate a meta-device module on the CPU and copy its parameters from the checkpoint."""
    module.to_empty(device="cpu")
    for name, param in module.named_parameters():
        param.copy_(checkpoint.get(f"{prefix}.{name}").to(dtype))


@torch.no_grad()
def load_streamed(
    folder: Path,
    config: Any,
    mode: QuantMode,
    dtype: torch.dtype,
    progress: Progress | None = None,
    gguf_file: str | None = None,
    shortlist: torch.Tensor | None = None,
) -> tuple[PreTrainedModel, int]:
    """The model in `folder` (or its `gguf_file`), quantized with `mode` piece by piece (see
    the module docstring), and its parameter count before packing; with `shortlist`, its
    head scores only those ids (model/draft_head.py), cut before it is packed. Raises
    KeyError for a tensor it cannot find."""
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config)
    checkpoint: Any
    if gguf_file:
        from .gguf_file import GgufCheckpoint

        checkpoint = GgufCheckpoint(folder / gguf_file, model, config)
    else:
        checkpoint = _Checkpoint(folder)
    model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    inner = model.model
    pieces: list[tuple[str, nn.Module]] = [("model.embed_tokens", inner.embed_tokens)]
    pieces += [(f"model.layers.{i}", layer) for i, layer in enumerate(inner.layers)]
    pieces.append(("model.norm", inner.norm))
    pieces.sort(
        key=lambda piece: checkpoint.position([f"{piece[0]}.{n}" for n, _ in piece[1].named_parameters()])
    )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for done, (prefix, module) in enumerate(pieces, 1):
        _fill(module, prefix, checkpoint, dtype)
        if prefix.startswith("model.layers."):
            quant.apply(module, mode, lm_head=False)  # a layer has no LM head
        if progress is not None:
            progress(done, len(pieces) + 1)
    # Rotary frequencies are computed, not stored: made afresh on the CPU.
    inner.rotary_emb = type(inner.rotary_emb)(config=config)
    if tied:
        model.lm_head.weight = inner.embed_tokens.weight
    else:
        _fill(model.lm_head, "lm_head", checkpoint, dtype)
    if shortlist is not None:
        from ..model.draft_head import apply_shortlist

        apply_shortlist(model, shortlist)
    quant.apply(model, mode)  # what is left as nn.Linear: the LM head, as from_pretrained's
    if progress is not None:
        progress(len(pieces) + 1, len(pieces) + 1)
    if not gguf_file and (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise KeyError(f"nothing in the checkpoint fills {left[0]}")
    model.eval()
    return model, params
