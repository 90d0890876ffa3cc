"""`specchat ab`: does mode B produce what mode A produces?

Greedy: per prompt, token identity, the first divergence and the target's
logit margin there (near-tie = numerics, wide margin = a bug), and the
agreement with the full target. The report first says whether the two modes
must be token-identical here (a batch-invariant target: then any divergence,
near-tie or not, is a bug) or are exact in distribution and equal up to
floating-point ties, and why. Sampled (--temperature > 0 or --dist-seeds):
a distribution check of the first tokens over many seeds. Exit status 1
when a lossless pair shows a wide-margin divergence or the check fails.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from specchat.engine.config import LOCAL_MODES

from . import bench as bench_cmd

ARMS = [m.value for m in LOCAL_MODES] + ["hf-generate", "hf-assisted"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ab",
        help="compare two decoding modes token by token (and in distribution)",
        description="A/B quality check: run modes A and B on the same prompts with the same "
        "seed; report token identity, the first divergence with the target's logit margin "
        "there, and agreement with the full target. With sampling, compare the distribution "
        "of the first tokens over many seeds (chi-square test).",
    )
    p.add_argument("--prompts", type=Path, required=True, help="JSONL prompt file")
    p.add_argument("--a", default="plain", choices=ARMS, help="reference mode (default plain)")
    p.add_argument("--b", default="spec", choices=ARMS, help="mode under test (default spec)")
    bench_cmd.add_run_args(p)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument(
        "--tie-threshold",
        type=float,
        default=None,
        help="logit margin under which a divergence counts as numerics "
        "(default: 0.01 float32, 0.1 float16, 0.5 bfloat16 or quantized)",
    )
    g = p.add_argument_group("distribution check (sampled decoding)")
    g.add_argument(
        "--dist-seeds",
        type=int,
        default=None,
        help="seeds per mode (default: 200 when --temperature > 0, else off; 0 = off)",
    )
    g.add_argument("--dist-tokens", type=int, default=2, help="tokens compared per reply")
    g.add_argument(
        "--dist-temperature",
        type=float,
        default=None,
        help="sampling temperature of the check (default: --temperature, or 1.0)",
    )
    g.add_argument("--alpha", type=float, default=0.01, help="significance level (default 0.01)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specchat.engine.errors import EngineError
    from specchat.engine.tools.ab import distribution_check, run_ab
    from specchat.engine.tools.bench import load_prompts

    from . import common

    out = bench_cmd.wide_console()
    err = Console(stderr=True)
    try:
        prompts = load_prompts(args.prompts)
        cfg = common.decode_config(args)
    except EngineError as exc:
        return bench_cmd.error(exc.message, exc.hint)
    except ValueError as exc:
        return bench_cmd.error(str(exc))
    if args.limit:
        prompts = prompts[: args.limit]
    seeds = args.dist_seeds
    if seeds is None:
        seeds = 200 if cfg.temperature > 0 else 0
    if seeds and (args.a not in {m.value for m in LOCAL_MODES} or args.b not in {m.value for m in LOCAL_MODES}):
        return bench_cmd.error("the distribution check compares session modes, not hf-* baselines")

    bench_cmd.quiet_transformers()
    try:
        session = bench_cmd.load_session(args, err)
    except EngineError as exc:
        return bench_cmd.error(exc.message, exc.hint)

    t0 = time.perf_counter()
    with err.status("") as status:

        def progress(i: int, n: int, pid: str) -> None:
            status.update(f"A/B {args.a} vs {args.b}: prompt {i + 1}/{n} {pid}")

        result = run_ab(
            session,
            prompts,
            args.a,
            args.b,
            config=cfg,
            seed=args.seed,
            tie_threshold=args.tie_threshold,
            progress=progress,
        )
        if seeds:
            temp = args.dist_temperature or (cfg.temperature if cfg.temperature > 0 else 1.0)

            def dist_progress(i: int, n: int, pid: str) -> None:
                status.update(f"distribution check: seed {i + 1}/{n} on {pid}")

            result.distribution = distribution_check(
                session,
                prompts[0],
                args.a,
                args.b,
                seeds=seeds,
                n_tokens=args.dist_tokens,
                config=cfg.with_(temperature=temp),
                alpha=args.alpha,
                first_seed=args.seed,
                progress=dist_progress,
            )
    print_ab(result.to_dict(), session.tokenizer, out)
    out.print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if args.out:
        out.print(f"wrote {result.write_json(args.out)}")
    return 0 if result.ok else 1


def _tok(tokenizer: Any, t: int | None) -> str:
    if t is None:
        return "(end)"
    return f"{t} {tokenizer.decode([t])!r}"


def print_ab(data: dict[str, Any], tokenizer: Any, console: Any) -> None:
    from rich.markup import escape

    cfg = data["config"]
    tgt = data["models"]["target"]
    console.print(
        f"[bold]A/B {data['a']} vs {data['b']}[/bold] on {tgt['name']} ({tgt['dtype']}, "
        f"{tgt['quant']}); {'greedy' if cfg['greedy'] else 'sampled'}, seed {cfg['seed']}, "
        f"max_new_tokens {cfg['decode']['max_new_tokens']}"
    )
    ident = data.get("identity") or {}
    if ident.get("guaranteed"):
        console.print(
            f"[bold]token identity guaranteed[/bold]: {escape(ident['reason'])}. "
            "Any divergence is a bug, whatever the target's margin there."
        )
    else:
        console.print(
            f"[bold]identity not guaranteed[/bold]: {escape(ident.get('reason', 'unknown'))}. "
            "A divergence where the target's top-2 logit margin is under "
            f"{data['tie_threshold']} counts as a near-tie (numerics)."
        )
    t = bench_cmd._table(
        "per prompt",
        ["prompt", "verdict", "first diff", f"{data['a']} token", f"{data['b']} token",
         "target top-2 margin", "agree A", "agree B"],
    )  # fmt: skip
    for c in data["comparisons"]:
        d = c["first_divergence"]
        diverged = d is not None
        t.add_row(
            c["prompt_id"],
            c["verdict"],
            "-" if d is None else str(d),
            escape(_tok(tokenizer, c["token_a"])) if diverged else "",
            escape(_tok(tokenizer, c["token_b"])) if diverged else "",
            bench_cmd._num(c["top2_margin"], "{:.4f}"),
            bench_cmd._num(c["agreement_a"], "{:.2f}"),
            bench_cmd._num(c["agreement_b"], "{:.2f}"),
        )
    console.print(t)
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(data["verdicts"].items()))
    console.print(
        f"{data['identical']}/{data['compared']} token-identical ({verdicts}); "
        f"mean agreement of {data['b']} with the full target: "
        f"{bench_cmd._num(data['mean_agreement_b'], '{:.3f}')}"
    )
    for c in data["comparisons"]:
        if c.get("error"):
            console.print(f"[yellow]{c['prompt_id']}: {escape(c['error'])}[/yellow]")
    dist = data.get("distribution")
    if dist:
        verdict = "[green]pass[/green]" if dist["passed"] else "[red]FAIL[/red]"
        console.print(
            f"\ndistribution of the first {dist['n_tokens']} tokens, {dist['a']} vs {dist['b']}, "
            f"{dist['seeds']} seeds each at temperature {dist['temperature']} on prompt "
            f"{dist['prompt_id']}: chi-square {dist['chi2']:.2f} with {dist['dof']} dof, "
            f"p = {dist['p_value']:.3f} (threshold alpha = {dist['alpha']}) {verdict}; "
            f"total variation {dist['total_variation']:.3f}"
        )
        top = list(dist["counts_a"].items())[:5]
        rows = ", ".join(
            f"{escape(repr(dist['labels'][k]))} {n}/{dist['counts_b'].get(k, 0)}" for k, n in top
        )
        console.print(f"[dim]most frequent ({dist['a']}/{dist['b']} counts): {rows}[/dim]")
    console.print("[bold green]ok[/bold green]" if data["ok"] else "[bold red]NOT OK[/bold red]")
