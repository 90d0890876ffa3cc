"""The Prometheus endpoint: series from synthetic events, then a real scrape on loopback."""

from __future__ import annotations

import dataclasses
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specchat.engine.config import DecodeConfig, Mode, QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import (
    Provenance,
    RoundEvent,
    TokenEvent,
    TurnFinished,
    TurnStarted,
    TurnStats,
)
from specchat.engine.tools.telemetry import Telemetry
from specchat.engine.weights.loading import LoadedModel, describe, layer_truncated
from tests.stories import STORIES, load_stories, needs_stories


def value(t: Telemetry, name: str, **labels: str) -> float:
    v = t.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def spec_round(t: Telemetry, rnd: int, k: int, acc: int, at: float, **kw: object) -> None:
    for pos in range(acc):
        t.observe(TokenEvent(7, "a", Provenance.ACCEPTED, rnd, pos, t=at), model="m", mode=None)
    prov = Provenance.BONUS if acc == k else Provenance.CORRECTED
    t.observe(TokenEvent(8, "b", prov, rnd, acc, t=at), model="m")
    t.observe(RoundEvent(rnd, Mode.SPEC, k, acc, 4.0, 10.0, **kw), model="m")  # type: ignore[arg-type]


def stats(tokens: int, mode: Mode = Mode.SPEC) -> TurnStats:
    return TurnStats(tokens, 1.0, float(tokens), 0.25, 3, 8, 5, 0.6, 2.5, mode, (), (), "eos", "")


def test_counters_and_histograms_from_synthetic_events() -> None:
    t = Telemetry()
    t.observe(TurnStarted(1, 10, 10, Mode.SPEC), model="m")
    spec_round(t, 1, 4, 4, at=1.00, next_mode=Mode.SPEC, next_k=4)  # 5 tokens
    spec_round(t, 2, 4, 1, at=1.10, next_mode=Mode.SPEC, next_k=2)  # 2 tokens, K 4 -> 2
    spec_round(t, 3, 2, 0, at=1.30, next_mode=Mode.PLAIN, next_k=2)  # 1 token, fall back
    t.observe(TokenEvent(9, "c", Provenance.TARGET, 4, t=1.34), model="m")
    t.observe(RoundEvent(4, Mode.PLAIN, 0, 0, 0.0, 30.0, next_mode=Mode.PLAIN), model="m")
    t.observe(TurnFinished(stats(9)), model="m")

    spec = {"model": "m", "mode": "spec"}
    assert value(t, "specchat_drafted_tokens_total", **spec) == 10
    assert value(t, "specchat_accepted_tokens_total", **spec) == 5
    assert value(t, "specchat_rounds_total", **spec) == 3
    assert value(t, "specchat_rounds_total", model="m", mode="plain") == 1
    assert value(t, "specchat_tokens_total", **spec, provenance="accepted") == 5
    assert value(t, "specchat_tokens_total", model="m", mode="plain", provenance="target") == 1
    assert value(t, "specchat_accepted_length_count", **spec) == 3
    assert value(t, "specchat_accepted_length_sum", **spec) == 5
    assert value(t, "specchat_accepted_length_bucket", **spec, le="1.0") == 2
    assert value(t, "specchat_k_changes_total", **spec) == 1
    assert value(t, "specchat_mode_switches_total", **spec, to="plain") == 1
    # Latency: rounds 2, 3 and 4 (the first round holds the prefill): 2 + 1 + 1 tokens.
    assert value(t, "specchat_token_latency_seconds_count", **spec) == 3
    assert value(t, "specchat_token_latency_seconds_sum", **spec) == pytest.approx(
        0.10 / 2 * 2 + 0.20
    )
    assert value(t, "specchat_token_latency_seconds_count", model="m", mode="plain") == 1
    assert value(t, "specchat_turns_total", **spec, outcome="eos") == 1
    assert value(t, "specchat_time_to_first_token_seconds_count", **spec) == 1


def test_a_fixed_mode_label_and_early_exit_layers() -> None:
    t = Telemetry()
    t.observe(TurnStarted(1, 10, 10, Mode.EARLY_EXIT), model="m", mode="run-a")
    for i, layer in enumerate([2, 2, 5]):
        t.observe(
            TokenEvent(3, "x", Provenance.EARLY_EXIT, i + 1, exit_layer=layer, t=1.0 + i * 0.01),
            model="m",
            mode="run-a",
        )
        t.observe(RoundEvent(i + 1, Mode.EARLY_EXIT, 0, 0, 0.0, 5.0), model="m", mode="run-a")
    labels = {"model": "m", "mode": "run-a"}
    assert value(t, "specchat_exit_layer_count", **labels) == 3
    assert value(t, "specchat_exit_layer_sum", **labels) == 9
    assert value(t, "specchat_exit_layer_bucket", **labels, le="2.0") == 2
    assert value(t, "specchat_rounds_total", model="m", mode="early-exit") == 0


