"""Training a draft head for a target where the user is (`specchat train-draft`).

Stages, each with progress and a share of the time budget:

1. **replies**: the target's own greedy replies to the shipped prompt set
   (engine/tools/train_prompts.py): what the head must predict is the target.
2. **text**: docstrings of the Python standard library, asked for and
   answered in the chat template: prose and code every machine running
   specchat has, close to what chat replies look like.
3. **features**: one teacher-forced target pass per sequence through the
   runner's own prefill, capturing the residual stream entering the head's
   feature layers and the target's final normed hidden state at every
   position: its LM head over the draft vocabulary is the soft label.
4. **train**: EAGLE-3's training-time test (`EagleHead.unrolled`, `TTT_STEPS`
   unrolled draft steps), forward KL to the target's distribution over the
   draft vocabulary, equal weight per step. The LM head starts as the
   target's own rows for the draft vocabulary and stays frozen, as
   speculators trains it; `fc` starts as the identity on the high-layer features.
5. **validate**: on held-out replies, acceptance by draft position, mean
   accepted length at K = 1..6 and the speedup the measured costs predict.

Work lives in `<cache>/heads/<weights sha256[:20]>/` (the head itself, in the
speculators layout, engine/model/eagle_io.py) and its `work/` folder (the
collected data and a checkpoint): an interrupted run resumes from both, and a
later run with more minutes trains on.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import hashlib
import itertools
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria

from ..config import DecodeConfig, Mode
from ..decode.costs import measure_head_cost
from ..decode.text import render_chat
from ..events import LoadProgress, TokenEvent
from ..model import cpu
from ..model.eagle import EagleHead, HeadConfig, init_head
from ..model.eagle_io import for_decoding, head_facts, save_head
from ..model.native import prompt_rows
from ..model.runner import ModelRunner
from ..weights.loading import LoadedModel
from .train_prompts import PROMPTS, Prompt, chat, split, turns

TTT_STEPS = 3
EVAL_K = 6
WARMUP_STEPS = 50


WORK = "work"

Progress = Callable[[LoadProgress], None]


@dataclass
class TrainOptions:
    minutes: float = 10.0
    draft_vocab: int = 16384
    intermediate: int | None = None  # None: the target's, at most twice the hidden size
    # 3e-4, not 1e-3: on the same 20k tokens, seed and steps the 1.5B's head agreed with
    # the target on 16.3% of held-out first drafts after 6 minutes, against 5.8% at 1e-3
    # (docs/draft-head.md, "The learning rate").
    lr: float = 3e-4
    # The last share of the training time decays the learning rate linearly to zero (a
    # warm-up, a constant rate, then a decay: WSD); 0, the default, keeps it constant to
    # the end. 0.2 over 20 minutes on a Zen 3 ended at the constant rate's acceptance for
    # the same steps (0.23 at 640 steps; docs/draft-head.md, "A decaying rate").
    decay: float = 0.0
    max_len: int = 640  # tokens per training sequence
    reply_tokens: int = 128
    # How often a target reply is drawn for a training step against a standard-library
    # answer: the replies are what the head must predict, yet a minority of the tokens.
    # On the same data and minutes, 6 against 1 lifted held-out first-draft acceptance
    # 0.19 -> 0.23 (seed 0, 48 training replies) and 0.21 -> 0.24 (seed 1, 126;
    # docs/draft-head.md, "More target replies, drawn more often").
    reply_weight: float = 6.0
    # Times the training prompts are asked at most: greedy first, then sampled rounds
    # (SAMPLED_REPLIES). None: while the replies' share of the time lasts.
    reply_rounds: int | None = None
    # Uniform noise on the target features a step trains on, as a share of each feature
    # layer's RMS in that row (EAGLE-1's augmentation, scaled to the raw residual stream):
    # a head that sees the same few hundred replies for an hour memorizes them. 0.2 and 0.5
    # for 15 minutes, and 0.5 for half an hour on a memorizing head, left held out where it
    # was (docs/draft-head.md, "Memorizing"): off by default.
    feature_noise: float = 0.0
    # Each feature layer RMS-normed before fc (HeadConfig.fc_norm): opt-in until it is
    # measured to lift held-out acceptance (docs/draft-head.md, "Feature layers normed").
    fc_norm: bool = False
    max_steps: int | None = None  # tests: stop after this many optimizer steps
    max_texts: int = 4000  # standard-library answers at most
    collect: bool = True  # False: train on what an earlier run collected (work/data/) only
    seed: int = 0
    eval_every_s: float = 120.0
    prompts: tuple[Prompt, ...] = PROMPTS
    out: Path | None = None  # default: the cache's heads/<sha>/
    weights: Path | None = None  # the target's float checkpoint folder (its LM head, if quantized)


@dataclass
class Sequence:
    ids: list[int]
    start: int  # first reply position (its token is predicted from position start - 1)
    held_out: bool = False
    reply: bool = False  # the target's own reply (else a standard-library answer)
    sampled: bool = False  # a sampled reply (else greedy: validation can read it)
    feats: Tensor | None = None  # [S, F] bfloat16: the residual stream entering the feature layers
    last: Tensor | None = None  # [S, H] bfloat16: the target's final normed hidden state


@dataclass
class TrainResult:
    folder: Path
    head: EagleHead
    report: dict[str, Any]
    curve: list[dict[str, float]] = field(default_factory=list)


def weights_id(target: LoadedModel) -> str:
    """The target weights' SHA-256, or one of its tensors' bytes for a model built in code."""
    if target.weights_sha256:
        return target.weights_sha256
    digest = hashlib.sha256()
    for name, t in sorted(target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def head_folder(target: LoadedModel, cache_dir: Path | str | None = None) -> Path:
    from .. import paths

    return paths.heads_dir(cache_dir) / weights_id(target)[:20]


# -- 1 and 2: the sequences ---------------------------------------------------------


def target_replies(
    target: LoadedModel, prompts: list[Prompt], tokens: int, deadline: float, report: Progress,
    held_out: bool, stopped: Callable[[], bool] = lambda: False,
) -> Iterator[Sequence | None]:
    """The target's greedy reply to each prompt, as the chat gives it, until the deadline:
    one item per prompt asked (None where the reply was empty)."""
    from ..decode.session import ChatSession

    session = ChatSession(target)
    cfg = DecodeConfig(mode=Mode.PLAIN, max_new_tokens=tokens)
    for i, prompt in enumerate(prompts):
        if time.monotonic() > deadline or stopped():
            return
        said = turns(prompt)
        system = said.pop(0)[1] if said[0][0] == "system" else None
        session.system_prompt = system
        session.reset(said[:-1], drop_caches=True)
        ids = session.render(said)
        reply = [e.token_id for e in session.stream(said[-1][1], cfg) if isinstance(e, TokenEvent)]
        report(LoadProgress("replies", i + 1, len(prompts), detail="held out" if held_out else ""))
        yield Sequence(ids + reply, len(ids), held_out, reply=True) if reply else None


# Prompts decoded together for the training replies. A decode step of 16 rows costs ~4.6
# one-row steps of the 1.5B through transformers' modules on a Zen 3 (AVX2, 2 threads:
# 252 against 55 ms; 24 rows 335 ms), and a padded prompt pass costs what its rows do.
REPLY_BATCH = 16

# Once every training prompt has its greedy reply, later rounds (a longer run, or a run
# resumed with more minutes) ask the prompts again and sample the replies, each round
# with its own seed: new continuations on the target's likely paths, so a longer run
# keeps finding data the head has not seen. The labels stay the target's distribution at
# every position, whichever token was sampled there.
SAMPLED_REPLIES = DecodeConfig(temperature=0.7, top_p=0.9)


def batched_replies(
    target: LoadedModel, prompts: list[Prompt], tokens: int, deadline: float, report: Progress,
    stopped: Callable[[], bool] = lambda: False, batch: int = REPLY_BATCH,
    seed: int | None = None,
) -> Iterator[Sequence | None]:
    """The target's replies to `batch` prompts at a time (left-padded, through
    transformers' generate): one item per prompt asked, in order, as `target_replies`.
    Greedy, or with a seed sampled at `SAMPLED_REPLIES` (the same seed, the same replies).

    For training only: a padded batch's arithmetic is not the chat's, so a greedy reply may
    leave the chat's greedy path at a near-tie (2 of 4 replies of the 1.5B did, at tokens 58
    and 63 of 128) and go on as the target would from there. The held-out replies, which
    validation reads as the chat's greedy tokens, come from `target_replies`."""
    from ..model.attention import padded_batches
    from .bench_runs import hf_generation_config

    tok, model = target.tokenizer, target.model
    cfg = hf_generation_config(target, SAMPLED_REPLIES if seed is not None else DecodeConfig(), tokens)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    halt = _Halt(deadline, stopped)
    detail = f"{batch} at a time" + (f", sampled (seed {seed})" if seed is not None else "")
    for first in range(0, len(prompts), batch):
        if halt.now():
            return
        chunk = [render_chat(tok, chat(p)) for p in prompts[first : first + batch]]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk], device=target.device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=target.device)
        with padded_batches(model), torch.inference_mode(), torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed * 1_000_003 + first)
            out = model.generate(  # type: ignore[operator]
                input_ids=ids, attention_mask=mask, generation_config=cfg, stopping_criteria=[halt],
            )
        for n, prompt_ids in enumerate(chunk):
            reply = out[n, width:].tolist()
            end = next((i + 1 for i, t in enumerate(reply) if t in target.eos_ids), len(reply))
            report(LoadProgress("replies", first + n + 1, len(prompts), detail=detail))
            yield Sequence(prompt_ids + reply[:end], len(prompt_ids), reply=True, sampled=seed is not None) if end else None
        if halt.fired:  # the deadline cut this batch's replies short: they stand as they are
            return


