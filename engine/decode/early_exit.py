"""Early exit on the target (lossy) and the self-speculative draft (lossless).

Early exit follows CALM (Schuster et al. 2022, "Confident Adaptive Language
Modeling"): after some decoder layers (the exit points), a confidence
measure decides whether the token is emitted from that layer's hidden state
through the model's final norm and LM head. The layers skipped for the
exited position still owe K/V entries to the cache, so later tokens can
attend to it; they are filled by state propagation (CALM section 3.2): the
exit layer's hidden state goes through each skipped layer's input norm and
K/V projections, K is rotated, and both are appended to that layer's cache.

Confidence measures (`Measure`), their cost per exit point on the default
1.5B target (hidden 1,536, vocabulary 151,936):

- SOFTMAX: top-1 probability of the exit layer's distribution. Needs the LM
  head: 233M multiply-adds, about five decoder layers' worth.
- MARGIN: top-1 minus top-2 probability. Same cost as SOFTMAX.
- SATURATION: cosine similarity between the hidden states at this exit point
  and at the previous one (the embeddings for the first). O(hidden): free.
  With SOFTMAX and MARGIN it serves as the pre-check (`ExitPolicy.gates`) that
  decides whether the LM head is paid at all.

The self-speculative draft (LayerSkip, Elhoushi et al. 2024) runs the first E
layers of the target plus its final norm and head; the full target verifies
(Leviathan et al. 2023), so the output is exactly the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache

from ..config import DecodeConfig
from ..events import Provenance, TokenEvent
from ..model.kv_cache import new_cache
from ..model.layers import LayerStack, crop_layers
from ..model.runner import ModelRunner
from .exit_policy import ExitPolicy, Measure, exits_at
from .sampling import logits_to_probs, sample
from .speculative import Proposal, RoundResult, draft_chain, emitted

if TYPE_CHECKING:
    from ..weights.loading import LoadedModel

def _saturation(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1))


def _confidence(measure: Measure, logits: Tensor) -> float:
    probs = torch.softmax(logits.float(), dim=-1)  # [V]
    top = torch.topk(probs, 2).values
    if measure is Measure.MARGIN:
        return float(top[0] - top[1])
    return float(top[0])


def _pick(
    logits: Tensor, cfg: DecodeConfig, generator: torch.Generator | None
) -> tuple[int, float]:
    """The token from logits [V], and its probability under the distribution it came from."""
    if cfg.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(torch.softmax(logits.float(), dim=-1)[tok])
    probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    tok = int(sample(probs, generator))
    return tok, float(probs[tok])


# -- early exit on the target ----------------------------------------------------


@dataclass(slots=True)
class ExitCounts:
    """What the stepper did so far: per exit point, how often each cost was paid."""

    steps: int = 0
    head_evals: list[int] = field(default_factory=list)  # LM heads at exit points
    gated: list[int] = field(default_factory=list)  # exit points the pre-check skipped
    exits: list[int] = field(default_factory=list)  # tokens emitted there
    layers: int = 0  # decoder layers executed, all steps


class EarlyExitStepper:
    """One token per step from the target, stopping at an exit point when confident.

    Works on the session's target runner: its DynamicCache and `cached`
    count stay what plain and speculative decoding expect (all layers hold
    K/V for the first `cached` tokens).
    """

    def __init__(self, runner: ModelRunner, policy: ExitPolicy) -> None:
        self.runner = runner
        self.policy = policy
        self.stack = runner.stack or LayerStack(runner.model, runner.native)
        if policy.layers and policy.layers[-1] >= self.stack.num_layers:
            raise ValueError(
                f"exit layers must be below {self.stack.num_layers}, got {policy.layers}"
            )
        n = len(policy.layers)
        self.counts = ExitCounts(head_evals=[0] * n, gated=[0] * n, exits=[0] * n)

    def step(
        self, seq: list[int], cfg: DecodeConfig, generator: torch.Generator | None
    ) -> RoundResult:
        """Emit the token after seq (EARLY_EXIT or TARGET provenance)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            em, layers = self._step(seq, cfg, generator)
        ms = (time.perf_counter() - t0) * 1e3
        return RoundResult([em], 0, 0, 0.0, ms, layers_run=[layers])

    def _step(
        self, seq: list[int], cfg: DecodeConfig, generator: torch.Generator | None
    ) -> tuple[TokenEvent, int]:
        runner, stack, policy, counts = self.runner, self.stack, self.policy, self.counts
        if runner.cached >= len(seq):
            runner.crop_to(len(seq) - 1)  # the last token must be fed again for its logits
        if len(seq) - runner.cached > 1:
            runner.feed(seq[runner.cached : -1])  # earlier pending tokens: all layers
        ids = torch.tensor(seq[-1:], dtype=torch.long, device=runner.device)
        p = stack.begin(ids, runner.cache, runner.cached)
        counts.steps += 1
        done = 0
        if policy.active:
            prev = p.h[0, -1]  # the embeddings [H]: saturation's reference at the first exit point
            for i, (layer, threshold) in enumerate(
                zip(policy.layers, policy.thresholds, strict=True)
            ):
                hs = stack.run(p, done, layer)[:, -1:]  # [1, 1, H]
                h = hs[0, -1]  # [H]
                done = layer
                saturation: float | None = None
                gate = policy.gates[i] if policy.gates is not None else None
                if threshold < 1.0 and (policy.measure is Measure.SATURATION or gate is not None):
                    saturation = _saturation(h, prev)
                prev = h
                if threshold >= 1.0:
                    continue
                logits: Tensor | None = None
                if policy.measure is Measure.SATURATION:
                    assert saturation is not None
                    confidence = saturation
                else:
                    if gate is not None and saturation is not None and saturation < gate:
                        counts.gated[i] += 1
                        continue
                    logits = stack.logits(hs)[0, -1]  # [V]
                    counts.head_evals[i] += 1
                    confidence = _confidence(policy.measure, logits)
                if not exits_at(confidence, threshold):
                    continue
                if logits is None:
                    logits = stack.logits(hs)[0, -1]
                stack.kv_fill(p, layer)
                runner.cached += 1
                counts.exits[i] += 1
                counts.layers += layer
                tok, prob = _pick(logits, cfg, generator)
                em = emitted(
                    tok,
                    Provenance.EARLY_EXIT,
                    p_target=prob,
                    exit_layer=layer,
                    confidence=confidence,
                )
                return em, layer
        hs = stack.run(p, done, stack.num_layers)[:, -1:]  # [1, 1, H]
        runner.cached += 1
        counts.layers += stack.num_layers
        tok, prob = _pick(stack.logits(hs)[0, -1], cfg, generator)
        return emitted(tok, Provenance.TARGET, p_target=prob), stack.num_layers


