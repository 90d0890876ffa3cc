"""CPU features (engine/model/cpu.py): read once, named one way, and the kernels' choices made from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specchat.engine.model import cpu, native

SAPPHIRE_RAPIDS = (
    "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2 avx512f "
    "avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    "processor\t: 1\nflags\t\t: fpu\n"
)
GRAVITON = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"


def test_linux_flags_are_renamed_as_cpuinfo_names_them() -> None:
    flags = cpu.linux_flags(SAPPHIRE_RAPIDS)
    assert {"fma3", "avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni", "avx512_bf16"} <= flags
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx2", "f16c"} <= flags
    assert "fma" not in flags and "avx512f" not in flags
    assert cpu.linux_flags(GRAVITON) == {"fp", "asimd", "evtstrm", "aes", "sve", "bf16", "i8mm"}
    assert cpu.linux_flags("") == frozenset()


def test_each_kind_of_cpu_is_described_by_its_flags() -> None:
    spr = cpu.detect(machine="x86_64", cpuinfo=SAPPHIRE_RAPIDS)
    assert spr.avx2 and spr.avx512_vnni and spr.avx512_bf16 and spr.amx
    assert spr.summary() == "x86_64: AVX2, AVX-512, AVX512-VNNI, AVX512-BF16, AMX; no AVX-VNNI"
    arm = cpu.detect(machine="aarch64", cpuinfo=GRAVITON)
    assert not (arm.x86 or arm.avx2 or arm.avx512_vnni or arm.avx512_bf16 or arm.amx)
    assert "not x86" in arm.summary()
    # a flag of the same name on another architecture means nothing to x86 kernels
    assert not cpu.detect(machine="aarch64", torch_flags=frozenset({"avx2"})).avx2


def test_sources_in_order_torch_then_proc_then_dispatch_level() -> None:
    assert cpu.detect("x86_64", frozenset({"avx2"}), SAPPHIRE_RAPIDS).source.startswith("torch")
    assert cpu.detect("x86_64", None, SAPPHIRE_RAPIDS).source == "/proc/cpuinfo"
    only_level = cpu.detect("x86_64", None, None, "AVX2")
    assert only_level.avx2 and not only_level.avx512_vnni
    assert not cpu.detect("x86_64", None, None, "DEFAULT").avx2


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo (not Linux)")
def test_this_machine_agrees_with_what_linux_lists() -> None:
    """The flags the kernels depend on, read by torch's cpuinfo and listed by the kernel."""
    here = cpu.features()
    listed = cpu.linux_flags(Path("/proc/cpuinfo").read_text())
    if not here.x86 or not listed:
        pytest.skip(f"not an x86 CPU with flags in /proc/cpuinfo: {here.summary()}")
    for flag in ("avx2", "fma3", "f16c", "avx512_f", "avx512_vnni", "avx512_bf16", "amx_tile"):
        assert (flag in here.flags) == (flag in listed), flag
    assert cpu.features() is here  # read once


def test_w4a8_kernel_needs_x86_with_avx2_fma_and_f16c() -> None:
    spr = cpu.detect(machine="x86_64", cpuinfo=SAPPHIRE_RAPIDS)
    assert native.cpu_supports("w4a8", spr) is None
    arm = native.cpu_supports("w4a8", cpu.detect(machine="aarch64", cpuinfo=GRAVITON))
    assert arm == "the w4a8 kernel is for x86-64 CPUs; this is aarch64"
    old = cpu.detect(machine="x86_64", cpuinfo="flags\t: sse4_2 avx\n")
    assert "lacks avx2, fma3, f16c" in str(native.cpu_supports("w4a8", old))
    # the decoder kernel calls ATen only: any CPU with a compiler
    assert native.cpu_supports("decoder", cpu.detect(machine="aarch64", cpuinfo=GRAVITON)) is None


def test_fbgemm_needs_an_x86_build_and_avx2() -> None:
    arm = cpu.detect(machine="aarch64", cpuinfo=GRAVITON)
    assert cpu.fbgemm_unavailable(arm) is not None
    if "fbgemm" in torch.backends.quantized.supported_engines:
        spr = cpu.detect(machine="x86_64", cpuinfo=SAPPHIRE_RAPIDS)
        assert cpu.fbgemm_unavailable(spr) is None
        old = cpu.detect(machine="x86_64", cpuinfo="flags\t: sse4_2 avx\n")
        assert "AVX2" in str(cpu.fbgemm_unavailable(old))
