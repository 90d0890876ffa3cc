"""Quantized models kept in the cache, so a second start skips reading floats and packing.

A post-load CPU mode reads every weight in float and packs it (w4a8: 4-bit codes in the
kernel's layout); for a 7B GGUF that is dequantizing 7.6 G values first. What comes out
depends only on the weights, the mode, the dtype and the code that packs, so it is kept:

    <cache>/packed/<weights sha256[:20]>-<code key>/
        config.json, tokenizer files   the model's, so a GGUF's metadata is not parsed again
        <mode>-<dtype>.pt              the quantized model as torch.save writes it
        entry.json                     what it is, where it came from, its size, when last used

The code key hashes the packing code (quant.py, qlinear.py, the w4a8 kernel's source,
which packs, and its compiler flags, the streamed readers), torch's, transformers' and
gguf's versions and the CPU's features (fbgemm's int8 range depends on them), so an
entry is never read by code that would pack differently: new code makes a new entry and
the old one ages out. The decoder kernel and the kernels' path choice (native.py) pack
nothing, and an edit there no longer re-packs every model (~40 s and ~2.5 GB a change
for the default pair). The file is
torch's pickle of the module tree: it is read back only from specchat's own cache, as
the kernels it builds there are. `$SPECCHAT_PACKED_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import QuantMode

FORMAT = 1
ENV = "SPECCHAT_PACKED_CACHE"
KEEP = 4  # entries kept; the least recently used beyond these are removed
_HERE = Path(__file__).resolve().parent
_CODE = (
    _HERE.parent / "model" / "quant.py",
    _HERE.parent / "model" / "qlinear.py",
    _HERE.parent / "model" / "csrc" / "w4a8.cpp",
    _HERE / "stream.py",
    _HERE / "gguf_file.py",
    Path(__file__).resolve(),
)


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in {"0", "no", "off", "false"}


def code_key() -> str:
    """What decides a packed model's bytes besides its weights, mode and dtype."""
    from importlib.metadata import version

    import transformers

    from ..model import cpu, native

    digest = hashlib.sha256(f"format {FORMAT}\n".encode())
    for path in _CODE:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(native.build_flags("w4a8")).encode() + b"\0")
    versions = f"torch {torch.__version__} transformers {transformers.__version__} gguf {version('gguf')}"
    digest.update(f"{versions}\n{cpu.features().summary()}\n".encode())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Entry:
    """One model's folder in the packed cache."""

    folder: Path
    weights_sha256: str

    def model_file(self, mode: QuantMode, dtype: torch.dtype, variant: str = "") -> Path:
        """The packed model's file; `variant` tells apart models cut differently from the
        same weights (a draft's shortlist head: `v<ids>-<their hash>`)."""
        tail = f"-{variant}" if variant else ""
        return self.folder / f"{mode.value}-{str(dtype).removeprefix('torch.')}{tail}.pt"

    @property
    def has_metadata(self) -> bool:
        """Whether the config and tokenizer were saved here (with the first packed model)."""
        return (self.folder / "config.json").is_file() and (self.folder / "tokenizer_config.json").is_file()

    def touch(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.folder)


def entry(weights_sha256: str | None, cache_dir: Path | str | None = None) -> Entry | None:
    """The cache folder for these weights under this code (None: no weights hash, or off)."""
    if not weights_sha256 or not enabled():
        return None
    return Entry(paths.packed_dir(cache_dir) / f"{weights_sha256[:20]}-{code_key()}", weights_sha256)


def load(where: Entry, mode: QuantMode, dtype: torch.dtype, variant: str = "") -> tuple[Any, int] | None:
    """The packed model saved for `mode` and `dtype` and its parameter count before
    packing, or None (absent or unreadable)."""
    path = where.model_file(mode, dtype, variant)
    if not path.is_file():
        return None
    try:
        params = int(json.loads((where.folder / "entry.json").read_text())["models"][path.name]["params"])
        with warnings.catch_warnings():  # fbgemm's packed params go through TypedStorage
            warnings.simplefilter("ignore", UserWarning)
            model = torch.load(path, weights_only=False)  # our own file: see the module docstring
    except Exception:  # a torn or foreign file: packed again and rewritten
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    where.touch()
    return model, params


def save(
    where: Entry,
    model: Any,
    tokenizer: Any,
    mode: QuantMode,
    dtype: torch.dtype,
    params: int,
    source: str,
    seconds: float,
    variant: str = "",
) -> str | None:
    """Keep `model` packed for the next start; None when saved, else why not (never raises)."""
    path = where.model_file(mode, dtype, variant)
    tmp: Path | None = None
    try:
        where.folder.mkdir(parents=True, exist_ok=True)
        need = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        free = shutil.disk_usage(where.folder).free
        if free < need * 1.2 + (1 << 28):
            return f"only {free / 2**30:.1f} GiB free for {need / 2**30:.1f} GiB of packed weights"
        if not where.has_metadata:
            model.config.save_pretrained(where.folder)
            tokenizer.save_pretrained(where.folder)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.save(model, tmp)
        os.replace(tmp, path)
        facts_path = where.folder / "entry.json"
        try:
            facts = json.loads(facts_path.read_text())
        except (OSError, ValueError):
            facts = {"format": FORMAT, "weights_sha256": where.weights_sha256, "models": {}}
        facts["source"] = source
        facts["models"][path.name] = {
            "bytes": path.stat().st_size,
            "params": params,
            "pack_seconds": round(seconds, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp_facts = facts_path.with_name(f".entry.json.{os.getpid()}.tmp")
        tmp_facts.write_text(json.dumps(facts, indent=2) + "\n")
        os.replace(tmp_facts, facts_path)
    except Exception as exc:  # a full disk or an unpicklable module: the load goes on
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        return f"{type(exc).__name__}: {exc}"
    prune(where.folder.parent, keep=KEEP, protect=where.folder)
    return None


def prune(root: Path, keep: int = KEEP, protect: Path | None = None) -> list[Path]:
    """Remove the least recently used entries beyond `keep`; returns those removed."""
    try:
        folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    removed = []
    for folder in folders[keep:]:
        if folder != protect:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