def test_self_spec_rounds_are_not_counted_as_switches() -> None:
    """The controller reports SPEC as the next mode of a self-speculative run."""
    t = Telemetry()
    t.observe(TurnStarted(1, 10, 10, Mode.SELF_SPEC), model="m")
    for rnd in (1, 2):
        t.observe(TokenEvent(1, "a", Provenance.BONUS, rnd, 2, t=float(rnd)), model="m")
        t.observe(
            RoundEvent(rnd, Mode.SELF_SPEC, 2, 2, 1.0, 2.0, next_mode=Mode.SPEC, next_k=2),
            model="m",
        )
    t.observe(TokenEvent(1, "a", Provenance.TARGET, 3, t=3.0), model="m")
    t.observe(RoundEvent(3, Mode.PLAIN, 0, 0, 0.0, 2.0, next_mode=Mode.SPEC, next_k=2), model="m")
    assert value(t, "specchat_mode_switches_total", model="m", mode="self-spec", to="plain") == 0
    assert value(t, "specchat_mode_switches_total", model="m", mode="plain", to="self-spec") == 1


def test_two_instances_do_not_share_a_registry() -> None:
    a, b = Telemetry(), Telemetry()
    a.observe(RoundEvent(1, Mode.SPEC, 3, 1, 1.0, 1.0), model="m")
    assert value(a, "specchat_drafted_tokens_total", model="m", mode="spec") == 3
    assert value(b, "specchat_drafted_tokens_total", model="m", mode="spec") == 0


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@needs_stories
def test_endpoint_answers_a_scrape_with_the_session_series() -> None:
    model, tok = load_stories()
    cpu = torch.device("cpu")

    def as_loaded(m: torch.nn.Module, role: str) -> LoadedModel:
        info = describe(
            m, role, f"stories260k-{role}", str(STORIES), cpu, torch.float32, QuantMode.NONE
        )  # type: ignore[arg-type]
        return LoadedModel(m, tok, cpu, torch.float32, info)  # type: ignore[arg-type]

    session = ChatSession(as_loaded(model, "target"), as_loaded(layer_truncated(model, 2), "draft"))  # type: ignore[arg-type]
    telemetry = Telemetry()
    server = telemetry.serve(port=0)  # an ephemeral port on 127.0.0.1
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        for mode in (Mode.SPEC, Mode.PLAIN):
            session.reset()
            cfg = DecodeConfig(mode=mode, max_new_tokens=16, k=3)
            for ev in session.stream("Once upon a time", cfg):
                telemetry.observe(ev, model="stories260k-target")
        series = scrape(server.url)
    finally:
        server.close()

    def get(name: str, **labels: str) -> float:
        for lab, v in series.get(name, []):
            if all(lab.get(k) == want for k, want in labels.items()):
                return v
        raise AssertionError(f"{name} {labels} not in the scrape")

    spec = {"model": "stories260k-target", "mode": "spec"}
    assert get("specchat_drafted_tokens_total", **spec) > 0
    assert (
        0
        <= get("specchat_accepted_tokens_total", **spec)
        <= get("specchat_drafted_tokens_total", **spec)
    )
    assert get("specchat_accepted_length_count", **spec) == get("specchat_rounds_total", **spec)
    assert get("specchat_token_latency_seconds_count", **spec) > 0
    assert get("specchat_token_latency_seconds_count", model="stories260k-target", mode="plain") > 0
    assert get("specchat_turns_total", model="stories260k-target", mode="plain") == 1


def test_speculative_counters_in_vllm_s_shape() -> None:
    """The same rounds as above, in vLLM's spec_decode_* series: read with the vLLM names
    (prefix swapped) they give what a vLLM dashboard would show."""
    from specchat.engine.remote.scrape import parse

    t = Telemetry()
    t.observe(TurnStarted(1, 10, 10, Mode.SPEC), model="m")
    spec_round(t, 1, 4, 4, at=1.00)
    spec_round(t, 2, 4, 1, at=1.10)
    spec_round(t, 3, 2, 0, at=1.30)
    t.observe(TurnFinished(stats(8)), model="m")
    from prometheus_client import generate_latest

    text = generate_latest(t.registry).decode()
    snap = parse(text.replace("specchat:", "vllm:"), "vllm", model="m")
    assert (snap.drafts, snap.draft_tokens, snap.accepted) == (3, 10, 5)
    assert snap.per_position == (2, 1, 1, 1)


def test_a_served_engine_s_reply_counts_what_the_server_reported() -> None:
    from specchat.engine.events import ServerStats

    t = Telemetry()
    server = ServerStats("llama.cpp", "timings", drafts=4, draft_tokens=30, accepted=24,
                         accepted_per_position=(4, 4, 3), final=True)  # fmt: skip
    t.observe(TurnStarted(1, 0, 0, Mode.REMOTE), model="m")
    t.observe(TurnFinished(dataclasses.replace(stats(28, Mode.REMOTE), server=server)), model="m")
    assert value(t, "specchat_drafted_tokens_total", model="m", mode="remote") == 30
    assert value(t, "specchat_accepted_tokens_total", model="m", mode="remote") == 24
    assert value(t, "specchat:spec_decode_num_drafts_total", model_name="m") == 4
    assert value(t, "specchat:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position="2") == 3
