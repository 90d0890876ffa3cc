"""`specchat generate`: one reply, headless; coloured by provenance on a terminal, or a JSON trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate one reply headless (plain, spec, lookup, self-spec or early-exit)",
        description="Generate one reply. Prints it (coloured by provenance on a terminal) "
        "and a summary line; --json writes every event as one JSON object per line.",
    )
    p.add_argument("--prompt", required=True, help="the user prompt ('-' reads standard input)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--json", action="store_true", help="write the event trace as JSON lines")
    common.add_model_args(p)
    common.add_server_args(p)
    common.add_decode_args(p, mode_default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.errors import EngineError
    from specchat.engine.events import (
        Cancelled,
        Failed,
        LoadProgress,
        Notice,
        TokenEvent,
        TurnFinished,
        to_dict,
    )

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        cfg = common.decode_config(args)
    except ValueError as exc:  # a flag out of range (--k 40): one line, not a traceback
        print(f"specchat: {exc}", file=sys.stderr)
        return 2
    target, draft = common.model_specs(args)
    if cfg.mode.value == "spec" and draft is None and args.mode is None:
        cfg = cfg.with_(mode=common.Mode.PLAIN)
    out = sys.stdout
    emit_json = args.json

    def write(event: Any) -> None:
        out.write(json.dumps(to_dict(event), ensure_ascii=False) + "\n")

    def progress(event: LoadProgress) -> None:
        if emit_json:
            write(event)

    try:
        session: Any
        if args.server:
            session = common.connect_server(args, progress, system_prompt=args.system)
        else:
            session = ChatSession.load(
                target,
                draft,
                cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                progress=progress,
                threads=args.threads,
                draft_head=getattr(args, "draft_head", "auto"),
                system_prompt=args.system,
            )
    except EngineError as exc:
        return common.fail(exc.message, exc.hint)

    console = None
    styles: dict[str, str] = {}
    if not emit_json:
        from rich.console import Console

        from specchat.themes import terminal_styles

        console = Console(highlight=False, soft_wrap=True)  # honours NO_COLOR: text styles stay
        styles = terminal_styles()
    else:
        write(session.ready)

    status = 0
    for event in session.stream(prompt, cfg):
        if emit_json:
            write(event)
            continue
        assert console is not None
        if isinstance(event, TokenEvent):
            console.print(event.text, style=styles[event.provenance.value] or None, end="")
        elif isinstance(event, Notice):
            console.print(f"[{event.level}] {event.message}", style="dim", markup=False)
        elif isinstance(event, TurnFinished):
            console.print()
            console.print(summary_line(event.stats), style="dim", markup=False)
            if event.stats.server is not None:
                console.print(server_line(event.stats.server), style="dim", markup=False)
        elif isinstance(event, Cancelled):
            console.print("\n(cancelled)", style="dim")
        elif isinstance(event, Failed):
            console.print()
            status = common.fail(event.message, event.hint)
    out.flush()
    return status


def server_line(server: Any) -> str:
    """What a served engine said of the reply's speculation, in one line."""
    head = f"{server.kind} server ({server.source}, {server.scope})"
    if server.speculative is False:
        return f"{head}: no speculative decoding"
    if server.acceptance_rate is None and server.mean_accepted_length is None:
        return f"{head}: no acceptance figures"
    parts = [head]
    if server.draft_tokens is not None and server.accepted is not None:
        rate = server.acceptance_rate
        parts.append(f"accepted {server.accepted}/{server.draft_tokens} drafts"
                     + (f" ({rate:.0%})" if rate is not None else ""))  # fmt: skip
    if server.mean_accepted_length is not None:
        parts.append(f"{server.mean_accepted_length:.2f} tokens / verify step")
    pos = server.by_position()
    if pos:
        parts.append("accepted at position / drafts " + " ".join(f"{p:.2f}" for p in pos))
    return " | ".join(parts)


def summary_line(stats: Any) -> str:
    parts = [
        f"{stats.tokens} tokens in {stats.seconds:.2f}s ({stats.tokens_per_s:.1f} tok/s)",
        f"TTFT {stats.ttft_s * 1e3:.0f} ms",
        f"mode {' '.join(stats.optimizations)}",
    ]
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.2f}")
        parts.append(f"tokens/round {stats.mean_accepted_length:.2f}")
    if stats.mean_layers is not None:
        parts.append(f"exits {stats.early_exits}, mean layers {stats.mean_layers:.1f}")
    if stats.fallbacks:
        parts.append(f"{len(stats.fallbacks)} controller change(s), last: {stats.fallbacks[-1]}")
    parts.append(f"stop: {stats.stop_reason}")
    return " | ".join(parts)
