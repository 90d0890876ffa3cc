#!/usr/bin/env python
"""CUDA check of the bitsandbytes modes: greedy identity of speculative decoding, verify cost.

For bnb-nf4 and bnb-int8 (and a float32 control) this script

1. loads a tiny random target and draft (Llama, built here with fixed seeds,
   saved to a temporary folder and loaded through `from_pretrained` with
   specchat's `quant.load_kwargs`), decodes greedily with a small speculative
   loop (draft K tokens, verify K+1 in one target pass, keep the agreeing
   prefix plus the target's own token, crop both KV caches), and checks that
   the tokens equal plain greedy decoding of the same target;
2. reports how far the target's logits for the same positions differ between
   one K+1-token verify pass and K+1 single-token steps (a quantized kernel
   that is not batch-invariant can flip a near-tie, which breaks identity
   without any bug in the loop: the margin column tells the two apart);
3. times one decode step against one verify pass of K+1 tokens on a target
   of Qwen2.5-1.5B width (4 layers, so it builds in seconds);
4. trains a draft head (`--mode eagle`) on the tiny float32 target for 60
   steps through `train-draft`'s own code path on the device, checks that
   greedy eagle decoding through `ChatSession` equals plain, and times a
   head step against a target step of the 1536-wide target (c on this device);
5. decodes greedily with draft trees (the draft's second guess beside depths 1..S,
   engine/decode/tree.py) through the engine's own round, float32 and bnb-nf4,
   checks the tokens against plain decoding, reports how far a tree's rows score
   from the chains along their paths, and times chain and tree verify passes;
6. real weights (stories260k) through the command line as a user runs it:
   `specchat train-draft` on the device for a few minutes, then one interleaved
   `specchat bench` of plain, spec, self-spec, eagle and lookup (tokens/s, ratios,
   c, v, identity with plain; float32 unless `--dtype` says otherwise);
7. the default pair's shapes (Qwen2.5-1.5B target, Qwen2.5-0.5B draft, random
   weights: no weights travel to a lent machine) in bfloat16 and bnb-nf4, the
   quantization CUDA loads by default: a target step, verify passes of 2..7 rows,
   a draft step and a head step, so c of the 0.5B draft and of the head on this GPU;
8. the devices panel's probes (engine/tools/probes.py): what the panel would show;
9. `train-draft`'s stages on a target of the 1.5B's shape (random weights): the
   features' and the training's tokens a second on this device.

It installs nothing, needs no network and finishes in about five minutes
(sections 1-5 about one, 6 the training budget plus a minute, 7 about one). Exit status: 0 all identities held, 1 one failed, 2 no CUDA (nothing
was checked). `--cpu` runs the same checks on the CPU (bitsandbytes 0.50 runs
both modes there), to try the script on a machine without a GPU.

    python scripts/gpu_check.py [--k 4] [--tokens 40] [--cpu] [--sections 1,6,7]
        [--stories DIR] [--train-minutes 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from specchat.engine.config import QuantMode
    from specchat.engine.model import quant
except ImportError:  # a checkout that was not pip-installed: map specchat.engine to engine/
    _root = Path(__file__).resolve().parents[1]
    _pkg = types.ModuleType("specchat")
    _pkg.__path__ = [str(_root)]
    sys.modules["specchat"] = _pkg
    from specchat.engine.config import QuantMode
    from specchat.engine.model import quant

PROMPT = [1, 17, 42, 99, 7, 123, 5, 64]
STORIES_DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def tiny(hidden: int, layers: int, seed: int, vocab: int = 512, inter: int | None = None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked logits: fewer near-ties than the default 0.02 init
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def load(folder: Path, mode: QuantMode, device: torch.device) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    quant.check(mode, AutoConfig.from_pretrained(folder), device)
    kwargs = quant.load_kwargs(mode, device) or {"device_map": {"": str(device)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return quant.apply(model.eval(), mode)


@torch.inference_mode()
def plain_greedy(
    model: nn.Module, prompt: list[int], n_new: int, device: torch.device
) -> list[int]:
    from transformers import DynamicCache

    seq, cache = list(prompt), DynamicCache()
    while len(seq) < len(prompt) + n_new:
        fresh = torch.tensor([seq[cache.get_seq_length() :]], device=device)
        seq.append(int(model(fresh, cache=cache, use_cache=True).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@torch.inference_mode()
def speculative_greedy(
    target: nn.Module, draft: nn.Module, prompt: list[int], n_new: int, k: int, device: torch.device
) -> tuple[list[int], float]:
    """Greedy speculative decoding (Leviathan et al. 2023, at temperature 0).

    Returns the new tokens and the mean number of draft tokens accepted per round.
    """
    from transformers import DynamicCache

    seq, t_cache, d_cache = list(prompt), DynamicCache(), DynamicCache()
    accepted: list[int] = []
    while len(seq) < len(prompt) + n_new:
        # 1. the draft proposes k tokens; its cache first catches up on tokens it has not seen
        proposal: list[int] = []
        for _ in range(k):
            fresh = torch.tensor([(seq + proposal)[d_cache.get_seq_length() :]], device=device)
            logits = draft(fresh, cache=d_cache, use_cache=True).logits[0, -1]
            proposal.append(int(logits.argmax()))
        # 2. the target scores the last accepted token and the k proposals in one pass
        fresh = torch.tensor([(seq + proposal)[t_cache.get_seq_length() :]], device=device)
        choice = target(fresh, cache=t_cache, use_cache=True).logits[0, -(k + 1) :].argmax(-1)
        choice_ids = choice.tolist()  # [k + 1]: the target's greedy token after each prefix
        # 3. keep the agreeing prefix, then the target's own token (correction or bonus)
        n = 0
        while n < k and proposal[n] == choice_ids[n]:
            n += 1
        seq += proposal[:n] + [choice_ids[n]]
        accepted.append(n)
        # 4. roll both caches back to the accepted tokens; the newest one is fed next round
        for cache in (t_cache, d_cache):
            extra = cache.get_seq_length() - (len(seq) - 1)
            if extra > 0:
                cache.crop(-extra)
    return seq[len(prompt) : len(prompt) + n_new], statistics.mean(accepted)


@torch.inference_mode()
def batch_variance(
    model: nn.Module, tokens: list[int], k: int, device: torch.device
) -> tuple[float, float]:
    """Max |logit difference| between one (k+1)-token pass and k+1 single steps over the
    same positions, and the smallest top-1 margin over those positions."""
    from transformers import DynamicCache

    head, block = tokens[: -(k + 1)], tokens[-(k + 1) :]
    cache = DynamicCache()
    model(torch.tensor([head], device=device), cache=cache, use_cache=True)
    together = model(torch.tensor([block], device=device), cache=cache, use_cache=True)
    cache.crop(-(k + 1))
    steps = [
        model(torch.tensor([[t]], device=device), cache=cache, use_cache=True).logits[0, -1]
        for t in block
    ]
    a, b = together.logits[0].float(), torch.stack(steps).float()  # [k + 1, V]
    top2 = b.topk(2, dim=-1).values
    return float((a - b).abs().max()), float((top2[:, 0] - top2[:, 1]).min())


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def timed(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def verify_cost(model: nn.Module, k: int, device: torch.device) -> tuple[float, float]:
    """(ms of one decode step, ms of one verify pass of k+1 tokens) after a 128-token context."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(torch.arange(128, device=device)[None], cache=cache, use_cache=True)
    one = torch.tensor([[5]], device=device)
    block = torch.arange(k + 1, device=device)[None]

    def step() -> None:
        model(one, cache=cache, use_cache=True)
        cache.crop(-1)

    def verify() -> None:
        model(block, cache=cache, use_cache=True)
        cache.crop(-(k + 1))

    reps = 20 if device.type == "cuda" else 3
    return timed(step, device, reps), timed(verify, device, reps)


