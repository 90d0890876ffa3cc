"""The draft head as a drafter: EAGLE-3 rows fed the target's features from the pass it ran.

The target runner hands over the residual stream entering the head's feature
layers for every row it feeds (`ModelRunner.capture`), so a verify pass
yields the features the next round drafts from: the round never runs the
target twice. Features are kept by position; the head's own cache holds one
row per confirmed position j (target features f_j and the next token
x_{j+1}), and a round's chain rows (the head's own outputs as features) are
dropped again when the round rolls back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import DecodeConfig
from ..errors import EngineError
from ..model.eagle import EagleHead, HeadCache
from ..model.eagle_io import find_head, for_decoding, load_head
from ..model.runner import ModelRunner
from ..weights.loading import LoadedModel
from .speculative import ModelDrafter, Proposal, draft_chain, on_logits


class HeadDrafter:
    """An `EagleHead` over a target runner; implements `Drafter`."""

    PENDING_IN_PROPOSE = ModelDrafter.PENDING_IN_PROPOSE  # rows a round leaves: see catch_up

    def __init__(self, head: EagleHead, target: ModelRunner, name: str = "draft head") -> None:
        self.head = head
        self.target = target
        self.name = name
        self.embed: nn.Module = target.model.get_input_embeddings()
        self.cache = HeadCache()
        self.confirmed = 0  # head rows 0..confirmed-1 came from the target's features
        self._feats: Tensor | None = None  # [T, F] by position
        self.fresh = 0  # features of positions 0..fresh-1 belong to the current sequence
        param = next(head.parameters(), None)
        self.dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        self.attach()

    def attach(self) -> None:
        """Take the target's features from every pass it runs (the session does this for
        eagle turns only: other turns skip the capture, and catch_up fills the gap)."""
        self.target.capture = self.head.config.aux_layers
        self.target.on_features = self._store

    def describe(self) -> str:
        c = self.head.config
        return (
            f"{self.head.parameter_count() / 1e6:.1f}M, features of layers "
            f"{', '.join(map(str, c.aux_layers))}, draft vocabulary {c.draft_vocab_size}"
        )

    def _store(self, start: int, feats: Tensor) -> None:
        """The target fed positions start..start+n-1: keep their features [n, F]."""
        n = int(feats.shape[0])
        buf = self._feats
        if buf is None or buf.shape[0] < start + n:
            grown = feats.new_zeros((max(2 * (start + n), 256), feats.shape[1]), dtype=self.dtype)
            if buf is not None:
                grown[: buf.shape[0]] = buf
            buf = self._feats = grown
        buf[start : start + n] = feats.to(self.dtype)
        if start <= self.fresh:
            self.fresh = start + n  # later positions were cropped from the target
        # Head rows from position start - 1 on were fed features that are now replaced.
        self.confirmed = min(self.confirmed, max(start - 1, 0))

    def catch_up(self, seq: list[int]) -> None:
        """Where the target's cache holds positions whose features were never captured
        (turns decoded another way), recompute them: a one-off target pass, untimed."""
        need = len(seq) - 1
        valid = min(self.fresh, self.target.cached)  # features past the target's cache are stale
        if valid < self.target.cached:
            self.target.crop_to(valid)
        if valid < need:
            self.target.prefill(seq)
        # A long stretch of rows the head has not seen (a prompt, a copy, plain rounds) goes
        # in here, untimed, all but the last. The rows a round leaves (its last accepted
        # draft and the target's token) go in propose's first pass: one head pass over 2
        # rows costs about one over 1, and feeding one of them here cost a second pass a
        # round that no timer saw (5.8 ms a K = 1 round on a Zen 3, a head step 5.5 ms).
        if need - min(self.cache.cached, self.confirmed) > self.PENDING_IN_PROPOSE:
            self._feed(seq, need - 1)

    @torch.inference_mode()
    def _rows(self, seq: list[int]) -> tuple[Tensor, Tensor]:
        """Bring the head to the target's rows of seq: (logits [Vd] after seq, output [H])."""
        m = len(seq) - 1  # rows 0..m-1: features f_j of seq[j], token seq[j + 1]
        if min(self.fresh, self.target.cached) < m or self._feats is None:
            raise RuntimeError(f"the head has target features for {self.fresh} of {m} positions")
        out, logits = self._feed(seq, m)
        return logits[-1], out[-1:]

    def _feed(self, seq: list[int], m: int) -> tuple[Tensor, Tensor]:
        """Head rows up to m-1 from the target's features: (outputs, logits) of the rows fed."""
        assert self._feats is not None
        start = min(self.cache.cached, self.confirmed, m - 1)
        self.cache.crop(start)
        ids = torch.tensor(seq[start + 1 : m + 1], dtype=torch.long, device=self._feats.device)
        with torch.inference_mode():
            out, logits = self.head.step(
                self.embed(ids).to(self.dtype), self._feats[start:m], self.cache
            )
        self.confirmed = m
        return out, logits

    def propose(
        self, seq: list[int], k: int, cfg: DecodeConfig, generator: torch.Generator | None
    ) -> Proposal:
        if len(seq) < 2:
            return Proposal(torch.zeros(0, dtype=torch.long))
        with torch.inference_mode():
            first, state = self._rows(seq)
            last = [state]

            def step(tok: Tensor) -> Tensor:
                out, logits = self.head.step(self.embed(tok).to(self.dtype), last[0], self.cache)
                last[0] = out
                return self._target_row(logits)

            return draft_chain(self._target_row(first.view(1, -1)), step, k, cfg, generator)

    def _target_row(self, logits: Tensor) -> Tensor:
        """The head's logits [1, Vd] as a row of the target's vocabulary [Vt], on one torch
        thread on the CPU (`on_logits`): filling 151,936 values woke a sleeping worker, 266
        against 132 us a drafted token on a Zen 3 (docs/performance.md, step 39)."""
        with on_logits(logits):
            return self.head.to_target_logits(logits)[0]

    def rollback(self, n: int) -> None:
        """Keep rows of confirmed positions j < n - 1 (their next token is seq[j + 1])."""
        self.confirmed = min(self.confirmed, max(n - 1, 0))
        self.cache.crop(self.confirmed)
        # The target's features stay valid as far as its cache reaches: after a tree's
        # round that ended on a second guess, past the chain's part the head keeps.
        self.fresh = min(self.fresh, max(n, self.target.cached))

    def reset(self) -> None:
        self.cache = HeadCache()
        self.confirmed = 0
        self.fresh = 0

    def detach(self) -> None:
        """Stop taking the target's features (another head replaces this one)."""
        if self.target.on_features == self._store:
            self.target.on_features = None
            self.target.capture = ()


