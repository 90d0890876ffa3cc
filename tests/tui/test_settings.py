"""The settings file: defaults, per-key validation, a corrupt file left alone, flags on top."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from tui_helpers import SIZE, make_app, ready

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.paths import config_path
from specchat.tui.cli import build_parser
from specchat.tui.commands import chat
from specchat.tui.settings import CHAT_MAX_NEW_TOKENS, Settings, SettingsStore
from specchat.tui.widgets.transcript import Note


def test_config_path_env_and_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECCHAT_CONFIG", str(tmp_path / "x.toml"))
    assert config_path() == tmp_path / "x.toml"
    monkeypatch.delenv("SPECCHAT_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert config_path() == tmp_path / "xdg" / "specchat" / "config.toml"


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    store = SettingsStore(tmp_path / "none.toml")
    assert store.load() == Settings()
    assert store.problems == [] and not store.corrupt
    # a chat reply runs to its end: the limit is far above DecodeConfig's headless default
    assert Settings().decode.max_new_tokens == CHAT_MAX_NEW_TOKENS > DecodeConfig().max_new_tokens


def test_values_apply_and_bad_ones_fall_back(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'theme = "specchat-light"\nview = "tokens"\npanels = ["devices", "latency"]\n'
        '[models]\ntarget = "my/target"\n'
        '[decode]\nmode = "early-exit"\nk = 3\ntemperature = 0.7\ntop_p = 0.9\n'
        "exit_budget = 0.9\nseed = 7\n"
        "max_new_tokens = -5\n"  # invalid: reported, default kept
        'colour = "red"\n'  # unknown: reported
    )
    store = SettingsStore(path)
    s = store.load()
    assert (s.theme, s.view, s.panels, s.target) == (
        "specchat-light",
        "tokens",
        ("devices", "latency"),
        "my/target",
    )
    assert s.decode == DecodeConfig(
        mode=Mode.EARLY_EXIT,
        k=3,
        temperature=0.7,
        top_p=0.9,
        exit_budget=0.9,
        seed=7,
        max_new_tokens=CHAT_MAX_NEW_TOKENS,
    )
    assert any("max_new_tokens" in p for p in store.problems)
    assert any("colour" in p for p in store.problems)
    assert not store.corrupt
    path.write_text('[decode]\nk = "auto"\nmode = "warp"\n')
    s = store.load()
    assert s.decode.k is None and s.decode.mode is Mode.SPEC
    assert any("decode.mode" in p for p in store.problems)


def test_corrupt_file_is_reported_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    broken = b'theme = "specchat-dark\n[decode\n'
    path.write_bytes(broken)
    store = SettingsStore(path)
    assert store.load() == Settings()
    assert store.corrupt and "not valid TOML" in store.problems[0]
    assert store.save({"theme": "nord"}) is False
    assert path.read_bytes() == broken


def test_save_merges_and_keeps_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "c.toml"
    store = SettingsStore(path)
    assert store.save({"decode": {"mode": "plain"}})
    path.write_text('my_note = "kept"\n' + path.read_text())
    assert store.save({"decode": {"k": 4}, "panels": ("latency",)})
    assert store.save({"decode": {"seed": None}})
    data = tomllib.loads(path.read_text())
    assert data == {"decode": {"mode": "plain", "k": 4}, "my_note": "kept", "panels": ["latency"]}


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[decode]\nmode = "plain"\ntemperature = 0.5\n')
    args = build_parser().parse_args(
        ["chat", "--config", str(path), "--mode", "spec", "--replay", __file__]
    )
    app = chat.build_app(args)
    assert not isinstance(app, int)
    assert app.state.decode.mode is Mode.SPEC  # the flag
    assert app.state.decode.temperature == 0.5  # the file
    assert app.state.decode.max_new_tokens == CHAT_MAX_NEW_TOKENS  # the chat's default
    path.write_text("[decode]\nmax_new_tokens = 512\n")
    from_file = chat.build_app(
        build_parser().parse_args(["chat", "--config", str(path), "--replay", __file__])
    )
    assert not isinstance(from_file, int) and from_file.state.decode.max_new_tokens == 512
    flagged = build_parser().parse_args(
        ["chat", "--config", str(path), "--max-new-tokens", "300", "--replay", __file__]
    )
    from_flag = chat.build_app(flagged)
    assert not isinstance(from_flag, int) and from_flag.state.decode.max_new_tokens == 300
    bad = build_parser().parse_args(["chat", "--config", str(path), "--temperature", "-1"])
    assert chat.build_app(bad) == 2
    missing = build_parser().parse_args(["chat", "--replay", str(tmp_path / "nope.jsonl")])
    assert chat.build_app(missing) == 2


async def test_app_with_corrupt_config_warns_and_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    broken = b"panels = [\n"
    path.write_bytes(broken)
    store = SettingsStore(path)
    settings = store.load()
    app = make_app(settings=settings, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        warnings = [n for n in app.query(Note) if n.level == "warning"]
        assert any("not valid TOML" in n.message for n in warnings)
        await pilot.press("f4", "f7")  # changes that would be saved
        await pilot.pause()
        assert path.read_bytes() == broken
        assert any("Not saved" in n.message for n in app._notifications)


async def test_app_saves_changes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    store = SettingsStore(path)
    app = make_app(settings=store.load(), store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert not path.exists()  # starting does not write
        await pilot.press("f7", "f8", "f4", "ctrl+t", "ctrl+l")
        app.theme = "specchat-okabe-ito"
        await pilot.pause()
    data = tomllib.loads(path.read_text())
    assert data["decode"] == {"mode": "self-spec", "k": 1, "max_new_tokens": 4096}
    assert data["theme"] == "specchat-okabe-ito"
    assert data["view"] == "tokens"
    assert data["panels"] == ["acceptance", "latency", "devices"]


def test_a_flag_out_of_range_is_a_message_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specchat.tui.commands import generate

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--k", "40"])
    assert generate.run(args) == 2
    assert "specchat: k must be in 1..31, got 40" in capsys.readouterr().err