def check_head(target_dir: Path, wide_dir: Path, device: torch.device, tokens: int) -> int:
    """Section 4: the draft head on this device; returns the number of failed identities."""
    from transformers import AutoModelForCausalLM

    from specchat.engine.config import DecodeConfig, Mode
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.events import RoundEvent, TokenEvent
    from specchat.engine.model.eagle import EagleHead, HeadConfig, init_head
    from specchat.engine.model.runner import ModelRunner
    from specchat.engine.tools.train_draft import TrainOptions, measure_head_cost, train
    from specchat.engine.weights.loading import LoadedModel, describe

    print("\n4. the draft head (--mode eagle): 60 training steps, greedy identity, cost")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tinymodels import chatml_tokenizer  # one token per printable character, ChatML

    tok = chatml_tokenizer()

    def as_loaded(folder: Path) -> LoadedModel:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        info = describe(model, "target", folder.name, "code", device, torch.float32, QuantMode.NONE)
        return LoadedModel(model, tok, device, torch.float32, info)

    target = as_loaded(target_dir)
    with tempfile.TemporaryDirectory() as out:
        opts = TrainOptions(
            minutes=3,
            max_steps=60,
            reply_tokens=24,
            reply_rounds=1,  # greedy replies only: the device's minutes go to the checks
            max_texts=40,
            draft_vocab=256,
            out=Path(out),
            eval_every_s=1e9,
            prompts=tuple(
                f"tell me about {w}"
                for w in (
                    "rain",
                    "cats",
                    "code",
                    "tea",
                    "maps",
                    "ships",
                    "stars",
                    "bread",
                    "rust",
                    "go",
                    "sql",
                    "css",
                    "math",
                    "songs",
                    "trees",
                    "rivers",
                )
            ),
        )
        t0 = time.perf_counter()
        result = train(target, opts)
        trained_s = time.perf_counter() - t0
    acc = result.report.get("acceptance_by_position") or [0.0]
    print(
        f"trained 60 steps in {trained_s:.1f} s ({result.report['precision']}); "
        f"held-out first-draft acceptance {acc[0]:.2f}"
    )
    cfg = DecodeConfig(mode=Mode.EAGLE, k=3, max_new_tokens=tokens, compose=False)
    prompt = "tell me about clouds"
    plain = [
        e.token_id
        for e in ChatSession(target).stream(prompt, cfg.with_(mode=Mode.PLAIN))
        if isinstance(e, TokenEvent)
    ]
    events = list(ChatSession(target, head=result.head).stream(prompt, cfg))
    eagle = [e.token_id for e in events if isinstance(e, TokenEvent)]
    rounds = [e for e in events if isinstance(e, RoundEvent) and e.k]
    same = eagle == plain
    accepted = sum(e.accepted for e in rounds) / max(len(rounds), 1)
    print(
        f"greedy eagle = plain: {'yes' if same else f'no @{first_difference(eagle, plain)}'}; "
        f"{accepted:.2f} drafts accepted a round"
    )
    del target
    wide = as_loaded(wide_dir)
    head = (
        init_head(
            EagleHead(
                HeadConfig.for_target(wide.model.config, draft_vocab=16384, intermediate=3072)
            )
        )
        .to(device)
        .eval()
    )
    head_ms, target_ms, verify = measure_head_cost(
        head, ModelRunner(wide.model, device), wide.model.get_input_embeddings()
    )
    print(
        f"1536 wide x 4 layers (float32): head step {head_ms:.2f} ms, target step {target_ms:.2f} ms, "
        f"c = {head_ms / target_ms:.3f}; verify K=1..6 in steps: "
        + ", ".join(f"{v:.2f}" for v in verify.values())
    )
    return 0 if same else 1


