"""`specchat calibrate`: early-exit thresholds for a target, from a prompt set.

Runs the full target over the prompts (and a short greedy continuation of
each), records per exit layer the confidence and whether the early top-1
equals the full model's, and saves the records under the weights' hash in
`$SPECCHAT_CACHE/calibration/` (default ~/.cache/specchat). Early-exit
decoding loads them automatically and applies its `exit_budget`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import common

REPORT_BUDGETS = (0.8, 0.9, 0.95, 0.99)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate early-exit thresholds of a target on a prompt set",
        description="Run the full target over a prompt set, record how often each exit layer "
        "already predicts the final token, and save thresholds that keep top-1 agreement "
        "with the full model at or above --budget.",
    )
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help='JSONL file of {"id", "kind", "messages"} (like dev_prompts.jsonl)',
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.95,
        help="top-1 agreement with the full model to keep (default 0.95)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=32,
        help="greedy continuation per prompt, so positions include the model's outputs (default 32)",
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument(
        "--exit-layers",
        default=None,
        help="comma-separated exit points in layers executed (default: every quarter)",
    )
    p.add_argument(
        "--measure",
        choices=["softmax", "margin", "saturation"],
        default="softmax",
        help="confidence measure (default softmax: top-1 probability)",
    )
    common.add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specchat.engine.decode.exit_policy import Measure
    from specchat.engine.errors import EngineError
    from specchat.engine.events import LoadProgress
    from specchat.engine.tools.calibration import collect, read_prompts
    from specchat.engine.weights.loading import load_model, set_threads

    if not 0.0 < args.budget <= 1.0:
        return common.fail(f"--budget must be in (0, 1], got {args.budget}")
    try:
        prompts = read_prompts(args.prompts)
    except (OSError, ValueError, KeyError) as exc:
        return common.fail(f"cannot read {args.prompts}: {exc}", "one JSON object per line")
    if args.limit:
        prompts = prompts[: args.limit]
    if not prompts:
        return common.fail(f"no prompts in {args.prompts}")
    layers = None
    if args.exit_layers:
        try:
            layers = [int(x) for x in args.exit_layers.split(",") if x.strip()]
        except ValueError:
            return common.fail(f"--exit-layers takes integers, got {args.exit_layers!r}")

    def progress(event: LoadProgress) -> None:
        total = f"/{event.total}" if event.total is not None else ""
        detail = f" {event.detail}" if event.detail else ""
        print(f"{event.stage}: {event.done}{total}{detail}", file=sys.stderr, flush=True)

    set_threads(args.threads)
    target_spec, _draft = common.model_specs(args)
    try:
        target = load_model(
            target_spec,
            "target",
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            progress=progress,
        )
        cal = collect(
            target,
            [messages for _id, messages in prompts],
            layers=layers,
            new_tokens=args.new_tokens,
            measure=Measure(args.measure),
            budget=args.budget,
            progress=progress,
        )
    except EngineError as exc:
        return common.fail(exc.message, exc.hint)
    except ValueError as exc:
        return common.fail(str(exc))
    path = cal.save()
    print(report(cal, args.budget))
    print(f"saved {path}")
    return 0


def report(cal: Any, budget: float) -> str:
    """Per-layer figures at the chosen budget, then budget against realised agreement."""
    s = cal.summary(budget)
    lines = [
        f"{s.model}: {s.positions} positions, {cal.num_layers} layers, measure {s.measure}",
        "layer  early top-1 = final  threshold  exits",
    ]
    for layer, threshold, share in zip(s.layers, s.thresholds, s.exits_by_layer, strict=True):
        agree = float(cal.records[layer].agree.mean()) if s.positions else 0.0
        shown = f"{threshold:.4f}" if threshold is not None else "off"
        lines.append(f"{layer:5d}  {agree:19.1%}  {shown:>9}  {share:5.1%}")
    lines.append("budget  agreement  (reply)  exit rate  mean layers  est. speedup")
    for b in sorted({*REPORT_BUDGETS, budget}):
        t = cal.summary(b)
        reply = f"{t.reply_agreement:.3f}" if t.reply_agreement is not None else "  n/a"
        mark = " *" if b == budget else ""
        lines.append(
            f"{b:6.2f}  {t.agreement:9.3f}  ({reply})  {t.exit_rate:9.1%}  "
            f"{t.mean_layers:11.2f}  {t.speedup:12.3f}{mark}"
        )
    return "\n".join(lines)
