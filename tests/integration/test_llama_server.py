"""The chat against a real llama.cpp server doing speculative decoding.

llama-server is built from the llama-cpp-python sdist on this machine (tests/llamacpp.py:
once per machine and instruction set, 5-8 minutes on 2 cores, a progress line on the
terminal) and serves the default pair's own GGUF files, the 0.5B as its draft. The tests
skip, saying why, only where the build cannot run here (no compiler, cmake or ninja) or
the GGUF files cannot be fetched.

What is checked against the real server: streaming, Esc cancelling mid-reply (the
server's slot stops), the live and final acceptance in the panel, those figures against
the server's own metrics counters, and each failure's message (unreachable, TLS, API key,
unknown model, no speculation, a stream cut when the server dies).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.errors import FetchError
from specchat.engine.events import (
    Cancelled,
    Failed,
    Provenance,
    RoundEvent,
    ServerStats,
    TokenEvent,
    TurnFinished,
)
from specchat.engine.remote.scrape import parse
from specchat.engine.remote.session import RemoteError, RemoteSession
from tests import llamacpp

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function is_prime(n) with a docstring."
GREEDY = DecodeConfig(temperature=0.0, max_new_tokens=48)


@pytest.fixture(scope="module")
def binary() -> Path:
    missing = [t for t in ("c++", "cmake", "ninja") if shutil.which(t) is None
               and shutil.which(t, path=str(Path(sys.executable).parent)) is None]  # fmt: skip
    if missing:
        pytest.skip(f"llama-server cannot be built here: {', '.join(missing)} not installed")
    return llamacpp.server_binary()


@pytest.fixture(scope="module")
def ggufs(binary: Path) -> tuple[Path, Path]:
    try:
        return llamacpp.default_pair_ggufs()
    except FetchError as exc:
        pytest.skip(f"the default pair's GGUF files cannot be fetched: {exc.message}")


@pytest.fixture(scope="module")
def spec_server(ggufs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[llamacpp.Server]:
    target, draft = ggufs
    log = tmp_path_factory.mktemp("llama") / "spec.log"
    with llamacpp.serve(target, draft, log=log) as server:
        yield server


def drain(events: Iterator[Any]) -> list[Any]:
    return list(events)


def metrics(url: str) -> Any:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return parse(r.read().decode(), "llama.cpp")


def slot_busy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/slots", timeout=5) as r:
        return any(s.get("is_processing") for s in json.loads(r.read()))


def test_connect_learns_the_kind_and_that_it_speculates(spec_server: llamacpp.Server) -> None:
    session = RemoteSession.connect(spec_server.url)
    info = session.info
    assert info.kind == "llama.cpp"
    assert info.speculative is True  # from /slots: /props lists "none" with a draft loaded
    assert info.metrics and info.context_length == 4096
    assert session.ready.server == f"llama.cpp {spec_server.url}"
    assert "speculative: " in session.ready.summary


def test_a_reply_streams_and_its_figures_match_the_server_s_counters(spec_server: llamacpp.Server) -> None:
    session = RemoteSession.connect(spec_server.url)
    before = metrics(spec_server.url)
    events = drain(session.stream(PROMPT, GREEDY))
    after = metrics(spec_server.url)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    end = events[-1]
    assert isinstance(end, TurnFinished), end
    stats = end.stats
    assert stats.mode is Mode.REMOTE and stats.stop_reason == "max_tokens"
    assert {t.provenance for t in tokens} == {Provenance.REMOTE}
    assert "".join(t.text for t in tokens) == stats.text
    assert stats.tokens == 48
    assert session.messages[-1] == ("assistant", stats.text)
    # rounds are the stream's chunks: each follows its tokens
    assert sum(isinstance(e, RoundEvent) for e in events) == stats.rounds > 0
    server = stats.server
    assert server is not None and server.final and server.source == "timings"
    assert server.scope == "reply"  # nothing else ran
    assert server.draft_tokens and 0 < server.accepted <= server.draft_tokens  # type: ignore[operator]
    # the request's timings agree with the server's own counters over the same reply
    assert server.draft_tokens == after.draft_tokens - before.draft_tokens
    assert server.accepted == after.accepted - before.accepted
    assert server.drafts == after.drafts - before.drafts
    # every verify step emits its accepted drafts plus one token of the target's
    assert server.drafts + server.accepted >= stats.tokens - 1
    assert stats.acceptance_rate == pytest.approx(server.accepted / server.draft_tokens)
    # llama.cpp sends logprobs for the tokens it sampled itself, with their ids
    probed = [t for t in tokens if t.p_target is not None]
    assert probed and all(t.token_id >= 0 and t.alternatives for t in probed)


def test_live_figures_arrive_during_the_reply(spec_server: llamacpp.Server) -> None:
    session = RemoteSession.connect(spec_server.url, scrape_interval=0.2)
    events = drain(session.stream("Explain what a Python generator is, in detail.", DecodeConfig(max_new_tokens=96)))
    live = [e for e in events if isinstance(e, ServerStats) and not e.final]
    assert live, "no ServerStats before the reply ended"
    assert any(e.source == "timings" and e.draft_tokens for e in live)
    first_live = events.index(live[0])
    assert any(isinstance(e, TokenEvent) for e in events[first_live + 1 :])


def test_cancel_stops_the_server_and_keeps_the_partial_reply(spec_server: llamacpp.Server) -> None:
    session = RemoteSession.connect(spec_server.url)
    cancel = threading.Event()
    seen = 0
    events: list[Any] = []
    for ev in session.stream("Write a long essay on the history of computing.", DecodeConfig(max_new_tokens=1000), cancel):
        events.append(ev)
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 12:
                cancel.set()
    end = events[-1]
    assert isinstance(end, Cancelled), end
    assert end.tokens >= 12 and end.text
    assert session.messages[-1] == ("assistant", end.text)
    deadline = time.monotonic() + 5
    while slot_busy(spec_server.url):
        assert time.monotonic() < deadline, "the server kept decoding after the stream closed"
        time.sleep(0.1)
    # the conversation goes on
    nxt = drain(session.stream("Say hello.", DecodeConfig(max_new_tokens=8)))
    assert isinstance(nxt[-1], TurnFinished)
    assert [r for r, _ in session.messages] == ["user", "assistant", "user", "assistant"]


def test_continue_a_cut_reply(spec_server: llamacpp.Server) -> None:
    session = RemoteSession.connect(spec_server.url)
    first = drain(session.stream(PROMPT, DecodeConfig(max_new_tokens=16)))
    assert isinstance(first[-1], TurnFinished) and session.can_continue
    more = drain(session.continue_reply(DecodeConfig(max_new_tokens=16)))
    end = more[-1]
    assert isinstance(end, TurnFinished), end
    assert end.stats.text.startswith(first[-1].stats.text) and len(end.stats.text) > len(first[-1].stats.text)
    assert session.messages[-1] == ("assistant", end.stats.text)
    assert [r for r, _ in session.messages] == ["user", "assistant"]


def test_the_chat_shows_the_server_s_acceptance_and_esc_cancels(spec_server: llamacpp.Server) -> None:
    from specchat.tui.app import SpecChatApp
    from specchat.tui.panels import AcceptancePanel
    from specchat.tui.widgets.legend import Legend
    from specchat.tui.widgets.reply import ReplyView

    session = RemoteSession.connect(spec_server.url, scrape_interval=0.2)
    app = SpecChatApp(lambda progress: session, sample_system=False)

    async def until(pilot: Any, cond: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not reached in time"
            await pilot.pause(0.05)

    async def run() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: app.backend is not None)
            assert app.query_one(Legend).remote
            await pilot.press(*"Write a haiku about speculative decoding.")
            await pilot.press("enter")
            await until(pilot, lambda: app._busy is None)
            reply = list(app.query(ReplyView))[-1]
            assert isinstance(reply.outcome, TurnFinished)
            app._refresh_panels()
            await pilot.pause()
            shown = _plain(app.query_one(AcceptancePanel).render())
            assert "llama.cpp" in shown and "this reply" in shown and "%" in shown, shown
            server = reply.outcome.stats.server
            assert server is not None and f"{server.accepted}/{server.draft_tokens}" in shown
            # Esc mid-reply
            await pilot.press(*"Write a long essay on the history of computing.")
            await pilot.press("enter")
            await until(pilot, lambda: len(list(app.query(ReplyView))) == 2 and list(app.query(ReplyView))[-1].tokens)
            await pilot.press("escape")
            await until(pilot, lambda: app._busy is None, timeout=10)
            last = list(app.query(ReplyView))[-1]
            assert isinstance(last.outcome, Cancelled)

    asyncio.run(run())


def _plain(renderable: Any) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=60, color_system=None).print(renderable)
    return out.getvalue()


def test_generate_json_carries_the_server_s_figures(spec_server: llamacpp.Server) -> None:
    cmd = [sys.executable, "-m", "specchat.tui.cli", "generate", "--server", spec_server.url,
           "--prompt", "Say hello in French.", "--max-new-tokens", "12", "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0]["type"] == "LoadProgress" and any(d["type"] == "Ready" for d in lines)
    fin = lines[-1]
    assert fin["type"] == "TurnFinished" and fin["stats"]["mode"] == "remote"
    assert fin["stats"]["server"]["kind"] == "llama.cpp" and fin["stats"]["server"]["source"] == "timings"


# -- failures, each with its message -------------------------------------------------


def test_unreachable_server() -> None:
    port = llamacpp.free_port()
    with pytest.raises(RemoteError) as err:
        RemoteSession.connect(f"http://127.0.0.1:{port}")
    assert f"Cannot reach the server at http://127.0.0.1:{port}" in err.value.message
    assert "Is it running" in err.value.hint


def test_tls_failure() -> None:
    """A real TLS server whose certificate (self-signed, tests/fixtures) nothing trusts."""
    import http.server
    import ssl

    fixtures = Path(__file__).parent.parent / "fixtures"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(fixtures / "selfsigned.crt", fixtures / "selfsigned.key")
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    worker = threading.Thread(target=httpd.serve_forever, daemon=True)
    worker.start()
    try:
        url = f"https://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(RemoteError) as err:
            RemoteSession.connect(url)
        assert err.value.message.startswith(f"TLS with {url} failed"), err.value.message
        assert "CERTIFICATE_VERIFY_FAILED" in err.value.message
        assert "SSL_CERT_FILE" in err.value.hint
    finally:
        httpd.shutdown()


def test_unknown_model(spec_server: llamacpp.Server) -> None:
    with pytest.raises(RemoteError) as err:
        RemoteSession.connect(spec_server.url, model="no-such-model")
    assert "does not serve 'no-such-model'; it serves: " in err.value.message
    assert "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" in err.value.message


def test_not_a_url() -> None:
    with pytest.raises(RemoteError) as err:
        RemoteSession.connect("ftp://example")
    assert "Not a server URL" in err.value.message


def test_api_key(ggufs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, small = ggufs
    with llamacpp.serve(small, extra=("--api-key", "s3cret"), log=tmp_path / "key.log") as server:
        with pytest.raises(RemoteError) as err:
            RemoteSession.connect(server.url)
        assert "refused the request (401)" in err.value.message
        assert "--api-key-env" in err.value.hint
        with pytest.raises(RemoteError) as unset:
            RemoteSession.connect(server.url, api_key_env="SPECCHAT_TEST_KEY")
        assert "SPECCHAT_TEST_KEY is not set" in unset.value.message
        monkeypatch.setenv("SPECCHAT_TEST_KEY", "s3cret")
        session = RemoteSession.connect(server.url, api_key_env="SPECCHAT_TEST_KEY")
        assert isinstance(drain(session.stream("Hi.", DecodeConfig(max_new_tokens=4)))[-1], TurnFinished)


def test_a_server_without_speculation_says_so_and_still_chats(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    _, small = ggufs
    with llamacpp.serve(small, log=tmp_path / "plain.log") as server:
        session = RemoteSession.connect(server.url)
        assert session.info.speculative is False
        assert "no speculative decoding" in session.ready.summary
        assert any("without speculation" in n for n in session.ready.notes)
        events = drain(session.stream("Hi.", DecodeConfig(max_new_tokens=8)))
        end = events[-1]
        assert isinstance(end, TurnFinished), end
        assert end.stats.server is not None and end.stats.server.speculative is False
        assert end.stats.acceptance_rate is None


def test_a_stream_cut_by_the_server_dying_keeps_the_partial_reply(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    _, small = ggufs
    with llamacpp.serve(small, log=tmp_path / "cut.log") as server:
        session = RemoteSession.connect(server.url)
        events: list[Any] = []
        seen = 0
        for ev in session.stream("Write a long essay on the history of computing.", DecodeConfig(max_new_tokens=1000)):
            events.append(ev)
            if isinstance(ev, TokenEvent):
                seen += 1
                if seen == 10:
                    server.process.kill()
        end = events[-1]
        assert isinstance(end, Failed), end
        assert "came before are kept" in end.message, end.message
        role, text = session.messages[-1]
        assert role == "assistant" and text
        # the server is gone: the next prompt fails before any token and leaves no dangling turn
        kept = session.messages
        again = drain(session.stream("Are you there?", DecodeConfig(max_new_tokens=8)))
        assert isinstance(again[-1], Failed) and "Cannot reach the server" in again[-1].message
        assert session.messages == kept


def test_the_chat_exports_the_server_s_figures_with_metrics_port(spec_server: llamacpp.Server) -> None:
    """`specchat --server URL --metrics-port N`: the chat's own endpoint carries what the
    served engine reported, in vLLM's spec_decode_* shape."""
    from specchat.tui.cli import build_parser
    from specchat.tui.commands import chat
    from specchat.tui.widgets.reply import ReplyView

    port = llamacpp.free_port()
    args = build_parser().parse_args(["chat", "--server", spec_server.url, "--metrics-port", str(port)])
    app = chat.build_app(args)
    assert not isinstance(app, int)

    async def run() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            deadline = time.monotonic() + 30
            while app.backend is None:
                assert time.monotonic() < deadline
                await pilot.pause(0.05)
            assert any(f"127.0.0.1:{port}/metrics" in n for n in app.backend.ready.notes)
            await pilot.press(*"Write a Python function that adds two numbers.")
            await pilot.press("enter")
            deadline = time.monotonic() + 60
            while app._busy is not None or not list(app.query(ReplyView)):
                assert time.monotonic() < deadline
                await pilot.pause(0.05)
            reply = list(app.query(ReplyView))[-1]
            assert isinstance(reply.outcome, TurnFinished)
            server = reply.outcome.stats.server
            assert server is not None and server.draft_tokens
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            snap = parse(text.replace("specchat:", "vllm:"), "vllm")
            assert (snap.draft_tokens, snap.accepted) == (server.draft_tokens, server.accepted)

    asyncio.run(run())


