#!/usr/bin/env python
"""What the chat UI costs: reply tokens/s in the app against headless `specchat generate`.

Both sides run the same prompt, models, decode flags and torch thread count,
each in a fresh process, interleaved (headless, app, headless, app, ...), and
both report the engine's own `TurnStats` of the reply: tokens/s is tokens
generated over the time from the start of the reply (prefill included) to its
last token, "decode" the same after the first token (no prefill, no
first-token latency); model loading is not counted. The app side is the real app
(`specchat chat` flags, real terminal driver) writing to a pseudo-terminal of
--size, driven by an auto pilot that sends the prompt once the model is ready;
the parent drains the terminal output. The headless side is
`specchat generate --json` (the lightest consumer; its coloured text output
costs the engine 10-15 % on its own).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/ui_cost.py \\
        --target ../shared/models/stories260k --runs 3 --modes plain spec

`--replay TRACE` measures the UI alone: the app replays a trace recorded with
`specchat generate --json` at its recorded pace (no model runs), and the
script reports the UI thread's and the whole process's CPU time per shown
token; every millisecond of it is one the engine would have to share.

`--profile DIR` also writes a cProfile (CPU time) of the app's UI thread,
from the prompt to the end of the reply, for each app run (read it with
`python -m pstats`). Prints one line per run, then per mode the medians and
the ratios app / headless.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = str(ROOT.parent / "shared" / "models" / "stories260k")


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The flags both the measuring child and the specchat commands take as they are."""
    return [
        "--target",
        args.target,
        "--threads",
        str(args.threads),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]


def model_flags(args: argparse.Namespace, mode: str) -> list[str]:
    flags = [*shared_flags(args), "--temperature", "0"]
    if mode == "spec":
        # the target drafts for itself: every draft is accepted, K+1 tokens a round
        flags += ["--draft", args.draft or args.target, "--mode", "spec"]
        if args.k:
            flags += ["--k", str(args.k)]
    else:
        flags += ["--draft", "none", "--mode", mode]
    return flags


def specchat_cmd() -> list[str]:
    return [sys.executable, "-m", "specchat.tui.cli"]


