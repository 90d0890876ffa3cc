"""System probes: CPU figures always, GPU figures or None, never an exception."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
import pytest

from specchat.engine.events import SystemSample
from specchat.engine.tools import probes


def test_sample_has_cpu_figures() -> None:
    probe = probes.SystemProbe(draft_device="cpu", target_device="cpu")
    time.sleep(0.05)
    s = probe.sample()
    assert isinstance(s, SystemSample)
    assert len(s.cpu_percent_per_core) == psutil.cpu_count()
    assert all(0.0 <= v <= 100.0 for v in s.cpu_percent_per_core)
    assert s.rss_bytes > 0
    assert s.process_cpu_percent >= 0.0
    assert (s.draft_device, s.target_device) == ("cpu", "cpu")
    if s.gpu_mem_total_bytes is None:  # no GPU here: every GPU field is None
        assert s.gpu_util_percent is None and s.gpu_mem_used_bytes is None


def test_nvml_failure_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(probes, "_NVML", probes._Nvml())
    assert probes._NVML.read() is None
    s = probes.sample_system()
    assert s.gpu_util_percent is None


def test_broken_torch_cuda_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cuda:
        @staticmethod
        def is_available() -> bool:
            raise RuntimeError("driver exploded")

    class FakeTorch:
        cuda = Cuda()

    monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    assert probes._torch_cuda() is None


def test_probes_never_import_torch() -> None:
    code = (
        "import sys\n"
        "from specchat.engine.tools import probes\n"
        "probes.sample_system()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sampler_runs_at_an_interval_and_stops() -> None:
    got: list[SystemSample] = []
    done = threading.Event()

    def callback(s: SystemSample) -> None:
        got.append(s)
        if len(got) == 2:
            raise RuntimeError("a failing callback does not stop the sampler")
        if len(got) >= 4:
            done.set()

    sampler = probes.Sampler(callback, interval=0.05)
    start = time.perf_counter()  # the samples' clock
    sampler.start()
    assert done.wait(3.0)
    sampler.stop()
    assert not sampler.running
    n = len(got)
    time.sleep(0.15)
    assert len(got) == n
    # Paced, not a busy loop: the n-th sample comes no sooner than n intervals after the
    # start (a tick that wakes late may be followed closely by the next, on schedule).
    assert all(s.t - start >= (n + 1) * 0.05 - 1e-3 for n, s in enumerate(got[:4]))
    with pytest.raises(ValueError):
        probes.Sampler(callback, interval=0)


class _FakeNvml:
    """Just enough of pynvml for one GPU."""

    class _Util:
        gpu = 42

    class _Mem:
        used = 3 * 2**30
        total = 80 * 2**30

    @staticmethod
    def nvmlInit() -> None:
        pass

    @staticmethod
    def nvmlDeviceGetCount() -> int:
        return 1

    @staticmethod
    def nvmlDeviceGetHandleByIndex(i: int) -> object:
        return object()

    @staticmethod
    def nvmlDeviceGetName(handle: object) -> bytes:
        return b"Fake H100"

    @classmethod
    def nvmlDeviceGetUtilizationRates(cls, handle: object) -> object:
        return cls._Util()

    @classmethod
    def nvmlDeviceGetMemoryInfo(cls, handle: object) -> object:
        return cls._Mem()


def test_gpu_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    monkeypatch.setattr(probes, "_NVML", probes._Nvml())
    s = probes.SystemProbe().sample()
    assert (s.gpu_util_percent, s.gpu_mem_used_bytes, s.gpu_mem_total_bytes) == (
        42.0,
        3 * 2**30,
        80 * 2**30,
    )
    assert s.gpu_name == "Fake H100"


def test_gpu_through_an_already_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cuda:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def mem_get_info() -> tuple[int, int]:
            return (6 * 2**30, 8 * 2**30)

        @staticmethod
        def get_device_name() -> str:
            return "Fake GPU"

    class FakeTorch:
        cuda = Cuda()

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(probes, "_NVML", probes._Nvml())
    monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    s = probes.SystemProbe().sample()
    assert s.gpu_util_percent is None  # torch.cuda does not report utilisation
    assert (s.gpu_mem_used_bytes, s.gpu_mem_total_bytes, s.gpu_name) == (
        2 * 2**30,
        8 * 2**30,
        "Fake GPU",
    )
