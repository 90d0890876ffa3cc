"""Greedy acceptance traces, and the speculation controller replayed on them.

Under greedy decoding a draft token is accepted exactly when the draft's argmax
equals the target's token at that position, and the target's reply is the same
whatever the drafting. So one plain reply per prompt and one draft pass over it
give, for every position, whether a draft proposed there would be accepted: a
trace. Any drafting policy can then be priced offline, in target steps, from
measured costs: c per draft step, v(K) per verify pass, a catch-up pass over a
plain stretch. The controller is the engine's own (`engine/decode/controller.py`).

    python scripts/accept_trace.py record --prompts ../shared/prompts/dev_prompts.jsonl \\
        --out trace.json --max-new-tokens 128
    python scripts/accept_trace.py replay trace.json --c 0.4,0.5 --verify 1.22,1.39,1.6,1.95
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specchat.engine.config import DecodeConfig, Mode, ModelSpec, QuantMode
from specchat.engine.decode.controller import Controller
from specchat.engine.decode.costs import Costs


def record(args: argparse.Namespace) -> None:
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.events import TurnStarted
    from specchat.engine.model.runner import ModelRunner

    q = QuantMode(args.quant)
    draft_spec = ModelSpec(args.draft, quant=q, head_shortlist=args.draft_vocab)
    session = ChatSession.load(ModelSpec(args.target, quant=q), draft_spec, threads=args.threads)
    assert session.draft is not None
    runner = ModelRunner(session.draft.model, session.draft.device)
    feed_ms: dict[int, float] = {}  # the draft catching up on n tokens
    for n in (1, 2, 8, 24, 48):
        times = []
        for _ in range(3):
            runner.reset()
            runner.prefill(list(range(100, 140)))
            t = time.perf_counter()
            runner.feed(list(range(200, 200 + n)))
            times.append((time.perf_counter() - t) * 1e3)
        feed_ms[n] = statistics.median(times)
    prompts = []
    for line in Path(args.prompts).read_text().splitlines():
        p = json.loads(line)
        session.reset()
        cfg = DecodeConfig(mode=Mode.PLAIN, max_new_tokens=args.max_new_tokens)
        events = list(session.stream(p["messages"][-1]["content"], cfg))
        n_prompt = next(e.prompt_tokens for e in events if isinstance(e, TurnStarted))
        ids = list(session.tokens)
        runner.reset()
        guess = runner.feed(ids, keep=len(ids)).argmax(-1).tolist()  # guess[i]: token i+1
        match = [int(guess[i - 1] == ids[i]) for i in range(n_prompt, len(ids))]
        prompts.append({"id": p["id"], "prompt_tokens": n_prompt, "ids": ids, "match": match})
        print(f"{p['id']}: {len(match)} tokens, draft argmax = target on {sum(match)}")
    costs = session.costs
    out = {
        "target": args.target,
        "draft": args.draft,
        "quant": args.quant,
        "draft_vocab": args.draft_vocab,
        "costs": {
            "target_step_ms": costs.target_step_ms,
            "draft_step_ms": costs.draft_step_ms,
            "verify_at": costs.verify_at,
        },
        "feed_ms": feed_ms,
        "prompts": prompts,
    }
    Path(args.out).write_text(json.dumps(out))


def replay_one(
    match: list[int],
    k_forced: int | None,
    c: float,
    verify: dict[int, float],
    feed: dict[int, float],
) -> tuple[float, int]:
    """Speedup over plain decoding of one reply, and the controller's fallbacks."""

    def catch_up(n: int) -> float:  # steps to feed n missed tokens; <= 2 ride in propose
        if n <= 2:
            return 0.0
        pts = sorted(feed)
        for a, b in zip(pts, pts[1:], strict=False):
            if a <= n <= b:
                return feed[a] + (feed[b] - feed[a]) * (n - a) / (b - a)
        return feed[pts[-1]] * n / pts[-1]

    step = 100.0
    measured = {k: verify[k] for k in (1, 4) if k in verify}  # what the session measures at load
    ctl = Controller(DecodeConfig(k=k_forced), Costs(step, c * step, 0.2, measured))
    t, cost, unseen, fallbacks, full = 0, 0.0, 0, 0, False
    while t < len(match):
        mode, k = ctl.next()
        k = min(k, len(match) - t - 1, max(verify))
        if mode is Mode.PLAIN or k < 1:
            cost, t, unseen = cost + 1, t + 1, unseen + 1
            ctl.observe_plain(step)
            continue
        # A round after a fully accepted one feeds two pending tokens: ~0.2 of a step more.
        draft = catch_up(unseen + 1) + k * c + (0.2 * c if full else 0.0)
        accepted = 0
        while accepted < k and match[t + accepted]:
            accepted += 1
        cost += draft + verify[k]
        t, unseen, full = t + accepted + 1, 0, accepted == k
        ctl.observe_round(k, accepted, k * c * step, verify[k] * step)
        if (ctl.take_reason() or "").startswith("fallback"):
            fallbacks += 1
    return len(match) / cost, fallbacks


def replay(args: argparse.Namespace) -> None:
    trace = json.loads(Path(args.trace).read_text())
    verify = {k + 1: float(v) for k, v in enumerate(args.verify.split(","))}
    step = trace["costs"]["target_step_ms"]
    feed = {int(n): ms / step for n, ms in trace["feed_ms"].items()}
    policies: list[tuple[str, int | None]] = [(f"K={k}", k) for k in sorted(verify)]
    policies.append(("adaptive", None))
    ids = [p["id"] for p in trace["prompts"]]
    print(f"trace {args.trace}: {len(ids)} replies; v(K) = {verify}")
    for c in (float(x) for x in args.c.split(",")):
        print(f"\nc = {c}: speedup over plain (median, then per reply: {' '.join(ids)})")
        for name, k in policies:
            runs = [replay_one(p["match"], k, c, verify, feed) for p in trace["prompts"]]
            speedups = [s for s, _ in runs]
            per = " ".join(f"{s:.2f}" for s in speedups)
            fb = sum(f for _, f in runs)
            print(f"  {name:9s} {statistics.median(speedups):.3f}  [{per}]  fallbacks {fb}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="plain replies and the draft's guesses at every position")
    rec.add_argument("--prompts", required=True)
    rec.add_argument("--out", required=True)
    rec.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    rec.add_argument("--quant", default="w4a8")
    rec.add_argument("--draft-vocab", type=int, default=0)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rep = sub.add_parser("replay", help="price drafting policies on a recorded trace")
    rep.add_argument("trace")
    rep.add_argument("--c", default="0.4", help="draft/target step cost ratios to try")
    rep.add_argument(
        "--verify", default="1.22,1.39,1.6,1.95", help="v(K) for K = 1, 2, ... in target steps"
    )
    args = ap.parse_args()
    record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    main()