def tree_verify_costs(runner: Any, device: torch.device) -> str:
    """A decode step after 128 tokens, and chain and tree verify passes of as many rows."""
    runner.feed(list(range(3, 131)))
    base = runner.cached

    def chain(n: int) -> None:
        runner.crop_to(base)
        runner.feed([5] * n, keep=n)

    def tree(k: int) -> None:  # a chain of k and a second guess beside each of its drafts
        runner.crop_to(base)
        parents = (-1, *range(k), *range(k))
        runner.feed_tree(torch.tensor([5] * len(parents), device=device), parents)

    reps = 20 if device.type == "cuda" else 3
    step = timed(lambda: chain(1), device, reps)
    cells = []
    for k in (1, 2, 3, 4):
        c_ms = timed(lambda k=k: chain(1 + 2 * k), device, reps)
        t_ms = timed(lambda k=k: tree(k), device, reps)
        cells.append(f"{1 + 2 * k} rows {c_ms / step:.2f} | {t_ms / step:.2f}")
    return f"step {step:.2f} ms; " + "; ".join(cells)


def check_trees(
    target_dir: Path,
    draft_dir: Path,
    wide_dir: Path,
    quantized: list[QuantMode],
    device: torch.device,
    k: int,
    tokens: int,
) -> int:
    """Section 5: draft trees through the engine's own round on this device (transformers'
    modules and row-wise attention: the native decoder is the CPU's); returns the
    number of failed identities."""
    from specchat.engine.config import DecodeConfig
    from specchat.engine.decode.speculative import ModelDrafter, plain_step, speculative_round
    from specchat.engine.model.runner import ModelRunner

    print(f"\n5. draft trees (the draft's second guess beside depths 1..S), K={k}, {tokens} tokens")
    cfg = DecodeConfig(temperature=0.0)
    failures = 0
    print(
        f"{'target':9} {'S':>2} {'identical':9} {'ended on a guess':>16} {'max|dlogit| tree-chain':>23}"
    )
    for mode in (QuantMode.NONE, *quantized):
        target = load(target_dir, mode, device)
        draft = load(draft_dir, mode, device)
        runner = ModelRunner(target, device)
        seq = list(PROMPT)
        while len(seq) < len(PROMPT) + tokens:
            seq.append(plain_step(runner, seq, cfg, None).tokens[0].token_id)
        plain = seq[len(PROMPT) :]
        for siblings in (1, k):
            runner = ModelRunner(target, device)
            drafter = ModelDrafter(ModelRunner(draft, device))
            seq, off = list(PROMPT), 0
            while len(seq) < len(PROMPT) + tokens:
                res = speculative_round(runner, drafter, seq, k, cfg, None, siblings)
                off += res.off_chain
                seq += [e.token_id for e in res.tokens]
            got = seq[len(PROMPT) : len(PROMPT) + tokens]
            same = got == plain
            failures += not same
            # One tree against the chains along its paths, same cache: how far apart they score.
            runner.crop_to(len(PROMPT) + 4)
            base = runner.cached
            ids = torch.tensor([seq[base]] + [3, 4, 5] + [6, 7], device=device)
            parents = (-1, 0, 1, 2, 0, 1)
            tree = runner.feed_tree(ids, parents)
            delta = 0.0
            for path in ([0, 1, 2, 3], [0, 4], [0, 1, 5]):
                runner.crop_to(base)
                chain = runner.feed(ids[path], keep=len(path))
                delta = max(delta, float((chain - tree[path]).abs().max()))
                runner.crop_to(base)
                runner.feed_tree(ids, parents)
            name = "float32" if mode is QuantMode.NONE else mode.value
            where = "yes" if same else f"no @{first_difference(got, plain)}"
            print(f"{name:9} {siblings:2d} {where:9} {off:16d} {delta:23.2e}")
        del target, draft
        torch.cuda.empty_cache()
    print(
        "verify passes, 1536 wide x 4 layers, context 128, in decode steps (chain | tree of as many rows)"
    )
    for mode in (QuantMode.NONE, *quantized):
        model = load(wide_dir, mode, device)
        if mode is QuantMode.NONE:
            model = model.to(torch.bfloat16)
        name = "bf16" if mode is QuantMode.NONE else mode.value
        print(f"{name:9} {tree_verify_costs(ModelRunner(model, device), device)}")
        del model
        torch.cuda.empty_cache()
    return failures