def run_headless(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    cmd = [*specchat_cmd(), "generate", "--json", "--prompt", args.prompt, *model_flags(args, mode)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=child_env())
    for line in out.stdout.splitlines():
        event = json.loads(line)
        if event.get("type") == "TurnFinished":
            return dict(event["stats"])
    raise RuntimeError(f"no TurnFinished from: {' '.join(cmd)}\n{out.stderr}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TERM", "xterm-256color")
    env.setdefault("COLORTERM", "truecolor")
    # a settings file of this run's own: the user's panels and view do not apply
    env["SPECCHAT_CONFIG"] = str(Path(tempfile.mkdtemp(prefix="ui_cost_")) / "config.toml")
    return env


def run_app(args: argparse.Namespace, mode: str, profile: Path | None) -> dict[str, Any]:
    """The app once, in a child process on a pseudo-terminal of `args.size`."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--app-once",
            str(result),
            "--mode-once",
            mode,
            *forward(args),
        ]
        if profile is not None:
            cmd += ["--profile-once", str(profile)]
        env = child_env()
        cols, rows = args.size
        pid, fd = pty.fork()
        if pid == 0:  # the child: stdin/stdout/stderr are the terminal
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            os.execve(cmd[0], cmd, env)
        drained = 0
        while True:  # read what the app draws, as a terminal would
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            drained += len(chunk)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        if not result.exists():
            raise RuntimeError(f"app run failed (status {status}): {' '.join(cmd)}")
        data: dict[str, Any] = json.loads(result.read_text())
        data["terminal_bytes"] = drained
        return data


def forward(args: argparse.Namespace) -> list[str]:
    out = [
        *shared_flags(args),
        "--k",
        str(args.k),
        "--prompt",
        args.prompt,
        "--size",
        f"{args.size[0]}x{args.size[1]}",
    ]
    if args.draft:
        out += ["--draft", args.draft]
    if args.replay:
        out += ["--replay", args.replay]
    return out


def app_once(args: argparse.Namespace) -> None:
    """Child side: open the chat, send the prompt, record the reply's stats, quit."""
    from specchat.tui.cli import _prepare_runtime, build_parser
    from specchat.tui.commands.chat import build_app
    from specchat.tui.widgets.prompt import PromptInput

    _prepare_runtime()
    flags = ["--replay", args.replay] if args.replay else model_flags(args, args.mode_once)
    ns = build_parser().parse_args(["chat", *flags])
    app: Any = build_app(ns)
    result: dict[str, Any] = {}

    async def until(cond: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError
            await asyncio.sleep(0.05)

    async def drive(pilot: Any) -> None:
        try:
            await until(lambda: app.backend is not None or app.load_error is not None)
            if app.backend is None:
                result["error"] = app.load_error.message
                return
            await pilot.pause(0.2)
            app.query_one(PromptInput).value = args.prompt
            if profiler is not None:
                profiler.enable()
            ui_cpu0 = time.thread_time()
            proc_cpu0 = time.process_time()
            t0 = time.perf_counter()
            await pilot.press("enter")
            await until(lambda: app._busy is None and app._last_reply() is not None)
            result["wall_s"] = time.perf_counter() - t0
            result["ui_cpu_s"] = time.thread_time() - ui_cpu0
            result["process_cpu_s"] = time.process_time() - proc_cpu0
            if profiler is not None:
                profiler.disable()
            reply = app._last_reply()
            result["stats"] = dataclass_dict(reply.outcome.stats)
            result["tokens_shown"] = len(reply.tokens)
            await pilot.pause(0.1)
        finally:
            app.exit()

    profiler = None
    if args.profile_once:
        import cProfile

        profiler = cProfile.Profile(
            time.thread_time
        )  # the UI thread, from enter to the end of the reply
    cols, rows = args.size
    app.run(auto_pilot=drive, size=(cols, rows))
    if profiler is not None:
        profiler.dump_stats(args.profile_once)
    Path(args.app_once).write_text(json.dumps(result))


def replay_cost(args: argparse.Namespace) -> int:
    """The app alone on a replayed trace: CPU per shown token, UI thread and whole process."""
    per_token: list[float] = []
    for i in range(args.runs):
        prof = args.profile / f"app-replay-{i + 1}.prof" if args.profile else None
        a = run_app(args, "replay", prof)
        if "stats" not in a:
            print(f"app run failed: {a}", file=sys.stderr)
            return 1
        n = max(1, a["tokens_shown"])
        per_token.append(a["ui_cpu_s"] / n)
        print(
            f"replay run {i + 1}: {n} tokens in {a['wall_s']:.1f} s; UI thread CPU {a['ui_cpu_s']:.2f} s "
            f"({a['ui_cpu_s'] / n * 1e3:.1f} ms/token, {a['ui_cpu_s'] / a['wall_s']:.1%} of wall), "
            f"process CPU {a['process_cpu_s']:.2f} s ({a['process_cpu_s'] / n * 1e3:.1f} ms/token); "
            f"{a['terminal_bytes'] / 1024:.0f} KiB drawn"
        )
        sys.stdout.flush()
    print(f"median UI thread CPU per token: {statistics.median(per_token) * 1e3:.1f} ms")
    return 0


def decode_rate(stats: dict[str, Any]) -> float:
    """Tokens/s after the first token: the steady decoding rate, without prefill and first-token latency."""
    return (stats["tokens"] - 1) / (stats["seconds"] - stats["ttft_s"])


def dataclass_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def parse_size(text: str) -> tuple[int, int]:
    cols, rows = text.lower().split("x")
    return int(cols), int(rows)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument(
        "--draft", default=None, help="draft of the spec mode (default: the target itself)"
    )
    p.add_argument("--modes", nargs="+", default=["plain", "spec"], choices=["plain", "spec"])
    p.add_argument("--runs", type=int, default=3, help="runs of each side per mode")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round in spec mode; 0 = adaptive, as the app")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--size", type=parse_size, default=(160, 45), help="terminal COLSxROWS")
    p.add_argument("--replay", metavar="TRACE", help="the app alone, on this trace at its recorded pace")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR")
    p.add_argument("--app-once", help=argparse.SUPPRESS)
    p.add_argument("--mode-once", help=argparse.SUPPRESS)
    p.add_argument("--profile-once", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.app_once:
        app_once(args)
        return 0

    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.replay:
        return replay_cost(args)
    summary: list[str] = []
    for mode in args.modes:
        rates: dict[str, list[float]] = {
            "headless": [],
            "app": [],
            "headless decode": [],
            "app decode": [],
        }
        ui_share: list[float] = []
        for i in range(args.runs):
            h = run_headless(args, mode)
            rates["headless"].append(h["tokens_per_s"])
            rates["headless decode"].append(decode_rate(h))
            print(
                f"{mode:5} run {i + 1} headless {h['tokens_per_s']:7.1f} tok/s, decode {decode_rate(h):7.1f} tok/s, "
                f"TTFT {h['ttft_s'] * 1e3:4.0f} ms ({h['tokens']} tokens, {h['rounds']} rounds)"
            )
            prof = args.profile / f"app-{mode}-{i + 1}.prof" if args.profile else None
            a = run_app(args, mode, prof)
            if "stats" not in a:
                print(f"app run failed: {a}", file=sys.stderr)
                return 1
            s = a["stats"]
            rates["app"].append(s["tokens_per_s"])
            rates["app decode"].append(decode_rate(s))
            ui_share.append(a["ui_cpu_s"] / a["wall_s"])
            print(
                f"{mode:5} run {i + 1} app      {s['tokens_per_s']:7.1f} tok/s, decode {decode_rate(s):7.1f} tok/s, "
                f"TTFT {s['ttft_s'] * 1e3:4.0f} ms ({s['tokens']} tokens, {s['rounds']} rounds, "
                f"{a['tokens_shown']} shown; UI thread CPU {a['ui_cpu_s']:.2f} s of {a['wall_s']:.2f} s; "
                f"{a['terminal_bytes'] / 1024:.0f} KiB drawn)"
            )
            sys.stdout.flush()
        med = {k: statistics.median(v) for k, v in rates.items()}
        ratio = med["app"] / med["headless"]
        ratio_decode = med["app decode"] / med["headless decode"]
        summary.append(
            f"{mode:5} median tok/s headless {med['headless']:.1f}, app {med['app']:.1f}: "
            f"app/headless {ratio:.3f} (UI cost {1 - ratio:.1%}); decode {med['headless decode']:.1f} vs "
            f"{med['app decode']:.1f}: {ratio_decode:.3f} (UI cost {1 - ratio_decode:.1%}); "
            f"UI thread busy {statistics.median(ui_share):.0%} of the app's wall time"
        )
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
