"""`RemoteSession`: a `ChatBackend` whose replies come from a served engine.

The chat streams through the OpenAI-compatible API with the `openai` client; what
the server says of its speculative decoding comes from its metrics endpoint
(scraped before the reply, every `scrape_interval` during it on a thread of its
own, and after it) and, for llama.cpp's server, from the per-request `timings` of
the stream's last chunk. The server's per-token provenance is not in these APIs,
so every token is `Provenance.REMOTE`; a round is one chunk of the stream.

Esc closes the stream (the server stops the request); a stream cut in the middle
keeps what came as the partial reply; every failure is a `Failed` with a hint.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import openai

from ..config import DecodeConfig, Mode
from ..errors import EngineError
from ..events import (
    Cancelled,
    Event,
    Failed,
    LoadProgress,
    ModelInfo,
    Provenance,
    Ready,
    RoundEvent,
    ServerStats,
    TokenEvent,
    TurnFinished,
    TurnStarted,
    TurnStats,
)
from .scrape import NAMES, MetricsEndpoint, ReplyWindow, Snapshot, reply_stats

KINDS = ("auto", "vllm", "sglang", "llama.cpp")
TOP_LOGPROBS = 5  # alternatives the inspector shows, where the server returns logprobs
_FINISH = {"stop": "eos", "length": "max_tokens", "content_filter": "stop_string"}


class RemoteError(EngineError):
    """The server could not be reached, refused the request, or broke the stream."""


@dataclass
class ServerInfo:
    """What `connect` learnt of the server."""

    url: str  # base URL, without /v1
    kind: str  # "vllm" | "sglang" | "llama.cpp" | "openai"
    model: str
    models: tuple[str, ...]
    speculative: bool | None  # None: the server does not say
    speculative_detail: str = ""  # "draft-simple", "eagle3 (3 tokens)", ...
    context_length: int = 0
    version: str = ""
    metrics: bool = False  # whether its metrics endpoint answered
    notes: list[str] = field(default_factory=list)


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise RemoteError(f"Not a server URL: {url}", "Give one like http://127.0.0.1:8080")
    return url.removesuffix("/v1")


def explain(exc: BaseException, url: str, *, model: str | None = None) -> RemoteError:
    """A message and a hint for what went wrong talking to the server at `url`."""
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return RemoteError(
            f"The server at {url} refused the request ({exc.status_code}): {_detail(exc)}",
            "Pass the API key through an environment variable: --api-key-env VAR",
        )
    if isinstance(exc, openai.NotFoundError):
        what = f"model {model!r}" if model else "the request"
        return RemoteError(f"The server at {url} does not know {what}: {_detail(exc)}",
                           "See the models it serves: curl " + url + "/v1/models")  # fmt: skip
    if isinstance(exc, openai.APITimeoutError):
        hint = "Check that it is up and not overloaded, then try again."
        if url.startswith("https://"):
            hint = "A server without TLS never answers an https:// client: try http://. " + hint
        return RemoteError(f"The server at {url} did not answer in time.", hint)
    if isinstance(exc, openai.APIConnectionError) or _transport(exc):
        cause = exc.__cause__ or exc.__context__ or exc
        text = f"{cause}"
        if "CERTIFICATE" in text.upper() or "SSL" in text.upper() or "TLS" in text.upper():
            return RemoteError(
                f"TLS with {url} failed: {text}",
                "Use http:// for a server without TLS, or point SSL_CERT_FILE at its CA certificate.",
            )
        return RemoteError(
            f"Cannot reach the server at {url}: {text or type(cause).__name__}",
            "Is it running, and is the URL right? e.g. curl " + url + "/v1/models",
        )
    if isinstance(exc, openai.APIStatusError):
        return RemoteError(f"The server at {url} answered {exc.status_code}: {_detail(exc)}",
                           "The conversation is kept; try again.")  # fmt: skip
    if isinstance(exc, openai.APIError):
        return RemoteError(f"The server at {url} sent something unexpected: {exc}",
                           "The conversation is kept; try again.")  # fmt: skip
    return RemoteError(f"Talking to {url} failed: {type(exc).__name__}: {exc}",
                       "The conversation is kept; try again.")  # fmt: skip


def _transport(exc: BaseException) -> bool:
    """An HTTP transport failure (refused, reset, cut mid-stream) from the HTTP library
    under the openai client (httpx, or its httpx2 fork), which raises its own types."""
    module = type(exc).__module__.split(".")[0]
    return module in ("httpx", "httpx2") and "Status" not in type(exc).__name__


def _detail(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(exc.message)


def _get_json(http: Any, path: str) -> dict[str, Any] | None:
    try:
        r = http.get(path, timeout=5.0)
    except Exception:  # noqa: BLE001 - a probe: any failure means "not this kind of server"
        return None
    if r.status_code != 200:
        return None
    try:
        data = r.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _get_list(http: Any, path: str) -> list[Any] | None:
    try:
        r = http.get(path, timeout=5.0)
        data = r.json() if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - a probe, as _get_json
        return None
    return data if isinstance(data, list) else None


def _sglang_info(http: Any) -> dict[str, Any] | None:
    """SGLang's server arguments (/server_info; /get_server_info before 0.5.10), which
    name its speculative algorithm; None where the server is not SGLang."""
    for path in ("/server_info", "/get_server_info"):
        info = _get_json(http, path)
        if info is not None and "speculative_algorithm" in info:
            return info
    return None


def _detect(http: Any, owned_by: str, kind: str, info: ServerInfo) -> str:
    """The kind of server (`kind` unless "auto"), and what it says of its speculation."""
    props = _get_json(http, "/props") if kind in ("auto", "llama.cpp") else None
    if kind == "auto":
        if owned_by == "llamacpp" or (props and "default_generation_settings" in props):
            kind = "llama.cpp"
        elif owned_by == "vllm":
            kind = "vllm"
        elif owned_by == "sglang":
            kind = "sglang"
        else:
            sg = _sglang_info(http)
            ver = _get_json(http, "/version")
            kind = "sglang" if sg else "vllm" if ver and "version" in ver else "openai"
    if kind == "llama.cpp":
        # /props lists the request defaults ("speculative.types": "none" even with a
        # draft model loaded); /slots says what each slot runs, unless started --no-slots
        settings = (props or {}).get("default_generation_settings") or {}
        info.context_length = int(settings.get("n_ctx") or 0)
        info.version = str((props or {}).get("build_info") or "")
        slots = _get_list(http, "/slots")
        if slots and isinstance(slots[0], dict) and "speculative" in slots[0]:
            slot = slots[0]
            info.speculative = bool(slot["speculative"])
            types = str((slot.get("params") or {}).get("speculative.types", "") or "")
            named = [t for t in types.split(",") if t and t != "none"]
            info.speculative_detail = ", ".join(named) or ("on" if info.speculative else "")
    elif kind == "sglang":
        sg = _sglang_info(http) or {}
        algo = sg.get("speculative_algorithm")
        if "speculative_algorithm" in sg:
            info.speculative = bool(algo) and str(algo).upper() != "NONE"
            if info.speculative:
                n = sg.get("speculative_num_draft_tokens")
                info.speculative_detail = f"{algo}" + (f" ({n} draft tokens)" if n else "")
        info.context_length = int(sg.get("context_length") or 0)
        info.version = str(sg.get("version") or "")
    elif kind == "vllm":
        ver = _get_json(http, "/version") or {}
        info.version = str(ver.get("version") or "")
    return kind


class RemoteSession:
    """A served engine as a `ChatBackend`. Make one with `connect`."""

    def __init__(
        self,
        client: openai.OpenAI,
        http: Any,
        info: ServerInfo,
        *,
        system_prompt: str | None = None,
        scrape_interval: float = 0.5,
        logprobs: bool = True,
    ) -> None:
        self.client = client
        self.http = http
        self.info = info
        self.system_prompt = system_prompt
        self.scrape_interval = scrape_interval
        self.logprobs = logprobs
        self.endpoint = MetricsEndpoint(http, info.kind, model=info.model) if info.kind in NAMES else None
        self._messages: list[tuple[str, str]] = []
        self._turn = 0
        self._cut = False  # the last reply stopped at the token limit
        self.ready = self._ready()

    # -- connecting ----------------------------------------------------------

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        kind: str = "auto",
        model: str | None = None,
        api_key_env: str | None = None,
        system_prompt: str | None = None,
        timeout: float = 30.0,
        progress: Callable[[LoadProgress], None] | None = None,
        scrape_interval: float = 0.5,
    ) -> RemoteSession:
        """Reach the server, pick its model, learn its kind and whether it speculates."""
        if kind not in KINDS:
            raise RemoteError(f"Unknown server kind {kind!r}", f"Use one of {', '.join(KINDS)}.")
        base = _base_url(url)
        key = "none"  # servers started without a key accept any; never send one unasked
        if api_key_env:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise RemoteError(f"The environment variable {api_key_env} is not set or empty.",
                                  f"Export the server's API key as {api_key_env}, or drop --api-key-env.")  # fmt: skip
        if progress:
            progress(LoadProgress("connect", 0, 1, detail=base))
        headers = {"Authorization": f"Bearer {key}"} if api_key_env else {}
        # the metrics and server-info GETs share the openai client's HTTP stack
        http = openai.DefaultHttpxClient(base_url=base, headers=headers, timeout=openai.Timeout(timeout, connect=5.0))
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0,
                               timeout=openai.Timeout(timeout, connect=5.0))  # fmt: skip
        try:
            listed = list(client.models.list())
        except Exception as exc:
            http.close()
            raise explain(exc, base) from None
        ids = tuple(m.id for m in listed)
        if not ids:
            http.close()
            raise RemoteError(f"The server at {base} serves no model.", "Start it with a model loaded.")
        if model is not None and model not in ids:
            http.close()
            raise RemoteError(f"The server at {base} does not serve {model!r}; it serves: {', '.join(ids)}.",
                              "Pass one of those with --model, or leave --model out.")  # fmt: skip
        chosen = model or ids[0]
        owned = next((str(getattr(m, "owned_by", "") or "") for m in listed if m.id == chosen), "")
        info = ServerInfo(url=base, kind="openai", model=chosen, models=ids, speculative=None)
        info.kind = _detect(http, owned, kind, info)
        session = cls(client, http, info, system_prompt=system_prompt, scrape_interval=scrape_interval)
        session._probe_metrics()
        session.ready = session._ready()
        if progress:
            progress(LoadProgress("connect", 1, 1, detail=base))
        return session

    def _probe_metrics(self) -> None:
        info = self.info
        if self.endpoint is None:
            info.notes.append(f"{info.kind} server: no metrics this client knows how to read")
            return
        snap = self.endpoint.snapshot()
        info.metrics = snap is not None
        if snap is None:
            hint = " (start llama-server with --metrics)" if info.kind == "llama.cpp" else ""
            info.notes.append(f"no metrics from {info.url}/metrics: {self.endpoint.error}{hint}")
            return
        if info.speculative is None and info.kind == "vllm":
            info.speculative = snap.speculative  # vLLM registers spec_decode_* only when it drafts
            if snap.speculative:
                info.speculative_detail = "speculative decoding on"
        if info.speculative is False:
            info.notes.append("the server decodes without speculation: no acceptance to show")

    def _ready(self) -> Ready:
        info = self.info
        spec = {True: f"speculative: {info.speculative_detail or 'on'}", False: "no speculative decoding",
                None: "speculation: the server does not say"}[info.speculative]  # fmt: skip
        name = info.model.rstrip("/").rsplit("/", 1)[-1]  # llama.cpp names a model by its path
        summary = f"{info.kind} server at {info.url} · {name} · {spec}"
        target = ModelInfo(
            role="target",
            name=name,
            source=info.url,
            device=f"remote ({info.kind})",
            dtype="n/a",
            quant="n/a",
            params=0,
            weight_bytes=0,
            kv_bytes_per_token=0,
            layers=0,
            context_length=info.context_length,
        )
        notes = list(info.notes)
        notes.append("tokens are 'remote': the server does not say which were drafted")
        if info.version:
            notes.append(f"server version: {info.version}")
        return Ready(summary=summary, target=target, notes=tuple(notes), server=f"{info.kind} {info.url}")

    def close(self) -> None:
        self.http.close()
        self.client.close()

    # -- ChatBackend ---------------------------------------------------------

    @property
    def messages(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._messages)

    @property
    def can_continue(self) -> bool:
        return self._cut and bool(self._messages) and self._messages[-1][0] == "assistant"

    def reset(self, history: Sequence[tuple[str, str]] = ()) -> None:
        """Start a new conversation (keeps the system prompt), holding `history`'s turns."""
        self._messages = list(history)
        self._cut = False

    def stream(
        self, prompt: str, config: DecodeConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        self._messages.append(("user", prompt))
        self._cut = False
        return self._reply(config, cancel, continuing=False)

    def regenerate(self, config: DecodeConfig, cancel: threading.Event | None = None) -> Iterator[Event]:
        while self._messages and self._messages[-1][0] == "assistant":
            self._messages.pop()
        if not self._messages:
            return iter([Failed("There is no message to answer again.", "Type a prompt first.")])
        self._cut = False
        return self._reply(config, cancel, continuing=False)

    def continue_reply(self, config: DecodeConfig, cancel: threading.Event | None = None) -> Iterator[Event]:
        if not self.can_continue:
            return iter([Failed("The last reply was not cut by the token limit.",
                                "Continue works on a reply that stopped at max tokens.")])  # fmt: skip
        return self._reply(config, cancel, continuing=True)

    # -- one reply -----------------------------------------------------------

    def _request(self, config: DecodeConfig, continuing: bool) -> dict[str, Any]:
        chat: list[dict[str, str]] = []
        if self.system_prompt:
            chat.append({"role": "system", "content": self.system_prompt})
        chat += [{"role": r, "content": c} for r, c in self._messages]
        extra: dict[str, Any] = {}
        if config.top_k:
            extra["top_k"] = config.top_k
        if continuing:
            extra.update(continue_final_message=True, add_generation_prompt=False)
        if self.info.kind == "llama.cpp":
            extra["timings_per_token"] = True  # the request's own draft counts in every chunk
        req: dict[str, Any] = dict(
            model=self.info.model,
            messages=chat,
            stream=True,
            max_tokens=config.max_new_tokens,
            temperature=config.temperature,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        if config.top_p is not None and config.top_p < 1.0:
            req["top_p"] = config.top_p
        if config.seed is not None:
            req["seed"] = config.seed
        if self.logprobs:
            req.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        return req

    def _reply(self, config: DecodeConfig, cancel: threading.Event | None, *, continuing: bool) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        self._turn += 1
        base_text = self._messages[-1][1] if continuing else ""
        submitted = time.perf_counter()
        window = ReplyWindow(before=self.endpoint.snapshot() if self.endpoint else None)
        yield TurnStarted(turn=self._turn, prompt_tokens=0, new_prompt_tokens=0, mode=Mode.REMOTE)
        samples: queue.SimpleQueue[Snapshot] = queue.SimpleQueue()
        done = threading.Event()
        stream: Any = None

        def watch() -> None:
            """Scrape at the panel rate; close the stream the moment Esc is pressed."""
            next_scrape = time.monotonic() + self.scrape_interval
            while not done.wait(0.05):
                if cancel.is_set() and stream is not None:  # before the stream: its first chunk stops
                    with contextlib.suppress(Exception):  # the reading side reports the close
                        stream.close()
                    return
                if self.endpoint is not None and time.monotonic() >= next_scrape:
                    snap = self.endpoint.snapshot()
                    if snap is not None:
                        samples.put(snap)
                    next_scrape = time.monotonic() + self.scrape_interval

        watcher = threading.Thread(target=watch, name="specchat-remote-watch", daemon=True)
        pieces: list[str] = []
        tokens = 0
        chunks = 0
        first_t: float | None = None
        last_t = submitted
        finish: str | None = None
        usage_tokens: int | None = None
        timings: tuple[int, int] | None = None
        failure: RemoteError | None = None
        next_live = submitted  # the next live ServerStats from the request's timings
        watcher.start()
        try:
            stream = self.client.chat.completions.create(**self._request(config, continuing))
            for chunk in stream:
                if cancel.is_set():
                    break
                now = time.perf_counter()
                extra = chunk.model_extra or {}
                t = extra.get("timings")
                if isinstance(t, dict) and "draft_n" in t:
                    seen = (int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0))
                    if seen != timings and now >= next_live:
                        next_live = now + self.scrape_interval
                        yield reply_stats(self.info.kind, window, streamed_tokens=tokens,
                                          speculative=self.info.speculative, timings=seen)  # fmt: skip
                    timings = seen
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.finish_reason:
                        finish = choice.finish_reason
                    text = choice.delta.content if choice.delta is not None else None
                    if not text:
                        continue
                    events = _token_events(text, choice.logprobs, chunks, now)
                    yield from events
                    tokens += len(events)
                    pieces.append(text)
                    if first_t is None:
                        first_t = now
                    yield RoundEvent(chunks, Mode.REMOTE, 0, 0, 0.0, (now - last_t) * 1000.0)
                    chunks += 1
                    last_t = now
                while not samples.empty():
                    window.add(samples.get())
                    yield reply_stats(self.info.kind, window, streamed_tokens=tokens,
                                      speculative=self.info.speculative, timings=timings)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every failure becomes a Failed with a hint
            if not cancel.is_set():
                failure = explain(exc, self.info.url, model=self.info.model)
        finally:
            done.set()
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        text = "".join(pieces)
        if text or continuing:
            self._keep(base_text + text, continuing)
        elif failure is not None:
            self._messages.pop()  # nothing came: the chat puts the prompt back in the input
        else:
            self._keep("", continuing)  # cancelled before the first token: the turns still alternate
        if self.endpoint is not None:
            snap = self.endpoint.snapshot()
            if snap is not None:
                window.add(snap)
        count = usage_tokens if usage_tokens is not None and not cancel.is_set() else tokens
        server = reply_stats(self.info.kind, window, streamed_tokens=count,
                             speculative=self.info.speculative, final=True, timings=timings)  # fmt: skip
        yield server
        if cancel.is_set():
            yield Cancelled(tokens, base_text + text)
            return
        if failure is not None:
            kept = f" The {tokens} tokens that came before are kept." if tokens else ""
            yield Failed(failure.message + kept, failure.hint)
            return
        stop = _FINISH.get(finish or "", "eos")
        self._cut = stop == "max_tokens"
        seconds = time.perf_counter() - submitted
        rate = server.acceptance_rate
        yield TurnFinished(
            TurnStats(
                tokens=count,
                seconds=seconds,
                tokens_per_s=count / seconds if seconds > 0 else 0.0,
                ttft_s=(first_t - submitted) if first_t is not None else seconds,
                rounds=chunks,
                drafted=server.draft_tokens or 0,
                accepted=server.accepted or 0,
                acceptance_rate=rate,
                mean_accepted_length=server.mean_accepted_length,
                mode=Mode.REMOTE,
                optimizations=(f"{self.info.kind}: {self.info.speculative_detail}",) if self.info.speculative else (),
                fallbacks=(),
                stop_reason=stop,
                text=base_text + text,
                server=server,
            )
        )

    def _keep(self, reply: str, continuing: bool) -> None:
        if continuing and self._messages and self._messages[-1][0] == "assistant":
            self._messages[-1] = ("assistant", reply)
        else:
            self._messages.append(("assistant", reply))


def _token_events(text: str, logprobs: Any, round_no: int, t: float) -> list[TokenEvent]:
    """The chunk's tokens: one per logprob entry when they spell the chunk's text,
    else one for the whole chunk (with the first entry's figures)."""
    entries = list(getattr(logprobs, "content", None) or [])
    if len(entries) > 1 and "".join(e.token for e in entries) == text:
        return [_token(e.token, e, round_no, t) for e in entries]
    return [_token(text, entries[0] if entries else None, round_no, t)]


def _token(text: str, entry: Any, round_no: int, t: float) -> TokenEvent:
    p = alts = None
    token_id = -1
    if entry is not None:
        p = _prob(entry.logprob)
        alts = tuple((a.token, _prob(a.logprob) or 0.0) for a in (entry.top_logprobs or ()))
        given = (getattr(entry, "model_extra", None) or {}).get("id")  # llama.cpp sends the id
        if isinstance(given, int) and given >= 0:
            token_id = given
    return TokenEvent(token_id, text, Provenance.REMOTE, round_no, p_target=p, t=t, alternatives=alts or ())


def _prob(logprob: float | None) -> float | None:
    if logprob is None or not math.isfinite(logprob):
        return None
    return math.exp(logprob)


__all__ = ["KINDS", "RemoteError", "RemoteSession", "ServerInfo", "ServerStats", "explain"]