def test_bench_puts_the_server_in_the_same_interleaved_table(spec_server: llamacpp.Server) -> None:
    """`specchat bench --server URL`: the server arm runs between the local arms (a tiny
    local pair here: the interleaving and the figures are under test, not its speed)."""
    from specchat.engine.decode.session import ChatSession
    from specchat.engine.tools.bench import BenchPrompt, run_bench
    from specchat.engine.weights.loading import layer_truncated
    from tests.tinymodels import loaded, tiny_llama

    target = tiny_llama(seed=0, layers=4)
    local = ChatSession(loaded(target), loaded(layer_truncated(target, 2), "draft"))  # type: ignore[arg-type]
    remote = RemoteSession.connect(spec_server.url)
    prompts = [BenchPrompt("p0", "code", "Write a Python function that adds two numbers."),
               BenchPrompt("p1", "chat", "Name three colours.", history=(("user", "Hi."), ("assistant", "Hello!")))]  # fmt: skip
    result = run_bench(local, prompts, arms=("plain",), baselines=False, max_new_tokens=24,
                       warmup=False, remote=remote)  # fmt: skip
    assert result.arms == ["plain", "server"]
    served = [r for r in result.records if r.arm == "server"]
    assert [r.prompt_id for r in served] == ["p0", "p1"] and all(r.ok for r in served)
    assert [r.arm for r in result.records] == ["plain", "server", "server", "plain"]  # rotated
    for r in served:
        assert r.server is not None and r.server["source"] == "timings" and r.server["draft_tokens"]
        assert r.text and 0 < r.n_tokens <= 24 and r.ttft_s is not None
    s = result.summary["server"]
    drafted = sum(r.server["draft_tokens"] for r in served)  # type: ignore[index]
    accepted = sum(r.server["accepted"] for r in served)  # type: ignore[index]
    assert s["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert s["mean_accepted_length"] > 1 and s["tokens_per_target_pass"] is None
    assert s["same_tokens_as_plain"] == {"equal": 0, "compared": 2}  # by text: the tiny model says other things
    assert result.config["server"] == {"server": remote.ready.summary}
    # the server's conversation was the prompt's: earlier turns, then the prompt
    assert remote.messages[:3] == (("user", "Hi."), ("assistant", "Hello!"), ("user", "Name three colours."))
