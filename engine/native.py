"""Native CPU kernels: C++ sources under csrc/, compiled on first use.

torch's own extension builder compiles them with the machine's C++ compiler
(gcc or clang, with ninja) into the cache folder, keyed by a hash of the
source, the compiler flags and the torch version, so a build happens once per
machine and source; later processes load the built library in milliseconds.
The kernels register with torch (`torch.ops.specchat.w4a8_linear`,
`torch.classes.specchat.Decoder`): no Python module,
no pybind11, and parallel loops run on torch's own thread pool.

A machine that cannot build them (no compiler; w4a8 also needs x86 with
AVX2) gets a `QuantizationError` that says why and what to use instead.
Nothing here is required: the other quantization modes need no kernel of
ours, and without the decoder kernel decoding runs through transformers'
modules (engine/decoder.py), slower but with the same results.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from .errors import QuantizationError

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = {"w4a8": _CSRC / "w4a8.cpp", "decoder": _CSRC / "decoder.cpp"}
KERNELS = tuple(_SOURCES)
_FLAGS = {
    "w4a8": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"],
    "decoder": ["-O2", "-DNDEBUG"],  # only calls ATen: any x86-64 or ARM CPU
}
_NEEDS_AVX2 = {"w4a8"}
_lock = threading.Lock()
_built: dict[str, str] = {}  # kernel -> library path, once loaded in this process


def cpu_supports(kernel: str) -> str | None:
    """Why this CPU cannot run `kernel`, or None when it can."""
    if kernel not in _NEEDS_AVX2:
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the {kernel} kernel is for x86-64 CPUs; this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX"):  # "AVX2", "AVX512"; "DEFAULT" means neither
        return f"the {kernel} kernel needs AVX2; torch reports this CPU as {capability}"
    return None


def build_dir(kernel: str) -> Path:
    """Where `kernel` is built: one folder per source, flags and torch version."""
    from .fetch import cache_root

    key = hashlib.sha256(_SOURCES[kernel].read_bytes())
    key.update(" ".join(_FLAGS[kernel]).encode())
    key.update(torch.__version__.encode())
    return cache_root() / "kernels" / f"{kernel}-{key.hexdigest()[:16]}"


def is_built(kernel: str) -> bool:
    """Whether `kernel` is loaded here or its library is already on disk (no compile needed)."""
    return kernel in _built or (build_dir(kernel) / f"specchat_{kernel}.so").exists()


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja wheel's binary is not on it outside a venv."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return  # the build fails with torch's own message, which says ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load(kernel: str) -> None:
    """Compile (once per machine) and load `kernel`; raise QuantizationError if it cannot be."""
    with _lock:
        if kernel in _built:
            return
        reason = cpu_supports(kernel)
        if reason:
            raise QuantizationError(reason, hint="use w8a8 or int8")
        _put_ninja_on_path()
        folder = build_dir(kernel)
        folder.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        try:
            library = cpp_extension.load(
                name=f"specchat_{kernel}",
                sources=[str(_SOURCES[kernel])],
                extra_cflags=_FLAGS[kernel],
                extra_ldflags=["-fopenmp"] if "-fopenmp" in _FLAGS[kernel] else [],
                build_directory=str(folder),
                is_python_module=False,
                verbose=bool(os.environ.get("SPECCHAT_VERBOSE_BUILD")),
            )
        except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, bad build
            raise QuantizationError(
                f"could not build the {kernel} kernel: {str(exc).strip().splitlines()[-1]}",
                hint="it needs a C++ compiler (gcc or clang) and ninja"
                + ("; or use w8a8 or int8, which need neither" if kernel == "w4a8" else "")
                + ". SPECCHAT_VERBOSE_BUILD=1 shows the compiler's output",
            ) from exc
        _built[kernel] = str(library)
