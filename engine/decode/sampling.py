"""Pure tensor functions: logits -> probabilities, sampling, the speculative residual.

Temperature, top-k and top-p are applied by one function, `logits_to_probs`,
so the target and the draft distributions are processed identically before
the acceptance test (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_NUMPY_FLOATS = (torch.float32, torch.float64)


def argmax(logits: Tensor) -> Tensor:
    """torch.argmax(logits, dim=-1): each row's first largest value's index (a NaN counts
    as largest, as in torch), as a long tensor on the logits' device.

    On the CPU NumPy computes it: ATen's index reduction is not vectorized, and took 156
    us over a 151,936-token row where NumPy takes 14 (Zen 3; docs/performance.md, step 39).
    """
    if logits.device.type != "cpu" or logits.dtype not in _NUMPY_FLOATS:
        return torch.argmax(logits, dim=-1)
    return torch.from_numpy(np.asarray(np.argmax(logits.detach().numpy(), axis=-1)))


def logits_to_probs(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """Processed sampling distribution over the last dimension.

    logits: [..., V] (any float dtype); returns float32 probabilities [..., V].
    temperature must be > 0 here; greedy decoding never calls this.
    """
    if temperature <= 0:
        raise ValueError("logits_to_probs needs temperature > 0; greedy decoding uses argmax")
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(~_top_p_keep(x, top_p), float("-inf"))
    return torch.softmax(x, dim=-1)


# Top-p looks for its cut among the most probable tokens first: a full sort of a
# 152k vocabulary per row (2K+1 rows a round) cost more than the rest of sampling
# on the CPU. Knowing whether the candidates cover top_p is a read of the values:
# free on the CPU, a host sync per row on an accelerator, which sorts the whole
# row instead (a GPU sorts 152k values in microseconds).
TOP_P_CANDIDATES = 1024


def branches_on_host(x: Tensor) -> bool:
    """Whether reading x's values into Python costs no device sync (x lives on the CPU)."""
    return x.device.type == "cpu"


def _top_p_keep(x: Tensor, top_p: float) -> Tensor:
    """Which tokens top-p keeps, as a bool mask like x [..., V].

    A token is dropped when the tokens ranked above it already cover top_p; the
    most probable token is always kept. On the CPU the cut is searched among
    the TOP_P_CANDIDATES most probable tokens, which decides it exactly whenever
    they cover top_p (almost always); otherwise, and on accelerators, the whole
    row is sorted.
    """
    probs = torch.softmax(x, dim=-1)  # [..., V]
    vocab = x.shape[-1]
    if branches_on_host(x) and vocab > TOP_P_CANDIDATES:
        top, order = torch.topk(probs, TOP_P_CANDIDATES, dim=-1)  # [..., n], descending
        if bool((top.sum(dim=-1) < top_p).any()):
            top, order = torch.sort(probs, dim=-1, descending=True)  # rare: a flat distribution
    else:
        top, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
    mass_above = torch.cumsum(top, dim=-1) - top
    keep_sorted = mass_above < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, num_samples=1, generator=generator)  # [N, 1]
    return ids.reshape(probs.shape[:-1])


def residual(p_target: Tensor, p_draft: Tensor) -> Tensor:
    """The distribution to resample from after a rejection: norm(max(0, p_target - p_draft)).

    Where the two are equal (the residual has no mass; only reachable through
    rounding), falls back to p_target, which is then the exact answer.
    """
    r = torch.clamp(p_target - p_draft, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p_target)


def residual_one_hot(p_target: Tensor, ids: Tensor) -> Tensor:
    """The residual for one-hot drafts (p_draft = 1 on ids [N]): p_target [N, V] without
    the drafted token, renormalised; p_target itself where it had no other mass."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    left = p_target.index_put((rows, ids), torch.zeros_like(ids, dtype=p_target.dtype))
    return residual(left, torch.zeros_like(left))


def token_probs(logits: Tensor, ids: Tensor) -> Tensor:
    """softmax(logits)[ids] without materialising the softmax: logits [N, V], ids [N] -> [N]."""
    x = logits.float()
    picked = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return torch.exp(picked - torch.logsumexp(x, dim=-1))


def align_vocab(logits: Tensor, vocab: int) -> Tensor:
    """Fit a draft's logits [..., Vd] to the target's vocabulary size.

    Rows the draft lacks get -inf (probability 0); ids the target lacks are cut.
    """
    have = logits.shape[-1]
    if have == vocab:
        return logits
    if have > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
