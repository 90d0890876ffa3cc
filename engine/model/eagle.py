"""A draft head on the target's own hidden states (EAGLE-3).

EAGLE (Li et al. 2024) drafts with one decoder layer fed the target's
features instead of a separate small model; EAGLE-3 (Li et al. 2025) fuses
the residual stream entering three of the target's layers (low, middle,
high: `aux_layers`, by default 2, L/2 and L-3), predicts tokens directly over
a draft vocabulary and trains on its own outputs ("training-time test").

One head row at position j takes the target's features f_j (what the target
computed for token x_j) and the embedding of the next token x_{j+1}, and
predicts x_{j+2}:

    e = input_layernorm(embed(x_{j+1}))          # [S, H], the target's embedding
    g = fc(f_j)                                  # [S, 3*Ht] -> [S, H] (fc_norm: each of the
                                                 #   three Ht parts RMS-normed first); a later draft step
                                                 #   passes the head's own output instead
    r = hidden_norm(g)                           # residual: r (norm_before_residual) or g
    h = r_or_g + attn(cat(e, r))                 # q/k/v read 2H, the head's own KV cache
    h = h + mlp(post_attention_layernorm(h))     # the layer's output, fed to the next step
    logits = lm_head(norm(h))                    # [S, Vd] over the draft vocabulary

Draft id i is target id i + d2t[i]; t2d marks the target ids the draft can
propose. Ids outside the draft vocabulary get p_draft = 0, which keeps
speculative sampling exact (the residual covers them).

Names and layout are the `speculators` EAGLE-3 checkpoint's (what
`vllm serve --speculative-config '{"method": "eagle3", ...}'` reads):
`fc.weight`, `fc_norm.{i}.weight` (with `fc_norm`), `layers.0.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`;
the embedding is the verifier's and is not saved (engine/model/eagle_io.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """The head's shape and what it was made for."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    norm_before_residual: bool = True
    # Each feature layer RMS-normed on its own before fc (speculators' `fc_norm`): the
    # residual stream entering the 1.5B's layer L-3 has a median RMS of 3.5 against 0.5
    # entering layer 2, so without it fc sees the high layer's scale (docs/draft-head.md).
    fc_norm: bool = False
    target_name: str = ""
    target_sha256: str = ""  # the weights the head was trained on ("" unknown)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def for_target(
        cls,
        config: Any,
        *,
        draft_vocab: int = 16384,
        intermediate: int | None = None,
        target_name: str = "",
        target_sha256: str = "",
        fc_norm: bool = False,
    ) -> HeadConfig:
        """A head of the target's width, its attention shape and rotary base."""
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        vocab = int(config.vocab_size)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(intermediate or config.intermediate_size),
            target_hidden_size=hidden,
            target_vocab_size=vocab,
            draft_vocab_size=min(draft_vocab, vocab),
            aux_layers=default_aux_layers(layers),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(config)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 32768)),
            fc_norm=fc_norm,
            target_name=target_name,
            target_sha256=target_sha256,
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high features: the residual stream entering layers
    2, L/2 and L-3 (distinct and inside the model for any L >= 1)."""
    picks = [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]
    return tuple(sorted(set(picks))) if len(set(picks)) == 3 else _spread(num_layers)


def _spread(num_layers: int) -> tuple[int, ...]:
    """Three layers as far apart as a shallow model allows (repeats where L < 3)."""
    return tuple(min(i * max(num_layers - 1, 0) // 2, num_layers - 1) for i in range(3))


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True)
class HeadCache:
    """The head's keys and values for the first `cached` positions, in buffers
    [Hkv, capacity, D] that double when full (a draft step appends one row)."""

    k: Tensor | None = None
    v: Tensor | None = None
    cached: int = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add k, v [Hkv, S, D] after the cached positions; returns all of them [Hkv, T, D]."""
        s = int(k.shape[1])
        end = self.cached + s
        if self.k is None or self.v is None or self.k.shape[1] < end or self.k.dtype != k.dtype:
            cap = max(2 * end, 64)
            grown_k = k.new_empty((k.shape[0], cap, k.shape[2]))
            grown_v = v.new_empty((v.shape[0], cap, v.shape[2]))
            if self.k is not None and self.v is not None and self.cached:
                grown_k[:, : self.cached] = self.k[:, : self.cached]
                grown_v[:, : self.cached] = self.v[:, : self.cached]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.cached : end] = k
        self.v[:, self.cached : end] = v
        self.cached = end
        return self.k[:, :end], self.v[:, :end]

    def crop(self, n: int) -> None:
        self.cached = min(self.cached, max(n, 0))


class Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        d_in = 2 * c.hidden_size  # the normed embedding and the normed features, side by side
        self.q_proj = nn.Linear(d_in, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def project(
        self, x: Tensor, rope: tuple[Tensor, Tensor], q_from: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [S, 2H] -> q [Hq, S - q_from, D] (the rows from q_from), k and v [Hkv, S, D],
        rotary applied to q and k."""
        s = x.shape[0]
        q = self.q_proj(x[q_from:]).view(s - q_from, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(s, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(s, self.kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = rope  # [S, D]
        q = q * cos[q_from:] + _rotate_half(q) * sin[q_from:]
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q [Hq, S, D] over k, v [Hkv, T, D] where mask [S, T] is True -> [S, H]."""
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask
        )[0]  # [Hq, S, D]
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def inputs(self, embeds: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input [S, 2H], residual [S, H]) from embeddings and features [S, H]."""
        r = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(embeds), r], dim=-1)
        return x, (r if self.norm_before_residual else g)

    def finish(self, residual: Tensor, attn: Tensor) -> Tensor:
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """The head's parameters (speculators' names) and its two passes: a decode block
    against its own cache (`step`) and a training pass over several unrolled steps
    (`unrolled`)."""

    d2t: Tensor  # [Vd] long
    t2d: Tensor  # [Vt] bool
    inv_freq: Tensor  # [D/2]

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layers)
            if c.fc_norm
            else None
        )
        self.layers = nn.ModuleList([Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Draft id i is target id i + d2t[i]; t2d[t] says whether target id t has a draft id.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))
        self.set_vocab(torch.arange(c.draft_vocab_size))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)  # [D/2]

    @property
    def layer(self) -> Layer:
        """The head's one decoder layer (saved as `layers.0.*`)."""
        layer = self.layers[0]
        assert isinstance(layer, Layer)
        return layer

    # -- the draft vocabulary --------------------------------------------------

    def set_vocab(self, target_ids: Tensor) -> None:
        """The draft vocabulary: these target ids (sorted), one per draft id."""
        ids = torch.unique(target_ids.to(torch.long)).sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> Tensor:
        """[Vt] the draft id of each target id, -1 where it has none."""
        index = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        index[self.draft_to_target] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return index

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """[S, Vd] draft logits -> [S, Vt], -inf on ids the draft cannot propose."""
        out = logits.new_full((logits.shape[0], self.config.target_vocab_size), float("-inf"))
        out[:, self.draft_to_target] = logits
        return out

    # -- passes ------------------------------------------------------------------

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        return emb.cos(), emb.sin()

    def features(self, hidden: Tensor) -> Tensor:
        """The target's fused features [S, 3*Ht] -> [S, H] (each layer's normed first, with
        fc_norm); the head's own outputs pass as they are."""
        if hidden.shape[-1] == self.fc.in_features:
            if self.fc_norm is not None:
                parts = hidden.split(self.config.target_hidden_size, dim=-1)
                hidden = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
            out: Tensor = self.fc(hidden)
            return out
        return hidden

    def step(
        self, embeds: Tensor, hidden: Tensor, cache: HeadCache
    ) -> tuple[Tensor, Tensor]:
        """A block of S rows after `cache.cached` positions: embeds [S, H] (the next tokens'),
        hidden [S, 3*Ht] (the target's) or [S, H] (the head's own) ->
        (outputs [S, H] for the next step, draft logits [S, Vd])."""
        layer = self.layer
        s = embeds.shape[0]
        past = cache.cached
        positions = torch.arange(past, past + s, device=embeds.device)
        x, residual = layer.inputs(embeds, self.features(hidden))
        q, k, v = layer.self_attn.project(x, self.rope(positions))
        k_all, v_all = cache.append(k, v)
        t = k_all.shape[1]
        mask = torch.arange(t, device=embeds.device)[None, :] <= positions[:, None]  # [S, T]
        h = layer.finish(residual, layer.self_attn.attend(q, k_all, v_all, mask))
        return h, self.lm_head(self.norm(h))

    def unrolled(self, embeds: Tensor, feats: Tensor, steps: int, first: int = 0) -> list[Tensor]:
        """Training-time test over one sequence: for each of `steps` unrolled draft steps,
        the draft logits of rows max(first, s) .. S-1 at step s ([S - max(first, s), Vd]).

        Row j of step 0 is the head's row at position j fed the target's features f_j
        and the next token's embedding (embeds [S, H], row j = embed(x_{j+1})).
        Row j of step s is what the s-th draft of a chain that left the target at
        position j - s sees: the step-(s-1) output of row j - 1 as its hidden state,
        the target rows 0..j-s and the chain's rows of steps 1..s in its attention.
        Every step predicts x_{j+2} at row j (rows with j < s have no such chain).

        Only what the rows asked for depend on is computed: step s runs rows
        s + d .. S-1 (d = max(0, first - steps + 1): each feeds row j + 1 of the next
        step), and the rows before them at step 0 only their keys and values (the
        context later rows attend to). A chat's prompt is a quarter of a training
        sequence, and no loss falls on it.
        """
        layer = self.layer
        attn = layer.self_attn
        s_len = embeds.shape[0]
        dev = embeds.device
        d = max(0, first - steps + 1)
        positions = torch.arange(s_len, device=dev)
        cos, sin = self.rope(positions)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        key_pos: list[Tensor] = []  # the positions of each step's keys
        out: list[Tensor] = []
        hidden = self.features(feats)  # [S, H]
        for s in range(steps):
            lo = min(s + d, s_len)  # this step's first row
            x, residual = layer.inputs(embeds[lo:] if s else embeds, hidden)
            if s == 0:  # every row's keys, queries from lo
                q, k, v = attn.project(x, (cos, sin), q_from=lo)
                residual = residual[lo:]
                key_pos.append(positions)
            else:
                q, k, v = attn.project(x, (cos[lo:], sin[lo:]))
                key_pos.append(positions[lo:])
            keys.append(k)
            values.append(v)
            i = positions[lo:, None]
            # Step 0's keys up to j - s; the key of step t (1..s) at position j - s + t.
            blocks = [key_pos[0][None, :] <= i - s] + [
                key_pos[t][None, :] == i - s + t for t in range(1, s + 1)
            ]
            mask = torch.cat(blocks, dim=1)  # [S - lo, keys so far]
            h = layer.finish(
                residual, attn.attend(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), mask)
            )
            asked = max(first, s) - lo  # the rows asked for, within this step's
            out.append(self.lm_head(self.norm(h[asked:])))
            # Row j of the next step takes row j - 1's output: rows lo .. S-2 for lo+1 .. S-1.
            hidden = h[:-1]
        return out

    def parameter_count(self) -> int:
        """Weights of the head, quantized projections (packed into buffers) included."""
        n = sum(p.numel() for p in self.parameters())
        for m in self.modules():
            shape: tuple[Any, Any] = (vars(m).get("in_features"), vars(m).get("out_features"))
            if not isinstance(m, nn.Linear) and None not in shape:
                n += int(shape[0]) * int(shape[1])
        return n


def init_head(head: EagleHead, seed: int = 0) -> EagleHead:
    """Small random weights (a fixed seed), norms at one: what training starts from."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            std = 1.0 / math.sqrt(p.shape[-1])
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return head


@dataclass(slots=True)
class HeadFacts:
    """What a saved head says about itself beyond its config (training, validation)."""

    trained_tokens: int = 0
    trained_seconds: float = 0.0
    steps: int = 0
    report: dict[str, Any] = field(default_factory=dict)
