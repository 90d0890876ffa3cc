"""The chat app: layout, bindings, workers, and the handlers that apply engine messages.

Message flow (see tui/messages.py):

    load worker ── LoadUpdated* ── BackendReady | BackendFailed ──▶ app
    prompt ⏎ ──▶ generate worker: backend.stream(prompt, config, cancel)
                 (ctrl+r: backend.regenerate; ctrl+o: backend.continue_reply,
                 streamed into the reply the limit cut)
                 ── GenerationStarted, RoundsCompleted (batches), EngineNotice,
                    GenerationEnded ──▶ app ──▶ reply widget, metrics, panels
    probe thread ── SystemSampled ──▶ app ──▶ devices panel

Workers only post messages; every widget changes on the UI thread. All
calls into the engine session happen in worker threads, one at a time
(`_engine_lock`), so torch never runs on the UI thread.

The UI's cost comes out of the engine's speed: on a small model decoding is
mostly Python, so every millisecond the UI thread holds the GIL is one the
engine waits. So while a reply streams, the UI thread keeps to a budget:
after each redraw of the reply it waits until the CPU time it spent since the
previous one (frames included) is at most `ui_budget` of the wall time, and
never less than `redraw_interval` nor more than LONGEST_WAIT seconds. A
redraw shows all the rounds that arrived since: the worker's
`RoundsCompleted` batch stays open until the UI takes it. The panels redraw
at most every `panel_interval` seconds, in the same frame as the reply.
A slow model gets smooth updates (a line that grows only repaints); a fast
one, whose reply adds lines (a layout of the whole screen) at every redraw,
gets fewer. Measured in docs/ui.md.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.worker import Worker, WorkerState, get_current_worker

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.errors import EngineError
from specchat.engine.events import (
    Cancelled,
    Failed,
    LoadProgress,
    Notice,
    RoundEvent,
    ServerStats,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)
from specchat.engine.protocol import ChatBackend
from specchat.themes import DEFAULT_THEME, PROVENANCE_DEFAULTS, THEMES

from . import actions
from .messages import (
    BackendFailed,
    BackendReady,
    EngineNotice,
    GenerationEnded,
    GenerationStarted,
    LoadUpdated,
    RoundsCompleted,
    ServerSampled,
    StreamedRound,
    SystemSampled,
)
from .panels import PANEL_TYPES, Panel
from .settings import Settings, SettingsStore, decode_to_toml
from .state import ChatState, ReplyComparison
from .widgets.help import HelpScreen
from .widgets.inspector import Inspector
from .widgets.legend import Legend
from .widgets.prompt import PromptInput, unfold
from .widgets.reply import ReplyView
from .widgets.status import LoadView, StatusLine, describe_decode, describe_progress
from .widgets.tokens import visible
from .widgets.transcript import Note, Transcript, UserMessage

# Runs in the load worker thread: build the session, reporting progress.
Loader = Callable[[Callable[[LoadProgress], None]], ChatBackend]

LONGEST_WAIT = 0.5  # seconds: a streaming reply is redrawn at least this often


class SpecChatApp(App[None]):
    """Chat with a local model and watch speculative decoding work."""

    CSS_PATH = "app.tcss"
    TITLE = "specchat"
    BINDINGS = [
        *(Binding(a.key, a.action, a.label, show=a.show, tooltip=a.help) for a in actions.ACTIONS),
        # ctrl+o is in the footer and the palette only while the last reply can go on (see
        # check_action); pressed at any other time, this hidden binding says why not
        Binding(actions.CONTINUE_KEY, "continue_reply(True)", show=False),
    ]

    def __init__(
        self,
        loader: Loader,
        *,
        decode: DecodeConfig | None = None,
        settings: Settings | None = None,
        store: SettingsStore | None = None,
        theme: str | None = None,
        models_label: str = "",
        sample_system: bool = True,
        sample_interval: float = 1.0,
        redraw_interval: float = 0.1,
        panel_interval: float = 1.0,
        ui_budget: float = 0.03,
        observer: Callable[[str, object], None] | None = None,
    ) -> None:
        super().__init__()
        self.loader = loader
        # every event of every reply, with the target's name, on the generation thread
        # (`--metrics-port` feeds its Prometheus endpoint from here)
        self.observer = observer
        self.settings = settings or Settings()
        self.store = store
        self.state = ChatState(decode=decode or self.settings.decode)
        self.view = self.settings.view
        self.panels_on: set[str] = set(self.settings.panels)
        self.models_label = models_label
        self.sample_system = sample_system
        self.sample_interval = sample_interval
        self.redraw_interval = redraw_interval
        self.panel_interval = panel_interval
        self.ui_budget = ui_budget
        self.backend: ChatBackend | None = None
        self.load_error: BackendFailed | None = None
        self._theme_request = theme or self.settings.theme
        self._engine_lock = threading.Lock()
        self._replies: dict[int, ReplyView] = {}
        self._prompts: dict[int, str] = {}
        self._next_id = 0
        self._busy_id: int | None = None
        self._stopping = False
        self._reset_pending = False
        self._mode_before_plain: Mode = Mode.SPEC
        self._panels_scheduled = False
        self._batches: list[RoundsCompleted] = []  # handed over, not yet shown
        self._batch_timer: Timer | None = None
        self._next_redraw = float("-inf")  # time.monotonic() of the earliest next reply redraw
        self._ui_cpu = 0.0  # time.thread_time() of the UI thread at the last redraw
        self._last_panels = float("-inf")
        self._panels: list[Panel] = []
        self._sampler: Any = None
        self._started = False
        self._told_unsaved = False
        for t in THEMES:
            self.register_theme(t)

    # -- layout ----------------------------------------------------------

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(PROVENANCE_DEFAULTS)

    def compose(self) -> ComposeResult:
        yield StatusLine()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                with Transcript(id="transcript"):
                    yield LoadView(id="load")
                yield Legend()
                yield PromptInput(placeholder="Ask something; enter sends, ↑ history, F1 help", id="prompt")
            with VerticalScroll(id="side"):
                yield Inspector(id="inspector")
                for cls in PANEL_TYPES:
                    yield cls(self.state, id=f"panel-{cls.KEY}")
        from textual.widgets import Footer

        yield Footer(compact=True)

    def on_mount(self) -> None:
        if self._theme_request in self.available_themes:
            self.theme = self._theme_request
        else:
            self.theme = DEFAULT_THEME
            self._note(f"Unknown theme {self._theme_request!r}; using {DEFAULT_THEME}.", level="warning")
        status = self.query_one(StatusLine)
        status.models = self.models_label or "loading…"
        status.state = "loading"
        self._refresh_decode()
        self.query_one("#inspector").display = False
        self._apply_panels()
        if self.store is not None:
            for problem in self.store.problems:
                self._note(f"Settings: {problem}", level="warning")
        self.query_one(PromptInput).focus()
        self._started = True
        self._load()

    @property
    def _busy(self) -> int | None:
        """The reply in flight, if any."""
        return self._busy_id

    @_busy.setter
    def _busy(self, reply_id: int | None) -> None:
        self._busy_id = reply_id
        if self._started:
            self.query_one(PromptInput).hold_still(reply_id is not None)
            self.refresh_bindings()  # ctrl+o: shown only while nothing streams

    # -- loading ---------------------------------------------------------

    @work(thread=True, exclusive=True, exit_on_error=False, group="load", name="load")
    def _load(self) -> None:
        def progress(p: LoadProgress) -> None:
            self.post_message(LoadUpdated(p))

        try:
            backend = self.loader(progress)
        except EngineError as exc:
            self.post_message(BackendFailed(exc.message, exc.hint))
            return
        except Exception as exc:
            self.post_message(
                BackendFailed(
                    f"Loading failed unexpectedly: {type(exc).__name__}: {exc}",
                    "Check the model flags (specchat --help); report this if it repeats.",
                )
            )
            return
        self.post_message(BackendReady(backend, backend.ready))

    def on_load_updated(self, message: LoadUpdated) -> None:
        for view in self.query(LoadView):
            view.update_progress(message.progress)
        self.query_one(StatusLine).state = f"loading: {describe_progress(message.progress)}"

    def on_backend_ready(self, message: BackendReady) -> None:
        self.backend = message.backend
        ready = message.ready
        self.state.ready = ready
        for view in self.query(LoadView):
            view.remove()
        status = self.query_one(StatusLine)
        names = ready.target.name + (f" + draft {ready.draft.name}" if ready.draft else "")
        if self.models_label.startswith("replay"):
            names += f" ({self.models_label})"
        status.models = names
        status.state = "ready"
        for legend in self.query(Legend):
            legend.remote = bool(ready.server)
        self._refresh_decode()
        text = f"Ready: {ready.summary}"
        if ready.load_seconds:
            text += f" (loaded in {ready.load_seconds:.1f} s)"
        self._note(text, "\n".join(ready.notes))
        self._update_sampler()
        self._schedule_panels()

    def on_backend_failed(self, message: BackendFailed) -> None:
        self.load_error = message
        for view in self.query(LoadView):
            view.remove()
        self.query_one(StatusLine).state = "no model"
        self._note(message.message, message.hint, level="error")

    # -- sending ---------------------------------------------------------

    @on(PromptInput.Submitted)
    def _on_submit(self, event: PromptInput.Submitted) -> None:
        prompt = unfold(event.value).strip()
        if not prompt:
            return
        prompt_input = self.query_one(PromptInput)
        if self.backend is None:
            prompt_input.remember(prompt)
            if self.load_error is not None:
                self.notify(self.load_error.hint or self.load_error.message, title="No model loaded",
                            severity="error")
            else:
                self.notify("The model is still loading; your prompt is kept.", title="Not ready")
            return
        if self._busy is not None:
            self.notify("A reply is in flight: esc stops it. Your prompt is kept.", title="Busy")
            return
        prompt_input.remember(prompt)
        prompt_input.value = ""
        self._send(prompt)

    def _turn_config(self) -> DecodeConfig:
        cfg = self.state.decode
        if cfg.seed is None and not cfg.greedy:
            # a fixed seed per turn lets A/B sample the same way
            cfg = cfg.with_(seed=random.randrange(2**31))
        return cfg

    def _new_reply(self, *, label: str = "assistant") -> ReplyView:
        for earlier in self._replies.values():
            earlier.set_continuable(False)  # only the last reply of a conversation can go on
        self._next_id += 1
        reply = ReplyView(self._next_id, label=label, view=self.view)
        self._replies[reply.reply_id] = reply
        return reply

    def _send(self, prompt: str) -> None:
        transcript = self.query_one(Transcript)
        config = self._turn_config()
        reply = self._new_reply()
        reply.config = config
        self._prompts[reply.reply_id] = prompt
        transcript.mount(UserMessage(prompt))
        transcript.mount(reply)
        self._follow()
        self._start(reply, "stream", prompt, config)

    def _start(self, reply: ReplyView, kind: str, prompt: str | None, config: DecodeConfig) -> None:
        self._busy = reply.reply_id
        self._stopping = False
        self.query_one(StatusLine).state = "generating… (esc stops)"
        reset, self._reset_pending = self._reset_pending, False
        self._generate(reply.reply_id, kind, prompt, config, reset)

    @work(thread=True, exclusive=True, exit_on_error=False, group="generate", name="generate")
    def _generate(
        self, reply_id: int, kind: str, prompt: str | None, config: DecodeConfig, reset: bool
    ) -> None:
        """Stream one reply, handing rounds to the UI in batches (see RoundsCompleted)."""
        cancel = get_current_worker().cancelled_event
        backend = self.backend
        assert backend is not None, "a reply is only started once the backend is ready"
        outcome: TurnFinished | Cancelled | Failed | None = None
        pending: list[TokenEvent] = []
        emitted = 0
        batch: RoundsCompleted | None = None

        def hand_over(tokens: tuple[TokenEvent, ...], rnd: RoundEvent | None) -> None:
            nonlocal batch
            if batch is None or not batch.add(tokens, rnd):
                batch = RoundsCompleted(reply_id)
                batch.add(tokens, rnd)
                self.post_message(batch)

        try:
            with self._engine_lock:
                if reset:
                    backend.reset()
                submitted = time.perf_counter()
                if kind == "regenerate":
                    events = backend.regenerate(config, cancel)
                elif kind == "continue":
                    events = backend.continue_reply(config, cancel)
                else:
                    assert prompt is not None, "a new turn has a prompt"
                    events = backend.stream(prompt, config, cancel)
                model = self.state.ready.target.name if self.state.ready else "unknown"
                for ev in events:  # run the stream to its end: the engine may tidy up after the last event
                    if self.observer is not None:
                        self.observer(model, ev)
                    if outcome is not None:
                        continue
                    if isinstance(ev, TokenEvent):
                        pending.append(ev)
                    elif isinstance(ev, RoundEvent):
                        emitted += len(pending)
                        hand_over(tuple(pending), ev)
                        pending = []
                    elif isinstance(ev, TurnStarted):
                        self.post_message(GenerationStarted(reply_id, ev, submitted))
                    elif isinstance(ev, Notice):
                        self.post_message(EngineNotice(reply_id, ev))
                    elif isinstance(ev, ServerStats):
                        self.post_message(ServerSampled(reply_id, ev))
                    elif isinstance(ev, TurnFinished | Cancelled | Failed):
                        outcome = ev
        except EngineError as exc:
            outcome = Failed(exc.message, exc.hint)
        except Exception as exc:
            outcome = Failed(
                f"Unexpected error: {type(exc).__name__}: {exc}",
                "The conversation is kept; try again, or start a new one with ctrl+n.",
            )
        finally:
            if pending:
                emitted += len(pending)
                hand_over(tuple(pending), None)
            if outcome is None:
                if cancel.is_set():
                    outcome = Cancelled(emitted)
                else:
                    outcome = Failed("The engine ended the reply without saying why.", "Try again.")
            self.post_message(GenerationEnded(reply_id, outcome, config))

    def on_generation_started(self, message: GenerationStarted) -> None:
        reply = self._replies.get(message.reply_id)
        if reply is None:
            return
        reply.start(message.started)
        self.state.metrics.start_turn(message.submitted)
        self.state.context_tokens = message.started.prompt_tokens
        self._next_redraw = float("-inf")
        self._ui_cpu = time.thread_time()  # the panels redraw with the first rounds

    def on_rounds_completed(self, message: RoundsCompleted) -> None:
        self._batches.append(message)
        if self._batch_timer is not None:
            return  # a redraw is due; the batch keeps filling until then
        wait = self._next_redraw - time.monotonic()
        if wait > 0:
            self._batch_timer = self.set_timer(wait, self._show_rounds)
        else:
            self._show_rounds()

    def _show_rounds(self) -> None:
        """Take every batch handed over so far into the replies and metrics: one redraw."""
        if self._batch_timer is not None:
            self._batch_timer.stop()
            self._batch_timer = None
        batches, self._batches = self._batches, []
        shown = False
        for batch in batches:
            rounds = batch.take()
            reply = self._replies.get(batch.reply_id)
            if reply is not None and rounds:
                self._apply_rounds(reply, rounds)
                shown = True
        now = time.monotonic()
        if shown and now - self._last_panels >= self.panel_interval:
            self._refresh_panels()  # in the same frame as the reply
        cpu = time.thread_time()  # this thread's CPU time: handlers and frames since the last redraw
        spent, self._ui_cpu = cpu - self._ui_cpu, cpu
        self._next_redraw = now + min(LONGEST_WAIT, max(self.redraw_interval, spent / self.ui_budget))

    def _apply_rounds(self, reply: ReplyView, rounds: tuple[StreamedRound, ...]) -> None:
        reply.add_rounds(rounds)
        metrics = self.state.metrics
        for tokens, rnd in rounds:
            for tok in tokens:
                metrics.observe(tok)
            if rnd is not None:
                metrics.observe(rnd)
            self.state.context_tokens += len(tokens)

    def on_server_sampled(self, message: ServerSampled) -> None:
        self.state.metrics.observe(message.stats)
        self._schedule_panels()

    def on_engine_notice(self, message: EngineNotice) -> None:
        if message.reply_id is not None and message.reply_id not in self._replies:
            return
        self._note(message.notice.message, level="warning" if message.notice.level == "warning" else "info")

    def on_generation_ended(self, message: GenerationEnded) -> None:
        self._show_rounds()  # the last rounds first: the final state holds every token
        if self._busy == message.reply_id:
            self._busy = None
            self._stopping = False
            self.query_one(StatusLine).state = "ready"
        reply = self._replies.get(message.reply_id)
        if reply is None:
            return
        outcome = message.outcome
        cut = isinstance(outcome, TurnFinished) and outcome.stats.stop_reason == "max_tokens"
        reply.set_continuable(cut and reply is self._last_reply())
        reply.finish(outcome)
        self.state.metrics.observe(outcome)
        if isinstance(outcome, Failed) and not reply.continued:
            prompt = self._prompts.get(message.reply_id)
            if prompt:
                self.query_one(PromptInput).restore(prompt)
        if reply.ab_of is not None and isinstance(outcome, TurnFinished) and not reply.continued:
            self._finish_ab(reply.ab_of, reply)
        self.refresh_bindings()  # a cut reply brings ctrl+o into the footer
        self._refresh_panels()  # the reply's final figures at once

    # -- actions ---------------------------------------------------------

    def action_stop(self) -> None:
        if self._busy is None:
            return
        self._stopping = True
        self.workers.cancel_group(self, "generate")
        self.query_one(StatusLine).state = "stopping…"

    def action_new_chat(self) -> None:
        if self._busy is not None:
            self.workers.cancel_group(self, "generate")
            self._busy = None
        self._reset_pending = True
        self._replies.clear()
        self._prompts.clear()
        transcript = self.query_one(Transcript)
        transcript.selected = None
        transcript.remove_children([w for w in transcript.children if not isinstance(w, LoadView)])
        self.state.metrics.reset()
        self.state.ab = None
        self.state.context_tokens = 0
        self.query_one("#inspector").display = False
        self._apply_panels()
        if self.backend is not None:
            self.query_one(StatusLine).state = "ready"
        self.query_one(PromptInput).focus()
        self.refresh_bindings()
        self.notify("New conversation.")

    def _last_reply(self) -> ReplyView | None:
        replies = self.query_one(Transcript).replies
        return replies[-1] if replies else None

    def _continuable(self) -> ReplyView | None:
        """The last reply, if the reply limit cut it and it can go on now."""
        if self.backend is None or self._busy is not None:
            return None
        reply = self._last_reply()
        if reply is None or not reply.cut or not self.backend.can_continue:
            return None
        return reply

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "continue_reply" and not parameters:
            return self._continuable() is not None
        return True

    def action_continue_reply(self, explain: bool = False) -> None:
        """Stream more of the last reply into the same widget, if the reply limit cut it; else say why.

        `explain` marks the hidden ctrl+o binding, which check_action always lets through.
        """
        reply = self._continuable()
        if reply is None:
            if self._busy is not None:
                self.notify("A reply is streaming: wait for its end, or esc stops it.", title="Continue")
            else:
                self.notify(
                    "Nothing to continue: only the last reply, when the reply limit cut it, can go on.",
                    title="Continue",
                )
            return
        config = self._turn_config()
        reply.resume(config)
        self._follow()
        self._start(reply, "continue", None, config)

    def action_ab(self) -> None:
        if self.backend is None or self._busy is not None:
            self.notify("Wait for the reply to finish (esc stops it).", title="A/B")
            return
        a = self._last_reply()
        if a is None or not isinstance(a.outcome, TurnFinished) or a.config is None:
            self.notify("A/B needs a finished reply: send a prompt first.", title="A/B")
            return
        a_mode = a.started.mode if a.started else a.config.mode
        if a_mode is Mode.REMOTE:
            self.notify("The server decides how it decodes: A/B compares the local engine's modes.",
                        title="A/B")  # fmt: skip
            return
        if a_mode is Mode.PLAIN:
            self.notify("The last reply is already plain decoding.", title="A/B")
            return
        config = a.config.with_(mode=Mode.PLAIN)
        a.set_label("A · assistant")
        b = self._new_reply(label="B · plain decoding (A/B)")
        b.ab_of = a
        b.config = config
        self.query_one(Transcript).mount(b)
        self._follow()
        self._start(b, "regenerate", None, config)

    def _finish_ab(self, a: ReplyView, b: ReplyView) -> None:
        a_out, b_out = a.outcome, b.outcome
        result = ReplyComparison.compare(
            a.tokens,
            b.tokens,
            a_mode=a.started.mode if a.started else Mode.SPEC,
            a_tokens_per_s=a_out.stats.tokens_per_s if isinstance(a_out, TurnFinished) else None,
            b_tokens_per_s=b_out.stats.tokens_per_s if isinstance(b_out, TurnFinished) else None,
        )
        self.state.ab = result
        speed = ""
        if result.speedup is not None:
            speed = (
                f" Speed: A {result.a_tokens_per_s:.1f} tok/s ({result.a_mode.value}) vs "
                f"B {result.b_tokens_per_s:.1f} tok/s (plain), {result.speedup:.2f}×."
            )
        if result.identical:
            text = f"A/B: identical, all {result.b_tokens} tokens match plain decoding.{speed}"
        else:
            at = result.diverge_at or 0
            text = (
                f"A/B: first divergence at token {at + 1}: A {visible(result.a_piece)!r} vs "
                f"B {visible(result.b_piece)!r}; {result.agreement:.0%} of the plain reply matched "
                f"before it.{speed}"
            )
        self._note(text, "The conversation continues from reply B.", level="info", after=b)

    def action_toggle_view(self) -> None:
        self.view = "tokens" if self.view == "markdown" else "markdown"
        for reply in self._replies.values():
            reply.set_view(self.view)
        self._save({"view": self.view})
        self.notify(f"Finished replies: {self.view} view.")

    def action_inspect(self) -> None:
        transcript = self.query_one(Transcript)
        if transcript.has_focus:
            self.query_one(PromptInput).focus()
        else:
            transcript.focus()

    @on(Transcript.Leave)
    def _leave_transcript(self) -> None:
        self.query_one(PromptInput).focus()

    @on(Transcript.Selected)
    def _on_selected(self, message: Transcript.Selected) -> None:
        inspector = self.query_one(Inspector)
        reply, index = message.reply, message.index
        if reply is None or index is None or not reply.tokens:
            inspector.show(None, None, 0, None)
            inspector.display = False
        else:
            inspector.show(reply.tokens[index], index, len(reply.tokens), reply.round_of(index))
            inspector.display = True
        self._apply_panels()

    def action_toggle_panel(self, key: str) -> None:
        if key in self.panels_on:
            self.panels_on.discard(key)
        else:
            self.panels_on.add(key)
        self._apply_panels()
        self._update_sampler()
        self._refresh_panels()
        order = [cls.KEY for cls in PANEL_TYPES]
        self._save({"panels": [k for k in order if k in self.panels_on]})

    def action_help(self) -> None:
        path = str(self.store.path) if self.store else "the settings file"
        self.push_screen(HelpScreen(path))

    def action_settings_path(self) -> None:
        if self.store is None:
            self.notify("Settings are not saved in this session.")
        else:
            self.notify(str(self.store.path), title="Settings file", timeout=8)

    # decode settings ----------------------------------------------------

    def _set_decode(self, **changes: Any) -> None:
        try:
            self.state.decode = self.state.decode.with_(**changes)
        except ValueError as exc:
            self.notify(str(exc), severity="error")
            return
        self._refresh_decode()
        full = decode_to_toml(self.state.decode)
        self._save({"decode": {key: full.get(key) for key in changes}})
        self._schedule_panels()

    def _refresh_decode(self) -> None:
        ready = self.state.ready
        server = ready.server.split(" ", 1)[0] if ready is not None and ready.server else None
        self.query_one(StatusLine).decode = describe_decode(self.state.decode, server)

    def action_set_decode(self, name: str, value: object) -> None:
        """Set one decode setting of `actions.SETTINGS` (the palette's entries)."""
        setting = actions.SETTINGS[name]
        self._set_decode(**{setting.field: setting.to_config(value)})
        shown = setting.shown(getattr(self.state.decode, setting.field))
        self.notify(f"{setting.label}: {shown}{setting.after}")

    def action_cycle(self, name: str) -> None:
        """Move one decode setting to the next value of its cycle (its F-key)."""
        setting = actions.SETTINGS[name]
        values = setting.values
        if name == "mode" and self._server_decides():
            return
        if name == "mode":  # eagle only where the backend has a draft head
            ready = self.state.ready
            values = tuple(m for m in values if m is not Mode.EAGLE or (ready and ready.draft_head))
        value = setting.step(values, getattr(self.state.decode, setting.field))
        self.action_set_decode(name, setting.to_action(value))

    def _server_decides(self) -> bool:
        """On a served engine the mode is the server's: say so, and change nothing."""
        if self.state.ready is None or not self.state.ready.server:
            return False
        self.notify("The server decodes as it was started to (its draft, head or n-gram); "
                    "modes are the local engine's.", title="Mode")  # fmt: skip
        return True

    def action_plain_toggle(self) -> None:
        if self._server_decides():
            return
        mode = self.state.decode.mode
        if mode is Mode.PLAIN:
            self.action_set_decode("mode", self._mode_before_plain.value)
        else:
            self._mode_before_plain = mode
            self.action_set_decode("mode", Mode.PLAIN.value)

    # -- palette ---------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for a in (*actions.ACTIONS, *actions.PALETTE_ONLY):
            if self.check_action(a.action, ()) is False:
                continue  # not possible now (continue with no cut reply), as in the footer
            title = f"{a.title} ({a.key})" if a.key else a.title
            yield SystemCommand(title, a.help, lambda action=a.action: self.run_action(action))

    # -- panels, sampler, settings ---------------------------------------

    def _apply_panels(self) -> None:
        any_on = False
        for panel in self.query(Panel):
            on_ = panel.KEY in self.panels_on
            panel.display = on_
            any_on = any_on or on_
        inspector_on = bool(self.query_one(Inspector).display)
        self.query_one("#side").display = any_on or inspector_on

    def _schedule_panels(self) -> None:
        if not self._panels_scheduled:
            self._panels_scheduled = True
            self.set_timer(self.redraw_interval, self._refresh_panels)

    def _refresh_panels(self) -> None:
        self._panels_scheduled = False
        self._last_panels = time.monotonic()
        if not self._panels:
            self._panels = list(self.query(Panel))
        streaming = self._busy is not None
        for panel in self._panels:
            if panel.display:
                panel.refresh_from(self.state, streaming)

    def on_system_sampled(self, message: SystemSampled) -> None:
        self.state.sample = message.sample
        if "devices" in self.panels_on:
            self.query_one("#panel-devices", Panel).refresh_from(self.state, self._busy is not None)

    def _update_sampler(self) -> None:
        want = self.sample_system and "devices" in self.panels_on
        if want and self._sampler is None:
            from specchat.engine.tools.probes import Sampler, SystemProbe

            ready = self.state.ready
            probe = SystemProbe(
                draft_device=ready.draft.device if ready and ready.draft else None,
                target_device=ready.target.device if ready else None,
            )
            self._sampler = Sampler(
                lambda s: self.post_message(SystemSampled(s)), interval=self.sample_interval, probe=probe
            )
            self._sampler.start()
        elif not want and self._sampler is not None:
            self._sampler.stop(timeout=0)
            self._sampler = None

    def on_unmount(self) -> None:
        if self._sampler is not None:
            self._sampler.stop(timeout=0)
            self._sampler = None

    def watch_theme(self, theme: str) -> None:
        if self._started and theme != self.settings.theme:
            self.settings.theme = theme
            self._save({"theme": theme})

    def _save(self, changes: dict[str, Any]) -> None:
        if self.store is None:
            return
        if not self.store.save(changes) and not self._told_unsaved:
            self._told_unsaved = True
            self.notify(
                f"Not saved: {self.store.path} is not valid TOML. Fix or remove it to save settings.",
                title="Settings",
                severity="warning",
                timeout=8,
            )

    # -- errors ----------------------------------------------------------

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state is not WorkerState.ERROR:
            return
        error = event.worker.error
        self._note(
            f"Unexpected error in {event.worker.name or 'a worker'}: {type(error).__name__}: {error}",
            "The app keeps running; report this if it repeats.",
            level="error",
        )
        if event.worker.group == "generate" and self._busy is not None:
            self._busy = None
            self.query_one(StatusLine).state = "ready" if self.backend is not None else "no model"

    def _follow(self) -> None:
        """Keep the transcript scrolled to its end as replies grow."""
        transcript = self.query_one(Transcript)
        transcript.anchor()
        transcript.scroll_end(animate=False)

    def _note(self, message: str, hint: str = "", *, level: str = "info", after: Any = None) -> None:
        note = Note(message, hint, level=level)
        transcript = self.query_one(Transcript)
        if after is not None:
            transcript.mount(note, after=after)
        else:
            transcript.mount(note)
