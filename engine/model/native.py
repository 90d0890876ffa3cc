"""Native CPU kernels: C++ sources under csrc/, compiled on first use.

torch's own extension builder compiles them with the machine's C++ compiler
(gcc or clang, with ninja) into the cache folder, keyed by a hash of the
source, the compiler flags, the torch version and the architecture, so a
build happens once per machine and source; later processes load the built library in milliseconds.
The kernels register with torch (`torch.ops.specchat.w4a8_linear`,
`torch.classes.specchat.Decoder`): no Python module,
no pybind11, and parallel loops run on torch's own thread pool.

The w4a8 kernel has three paths, AVX2, AVX512-VNNI and AMX, that give the same
bits; loading it picks the best the CPU has (`w4a8_choice`; AMX only where the
operating system also grants the process the tile state), $SPECCHAT_W4A8
overrides, and `w4a8_describe` says which runs (Ready's notes, bench reports).

A machine that cannot build them (no compiler; w4a8 also needs x86 with
AVX2, FMA and F16C, read from the CPU by engine/model/cpu.py) gets a
`QuantizationError` that says why and what to use instead.
Nothing here is required: the other quantization modes need no kernel of
ours, and without the decoder kernel decoding runs through transformers'
modules (engine/model/decoder.py), slower but with the same results.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import QuantizationError
from ..paths import kernels_dir
from . import cpu

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = {"w4a8": _CSRC / "w4a8.cpp", "decoder": _CSRC / "decoder.cpp"}
KERNELS = tuple(_SOURCES)
_FLAGS = {
    "w4a8": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"],
    # Any x86-64 or ARM CPU (its x86 kernels pick their instructions at run time); no
    # product fused into a sum, so its own loops give ATen's elementwise values.
    "decoder": ["-O2", "-ffp-contract=off", "-DNDEBUG"],
}
_NEEDS_AVX2 = {"w4a8"}
# The w4a8 kernel's paths, by the instruction sets each needs (the same bits from either).
W4A8_PATHS = {"avx2": 0, "avx512vnni": 1, "amx": 2}
W4A8_NAMES = {"avx2": "AVX2", "avx512vnni": "AVX512-VNNI", "amx": "AMX"}
W4A8_ENV = "SPECCHAT_W4A8"  # auto (default), avx2, avx512vnni or amx
# A prompt's rows (`prompt_rows`): "auto" (the default) takes them to bfloat16 tiles where
# the AMX path runs and the CPU has AMX-BF16; "steps" keeps them on a step's bits.
W4A8_PROMPT_ENV = "SPECCHAT_W4A8_PROMPT"
# From how many rows a prompt's call takes the bfloat16 tiles. Below, the weights' one
# conversion a call costs more than the int8 tiles' float steps save: the 1.5B's projections
# over 16 / 32 / 64 / 141 / 512 rows took 0.6 / 0.97 / 1.2 / 1.6 / 1.9 times the int8
# code's time, and a 40-token prompt's whole pass was alike either way (Intel Xeon with
# AMX, 2 threads: docs/performance.md, step 43).
W4A8_PROMPT_MIN_ROWS = 48
_w4a8_path: dict[str, str] = {}  # "path" and "why", once the kernel is loaded
# The fewest rows the VNNI code takes on several threads, and why where not the default.
_w4a8_rows: dict[str, int | str] = {}
_lock = threading.Lock()
_built: dict[str, str] = {}  # kernel -> library path, once loaded in this process
_failed: dict[str, QuantizationError] = {}  # kernel -> why its build failed in this process


def build_flags(kernel: str) -> list[str]:
    """The compiler flags `kernel` is built with (the packed cache keys on the w4a8 kernel's)."""
    return list(_FLAGS[kernel])


def cpu_supports(kernel: str, have: cpu.CpuFeatures | None = None) -> str | None:
    """Why this CPU (or one that has `have`) cannot run `kernel`, or None when it can.

    Decided from the instruction sets the CPU reports (engine/model/cpu.py), not from
    torch's dispatch level, which ATEN_CPU_CAPABILITY can lower.
    """
    if kernel not in _NEEDS_AVX2:
        return None
    have = have or cpu.features()
    if not have.x86:
        return f"the {kernel} kernel is for x86-64 CPUs; this is {have.machine}"
    if not have.avx2:
        lacking = [f for f in ("avx2", "fma3", "f16c") if not have.has(f)]
        return f"the {kernel} kernel needs AVX2, FMA and F16C; this CPU lacks {', '.join(lacking)}"
    return None


def w4a8_choice(requested: str = "auto", have: cpu.CpuFeatures | None = None) -> tuple[str, str]:
    """The w4a8 path for this CPU (or one that has `have`) and why: AMX where the CPU has
    AMX-INT8 (and AVX512-VNNI, which every such CPU has), else AVX512-VNNI where it has that
    with AVX-512 F, BW and VL, else AVX2. Raises QuantizationError for a path the CPU cannot
    run or a name that is none. (Whether the operating system grants AMX's tile state is
    only known once the kernel asks: `_set_w4a8`.)"""
    have = have or cpu.features()
    vnni = have.x86 and have.has("avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni")
    amx = vnni and have.has("amx_tile", "amx_int8")
    want = requested.strip().lower() or "auto"
    if want == "auto":
        if amx:
            return "amx", "this CPU has AMX-INT8"
        if vnni:
            return "avx512vnni", "this CPU has AVX512-VNNI"
        return "avx2", "this CPU has no AVX512-VNNI"
    if want not in W4A8_PATHS:
        raise QuantizationError(
            f"{W4A8_ENV}={requested!r} names no w4a8 path",
            hint=f"use auto, {', '.join(W4A8_PATHS)}",
        )
    if want == "avx512vnni" and not vnni:
        raise QuantizationError(
            f"{W4A8_ENV}=avx512vnni: this CPU has no AVX512-VNNI ({have.summary()})",
            hint=f"unset {W4A8_ENV} (auto) or set it to avx2",
        )
    if want == "amx" and not amx:
        raise QuantizationError(
            f"{W4A8_ENV}=amx: this CPU has no AMX-INT8 ({have.summary()})",
            hint=f"unset {W4A8_ENV} (auto) or set it to " + ("avx512vnni" if vnni else "avx2"),
        )
    return want, f"{W4A8_ENV}={want}"


# One row takes the AVX2 code, same bits (w4a8.cpp): the VNNI code is 8% slower there for
# the 0.5B on Zen 5 (docs/performance.md, step 23) and within 2% on Zen 4 (step 22), but an
# AMX Xeon's one-row steps are 3-8% faster on it (step 42). From two rows up the VNNI code
# wins on Zen 5 (2-3-row verify blocks of the 1.5B ~10% faster: step 23), but not on Zen 4,
# whose 512-bit instructions take two passes: there a 2-row block costs 1.16 steps against
# the AVX2 code's 1.10, and 3 rows tie (step 34). So a session's load times one-row steps
# and 2-row passes both ways (decode/costs.py `choose_vnni_rows`) and moves them to the code
# that is clearly faster (`w4a8_set_vnni_min_rows`). A call on one
# thread keeps 2-3 rows on the AVX2 code: on a Zen 5 a 2-row block of the 1.5B costs 1.18
# steps there against 1.48 (step 24).
W4A8_VNNI_MIN_ROWS = 2
W4A8_VNNI_MIN_ROWS_ONE_THREAD = 4
# On the AMX path, calls of fewer rows than this take the VNNI code (same bits). A tile
# product serves 16 rows at once, but each block's int32 sums leave the tiles through
# memory before their float steps, and that trip sets a floor: a one-row step of the 1.5B
# costs 61 against 59 ms, 3 rows tie (1.08 / 1.09 steps), and from 5 rows AMX wins
# (verify 5: 1.18 / 1.22, 7: 1.28 / 1.42, 9: 1.40 / 1.68; a 44-row prompt 4.89 / 5.77).
# Intel Xeon with AMX, 2 threads, scripts/step_cost.py (docs/performance.md, step 30).
W4A8_AMX_MIN_ROWS = 4


def w4a8_use(
    requested: str = "auto",
    vnni_min_rows: int = W4A8_VNNI_MIN_ROWS,
    vnni_min_rows_one_thread: int = W4A8_VNNI_MIN_ROWS_ONE_THREAD,
    amx_min_rows: int = W4A8_AMX_MIN_ROWS,
) -> str:
    """Load the w4a8 kernel and make every later call take `requested`'s path; returns it.
    On the VNNI and AMX paths calls of fewer than `vnni_min_rows` rows run the AVX2 code
    (fewer than `vnni_min_rows_one_thread` on one thread); on the AMX path calls of fewer
    than `amx_min_rows` run the VNNI code by those rules. (Loading takes $SPECCHAT_W4A8's
    path, auto where unset; tests call this to compare.)"""
    load("w4a8")
    with _lock:
        return _set_w4a8(requested, vnni_min_rows, vnni_min_rows_one_thread, amx_min_rows)


def _set_w4a8(
    requested: str,
    vnni_min_rows: int = W4A8_VNNI_MIN_ROWS,
    vnni_min_rows_one_thread: int = W4A8_VNNI_MIN_ROWS_ONE_THREAD,
    amx_min_rows: int = W4A8_AMX_MIN_ROWS,
) -> str:
    path, why = w4a8_choice(requested)
    if path == "amx" and not _amx_granted():
        # Linux hands AMX's tile state only to a process that asks; a kernel (or a VM)
        # that refuses leaves the VNNI code, which gives the same bits.
        refused = "the operating system did not grant this process AMX's tile state"
        if requested.strip().lower() not in ("", "auto"):
            raise QuantizationError(
                f"{W4A8_ENV}=amx: {refused}", hint=f"unset {W4A8_ENV} (auto) or set it to avx512vnni"
            )
        path, why = "avx512vnni", f"this CPU has AMX-INT8, but {refused}"
    prompt, prompt_why = _prompt_choice(path)
    torch.ops.specchat.w4a8_set_path(
        W4A8_PATHS[path], vnni_min_rows, vnni_min_rows_one_thread, amx_min_rows
    )
    torch.ops.specchat.w4a8_set_prompt_rows(W4A8_PROMPT_MIN_ROWS if prompt else 0)
    asked = requested.strip().lower() or "auto"
    _w4a8_path.update(path=path, why=why, requested=asked, prompt=prompt, prompt_why=prompt_why)
    _w4a8_rows.update(vnni=vnni_min_rows, one=vnni_min_rows_one_thread, why="")
    return path


def _prompt_choice(path: str) -> tuple[str, str]:
    """Whether a prompt's rows take bfloat16 tiles ("bf16", else "") on `path`, and why."""
    asked = os.environ.get(W4A8_PROMPT_ENV, "auto").strip().lower() or "auto"
    if asked not in ("auto", "steps"):
        raise QuantizationError(
            f"{W4A8_PROMPT_ENV}={asked!r} names no way to read a prompt", hint="use auto or steps"
        )
    if asked == "steps":
        return "", f"{W4A8_PROMPT_ENV}=steps"
    if path != "amx":
        return "", "the bfloat16 tiles are the AMX path's"
    if not torch.ops.specchat.w4a8_amx_bf16_permitted():
        return "", "this CPU has no AMX-BF16 (with AVX512-BF16 and VBMI)"
    return "bf16", "this CPU has AMX-BF16"


@contextlib.contextmanager
def prompt_rows(on: bool = True) -> Iterator[None]:
    """Inside (when `on`), w4a8 calls of W4A8_PROMPT_MIN_ROWS rows or more from this thread
    may take the prompt's code: where the AMX path runs on a CPU with AMX-BF16, each call
    brings its weights to bfloat16 once and multiplies every row in bfloat16 tiles, summed
    in float32 (the 1.5B's 141-token prompt 1.45x faster, 500 tokens 1.9x). Those rows get
    other bits than a step's (closer to float32 than the int8 code's, which rounds each
    32 values of a row to int8), so only what needs no step's bits goes inside: the
    conversation's new tokens before a turn's first step, which plain and speculative
    turns read alike, and a draft's reads. $SPECCHAT_W4A8_PROMPT=steps keeps them on a
    step's bits, so that a conversation read again from its text continues bit for bit
    as it did live."""
    if not on or not _w4a8_path.get("prompt"):
        yield
        return
    before = torch.ops.specchat.w4a8_set_prompt(True)
    try:
        yield
    finally:
        torch.ops.specchat.w4a8_set_prompt(before)


def w4a8_auto() -> bool:
    """Whether the kernel's path was chosen from this CPU (nothing named one), so a load may
    also choose from which rows its calls take the VNNI code (decode/costs.py)."""
    return _w4a8_path.get("requested") == "auto"


def w4a8_vnni_rows() -> tuple[int, str]:
    """The fewest rows a call on several threads takes the VNNI code from, and why (what a
    load measured), to put back with `w4a8_set_vnni_min_rows`."""
    return int(_w4a8_rows.get("vnni", W4A8_VNNI_MIN_ROWS)), str(_w4a8_rows.get("why", ""))


def w4a8_set_vnni_min_rows(rows: int, why: str = "") -> None:
    """Calls of fewer than `rows` rows on several threads run the AVX2 code from now on
    (the same bits), on the path the kernel runs; `why` is said in `w4a8_describe`."""
    load("w4a8")
    with _lock:
        path = _w4a8_path["path"]
        one = max(rows, int(_w4a8_rows.get("one", W4A8_VNNI_MIN_ROWS_ONE_THREAD)))
        torch.ops.specchat.w4a8_set_path(W4A8_PATHS[path], rows, one, W4A8_AMX_MIN_ROWS)
        _w4a8_rows.update(vnni=rows, why=why)


@contextlib.contextmanager
def small_ops_on_one_thread(on: bool = True) -> Iterator[None]:
    """Inside (when `on`), torch's own operations run on one thread and w4a8 calls from
    this thread on as many as torch had: its helpers need no wake, where each of torch's
    parallel operations wakes a sleeping OpenMP worker (OMP_WAIT_POLICY=PASSIVE), ~100 us
    on a 2-core VM, against 17 us for a product of 50 x 896 values on one thread
    (docs/performance.md, step 39). Both counts are put back after. For blocks of a model
    whose every projection is the w4a8 kernel's (engine/model/runner.py decides)."""
    threads = torch.get_num_threads()
    if not on or threads == 1:
        yield
        return
    load("w4a8")
    before = torch.ops.specchat.w4a8_set_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.ops.specchat.w4a8_set_threads(before)


def _amx_granted() -> bool:
    """Whether the loaded kernel may use AMX tiles here (it asks the OS once)."""
    return bool(torch.ops.specchat.w4a8_amx_permitted())


def w4a8_default() -> str:
    """The path asked for where nothing names one: $SPECCHAT_W4A8, else auto."""
    return os.environ.get(W4A8_ENV, "auto")


def w4a8_path() -> str | None:
    """The w4a8 path calls take now ("avx2", "avx512vnni" or "amx"), None before the kernel loads."""
    return _w4a8_path.get("path")


def w4a8_describe() -> str | None:
    """One line for Ready and reports: which path the w4a8 kernel runs and why."""
    if "path" not in _w4a8_path:
        return None
    path = _w4a8_path["path"]
    least, one, chosen = _w4a8_rows["vnni"], _w4a8_rows["one"], _w4a8_rows["why"]
    vnni = f"{least}+ rows ({one}+ on one thread{'; ' + str(chosen) if chosen else ''})"
    rows = {
        "avx2": "",
        "avx512vnni": f" for blocks of {vnni}",
        "amx": f" for blocks of {W4A8_AMX_MIN_ROWS}+ rows, AVX512-VNNI below from {vnni}",
    }[path]
    paths = "|".join(W4A8_PATHS)
    prompt = (
        f"; prompts of {W4A8_PROMPT_MIN_ROWS}+ rows in bfloat16 tiles ({_w4a8_path['prompt_why']}; "
        f"{W4A8_PROMPT_ENV}=steps keeps a step's bits)"
        if _w4a8_path.get("prompt")
        else ""
    )
    return (
        f"w4a8 kernel: {W4A8_NAMES[path]} path{rows} ({_w4a8_path['why']}; {W4A8_ENV}={paths}|auto)"
        + prompt
    )


def unavailable(kernel: str) -> str | None:
    """Why `kernel` cannot be used here (CPU, compiler, build), or None once it is loaded.

    Builds it if need be (once per machine); a build that failed is not tried again in
    this process.
    """
    try:
        load(kernel)
    except QuantizationError as exc:
        return exc.message
    return None


def _others() -> str:
    """The CPU modes that need no kernel of ours and run on this machine."""
    return "int8 or int4" if cpu.fbgemm_unavailable() else "w8a8 or int8"


def build_dir(kernel: str) -> Path:
    """Where `kernel` is built: one folder per source, flags, torch version and architecture."""
    key = hashlib.sha256(_SOURCES[kernel].read_bytes())
    key.update(" ".join(_FLAGS[kernel]).encode())
    key.update(torch.__version__.encode())
    key.update(platform.machine().encode())  # a cache folder shared by x86 and ARM machines
    return kernels_dir() / f"{kernel}-{key.hexdigest()[:16]}"


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


def _compiler() -> str:
    """The C++ compiler command torch's builder calls: $CXX (may be "ccache g++"), else c++."""
    return os.environ.get("CXX", "").strip() or "c++"


def _build_error(exc: BaseException) -> str:
    """The line of a failed build that says what went wrong (the compiler's own error where
    there is one, not ninja's closing "build stopped")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():  # gcc's and clang's "error:", "fatal error:"
            return line
    for line in lines:
        if "not found" in line or "No such file" in line:
            return line
    return lines[-1] if lines else type(exc).__name__


def load(kernel: str) -> None:
    """Compile (once per machine) and load `kernel`; raise QuantizationError if it cannot be."""
    with _lock:
        if kernel in _built:
            return
        if kernel in _failed:  # the same answer, without a second build
            raise QuantizationError(_failed[kernel].message, hint=_failed[kernel].hint)
        reason = cpu_supports(kernel)
        if reason:
            raise QuantizationError(reason, hint=f"use {_others()}")
        hint = (
            "it needs a C++ compiler (gcc or clang) and ninja"
            + (f"; or use {_others()}, which need neither" if kernel == "w4a8" else "")
            + ". SPECCHAT_VERBOSE_BUILD=1 shows the compiler's output"
        )
        if not is_built(kernel) and shutil.which(_compiler().split()[0]) is None:
            error = QuantizationError(
                f"could not build the {kernel} kernel: no C++ compiler "
                f"({_compiler()!r} is not on PATH; $CXX names another)",
                hint=hint,
            )
            _failed[kernel] = error
            raise error
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
            error = QuantizationError(
                f"could not build the {kernel} kernel: {_build_error(exc)}", hint=hint
            )
            _failed[kernel] = error
            raise error from exc
        if kernel == "w4a8":  # its path, from this CPU or $SPECCHAT_W4A8 (w4a8_describe says)
            try:
                _set_w4a8(w4a8_default())
            except QuantizationError as error:  # a path this CPU lacks, or no path's name
                _failed[kernel] = error
                raise
        _built[kernel] = str(library)
