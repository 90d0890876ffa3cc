"""The `specchat` command: the chat by default, headless subcommands beside it.

Each subcommand lives in `specchat.tui.commands.<name>` with two functions,
`add_parser(subparsers)` (cheap: no torch, no textual) and `run(args) -> int`
(imports what it needs).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand name -> module under specchat.tui.commands.
COMMANDS: dict[str, str] = {
    "chat": "chat",
    "generate": "generate",
    "models": "models",
    "bench": "bench",
    "ab": "ab",
    "calibrate": "calibrate",
    "train-draft": "train_draft",
    "serve-metrics": "serve_metrics",
}


def _prepare_runtime() -> None:
    # Idle OpenMP threads must not spin: on a 2-core machine a spinning pool
    # slows the UI thread and any second torch user by several times.
    # (Read by the OpenMP runtime at torch import, so set before it.)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_parser() -> argparse.ArgumentParser:
    from .commands import common

    parser = argparse.ArgumentParser(
        prog="specchat",
        description=(
            "Chat with a local LLM and watch speculative decoding and early exit work. "
            "With no subcommand, opens the chat on the default model pair."
        ),
    )
    parser.add_argument("--version", action="version", version=f"specchat {common.version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(f"specchat.tui.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"specchat.tui.commands.{module}":
                raise
            continue  # a subcommand not built yet
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _prepare_runtime()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `specchat [chat flags]` means `specchat chat [chat flags]`.
    known = set(COMMANDS)
    if not argv or (argv[0] not in known and argv[0] not in ("-h", "--help", "--version")):
        argv = ["chat", *argv]
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
