"""The engine stays headless: importing it loads neither textual nor rich."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = [
    "specchat.engine",
    "specchat.engine.config",
    "specchat.engine.events",
    "specchat.engine.sampling",
    "specchat.engine.speculative",
    "specchat.engine.controller",
    "specchat.engine.session",
    "specchat.engine.loading",
]


def test_engine_imports_no_ui() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {ENGINE_MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich')"
        " or m.startswith('specchat.tui') or m.startswith('specchat.themes'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine imported UI modules: {out.stdout}"


def test_cli_help_is_light() -> None:
    """`specchat --help` parses without importing torch (a fast first response)."""
    code = (
        "import sys\n"
        "from specchat.tui import cli\n"
        "cli.build_parser()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