def load_draft_head(
    source: str | None, target: LoadedModel, cache_dir: Path | str | None = None
) -> tuple[EagleHead | None, str | None]:
    """The draft head for `target` from `source` (a folder, a Hugging Face id, "auto" for
    the one trained here, None or "none"), ready to decode, and a note saying what was
    loaded; (None, None) where "auto" finds none. Raises EngineError for a head that is
    missing, corrupt, or made for other weights."""
    if source is None or source == "none":
        return None, None
    if source == "auto":
        folder = find_head(target.weights_sha256, cache_dir)
        if folder is None:
            return None, None
        try:  # a head found in the cache that does not load must not stop the chat
            return _ready(folder, target)
        except EngineError as exc:
            return None, f"the draft head in the cache was not loaded: {exc.message} ({exc.hint})"
    else:
        folder = Path(source).expanduser()
        if not folder.exists():
            folder = _from_hub(source)
    return _ready(folder, target)


def _ready(folder: Path, target: LoadedModel) -> tuple[EagleHead, str]:
    head = load_head(
        folder, target_sha256=target.weights_sha256, target_config=target.model.config
    )
    head, how = for_decoding(head, target.device)
    c = head.config
    return head, (
        f"draft head {folder} ({head.parameter_count() / 1e6:.1f}M, {how}; features of layers "
        f"{', '.join(map(str, c.aux_layers))}; draft vocabulary {c.draft_vocab_size}): --mode eagle"
    )


def _from_hub(repo_id: str) -> Path:
    """A published head, fetched from the Hugging Face hub where a network allows."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        raise EngineError(
            f"no draft head at {repo_id}", hint="give a folder with config.json and model.safetensors"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors"]))
    except Exception as exc:
        raise EngineError(
            f"the draft head {repo_id} cannot be fetched: {str(exc).splitlines()[0]}",
            hint="download it where a network is, and give its folder with --draft-head PATH",
        ) from exc