class _Halt(StoppingCriteria):
    """A stopping criterion for generate: the deadline passed, or the user stopped."""

    def __init__(self, deadline: float, stopped: Callable[[], bool]) -> None:
        self.deadline, self.stopped, self.fired = deadline, stopped, False

    def now(self) -> bool:
        self.fired = self.fired or time.monotonic() > self.deadline or self.stopped()
        return self.fired

    def __call__(self, input_ids: Tensor, scores: Tensor, **_: Any) -> Tensor:  # type: ignore[override]
        return torch.full((input_ids.shape[0],), self.now(), dtype=torch.bool, device=input_ids.device)


def stdlib_answers(limit: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) pairs from the docstrings of the Python standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(root.glob("*/__init__.py"))
    pairs: list[tuple[str, str]] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = path.stem if path.name != "__init__.py" else path.parent.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Module):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 200:
                continue
            name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
            kind = "module" if isinstance(node, ast.Module) else (
                "class" if isinstance(node, ast.ClassDef) else "function")
            pairs.append((f"What does the Python {kind} `{name}` do?", doc[:1500]))
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def text_sequence(target: LoadedModel, pair: tuple[str, str], max_len: int) -> Sequence | None:
    """A question and its answer in the chat template; None where nothing is left to learn."""
    tok = target.tokenizer
    ids = render_chat(tok, [{"role": "user", "content": pair[0]}])
    reply = list(tok(pair[1], add_special_tokens=False)["input_ids"])
    seq = Sequence((ids + reply)[:max_len], len(ids))
    return seq if len(seq.ids) > seq.start + 1 else None


