"""What this CPU can do, read once: the one source the kernels' choices and the tests share.

The CPU-bound quantization paths each hang on an instruction set:

- specchat's w4a8 kernel (csrc/w4a8.cpp) is compiled with AVX2, FMA and F16C;
- fbgemm (w8a8) needs AVX2, and on AVX512-VNNI it accumulates u8 x s8 products
  in int32 (vpdpbusd) instead of AVX2's saturating int16 pair sums (vpmaddubsw);
- bitsandbytes repacks 4-bit weights for its own kernel on AVX512-BF16 CPUs.

`features()` answers from torch's cpuinfo (`torch.cpu.get_capabilities`, the
library fbgemm and oneDNN ask too), else from the flags Linux lists in
/proc/cpuinfo, else from torch's dispatch level. Nothing here guesses from a
CPU's name.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})

# Linux's /proc/cpuinfo flag -> the name cpuinfo (torch.cpu.get_capabilities) uses.
_LINUX_NAMES = {"fma": "fma3", "pni": "sse3", "sse4_1": "sse4_1", "sse4_2": "sse4_2"}
# What torch's dispatch level implies, where nothing better can be read.
_FROM_CAPABILITY = {
    "AVX2": ("avx", "avx2", "fma3", "f16c"),
    "AVX512": ("avx", "avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"),
}


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The machine's architecture and instruction-set flags, named as cpuinfo names them
    (`avx2`, `fma3`, `f16c`, `avx512_f`, `avx512_vnni`, `avx_vnni`, `avx512_bf16`,
    `amx_tile`, `amx_int8`, `amx_bf16`, ...)."""

    machine: str  # platform.machine(), lower case: "x86_64", "aarch64", "arm64"
    flags: frozenset[str]
    source: str  # where the flags were read

    @property
    def x86(self) -> bool:
        return self.machine in X86

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def avx2(self) -> bool:
        """AVX2 with FMA and F16C: what the w4a8 kernel is compiled for."""
        return self.x86 and self.has("avx2", "fma3", "f16c")

    @property
    def avx512_vnni(self) -> bool:
        return self.x86 and self.has("avx512_vnni")

    @property
    def avx512_bf16(self) -> bool:
        return self.x86 and self.has("avx512_bf16")

    @property
    def amx(self) -> bool:
        return self.x86 and self.has("amx_tile")

    def summary(self) -> str:
        """One line for logs, reports and skip reasons, e.g.
        'x86_64: AVX2, AVX-512, AVX512-VNNI; no AVX512-BF16, no AMX'."""
        if not self.x86:
            return f"{self.machine} (not x86: no AVX kernels)"
        named = (
            ("AVX2", self.avx2),
            ("AVX-512", self.has("avx512_f", "avx512_bw", "avx512_vl")),
            ("AVX512-VNNI", self.avx512_vnni),
            ("AVX-VNNI", self.has("avx_vnni")),
            ("AVX512-BF16", self.avx512_bf16),
            ("AMX", self.amx),
        )
        have = [n for n, ok in named if ok]
        lack = [f"no {n}" for n, ok in named if not ok]
        return (
            f"{self.machine}: "
            + ", ".join(have or ["no AVX2"])
            + ("; " + ", ".join(lack) if lack else "")
        )


def linux_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags (x86) or Features (ARM) in /proc/cpuinfo text, renamed as
    cpuinfo names them: avx512f -> avx512_f, fma -> fma3."""
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(_cpuinfo_name(f) for f in match.group(1).split()) if match else frozenset()


def _cpuinfo_name(flag: str) -> str:
    if flag in _LINUX_NAMES:
        return _LINUX_NAMES[flag]
    # avx512f, avx512bw, avx512vl, ... -> avx512_f; avx512_vnni and avx512_bf16 stay
    return re.sub(r"^avx512(?=[a-z])", "avx512_", flag)


def _torch_flags() -> frozenset[str] | None:
    get = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get is None:  # torch before 2.9
        return None
    try:
        caps = get()
    except (RuntimeError, OSError):
        return None
    return frozenset(name for name, value in caps.items() if value is True)


def detect(
    machine: str | None = None,
    torch_flags: frozenset[str] | None = None,
    cpuinfo: str | None = None,
    capability: str | None = None,
) -> CpuFeatures:
    """Features from the first source that answers; each argument stands for one source."""
    arch = (machine or platform.machine()).lower()
    if torch_flags:
        return CpuFeatures(arch, torch_flags, "torch.cpu.get_capabilities")
    if cpuinfo:
        flags = linux_flags(cpuinfo)
        if flags:
            return CpuFeatures(arch, flags, "/proc/cpuinfo")
    implied = _FROM_CAPABILITY.get(capability or "", ()) if arch in X86 else ()
    return CpuFeatures(arch, frozenset(implied), f"torch's dispatch level {capability}")


@functools.cache
def features() -> CpuFeatures:
    """This machine's features, read once per process."""
    cpuinfo = None
    with contextlib.suppress(OSError):  # not Linux
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    return detect(
        torch_flags=_torch_flags(),
        cpuinfo=cpuinfo,
        capability=torch.backends.cpu.get_cpu_capability(),
    )


def fbgemm_unavailable(cpu: CpuFeatures | None = None) -> str | None:
    """Why fbgemm's int8 GEMM (w8a8) cannot run here, or None when it can.

    It needs a torch built with fbgemm (x86 builds) and, at run time, AVX2:
    on a CPU without it fbgemm refuses every call.
    """
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm (it comes with x86 builds)"
    have = cpu or features()
    if not have.x86 or not have.has("avx2"):
        return f"fbgemm needs an x86 CPU with AVX2; this is {have.summary()}"
    return None
