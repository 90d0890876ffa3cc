"""ChatSession: a conversation over a target (and draft) model, streamed as events.

The session keeps both models' KV caches for the conversation so far. Each
turn renders the whole conversation with the chat template, keeps the cached
prefix it shares with what the caches hold, and prefills only the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path

import torch

from ..config import W4A8_MODES, DecodeConfig, Mode, ModelSpec
from ..errors import ContextOverflowError, EngineError
from ..events import (
    Cancelled,
    Event,
    Failed,
    LoadProgress,
    Notice,
    Ready,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from ..model import native
from ..model.eagle import EagleHead
from ..model.runner import ModelRunner
from ..weights.loading import LoadedModel, check_tokenizers_match, load_model, set_threads
from .ahead import AheadDrafter, ahead_of, common_prefix_len
from .compose import ComposedDrafter
from .controller import Controller, trees_pay_below
from .costs import (
    AheadCosts,
    Costs,
    choose_vnni_rows,
    measure_ahead,
    measure_costs,
    measure_head_cost,
)
from .early_exit import EarlyExitStepper, SelfSpecDrafter
from .exit_policy import policy_for
from .head import HeadDrafter, load_draft_head
from .lookup import LookupDrafter
from .speculative import (
    Drafter,
    ModelDrafter,
    RoundResult,
    plain_step,
    speculative_round,
)
from .text import IncrementalDecoder, ReplyFilter, render_chat
from .turn import Turn

log = logging.getLogger(__name__)
# What a session has learnt of its costs: the draft model's, the draft ahead's, other modes'.
CostState = tuple[Costs, AheadCosts | None, dict[tuple[Mode, bool], Costs]]

Progress = Callable[[LoadProgress], None]


class ChatSession:
    """Multi-turn chat on one target and an optional draft; implements `ChatBackend`."""

    # Tokens kept free for the reply when the conversation must be trimmed.
    MIN_REPLY_ROOM = 64

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        system_prompt: str | None = None,
        max_context: int | None = None,
        load_seconds: float = 0.0,
        head: EagleHead | None = None,
        forced_siblings: int | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = target.tokenizer
        self.target_runner = ModelRunner(target.model, target.device)
        self.drafter: Drafter | None = (
            ModelDrafter(
                ModelRunner(draft.model, draft.device), draft.info.name, self.target_runner.vocab
            )
            if draft
            else None
        )
        self._self_drafter: Drafter | None = None
        self._self_drafter_layer: int | None = None
        self._lookup_drafter: LookupDrafter | None = None
        self._composed: ComposedDrafter | None = None  # spec's lookup-first drafter, made on first use
        # The draft model drafting on a core of its own while the target verifies
        # (decode/ahead.py), for greedy spec turns where the load measured that it pays.
        self._ahead: AheadDrafter | None = None
        self._ahead_costs: AheadCosts | None = None
        self._composed_ahead: ComposedDrafter | None = None
        self._ahead_way = "auto"
        # The draft head (--mode eagle), fed the target's features from its own passes.
        self.head_drafter = HeadDrafter(head, self.target_runner) if head is not None else None
        self._composed_head: ComposedDrafter | None = None
        self.system_prompt = system_prompt
        limits = [target.info.context_length]
        if draft:
            limits.append(draft.info.context_length)
        if max_context:
            limits.append(max_context)
        self.context_length = min(limits)
        self.eos = target.eos_ids
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.tokens: list[int] = []  # the sequence the target cache follows
        self._messages: list[tuple[str, str]] = []
        self._window = 0  # index of the first message the model still sees (context full)
        # First position whose target K/V an early exit estimated: lossless turns recompute from it.
        self._approx_from: int | None = None
        self._cut = False  # the last reply stopped at the token limit: it can be continued
        self._unfinished = 0  # tokens at the end of the last reply whose text is not out yet
        # How long this session's replies run when they end of themselves (eos, a stop
        # string): the horizon a draft's read pays back in, where the token budget is far
        # longer than a reply (the chat's 2,048). None until a reply has ended so.
        self._reply_tokens: float | None = None
        self.turn = 0
        self.costs = Costs()
        # The siblings the user's configuration forces (--siblings S), for the Ready line
        # on trees; None: the controller chooses.
        self.forced_siblings = forced_siblings
        self._mode_costs: dict[tuple[Mode, bool], Costs] = {}  # self-spec, lookup: see _costs_for
        # The costs the first turn started from (the load's measurements, or none): a
        # benchmark's cold start restores them, so no run starts from what another learnt.
        self._first_costs: CostState | None = None
        notes: list[str] = []
        if not self.has_template:
            notes.append(
                "the model has no chat template: plain continuation format "
                "(turns joined by newlines)"
            )
        self._notes = notes
        self.load_seconds = load_seconds
        self.ready = self._make_ready()

    # -- construction -------------------------------------------------------

    @classmethod
    def load(
        cls,
        target: ModelSpec,
        draft: ModelSpec | None = None,
        *,
        cache_dir: Path | None = None,
        progress: Progress | None = None,
        threads: int | None = None,
        system_prompt: str | None = None,
        max_context: int | None = None,
        measure: bool = True,
        draft_head: str | None = "auto",
        siblings: int | None = None,
    ) -> ChatSession:
        """Load the models (fetching presets as needed) and the draft head (`draft_head`:
        a folder or hub id, "auto" for the one trained here for this target, None or
        "none" for no head). `siblings`: the user's forced --siblings, which the Ready
        line on trees then states. Raises EngineError."""
        set_threads(threads)
        t0 = time.perf_counter()
        tgt = load_model(target, "target", cache_dir=cache_dir, progress=progress)
        drf = load_model(draft, "draft", cache_dir=cache_dir, progress=progress) if draft else None
        if drf is not None:
            check_tokenizers_match(tgt.tokenizer, drf.tokenizer)
        head, head_note = load_draft_head(draft_head, tgt, cache_dir)
        session = cls(
            tgt,
            drf,
            system_prompt=system_prompt,
            max_context=max_context,
            load_seconds=time.perf_counter() - t0,
            head=head,
            forced_siblings=siblings,
        )
        if head_note:
            session._notes.append(head_note)
            if measure:
                session.measure_head()
            session.ready = session._make_ready()
        if measure and drf is not None:
            session.measure_costs()
        return session

    def _make_ready(self) -> Ready:
        t = self.target.info
        parts = [
            f"target {t.name} ({t.device}, {t.dtype}, {t.quant}, {t.params / 1e6:.1f}M params)"
        ]
        if self.draft:
            d = self.draft.info
            parts.append(
                f"draft {d.name} ({d.device}, {d.dtype}, {d.quant}, {d.params / 1e6:.1f}M)"
            )
        c = self.costs.ratio()
        notes = list(self._notes)
        runner = self.target_runner
        notes.append(f"greedy exactness: {runner.exactness.reason}")
        if {t.quant, self.draft.info.quant if self.draft else None} & {m.value for m in W4A8_MODES}:
            kernel = native.w4a8_describe()  # which instruction set runs it, and why
            if kernel:
                notes.append(kernel)
        if runner.native is None and self.target.device.type == "cpu":
            notes.append(f"decoding through transformers' modules, not natively: {runner.native_off}")
        if c is not None:
            facts = [f"draft/target step cost c={c:.2f}"]
            if self.costs.draft_one_thread is not None:
                one, every = self.costs.draft_one_thread
                facts.append(
                    f"draft steps on one thread ({one:.1f} against {every:.1f} ms on "
                    f"{torch.get_num_threads()})"
                )
            facts.append(f"target step {self.costs.target_step_ms:.1f} ms")
            facts += [f"verify K={k}: {v:.2f} steps" for k, v in sorted(self.costs.verify_at.items())]
            if self.costs.catch_up_row_ms is not None:
                facts.append(
                    f"a catch-up pass of the draft {self.costs.catch_up_pass_ms:.1f} ms + "
                    f"{self.costs.catch_up_row_ms:.1f} ms a token (composed spec prices "
                    "copies and reads with it)"
                )
            notes.append("measured: " + ", ".join(facts))
        if self._ahead_costs is not None:
            notes.append(self._ahead_costs.describe(self._ahead_way))
        if self.drafter is not None:
            notes.append(self._describe_trees())
        return Ready(
            summary="; ".join(parts),
            target=t,
            draft=self.draft.info if self.draft else None,
            chat_template=self.has_template,
            load_seconds=self.load_seconds,
            notes=tuple(notes),
            draft_head=self.head_drafter.describe() if self.head_drafter is not None else None,
        )

    def _describe_trees(self) -> str:
        """Whether spec's draft model may verify trees here, and from which acceptance down."""
        if not self._takes_trees(Mode.SPEC):
            return "draft trees off: the target's attention cannot score a tree's rows by their paths"
        if self.forced_siblings == 0:
            return "draft trees off (--siblings 0): spec verifies chains of drafts only"
        if self.forced_siblings is not None:
            depths = "depth 1" if self.forced_siblings == 1 else f"depths 1..{self.forced_siblings}"
            return (
                f"draft trees forced (--siblings {self.forced_siblings}): every round the draft "
                f"model drafts verifies its second guess beside its first drafts at {depths}, "
                "whatever the measured costs say"
            )
        below = trees_pay_below(self.costs) if self.costs.ratio() is not None else None
        where = (
            f"where acceptance is at most {below:.2f} at these costs"
            if below is not None
            else "where the measured costs say it pays (at these: nowhere)"
        )
        return (
            "draft trees: the draft's second guess verified beside its first drafts "
            f"{where} (--siblings 0: chains only)"
        )

    def measure_costs(self, k: int = 4, repeats: int = 3) -> Costs:
        """Time one target step, verify passes and one draft step (decode/costs.py); the
        session stays as new (its first turn prefills everything)."""
        if self.drafter is None or self.draft is None:
            return self.costs
        scratch = ModelRunner(self.draft.model, self.draft.device)
        if self._picks_vnni_rows():
            choose_vnni_rows(self.target_runner, scratch)
        self.costs = measure_costs(self.target_runner, scratch, k, repeats)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.runner.steps_on_one_thread = self.costs.draft_one_thread is not None
            self._ahead_costs = None
            if self.target.device.type == "cpu" and torch.get_num_threads() > 1:
                self._ahead_costs = measure_ahead(self.target_runner, scratch, self.costs, k, repeats)
            self.set_ahead(os.environ.get("SPECCHAT_AHEAD", "auto"))
        self.tokens = []
        self._first_costs = None
        self.ready = self._make_ready()
        return self.costs

    def _picks_vnni_rows(self) -> bool:
        """Whether the load times the w4a8 kernel's short calls both ways: a w4a8 target on
        the CPU, the kernel's path chosen automatically (neither $SPECCHAT_W4A8 nor a bench
        config's ~PATH names one)."""
        return (
            self.target.device.type == "cpu"
            and self.target.info.quant in W4A8_MODES
            and native.w4a8_auto()
        )

    def set_ahead(self, way: bool | str) -> None:
        """Whether greedy spec turns draft ahead on a core of their own (decode/ahead.py):
        "auto" (round by round, at the acceptance the turn measures, where the load's
        figures say it pays at some acceptance), "on" (True: always) or "off" (False)."""
        way = {True: "on", False: "off"}.get(way, way) if isinstance(way, bool) else way
        if way not in ("auto", "on", "off"):
            raise EngineError(
                f"SPECCHAT_AHEAD={way!r} is none of auto, on, off", hint="unset it for auto"
            )
        if self._ahead is not None:
            self._ahead.stop(self.tokens)
        self._ahead = self._composed_ahead = None
        self._ahead_way = way
        pays = self._ahead_costs is not None and self._ahead_costs.from_alpha is not None
        if (way == "on" or (way == "auto" and pays)) and isinstance(self.drafter, ModelDrafter):
            self._ahead = AheadDrafter(self.drafter)
        self.ready = self._make_ready()

    @property
    def drafts_ahead(self) -> bool:
        return self._ahead is not None

    def measure_head(self) -> Costs | None:
        """Time a draft-head step and the target's verify passes (decode/costs.py): the
        eagle controller's starting costs, and a note in Ready."""
        if self.head_drafter is None:
            return None
        scratch = ModelRunner(self.target.model, self.target.device)
        head_ms, target_ms, verify = measure_head_cost(
            self.head_drafter.head, scratch, self.head_drafter.embed
        )
        costs = Costs(target_ms, head_ms, self.costs.verify_slope, verify)
        self._mode_costs[(Mode.EAGLE, False)] = costs
        self._first_costs = None
        self._notes.append(
            f"measured: draft head step c={head_ms / target_ms:.3f} "
            f"({head_ms:.1f} ms, target step {target_ms:.1f} ms)"
        )
        return costs

    def _costs_for(self, mode: Mode, ahead: bool = False) -> Costs:
        """The step costs the controller of `mode` starts from and keeps learning into.

        The draft model's mode uses the measured costs; every other drafter
        has a draft cost of its own, learnt from its first rounds, and shares the
        target's step and verify cost. A lookup's starts at 0: a copy costs no
        draft step, and a composed round weighs its copies against the model's
        round from the first (unknown, a copier would be priced at plain's 1x
        and never take the copies that would measure it).
        A turn drafted ahead verifies on one thread with the draft beside it,
        at the costs `measure_ahead` found, and keeps its own.
        """
        base = self._ahead_costs.costs if ahead and self._ahead_costs is not None else self.costs
        if mode is Mode.SPEC:
            return base
        key = (mode, base is not self.costs)
        costs = self._mode_costs.get(key)
        if costs is None:
            draft = 0.0 if mode is Mode.LOOKUP else None
            costs = Costs(base.target_step_ms, draft, base.verify_slope, dict(base.verify_at))
            self._mode_costs[key] = costs
        return costs

    # -- the ChatBackend interface -------------------------------------------

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._messages)

    def reset(
        self, history: Iterable[tuple[str, str]] = (), *, drop_caches: bool = False
    ) -> None:
        """A new conversation, from earlier turns if given ((role, text), role user or assistant).

        The caches stay, so the next turn reuses their common prefix, unless
        `drop_caches`: then the next turn prefills the whole conversation (a
        benchmark's cold start, whatever the previous run left behind).
        """
        turns = list(history)
        bad = [role for role, _ in turns if role not in ("user", "assistant")]
        if bad:
            raise ValueError(f"history roles must be 'user' or 'assistant', got {bad[0]!r}")
        self._messages[:] = turns
        self._window = 0
        self._cut = False
        if drop_caches:  # a benchmark's cold start: nothing learnt from earlier replies
            self._drop_caches()
            self._reply_tokens = None
            if self._first_costs is not None:
                self.costs, self._ahead_costs, self._mode_costs = copy.deepcopy(self._first_costs)

    def _drop_caches(self) -> None:
        self.tokens = []
        self._approx_from = None
        self.target_runner.reset()
        for d in (*self._drafters(), self._composed, self._composed_head, self._composed_ahead):
            if d is not None:
                d.reset()

    @property
    def can_continue(self) -> bool:
        """Whether the last reply was cut by the token limit and can be continued."""
        return self._cut and bool(self._messages) and self._messages[-1][0] == "assistant"

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        self._messages.append(("user", prompt))
        yield from self._reply(config, cancel, keep=len(self._messages) - 1)

    def regenerate(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        if self._messages and self._messages[-1][0] == "assistant":
            self._messages.pop()
        if not self._messages:
            yield Failed("there is no prompt to answer again", hint="type a prompt first")
            return
        yield from self._reply(config, cancel, keep=len(self._messages) - 1)

    def continue_reply(
        self, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Decode more of the last reply, which the token limit cut.

        Streams like `stream`; TurnFinished.stats.text and Cancelled.text hold
        the whole reply, stats.tokens the tokens of this continuation.
        """
        if not self.can_continue:
            yield Failed(
                "there is no cut reply to continue",
                hint="only a reply that stopped at the token limit can be continued",
            )
            return
        yield from self._reply(config, cancel, keep=len(self._messages), continuing=True)

    # -- rendering and context -----------------------------------------------

    def render(self, messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of the conversation, ready for the assistant's reply."""
        chat = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        chat.extend({"role": r, "content": c} for r, c in messages)
        return render_chat(self.tokenizer, chat)

    def _fit_context(self, cfg: DecodeConfig) -> tuple[list[int], int, list[str]]:
        """Render the conversation the model can see: (ids, first message index, notes).

        When the context is full the oldest turns (never the system prompt) leave
        the window, down to a quarter of the context below the limit, so the next
        turns keep a stable prefix to reuse instead of re-prefilling nearly all
        of it every turn. The history itself is never trimmed.
        """
        room = min(cfg.max_new_tokens, max(self.MIN_REPLY_ROOM, self.context_length // 4))
        limit = self.context_length - room
        last = len(self._messages) - 1
        start = min(self._window, last)
        ids = self.render(self._messages[start:])
        if len(ids) > limit:
            goal = limit - self.context_length // 4
            while len(ids) > goal and start < last:
                start += 1  # the oldest user turn, and the reply that followed it
                if start < last and self._messages[start][0] == "assistant":
                    start += 1
                ids = self.render(self._messages[start:])
        if len(ids) > limit:
            raise ContextOverflowError(
                f"the prompt is {len(ids)} tokens; the context holds {self.context_length} "
                f"with {room} kept for the reply",
                hint="shorten the prompt or lower --max-new-tokens",
            )
        notes = []
        if start > self._window:
            notes.append(
                f"context full: the {start} oldest message(s) are out of the model's view "
                f"of {self.context_length} tokens (the system prompt is kept; the "
                "conversation keeps them all)"
            )
        return ids, start, notes

    # -- drafters for each mode ----------------------------------------------

    def _drafter_for(self, cfg: DecodeConfig) -> tuple[Drafter | None, str | None]:
        if cfg.mode is Mode.SPEC:
            if self.drafter is None:
                return None, "no draft model is loaded: plain decoding"
            # Ahead keeps a chain of its own: a turn that asks for trees drafts serially.
            if self._ahead is not None and cfg.ahead and cfg.greedy and not cfg.siblings:
                return self._spec_drafter(cfg, self._ahead), None
            return self._spec_drafter(cfg, self.drafter), None
        if cfg.mode is Mode.SELF_SPEC:
            layer = cfg.exit_layer or max(1, self.target.num_layers // 4)
            if self._self_drafter is None or self._self_drafter_layer != layer:
                self._self_drafter = SelfSpecDrafter(self.target, layer, runner=self.target_runner)
                self._self_drafter_layer = layer
            return self._self_drafter, None
        if cfg.mode is Mode.LOOKUP:
            return self._lookup(), None
        if cfg.mode is Mode.EAGLE:
            if self.head_drafter is None:
                return None, (
                    "no draft head for this target: plain decoding "
                    "(train one with `specchat train-draft`, or give --draft-head PATH)"
                )
            if cfg.compose:
                if self._composed_head is None:
                    self._composed_head = ComposedDrafter(self._lookup(), self.head_drafter)
                return self._composed_head, None
            return self.head_drafter, None
        return None, None

    def _spec_drafter(self, cfg: DecodeConfig, model: Drafter) -> Drafter:
        """Spec's drafter over `model` (the draft, serial or ahead): composed with lookup
        unless the turn asks for the model alone."""
        if not cfg.compose:
            return model
        if model is self._ahead:
            if self._composed_ahead is None:
                self._composed_ahead = ComposedDrafter(self._lookup(), model)
            return self._composed_ahead
        if self._composed is None:
            self._composed = ComposedDrafter(self._lookup(), model)
        return self._composed

    def _drafters(self) -> tuple[Drafter | None, ...]:
        """Every drafter with state of its own (a composed one holds two of these)."""
        return (
            self.drafter, self._self_drafter, self._lookup_drafter, self.head_drafter, self._ahead
        )

    def _lookup(self) -> LookupDrafter:
        if self._lookup_drafter is None:
            self._lookup_drafter = LookupDrafter(self.target_runner.vocab, self.target.device)
        return self._lookup_drafter

    # -- the decoding loop ----------------------------------------------------

    def _reply(
        self,
        cfg: DecodeConfig,
        cancel: threading.Event | None,
        keep: int,
        continuing: bool = False,
    ) -> Iterator[Event]:
        """Run one reply; on a failure keep the first `keep` messages and report it."""
        t_start = time.perf_counter()
        if self._first_costs is None:
            self._first_costs = copy.deepcopy((self.costs, self._ahead_costs, self._mode_costs))
        try:
            yield from self._decode(cfg, cancel, t_start, continuing)
        except ContextOverflowError as exc:
            del self._messages[keep:]  # nothing was decoded: the caches are intact
            yield Failed(exc.message, exc.hint)
        except EngineError as exc:
            self._recover(keep)
            yield Failed(exc.message, exc.hint)
        except torch.OutOfMemoryError:
            self._recover(keep)
            yield Failed(
                "out of memory while decoding",
                hint="lower --max-new-tokens, start a new conversation, or use a quantized/smaller model",
            )
        except Exception as exc:  # a bug or a backend failure: report it, keep the UI alive
            log.exception("decoding failed")
            self._recover(keep)
            yield Failed(
                f"decoding failed: {type(exc).__name__}: {exc}", hint="see the log for details"
            )

    def _recover(self, keep: int) -> None:
        """After a failure: keep `keep` messages, drop the caches (re-prefilled next turn)."""
        del self._messages[keep:]
        self._window = min(self._window, max(0, len(self._messages) - 1))
        self._cut = False
        self._drop_caches()

    def _start(self, ids: list[int], lossless: bool) -> int:
        """Bring every cache to the longest prefix of ids it holds; returns that length.

        Each drafter with a cache is rolled back too, not only the one this turn
        uses: a draft left behind by a turn in another mode still holds the old
        sequence past the common prefix. A lossless turn also drops the K/V an
        early exit estimated, from its first such position on.
        """
        reuse = common_prefix_len(self.tokens, ids)
        if lossless and self._approx_from is not None:
            reuse = min(reuse, self._approx_from)
            self._approx_from = None
        self.target_runner.crop_to(reuse)
        for d in self._drafters():
            if d is not None:
                d.rollback(reuse)
        return reuse

    def _decode(
        self, cfg: DecodeConfig, cancel: threading.Event | None, t_start: float, continuing: bool
    ) -> Iterator[Event]:
        """One reply: set up the turn, then rounds until a stop, then the reply's record."""
        turn = yield from self._begin(cfg, continuing)
        stop_reason = None
        with ahead_of(turn.ahead, turn.seq):
            while stop_reason is None:
                stop_reason = self._stop_before_round(turn, cancel)
                if stop_reason is not None:
                    break
                res, round_mode, reason = self._round(turn)
                stop_reason = yield from self._emit(turn, res)
                yield self._round_event(turn, res, round_mode, reason)
        yield from self._finish(turn, stop_reason, t_start)

    def _begin(self, cfg: DecodeConfig, continuing: bool) -> Generator[Event, None, Turn]:
        """Fit the conversation, choose the drafter, bring the caches to it: a new Turn."""
        earlier = ""  # the part of a continued reply decoded before
        notes: list[str] = []
        if continuing:
            ids, earlier = list(self.tokens), self._messages[-1][1]
        else:
            ids, self._window, notes = self._fit_context(cfg)
        self._cut = False
        for note in notes:
            yield Notice(note, "warning")

        drafter, why_not = self._drafter_for(cfg)
        if why_not:
            yield Notice(why_not, "warning")
        run_mode = cfg.mode if drafter is not None or cfg.mode is Mode.EARLY_EXIT else Mode.PLAIN
        early_exit = None
        if run_mode is Mode.EARLY_EXIT:
            early_exit = EarlyExitStepper(self.target_runner, policy_for(self.target, cfg))

        # Reuse the cached prefix; prefill the rest (all but the last token).
        reuse = self._start(ids, lossless=run_mode is not Mode.EARLY_EXIT)
        if self.head_drafter is not None:  # features only where the head drafts
            if run_mode is Mode.EAGLE:
                self.head_drafter.attach()
            else:
                self.head_drafter.detach()
        t0 = time.perf_counter()
        # The draft's read waits for its first round (see _round). Plain and speculative turns
        # read a prompt alike, so its rows need no step's bits.
        self.target_runner.prefill(ids, prompt=True)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        self.turn += 1
        self.tokens = list(ids)
        yield TurnStarted(self.turn, len(ids), len(ids) - reuse, run_mode, prefill_ms)

        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(
            cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
        )
        ahead = self._ahead if self._ahead is not None and drafter in (
            self._ahead, self._composed_ahead
        ) else None
        serial = self._spec_drafter(cfg, self.drafter) if ahead and self.drafter else None
        ahead_on = ahead is not None
        auto = self._ahead_way == "auto"
        if ahead_on and auto and drafter is self._composed_ahead:
            # Composed, the turn starts serially and chooses its way after its first rounds
            # (_choose_way), from the acceptance they measure. Started ahead, the draft
            # would read the prompt on the core the target's steps lose, before anything
            # says that the model's drafts pay on this prompt; serially, the read is a
            # catch-up pass on every core that the controller weighs first (pays_to_read),
            # and a later switch ahead reads only what the draft lacks by then.
            drafter, ahead_on = serial, False
        composed = drafter if isinstance(drafter, ComposedDrafter) else None
        return Turn(
            cfg=cfg,
            run_mode=run_mode,
            drafter=drafter,
            composed=composed,
            early_exit=early_exit,
            controller=Controller(  # the draft ahead keeps a chain of its own
                cfg,
                self._costs_for(run_mode, ahead_on),
                tree=self._takes_trees(run_mode) and not ahead_on,
                runs=run_mode is Mode.LOOKUP,
            ),
            copier=(
                Controller(cfg, self._costs_for(Mode.LOOKUP, ahead_on), runs=True, label="copies")
                if composed
                else None
            ),
            ahead=ahead,
            ahead_on=ahead_on,
            ahead_auto=ahead is not None and auto,
            serial=serial,
            seq=self.tokens,
            earlier=earlier,
            continuing=continuing,
            decoder=IncrementalDecoder(
                self.tokenizer, context=ids, unfinished=self._unfinished if continuing else 0
            ),
            reply=ReplyFilter(cfg.stop),
            generator=generator,
        )

    # Weight of the newest reply in the typical length (an exponential mean).
    REPLY_MEMORY = 0.5

    def _read_horizon(self, turn: Turn, remaining: int) -> tuple[int, str]:
        """The tokens a read now can pay back in, and how to name them: the budget left, or
        less where this session's replies end sooner of themselves (a reply already past
        its typical length is taken to run half that again)."""
        if self._reply_tokens is None:
            return remaining, "left"
        typical = int(self._reply_tokens)
        left = max(typical - turn.tally.generated, typical // 2, 1)
        if left >= remaining:
            return remaining, "left"
        return left, f"a reply here has left (replies ran {typical} tokens)"

    def _remember_length(self, stop_reason: str, generated: int) -> None:
        """Keep the typical length of replies that ended of themselves."""
        if stop_reason not in ("eos", "stop_string") or generated <= 0:
            return
        old = self._reply_tokens
        self._reply_tokens = float(generated) if old is None else (
            self.REPLY_MEMORY * generated + (1 - self.REPLY_MEMORY) * old
        )

    def _takes_trees(self, mode: Mode) -> bool:
        """Whether spec's draft model or eagle's head may draft trees (tree.py): the target
        scores a tree's rows by their paths (its native decoder or row-wise attention)."""
        drafts = self.drafter if mode is Mode.SPEC else self.head_drafter if mode is Mode.EAGLE else None
        return drafts is not None and self.target_runner.scores_trees

    def _stop_before_round(self, turn: Turn, cancel: threading.Event | None) -> str | None:
        """Why the reply ends before another round ("cancelled", "max_tokens", "context"), or None."""
        if cancel is not None and cancel.is_set():
            return "cancelled"
        if turn.cfg.max_new_tokens - turn.tally.generated <= 0:
            return "max_tokens"
        if self.context_length - len(turn.seq) <= 0:
            return "context"
        return None

    def _round(self, turn: Turn) -> tuple[RoundResult, Mode, str | None]:
        """One round of the turn's mode: (its result, the mode it ran in, the controller's reason)."""
        seq, cfg = turn.seq, turn.cfg
        # Spec composed with lookup: a copy, where there is one, is priced by a
        # controller of its own (its drafts cost nothing and run long); the draft
        # model's rounds by the turn's controller.
        switched = self._choose_way(turn) if turn.ahead_auto else None
        ctl, drafter = turn.controller, turn.drafter
        if turn.speculative and turn.tally.rounds == 0:
            # The first token comes from the target alone, so a speculative reply starts
            # when a plain one would: the draft's prefill and drafting would come first
            # otherwise (~1.5 target steps on a CPU). The draft catches up on the prompt
            # before the next round, untimed like any catch-up.
            first = plain_step(self.target_runner, seq, cfg, turn.generator)
            turn.tally.round(first, None)
            if turn.ahead_on and turn.ahead is not None:  # it reads the prompt beside the next steps
                turn.ahead.start([*seq, first.tokens[0].token_id])
            return first, Mode.PLAIN, None
        copy = False
        if turn.composed is not None:
            drafter = turn.composed.model
            if (
                turn.copier is not None
                and turn.copier.mode is Mode.SPEC
                and turn.composed.copies(seq)
                and self._copy_pays_more(turn)
            ):
                ctl, drafter, copy = turn.copier, turn.composed, True
            else:  # a round the model could draft: it would read the copies' tokens first
                ctl.observe_copies(turn.copied)
                turn.copied = 0
                if turn.copier is not None:
                    turn.copier.break_run()
        # Composed, the serial draft model's reads: what it lacks before this round.
        model = drafter if turn.composed is not None and not copy else None
        model = model if isinstance(model, ModelDrafter) else None
        unread = 0
        if turn.speculative:
            mode, k = ctl.next()
            k = ctl.run_k(k)  # a copy continuing one the target took whole: longer
            remaining = cfg.max_new_tokens - turn.tally.generated
            k = min(k, remaining - 1, self.context_length - len(seq) - 1)
            if mode is not Mode.PLAIN and model is not None:
                unread = model.unread(seq)
                # Its read of the prompt, or of a plain stretch before a probe, is an
                # investment: copies and plain steps are the way without it. (What copies
                # leave between its rounds is priced in every round, as o.)
                invests = not turn.model_drafted or ctl.probing
                if unread and invests:
                    horizon, why = self._read_horizon(turn, remaining)
                    if not ctl.pays_to_read(unread, horizon, why, model.folds(seq)):
                        mode = Mode.PLAIN
        else:
            mode, k = turn.run_mode, 0
        reason = ctl.take_reason()

        res: RoundResult
        if mode is not Mode.PLAIN and k >= 1 and drafter is not None:
            # A tree where the controller priced one, for the serial draft model's rounds
            # (a copy's drafts are one-hot; the draft ahead keeps a chain of its own).
            siblings = ctl.siblings if drafter in (self.drafter, self.head_drafter) else 0
            serial = drafter if isinstance(drafter, ModelDrafter) else None
            folded = serial.unread(seq) if serial is not None and serial.folds(seq) else 0
            res = speculative_round(
                self.target_runner, drafter, seq, k, cfg, turn.generator, siblings
            )
            if res.k and folded:
                # A short read rode in the first draft pass: its rows' price moves from the
                # draft's time (which the controller reads as K draft steps) to the catch-up.
                moved = min(res.draft_ms, ctl.costs.folded_ms(folded))
                res.draft_ms -= moved
                res.catch_up_ms += moved
            if res.k:
                # A timed catch-up pass prices a row (the prompt read before the model's first
                # round is priced at load; on a GPU the timer would see launches only).
                if (
                    unread
                    and not folded
                    and turn.model_drafted
                    and model is not None
                    and model.runner.device.type == "cpu"
                ):
                    ctl.observe_catch_up(unread, res.catch_up_ms)
                ctl.observe_round(
                    res.k, res.accepted, res.draft_ms, res.verify_ms, res.siblings, res.off_chain,
                    res.guessed if res.siblings else None,
                )
                round_mode = turn.run_mode
            else:  # a lookup that found nothing: the round was a plain step
                ctl.observe_plain(res.verify_ms)
                round_mode = Mode.PLAIN
        elif turn.early_exit is not None:
            res = turn.early_exit.step(seq, cfg, turn.generator)
            round_mode = Mode.EARLY_EXIT
        else:
            res = plain_step(self.target_runner, seq, cfg, turn.generator)
            if turn.run_mode is not Mode.PLAIN:
                ctl.observe_plain(res.verify_ms)
            round_mode = Mode.PLAIN
        reason = "; ".join(r for r in (switched, ctl.take_reason() or reason) if r) or None
        turn.tally.round(res, reason)
        if turn.composed is not None and res.k:
            if copy:
                turn.copied += len(res.tokens)
            else:
                turn.model_drafted = True
        return res, round_mode, reason

    @staticmethod
    def _copy_pays_more(turn: Turn) -> bool:
        """Whether a composed round takes the copy the lookup found: where the copies' controller
        expects at least the draft model's round's speedup, or the model is off. (Against plain
        alone, copies that accept 0.2 displaced model rounds that accept 0.7 on chat prompts.)
        With K fixed, every copy is taken: the expectations rest on measured times, and a
        seed with a fixed K must give the same reply on every run."""
        model = turn.controller
        if model.mode is not Mode.SPEC or turn.copier is None or not model.adaptive:
            return True
        return turn.copier.best()[1] >= model.best()[1]

    # Rounds between two changes of way (ahead or serial), so each is measured before the
    # next choice; the first lets the draft read the prompt beside the first steps.
    AHEAD_SWITCH_ROUNDS = 6
    # A stretch ahead this long that took fewer drafts than one in two rounds ends running
    # ahead for the turn: the draft cannot keep up (a model so small that Python's turns,
    # not its passes, set its pace), whatever the load's timings predicted. Twice the switch
    # interval, so the prompt read at a turn's start (about five steps here) is not taken
    # for it.
    AHEAD_STARVED_ROUNDS = 12

    def _choose_way(self, turn: Turn) -> str | None:
        """Draft ahead or serially for the next rounds, from the acceptance measured so far
        and the load's prediction at it (costs.AheadCosts.prefers); says why on a change."""
        figures, ahead = self._ahead_costs, turn.ahead
        if figures is None or ahead is None or turn.tally.rounds < turn.switch_at:
            return None
        alpha = turn.controller.alpha
        serial_ms, ahead_ms = figures.at(alpha)
        rounds = turn.tally.rounds - turn.switched_at
        starved = (
            turn.ahead_on
            and rounds >= self.AHEAD_STARVED_ROUNDS
            and turn.tally.drafted - turn.drafted_at < rounds / 2
        )
        if starved:  # the draft does not keep up here, whatever the timings predicted
            turn.ahead_refuted = True
        # Not while the draft model is off: running ahead, it would read all it missed and
        # take a core from the target's plain steps (so a turn ahead whose controller falls
        # back goes serial at the next choice, whatever the figures' margin).
        drafting = turn.controller.mode is Mode.SPEC
        want = not turn.ahead_refuted and drafting and figures.prefers(alpha, turn.ahead_on)
        if want == turn.ahead_on:
            return None
        if want:
            ahead.start(turn.seq)
            drafter: Drafter | None = self._spec_drafter(turn.cfg, ahead)
        else:
            ahead.stop(turn.seq)
            drafter = turn.serial
        turn.ahead_on = want
        turn.drafter = drafter
        turn.composed = drafter if isinstance(drafter, ComposedDrafter) else None
        turn.controller.use_costs(
            self._costs_for(turn.run_mode, want), tree=self._takes_trees(turn.run_mode) and not want
        )
        if turn.copier is not None:
            turn.copier.use_costs(self._costs_for(Mode.LOOKUP, want))
        turn.switch_at = turn.tally.rounds + self.AHEAD_SWITCH_ROUNDS
        turn.switched_at, turn.drafted_at = turn.tally.rounds, turn.tally.drafted
        if starved:
            return (
                f"the draft drafts, then the target verifies: ahead, {rounds} rounds took "
                "fewer than one draft in two (the draft does not keep up on this machine)"
            )
        way = "the draft runs ahead on its own core" if want else "the draft drafts, then the target verifies"
        return (
            f"{way}: α={alpha:.2f}, a token predicted to take {serial_ms:.1f} ms serially, "
            f"{ahead_ms:.1f} ms with the draft ahead"
        )

    def _emit(self, turn: Turn, res: RoundResult) -> Generator[Event, None, str | None]:
        """Append the round's tokens and stream their events; "eos" or "stop_string" if one ends
        the reply (the stop filter holds back text that may begin a stop string)."""
        seq, tally, reply = turn.seq, turn.tally, turn.reply
        for i, em in enumerate(res.tokens):
            if em.exit_layer is not None and self._approx_from is None:
                self._approx_from = len(seq) - 1  # this step estimated seq[-1]'s upper K/V
            seq.append(em.token_id)
            tally.token(res, i)
            is_eos = em.token_id in self.eos
            text = turn.decoder.flush() if is_eos else turn.decoder.add(em.token_id)
            released = reply.push(self._token_event(em, text, tally.rounds))
            if is_eos and not reply.stopped:
                released += reply.release()
            yield from released
            if released and tally.t_first is None:
                tally.t_first = released[0].t
            if reply.stopped:
                return "stop_string"
            if is_eos:
                return "eos"
        return None

    def _round_event(
        self, turn: Turn, res: RoundResult, round_mode: Mode, reason: str | None
    ) -> RoundEvent:
        controller = turn.controller
        speculative = turn.speculative
        next_mode = turn.run_mode
        if speculative and controller.mode is not Mode.SPEC:
            next_mode = Mode.PLAIN
        # The K the next round drafts: after a copy, the copier's, a run's included (a copy
        # of 31 in a run showed as the planned 4 before).
        planner = turn.copier if turn.copier is not None and res.drafter == LookupDrafter.name else controller
        return RoundEvent(
            round=turn.tally.rounds,
            mode=round_mode,
            k=res.k,
            accepted=res.accepted,
            draft_ms=res.draft_ms,
            verify_ms=res.verify_ms,
            fallback_reason=reason,
            next_mode=next_mode,
            next_k=planner.run_k(planner.k) if speculative else None,
            target_step_ms=controller.costs.target_step_ms if speculative else None,
            drafter=res.drafter,
            siblings=res.siblings,
            catch_up_ms=res.catch_up_ms,
        )

    def _finish(self, turn: Turn, stop_reason: str, t_start: float) -> Iterator[Event]:
        """Release held text, record the reply in the conversation, say how the turn ended."""
        # A reply cut inside a multi-byte character ends without it: those bytes are
        # no text yet (a continuation completes them), so the stream and the reply agree.
        self._unfinished = turn.decoder.unfinished
        yield from turn.reply.finish()
        text = turn.earlier + turn.reply.text
        self.tokens = turn.seq
        if turn.continuing:
            self._messages[-1] = ("assistant", text)
        else:
            self._messages.append(("assistant", text))
        self._cut = stop_reason == "max_tokens"
        if not turn.continuing:
            self._remember_length(stop_reason, turn.tally.generated)
        if stop_reason == "cancelled":
            yield Cancelled(turn.tally.generated, text)
            return
        optimizations = [turn.run_mode.value]
        if turn.speculative:
            optimizations.append(f"K={turn.cfg.k}" if turn.cfg.k is not None else "K=auto")
        yield TurnFinished(
            turn.tally.stats(t_start, turn.run_mode, optimizations, stop_reason, text)
        )

    def _token_event(self, em: TokenEvent, text: str, round_: int) -> TokenEvent:
        """The round's token with its text, round, refused draft's text and emission time."""
        rejected = em.rejected_id
        return dataclasses.replace(
            em,
            text=text,
            round=round_,
            rejected_text=self.tokenizer.decode([rejected]) if rejected is not None else None,
            t=time.perf_counter(),
        )
