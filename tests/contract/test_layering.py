"""The layers of the house, checked over every module.

Bottom up, one direction only:

    contract   engine/*.py: config, events, errors, protocol, paths, metrics
    model      engine/model/: one model's passes, its cache, kernels, quantization
    weights    engine/weights/: presets, fetch and convert, load, the memory check
    decode     engine/decode/: sampling, the round, drafters, controller, session
    tools      engine/tools/: bench, A/B, replay, telemetry, calibration, probes
    remote     engine/remote/: a served engine as a backend (beside tools: like the
               replay, a backend without a model; it reads Prometheus text)
    tui        tui/ (the app, its widgets and panels) and tui/commands/ (the CLI)

The static checks read every module's imports from its source (lazy imports in
functions and TYPE_CHECKING blocks included), so a module added tomorrow is
covered without being listed here. The runtime checks import modules in a fresh
interpreter and look at sys.modules, which also sees what third-party code pulls in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"engine": "specchat.engine", "tui": "specchat.tui", "themes": "specchat.themes"}
RANK = {"contract": 0, "model": 1, "weights": 2, "decode": 3, "tools": 4, "remote": 4}
# The layers above the decode core, which may pull in the tool libraries.
OUTER = {"tools", "remote"}
# The decode core and below never pull these in; tools may.
TOOL_ONLY = {"matplotlib", "prometheus_client", "argparse"}
UI_ONLY = {"textual", "rich"}
# What the app side of the UI (everything but tui/commands and tui/cli) may import of the
# engine: the contract, and the local machine's probes, which the devices panel shows
# whichever backend is driving the chat.
APP_SIDE_ENGINE = {"specchat.engine.tools.probes"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(specchat modules, top-level third-party names) that `name` imports anywhere."""
    ours: set[str] = set()
    theirs: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            if c in MODULES:
                if c != name:
                    ours.add(c)
            elif not c.startswith("specchat"):
                theirs.add(c.split(".")[0])
    return ours, theirs


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> str:
    """The engine layer of an engine module."""
    parts = name.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in RANK) else "contract"


def test_every_engine_module_has_a_layer_and_the_folders_are_the_layers() -> None:
    engine = [n for n in MODULES if n.startswith("specchat.engine")]
    assert len(engine) > 30
    assert {layer(n) for n in engine} == set(RANK)
    stray = [p for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name not in RANK]
    assert [p.name for p in stray if p.name != "__pycache__"] == []


def test_engine_layers_import_only_downwards() -> None:
    wrong = []
    for name, (ours, _) in GRAPH.items():
        if not name.startswith("specchat.engine"):
            continue
        for target in ours:
            if not target.startswith("specchat.engine"):
                wrong.append(f"{name} -> {target} (the engine never imports the UI or themes)")
            elif RANK[layer(target)] > RANK[layer(name)]:
                wrong.append(f"{name} ({layer(name)}) -> {target} ({layer(target)})")
    assert wrong == []


def test_the_core_pulls_in_no_tool_or_ui_library() -> None:
    wrong = []
    for name, (_, theirs) in GRAPH.items():
        if not name.startswith("specchat.engine"):
            continue
        banned = UI_ONLY | (TOOL_ONLY if layer(name) not in OUTER else set())
        wrong += [f"{name} imports {lib}" for lib in sorted(theirs & banned)]
    assert wrong == []


def test_the_app_side_of_the_ui_sees_the_engine_through_its_contract() -> None:
    """Widgets, panels, state and the app talk to a ChatBackend and its events; only the
    command-line glue (tui/cli.py, tui/commands/) builds sessions and runs tools."""
    wrong = []
    for name, (ours, _) in GRAPH.items():
        if not name.startswith("specchat.tui") or name.startswith(
            ("specchat.tui.commands", "specchat.tui.cli")
        ):
            continue
        for target in ours:
            engine_side = target.startswith("specchat.engine") and layer(target) != "contract"
            if engine_side and target not in APP_SIDE_ENGINE:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_anywhere() -> None:
    assert cycles({name: ours for name, (ours, _) in GRAPH.items()}) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles(graph) == [["a", "b", "c"]]


def test_engine_imports_no_ui() -> None:
    engine = sorted(n for n in MODULES if n.startswith("specchat.engine"))
    code = (
        "import importlib, sys\n"
        f"for m in {engine!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich')"
        " or m.startswith('specchat.tui') or m.startswith('specchat.themes'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine imported UI modules: {out.stdout}"


def test_the_decode_core_loads_no_tool_library() -> None:
    core = sorted(n for n in MODULES if n.startswith("specchat.engine") and layer(n) not in OUTER)
    code = (
        "import importlib, sys\n"
        f"for m in {core!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(TOOL_ONLY - {'argparse'})!r}"
        " or m.startswith('specchat.engine.tools'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the core loaded tool modules: {out.stdout}"


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
