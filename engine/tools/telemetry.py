"""Prometheus metrics fed from the session's event stream.

    telemetry = Telemetry()
    server = telemetry.serve(port=9464)          # 127.0.0.1 unless told otherwise
    for event in session.stream(prompt, config):
        telemetry.observe(event, model="qwen2.5-coder-1.5b-instruct")
    server.close()

The metrics live in the instance's own `CollectorRegistry` (never the
process-wide default), so several instances and tests do not collide.
Every series is labelled by `model` and `mode`. `mode` is the label given to
`observe`, or else the mode of the round the tokens came from (a speculative
reply whose controller fell back to plain counts those tokens as plain).

Series (prefix `specchat_`):

- `tokens_total{model,mode,provenance}`   tokens emitted
- `drafted_tokens_total`, `accepted_tokens_total`, `rounds_total{model,mode}`
- `accepted_length{model,mode}`   histogram of drafts accepted per speculative round
- `exit_layer{model,mode}`        histogram of the layer early-exit tokens left at
- `token_latency_seconds{model,mode}`  per-token latency: the gap between a round's
  emission and the previous round's, over the tokens it carried (the first round,
  which includes the prefill, is `time_to_first_token_seconds`)
- `time_to_first_token_seconds{model,mode}`
- `mode_switches_total{model,mode,to}`  the controller moved between speculative and
  plain decoding (`mode` is where it was, `to` where it went)
- `k_changes_total{model,mode}`   the controller changed K
- `turns_total{model,mode,outcome}`  replies finished, cancelled or failed
- `tokens_per_second{model,mode}` gauge: the last finished reply

The speculative counters also come in vLLM's shape, so a dashboard built on
`vllm:spec_decode_*` watches specchat with the prefix swapped for `specchat:`
(labelled `model_name`, as vLLM's; `position` counts from 0):

- `specchat:spec_decode_num_drafts_total`, `specchat:spec_decode_num_draft_tokens_total`,
  `specchat:spec_decode_num_accepted_tokens_total`,
  `specchat:spec_decode_num_accepted_tokens_per_pos_total{position}`

A served engine's reply (Mode.REMOTE) counts there what the server reported for it
(`TurnStats.server`): its draft and accepted tokens, and its drafts and positions
where the server says them.

Thread-safe (prometheus-client is): the chat's worker thread may call
`observe` while the HTTP thread serves scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..config import SPECULATIVE_MODES, Mode
from ..events import (
    Cancelled,
    Failed,
    RoundEvent,
    ServerStats,
    TokenEvent,
    TurnFinished,
    TurnStarted,
)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPTED_BUCKETS = tuple(float(i) for i in range(0, 17))
EXIT_LAYER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)

_SPECULATIVE = SPECULATIVE_MODES


@dataclass(slots=True)
class _Stream:
    """Per (model, label) state between events: tokens waiting for their round."""

    mode: str | None = None
    pending: list[TokenEvent] = field(default_factory=list)
    last_emit: float | None = None


@dataclass(slots=True)
class MetricsServer:
    """A running endpoint; `close()` stops it."""

    host: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Telemetry:
    """Counters and histograms of decoding, in a registry of their own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "specchat"
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r, ns = self.registry, namespace
        mm = ("model", "mode")
        self.tokens = Counter(
            "tokens", "Tokens emitted", (*mm, "provenance"), namespace=ns, registry=r
        )
        self.drafted = Counter(
            "drafted_tokens", "Draft tokens proposed", mm, namespace=ns, registry=r
        )
        self.accepted = Counter(
            "accepted_tokens", "Draft tokens the target accepted", mm, namespace=ns, registry=r
        )
        self.rounds = Counter("rounds", "Decoding rounds", mm, namespace=ns, registry=r)
        self.accepted_length = Histogram(
            "accepted_length",
            "Draft tokens accepted per speculative round",
            mm,
            namespace=ns,
            registry=r,
            buckets=ACCEPTED_BUCKETS,
        )
        self.exit_layer = Histogram(
            "exit_layer",
            "Target layer at which early-exit tokens left",
            mm,
            namespace=ns,
            registry=r,
            buckets=EXIT_LAYER_BUCKETS,
        )
        self.token_latency = Histogram(
            "token_latency_seconds",
            "Per-token latency after the first token",
            mm,
            namespace=ns,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Prompt submitted to first token",
            mm,
            namespace=ns,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.mode_switches = Counter(
            "mode_switches",
            "Controller switches between speculative and plain decoding",
            (*mm, "to"),
            namespace=ns,
            registry=r,
        )
        self.k_changes = Counter(
            "k_changes", "Controller changes of K", mm, namespace=ns, registry=r
        )
        self.turns = Counter("turns", "Replies", (*mm, "outcome"), namespace=ns, registry=r)
        self.tokens_per_second = Gauge(
            "tokens_per_second", "Tokens per second of the last reply", mm, namespace=ns, registry=r
        )
        mn = ("model_name",)
        self.spec_drafts = Counter("specchat:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                   mn, registry=r)  # fmt: skip
        self.spec_draft_tokens = Counter("specchat:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                         mn, registry=r)  # fmt: skip
        self.spec_accepted = Counter("specchat:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                     mn, registry=r)  # fmt: skip
        self.spec_per_pos = Counter("specchat:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", (*mn, "position"),
                                    registry=r)  # fmt: skip
        self._streams: dict[tuple[str, str | None], _Stream] = {}
        self._lock = threading.Lock()

    # -- feeding ---------------------------------------------------------------

    def observe(self, event: object, *, model: str, mode: str | None = None) -> None:
        """Count one engine event. `mode` fixes the label; None takes it from the events."""
        with self._lock:
            st = self._streams.setdefault((model, mode), _Stream())
        if isinstance(event, TurnStarted):
            st.mode = event.mode.value
            st.pending.clear()
            st.last_emit = None
        elif isinstance(event, TokenEvent):
            st.pending.append(event)
        elif isinstance(event, RoundEvent):
            self._on_round(st, event, model, mode)
        elif isinstance(event, TurnFinished):
            label = mode or event.stats.mode.value
            server = event.stats.server
            if server is not None and server.draft_tokens is not None and server.accepted is not None:
                self._server_counts(model, label, server)
            self.turns.labels(model, label, event.stats.stop_reason).inc()
            self.tokens_per_second.labels(model, label).set(event.stats.tokens_per_s)
            if event.stats.tokens:
                self.ttft.labels(model, label).observe(event.stats.ttft_s)
            st.pending.clear()
        elif isinstance(event, Cancelled | Failed):
            label = mode or st.mode or "unknown"
            outcome = "cancelled" if isinstance(event, Cancelled) else "failed"
            self.turns.labels(model, label, outcome).inc()
            st.pending.clear()

    def _on_round(self, st: _Stream, ev: RoundEvent, model: str, mode: str | None) -> None:
        label = mode or ev.mode.value
        tokens, st.pending = st.pending, []
        self.rounds.labels(model, label).inc()
        for t in tokens:
            self.tokens.labels(model, label, t.provenance.value).inc()
            if t.exit_layer is not None:
                self.exit_layer.labels(model, label).observe(t.exit_layer)
        if ev.k > 0:
            accepted = min(ev.accepted, ev.k)
            self.drafted.labels(model, label).inc(ev.k)
            self.accepted.labels(model, label).inc(accepted)
            self.accepted_length.labels(model, label).observe(accepted)
            self.spec_drafts.labels(model).inc()
            self.spec_draft_tokens.labels(model).inc(ev.k)
            self.spec_accepted.labels(model).inc(accepted)
            for pos in range(accepted):
                self.spec_per_pos.labels(model, str(pos)).inc()
        spec_now, spec_next = ev.mode in _SPECULATIVE, ev.next_mode in _SPECULATIVE
        if ev.next_mode is not None and spec_now != spec_next:
            # The controller reports SPEC for any speculative run; name the run's own mode.
            to = (st.mode or ev.next_mode.value) if spec_next else Mode.PLAIN.value
            self.mode_switches.labels(model, label, to).inc()
        elif ev.next_k is not None and ev.k > 0 and ev.next_k != ev.k:
            self.k_changes.labels(model, label).inc()
        if tokens:
            emit = max(t.t for t in tokens)
            if st.last_emit is not None and emit > 0:
                per = max(0.0, emit - st.last_emit) / len(tokens)
                hist = self.token_latency.labels(model, label)
                for _ in tokens:
                    hist.observe(per)
            if emit > 0:
                st.last_emit = emit

    def _server_counts(self, model: str, label: str, server: ServerStats) -> None:
        """A served engine's reply: what it reported, in the same series."""
        assert server.draft_tokens is not None and server.accepted is not None
        self.drafted.labels(model, label).inc(server.draft_tokens)
        self.accepted.labels(model, label).inc(server.accepted)
        self.spec_draft_tokens.labels(model).inc(server.draft_tokens)
        self.spec_accepted.labels(model).inc(server.accepted)
        if server.drafts is not None:
            self.spec_drafts.labels(model).inc(server.drafts)
        for pos, n in enumerate(server.accepted_per_position):
            self.spec_per_pos.labels(model, str(pos)).inc(n)

    def observe_run(
        self,
        *,
        model: str,
        mode: str,
        tokens: int,
        ttft_s: float | None,
        latencies_s: Sequence[float],
        seconds: float | None = None,
    ) -> None:
        """A reply measured outside the event stream (the transformers baselines)."""
        self.tokens.labels(model, mode, "target").inc(tokens)
        if ttft_s is not None:
            self.ttft.labels(model, mode).observe(ttft_s)
        hist = self.token_latency.labels(model, mode)
        for v in latencies_s:
            hist.observe(v)
        self.turns.labels(model, mode, "finished").inc()
        if seconds:
            self.tokens_per_second.labels(model, mode).set(tokens / seconds)

    # -- serving -----------------------------------------------------------------

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on host:port in a daemon thread (port 0: an ephemeral port)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(host, int(server.server_port), server, thread)