# -- 3: features and labels ---------------------------------------------------------------


@torch.inference_mode()
def featurize(runner: ModelRunner, seq: Sequence, layers: tuple[int, ...]) -> None:
    """One target pass over seq: its features [S, F] and final normed hidden states [S, H].

    The label of each position, the target's distribution, is its LM head over those
    hidden states, computed in training over the draft vocabulary only (as speculators
    does): the pass itself scores one row, not S rows of the full vocabulary.
    """
    got: list[Tensor] = []
    normed: list[Tensor] = []
    norm = runner.model.model.norm  # type: ignore[union-attr]
    hook = norm.register_forward_hook(lambda _m, _i, out: normed.append(out[0]))
    runner.capture = layers
    runner.on_features = lambda _start, f: got.append(f)
    try:
        runner.reset()
        with prompt_rows():  # teacher-forced rows: a prompt's code where there is one
            runner.feed(seq.ids, keep=1)
    finally:
        hook.remove()
        runner.on_features = None
        runner.capture = ()
        runner.reset()
    seq.feats = torch.cat(got).to(torch.bfloat16)
    seq.last = torch.cat(normed).to(torch.bfloat16)


def draft_vocabulary(seqs: list[Sequence], size: int, vocab: int) -> Tensor:
    """The `size` target ids most frequent among the reply tokens, padded with the lowest
    unused ids (speculators' rule: ties and padding by lower id)."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in seqs:
        reply = torch.tensor(s.ids[s.start :], dtype=torch.long)
        counts.index_add_(0, reply, torch.ones(reply.numel(), dtype=torch.float64))
    order = torch.argsort(-counts, stable=True)  # ties: lower id first
    return order[:size].sort().values


# -- 4: training ----------------------------------------------------------------------------


def learning_rate(base: float, step: int, progress: float, decay: float) -> float:
    """The rate for this run's step-th optimizer step: a linear warm-up over WARMUP_STEPS,
    constant, then linear to zero over the last `decay` share of the run (progress in
    [0, 1]: the share spent of the time, or steps, this run has for training)."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    left = 1.0 - min(max(progress, 0.0), 1.0)
    return base * warm * (min(1.0, left / decay) if decay > 0 else 1.0)


def new_config(target: LoadedModel, opts: TrainOptions, draft_vocab: int, sha: str) -> HeadConfig:
    config = target.model.config
    return HeadConfig.for_target(
        config,
        draft_vocab=draft_vocab,
        # An MLP of twice the width, not the target's ~6x: 1.6x the training tokens/s on
        # a 2-core CPU and a third of the head's bytes a draft step (1.5B: 3,072 vs 8,960).
        intermediate=opts.intermediate or min(int(config.intermediate_size), 2 * int(config.hidden_size)),
        target_name=target.info.source,
        target_sha256=sha,
        fc_norm=opts.fc_norm,
    )


def new_head(target: LoadedModel, opts: TrainOptions, vocab_ids: Tensor, sha: str) -> EagleHead:
    """A head for the target: its LM head the target's rows where they are float, frozen."""
    cfg = new_config(target, opts, int(vocab_ids.numel()), sha)
    head = init_head(EagleHead(cfg), opts.seed)
    head.set_vocab(vocab_ids)
    rows = _target_head_rows(target, head.draft_to_target, opts.weights)
    with torch.no_grad():
        if rows is not None:  # the target's own rows, frozen (speculators does the same)
            head.lm_head.weight.copy_(rows)
            head.lm_head.weight.requires_grad_(False)
        # Start from the high-layer features alone (fc the identity on them) and a layer
        # near the identity: the first steps refine a sensible guess instead of undoing a
        # random projection (loss at step 0: 27 against 40 nats over 3 steps, 1.5B target).
        hidden, ht = cfg.hidden_size, cfg.target_hidden_size
        if hidden == ht:
            head.fc.weight.zero_()
            head.fc.weight[:, -ht:] = torch.eye(ht)
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
    return head


