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
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .attention import MAX_ROWWISE
from .config import DecodeConfig
from .decoder import native_decoder
from .errors import EngineError
from .events import Provenance
from .kv_cache import new_cache
from .runner import ModelRunner
from .sampling import logits_to_probs, sample
from .speculative import Emitted, Proposal, RoundResult, draft_chain

if TYPE_CHECKING:
    from .loading import LoadedModel
    from .session import ChatSession

# Used when the model has no calibration and no --exit-threshold was given:
# strict, because an uncalibrated exit layer can be confidently wrong.
DEFAULT_THRESHOLD = 0.99


class Measure(StrEnum):
    """What decides an exit (see the module docstring for the costs)."""

    SOFTMAX = "softmax"  # top-1 probability
    MARGIN = "margin"  # top-1 minus top-2 probability
    SATURATION = "saturation"  # cosine(hidden at this exit point, hidden at the previous one)


def default_exit_layers(num_layers: int) -> tuple[int, ...]:
    """Every quarter: 7, 14, 21 of 28; 1, 2, 3 of 4. Counted in layers executed."""
    points = {num_layers * q // 4 for q in (1, 2, 3)}
    return tuple(sorted(p for p in points if 1 <= p < num_layers))


def exits_at(confidence: float, threshold: float) -> bool:
    """The exit rule. A threshold of 1.0 or more means never (a probability can reach 1.0)."""
    return threshold < 1.0 and confidence >= threshold


@dataclass(frozen=True, slots=True)
class ExitPolicy:
    """Where to look and when to leave.

    `layers` are exit points counted in layers executed (1..L-1, increasing);
    `thresholds[i]` applies at `layers[i]` (>= 1.0: never exit there);
    `gates[i]`, for SOFTMAX and MARGIN, is the saturation pre-check: the LM
    head is computed at `layers[i]` only when saturation >= gates[i].
    """

    layers: tuple[int, ...]
    thresholds: tuple[float, ...]
    measure: Measure = Measure.SOFTMAX
    gates: tuple[float, ...] | None = None
    source: str = "default"  # "calibrated" | "threshold" | "default"

    def __post_init__(self) -> None:
        if len(self.thresholds) != len(self.layers):
            raise ValueError("one threshold per exit layer")
        if self.gates is not None and len(self.gates) != len(self.layers):
            raise ValueError("one gate per exit layer")
        if list(self.layers) != sorted(set(self.layers)) or (self.layers and self.layers[0] < 1):
            raise ValueError(f"exit layers must be increasing and >= 1, got {self.layers}")

    @classmethod
    def uniform(
        cls,
        layers: tuple[int, ...],
        threshold: float,
        measure: Measure = Measure.SOFTMAX,
        source: str = "threshold",
    ) -> ExitPolicy:
        return cls(layers, (threshold,) * len(layers), measure, None, source)

    @property
    def active(self) -> bool:
        return any(t < 1.0 for t in self.thresholds)


# -- the target's layers, called one by one -------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerStack:
    """A Llama-style decoder (Llama, Qwen2, Qwen3, Mistral) run layer by layer.

    Layers are called exactly as `LlamaModel.forward` / `Qwen2Model.forward`
    call them, so a pass through all layers gives the model's own numbers.
    """

    def __init__(self, model: Any, runner: ModelRunner | None = None) -> None:
        """`runner`: the runner over `model` whose native decoder to share (else one is built)."""
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed):
            raise EngineError(
                f"early exit needs a Llama-style decoder; {type(model).__name__} is not one",
                hint="use plain or speculative decoding with this model",
            )
        attn = inner.layers[0].self_attn
        if not all(hasattr(attn, n) for n in ("k_proj", "v_proj", "head_dim")):
            raise EngineError(
                f"early exit cannot fill the K/V of {type(attn).__name__} layers",
                hint="use plain or speculative decoding with this model",
            )
        self.model = model
        self.config = model.config
        self.inner = inner
        self.layers = list(inner.layers)
        self.num_layers = int(model.config.num_hidden_layers)
        self.head = model.get_output_embeddings()
        types = getattr(model.config, "layer_types", None)
        self.layer_types: list[str] = list(types or ["full_attention"] * self.num_layers)
        # Layer ranges in one native call where possible (engine/decoder.py): bit-identical.
        # The runner's, when it serves the same model: steppers are made every turn.
        if runner is not None and runner.model is model:
            self.native = runner.native
        else:
            self.native, _ = native_decoder(model)

    def begin(self, ids: Tensor, cache: DynamicCache, past: int) -> _Pass:
        """Embed ids [S] at positions past..past+S-1; rotary for the pass."""
        n = int(ids.shape[-1])
        h = self.inner.embed_tokens(ids.view(1, n))  # [1, S, H]
        pos = torch.arange(past, past + n, device=h.device).view(1, n)  # [1, S]
        rope = self.inner.rotary_emb(h, pos)  # (cos, sin), each [1, S, D]
        # With the native decoder the model scores short blocks row by row, which takes
        # no mask (engine/attention.py): skip making one, ~1 ms of Python a step.
        short = self.native is not None and n <= MAX_ROWWISE
        masks = dict.fromkeys(self.layer_types) if short else self._masks(h, pos, cache)
        return _Pass(h, pos, rope, masks, cache, past)

    def run(self, p: _Pass, start: int, stop: int) -> Tensor:
        """Layers start..stop-1 (0-based); appends their K/V to p.cache; returns p.h [1, S, H]."""
        run = range(start, stop)
        if self.native is not None and self.native.usable(p.cache, p.past, p.h.shape[1], run):
            p.h = self.native.layers(p.h, p.rope, p.cache, p.past, run)
            return p.h
        for i in run:
            p.h = self.layers[i](
                p.h,
                attention_mask=p.masks[self.layer_types[i]],
                position_embeddings=p.rope,
                position_ids=p.pos,
                cache=p.cache,
                use_cache=True,
            )
        return p.h

    def _masks(self, h: Tensor, pos: Tensor, cache: DynamicCache) -> dict[str, Any]:
        """The attention masks the modules take, as the model's forward makes them."""
        args = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": None,
            "cache": cache,
            "position_ids": pos,
        }
        masks = {"full_attention": create_causal_mask(**args)}  # type: ignore[arg-type]
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)  # type: ignore[arg-type]
        return masks

    def logits(self, h: Tensor) -> Tensor:
        """Final norm and LM head: h [..., H] -> logits [..., V]."""
        out: Tensor = self.head(self.inner.norm(h))
        return out

    def kv_fill(self, p: _Pass, start: int) -> None:
        """Give layers start..L-1 K/V for p's positions from p.h (CALM state propagation).

        For each skipped layer: input_layernorm, k_proj / v_proj (k_norm where
        the model has one), rotary on K, append to that layer's cache.
        """
        cos, sin = (t.unsqueeze(1) for t in p.rope)  # [1, 1, S, D]
        for i in range(start, self.num_layers):
            layer = self.layers[i]
            attn = layer.self_attn
            x = layer.input_layernorm(p.h)  # [1, S, H]
            shape = (*x.shape[:-1], -1, attn.head_dim)
            k = attn.k_proj(x).view(shape)  # [1, S, Hkv, D]
            k_norm = getattr(attn, "k_norm", None)
            if k_norm is not None:
                k = k_norm(k)
            k = k.transpose(1, 2)  # [1, Hkv, S, D]
            v = attn.v_proj(x).view(shape).transpose(1, 2)  # [1, Hkv, S, D]
            k = k * cos + _rotate_half(k) * sin
            p.cache.update(k, v, i)

    def layer_params(self) -> tuple[int, int, int]:
        """(one decoder layer, the LM head, one layer's K/V fill) in parameters: a cost proxy."""
        layer = self.layers[0]
        attn = layer.self_attn
        n_layer = sum(t.numel() for t in layer.parameters())
        n_head = sum(t.numel() for t in self.head.parameters())
        n_fill = sum(
            t.numel()
            for m in (layer.input_layernorm, attn.k_proj, attn.v_proj)
            for t in m.parameters()
        )
        return n_layer, n_head, n_fill


