"""llama.cpp's server, built from source on this machine and started for a test.

The llama-cpp-python sdist (pinned below) vendors a llama.cpp tree; it is fetched
through pip, checked against its sha256, and `llama-server` is built once per machine
and instruction set into `<cache>/llama.cpp/<version>-<isa>/`. A build prints a
progress line to the terminal (not to pytest's capture): it takes 5-8 minutes on 2 cores.

Choices made at run time, and why:
- The instruction sets come from this CPU's flags and are listed one by one
  (GGML_NATIVE=OFF): a native build on an Intel CPU with AMX died with a
  general-protection fault in ggml's AMX path inside a VM, so AMX stays off and
  AVX-512/VNNI/BF16 are on where the CPU has them.
- The server starts without OMP_WAIT_POLICY=PASSIVE (right for torch, 35% slower
  for llama.cpp), with as many threads as the caller asks.

    python -m tests.llamacpp build          # build (or find) llama-server, print its path
    python -m tests.llamacpp serve [--port 8080]   # serve the default pair, draft on
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SERVER_BINARY = "llama-server"

# CPU flag -> ggml option. AMX is never turned on (see the module docstring).
_ISA = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512_vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)


class BuildError(RuntimeError):
    """llama-server could not be built here; the message says which step failed."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_options(flags: set[str]) -> tuple[list[str], str]:
    """The ggml instruction-set options for a CPU with `flags`, and a short tag naming them."""
    on = [opt for flag, opt in _ISA if flag in flags]
    if "GGML_AVX512" in on and not {"avx512bw", "avx512vl", "avx512dq"} <= flags:
        on = [o for o in on if not o.startswith("GGML_AVX512")]
    opts = ["-DGGML_NATIVE=OFF"]
    opts += [f"-D{opt}={'ON' if opt in on else 'OFF'}" for _, opt in _ISA]
    opts += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    tag = "-".join(o.removeprefix("GGML_").lower() for o in on) or "generic"
    return opts, tag


def cache_root() -> Path:
    from specchat.engine import paths

    return paths.cache_root() / "llama.cpp"


def _say(line: str) -> None:
    """A progress line on the real terminal, past pytest's capture."""
    stream = sys.__stderr__ or sys.stderr
    print(f"[llama.cpp] {line}", file=stream, flush=True)


def _sdist(work: Path) -> Path:
    """The pinned llama-cpp-python sdist, fetched through pip and checked."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    target = work / name
    if not target.is_file():
        _say(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (73 MB) through pip")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not target.is_file():
            raise BuildError(f"pip download of llama-cpp-python failed: {done.stderr[-400:]}")
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        target.unlink()
        raise BuildError(f"{name}: sha256 {digest}, expected {SDIST_SHA256}")
    return target


def _extract(sdist: Path, dest: Path) -> Path:
    """Unpack only the vendored llama.cpp tree; returns its root."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(dest, members=members, filter="data")
    return dest / prefix


def _run_logged(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    """Run a build step, its output to `log`, a progress line every tenth of ninja's steps."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    step = re.compile(rb"^\[(\d+)/(\d+)\]")
    shown = -1
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = step.match(line)
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                tenth = 10 * done // max(total, 1)
                if tenth > shown:
                    shown = tenth
                    _say(f"{what}: {done}/{total} steps, {time.monotonic() - t0:.0f} s")
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise BuildError(f"{what} failed (exit {rc}); the last lines of {log}:\n{tail}")


def server_binary(jobs: int | None = None) -> Path:
    """Path of a built `llama-server` for this CPU, building it first when there is none."""
    opts, tag = isa_options(cpu_flags())
    root = cache_root()
    home = root / f"{LLAMA_CPP_PYTHON}-{tag}"
    binary = home / "bin" / SERVER_BINARY
    if binary.is_file():
        return binary
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None and shutil.which(tool, path=str(Path(sys.executable).parent)) is None:
            raise BuildError(f"{tool} is not installed (pip install {tool})")
    root.mkdir(parents=True, exist_ok=True)
    lock = (root / f"{home.name}.lock").open("w")
    import fcntl

    fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same: wait for it
    try:
        if binary.is_file():
            return binary
        work = root / "src"
        work.mkdir(exist_ok=True)
        src = _extract(_sdist(work), Path(tempfile.mkdtemp(dir=root, prefix="tree-")))
        build = src / "build"
        log = root / f"{home.name}.log"
        log.write_text("")
        _say(f"building {SERVER_BINARY} from llama-cpp-python {LLAMA_CPP_PYTHON} "
             f"({tag}; AMX off; log {log})")  # fmt: skip
        bindir = str(Path(sys.executable).parent)
        cmake = shutil.which("cmake", path=bindir) or "cmake"
        ninja = shutil.which("ninja", path=bindir) or shutil.which("ninja") or "ninja"
        configure = [
            cmake, "-S", str(src), "-B", str(build), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF", *opts,
        ]  # fmt: skip
        _run_logged(configure, log, "configure")
        jobs = jobs or os.cpu_count() or 2
        _run_logged([cmake, "--build", str(build), "--target", SERVER_BINARY, "-j", str(jobs)],
                    log, "build")  # fmt: skip
        built = build / "bin" / SERVER_BINARY
        if not built.is_file():
            raise BuildError(f"the build finished without {built}")
        (home / "bin").mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".partial")
        shutil.copy2(built, tmp)
        tmp.rename(binary)
        shutil.rmtree(src.parents[2], ignore_errors=True)
        _say(f"built {binary}")
        return binary
    finally:
        lock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT (the OpenAI API is under /v1)
    process: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def serve(
    target: Path,
    draft: Path | None = None,
    *,
    port: int | None = None,
    threads: int = 2,
    ctx: int = 4096,
    draft_max: int = 8,
    extra: tuple[str, ...] = (),
    log: Path | None = None,
    ready_timeout: float = 180.0,
) -> Iterator[Server]:
    """Start llama-server on `target` (with `draft` as its draft model), wait until its
    /health says ok, and stop it on exit."""
    binary = server_binary()
    port = port or free_port()
    log = log or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-c", str(ctx), "--parallel", "1", "--metrics", "--no-webui",
           *extra]  # fmt: skip
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max",
                str(draft_max), "--spec-draft-n-min", "0", "-td", str(threads)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise BuildError(f"llama-server exited ({proc.returncode}): "
                                 f"{log.read_text(errors='replace')[-1500:]}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BuildError(f"llama-server not ready after {ready_timeout:.0f} s; log {log}")
            time.sleep(0.5)
        yield Server(url, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def default_pair_ggufs() -> tuple[Path, Path]:
    """The default pair's verified GGUF files (target, draft), fetched into the cache."""
    from specchat.engine.weights import fetch, registry

    target, draft = registry.DEFAULT_PAIR
    return fetch.fetch_gguf(target), fetch.fetch_gguf(draft)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.llamacpp", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build (or find) llama-server and print its path")
    s = sub.add_parser("serve", help="serve the default pair with its draft on")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--no-draft", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            print(server_binary())
            return 0
        target, draft = default_pair_ggufs()
        with serve(target, None if args.no_draft else draft, port=args.port,
                   threads=args.threads) as srv:  # fmt: skip
            print(f"serving {target.name} at {srv.url}/v1 (log {srv.log}); Ctrl+C stops it")
            srv.process.wait()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
