"""Where a speculative reply's time goes: each round's wall time against its own timers.

A round reports how long its drafts took and how long the target's pass took
(RoundEvent.draft_ms, verify_ms); the controller prices rounds from those. This
script runs the given modes on every prompt in turn (so drift in a shared
machine's speed hits all alike), times the gap between consecutive RoundEvents
as the caller sees it, and prints per (mode the round ran, K): rounds, tokens,
median gap, draft and verify times, the draft's catch-up passes (RoundEvent.catch_up_ms,
summed), and the untimed rest (gap - draft - verify - catch-up: Python between rounds),
medians and sums. A whole reply's
ms/token next to plain's says whether speculation pays; the untimed column says
how much of its cost the controller never sees. Each prompt's last message is
asked alone, in a fresh conversation.

    python scripts/round_times.py --modes plain,spec --prompts ../shared/prompts/dev_prompts.jsonl
    python scripts/round_times.py --modes plain,eagle --out rounds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from specchat.engine.config import DecodeConfig, Mode, ModelSpec, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import RoundEvent, TokenEvent
from specchat.engine.model import cpu
from specchat.engine.weights.registry import DEFAULT_PAIR


def rounds_of(session: ChatSession, prompt: str, cfg: DecodeConfig) -> list[dict[str, Any]]:
    """One fresh reply: a row per round after the first (the first one's gap is the prefill)."""
    session.reset(drop_caches=True)
    rows: list[dict[str, Any]] = []
    t_prev: float | None = None
    tokens = 0
    for ev in session.stream(prompt, cfg):
        now = time.perf_counter()
        if isinstance(ev, TokenEvent):
            tokens += 1
        elif isinstance(ev, RoundEvent):
            if t_prev is not None:
                rows.append({"mode": ev.mode.value, "k": ev.k, "accepted": ev.accepted,
                             "draft_ms": ev.draft_ms, "verify_ms": ev.verify_ms,
                             "catch_up_ms": ev.catch_up_ms, "drafter": ev.drafter,
                             "gap_ms": (now - t_prev) * 1e3, "tokens": tokens})
            t_prev, tokens = now, 0
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    gap = sum(r["gap_ms"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    lines = [f"{len(rows)} rounds, {tokens} tokens, {gap / max(tokens, 1):.1f} ms a token"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:  # a composed reply's copies apart from the model's rounds
        mode = r["mode"] + ("/copy" if r.get("drafter") == "lookup" and r["mode"] != "lookup" else "")
        groups[(mode, r["k"])].append(r)
    lines.append(f"  {'round':<15}{'n':>5}{'tokens':>8}{'gap':>8}{'draft':>8}{'verify':>8}"
                 f"{'catch-up sum':>14}{'untimed':>9}{'untimed sum':>13}")
    for (mode, k), g in sorted(groups.items()):
        timed = ("draft_ms", "verify_ms", "catch_up_ms")
        untimed = [r["gap_ms"] - sum(r[t] for t in timed) for r in g]
        med = statistics.median
        lines.append(
            f"  {mode + ' K=' + str(k):<15}{len(g):>5}{sum(r['tokens'] for r in g):>8}"
            f"{med(r['gap_ms'] for r in g):>8.1f}{med(r['draft_ms'] for r in g):>8.1f}"
            f"{med(r['verify_ms'] for r in g):>8.1f}{sum(r['catch_up_ms'] for r in g):>11.0f} ms"
            f"{med(untimed):>9.1f}{sum(untimed):>11.0f} ms"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="plain,spec")
    ap.add_argument("--prompts", default=str(Path(__file__).parents[1].parent / "shared/prompts/dev_prompts.jsonl"))
    ap.add_argument("--target", default=DEFAULT_PAIR[0])
    ap.add_argument("--draft", default=DEFAULT_PAIR[1])
    ap.add_argument("--quant", default="w4a8")
    ap.add_argument("--draft-quant", default="w4a8-g128")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--out", type=Path, default=None, help="write every round here (JSON)")
    args = ap.parse_args()
    modes = [Mode(m) for m in args.modes.split(",")]
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit]
    session = ChatSession.load(
        ModelSpec(args.target, quant=QuantMode(args.quant)),
        ModelSpec(args.draft, quant=QuantMode(args.draft_quant)),
        threads=args.threads,
        draft_head="auto" if Mode.EAGLE in modes else "none",
    )
    print(f"CPU: {cpu.features().summary()}, {args.threads} threads", file=sys.stderr)
    got: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in prompts:
        for mode in modes:  # in turns, prompt by prompt
            cfg = DecodeConfig(mode=mode, max_new_tokens=args.max_new_tokens)
            got[mode.value] += rounds_of(session, p["messages"][-1]["content"], cfg)
    for mode_name, rows in got.items():
        print(mode_name + ": " + "\n".join(summary(rows)))
    if args.out:
        args.out.write_text(json.dumps(got))


if __name__ == "__main__":
    main()