STORY_PROMPTS = (
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog was sad because",
    "One day, a big red ball",
    "Sam liked to play with his toy car",
    "The sun was shining and the birds",
)


def check_real(
    stories: Path,
    device: torch.device,
    minutes: float,
    tokens: int,
    out: Path | None,
    dtype: str = "float32",
) -> int:
    """Section 6: real weights through the command line; returns failed identities."""
    import json
    import os

    from specchat.tui.cli import main as cli

    print(f"\n6. real weights ({stories.name}) through the command line, {tokens} tokens")
    if not (stories / "model.safetensors").is_file():
        print(f"skipped: no model at {stories} (copy ../shared/models/stories260k there)")
        return 0
    dev = "cuda" if device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPECCHAT_CACHE"] = str(Path(tmp, "cache"))  # the head lands here
        t0 = time.perf_counter()
        rc = cli(
            [
                "train-draft",
                "--target",
                str(stories),
                "--device",
                dev,
                "--minutes",
                str(minutes),
                "--head-vocab",
                "512",
                "--reply-tokens",
                "96",
                "--threads",
                "2",
                "--dtype",
                dtype,
            ]
        )
        print(f"train-draft: exit {rc} after {time.perf_counter() - t0:.0f} s")
        if rc != 0:
            return 1
        prompts = Path(tmp, "prompts.jsonl")
        lines = [
            {"id": f"s{i}", "kind": "story", "messages": [{"role": "user", "content": text}]}
            for i, text in enumerate(STORY_PROMPTS)
        ]
        prompts.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
        res = Path(out or tmp, "bench-stories")
        argv = [
            "bench",
            "--prompts",
            str(prompts),
            "--target",
            str(stories),
            "--draft",
            str(stories),
            "--device",
            dev,
            "--modes",
            "plain,spec,self-spec,eagle,lookup",
            "--max-new-tokens",
            str(tokens),
            "--repeats",
            "2",
            "--no-baseline",
            "--no-plots",
            "--threads",
            "2",
            "--out",
            str(res),
            "--dtype",
            dtype,
        ]
        t0 = time.perf_counter()
        rc = cli(argv)
        print(f"bench: exit {rc} after {time.perf_counter() - t0:.0f} s")
        if rc != 0:
            return 1
        data = json.loads((res / "result.json").read_text(encoding="utf-8"))
    failures = 0
    print(f"{'arm':10} {'tok/s':>7} {'x plain':>7} {'accept':>6} {'c':>5} {'v':>5} {'= plain':>7}")
    for arm in data["arms"]:
        f = data["summary"][arm]
        same = f.get("same_tokens_as_plain")
        failures += bool(same and same["equal"] != same["compared"])

        cell = f"{same['equal']}/{same['compared']}" if same else "-"

        def num(x: Any, fmt: str) -> str:
            return format(x, fmt) if isinstance(x, int | float) else "-"

        print(
            f"{arm:10} {num(f['tokens_per_s']['median'], '7.1f')} "
            f"{num((f.get('speedup_vs_plain') or {}).get('median'), '7.2f')} "
            f"{num(f['acceptance_rate'], '6.2f')} {num(f['cost_ratio_c'], '5.2f')} "
            f"{num(f['verify_ratio_v'], '5.2f')} "
            f"{cell:>7}"
        )
    return failures


