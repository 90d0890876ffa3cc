"""One model and its KV cache, fed incrementally and rolled back by cropping.

Invariant: the cache holds K/V for the first `cached` tokens of the sequence
the caller tracks. `forward(seq)` feeds `seq[cached:]` and returns the logits
of the last `keep` fed positions; `crop_to(n)` forgets everything after the
first n tokens.

A token's logits do not depend on how many tokens (up to MAX_ROWWISE) are fed
with it: the basis of greedy speculative output being token-identical to
plain. Attention scores each row alone (engine/model/attention.py), the quantized
kernels compute each row from its own row (engine/model/quant.py), and float
projections run a fixed-order kernel, or take a short block one row at a
time as a one-token step runs them, and so does silu (engine/model/invariance.py). `exactness` says, per model, whether
that holds and by which path, or why not (then speculation is exact in
distribution and equal to plain up to floating-point ties).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .attention import MAX_ROWWISE, ONE_THREAD_KEYS, one_thread, tree_rows, use_rowwise_attention
from .attention import NAME as ROWWISE
from .decoder import native_decoder
from .invariance import RowsApart, plan
from .kv_cache import GrowingLayer, new_cache
from .layers import LayerStack, tree_depths, tree_paths
from .native import prompt_rows, small_ops_on_one_thread
from .qlinear import W4A8Linear, _QuantizedLinear

# Prompt blocks of up to this many rows run torch's own operations on one thread where the
# model's projections are all the w4a8 kernel's (`small_ops_on_one_thread`): their products,
# norms and SiLU of a few hundred thousand values cost less there than a worker's wake (a
# product of 50 x 8,960 values: 125 us on one thread, 160 on two; of 500 x 8,960: 2.6 ms
# against 1.6, so long prompts keep both). docs/performance.md, step 39.
ONE_THREAD_BLOCK = 128


class ModelRunner:
    def __init__(self, model: PreTrainedModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        use_rowwise_attention(model)
        self.cache = new_cache(model.config)
        self.cached = 0
        head = model.get_output_embeddings()
        # Rows of the output projection (quantized heads have no .weight).
        rows = getattr(head, "vocab", None) or getattr(head, "out_features", None)
        self.vocab = int(rows or model.config.vocab_size)
        # Whether greedy speculative output is token-identical to plain, and how.
        self.exactness = plan(model)
        # Decode steps and verify blocks in one native call where the model allows it
        # (engine/model/decoder.py); `native_off` says why not otherwise.
        self.native, self.native_off = native_decoder(model, self.exactness)
        self._stack: LayerStack | None = None
        # Features for a draft head (model/eagle.py): the residual stream entering these
        # layers, handed to `on_features(first position, [n, len(capture) * H])` for every
        # fed row, from the pass that computes the logits anyway.
        self.capture: tuple[int, ...] = ()
        self.on_features: Callable[[int, Tensor], None] | None = None
        # One-token passes on one thread: a small model's step is bound by one core's reads
        # and the second thread's wake costs more than it brings (the 0.5B draft on a Zen 5:
        # 14 against 16 ms on two). Set where measured faster (decode/costs.py); blocks of
        # several rows keep every thread. Which thread computes a value never changes it.
        self.steps_on_one_thread = False
        self._tree_feats: Tensor | None = None  # a tree's features until keep_path picks its rows
        # Whether every projection, the LM head's included, is the w4a8 kernel's, whose
        # helper threads run without torch's: then a prompt's small ops may take one thread.
        self.kernel_only = w4a8_only(model)

    @property
    def stack(self) -> LayerStack | None:
        """The model's layers, one by one or in ranges, through this runner's native decoder
        (model/layers.py); None without a native decoder."""
        if self.native is None:
            return None
        if self._stack is None or self._stack.native is not self.native:
            self._stack = LayerStack(self.model, self.native)
        return self._stack

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self.cached = 0

    def crop_to(self, n: int) -> None:
        """Keep K/V for the first n tokens only (no-op if fewer are cached)."""
        if self.cached > n:
            self.cache.crop(-(self.cached - n))
            self.cached = n

    @torch.inference_mode()
    def feed(self, ids: Tensor | list[int], keep: int = 1) -> Tensor:
        """Append ids [S] to the cache; return logits of the last `keep` positions [keep, V]."""
        if isinstance(ids, list):
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        n = int(ids.shape[-1])
        if n == 0:
            raise ValueError("feed() needs at least one new token")
        with one_thread(n == 1 and self.steps_on_one_thread):
            return self._feed(ids, n, keep)

    def _feed(self, ids: Tensor, n: int, keep: int) -> Tensor:
        stack = self.stack
        capture = self.capture if self.on_features is not None else ()
        if stack is not None and self.native is not None and self.native.usable(self.cache, self.cached, n):
            logits, feats = stack.forward_capturing(
                ids, self.cache, self.cached, min(keep, n), self.exactness, capture
            )
            self._hand_over(feats)
            self.cached += n
            return logits
        # The first pass of a conversation (it makes the caches), blocks past MAX_ROWWISE
        # and models without a native decoder: transformers' own forward.
        # Float projections and silu so that each row gets a one-token step's bits.
        ex = self.exactness
        alone = self.kernel_only and n <= ONE_THREAD_BLOCK and self.cached + n <= ONE_THREAD_KEYS
        with (
            RowsApart(ex.fixed) if RowsApart.needed(ex, n) else nullcontext(),
            small_ops_on_one_thread(alone),
        ):
            out = self.model(
                input_ids=ids.view(1, n),
                cache=self.cache,
                use_cache=True,
                logits_to_keep=min(keep, n),
                output_hidden_states=bool(capture),
            )
        if capture:  # hidden_states[i]: the residual stream entering layer i
            self._hand_over(torch.cat([out.hidden_states[i][0] for i in capture], dim=-1))
        self.cached += n
        return out.logits[0]  # [keep, V]

    @property
    def scores_trees(self) -> bool:
        """Whether this model can verify draft trees: its row-wise attention (model/attention.py,
        and the native decoder, which takes it only then) scores each row over its own path."""
        return bool(self.model.config._attn_implementation == ROWWISE)

    def takes_tree(self, n: int) -> bool:
        """Whether a draft tree of n rows can be verified now (after the conversation's
        first pass, in a cache that grows in place)."""
        return (
            self.scores_trees
            and 0 < n <= MAX_ROWWISE
            and self.cached > 0
            and all(
                type(layer) is GrowingLayer and layer.get_seq_length() == self.cached
                for layer in self.cache.layers
            )
        )

    @torch.inference_mode()
    def feed_tree(self, ids: Tensor, parents: tuple[int, ...]) -> Tensor:
        """Append a draft tree's rows ids [S] (`parents[i]` row i's parent row; row 0, -1,
        follows the cache): the logits of every row [S, V], each row scored over the cache
        and its own path as the chain along that path would score it. The cache holds
        the rows in their order until `keep_path`, which also hands the kept rows'
        features over (a head reads them as a sequence). Needs `takes_tree(S)`."""
        n = int(ids.shape[-1])
        assert len(parents) == n
        capture = self.capture if self.on_features is not None else ()
        stack = self.stack
        if stack is not None and self.native is not None and self.native.usable(self.cache, self.cached, n):
            logits, self._tree_feats = stack.forward_capturing(
                ids, self.cache, self.cached, n, self.exactness, capture, parents
            )
            self.cached += n
            return logits
        # transformers' modules: each row at its depth, its attention over its path.
        ex = self.exactness
        positions = (self.cached + tree_depths(parents).to(self.device)).view(1, n)
        with tree_rows(tree_paths(parents)), (
            RowsApart(ex.fixed) if RowsApart.needed(ex, n) else nullcontext()
        ):
            out = self.model(
                input_ids=ids.view(1, n),
                position_ids=positions,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=n,
                output_hidden_states=bool(capture),
            )
        self._tree_feats = (
            torch.cat([out.hidden_states[i][0] for i in capture], dim=-1) if capture else None
        )
        self.cached += n
        return out.logits[0]  # type: ignore[no-any-return]

    @torch.inference_mode()
    def keep_path(self, start: int, rows: list[int]) -> None:
        """After `feed_tree` at `start` cached tokens: keep the tree's rows `rows` (a path
        from row 0, ascending) at positions start, start + 1, ..., and nothing after."""
        for layer in self.cache.layers:
            assert isinstance(layer, GrowingLayer)
            layer.keep_rows(start, rows)
        self.cached = start
        feats, self._tree_feats = self._tree_feats, None
        if feats is not None:
            self._hand_over(feats[torch.tensor(rows, device=feats.device)])
        self.cached = start + len(rows)

    def _hand_over(self, feats: Tensor | None) -> None:
        if feats is not None and self.on_features is not None:
            self.on_features(self.cached, feats)

    def forward(self, seq: list[int], keep: int = 1) -> Tensor:
        """Feed seq[cached:] (at least one token) and return the last `keep` logits."""
        if self.cached >= len(seq):
            # The last token must be fed again to get its logits.
            self.crop_to(len(seq) - 1)
        return self.feed(seq[self.cached :], keep)

    def prefill(self, seq: list[int], prompt: bool = False) -> None:
        """Bring the cache to hold seq[:-1], so the next forward yields the next-token logits.
        `prompt`: rows that need no step's bits (a turn's new tokens before its first step,
        a draft's read), which may take the w4a8 kernel's prompt code (`native.prompt_rows`)."""
        self.crop_to(len(seq) - 1)
        if self.cached < len(seq) - 1:
            with prompt_rows(prompt):
                self.feed(seq[self.cached : len(seq) - 1], keep=1)


def w4a8_only(model: torch.nn.Module) -> bool:
    """Whether every linear projection in `model` (its LM head included) is a W4A8Linear."""
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, _QuantizedLinear))]
    return bool(linears) and all(type(m) is W4A8Linear for m in linears)
