"""Cost of one decode step and of verifying K+1 tokens, per model and quantization.

Loads every (model, mode) once, then measures them in interleaved rounds (each
round visits every model, mode and thread count once, in turn), so drift in a
shared machine's speed hits all alike. Prints medians over rounds:

    step      ms for one token on a cache of --context tokens (median of --tokens steps)
    verify N  ms for one pass over N new tokens on the same cache, / step

and, for every draft/target pair given, the cost ratio c = draft step / target step.

    python scripts/step_cost.py --models qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct \\
        --modes int8,int4,w8a8 --threads 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.model import cpu
from specchat.engine.model import native as kernels
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import load_model

PROMPT = 64  # the cache's tokens before the steps (--context)


def measure(runner: ModelRunner, tokens: int, blocks: list[int], context: int = PROMPT) -> dict[str, float]:
    runner.reset()
    runner.feed([1000 + i % 5000 for i in range(context)])
    tok, steps = 500, []
    for _ in range(tokens + 2):
        t = time.perf_counter()
        tok = int(runner.feed([tok])[-1].argmax())
        steps.append(time.perf_counter() - t)
    out = {"step": statistics.median(steps[2:]) * 1000}
    for n in blocks:
        cached, times = runner.cached, []
        for _ in range(3):
            t = time.perf_counter()
            runner.feed(list(range(2000, 2000 + n)), keep=n)
            times.append(time.perf_counter() - t)
            runner.crop_to(cached)
        out[f"verify {n}"] = statistics.median(times) * 1000
    return out


def variant(label: str) -> str:
    """What a row's label adds to its quantization: '@path', '%splitS' or both."""
    marks = [i for i in (label.find("@"), label.find("%")) if i >= 0]
    return label[min(marks):] if marks else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--modes", default="int8,int4,w8a8", help="QuantMode values, or bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--context", type=int, default=PROMPT, help="tokens in the cache before the timed steps"
    )
    ap.add_argument("--blocks", default="2,3,5,9", help="verify block sizes (K+1)")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="shortlist head for the second model (labelled <mode>/v<N>; list the draft "
        "twice to measure it with and without)",
    )
    ap.add_argument(
        "--native",
        default="on",
        help="on, off or on,off: decode through the native decoder (engine/model/decoder.py) "
        "or transformers' modules; 'off' rows are labelled '<mode>/py'",
    )
    ap.add_argument(
        "--w4a8-paths",
        default="",
        help="avx2,avx512vnni[,avx512vnni:ROWS[:ROWS1]][,amx[:ROWS]]: measure each w4a8 model on "
        "each of the kernel's paths (ROWS: the fewest activation rows the VNNI code takes, or "
        "the AMX code; ROWS1: VNNI on one thread, ROWS where not given), switched "
        "between measurements of the same loaded model (rows labelled '<mode>@<path>'); "
        "default: the path this CPU chose",
    )
    ap.add_argument(
        "--splits",
        default="",
        help="1,0: measure each w4a8 model with the kernel's chunks dealt a range a thread (1, "
        "the default) and from one shared counter (0), switched between measurements of the "
        "same loaded model (rows labelled '<mode>%%split<S>')",
    )
    args = ap.parse_args()
    paths = [p for p in args.w4a8_paths.split(",") if p] or [None]
    splits = [int(s) for s in args.splits.split(",") if s] or [None]
    blocks = [int(b) for b in args.blocks.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    runners = {}
    for index, model in enumerate(args.models.split(",")):
        for mode in args.modes.split(","):
            dtype, quant = (
                ("bfloat16", QuantMode.NONE) if mode == "bf16" else ("float32", QuantMode(mode))
            )
            t0 = time.perf_counter()
            shortlist = args.draft_vocab if index == 1 else 0
            spec = ModelSpec(model, quant, dtype=dtype, device="cpu", head_shortlist=shortlist)
            lm = load_model(spec, "target")
            print(
                f"loaded {model} {mode} in {time.perf_counter() - t0:.1f}s, {lm.info.weight_bytes / 2**30:.2f} GiB",
                flush=True,
            )
            for native in args.native.split(","):
                runner = ModelRunner(lm.model, lm.device)
                if native == "off":
                    runner.native = None
                elif runner.native is None:
                    print(f"  no native decoder: {runner.native_off}")
                label = mode + (f"/v{shortlist}" if shortlist else "")
                runners[(model, label if native == "on" else f"{label}/py")] = runner
    results: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in range(args.rounds):
        for (model, mode), runner in runners.items():
            for path in paths if mode.startswith("w4a8") else [None]:
                if path:
                    name, _, rows = path.partition(":")
                    min_rows, _, min_one = rows.partition(":")
                    if name == "amx":
                        kernels.w4a8_use(name, amx_min_rows=int(min_rows or kernels.W4A8_AMX_MIN_ROWS))
                    else:
                        kernels.w4a8_use(
                            name,
                            int(min_rows or kernels.W4A8_VNNI_MIN_ROWS),
                            int(min_one or min_rows or kernels.W4A8_VNNI_MIN_ROWS_ONE_THREAD),
                        )
                for split in splits if mode.startswith("w4a8") else [None]:
                    if split is not None:
                        torch.ops.specchat.w4a8_set_split(split)
                    label = (f"{mode}@{path}" if path else mode) + (
                        f"%split{split}" if split is not None else ""
                    )
                    for th in threads:
                        torch.set_num_threads(th)
                        for key, value in measure(runner, args.tokens, blocks, args.context).items():
                            results[(model, label, th)][key].append(value)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nCPU: {cpu.features().summary()}; {kernels.w4a8_describe() or 'no w4a8 kernel loaded'}")
    cols = ["step"] + [f"verify {n}" for n in blocks]
    print(
        "\n| model | mode | threads | step ms | tok/s | "
        + " | ".join(f"verify {n} / step" for n in blocks)
        + " |"
    )
    print("|---" * (5 + len(blocks)) + "|")
    med = {k: {c: statistics.median(v[c]) for c in cols} for k, v in results.items()}
    for (model, mode, th), m in med.items():
        ratios = " | ".join(f"{m[f'verify {n}'] / m['step']:.2f}" for n in blocks)
        print(f"| {model} | {mode} | {th} | {m['step']:.0f} | {1000 / m['step']:.1f} | {ratios} |")
    target = args.models.split(",")[0]
    if any(model != target for model, _, _ in med):
        print("\nc = draft step / target step (same thread count):")
        for model, mode_t, th in med:
            if model != target:
                continue
            row = ", ".join(
                f"draft {mode_d}: {med[(m2, mode_d, th)]['step'] / med[(target, mode_t, th)]['step']:.2f}"
                for (m2, mode_d, th2) in med
                if m2 != target and th2 == th and variant(mode_d) == variant(mode_t)
            )
            print(f"  target {mode_t}, {th} threads: {row}")


if __name__ == "__main__":
    main()
