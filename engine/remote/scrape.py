"""A served engine's speculative-decoding figures, from its Prometheus metrics endpoint.

Each kind of server names the same counters differently (`NAMES`, with the source
file and version each name was read from). A `Snapshot` is one scrape reduced to
those figures; `reply_stats` turns the snapshots taken before, during and after a
reply into the reply's `ServerStats`: the growth of each counter, marked
"server-wide" when other requests ran meanwhile (a running-requests gauge above
one at any sample, or more tokens generated than the reply streamed).

The exposition text is parsed by prometheus_client's parser; the GETs go through the
openai client's HTTP stack (`openai.DefaultHttpxClient`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ..events import ServerStats


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Sample names (as exposed, counters with their `_total`) of one kind of server.
    A tuple lists alternatives, newest first: the first one present is read."""

    drafts: tuple[str, ...] = ()
    draft_tokens: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    per_position: tuple[str, ...] = ()
    position_label: str = "position"
    accept_length: tuple[str, ...] = ()  # a gauge: the server's own mean accepted length
    accept_rate: tuple[str, ...] = ()  # a gauge: the server's own acceptance rate
    kv_usage: tuple[str, ...] = ()  # a gauge in 0..1
    running: tuple[str, ...] = ()
    generated: tuple[str, ...] = ()
    source: str = ""  # where the names come from