QWEN_15B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}
QWEN_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}


def qwen_shaped(
    shape: dict[str, int], seed: int, folder: Path, mode: QuantMode, device: torch.device
) -> nn.Module:
    """A random model of a default-pair shape in bfloat16 (or bnb-nf4, through a folder)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, **shape
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    if mode is QuantMode.NONE:
        return model
    model.save_pretrained(folder)
    del model
    kwargs = quant.load_kwargs(mode, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
    return quant.apply(loaded.eval(), mode)


def full_shapes(device: torch.device, modes: list[QuantMode], tmp: Path) -> None:
    """Section 7: the default pair's shapes on this device: c of the 0.5B draft and of the head."""
    from specchat.engine.decode.costs import measure_head_cost
    from specchat.engine.model.eagle import EagleHead, HeadConfig, init_head
    from specchat.engine.model.runner import ModelRunner

    print("\n7. the default pair's shapes (random weights), context 128, medians")
    print(
        f"{'weights':9} {'step ms':>7} {'verify 2..7 rows, in steps':>34} {'0.5B ms':>7} "
        f"{'c 0.5B':>6} {'head ms':>7} {'c head':>6}"
    )
    reps = 20 if device.type == "cuda" else 3
    for mode in modes:
        target = qwen_shaped(QWEN_15B, 1, tmp / f"t-{mode}", mode, device)
        runner = ModelRunner(target, device)
        runner.feed(list(range(3, 131)))
        base = runner.cached

        def rows(n: int, runner: Any = runner, base: int = base) -> None:
            runner.crop_to(base)
            runner.feed([5] * n, keep=n)

        step = timed(lambda: rows(1), device, reps)
        verify = [timed(lambda n=n: rows(n), device, reps) / step for n in range(2, 8)]
        # float32, as the engine runs a head (engine/decode/head.py takes its parameters' dtype)
        head = init_head(EagleHead(HeadConfig.for_target(target.config))).to(device).eval()
        head_ms, _target_ms, _v = measure_head_cost(
            head, ModelRunner(target, device), target.get_input_embeddings(), repeats=reps
        )
        del runner, target, head
        draft = qwen_shaped(QWEN_05B, 2, tmp / f"d-{mode}", mode, device)
        d_runner = ModelRunner(draft, device)
        d_runner.feed(list(range(3, 131)))
        d_base = d_runner.cached

        def d_row(runner: Any = d_runner, base: int = d_base) -> None:
            runner.crop_to(base)
            runner.feed([5], keep=1)

        draft_ms = timed(d_row, device, reps)
        del d_runner, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
        name = "bf16" if mode is QuantMode.NONE else mode.value
        print(
            f"{name:9} {step:7.2f} {' '.join(f'{v:.2f}' for v in verify):>34} {draft_ms:7.2f} "
            f"{draft_ms / step:6.2f} {head_ms:7.2f} {head_ms / step:6.2f}"
        )