def _target_head_rows(target: LoadedModel, ids: Tensor, weights: Path | None = None) -> Tensor | None:
    """The target's float LM-head rows for ids: its module's, its tied embedding's, or read
    from its checkpoint folder when the loaded head is quantized; None if none of these."""
    out = target.model.get_output_embeddings()
    weight = getattr(out, "weight", None)
    if isinstance(weight, Tensor) and weight.is_floating_point() and weight.device.type != "meta":
        return weight.detach()[ids].float().cpu()
    tied = bool(getattr(target.model.config, "tie_word_embeddings", False))
    if tied:
        emb = getattr(target.model.get_input_embeddings(), "weight", None)
        if isinstance(emb, Tensor):
            return emb.detach()[ids].float().cpu()
    if weights is not None:
        from ..weights.stream import read_tensor

        with contextlib.suppress(OSError, KeyError, ValueError):
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
            return read_tensor(weights, name)[ids].float()
    return None


def label_logits(target: LoadedModel, ids: Tensor, weights: Path | None = None) -> Callable[[Tensor], Tensor]:
    """The target's logits over draft ids from its final normed hidden states [n, H]
    (through its quantized LM head over the whole vocabulary where no float rows exist)."""
    rows = _target_head_rows(target, ids, weights)
    if rows is not None:
        rows = rows.to(target.device)
        return lambda h: h.float() @ rows.T
    head = target.model.get_output_embeddings()
    index = ids.to(target.device)
    return lambda h: head(h.float())[:, index].float()


