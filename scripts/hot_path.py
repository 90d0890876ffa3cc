"""What decoding costs beyond the model's passes, on a real 152k-token vocabulary.

A random Qwen2-shaped model of width 64 with the default target's tokenizer
and vocabulary: its passes cost little, so what is measured is the work
around them (sampling, drafting bookkeeping, the stop-string search, host
reads) and, for a full context, how many prompt tokens each turn prefills.

    python scripts/hot_path.py --tokenizer ~/.cache/specchat/models/qwen2.5-coder-1.5b-instruct

Prints one line per scenario: ms per generated token (median of --repeats),
and the prefilled-token total of a long chat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import TokenEvent, TurnStarted
from specchat.engine.weights.loading import LoadedModel, describe, layer_truncated

LOGIT_SCALE = 40.0
CODE = "def area(w, h):\n    return w * h\n\n" * 6


def model(vocab: int, layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():  # peaked like a trained model's (top-1 ~0.3-0.9), not flat
        m.lm_head.weight.mul_(LOGIT_SCALE)
    return m


def session(tok: object, target: torch.nn.Module, max_context: int | None = None) -> ChatSession:
    def load(m: torch.nn.Module, role: str) -> LoadedModel:
        dev = torch.device("cpu")
        info = describe(m, role, f"random-{role}", "code", dev, torch.float32, QuantMode.NONE)  # type: ignore[arg-type]
        return LoadedModel(m, tok, dev, torch.float32, info)  # type: ignore[arg-type]

    draft = layer_truncated(target, 1)  # type: ignore[arg-type]
    return ChatSession(load(target, "target"), load(draft, "draft"), max_context=max_context)


def per_token_ms(s: ChatSession, prompt: str, cfg: DecodeConfig) -> float:
    s.reset()
    t0 = time.perf_counter()
    n = sum(isinstance(e, TokenEvent) for e in s.stream(prompt, cfg))
    return (time.perf_counter() - t0) * 1e3 / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a model folder with tokenizer files")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    target = model(len(tok), 2)
    s = session(tok, target)
    scenarios = {
        "spec, sampled, top-p 0.9, K=4": (
            "Write a story.",
            DecodeConfig(mode=Mode.SPEC, k=4, temperature=0.8, top_p=0.9, max_new_tokens=48, seed=1),
        ),
        "lookup, greedy, K=4": (
            CODE,
            DecodeConfig(mode=Mode.LOOKUP, k=4, max_new_tokens=96),
        ),
        "plain, greedy, 512 tokens": (
            "Write a story.",
            DecodeConfig(mode=Mode.PLAIN, max_new_tokens=512),
        ),
        "plain, greedy, 512 tokens, 2 stop strings": (
            "Write a story.",
            DecodeConfig(mode=Mode.PLAIN, max_new_tokens=512, stop=("\x00never", "\x01end")),
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(args.repeats):  # interleaved: drift hits every scenario alike
        for name, (prompt, cfg) in scenarios.items():
            times[name].append(per_token_ms(s, prompt, cfg))
    for name, values in times.items():
        print(f"{name:45s} {statistics.median(values):8.3f} ms/token")

    chat = session(tok, target, max_context=512)
    prefilled = turns = 0
    for i in range(30):
        for e in chat.stream(f"Question {i}: " + "tell me more " * 8, DecodeConfig(max_new_tokens=32)):
            if isinstance(e, TurnStarted):
                prefilled += e.new_prompt_tokens
                turns += 1
    print(f"{'full context: prompt tokens prefilled, 30 turns':45s} {prefilled:8d} ({prefilled / turns:.0f}/turn)")


if __name__ == "__main__":
    main()