@dataclass(slots=True)
class _Pass:
    h: Tensor  # [1, S, H] the residual stream
    pos: Tensor  # [1, S]
    rope: tuple[Tensor, Tensor]
    masks: dict[str, Any]  # by layer type
    cache: DynamicCache
    past: int  # positions cached before this pass


def crop_layers(cache: DynamicCache, layers: range, n: int) -> None:
    """Keep the first n positions of the given cache layers only."""
    for i in layers:
        if i < len(cache.layers):
            layer: Any = cache.layers[i]
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)


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
        self.stack = LayerStack(runner.model, runner)
        if policy.layers and policy.layers[-1] >= self.stack.num_layers:
            raise ValueError(
                f"exit layers must be below {self.stack.num_layers}, got {policy.layers}"
            )
        n = len(policy.layers)
        self.counts = ExitCounts(head_evals=[0] * n, gated=[0] * n, exits=[0] * n)

    @classmethod
    def for_session(cls, session: ChatSession, cfg: DecodeConfig) -> EarlyExitStepper:
        """The session's calibrated policy; cfg.exit_threshold (top-1 probability) overrides it."""
        from .calibration import load_calibration

        num_layers = session.target.num_layers
        cal = load_calibration(session.target)
        layers = cal.layers if cal is not None else default_exit_layers(num_layers)
        if cfg.exit_threshold is not None:
            policy = ExitPolicy.uniform(layers, cfg.exit_threshold)
        elif cal is not None:
            policy = cal.policy(cfg.exit_budget)
        else:
            policy = ExitPolicy.uniform(layers, DEFAULT_THRESHOLD, source="default")
        return cls(session.target_runner, policy)

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
    ) -> tuple[Emitted, int]:
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
                em = Emitted(
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
        return Emitted(tok, Provenance.TARGET, p_target=prob), stack.num_layers


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
        self.stack = LayerStack(target.model, runner)
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
