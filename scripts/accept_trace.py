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

The trace also keeps where the target's token ranks among the draft's guesses
and whether a shortlist head would still guess it, so draft trees (--trees,
--full-trees) and shortlists (--match N) are priced the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from math import prod
from pathlib import Path

import torch

from specchat.engine.config import DecodeConfig, Mode, ModelSpec, QuantMode
from specchat.engine.decode.controller import Controller
from specchat.engine.decode.costs import Costs
from specchat.engine.decode.speculative import ModelDrafter

RANK_CAP = 7  # ranks beyond this are stored as 7
SHORTLISTS = (8192, 16384, 32768, 65536)


def record(args: argparse.Namespace) -> None:
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.events import TurnStarted
    from specchat.engine.model.draft_head import shortlist_ids, token_ranking
    from specchat.engine.model.runner import ModelRunner

    q = QuantMode(args.quant)
    dq = QuantMode(args.draft_quant) if args.draft_quant else q
    draft_spec = ModelSpec(args.draft, quant=dq, head_shortlist=args.draft_vocab)
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
    tok = session.tokenizer
    ranking = token_ranking(tok, int(session.draft.model.config.vocab_size))
    specials = [int(i) for i in getattr(tok, "all_special_ids", [])]
    specials += [int(i) for i in getattr(tok, "added_tokens_decoder", {})]
    prompts = []
    for line in Path(args.prompts).read_text().splitlines():
        p = json.loads(line)
        session.reset()
        cfg = DecodeConfig(mode=Mode.PLAIN, max_new_tokens=args.max_new_tokens)
        events = list(session.stream(p["messages"][-1]["content"], cfg))
        n_prompt = next(e.prompt_tokens for e in events if isinstance(e, TurnStarted))
        ids = list(session.tokens)
        runner.reset()
        logits = runner.feed(ids, keep=len(ids))[n_prompt - 1 : -1].float()  # row i: token i+1
        want = torch.tensor(ids[n_prompt:])
        match = (logits.argmax(-1) == want).int().tolist()
        # Where the target's token ranks among the draft's guesses (0: its argmax),
        # what a tree with siblings at each depth would cover.
        scored = logits.gather(1, want[:, None])
        rank = (logits > scored).sum(-1).clamp(max=RANK_CAP).tolist()
        # Whether a shortlist head (the N most frequent ids + specials) would still guess it.
        vocab = logits.shape[-1]
        short = {}
        for n in SHORTLISTS:
            keep = shortlist_ids(vocab, n, specials, ranking)
            masked = torch.full_like(logits, float("-inf"))
            masked[:, keep] = logits[:, keep]
            short[str(n)] = (masked.argmax(-1) == want).int().tolist()
        prompts.append(
            {
                "id": p["id"],
                "prompt_tokens": n_prompt,
                "ids": ids,
                "match": match,
                "rank": rank,
                "shortlist_match": short,
            }
        )
        top2 = sum(r <= 1 for r in rank)
        print(
            f"{p['id']}: {len(match)} tokens, draft argmax = target on {sum(match)}, "
            f"in its top 2 on {top2}; shortlists "
            + " ".join(f"{n}: {sum(m)}" for n, m in short.items())
        )
    costs = session.costs
    out = {
        "target": args.target,
        "draft": args.draft,
        "quant": args.quant,
        "draft_quant": dq.value,
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


def fake_quant(w: torch.Tensor, bits: int, group: int, search: bool) -> torch.Tensor:
    """w rounded to `bits` per weight, a scale and minimum per `group` inputs, back in float.
    With `search`, each group's range is shrunk where that lowers its squared error."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // group, group)
    top = (1 << bits) - 1
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    best, best_err = None, None
    for shrink in torch.linspace(1.0, 0.55, 10).tolist() if search else [1.0]:
        mid = (lo + hi) / 2
        a, b = mid + (lo - mid) * shrink, mid + (hi - mid) * shrink
        scale = ((b - a) / top).clamp(min=1e-8)
        deq = ((g - a) / scale).round().clamp(0, top) * scale + a
        err = (deq - g).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = deq, err
        else:
            better = err < best_err
            best = torch.where(better, deq, best)
            best_err = torch.minimum(err, best_err)
    assert best is not None
    return best.reshape(out, inp).to(w.dtype)


def rescore(args: argparse.Namespace) -> None:
    """The trace's draft matches again, for the draft's float weights rounded per layer kind."""
    from torch import nn

    from specchat.engine.weights.loading import load_model

    trace = json.loads(Path(args.trace).read_text())
    lm = load_model(
        ModelSpec(trace["draft"], QuantMode.NONE, dtype="float32", device="cpu"), "draft"
    )
    model = lm.model
    head = model.get_output_embeddings()
    model.lm_head = head = nn.Linear(head.in_features, head.out_features, bias=False)
    head.weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    original = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    print(
        f"trace {args.trace}: recorded match {sum(sum(p['match']) for p in trace['prompts']) / sum(len(p['match']) for p in trace['prompts']):.3f} ({trace['quant']} draft)"
    )
    print(
        "| config | bits a weight (codes + scales) | argmax = target | per reply |\n|---|---|---|---|"
    )
    for spec in args.configs.split(","):
        # e.g. 'mlp=2g64s,attn=4g32,head=4g32': kind=bits 'g' group ['s' search]; 'all=...' for every kind
        rule = dict(part.split("=") for part in spec.split("+"))
        total_bits = total_n = 0
        with torch.inference_mode():
            for name, mod in model.named_modules():
                if not isinstance(mod, nn.Linear):
                    continue
                kind = "head" if mod is head else "mlp" if "mlp" in name else "attn"
                how = rule.get(kind, rule.get("all", "32"))
                w = original[name]
                if how == "32":
                    mod.weight.copy_(w)
                    total_bits += 16 * w.numel()
                else:
                    bits, rest = how.split("g")
                    search = rest.endswith("s")
                    group = int(rest.rstrip("s"))
                    mod.weight.copy_(fake_quant(w, int(bits), group, search))
                    total_bits += (int(bits) + 32 / group) * w.numel()
                total_n += w.numel()
            matches = []
            for p in trace["prompts"]:
                ids, n = p["ids"], p["prompt_tokens"]
                logits = model(torch.tensor([ids])).logits[0, n - 1 : -1]
                matches.append((logits.argmax(-1) == torch.tensor(ids[n:])).int().tolist())
        rate = sum(map(sum, matches)) / sum(map(len, matches))
        per = " ".join(f"{sum(m) / len(m):.2f}" for m in matches)
        print(f"| {spec} | {total_bits / total_n:.2f} | {rate:.3f} | {per} |", flush=True)
        if args.out:
            out = dict(
                trace,
                prompts=[dict(p, match=m) for p, m in zip(trace["prompts"], matches, strict=True)],
            )
            Path(args.out.format(spec=spec.replace("=", "").replace("+", "_"))).write_text(
                json.dumps(out)
            )


def feed_cost(feed: dict[int, float], n: int) -> float:
    """Steps for the draft to read n tokens in one pass, from the trace's measured feeds."""
    pts = sorted(feed)
    for a, b in zip(pts, pts[1:], strict=False):
        if a <= n <= b:
            return feed[a] + (feed[b] - feed[a]) * (n - a) / (b - a)
    return feed[pts[-1]] * n / pts[-1] if n > pts[-1] else feed[pts[0]]


def replay_one(
    match: list[int],
    k_forced: int | None,
    c: float,
    verify: dict[int, float],
    feed: dict[int, float],
) -> tuple[float, int]:
    """Speedup over plain decoding of one reply, and the controller's fallbacks."""

    def catch_up(n: int) -> float:  # steps to feed n missed tokens; <= 2 ride in propose
        return 0.0 if n <= 2 else feed_cost(feed, n)

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


def replay_tree(rank: list[int], k: int, siblings: int, width: int, c: float, v: float) -> float:
    """Speedup of fixed-shape trees: a chain of k draft tokens, and at each of the first
    `siblings` depths width-1 more of the draft's next guesses from the same logits
    (no extra draft pass). A round verifies 1 + k + siblings*(width-1) rows in one pass,
    priced v; a sibling that holds the target's token is accepted with the bonus after it.
    """
    t, cost = 0, 0.0
    while t < len(rank):
        kk = min(k, len(rank) - t - 1)
        if kk < 1:
            cost, t = cost + 1, t + 1
            continue
        j = 0
        while j < kk and rank[t + j] == 0:
            j += 1
        hit = j < kk and j < siblings and rank[t + j] < width
        cost += kk * c + v + (0.2 * c if j == kk or hit else 0.0)  # two tokens pending
        t += j + 1 + int(hit)
    return len(rank) / cost


def replay_full_tree(
    rank: list[int], widths: list[int], c: float, v: dict[int, float], vd: dict[int, float]
) -> float:
    """Speedup of a full static tree: every node at depth d has widths[d] children (the
    draft's top guesses), the draft runs one batched pass per depth over that depth's
    nodes (priced c·vd(rows)), the target verifies all nodes in one pass (v(nodes)).
    Under greedy decoding the accepted path is the target's own tokens, so the trace's
    teacher-forced ranks decide it: depth d holds the target's token if it ranks below
    widths[d] there.
    """
    def shape(depth: int) -> tuple[float, int]:  # (draft cost, nodes) of the first `depth` levels
        level, nodes, draft = 1, 0, 0.0
        for w in widths[:depth]:
            draft += c * vd.get(level, max(vd.values()))  # this depth's pass: `level` rows
            level *= w
            nodes += level
        return draft, nodes

    t, cost = 0, 0.0
    while t < len(rank):
        depth = min(len(widths), len(rank) - t - 1)  # near the end the tree is cut, as a chain's K
        if depth < 1:
            cost, t = cost + 1, t + 1
            continue
        draft, nodes = shape(depth)
        j = 0
        while j < depth and rank[t + j] < widths[j]:
            j += 1
        cost += draft + v[nodes] + (0.2 * c if j == depth else 0.0)  # two tokens pending
        t += j + 1
    return len(rank) / cost


COMPOSE_POLICIES = ("model", "lookup", "composed-unpriced", "composed", "composed+trees")


def replay_composed(
    prompt: dict, policy: str, c: float, verify: dict[int, float], feed: dict[int, float]
) -> tuple[float, dict[str, int]]:
    """Speedup over plain of spec composed with prompt lookup, round by round as the session
    runs it (engine/decode/session.py `_round`), from a trace's replies and draft matches.

    policy: "model" the draft model alone; "lookup" copies alone (a plain step where
    nothing matches); "composed" a copy wherever the lookup finds one, priced by a
    controller of its own, the draft model's round elsewhere; "+trees": the draft
    model's rounds may verify its second guess beside depths 1..S where the controller
    prices that worth it (engine/decode/tree.py), taken where the trace ranks the
    target's token second among the draft's guesses; "composed-unpriced": composed with
    the controller blind to catch-ups (the copies' and the prompt's, as before they were
    priced). The remaining tokens a read must pay back in are the recorded reply's.
    The draft model reads the prompt before its first round (a catch-up), the first
    token is a plain step, and after a copy or a plain stretch the draft catches up on
    what it missed (a pass over more than two tokens; two or fewer ride in its next
    propose). Costs are target steps; greedy acceptance is the trace's.
    """
    from specchat.engine.config import MAX_K
    from specchat.engine.decode.lookup import LookupDrafter

    ids, n0, match = prompt["ids"], prompt["prompt_tokens"], prompt["match"]
    reply = len(match)
    step = 100.0
    measured = {k: verify[k] for k in (1, 4) if k in verify}
    trees = policy.endswith("+trees")
    priced = policy != "composed-unpriced"
    # A catch-up pass's cost line, as measure_costs fits it (1 and 24 rows).
    row = (feed_cost(feed, 24) - feed_cost(feed, 1)) / 23 * step if priced else None
    costs = Costs(step, c * step, 0.2, dict(measured), catch_up_row_ms=row)
    costs.catch_up_pass_ms = max(0.0, feed_cost(feed, 1) * step - (row or 0.0))
    model = Controller(DecodeConfig(), costs, tree=trees)
    copier = Controller(DecodeConfig(), Costs(step, 0.0, 0.2, dict(measured)), runs=True)
    lookup = LookupDrafter(1)
    use_model, use_copy = policy != "lookup", not policy.startswith("model")
    rank = prompt.get("rank", [])
    cost, t, unseen = 1.0, 1, n0 + 1  # the first token: a plain step; the draft has read nothing
    copied, drafted = 0, False  # as the session counts them (Turn.copied, model_unseen)
    rounds = {"copy": 0, "copy_accepted": 0, "copy_drafted": 0, "model": 0, "plain": 0, "tree": 0, "hit": 0}
    while t < reply:
        remaining = reply - t
        found = lookup.match(ids[: n0 + t], MAX_K) if use_copy else []
        if found and copier.mode is Mode.SPEC and remaining > 1:
            k = min(copier.run_k(copier.next()[1]), remaining - 1, len(found))
            acc = 0
            while acc < k and found[acc] == ids[n0 + t + acc]:
                acc += 1
            k_v = min(k, max(verify))
            cost += verify[k_v]
            copier.observe_round(k, acc, 0.0, verify[k_v] * step)
            copier.take_reason()
            rounds["copy"] += 1
            rounds["copy_drafted"] += k
            rounds["copy_accepted"] += acc
            t, unseen, copied = t + acc + 1, unseen + acc + 1, copied + acc + 1
            continue
        copier.break_run()  # as the session: a round that does not copy ends a run
        if use_model and use_copy:
            model.observe_copies(copied)
            copied = 0
        mode, k = model.next() if use_model else (Mode.PLAIN, 0)
        k = min(k, remaining - 1, max(verify))
        # as the session: the read of a prompt or plain stretch only where it pays back
        invests = mode is not Mode.PLAIN and use_copy and unseen > 2 and (not drafted or model.probing)
        # as ModelDrafter.folds: a short stretch after the draft's first read rides in its first pass
        folds = drafted and 2 < unseen <= ModelDrafter.FOLDED_ROWS + 1
        if invests and not model.pays_to_read(unseen - 1, remaining, folded=folds):
            mode = Mode.PLAIN
        if mode is Mode.PLAIN or k < 1:
            cost, t, unseen = cost + 1, t + 1, unseen + 1
            model.observe_plain(step)
            model.take_reason()
            rounds["plain"] += 1
            continue
        if unseen > 2 and not folds:  # a catch-up pass, then one row in propose
            read = feed_cost(feed, unseen - 1)
            cost += read
            if drafted and priced:
                model.observe_catch_up(unseen - 1, read * step)
            unseen = 1
        drafted = True
        acc = 0
        while acc < k and match[t + acc]:
            acc += 1
        sib = min(model.siblings, max(verify) - k)
        hit = sib > 0 and acc < min(k, sib) and rank[t + acc] == 1  # its second guess
        # the first draft pass reads what the draft missed: the round's two rows, or a short copy
        first = c * (1 + 0.1 * (unseen - 1)) if unseen <= 2 else feed_cost(feed, unseen)
        cost += first + (k - 1) * c + verify[k + sib]
        model.observe_round(k, acc + hit, k * c * step, verify[k + sib] * step, sib, hit)
        model.take_reason()
        rounds["model"] += 1
        rounds["tree"] += sib > 0
        rounds["hit"] += hit
        t, unseen = t + acc + 1 + hit, 2 if acc == k or hit else 1
    return reply / cost, rounds


def replay_compose_table(
    prompts: list[dict], c: float, verify: dict[int, float], feed: dict[int, float]
) -> None:
    """One line per composition policy: median and per-reply speedups, and what the copies did."""
    for policy in COMPOSE_POLICIES:
        runs = [replay_composed(p, policy, c, verify, feed) for p in prompts]
        speedups = [s for s, _ in runs]
        n = {k: sum(r[k] for _, r in runs) for k in runs[0][1]}
        kept = n["copy_accepted"] / max(1, n["copy_drafted"])
        per = " ".join(f"{s:.2f}" for s in speedups)
        print(
            f"  {policy:9s} {statistics.median(speedups):.3f}  [{per}]  copies {n['copy']} "
            f"({kept:.2f} of {n['copy_drafted']} drafts kept), model rounds {n['model']} "
            f"(trees {n['tree']}, ending on a second guess {n['hit']}), plain {n['plain']}"
        )


def replay(args: argparse.Namespace) -> None:
    trace = json.loads(Path(args.trace).read_text())
    verify = {k + 1: float(v) for k, v in enumerate(args.verify.split(","))}
    step = trace["costs"]["target_step_ms"]
    feed = {int(n): ms / step for n, ms in trace["feed_ms"].items()}
    policies: list[tuple[str, int | None]] = [(f"K={k}", k) for k in sorted(verify)]
    policies.append(("adaptive", None))
    ids = [p["id"] for p in trace["prompts"]]
    key = args.match
    matches = [p["match"] if key == "full" else p["shortlist_match"][key] for p in trace["prompts"]]
    rate = sum(map(sum, matches)) / sum(map(len, matches))
    print(f"trace {args.trace}: {len(ids)} replies; draft head {key}: argmax = target on {rate:.3f}")
    print(f"v(K) = {verify}")
    for c in (float(x) for x in args.c.split(",")):
        print(f"\nc = {c}: speedup over plain (median, then per reply: {' '.join(ids)})")
        if args.compose:
            replay_compose_table(trace["prompts"], c, verify, feed)
            continue
        for name, k in policies:
            runs = [replay_one(m, k, c, verify, feed) for m in matches]
            speedups = [s for s, _ in runs]
            per = " ".join(f"{s:.2f}" for s in speedups)
            fb = sum(f for _, f in runs)
            print(f"  {name:9s} {statistics.median(speedups):.3f}  [{per}]  fallbacks {fb}")
        vd = {k + 1: float(x) for k, x in enumerate(args.draft_verify.split(","))}
        for shape in filter(None, args.full_trees.split(",")):
            widths = [int(w) for w in shape.split("-")]
            rows = sum(prod(widths[: d + 1]) for d in range(len(widths)))
            if rows not in verify:
                print(f"  full tree {shape}: no v for {rows} rows")
                continue
            speedups = [replay_full_tree(p["rank"], widths, c, verify, vd) for p in trace["prompts"]]
            per = " ".join(f"{s:.2f}" for s in speedups)
            print(f"  full {shape:9s} {statistics.median(speedups):.3f}  [{per}]  ({rows + 1} rows)")
        for shape in filter(None, args.trees.split(",")):
            k, sib, width = (int(x) for x in shape.split(":"))
            rows = 1 + k + sib * (width - 1)
            if rows - 1 not in verify:
                print(f"  tree {shape}: no v for {rows} rows")
                continue
            speedups = [
                replay_tree(p["rank"], k, sib, width, c, verify[rows - 1]) for p in trace["prompts"]
            ]
            per = " ".join(f"{s:.2f}" for s in speedups)
            name = f"tree {shape}"
            print(f"  {name:9s} {statistics.median(speedups):.3f}  [{per}]  ({rows} rows)")
    if "rank" in trace["prompts"][0]:
        ranks = [r for p in trace["prompts"] for r in p["rank"]]
        misses = [r for r in ranks if r > 0]
        cover = ", ".join(
            f"top {w}: {sum(r < w for r in misses) / max(1, len(misses)):.2f}" for w in (2, 3, 4)
        )
        print(f"\nwhere the draft's argmax misses ({len(misses)} of {len(ranks)}): {cover}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="plain replies and the draft's guesses at every position")
    rec.add_argument("--prompts", required=True)
    rec.add_argument("--out", required=True)
    rec.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    rec.add_argument("--quant", default="w4a8")
    rec.add_argument("--draft-quant", default="", help="the draft's (default: --quant)")
    rec.add_argument("--draft-vocab", type=int, default=0)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rep = sub.add_parser("replay", help="price drafting policies on a recorded trace")
    rep.add_argument("trace")
    rep.add_argument("--c", default="0.4", help="draft/target step cost ratios to try")
    rep.add_argument(
        "--verify", default="1.22,1.39,1.6,1.95", help="v(K) for K = 1, 2, ... in target steps"
    )
    rep.add_argument(
        "--match", default="full", help="'full', or a shortlist size the trace recorded"
    )
    rep.add_argument(
        "--trees", default="", help="fixed tree shapes K:S:W (chain K, width W at depths 1..S)"
    )
    rep.add_argument(
        "--full-trees",
        default="",
        help="full static trees w1-w2-...: every node at depth d has w_d children",
    )
    rep.add_argument(
        "--draft-verify",
        default="1.0,1.44,1.45,1.94",
        help="the draft's cost of a pass over 1, 2, ... rows, in draft steps (full trees)",
    )
    rep.add_argument(
        "--compose",
        action="store_true",
        help="price spec composed with prompt lookup against the draft model and the lookup alone",
    )
    res = sub.add_parser(
        "rescore", help="the draft's matches with its weights rounded to fewer bits"
    )
    res.add_argument("trace")
    res.add_argument(
        "--configs",
        default="all=4g32,all=3g32s,all=2g32s",
        help="comma-separated; each KIND=BITSgGROUP[s] joined by '+' (kinds: all, mlp, attn, head; s: range search)",
    )
    res.add_argument(
        "--out", default="", help="write each config's trace here ({spec} is replaced)"
    )
    res.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "rescore":
        torch.set_num_threads(args.threads)
    {"record": record, "replay": replay, "rescore": rescore}[args.cmd](args)


if __name__ == "__main__":
    main()