def train_throughput(device: torch.device, tmp: Path, minutes: float) -> None:
    """Section 9: `train-draft`'s stages on a target of the 1.5B's shape (random weights,
    bfloat16): how many tokens a second the features and the training steps take here."""
    from specchat.engine.tools.train_draft import TrainOptions, train
    from specchat.engine.weights.loading import LoadedModel, describe

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tinymodels import chatml_tokenizer

    print(f"\n9. train-draft on the 1.5B's shape (random weights, bfloat16), {minutes} min")
    model = qwen_shaped(QWEN_15B, 1, tmp / "train-t", QuantMode.NONE, device)
    info = describe(model, "target", "qwen2.5-1.5b-shaped", "code", device, torch.bfloat16,
                    QuantMode.NONE)  # fmt: skip
    target = LoadedModel(model, chatml_tokenizer(), device, torch.bfloat16, info)
    opts = TrainOptions(
        minutes=minutes,
        reply_tokens=32,
        reply_rounds=1,  # greedy replies only: this section times features and training
        max_texts=400,
        out=tmp / "train-head",
        eval_every_s=1e9,
        prompts=tuple(f"tell me about {w}" for w in ("rain", "maps", "code", "tea", "sql", "go")),
    )
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith(("data:", "training:", "train:", "features:", "held-out", "cost")):
            print(line)

    t0 = time.perf_counter()
    report = train(target, opts, say=say).report
    print(
        f"train-draft ran {time.perf_counter() - t0:.0f} s in all; training "
        f"{report['train_tokens_per_s']:.0f} tokens/s ({report['precision']}); the trained "
        f"head's step {report['head_step_ms']:.2f} ms against the target's "
        f"{report['target_step_ms']:.2f} ms"
    )


