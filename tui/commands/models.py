"""`specchat models`: list, fetch, verify, locate and remove the model presets.

    specchat models list
    specchat models fetch [NAME ...]     (no NAME: the default pair)
    specchat models verify [NAME ...]    (no NAME: every preset in the cache)
    specchat models path NAME
    specchat models rm NAME

Fetching shows a bar per stage (download, verify, join, convert) and ends
with the time each stage took. An interrupted fetch is resumed by running the
same command again. Errors print one line and a hint, and exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from specchat.engine.events import LoadProgress


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="list, fetch, verify and remove model presets",
        description="Manage the model cache: the default pair and the other presets.",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SPECCHAT_CACHE or $XDG_CACHE_HOME/specchat)",
    )
    # Also accepted after the action; SUPPRESS keeps it from hiding the one given before.
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("list", parents=[shared], help="presets, their state and size (default)")
    f = sub.add_parser("fetch", parents=[shared], help="download, verify and convert presets")
    f.add_argument("names", nargs="*", metavar="NAME", help="presets (default: the default pair)")
    f.add_argument(
        "--keep-gguf", action="store_true", help="keep the verified GGUF after conversion"
    )
    f.add_argument("--no-hub", action="store_true", help="skip the Hugging Face hub")
    v = sub.add_parser("verify", parents=[shared], help="re-hash the cached files")
    v.add_argument("names", nargs="*", metavar="NAME", help="presets (default: all in the cache)")
    pa = sub.add_parser("path", parents=[shared], help="print the folder of a ready preset")
    pa.add_argument("name", metavar="NAME")
    rm = sub.add_parser("rm", parents=[shared], help="delete a preset from the cache")
    rm.add_argument("name", metavar="NAME")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Our own bars replace the libraries' tqdm bars; their notices would only
    # tear the display. (Read when those libraries are imported: set before.)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from rich.console import Console

    from specchat.engine.errors import EngineError

    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    action = args.action or "list"
    handlers: dict[str, Callable[[argparse.Namespace, Console], int]] = {
        "list": _list,
        "fetch": _fetch,
        "verify": _verify,
        "path": _path,
        "rm": _rm,
    }
    try:
        return handlers[action](args, out)
    except EngineError as exc:
        _fail(err, exc.message, exc.hint)
        return 1
    except KeyboardInterrupt:
        _fail(err, "interrupted", "run the same command again to resume")
        return 130
    except Exception as exc:  # one line, no traceback (SPECCHAT_DEBUG=1 shows it)
        if os.environ.get("SPECCHAT_DEBUG"):
            raise
        _fail(err, f"{type(exc).__name__}: {exc}", "SPECCHAT_DEBUG=1 shows the traceback")
        return 1


def _fail(err: Console, message: str, hint: str = "") -> None:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    if hint:
        err.print(f"[dim]hint:[/] {hint}", soft_wrap=True)


def _check_names(names: list[str]) -> None:
    from specchat.engine.errors import FetchError
    from specchat.engine.weights import registry

    for name in names:
        if not registry.is_preset(name):
            close = registry.suggest(name)
            raise FetchError(
                f"unknown model preset {name!r}",
                hint=(f"did you mean {', '.join(close)}? " if close else "")
                + "`specchat models list` shows them",
            )


# -- list ------------------------------------------------------------------------


def _list(args: argparse.Namespace, out: Console) -> int:
    from rich.table import Table

    from specchat.engine import paths
    from specchat.engine.weights import fetch, registry

    root = paths.cache_root(args.cache_dir)
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for col in ("preset", "role", "params", "fetch", "state", "disk", "licence"):
        right = col in ("params", "fetch", "disk")
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    total = 0
    notes = []
    for name in registry.names():
        preset = registry.get(name)
        st = fetch.preset_status(name, cache_dir=root)
        total += st.disk_bytes
        role = registry.role_of(name) or ""
        if name in registry.DEFAULT_PAIR:
            role += "*"
        colour = {"ready": "green", "local": "green", "partial": "yellow", "missing": "red"}
        state = f"[{colour.get(st.state, 'dim')}]{st.state}[/]"
        if st.detail:
            notes.append(f"{name}: {st.state}, {st.detail}")
        params = preset.params
        table.add_row(
            name,
            role,
            f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M",
            fetch.human_bytes(preset.download_size) if preset.download_size else "-",
            state,
            fetch.human_bytes(st.disk_bytes) if st.disk_bytes else "-",
            preset.licence,
        )
    out.print(table)
    for note in notes:
        out.print(f"[dim]{note}[/]", soft_wrap=True)
    out.print("[dim]* the default pair (target, draft)[/]")
    out.print(f"[dim]cache: {root} ({fetch.human_bytes(total)} used)[/]", soft_wrap=True)
    return 0


# -- fetch -------------------------------------------------------------------------


class _Bars:
    """Turns LoadProgress events into rich bars, one per stage, and times the stages."""

    def __init__(self, progress: Progress) -> None:
        from specchat.engine.weights.fetch import human_bytes

        self._progress = progress
        self._human = human_bytes
        self._tasks: dict[tuple[str, str], TaskID] = {}
        self._current: tuple[str, str] | None = None
        self._since = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def _switch(self, key: tuple[str, str] | None) -> None:
        now = time.perf_counter()
        if self._current is not None:
            stage = self._current[0]
            self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._since
        self._current, self._since = key, now

    def close(self) -> None:
        self._switch(None)

    def __call__(self, ev: LoadProgress) -> None:
        if ev.stage in ("notice", "wait"):
            self._progress.console.print(f"  [yellow]{ev.detail}[/]")
            return
        by_bytes = ev.unit == "B"
        key = (ev.stage, ev.detail if by_bytes else "")
        if key != self._current:
            self._switch(key)
        if by_bytes:
            what = "GGUF" if ev.detail.endswith(".gguf") else ev.detail
            label = f"{ev.stage} {what}".strip()
            amount = f"{self._human(ev.done)} / {self._human(ev.total or 0)}"
        else:
            label = f"{ev.stage}: {ev.detail}" if ev.detail else ev.stage
            amount = f"step {ev.done}/{ev.total}" if ev.total else ""
        task = self._tasks.get(key)
        if task is None:
            task = self._progress.add_task(label, total=ev.total, amount=amount)
            self._tasks[key] = task
        self._progress.update(
            task, completed=ev.done, total=ev.total, description=label, amount=amount
        )


def _fetch(args: argparse.Namespace, out: Console) -> int:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from specchat.engine import paths
    from specchat.engine.weights import fetch, registry

    names = list(dict.fromkeys(args.names or registry.DEFAULT_PAIR))
    _check_names(names)
    root = paths.cache_root(args.cache_dir)
    need = fetch.check_disk_space(names, root, keep_gguf=args.keep_gguf)
    if need:
        out.print(
            f"[dim]cache: {root} (up to {fetch.human_bytes(need)} needed while fetching)[/]",
            soft_wrap=True,
        )
    for name in names:
        preset = registry.get(name)
        before = fetch.preset_status(name, cache_dir=root)
        if before.state in ("ready", "local"):
            out.print(f"[green]{name}[/]: already {before.state} at {before.path}", soft_wrap=True)
            continue
        out.print(f"[bold]{preset.display}[/] ({preset.licence})")
        t0 = time.perf_counter()
        columns = (
            TextColumn("  {task.description:<34}"),
            BarColumn(bar_width=24),
            TextColumn("{task.percentage:>5.1f}%"),
            TextColumn("{task.fields[amount]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=out, transient=False) as progress:
            bars = _Bars(progress)
            try:
                path = fetch.fetch_preset(
                    name,
                    cache_dir=root,
                    progress=bars,
                    hub=not args.no_hub,
                    keep_gguf=args.keep_gguf,
                )
            finally:
                bars.close()
        took = ", ".join(f"{stage} {sec:.1f} s" for stage, sec in bars.seconds.items())
        out.print(f"[green]{name}[/]: ready in {time.perf_counter() - t0:.1f} s ({took})")
        out.print(f"  {path}", soft_wrap=True)
    _build_kernels(out)
    return 0


def _build_kernels(out: Console) -> None:
    """Compile the native kernels now, so the first chat does not wait for the compiler."""
    from specchat.engine.errors import QuantizationError
    from specchat.engine.model import native

    for kernel in native.KERNELS:
        if native.is_built(kernel) or native.cpu_supports(kernel):
            continue
        out.print(f"[bold]{kernel} kernel[/]: compiling for this machine (once)")
        t0 = time.perf_counter()
        try:
            native.load(kernel)
        except QuantizationError as exc:  # the other modes still work: say so, do not fail
            out.print(f"[yellow]{kernel} kernel[/]: not built: {exc.message}", soft_wrap=True)
            out.print(f"  [dim]hint:[/] {exc.hint}", soft_wrap=True)
            continue
        took = time.perf_counter() - t0
        out.print(f"[green]{kernel} kernel[/]: built in {took:.1f} s at {native.build_dir(kernel)}")


# -- verify, path, rm -------------------------------------------------------------------


def _verify(args: argparse.Namespace, out: Console) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from specchat.engine import paths
    from specchat.engine.errors import FetchError
    from specchat.engine.weights import fetch, registry

    root = paths.cache_root(args.cache_dir)
    if args.names:
        names = list(dict.fromkeys(args.names))
        _check_names(names)
    else:
        names = [
            n
            for n in registry.names()
            if fetch.preset_status(n, cache_dir=root).state in ("ready", "partial", "local")
        ]
        if not names:
            raise FetchError("nothing in the cache to verify", hint="run: specchat models fetch")
    failed = 0
    for name in names:
        columns = (
            TextColumn("  {task.description:<34}"),
            BarColumn(bar_width=24),
            DownloadColumn(),
        )
        bars = Progress(*columns, console=out, transient=True, disable=not out.is_terminal)
        with bars as progress:
            tasks: dict[str, TaskID] = {}

            def show(ev: LoadProgress, progress: Progress = progress, tasks: dict = tasks) -> None:
                if ev.unit != "B":
                    return
                if ev.detail not in tasks:
                    tasks[ev.detail] = progress.add_task(f"verify {ev.detail}", total=ev.total)
                progress.update(tasks[ev.detail], completed=ev.done)

            try:
                lines = fetch.verify_preset(name, cache_dir=root, progress=show)
            except FetchError as exc:
                failed += 1
                progress.stop()
                out.print(f"[red]{name}: FAILED[/] {exc.message}", soft_wrap=True)
                if exc.hint:
                    out.print(f"  [dim]hint:[/] {exc.hint}", soft_wrap=True)
                continue
        out.print(f"[green]{name}: ok[/]")
        for line in lines:
            out.print(f"  {line}", soft_wrap=True)
    if failed:
        print(f"error: {failed} of {len(names)} presets failed verification", file=sys.stderr)
        return 1
    return 0


def _path(args: argparse.Namespace, out: Console) -> int:
    from specchat.engine.errors import FetchError
    from specchat.engine.weights import fetch

    _check_names([args.name])
    st = fetch.preset_status(args.name, cache_dir=args.cache_dir)
    if st.state not in ("ready", "local") or st.path is None:
        raise FetchError(
            f"{args.name} is not ready ({st.detail or st.state})",
            hint=f"run: specchat models fetch {args.name}",
        )
    print(st.path)  # plain, for $(specchat models path NAME)
    return 0


def _rm(args: argparse.Namespace, out: Console) -> int:
    from specchat.engine.weights import fetch

    _check_names([args.name])
    freed = fetch.remove_preset(args.name, cache_dir=args.cache_dir)
    if freed:
        out.print(f"removed {args.name} ({fetch.human_bytes(freed)} freed)")
    else:
        out.print(f"{args.name} was not in the cache")
    return 0