def autocast_dtype(device: torch.device) -> tuple[torch.dtype | None, str]:
    """bfloat16 autocast where the hardware multiplies bfloat16 natively, else float32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA: bfloat16 autocast"
    have = cpu.features()
    if have.amx or have.avx512_bf16:
        return torch.bfloat16, f"CPU with {'AMX' if have.amx else 'AVX512-BF16'}: bfloat16 autocast"
    return None, "CPU without bfloat16 arithmetic: float32"


def sequence_loss(
    head: EagleHead, embed: torch.nn.Module, seq: Sequence, labels: Callable[[Tensor], Tensor],
    steps: int, noise: float = 0.0,
) -> tuple[Tensor, int, list[float]]:
    """Forward KL to the target over the draft vocabulary (soft labels), summed over the
    unrolled steps: (loss, labelled rows, top-1 agreement with the target per step).
    `noise`: the features get uniform noise of that share of their RMS (`noisy`)."""
    assert seq.feats is not None and seq.last is not None
    dev = head.norm.weight.device
    s = len(seq.ids)
    ids = torch.tensor(seq.ids, device=dev)
    embeds = embed(ids[1:]).float()  # row j: x_{j+1}
    feats = seq.feats[: s - 1].to(dev).float()  # row j: f_j
    if noise > 0:
        feats = noisy(feats, len(head.config.aux_layers), noise)
    # Row j predicts x_{j+2}: the target's distribution at position j + 1, in float32.
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):
        target_logits = labels(seq.last[1:].to(dev))  # [S-1, Vd]
        p = torch.softmax(target_logits.float(), dim=-1)
        best = target_logits.argmax(-1)
    first = max(seq.start - 2, 0)  # rows from here predict reply tokens (x_{j+2})
    outs = head.unrolled(embeds, feats, steps, first)  # step s: rows max(first, s)..
    total = embeds.new_zeros(())
    agree: list[float] = []
    n_rows = 0
    for step, logits in enumerate(outs):
        if not logits.shape[0]:
            agree.append(0.0)
            continue
        rows = slice(max(first, step), None)
        logq = torch.log_softmax(logits.float(), dim=-1)  # [n, Vd]
        total = total - (p[rows] * logq).sum(-1).mean()
        agree.append(float((logits.argmax(-1) == best[rows]).float().mean()))
        n_rows = max(n_rows, logits.shape[0])
    return total, n_rows, agree


def noisy(feats: Tensor, layers: int, share: float) -> Tensor:
    """feats [S, layers * H] plus uniform noise in +-share x the RMS of each row's slice
    of each layer: the residual stream's scale grows with depth, so one absolute width
    would drown the low layer's features and leave the high layer's untouched."""
    f = feats.view(feats.shape[0], layers, -1)
    rms = f.pow(2).mean(-1, keepdim=True).sqrt()
    return (f + (torch.rand_like(f) * 2 - 1) * (share * rms)).view_as(feats)


# -- 5: validation ----------------------------------------------------------------------


@torch.inference_mode()
def validate(head: EagleHead, embed: torch.nn.Module, seqs: list[Sequence], k: int = EVAL_K) -> dict[str, Any]:
    """Greedy acceptance on held-out target replies: a chain leaving the target at row m
    accepts draft s while every draft up to s equals the target's greedy token.

    Returns acceptance by position (P(draft s accepted | drafts before it were)),
    mean accepted drafts per round at K = 1..k and the positions it saw."""
    t2d = head.target_to_draft()
    dev = head.norm.weight.device
    accepted_at = torch.zeros(k, device=dev)  # chains whose first s+1 drafts were accepted
    chains = 0
    for seq in seqs:
        assert seq.feats is not None
        s = len(seq.ids)
        ids = torch.tensor(seq.ids, device=dev)
        lo, hi = max(seq.start - 2, 0), s - 1 - k  # the chains leaving at rows lo..hi-1
        if hi <= lo:
            continue
        outs = head.unrolled(embed(ids[1:]).float(), seq.feats[: s - 1].to(dev).float(), k, lo)
        # Held-out sequences are the target's greedy replies: x_{j+2} is its greedy token
        # (an id outside the draft vocabulary, -1, is never drafted).
        greedy = torch.cat([t2d[ids[2:]], t2d.new_full((1,), -1)])  # [S-1]
        # run[i, n]: draft i of the chain leaving at row lo + n hit (one tensor op per
        # draft position, not a host round trip per chain: on a GPU that is the cost);
        # step i's logits start at row max(lo, i).
        run = torch.stack([
            (o.argmax(-1) == greedy[max(lo, i) :])[lo + i - max(lo, i) : hi + i - max(lo, i)]
            for i, o in enumerate(outs)
        ]).long()
        accepted_at += torch.cumprod(run, 0).sum(1).float()
        chains += hi - lo
    if not chains:
        return {"chains": 0}
    reach = accepted_at.cpu() / chains  # P(first s+1 drafts accepted)
    by_position = [float(reach[0])] + [
        float(reach[i] / reach[i - 1]) if reach[i - 1] > 0 else 0.0 for i in range(1, k)
    ]
    mean_accepted = {K: float(reach[:K].sum()) for K in range(1, k + 1)}
    return {"chains": chains, "acceptance_by_position": by_position, "mean_accepted": mean_accepted}


MEMORIZING = 0.15  # first-draft acceptance this much higher on seen replies than held out


def seen_replies(trainset: list[Sequence], n: int) -> list[Sequence]:
    """n greedy training replies spread over the prompt set: validated beside the held-out
    ones, they tell memorizing (high here, low there) from learning too little (low on both)."""
    greedy = [q for q in trainset if q.reply and not q.sampled]
    return greedy[:: max(1, len(greedy) // n)][:n] if n else []


def validated(head: EagleHead, embed: torch.nn.Module, held: list[Sequence], seen: list[Sequence]) -> dict[str, Any]:
    """`validate` on the held-out replies, with the first-draft acceptance on replies the
    head trained on as `seen_top1`."""
    res = validate(head, embed, held)
    mine: dict[str, Any] = validate(head, embed, seen) if seen else {"chains": 0}
    if res.get("chains") and mine.get("chains"):
        res["seen_top1"] = mine["acceptance_by_position"][0]
    return res


def predicted_speedup(mean_accepted: dict[int, float], c: float, verify: Callable[[int], float]) -> dict[int, float]:
    """(1 + accepted(K)) / (K c + v(K)) for each K: tokens per round over its cost in target steps."""
    return {K: (1 + a) / (K * c + verify(K)) for K, a in mean_accepted.items()}


# -- the whole run -------------------------------------------------------------------------


@dataclass
class Budget:
    """Deadlines for the stages, from the start and the minutes given."""

    start: float
    seconds: float

    def at(self, share: float) -> float:
        return self.start + share * self.seconds

    @property
    def end(self) -> float:
        return self.start + self.seconds


SHARD = 25  # sequences a data file holds


class DataStore:
    """work/data/: the collected sequences in files of SHARD each, every full file written
    once (the last, partial one rewritten as it fills), and state.json with their count
    and how far the stages got, written last. A save costs what is new, not all that was
    collected: one data.pt rewritten whole every 25 sequences wrote ~400 GB over a run
    that filled the 6 GiB cap. A work/data.pt from before is read and carried over."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "data"
        self.legacy = work / "data.pt"
        self.done = 0  # sequences in full files on disk

    def _file(self, n: int) -> Path:
        return self.dir / f"{n:05d}.pt"

    def load(self) -> tuple[list[Sequence], dict[str, int]]:
        """What an earlier run collected; nothing where the files are missing, torn or old."""
        try:
            if (self.dir / "state.json").is_file():
                meta = json.loads((self.dir / "state.json").read_text())
                count = int(meta.pop("count"))
                rows: list[dict[str, Any]] = []
                for n in range(math.ceil(count / SHARD)):
                    rows += torch.load(self._file(n), weights_only=True)
                rows, state = rows[:count], {k: int(v) for k, v in meta.items()}
                self.done = count // SHARD * SHARD
            elif self.legacy.is_file():
                saved = torch.load(self.legacy, weights_only=True)
                rows, state = saved["seqs"], dict(saved["state"])
            else:
                return [], {"asked": 0, "texts": 0}
            if rows and "reply" not in rows[0]:
                _mark_replies(rows, state["asked"])
            return [Sequence(**row) for row in rows], state
        except Exception:
            self.done = 0
            return [], {"asked": 0, "texts": 0}

    def save(self, seqs: list[Sequence], state: dict[str, int]) -> None:
        rows = [vars(q) for q in seqs if q.feats is not None]
        self.dir.mkdir(parents=True, exist_ok=True)
        for first in range(self.done, len(rows), SHARD):
            _replace(self._file(first // SHARD), functools.partial(torch.save, rows[first : first + SHARD]))
        self.done = len(rows) // SHARD * SHARD
        meta = json.dumps({**state, "count": len(rows)})
        _replace(self.dir / "state.json", lambda tmp: tmp.write_text(meta))
        self.legacy.unlink(missing_ok=True)


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) beside path, then rename over it: a reader sees the old file or the new."""
    tmp = path.with_name(path.name + ".part")
    write(tmp)
    tmp.replace(path)


def _mark_replies(rows: list[dict[str, Any]], asked: int) -> None:
    """Data saved before sequences said what they are: collect() adds the held-out replies,
    then one training reply per prompt asked (none where a reply came back empty, which
    would count one answer among the replies here), then the answers."""
    for row in rows:
        row["reply"] = bool(row["held_out"]) or asked > 0
        if not row["held_out"]:
            asked -= 1


MAX_FEATURE_BYTES = 6 << 30  # features kept in memory (and in work/data/) at most


def collect(
    target: LoadedModel, opts: TrainOptions, work: Path, budget: Budget, report: Progress,
    tell: Callable[[str], None], stopped: Callable[[], bool],
) -> list[Sequence]:
    """Stages 1-3, kept in work/data/ (every SHARD sequences, and on Ctrl+C): a later run
    goes on where this one stopped."""
    store = DataStore(work)
    seqs, state = store.load()
    if not opts.collect:
        if not seqs:
            raise ValueError(f"no data collected before in {work}: run without --no-collect first")
        tell(f"training on the {len(seqs)} sequences collected before (--no-collect)")
        return seqs
    if seqs:
        tell(f"resuming with {len(seqs)} sequences collected before")
    train_prompts, held_prompts = split(opts.prompts)
    runner = ModelRunner(target.model, target.device)
    layers = HeadConfig.for_target(target.model.config).aux_layers
    kept = sum(_bytes(q) for q in seqs)

    def add(q: Sequence) -> None:
        nonlocal kept
        q.ids = q.ids[: opts.max_len]
        featurize(runner, q, layers)
        seqs.append(q)
        kept += _bytes(q)
        if len(seqs) % SHARD == 0:
            store.save(seqs, state)

    try:
        if not any(q.held_out for q in seqs):
            for q in target_replies(target, held_prompts, opts.reply_tokens, budget.at(0.1), report, True, stopped):
                if q is not None:
                    add(q)
        # Up to 40% of the time (held-out ones included): the replies lifted acceptance more
        # than the answers did (docs/draft-head.md, "More target replies, drawn more often").
        # Greedy replies first, then sampled rounds while the time lasts (SAMPLED_REPLIES).
        while train_prompts and time.monotonic() < budget.at(0.4) and not stopped() and kept <= MAX_FEATURE_BYTES:
            rounds, at = divmod(state["asked"], len(train_prompts))
            if opts.reply_rounds is not None and rounds >= opts.reply_rounds:
                break
            seed = None if rounds == 0 else opts.seed * 1000 + rounds
            for q in batched_replies(
                target, train_prompts[at:], opts.reply_tokens, budget.at(0.4), report, stopped, seed=seed
            ):
                state["asked"] += 1
                if q is not None:
                    add(q)
                if kept > MAX_FEATURE_BYTES:
                    break
        pairs = stdlib_answers(opts.max_texts, opts.seed)[state["texts"] :]
        tell(f"features: up to {len(pairs)} standard-library answers through the target")
        for i, pair in enumerate(pairs):
            if time.monotonic() > budget.at(0.5) or stopped() or kept > MAX_FEATURE_BYTES:
                break
            state["texts"] += 1
            q = text_sequence(target, pair, opts.max_len)
            if q is not None:
                add(q)
            report(LoadProgress("features", i + 1, len(pairs)))
    finally:  # Ctrl+C included: what was collected is kept
        store.save(seqs, state)
    return seqs


def sampler(seqs: list[Sequence], reply_weight: float, rng: random.Random) -> Callable[[], Sequence]:
    """Draws a training sequence, a target reply `reply_weight` times as often as an answer."""
    cum = list(itertools.accumulate(reply_weight if q.reply else 1.0 for q in seqs))
    return lambda: rng.choices(seqs, cum_weights=cum)[0]


def _bytes(q: Sequence) -> int:
    return sum(t.numel() * t.element_size() for t in (q.feats, q.last) if t is not None)


def train(
    target: LoadedModel,
    opts: TrainOptions,
    progress: Progress | None = None,
    cancel: Any = None,
    cache_dir: Path | str | None = None,
    say: Callable[[str], None] | None = None,
) -> TrainResult:
    """Collect, featurize, train and validate within opts.minutes; resumable (module doc)."""
    report = progress or (lambda _e: None)
    tell = say or (lambda _m: None)
    stopped = cancel.is_set if cancel is not None else (lambda: False)
    sha = weights_id(target)
    folder = Path(opts.out) if opts.out else head_folder(target, cache_dir)
    work = folder / WORK
    work.mkdir(parents=True, exist_ok=True)
    budget = Budget(time.monotonic(), opts.minutes * 60)
    torch.manual_seed(opts.seed)
    embed = target.model.get_input_embeddings()
    seqs = collect(target, opts, work, budget, report, tell, stopped)
    held = [q for q in seqs if q.held_out]
    trainset = [q for q in seqs if not q.held_out]
    seen = seen_replies(trainset, len(held))
    if not trainset:
        raise ValueError("no training data was collected in the time given: give more --minutes")
    tokens = sum(len(q.ids) - q.start for q in trainset)
    replies = [q for q in trainset if q.reply]
    tell(f"data: {len(trainset)} sequences ({tokens} reply tokens; {len(replies)} target replies, "
         f"{sum(len(q.ids) - q.start for q in replies)} tokens), {len(held)} held out")

    # 4. The head: a checkpoint's, or new over the draft vocabulary this data suggests.
    ckpt_path = work / "checkpoint.pt"
    ckpt = _load_checkpoint(ckpt_path, sha)
    head: EagleHead | None = None
    if ckpt is not None:
        saved = HeadConfig(**{**ckpt["config"], "aux_layers": tuple(ckpt["config"]["aux_layers"])})
        wanted = new_config(target, opts, saved.draft_vocab_size, sha)
        if (saved.intermediate_size, saved.draft_vocab_size, saved.fc_norm) != (
            wanted.intermediate_size, min(opts.draft_vocab, saved.target_vocab_size), wanted.fc_norm
        ):
            tell("the checkpoint has another shape than asked for (--head-vocab, --intermediate, "
                 "--fc-norm): training a new head")
            ckpt = None
        else:
            head = EagleHead(saved)
            try:
                head.load_state_dict(ckpt["head"])
                head.lm_head.weight.requires_grad_(not ckpt["frozen_lm_head"])
                tell(f"resuming training at step {ckpt['step']} ({ckpt['seconds']:.0f} s trained)")
            except (RuntimeError, KeyError) as exc:
                tell(f"the checkpoint does not load ({str(exc).splitlines()[0]}): training a new head")
                head, ckpt = None, None
    if head is None:
        vocab_ids = draft_vocabulary(seqs, min(opts.draft_vocab, target.model.config.vocab_size),
                                     int(target.model.config.vocab_size))
        head = new_head(target, opts, vocab_ids, sha)
    head.to(target.device).train()
    frozen = not head.lm_head.weight.requires_grad
    params = [p for p in head.parameters() if p.requires_grad]
    # fused: one kernel over all parameters (CPU too): a 30M-parameter step took 28 ms
    # against 102 for the per-tensor default on a Zen 3 (docs/draft-head.md).
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    step, seconds, curve = 0, 0.0, []
    if ckpt is not None:
        optim.load_state_dict(ckpt["optim"])
        step, seconds, curve = int(ckpt["step"]), float(ckpt["seconds"]), list(ckpt["curve"])
    amp, amp_why = autocast_dtype(target.device)
    tell(f"training: {head.parameter_count() / 1e6:.1f}M parameters "
         f"({sum(p.numel() for p in params) / 1e6:.1f}M trained), {amp_why}")
    labels = label_logits(target, head.draft_to_target.cpu(), opts.weights)
    draw = sampler(trainset, opts.reply_weight, random.Random(opts.seed + step))
    last_eval = time.monotonic()
    trained_tokens = 0
    t_train = time.monotonic()
    # Warm-up and decay run over this run's own steps and time: a run that resumes from a
    # decayed checkpoint warms up to the full rate again and decays again at its end.
    train_end = budget.end - _validation_room(budget)
    first_step = step

    def checkpoint() -> None:
        torch.save({
            "sha": sha, "config": head.config.as_dict(), "head": head.state_dict(),
            "optim": optim.state_dict(), "step": step, "frozen_lm_head": frozen,
            "seconds": seconds + time.monotonic() - t_train, "curve": curve,
        }, ckpt_path.with_name("checkpoint.pt.part"))
        ckpt_path.with_name("checkpoint.pt.part").replace(ckpt_path)

    def evaluate() -> dict[str, Any]:
        head.eval()
        res = validated(head, embed, held, seen)
        head.train()
        return res

    last_saved = time.monotonic()
    try:
        while not stopped():
            if opts.max_steps is not None and step >= opts.max_steps:
                break
            if opts.max_steps is None and time.monotonic() > train_end:
                break
            q = draw()
            if opts.max_steps is not None:
                spent = (step - first_step) / max(opts.max_steps - first_step, 1)
            else:
                spent = (time.monotonic() - t_train) / max(train_end - t_train, 1e-9)
            lr = learning_rate(opts.lr, step - first_step, spent, opts.decay)
            for g in optim.param_groups:
                g["lr"] = lr
            with torch.autocast(target.device.type, dtype=amp) if amp else contextlib.nullcontext():
                loss, rows, agree = sequence_loss(head, embed, q, labels, TTT_STEPS, opts.feature_noise)
            if rows == 0:
                continue
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            trained_tokens += rows
            elapsed = time.monotonic() - t_train
            report(LoadProgress("train", step, opts.max_steps,
                                detail=f"loss {loss.item():.3f}, top-1 {agree[0]:.2f}, "
                                f"{trained_tokens / max(elapsed, 1e-9):.0f} tokens/s"))
            if held and time.monotonic() - last_eval > max(opts.eval_every_s, budget.seconds / 12):
                res = evaluate()
                curve.append(_point(seconds + elapsed, res))
                tell(f"after {(seconds + elapsed) / 60:.1f} min: {_describe(res)}")
                last_eval = time.monotonic()
            if time.monotonic() - last_saved > 60:
                checkpoint()
                last_saved = time.monotonic()
    except KeyboardInterrupt:
        checkpoint()
        raise
    if step == 0:
        raise ValueError(
            "the time given ran out before the first training step: give more --minutes "
            "(the data collected is kept; the next run starts from it)"
        )
    checkpoint()
    elapsed = time.monotonic() - t_train
    head.eval()

    # 5. Validation and the head's own file.
    res = validated(head, embed, held, seen) if held else {"chains": 0}
    total_s = seconds + elapsed
    if res.get("chains"):
        curve.append(_point(total_s, res))
    decoding, how = for_decoding(copy.deepcopy(head), target.device)
    head_ms, target_ms, verify = measure_head_cost(decoding, ModelRunner(target.model, target.device), embed)
    c = head_ms / target_ms if target_ms else math.nan
    report_ = {
        **res,
        "head_step_ms": head_ms,
        "target_step_ms": target_ms,
        "c": c,
        "verify": verify,
        "train_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
        "precision": amp_why,
        "decoding": how,
        "cpu": cpu.features().summary(),
    }
    if res.get("mean_accepted"):
        report_["predicted_speedup"] = predicted_speedup(
            res["mean_accepted"], c, lambda k: verify[k]
        )
    facts = {
        "trained_steps": step,
        "trained_seconds": total_s,
        "train_sequences": len(trainset),
        "train_reply_tokens": sum(len(q.ids) - q.start for q in trainset),
        "train_target_replies": len(replies),
        "reply_weight": opts.reply_weight,
        "validation": report_,
        "curve": curve,
    }
    save_head(head, folder, facts, list(getattr(target.model.config, "architectures", None) or []))
    return TrainResult(folder, head, report_, curve)


def _validation_room(budget: Budget) -> float:
    """Seconds kept at the end for validation and saving: a few percent of the run."""
    return min(30.0, 0.05 * budget.seconds)


def _load_checkpoint(path: Path, sha: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        ckpt = torch.load(path, weights_only=True)
    except Exception:
        return None
    return ckpt if ckpt.get("sha") == sha else None


def _point(seconds: float, res: dict[str, Any]) -> dict[str, float]:
    acc = res.get("acceptance_by_position") or [0.0]
    mean = res.get("mean_accepted") or {}
    point = {"minutes": seconds / 60, "top1": float(acc[0]), "accepted_k4": float(mean.get(4, 0.0))}
    if "seen_top1" in res:
        point["seen_top1"] = float(res["seen_top1"])
    return point


def _describe(res: dict[str, Any]) -> str:
    if not res.get("chains"):
        return "no held-out replies to validate on"
    acc = ", ".join(f"{a:.2f}" for a in res["acceptance_by_position"])
    mean = res["mean_accepted"]
    seen = f"; first draft on training replies {res['seen_top1']:.2f}" if "seen_top1" in res else ""
    return f"acceptance by position {acc}; mean accepted at K=1 {mean[1]:.2f}, K=4 {mean[4]:.2f}{seen}"


def describe_report(result: TrainResult) -> str:
    """The validation report for the terminal."""
    r = result.report
    lines = [f"head saved in {result.folder}"]
    if r.get("chains"):
        lines.append(f"held-out chains: {r['chains']}")
        lines.append("acceptance by draft position: " + ", ".join(
            f"{i + 1}: {a:.2f}" for i, a in enumerate(r["acceptance_by_position"])))
        lines.append("mean accepted drafts per round: " + ", ".join(
            f"K={k}: {a:.2f}" for k, a in r["mean_accepted"].items()))
        if "seen_top1" in r:
            gap = r["seen_top1"] - r["acceptance_by_position"][0]
            lines.append(f"first draft on replies it trained on: {r['seen_top1']:.2f}" + (
                " (far above held out: the head memorizes its replies, and more minutes on "
                "the same data will not lift held out)" if gap > MEMORIZING else ""))
    else:
        lines.append("no held-out replies were collected: no validation figures")
    lines.append(f"cost ({r['decoding']}): head step {r['head_step_ms']:.1f} ms, target step {r['target_step_ms']:.1f} ms, "
                 f"c = {r['c']:.3f}")
    if r.get("predicted_speedup"):
        best = max(r["predicted_speedup"].items(), key=lambda kv: kv[1])
        lines.append("verify of K drafts, in target steps: " + ", ".join(
            f"K={k}: {v:.2f}" for k, v in r["verify"].items()))
        lines.append(f"predicted speedup (1 + accepted) / (K c + v): best K={best[0]}: {best[1]:.2f}x plain")
    lines.append(f"training: {r['train_tokens_per_s']:.0f} tokens/s, {r['precision']}")
    return "\n".join(lines)


def saved_curve(folder: Path) -> list[dict[str, float]]:
    return list(head_facts(folder).get("curve") or [])


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
