"""What speculation with the 0.5B draft would pay against bigger targets, measured on
Qwen2.5-Coder-shaped targets (1.5B, 3B, 7B, 14B) built in code with random weights.

A CPU's cost for a step or a verify block depends on the shapes and the bytes, not
on the values, so random weights give the real costs. Each target is built layer by
layer straight into specchat's w4a8 format (one layer's float weights exist at a
time, never the whole model's), at two depths (`--depths`, default 2 and 6 of its
decoder layers); its full depth is extrapolated from them, since every layer costs
the same: cost(L) = cost(d1) + (L - d1) * (cost(d2) - cost(d1)) / (d2 - d1).

Measured per target, through the same runner and native decoder the chat uses:
the step (one token on a 64-token cache), verify passes of K+1 tokens (K = 1, 2, 4)
in steps, and c = the real 0.5B draft's step (w4a8, from the model cache) / the
target's step. The predicted speedup E(K) / (K c + v(K)) is printed at the
acceptance rates given (`--alphas`; the 0.5B reaches ~0.8 against the 1.5B on
the dev prompts), at the best K. The real 1.5B is measured too, as a check of the
extrapolation.

    python scripts/target_sizes.py --sizes 1.5b,3b,7b,14b --threads 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.metrics import expected_speedup
from specchat.engine.model.runner import ModelRunner
from specchat.engine.tools.shaped import QWEN_VOCAB as VOCAB
from specchat.engine.tools.shaped import SHAPES, build
from specchat.engine.weights.loading import load_model

PROMPT = 64
KS = (1, 2, 4)


def measure(runner: ModelRunner, steps: int = 16, repeats: int = 7) -> dict[str, float]:
    """ms of one step on a PROMPT-token cache, and of verify passes of K+1 tokens."""
    runner.reset()
    runner.feed(list(range(1000, 1000 + PROMPT)))
    tok, times = 500, []
    for _ in range(steps + 2):
        t = time.perf_counter()
        tok = int(runner.feed([tok])[-1].argmax())
        times.append(time.perf_counter() - t)
    out = {"step": statistics.median(times[2:]) * 1e3}
    for k in KS:
        cached, block = runner.cached, []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.feed(list(range(2000, 2001 + k)), keep=k + 1)
            block.append(time.perf_counter() - t)
            runner.crop_to(cached)
        out[f"verify {k}"] = statistics.median(block) * 1e3
    return out


def extrapolate(a: dict[str, float], b: dict[str, float], d1: int, d2: int, depth: int) -> dict[str, float]:
    return {key: a[key] + (depth - d1) * (b[key] - a[key]) / (d2 - d1) for key in a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,3b,7b,14b")
    ap.add_argument("--depths", default="2,6")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--alphas", default="0.7,0.8")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--check", default="qwen2.5-coder-1.5b-instruct", help="a real target to compare ('' to skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d1, d2 = (int(d) for d in args.depths.split(","))
    alphas = [float(a) for a in args.alphas.split(",")]

    def real(name: str) -> dict[str, float]:
        lm = load_model(ModelSpec(name, QuantMode.W4A8, dtype="float32", device="cpu"), "target")
        runner = ModelRunner(lm.model, lm.device)
        measure(runner)  # warm-up
        out = measure(runner)
        del runner, lm
        gc.collect()
        return out

    draft = real(args.draft)
    print(f"draft {args.draft} w4a8: step {draft['step']:.1f} ms", flush=True)
    rows = []
    for size in args.sizes.split(","):
        shape = SHAPES[size]
        got = []
        for depth in (d1, d2):
            t0 = time.perf_counter()
            model = build(shape, depth)
            built = time.perf_counter() - t0
            runner = ModelRunner(model, torch.device("cpu"))
            assert runner.native is not None, runner.native_off
            measure(runner)  # warm-up
            got.append(measure(runner))
            print(f"{size} at {depth} layers: built in {built:.1f} s, step {got[-1]['step']:.1f} ms", flush=True)
            del runner, model
            gc.collect()
        full = extrapolate(got[0], got[1], d1, d2, shape.layers)
        rows.append((size, shape, full))
    if args.check:
        rows.append((f"{args.check} (real)", SHAPES["1.5b"], real(args.check)))

    print(f"\n{args.threads} threads; c = {args.draft} w4a8 step ({draft['step']:.1f} ms) / target step\n")
    head = " | ".join(f"α {a}: best K, x plain" for a in alphas)
    print(f"| target | params | w4a8 GB | step ms | tok/s | v(K=1,2,4) | c | {head} |")
    print("|---" * (7 + len(alphas)) + "|")
    for name, shape, m in rows:
        v = {k: m[f"verify {k}"] / m["step"] for k in KS}
        c = draft["step"] / m["step"]
        best = []
        for a in alphas:
            k, s = max(((k, expected_speedup(a, k, c, v[k])) for k in KS), key=lambda t: t[1])
            best.append(f"K={k}: {s:.2f}")
        # decoder layers and the LM head at 0.625 bytes a weight, the embedding in float32
        embed = VOCAB * shape.hidden
        layers = shape.params() - embed * (1 if shape.tied else 2)
        gb = (layers * 0.625 + embed * (4 + 0.625)) / 1e9
        print(
            f"| {name} | {shape.params() / 1e9:.2f}B | {gb:.1f} | {m['step']:.0f} | {1e3 / m['step']:.1f} | "
            f"{v[1]:.2f}, {v[2]:.2f}, {v[4]:.2f} | {c:.3f} | " + " | ".join(best) + " |"
        )


if __name__ == "__main__":
    main()
