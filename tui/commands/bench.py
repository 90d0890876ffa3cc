"""`specchat bench`: decoding modes side by side with transformers' generate, headless.

Runs the modes over a prompt file (interleaved, after a warm-up), prints a
table, and writes result.json and plots (PNG and SVG) into --out.
`--configs none:bfloat16,int8/int4` runs every mode on several model
configurations (quantization, dtype) in the same interleaved run.
`specchat bench --show DIR/result.json` prints the tables of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from specchat.engine.config import LOCAL_MODES, SPEC_ALONE, SPEC_CHAIN, SPEC_SERIAL, SPEC_VARIANTS

from . import common

ALL_MODES = ",".join(m.value for m in LOCAL_MODES)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark decoding modes against transformers' generate",
        description="Benchmark decoding modes over a JSONL prompt file: tokens/s, speedup, "
        "time to first token, per-token latency, acceptance, early exit and memory, next to "
        "transformers' own model.generate (plain and assisted) on the same models. "
        "--server URL[,URL...] adds a served engine per URL as one more arm of the same run.",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        help='JSONL file, one {"id", "kind", "messages": [{"role", "content"}]} per line',
    )
    p.add_argument(
        "--modes",
        default=ALL_MODES,
        help=f"comma-separated modes to run (default: {ALL_MODES}); "
        f"{SPEC_ALONE}: spec with the draft model alone, without lookup first; "
        f"{SPEC_SERIAL}: spec drafting then verifying in turns, the draft never ahead on "
        f"a core of its own; {SPEC_CHAIN}: spec with chains of drafts only, never a draft tree",
    )
    add_run_args(p)
    common.add_server_args(p)
    p.add_argument(
        "--configs",
        default=None,
        metavar="SPEC[,SPEC...]",
        help="model configurations to compare in one run, each "
        "TARGETQUANT[/DRAFTQUANT[+vN]][:DTYPE][~W4A8PATH] (draft quant: the target's; +vN: the "
        "draft's head over N ids; dtype: --dtype; ~avx2, ~avx512vnni or ~amx: the w4a8 kernel's code "
        "for that config's runs), e.g. none:bfloat16,int8/int4,w8a8,w4a8/w4a8+v65536,w4a8~avx2; "
        "every mode runs on every config, labelled mode@config "
        "(default: one config from --target-quant/--draft-quant/--dtype)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per prompt and mode (default 3)"
    )
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run transformers' generate, plain and with assistant_model (default: on)",
    )
    p.add_argument(
        "--baseline-config",
        default=None,
        metavar="SPEC",
        help="the config of --configs the transformers baselines run on (default: the first)",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="ARM",
        help="the arm speed ratios (×ref) are taken against, e.g. plain or plain@int8/int4 "
        "(default: hf-generate, or the first arm without baselines)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: bench-results/<time>)"
    )
    p.add_argument("--no-plots", action="store_true", help="write the JSON only")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port while the benchmark runs (0: any free port)",
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
    )
    p.add_argument(
        "--show",
        type=Path,
        default=None,
        help="print the tables of an earlier result.json and exit",
    )
    p.set_defaults(func=run)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Model and decoding flags shared by bench, ab and serve-metrics."""
    common.add_model_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens per reply (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--k", type=int, default=None, help="force K draft tokens (default: adaptive)")
    g.add_argument(
        "--siblings",
        type=int,
        default=None,
        metavar="S",
        help="spec: the draft's second guess beside depths 1..S (default: the controller "
        f"chooses; the {SPEC_CHAIN} arm: never)",
    )
    g.add_argument("--exit-threshold", type=float, default=None)
    g.add_argument("--exit-layer", type=int, default=None, help="self-spec draft depth")


def error(message: str, hint: str = "") -> int:
    print(f"specchat: error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return 2


def load_session(args: argparse.Namespace, console: Any, label: str = "") -> Any:
    """ChatSession from the model flags, with load progress on `console` (stderr)."""
    from rich.progress import BarColumn, Progress, TextColumn

    from specchat.engine.decode.session import ChatSession
    from specchat.engine.events import LoadProgress

    target, draft = common.model_specs(args)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
        transient=True,
    ) as bar:
        tasks: dict[str, Any] = {}

        def progress(ev: LoadProgress) -> None:
            if ev.stage not in tasks:
                tasks[ev.stage] = bar.add_task(ev.stage, total=ev.total, detail="")
            detail = ev.detail
            if ev.unit == "B" and ev.total:
                detail = f"{detail} {ev.done / 1e6:.0f}/{ev.total / 1e6:.0f} MB"
            bar.update(tasks[ev.stage], completed=ev.done, total=ev.total, detail=detail)

        session = ChatSession.load(
            target,
            draft,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            progress=progress,
            threads=args.threads,
            draft_head=getattr(args, "draft_head", "auto"),
        )
    console.print(f"[dim]{f'config {label}: ' if label else ''}{session.ready.summary}[/dim]")
    for note in session.ready.notes:
        console.print(f"[dim]  {note}[/dim]")
    return session


def config_args(args: argparse.Namespace, spec: Any) -> argparse.Namespace:
    """The model flags with one config's quantizations and dtype."""
    return argparse.Namespace(
        **{
            **vars(args),
            "target_quant": spec.target_quant,
            "draft_quant": spec.draft_quant,
            "dtype": spec.dtype,
            "draft_vocab": spec.draft_vocab if spec.draft_vocab is not None else args.draft_vocab,
        }
    )


def plan_configs(
    args: argparse.Namespace, modes: list[str]
) -> tuple[list[Any] | None, str | None, str | None]:
    """(config specs or None for one config from the flags, baseline config label,
    reference arm label), checked before any model is loaded. Raises EngineError."""
    from specchat.engine.tools.bench_runs import (
        BASELINES,
        ConfigSpecError,
        find_arm,
        find_config,
        make_arms,
        parse_config_specs,
    )

    specs = None
    baseline = None
    if args.configs is not None:
        if args.target_quant != "auto" or args.draft_quant != "auto":
            raise ConfigSpecError(
                "--configs sets the quantizations; --target-quant and --draft-quant do not apply",
                hint="drop --target-quant/--draft-quant, or write them into each config",
            )
        specs = parse_config_specs(args.configs, args.dtype)
        baseline = specs[0].label
        if args.baseline_config is not None:
            baseline = find_config(specs, args.baseline_config, args.dtype).label
    elif args.baseline_config is not None:
        raise ConfigSpecError(
            "--baseline-config needs --configs", hint="without --configs there is one config"
        )
    reference = None
    if args.reference is not None:
        labels = [s.label for s in specs] if specs else ["-"]
        base = list(BASELINES) if args.baseline else []
        arms = make_arms(labels, modes, base, baseline or labels[0])
        reference = find_arm(arms, args.reference, specs or (), args.dtype).label
    return specs, baseline, reference


def wide_console() -> Any:
    """Standard output; 120 columns when it is a file or a pipe (rich would assume 80)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def quiet_transformers() -> None:
    """transformers warns about flags assisted generation sets itself; keep stderr readable."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    out = wide_console()
    err = Console(stderr=True)
    if args.show is not None:
        try:
            data = json.loads(args.show.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            return error(f"cannot read {args.show}: {exc}")
        print_result(data, out)
        return 0
    if args.prompts is None:
        return error("--prompts is required", hint="e.g. --prompts prompts.jsonl")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in {x.value for x in LOCAL_MODES} | set(SPEC_VARIANTS)]
    if bad:
        return error(
            f"unknown mode(s) {', '.join(bad)}",
            hint=f"choose from {ALL_MODES},{','.join(SPEC_VARIANTS)}",
        )
    if args.repeats < 1:
        return error("--repeats must be at least 1")

    from specchat.engine.errors import EngineError
    from specchat.engine.tools.bench import load_configs, load_prompts

    try:
        specs, baseline_config, reference = plan_configs(args, modes)
        prompts = load_prompts(args.prompts)
        cfg = common.decode_config(args)
    except EngineError as exc:
        return error(exc.message, exc.hint)
    except ValueError as exc:
        return error(str(exc))
    if args.limit:
        prompts = prompts[: args.limit]
    out_dir = args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")

    quiet_transformers()
    try:
        if specs is None:
            session: Any = load_session(args, err)
        else:
            session = load_configs(
                specs, lambda spec: load_session(config_args(args, spec), err, spec.label)
            )
    except EngineError as exc:
        return error(exc.message, exc.hint)

    remote = []
    for url in (u.strip() for u in (getattr(args, "server", None) or "").split(",")):
        if not url:
            continue
        try:
            remote.append(
                common.connect_server(argparse.Namespace(**{**vars(args), "server": url}))
            )
        except EngineError as exc:
            return error(exc.message, exc.hint)
        err.print(f"[dim]server arm: {remote[-1].ready.summary}[/dim]")

    telemetry = server = None
    if args.metrics_port is not None:
        from specchat.engine.tools.telemetry import Telemetry

        telemetry = Telemetry()
        try:
            server = telemetry.serve(args.metrics_port, args.metrics_host)
        except OSError as exc:
            return error(
                f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                hint="choose another --metrics-port",
            )
        err.print(f"metrics: {server.url}")
    t0 = time.perf_counter()
    try:
        result = run_with_progress(
            session, prompts, modes, cfg, args, err, telemetry, baseline_config, reference, remote
        )
    finally:
        if server is not None:
            server.close()
    data = result.to_dict()
    path = result.write_json(out_dir / "result.json")
    files = [path]
    if not args.no_plots:
        from specchat.engine.tools.bench_plots import write_plots

        files += write_plots(data, out_dir)
    print_result(data, out)
    out.print(f"\nwall time {time.perf_counter() - t0:.0f} s; wrote {path}")
    if len(files) > 1:
        out.print(f"plots: {', '.join(f.name for f in files[1:])} in {out_dir}")
    return 0


def run_with_progress(
    session: Any,
    prompts: list[Any],
    modes: list[str],
    cfg: Any,
    args: argparse.Namespace,
    console: Any,
    telemetry: Any,
    baseline_config: str | None = None,
    reference: str | None = None,
    remote: Any = None,
) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specchat.engine.tools.bench import BenchProgress, run_bench

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("bench", total=None)

        t0 = time.perf_counter()

        def progress(ev: BenchProgress) -> None:
            label = f"{ev.phase} {ev.arm} {ev.prompt_id}".strip()
            bar.update(task, completed=ev.done, total=ev.total, description=label)
            if not console.is_terminal:  # a log file gets one line per run instead of a bar
                console.print(f"[{ev.done}/{ev.total}] {time.perf_counter() - t0:.0f}s {label}")

        return run_bench(
            session,
            prompts,
            arms=modes,
            baselines=args.baseline,
            baseline_config=baseline_config,
            reference=reference,
            config=cfg,
            repeats=args.repeats,
            seed=args.seed,
            warmup=not args.no_warmup,
            progress=progress,
            telemetry=telemetry,
            remote=remote,
        )


# -- rendering ---------------------------------------------------------------------


def _num(v: float | None, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _speed(v: float | None) -> str:
    """Tokens/s with three significant figures at most (0.87, 12.4, 145)."""
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _ratio(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.2f}x"


def _table(title: str, columns: list[str]) -> Any:
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, col in enumerate(columns):
        if i == 0:
            t.add_column(col, justify="left", no_wrap=True)
        else:
            t.add_column(col, justify="right")
    return t


def _mode(arm: str) -> str:
    return arm.partition("@")[0]


def _mb(v: int | None) -> str:
    return _speed(v / 2**20) if v is not None else "-"


def _kb(v: int | None) -> str:
    return _speed(v / 2**10) if v is not None else "-"


def print_configs(configs: list[dict[str, Any]], console: Any) -> None:
    """Per config: quantization and dtype as loaded, weights and KV cache per token, RSS."""
    t = _table(
        "configs (RSS is the whole process, every config loaded)",
        ["config", "loaded as", "target MB", "KV KB/tok", "draft MB", "KV KB/tok",
         "load +RSS MB", "peak RSS MB"],
    )  # fmt: skip
    for c in configs:
        m, mem = c["models"], c["memory"]
        tgt, drf = m["target"], m.get("draft")
        quants = f"{tgt['quant']}/{drf['quant']}" if drf else tgt["quant"]
        t.add_row(
            c["label"],
            f"{quants} {tgt['dtype']}",
            _mb(mem["target_weight_bytes"]),
            _kb(mem["target_kv_bytes_per_token"]),
            _mb(mem["draft_weight_bytes"]),
            _kb(mem["draft_kv_bytes_per_token"]),
            _mb(mem.get("load_rss_delta_bytes")),
            _mb(mem.get("peak_rss_bytes")),
        )
    console.print(t)


def print_result(data: dict[str, Any], console: Any) -> None:
    """The tables of a result.json, this version's or an earlier one's (no configs, no
    reference: one config, ratios against plain and hf-generate)."""
    env, models, cfg = data["environment"], data["models"], data["config"]
    configs = data.get("configs") or []
    several = len(configs) > 1
    tgt, drf = models["target"], models.get("draft")
    if several:
        head = f"target {tgt['name']}" + (f", draft {drf['name']}" if drf else "")
        head += f"; configs {', '.join(c['label'] for c in configs)}"
    else:
        head = f"target {tgt['name']} ({tgt['dtype']}, {tgt['quant']})"
        if drf:
            head += f", draft {drf['name']} ({drf['dtype']}, {drf['quant']})"
    dec = cfg["decode"]
    console.print(
        f"[bold]{head}[/bold]\n"
        f"device {env['device']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
        + (f"CPU {env['cpu']} ({env['cpu_features']}), " if env.get("cpu_features") else "")
        + (f"w4a8 {env['w4a8_path']} path, " if env.get("w4a8_path") else "")
        + f"transformers {env['transformers']}; {len(cfg['prompts'])} prompts x {cfg['repeats']} "
        f"repeats, max_new_tokens {dec['max_new_tokens']}, temperature {dec['temperature']}, "
        f"seed {cfg['seed']}"
    )
    for c in configs:  # where the w4a8 kernel's VNNI code starts, and what the load measured
        rows = c.get("w4a8_vnni_rows")
        if rows:
            said = f": {rows['why']}" if rows.get("why") else ""
            name = f"{c['label']}: " if several else ""
            n = rows["from"]
            console.print(f"{name}w4a8 VNNI code from {n} row{'s' if n != 1 else ''}{said}")
    for label, summary in (cfg.get("server") or {}).items():
        console.print(f"{label} arm: {summary}; its =plain compares text (a server sends no ids)")
    if several:
        print_configs(configs, console)
    summary = data["summary"]
    arms = data["arms"]
    ok_arms = [a for a in arms if summary[a]["status"] == "ok"]
    notes = [
        f"{a}: {summary[a]['status']}: {summary[a].get('reason')}" for a in arms if a not in ok_arms
    ]
    reference = data.get("reference")
    hf_gen = next((a for a in arms if _mode(a) == "hf-generate"), None)
    show_ref = (
        reference is not None and reference != hf_gen and not (not several and reference == "plain")
    )
    ratio_notes = ["×plain: against the plain arm of the same config"] if several else []
    ratio_notes.append("decode: ×plain after each reply's first token (the prefill is every arm's alike)")
    if show_ref:
        ratio_notes.append(f"×ref: against {reference}")
    first = "arm" if several else "mode"
    speed = _table(
        "speed (medians over runs; ratios paired within each block)",
        [first, "tok/s", "range", "×plain", "decode", "×hf-gen", *(["×ref"] if show_ref else []),
         "TTFT ms", "p50 ms", "p95 ms", "RSS MB", "=plain"],
    )  # fmt: skip
    decoding = _table(
        "decoding",
        [first, "accept", "acc len", "tok/pass", "c", "v", "o", "accept by position %",
         "exit", "layers", "fallbacks"],
    )  # fmt: skip
    for arm in arms:
        f = summary[arm]
        if arm not in ok_arms:
            speed.add_row(arm, f"[dim]{f['status']}[/dim]", *[""] * (len(speed.columns) - 2))
            continue
        tps = f["tokens_per_s"]
        same = f.get("same_tokens_as_plain")
        ref_cell = [_ratio(f.get("speedup_vs_reference"))] if show_ref else []
        speed.add_row(
            arm,
            _speed(tps["median"]),
            f"{_speed(tps['min'])}-{_speed(tps['max'])}",
            _ratio(f.get("speedup_vs_plain")),
            _ratio(f.get("decode_speedup_vs_plain")),
            _ratio(f.get("speedup_vs_hf-generate")),
            *ref_cell,
            _num(f["ttft_s"] * 1e3 if f["ttft_s"] is not None else None, "{:.0f}"),
            _num(f["latency_ms"]["p50"]),
            _num(f["latency_ms"]["p95"]),
            _num(f["peak_rss_bytes"] / 2**20 if f["peak_rss_bytes"] else None, "{:.0f}"),
            f"{same['equal']}/{same['compared']}" if same else "",
        )
        by_pos = f.get("acceptance_by_position") or []
        decoding.add_row(
            arm,
            _num(f["acceptance_rate"], "{:.2f}"),
            _num(f["mean_accepted_length"], "{:.2f}"),
            _num(f["tokens_per_target_pass"], "{:.2f}"),
            _num(f.get("cost_ratio_c"), "{:.2f}"),
            _num(f.get("verify_ratio_v"), "{:.2f}"),
            _num(f.get("catch_up_o"), "{:.2f}"),
            " ".join(_num(v * 100 if v is not None else None, "{:.0f}") for v in by_pos[:8]) or "-",
            _num(f["exit_rate"], "{:.2f}"),
            _num(f["mean_layers"], "{:.1f}"),
            str(f["fallbacks"]),
        )
    console.print(speed)
    if ratio_notes:
        console.print(f"[dim]{'; '.join(ratio_notes)}[/dim]")
    console.print(decoding)

    kinds = data.get("by_kind") or {}
    if len(kinds) > 1:
        arms = ok_arms
        kt = _table("tokens/s by prompt kind (×plain)", ["kind"])
        for a in arms:
            kt.add_column(a, justify="right")
        for kind, per_arm in kinds.items():
            cells = []
            for a in arms:
                f = per_arm[a]
                cell = _speed(f["tokens_per_s"]["median"])
                if _mode(a) != "plain" and "speedup_vs_plain" in f:
                    cell += f" ({_ratio(f['speedup_vs_plain'])})"
                cells.append(cell)
            kt.add_row(kind, *cells)
        console.print(kt)

    noise = data["noise"]
    start, end = noise["load_start"], noise["load_end"]

    def load(x: dict[str, Any]) -> str:
        la = x.get("loadavg")
        cpu = x.get("cpu_percent")
        return f"load {'/'.join(f'{v:.2f}' for v in la) if la else '-'}, CPU {_num(cpu, '{:.0f}')}%"

    spreads = ", ".join(
        f"{a} {summary[a]['noise'] * 100:.0f}%"
        for a in data["arms"]
        if summary[a]["status"] == "ok" and summary[a].get("noise") is not None
    )
    console.print(
        f"noise: at start {load(start)}; at end {load(end)} (loadavg 1/5/15 min over "
        f"{env.get('cpus_usable')} usable CPUs); tok/s spread (max-min)/median: {spreads or '-'}"
    )
    console.print(f"[dim]{cfg['cache_policy']}; benchmark {data['seconds']:.0f} s.[/dim]")
    for n in notes:
        console.print(f"[yellow]{n}[/yellow]")
