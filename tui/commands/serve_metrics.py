"""`specchat serve-metrics`: a Prometheus endpoint fed by a replayed trace or a benchmark.

    specchat serve-metrics --trace reply.jsonl --loop       # replay a recorded trace
    specchat serve-metrics --demo --loop                    # a synthetic trace, no model
    specchat serve-metrics --prompts prompts.jsonl [model flags] [--modes plain,spec]

The endpoint binds 127.0.0.1 unless --host says otherwise; it keeps serving
after the replay or benchmark ends until Ctrl-C (--exit-when-done stops it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from . import bench as bench_cmd

DEFAULT_PORT = 9464


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve-metrics",
        help="serve Prometheus metrics while replaying a trace or running a benchmark",
        description="Serve a Prometheus /metrics endpoint (drafted/accepted tokens, accepted "
        "length, exit layers, per-token latency, mode switches; labelled by model and mode) "
        "fed by a replayed trace (--trace, --demo) or by a benchmark run (--prompts).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="JSONL event trace (specchat generate --json)")
    src.add_argument("--demo", action="store_true", help="replay a synthetic trace (no model)")
    src.add_argument("--prompts", type=Path, help="benchmark this JSONL prompt file")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor (default 1)")
    p.add_argument("--loop", action="store_true", help="replay again and again")
    p.add_argument("--model-label", default=None, help="model label (default: from the trace)")
    p.add_argument("--exit-when-done", action="store_true", help="stop serving at the end")
    p.add_argument("--modes", default="plain,spec", help="benchmark modes (with --prompts)")
    p.add_argument("--repeats", type=int, default=1, help="benchmark repeats (with --prompts)")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="benchmark transformers' generate too (with --prompts)",
    )
    bench_cmd.add_run_args(p)
    p.set_defaults(func=run)


def replay(events: list[Any], telemetry: Any, model: str, speed: float) -> int:
    """Feed events to telemetry, sleeping the recorded gaps between tokens / speed."""
    from specchat.engine.events import Ready, SystemSample, TokenEvent

    last_t: float | None = None
    n = 0
    for ev in events:
        if isinstance(ev, SystemSample):
            continue
        if isinstance(ev, Ready):
            model = model or ev.target.name
            continue
        if isinstance(ev, TokenEvent) and ev.t:
            if last_t is not None and speed > 0:
                time.sleep(min(2.0, max(0.0, ev.t - last_t) / speed))
            last_t = ev.t
        telemetry.observe(ev, model=model or "unknown")
        n += 1
    return n


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specchat.engine.errors import EngineError
    from specchat.engine.tools.telemetry import Telemetry

    err = Console(stderr=True)
    events: list[Any] = []
    if args.trace or args.demo:
        from specchat.engine.tools import replay as replay_mod

        try:
            events = (
                replay_mod.read_trace(args.trace) if args.trace else replay_mod.synthesize_trace()
            )
        except EngineError as exc:
            return bench_cmd.error(exc.message, exc.hint)
    telemetry = Telemetry()
    try:
        server = telemetry.serve(args.port, args.host)
    except OSError as exc:
        return bench_cmd.error(
            f"cannot serve metrics on {args.host}:{args.port}: {exc}", hint="choose another --port"
        )
    err.print(f"serving Prometheus metrics at {server.url} (Ctrl-C stops)")
    try:
        if events:
            while True:
                n = replay(events, telemetry, args.model_label or "", args.speed)
                err.print(f"replayed {n} events")
                if not args.loop:
                    break
        elif args.prompts:
            status = run_benchmark(args, telemetry, err)
            if status:
                return status
        if not args.exit_when_done:
            err.print("done; still serving (Ctrl-C stops)")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.close()
    return 0


def run_benchmark(args: argparse.Namespace, telemetry: Any, console: Any) -> int:
    from specchat.engine.errors import EngineError
    from specchat.engine.tools.bench import load_prompts

    from . import common

    try:
        prompts = load_prompts(args.prompts)
        cfg = common.decode_config(args)
    except EngineError as exc:
        return bench_cmd.error(exc.message, exc.hint)
    except ValueError as exc:
        return bench_cmd.error(str(exc))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bench_cmd.quiet_transformers()
    try:
        session = bench_cmd.load_session(args, console)
    except EngineError as exc:
        return bench_cmd.error(exc.message, exc.hint)
    args.no_warmup = False
    while True:
        result = bench_cmd.run_with_progress(session, prompts, modes, cfg, args, console, telemetry)
        bench_cmd.print_result(result.to_dict(), bench_cmd.wide_console())
        if not args.loop:
            return 0
