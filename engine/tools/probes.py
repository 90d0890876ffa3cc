"""CPU and GPU samples for the devices panel: `SystemSample`, None where unavailable.

Probing never raises. The GPU is read through NVML (nvidia-ml-py) when the
driver answers, else through torch.cuda when torch is *already imported* by
someone else and sees a device; this module never imports torch itself.
A `Sampler` thread takes a sample at a fixed interval and hands it to a
callback (the chat posts it to the UI; a benchmark may log it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..events import SystemSample

try:  # psutil is a dependency, but a broken install must not break the chat
    import psutil
except Exception:  # pragma: no cover - exercised only on broken installs
    psutil = None  # type: ignore[assignment]


class _Nvml:
    """NVML handle for GPU 0, initialised once; every failure means 'no GPU'."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._nvml: Any = None
        self._handle: Any = None
        self.name: str | None = None

    def _init(self) -> None:
        self._tried = True
        try:
            import pynvml  # provided by nvidia-ml-py

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() < 1:
                return
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self._nvml, self._handle = pynvml, handle
        except Exception:
            self._nvml = self._handle = None

    def read(self) -> tuple[float, int, int] | None:
        """(utilisation %, memory used, memory total) or None."""
        with self._lock:
            if not self._tried:
                self._init()
            if self._handle is None:
                return None
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                return float(util.gpu), int(mem.used), int(mem.total)
            except Exception:
                return None


_NVML = _Nvml()


def _torch_cuda() -> tuple[int, int, str | None] | None:
    """(memory used, memory total, name) from torch.cuda, only if torch is loaded already."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return int(total - free), int(total), str(torch.cuda.get_device_name())
    except Exception:
        return None


class SystemProbe:
    """Takes `SystemSample`s. The first CPU reading after creation covers the time since then."""

    def __init__(
        self, *, draft_device: str | None = None, target_device: str | None = None
    ) -> None:
        self.draft_device = draft_device
        self.target_device = target_device
        self._process: Any = None
        if psutil is not None:
            try:
                self._process = psutil.Process(os.getpid())
                self._process.cpu_percent(None)  # prime the counters
                psutil.cpu_percent(None, percpu=True)
            except Exception:
                self._process = None

    def sample(self) -> SystemSample:
        per_core: tuple[float, ...] = ()
        proc_cpu = 0.0
        rss = 0
        if psutil is not None:
            try:
                per_core = tuple(float(v) for v in psutil.cpu_percent(None, percpu=True))
            except Exception:
                per_core = ()
            if self._process is not None:
                try:
                    proc_cpu = float(self._process.cpu_percent(None))
                    rss = int(self._process.memory_info().rss)
                except Exception:
                    pass
        util: float | None = None
        used: int | None = None
        total: int | None = None
        name: str | None = None
        nv = _NVML.read()
        if nv is not None:
            util, used, total = nv
            name = _NVML.name
        else:
            tc = _torch_cuda()
            if tc is not None:
                used, total, name = tc
        return SystemSample(
            cpu_percent_per_core=per_core,
            process_cpu_percent=proc_cpu,
            rss_bytes=rss,
            gpu_util_percent=util,
            gpu_mem_used_bytes=used,
            gpu_mem_total_bytes=total,
            gpu_name=name,
            draft_device=self.draft_device,
            target_device=self.target_device,
            t=time.perf_counter(),
        )


def sample_system(
    *, draft_device: str | None = None, target_device: str | None = None
) -> SystemSample:
    """One sample now (CPU figures cover a short 0.1 s window)."""
    probe = SystemProbe(draft_device=draft_device, target_device=target_device)
    time.sleep(0.1)
    return probe.sample()


class Sampler:
    """A daemon thread calling `callback(sample)` every `interval` seconds until `stop()`.

    The callback runs on the sampler thread: a UI hands it on with a
    thread-safe post. An exception in the callback stops nothing.
    """

    def __init__(
        self,
        callback: Callable[[SystemSample], None],
        *,
        interval: float = 1.0,
        probe: SystemProbe | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.callback = callback
        self.interval = interval
        self.probe = probe or SystemProbe()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="specchat-probe", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 2.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        next_t = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            next_t += self.interval
            if next_t < time.monotonic():  # fell behind (suspended): do not burst
                next_t = time.monotonic() + self.interval
            try:
                self.callback(self.probe.sample())
            except Exception:
                continue