NAMES: dict[str, MetricNames] = {
    # llama.cpp tools/server/server-task.cpp (the tree llama-cpp-python 0.3.36 vendors),
    # served at /metrics when the server runs with --metrics. Counters grow when a
    # request ends; the request's own counts come live in its `timings`.
    "llama.cpp": MetricNames(
        drafts=("llamacpp:spec_decode_num_drafts_total",),
        draft_tokens=("llamacpp:spec_decode_num_draft_tokens_total",),
        accepted=("llamacpp:spec_decode_num_accepted_tokens_total",),
        per_position=("llamacpp:spec_decode_num_accepted_tokens_per_pos_total",),
        running=("llamacpp:requests_processing",),
        generated=("llamacpp:tokens_predicted_total",),
        source="llama.cpp tools/server/server-task.cpp (llama-cpp-python 0.3.36)",
    ),
    # vLLM 0.33.0 (also 0.10.2-0.12.0, same names): vllm/v1/spec_decode/metrics.py
    # (SpecDecodingProm: registered only with a speculative_config) and
    # vllm/v1/metrics/loggers.py. kv_cache_usage_perc is 0..1; gpu_cache_usage_perc is
    # its name before 0.11 (removed in 0.12). Labels: model_name, engine.
    "vllm": MetricNames(
        drafts=("vllm:spec_decode_num_drafts_total",),
        draft_tokens=("vllm:spec_decode_num_draft_tokens_total",),
        accepted=("vllm:spec_decode_num_accepted_tokens_total",),
        per_position=("vllm:spec_decode_num_accepted_tokens_per_pos_total",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        running=("vllm:num_requests_running",),
        generated=("vllm:generation_tokens_total",),
        source="vllm 0.33.0 vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py",
    ),
    # SGLang 0.5.23: python/sglang/srt/observability/metrics_collector.py (before 0.5.10:
    # python/sglang/srt/metrics/collector.py). No draft or accepted-token counters: the
    # verify calls (a counter, grown as a request ends) and the generated tokens give
    # the accepted length; spec_accept_length / spec_accept_rate are gauges over the
    # last log interval (0 when speculation is off). token_usage is 0..1.
    "sglang": MetricNames(
        drafts=("sglang:spec_verify_calls_total",),
        accept_length=("sglang:spec_accept_length",),
        accept_rate=("sglang:spec_accept_rate",),
        kv_usage=("sglang:token_usage",),
        running=("sglang:num_running_reqs",),
        generated=("sglang:generation_tokens_total",),
        source="sglang 0.5.23 python/sglang/srt/observability/metrics_collector.py",
    ),
}

# How each figure's series (one per label set: engine, tp_rank, pid, ...) combine:
# counters and request counts add up; a usage share is the fullest; a rate or length
# is the mean of the series that report one (a value of 0 means "none this interval").
_MEAN = frozenset({"accept_length", "accept_rate"})
_MAX = frozenset({"kv_usage"})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One scrape: each figure summed over its label sets; None where not exposed."""

    t: float
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    per_position: tuple[float, ...] = ()
    accept_length: float | None = None
    accept_rate: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    generated: float | None = None

    @property
    def speculative(self) -> bool:
        """Whether the server exposes speculative-decoding figures at all."""
        return self.drafts is not None or bool(self.accept_length)


def parse(text: str, kind: str, *, model: str | None = None, t: float | None = None) -> Snapshot:
    """Reduce an exposition text to a Snapshot, reading the names of `kind`.

    With `model`, samples labelled with another `model_name` are left out (a server
    that serves several models labels each); unlabelled samples always count.
    """
    names = NAMES[kind]
    fields = {n: f for f, group in _fields(names) for n in group}
    series: dict[str, list[float]] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name not in fields or not math.isfinite(sample.value):
                continue
            label = sample.labels.get("model_name")
            if model is not None and label is not None and label != model:
                continue
            if fields[name] == "per_position":
                try:
                    pos = int(sample.labels.get(names.position_label, ""))
                except ValueError:
                    continue
                positions[pos] = positions.get(pos, 0.0) + sample.value
            else:
                series.setdefault(name, []).append(sample.value)

    def read(field: str, group: tuple[str, ...]) -> float | None:
        name = next((n for n in group if n in series), None)
        if name is None:
            return None
        values = series[name]
        if field in _MEAN:
            given = [v for v in values if v > 0]
            return sum(given) / len(given) if given else 0.0
        return max(values) if field in _MAX else sum(values)

    got = {f: read(f, group) for f, group in _fields(names) if f != "per_position"}
    per_pos = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return Snapshot(t=time.monotonic() if t is None else t, per_position=per_pos, **got)


def _fields(names: MetricNames) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((f, getattr(names, f)) for f in _FIELDS)


_FIELDS = ("drafts", "draft_tokens", "accepted", "per_position", "accept_length", "accept_rate",
           "kv_usage", "running", "generated")  # fmt: skip


def _grew(before: float | None, after: float | None) -> int | None:
    if after is None:
        return None
    # a counter that fell means the server restarted: count from zero
    base = before if before is not None and before <= after else 0.0
    return int(round(after - base))


@dataclass
class ReplyWindow:
    """The snapshots of one reply: the one before it, and each since."""

    before: Snapshot | None
    latest: Snapshot | None = None
    busiest: float = 0.0  # the most requests seen running at once
    samples: int = 0
    extra: list[str] = field(default_factory=list)

    def add(self, snap: Snapshot) -> None:
        self.latest = snap
        self.samples += 1
        if snap.running is not None:
            self.busiest = max(self.busiest, snap.running)


def reply_stats(
    kind: str,
    window: ReplyWindow,
    *,
    streamed_tokens: int,
    speculative: bool | None,
    final: bool = False,
    timings: tuple[int, int] | None = None,
) -> ServerStats:
    """The reply's ServerStats from its window of snapshots.

    `timings` (draft tokens, accepted), where the server reported them for this
    request (llama.cpp's `timings`), count as the reply's own figures whatever else ran;
    the number of drafts and the per-position counts still come from the metrics, and
    only while the server ran nothing else.
    """
    before, after = window.before, window.latest
    busy = window.busiest > 1
    drafts = draft_tokens = accepted = None
    per_pos: Sequence[int] = ()
    accept_length = accept_rate = kv = running = None
    if after is not None:
        b = before or Snapshot(t=after.t)
        drafts = _grew(b.drafts, after.drafts)
        draft_tokens = _grew(b.draft_tokens, after.draft_tokens)
        accepted = _grew(b.accepted, after.accepted)
        if after.per_position:
            old = b.per_position + (0.0,) * (len(after.per_position) - len(b.per_position))
            per_pos = tuple(max(0, int(round(a - o))) for a, o in zip(after.per_position, old, strict=False))
            while per_pos and per_pos[-1] == 0:
                per_pos = per_pos[:-1]
        generated = _grew(b.generated, after.generated)
        # streamed chunks can merge tokens, and a server counts the stop token: allow a little
        if generated is not None and generated > streamed_tokens * 1.1 + 8:
            busy = True
        if accepted is None and drafts and generated is not None and generated >= drafts:
            accepted = generated - drafts  # each verify call emits its accepted drafts plus one
        accept_length, kv, running = after.accept_length, after.kv_usage, after.running
        accept_rate = after.accept_rate
    scope = "server-wide" if busy else "reply"
    source = "metrics" if after is not None else "none"
    if timings is not None:
        draft_tokens, accepted = timings
        source, scope = "timings", "reply"
        if busy:
            drafts, per_pos = None, ()  # the metrics' share of this reply is unknown
    return ServerStats(
        kind=kind,
        source=source,
        scope=scope,
        speculative=speculative,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted=accepted,
        accepted_per_position=tuple(per_pos),
        accept_length=accept_length or None,
        accept_rate=accept_rate or None,
        kv_cache_usage=kv,
        running=None if running is None else int(running),
        final=final,
        t=time.perf_counter(),
    )


class MetricsEndpoint:
    """GETs a server's /metrics; `snapshot()` is None when it has none or it failed."""

    def __init__(self, http: Any, kind: str, *, model: str | None = None,
                 path: str = "/metrics") -> None:  # fmt: skip
        self.http = http
        self.kind = kind
        self.model = model
        self.path = path
        self.error: str | None = None  # why the last scrape gave nothing

    def snapshot(self) -> Snapshot | None:
        try:
            r = self.http.get(self.path, timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - a scrape that fails gives no figures, and says why
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        if r.status_code != 200:
            self.error = f"HTTP {r.status_code} from {self.path}"
            return None
        try:
            snap = parse(r.text, self.kind, model=self.model)
        except ValueError as exc:  # not the Prometheus text format
            self.error = f"{self.path} is not Prometheus text: {exc}"
            return None
        self.error = None
        return snap
