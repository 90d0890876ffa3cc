"""Layering and theming rules of the UI, checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tui_helpers import SIZE, make_app, ready

from specchat import themes
from specchat.engine.events import Provenance

TUI = Path(__file__).resolve().parents[2] / "tui"
HEX = re.compile(r"#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?(?:[0-9a-fA-F]{2})?\b")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_no_hex_colours_outside_themes() -> None:
    offenders = []
    for path in [*TUI.rglob("*.py"), *TUI.rglob("*.tcss")]:
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HEX.search(line):
                offenders.append(f"{path.relative_to(TUI)}:{no}: {line.strip()}")
    assert offenders == []


def test_ui_import_stays_light() -> None:
    """The app module loads neither torch nor the engine session: the first frame paints at once."""
    code = (
        "import sys\n"
        "import specchat.tui.app\n"
        "print(sorted(m for m in ('torch', 'transformers', 'specchat.engine.decode.session') if m in sys.modules))\n"
    )
    assert _run(code) == "[]"


def test_chat_parser_does_not_import_textual() -> None:
    code = (
        "import sys\n"
        "from specchat.tui.commands import chat\n"
        "import argparse\n"
        "p = argparse.ArgumentParser(); chat.add_parser(p.add_subparsers())\n"
        "print('textual' in sys.modules)\n"
    )
    assert _run(code) == "False"


def test_headless_engine_modules_stay_headless() -> None:
    code = (
        "import sys\n"
        "import specchat.engine.metrics, specchat.engine.tools.replay, specchat.engine.tools.probes\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich', 'torch')))\n"
    )
    assert _run(code) == "[]"


def test_themes_define_every_token_colour() -> None:
    names = {f"token-{p.value}" for p in Provenance}
    assert set(themes.TOKEN_VARIABLES.values()) == names
    assert set(themes.PROVENANCE_DEFAULTS) == names
    for theme in themes.THEMES:
        assert names <= set(theme.variables), theme.name
    okabe = themes.SPECCHAT_OKABE_ITO.variables
    palette = {v.upper() for v in themes.OKABE_ITO.values()}
    for p in Provenance:
        if p is not Provenance.TARGET:  # target is plain text colour
            assert okabe[f"token-{p.value}"].upper() in palette


def test_headless_and_app_provenance_looks_come_from_the_themes() -> None:
    """generate prints each provenance in the theme's colour with the app's text style;
    no command keeps a palette of its own."""
    from specchat.tui.widgets import tokens

    styles = themes.terminal_styles(themes.SPECCHAT_LIGHT)
    for p in Provenance:
        colour = themes.SPECCHAT_LIGHT.variables[f"token-{p.value}"]
        text = themes.TEXT_STYLES[p.value]
        assert styles[p.value].split()[0] == colour
        assert tokens.TEXT_STYLES[p] == text
        assert styles[p.value].endswith(text) or text == "none"
    plain = themes.terminal_styles(colour=False)
    assert plain["corrected"] == "bold underline" and plain["target"] == ""
    palettes = [
        path.relative_to(TUI)
        for path in TUI.rglob("*.py")
        if re.search(r"\"(accepted|corrected|bonus)\":\s*\"", path.read_text(encoding="utf-8"))
    ]
    assert palettes == []


async def test_themes_register_and_builtin_themes_get_defaults() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for theme in themes.THEMES:
            assert theme.name in app.available_themes
        app.theme = "specchat-okabe-ito"
        await pilot.pause()
        assert app.theme_variables["token-corrected"] == themes.OKABE_ITO["vermillion"]
        app.theme = "textual-light"  # a built-in theme: the app's defaults fill in
        await pilot.pause()
        assert app.theme_variables["token-accepted"] == themes.PROVENANCE_DEFAULTS["token-accepted"]