# -- the self-speculative draft ---------------------------------------------------


class SelfSpecDrafter:
    """Drafts with the target's first E layers, its final norm and its LM head.

    Two cache designs:

    - `runner=None`: its own DynamicCache over the first E layers (simple;
      prefills the prompt through E layers once more and holds their K/V twice).
    - `runner=<the session's target runner>`: reuses the target's K/V for
      layers 0..E-1, which are exactly what the draft would compute (a layer's
      output depends only on the layers below it). No second prefill, no second
      copy. The drafted tokens' K/V are appended to those layers while
      drafting and removed again before `propose` returns, because
      `speculative_round` then crops the runner to n0-1 (which only looks at
      `runner.cached`) and feeds pending + drafts through all layers: the
      cache must be back to `runner.cached` positions in every layer.
    """

    def __init__(
        self, target: LoadedModel, exit_layer: int, runner: ModelRunner | None = None
    ) -> None:
        self.stack = (runner and runner.stack) or LayerStack(
            target.model, runner.native if runner is not None else "build"
        )
        if not 1 <= exit_layer <= self.stack.num_layers:
            raise ValueError(f"exit_layer must be in 1..{self.stack.num_layers}, got {exit_layer}")
        self.exit_layer = exit_layer
        self.name = f"self-spec E={exit_layer}"
        self.device = target.device
        self.shared = runner
        self.cache = new_cache(target.model.config)
        self.cached = 0  # own cache only

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        with torch.inference_mode():
            return self._propose(seq, k, cfg, generator)

    def _propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        runner = self.shared
        if runner is not None:
            if runner.cached >= len(seq):
                runner.crop_to(len(seq) - 1)
            cache, base = runner.cache, runner.cached
        else:
            if self.cached >= len(seq):
                self.rollback(len(seq) - 1)
            cache, base = self.cache, self.cached
        pending = torch.tensor(seq[base:], dtype=torch.long, device=self.device)
        past = base + int(pending.shape[0])

        def step(tok: Tensor) -> Tensor:
            nonlocal past
            logits = self._layers(tok, cache, past)
            past += 1
            return logits

        proposal = draft_chain(self._layers(pending, cache, base), step, k, cfg, generator)
        if runner is not None:
            crop_layers(cache, range(self.exit_layer), base)  # back to the runner's invariant
        else:
            self.cached = past
        return proposal

    def _layers(self, ids: Tensor, cache: DynamicCache, past: int) -> Tensor:
        """Feed ids [S] through the first E layers; logits of the last position [V]."""
        p = self.stack.begin(ids, cache, past)
        h = self.stack.run(p, 0, self.exit_layer)[:, -1:]  # [1, 1, H]
        return self.stack.logits(h)[0, -1]

    def catch_up(self, seq: list[int]) -> None:
        """Nothing to do ahead: `propose` feeds the pending tokens through E layers only."""

    def rollback(self, n: int) -> None:
        if self.shared is None and self.cached > n:
            crop_layers(self.cache, range(self.exit_layer), n)
            self.cached = n

    def reset(self) -> None:
        if self.shared is None:
            self.cache = new_cache(self.stack.config)
            self.cached = 0
