"""How far each quantization mode moves a model's greedy output from float32.

For each prompt of a JSONL prompt file, the float32 model decodes N greedy
tokens; each mode then scores prompt + those tokens in one teacher-forced pass
and is compared position by position:

    top-1     share of positions where the mode's argmax is float32's token
    chats     prompts whose N positions all agree (= free-running greedy output identical)
    rel. err  median over positions of ||logits_mode - logits_fp32|| / ||logits_fp32||

    python scripts/quant_quality.py --modes bf16,int8,int4,w8a8 --tokens 32

A mode ending in +prompt scores its pass as a prompt's rows (engine/model/native.py
`prompt_rows`: w4a8's bfloat16 tiles where the CPU has AMX-BF16), e.g. w4a8,w4a8+prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specchat.engine.config import ModelSpec, QuantMode
from specchat.engine.model import native
from specchat.engine.weights.loading import load_model

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "dev_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--modes", default="bf16,int8,int4,w8a8", help="bf16 or QuantMode values")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--reference", type=Path, help="keep the float32 reference in this file and reuse it"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chats = [json.loads(line)["messages"] for line in args.prompts.read_text().splitlines() if line]

    if args.reference and args.reference.exists():
        seqs, starts, ref_logits = torch.load(args.reference)
    else:
        seqs, starts, ref_logits = reference(args.model, chats, args.tokens)
        if args.reference:
            torch.save((seqs, starts, ref_logits), args.reference)

    print("| mode | top-1 | chats identical | median rel. logit error |\n|---|---|---|---|")
    for name in args.modes.split(","):
        base, _, read = name.partition("+")
        dtype, quant = (
            ("bfloat16", QuantMode.NONE) if base == "bf16" else ("float32", QuantMode(base))
        )
        lm = load_model(ModelSpec(args.model, quant, dtype=dtype, device="cpu"), "target")
        agree, identical, errors = 0, 0, []
        with torch.inference_mode(), native.prompt_rows(read == "prompt"):
            for seq, start, want in zip(seqs, starts, ref_logits, strict=True):
                got = lm.model(torch.tensor([seq])).logits[0, start - 1 : -1].float()
                same = got.argmax(-1) == want.argmax(-1)
                agree += int(same.sum())
                identical += bool(same.all())
                errors += ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
        total = len(seqs) * args.tokens
        print(
            f"| {name} | {agree / total:.1%} | {identical}/{len(seqs)} | {statistics.median(errors):.4f} |",
            flush=True,
        )
        del lm


def reference(model: str, chats: list, tokens: int) -> tuple[list, list, list]:
    """float32 greedy continuations, where each starts, and float32's logits over them."""
    ref = load_model(ModelSpec(model, QuantMode.NONE, dtype="float32", device="cpu"), "target")
    seqs, starts, ref_logits = [], [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for messages in chats:
            ids = ref.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out = ref.model.generate(
                torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens
            )
            seq = out[0].tolist()
            logits = ref.model(torch.tensor([seq])).logits[0, len(ids) - 1 : -1].float()
            seqs.append(seq)
            starts.append(len(ids))
            ref_logits.append(logits)
    print(
        f"float32 reference: {len(chats)} prompts x {tokens} tokens in {time.perf_counter() - t0:.0f}s"
    )
    return seqs, starts, ref_logits


if __name__ == "__main__":
    main()
