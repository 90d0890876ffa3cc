"""`specchat chat` (and plain `specchat`): the terminal chat.

`add_parser` stays cheap (no textual, no torch); `run` imports the UI, and
the engine session is imported only inside the load worker, so the first
frame paints before any model code is touched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import common


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chat",
        help="chat in the terminal (the default command)",
        description=(
            "Chat with a local model; every token shows where it came from and side panels "
            "show acceptance, latency and device balance live. Settings are read from "
            "$SPECCHAT_CONFIG or $XDG_CONFIG_HOME/specchat/config.toml; flags override them."
        ),
    )
    common.add_model_args(p)
    common.add_server_args(p)
    common.add_decode_args(p)
    g = p.add_argument_group("chat")
    g.add_argument(
        "--replay",
        metavar="FILE",
        help="open the chat on a recorded trace (JSONL from `specchat generate --json`) instead of models",
    )
    g.add_argument(
        "--replay-speed",
        type=float,
        default=1.0,
        metavar="X",
        help="replay at X times the recorded speed; 0 = as fast as possible (default 1)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the chat's figures as Prometheus metrics on 127.0.0.1:PORT/metrics "
        "(also in vLLM's spec_decode_* shape, prefix specchat:), local or remote backend",
    )
    g.add_argument("--theme", help="specchat-dark, specchat-light, specchat-okabe-ito or a Textual theme")
    g.add_argument("--config", metavar="FILE", help="settings file to read and update")
    p.set_defaults(func=run)


def _replay_loader(path: str, speed: float):  # type: ignore[no-untyped-def]
    def load(progress):  # type: ignore[no-untyped-def]
        from specchat.engine.tools.replay import ReplaySession

        return ReplaySession.from_file(path, pace=speed if speed > 0 else None, progress=progress)

    return load


def _server_loader(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    def load(progress):  # type: ignore[no-untyped-def]
        return common.connect_server(args, progress)

    return load


def _engine_loader(args: argparse.Namespace, siblings: int | None = None):  # type: ignore[no-untyped-def]
    def load(progress):  # type: ignore[no-untyped-def]
        from specchat.engine.errors import EngineError

        try:
            from specchat.engine.decode.session import ChatSession
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("specchat."):
                raise EngineError(
                    f"The model engine is not available in this build ({exc.name} is missing).",
                    "Open a recorded trace instead: specchat --replay TRACE.jsonl",
                ) from None
            raise EngineError(
                f"A package the engine needs is not installed: {exc.name}.",
                "Install specchat with its dependencies: pip install -e .",
            ) from None
        try:
            target, draft = common.model_specs(args)
        except ModuleNotFoundError as exc:
            raise EngineError(
                f"The model registry is not available ({exc.name} is missing).",
                "Name the models explicitly with --target and --draft.",
            ) from None
        return ChatSession.load(
            target,
            draft,
            cache_dir=Path(args.cache_dir).expanduser() if args.cache_dir else None,
            progress=progress,
            threads=args.threads,
            draft_head=getattr(args, "draft_head", "auto"),
            siblings=siblings,
        )

    return load


def build_app(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The chat app for these flags (settings file first, flags over it), or an exit status."""
    from specchat.tui.settings import SettingsStore

    store = SettingsStore(Path(args.config).expanduser() if args.config else None)
    settings = store.load()
    try:
        decode = common.decode_config(args, base=settings.decode)
    except ValueError as exc:
        print(f"specchat: {exc}", file=sys.stderr)
        return 2
    if args.replay:
        if not Path(args.replay).is_file():
            print(f"specchat: no such trace file: {args.replay}", file=sys.stderr)
            return 2
        if args.replay_speed < 0:
            print("specchat: --replay-speed must be >= 0", file=sys.stderr)
            return 2
        loader = _replay_loader(args.replay, args.replay_speed)
        label = f"replay of {Path(args.replay).name}"
    elif args.server:
        loader = _server_loader(args)
        label = f"connecting to {args.server}…"
    else:
        if args.target is None and settings.target:
            args.target = settings.target
            if args.draft is None and settings.draft:
                args.draft = settings.draft
        loader = _engine_loader(args, decode.siblings)
        label = f"loading {args.target or 'the default pair'}…"

    observer = None
    if getattr(args, "metrics_port", None) is not None:
        exported = _export_metrics(args.metrics_port)
        if isinstance(exported, int):
            return exported
        observer, url = exported
        loader = _noting(loader, f"metrics: {url} (Prometheus; vLLM's spec_decode_* series as specchat:)")

    from specchat.tui.app import SpecChatApp

    return SpecChatApp(
        loader,
        decode=decode,
        settings=settings,
        store=store,
        theme=args.theme,
        models_label=label,
        observer=observer,
    )


def _export_metrics(port: int):  # type: ignore[no-untyped-def]
    """A Telemetry endpoint on 127.0.0.1:port and the observer that feeds it; or an exit status."""
    from specchat.engine.tools.telemetry import Telemetry

    telemetry = Telemetry()
    try:
        server = telemetry.serve(port=port)
    except OSError as exc:
        print(f"specchat: cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2

    def observe(model: str, event: object) -> None:
        telemetry.observe(event, model=model)

    return observe, server.url


def _noting(loader, note: str):  # type: ignore[no-untyped-def]
    """The loader, its backend's Ready carrying one more note."""
    import dataclasses

    def load(progress):  # type: ignore[no-untyped-def]
        backend = loader(progress)
        backend.ready = dataclasses.replace(backend.ready, notes=(*backend.ready.notes, note))
        return backend

    return load


def run(args: argparse.Namespace) -> int:
    app = build_app(args)
    if isinstance(app, int):
        return app
    app.run()
    return 0