def devices_probe(device: torch.device) -> None:
    """Section 8: one sample of the devices panel's probes, as the panel reads them."""
    from specchat.engine.tools.probes import sample_system

    where = str(device)
    s = sample_system(draft_device=where, target_device=where)
    gib = 1 << 30
    gpu = (
        f"{s.gpu_name}, {s.gpu_util_percent}% busy, "
        f"{(s.gpu_mem_used_bytes or 0) / gib:.1f} of {(s.gpu_mem_total_bytes or 0) / gib:.1f} GiB"
        if s.gpu_mem_total_bytes
        else "none seen"
    )
    print(
        f"\n8. the devices panel's probes: {len(s.cpu_percent_per_core)} cores, this process "
        f"{s.process_cpu_percent:.0f}% CPU, {s.rss_bytes / gib:.1f} GiB resident; GPU: {gpu}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--tokens", type=int, default=40, help="new tokens per decode")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (tries the script)")
    parser.add_argument(
        "--sections",
        default="1,3,4,5,6,7,8,9",
        help="which sections to run (1 covers 1-2; default all)",
    )
    parser.add_argument(
        "--stories", type=Path, default=STORIES_DEFAULT, help="the stories260k folder for section 6"
    )
    parser.add_argument(
        "--train-minutes",
        type=float,
        default=2.0,
        help="section 6's train-draft budget (default 2)",
    )
    parser.add_argument(
        "--bench-tokens", type=int, default=128, help="section 6's tokens per reply (default 128)"
    )
    parser.add_argument("--out", type=Path, default=None, help="keep section 6's bench here")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="section 6's dtype (default float32: bfloat16 GEMMs on CUDA are not batch-invariant, "
        "so a greedy tie may flip there and the identity check would fail without an error; "
        "auto: the engine's own choice)",
    )
    args = parser.parse_args()
    sections = {int(x) for x in args.sections.split(",") if x.strip()}

    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print(
            f"gpu_check: no CUDA device visible to torch {torch.__version__} "
            f"(torch.version.cuda = {torch.version.cuda}); nothing was checked. "
            "Use --cpu to try the checks on the CPU."
        )
        return 2
    import transformers

    try:
        import bitsandbytes

        bnb = f"bitsandbytes {bitsandbytes.__version__}"
        quantized = [QuantMode.BNB_NF4, QuantMode.BNB_INT8]
    except Exception as exc:  # the bnb rows are left out, and the reason printed
        bnb = f"no bitsandbytes ({type(exc).__name__}: {exc}): its rows are left out"
        quantized = []

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 control must be float32
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name} | torch {torch.__version__} | transformers {transformers.__version__} | {bnb}")
    started = time.perf_counter()
    failures = 0
    nf4 = [m for m in quantized if m is QuantMode.BNB_NF4]
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir, wide_dir = Path(tmp, "t"), Path(tmp, "d"), Path(tmp, "w")
        tiny(256, 4, seed=0).save_pretrained(target_dir)
        draft = tiny(256, 4, seed=0)
        torch.manual_seed(2)
        with torch.no_grad():  # the target plus noise: agrees often, not always
            for p in draft.parameters():
                p.add_(0.002 * torch.randn_like(p))
        draft.save_pretrained(draft_dir)
        if sections & {3, 4, 5}:
            tiny(1536, 4, seed=1, vocab=32000, inter=8960).save_pretrained(wide_dir)

        if 1 in sections:
            failures += identities(target_dir, draft_dir, quantized, device, args.k, args.tokens)
        if 3 in sections:
            print(f"\n3. verify cost, 1536 wide x 4 layers, vocab 32000, context 128, K={args.k}")
            print(f"{'target':9} {'step ms':>8} {f'verify {args.k + 1} ms':>12} {'ratio':>6}")
            for mode in (QuantMode.NONE, *quantized):
                model = load(wide_dir, mode, device)
                if mode is QuantMode.NONE:
                    model = model.to(torch.bfloat16)
                step_ms, verify_ms = verify_cost(model, args.k, device)
                name = "bf16" if mode is QuantMode.NONE else mode.value
                print(f"{name:9} {step_ms:8.2f} {verify_ms:12.2f} {verify_ms / step_ms:6.2f}")
                del model
                torch.cuda.empty_cache()
        if 4 in sections:
            failures += check_head(target_dir, wide_dir, device, args.tokens)
        if 5 in sections:
            failures += check_trees(
                target_dir, draft_dir, wide_dir, nf4, device, args.k, args.tokens
            )
        if 6 in sections:
            failures += check_real(
                args.stories, device, args.train_minutes, args.bench_tokens, args.out, args.dtype
            )
        if 7 in sections:
            full_shapes(device, [QuantMode.NONE, *nf4], Path(tmp))
        if 8 in sections:
            devices_probe(device)
        if 9 in sections:
            train_throughput(device, Path(tmp), args.train_minutes)

    print(
        f"\n{'all identities held' if not failures else f'{failures} identity check(s) FAILED'}"
        f" ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if failures else 0


def identities(
    target_dir: Path,
    draft_dir: Path,
    quantized: list[QuantMode],
    device: torch.device,
    k: int,
    tokens: int,
) -> int:
    """Sections 1-2: greedy identity of a small speculative loop, per quantization pair."""
    print(f"\n1-2. greedy identity, K={k}, {tokens} tokens")
    print(
        f"{'target':9} {'draft':9} {'identical':9} {'accepted/round':>14} "
        f"{'max|dlogit|':>11} {'min margin':>10}"
    )
    pairs = [(QuantMode.NONE, QuantMode.NONE)]
    pairs += [(QuantMode.NONE, m) for m in quantized] + [(m, m) for m in quantized]
    failures = 0
    for t_mode, d_mode in pairs:
        target = load(target_dir, t_mode, device)
        drafter = load(draft_dir, d_mode, device)
        plain = plain_greedy(target, PROMPT, tokens, device)
        spec, mean_accepted = speculative_greedy(target, drafter, PROMPT, tokens, k, device)
        delta, margin = batch_variance(target, PROMPT + plain, k, device)
        same = spec == plain
        failures += not same
        where = "yes" if same else f"no @{first_difference(spec, plain)}"
        t_name = "float32" if t_mode is QuantMode.NONE else t_mode.value
        d_name = "float32" if d_mode is QuantMode.NONE else d_mode.value
        print(f"{t_name:9} {d_name:9} {where:9} {mean_accepted:14.2f} {delta:11.2e} {margin:10.3f}")
        if not same and delta > 1e-3:
            print(
                f"{'':9} ^ this target's logits change by up to {delta:.2g} between a "
                f"{k + 1}-token verify and single steps (not batch-invariant), so a "
                "near-tie can flip: a limit of the mode's kernels, not of the loop"
            )
        del target, drafter
        torch.cuda.empty_cache()
    return failures


if __name__ == "__main__":
    sys.exit(main())
