"""`specchat train-draft`: an EAGLE-3 draft head for a target, trained on this machine.

Collects the target's own replies to the shipped prompt set (greedy, then
sampled rounds while the time lasts) and
answers from the Python standard library's docstrings, runs them through the
target for its features and distributions, trains the head with EAGLE-3's
training-time test within `--minutes`, validates it on held-out replies and
saves it where `--mode eagle` finds it (`<cache>/heads/<weights sha256[:20]>/`,
the speculators layout vLLM serves). Ctrl+C stops and keeps a checkpoint; the
next run resumes from it and from the data already collected.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from . import common


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head for a target on this machine (--mode eagle)",
        description="Train a draft head on the target's own hidden states within a time "
        "budget, validate it on held-out replies, and save it for --mode eagle.",
    )
    p.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    p.add_argument(
        "--head-vocab",
        type=int,
        default=16384,
        metavar="N",
        help="draft vocabulary: the N target ids the target predicts most (default 16384)",
    )
    p.add_argument(
        "--intermediate",
        type=int,
        default=None,
        help="the head's MLP width (default: the target's, at most twice its hidden size)",
    )
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument(
        "--decay",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="the last SHARE of the training time takes the learning rate linearly to zero "
        "(default 0: constant to the end)",
    )
    p.add_argument(
        "--reply-tokens", type=int, default=128, help="tokens of each target reply (default 128)"
    )
    p.add_argument(
        "--reply-rounds",
        type=int,
        default=None,
        metavar="N",
        help="ask the prompts at most N times: greedy replies first, then replies sampled "
        "with a new seed each round (default: while the replies' share of the time lasts)",
    )
    p.add_argument(
        "--reply-weight",
        type=float,
        default=6.0,
        metavar="W",
        help="a training step draws a target reply W times as often as a standard-library "
        "answer (default 6)",
    )
    p.add_argument(
        "--feature-noise",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="uniform noise on the target's features while training, as a share of their "
        "RMS (default 0)",
    )
    p.add_argument(
        "--fc-norm",
        action="store_true",
        help="RMS-norm each of the target's feature layers before the head's fusion layer "
        "(speculators' fc_norm; default off)",
    )
    p.add_argument(
        "--no-collect",
        dest="collect",
        action="store_false",
        help="train on the data an earlier run collected, collecting no more: the whole "
        "budget goes to training (a run that trains on for longer)",
    )
    p.add_argument("--out", type=Path, default=None, help="head folder (default: in the cache)")
    p.add_argument("--seed", type=int, default=0)
    common.add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specchat.engine.errors import EngineError
    from specchat.engine.events import LoadProgress
    from specchat.engine.tools.train_draft import TrainOptions, describe_report, train
    from specchat.engine.weights.loading import load_model, set_threads

    # written so that nan fails too (argparse's float() takes 'nan' and 'inf')
    if not args.minutes > 0:
        return common.fail(f"--minutes must be > 0, got {args.minutes}")
    if not 0 <= args.decay <= 1:
        return common.fail(f"--decay must be between 0 and 1, got {args.decay}")
    if not 0 < args.reply_weight < math.inf:
        return common.fail(f"--reply-weight must be a number > 0, got {args.reply_weight}")
    if args.reply_rounds is not None and args.reply_rounds < 1:
        return common.fail(f"--reply-rounds must be >= 1, got {args.reply_rounds}")
    if not 0 <= args.feature_noise < math.inf:
        return common.fail(f"--feature-noise must be a number >= 0, got {args.feature_noise}")
    if args.head_vocab < 1:
        return common.fail(f"--head-vocab must be >= 1, got {args.head_vocab}")
    last: dict[str, str] = {}

    def progress(event: LoadProgress) -> None:
        total = f"/{event.total}" if event.total is not None else ""
        detail = f" {event.detail}" if event.detail else ""
        line = f"{event.stage}: {event.done}{total}{detail}"
        if sys.stderr.isatty():
            print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)
        elif event.stage != last.get("stage") or event.done % 50 == 0 or event.done == event.total:
            print(line, file=sys.stderr, flush=True)
        last["stage"] = event.stage

    def say(message: str) -> None:
        print(("\n" if sys.stderr.isatty() else "") + message, file=sys.stderr, flush=True)

    threads = set_threads(args.threads)
    target_spec, _draft = common.model_specs(args)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else None
    try:
        from specchat.engine.weights import fetch

        target = load_model(target_spec, "target", cache_dir=cache, progress=progress)
        resolved = fetch.resolve(target_spec.source, cache_dir=cache)
        weights = Path(resolved.pretrained) if Path(resolved.pretrained).is_dir() else None
        say(f"target {target.info.name} ({target.info.quant}, {target.info.device}), {threads} threads")
        result = train(
            target,
            TrainOptions(
                minutes=args.minutes,
                draft_vocab=args.head_vocab,
                intermediate=args.intermediate,
                lr=args.lr,
                decay=args.decay,
                reply_tokens=args.reply_tokens,
                reply_weight=args.reply_weight,
                reply_rounds=args.reply_rounds,
                feature_noise=args.feature_noise,
                fc_norm=args.fc_norm,
                collect=args.collect,
                seed=args.seed,
                out=args.out,
                weights=weights,
            ),
            progress=progress,
            cache_dir=cache,
            say=say,
        )
    except EngineError as exc:
        return common.fail(exc.message, exc.hint)
    except ValueError as exc:
        return common.fail(str(exc))
    except KeyboardInterrupt:
        say("stopped: the checkpoint is kept; run the same command again to resume")
        return 130
    print(describe_report(result))
    print("chat with it: specchat --mode eagle" + (f" --draft-head {result.folder}" if args.out else ""))
    return 0
