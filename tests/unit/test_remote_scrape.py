"""Served engines' metrics: each kind's exposition text read into the same figures.

The vLLM and SGLang texts (tests/fixtures) reproduce their exposition format as
prometheus_client 0.26.0 renders their metric definitions (vLLM 0.33.0:
vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py; SGLang 0.5.23:
python/sglang/srt/observability/metrics_collector.py; each file's first line names
its source). The llama.cpp text was scraped from the real llama-server the
integration tests build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.engine.config import Mode
from specchat.engine.events import ServerStats, TurnStats, from_dict, to_dict
from specchat.engine.remote.scrape import ReplyWindow, Snapshot, parse, reply_stats

FIXTURES = Path(__file__).parent.parent / "fixtures"
VLLM = (FIXTURES / "vllm-0.33.0.metrics.txt").read_text()
SGLANG = (FIXTURES / "sglang-0.5.23.metrics.txt").read_text()
LLAMA = (FIXTURES / "llama.cpp-0.3.36.metrics.txt").read_text()


def test_vllm_figures() -> None:
    snap = parse(VLLM, "vllm")
    assert (snap.drafts, snap.draft_tokens, snap.accepted) == (120, 480, 300)
    assert snap.per_position == (110, 90, 60, 40)
    assert snap.kv_usage == pytest.approx(0.03)
    assert snap.running == 1
    assert snap.speculative


def test_vllm_series_of_another_model_are_left_out() -> None:
    other = VLLM.replace('model_name="meta-llama/Llama-3.1-8B-Instruct"', 'model_name="other"')
    both = VLLM + "\n".join(x for x in other.splitlines() if x and not x.startswith("#")) + "\n"
    # the same families twice in one text: prometheus_client reads the second as more samples
    assert parse(both, "vllm").drafts == 240
    assert parse(both, "vllm", model="meta-llama/Llama-3.1-8B-Instruct").drafts == 120


def test_vllm_before_0_11_names_its_kv_gauge_gpu_cache_usage_perc() -> None:
    old = VLLM.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert "kv_cache_usage_perc" not in old
    assert parse(old, "vllm").kv_usage == pytest.approx(0.03)


def test_vllm_without_a_speculative_config_has_no_spec_decode_series() -> None:
    plain = "\n".join(x for x in VLLM.splitlines() if "spec_decode" not in x) + "\n"
    snap = parse(plain, "vllm")
    assert snap.drafts is None and not snap.speculative
    stats = reply_stats("vllm", ReplyWindow(before=snap, latest=snap), streamed_tokens=10, speculative=False)
    assert stats.acceptance_rate is None and stats.mean_accepted_length is None


def test_sglang_gauges_and_verify_calls() -> None:
    snap = parse(SGLANG, "sglang")
    assert snap.accept_length == pytest.approx(3.5)
    assert snap.accept_rate == pytest.approx(0.625)
    assert snap.kv_usage == pytest.approx(0.03)
    assert snap.running == 1
    assert snap.drafts == 96  # sglang:spec_verify_calls_total
    assert snap.generated == 340
    assert snap.draft_tokens is None  # SGLang has no draft-token counter


def test_sglang_reply_derives_accepted_from_generated_tokens_and_verify_calls() -> None:
    before = Snapshot(t=0.0, drafts=96, generated=340, running=0)
    after = Snapshot(t=1.0, drafts=106, generated=380, running=1, accept_rate=0.7, accept_length=4.0)
    stats = reply_stats("sglang", ReplyWindow(before, after), streamed_tokens=40, speculative=True)
    assert (stats.drafts, stats.accepted) == (10, 30)  # 40 tokens from 10 verify calls
    assert stats.mean_accepted_length == pytest.approx(4.0)
    assert stats.acceptance_rate == pytest.approx(0.7)  # no draft-token counter: the gauge


def test_sglang_gauges_over_several_ranks_average_and_add() -> None:
    rank1 = SGLANG.replace('tp_rank="0"', 'tp_rank="1"')
    text = SGLANG + "\n".join(x for x in rank1.splitlines() if x.startswith("sglang:") and "_total" not in x) + "\n"
    snap = parse(text, "sglang")
    assert snap.accept_length == pytest.approx(3.5)  # a length is the mean, never 7
    assert snap.running == 2  # request counts add up


def test_llama_cpp_figures_from_a_real_server() -> None:
    snap = parse(LLAMA, "llama.cpp")
    assert snap.drafts == 83 and snap.draft_tokens == 643 and snap.accepted == 485
    assert len(snap.per_position) == 8 and snap.per_position[0] == 78
    assert snap.running == 0
    assert snap.kv_usage is None  # llama.cpp has no KV-usage gauge


def test_reply_stats_count_the_growth_and_the_scope() -> None:
    before = parse(LLAMA, "llama.cpp", t=0.0)
    after = Snapshot(
        t=1.0, drafts=93, draft_tokens=723, accepted=545, per_position=(88, 85, 70), running=1, generated=2000
    )
    window = ReplyWindow(before)
    window.add(after)
    generated = int(2000 - (before.generated or 0))
    stats = reply_stats("llama.cpp", window, streamed_tokens=generated, speculative=True, final=True)
    assert (stats.drafts, stats.draft_tokens, stats.accepted) == (10, 80, 60)
    assert stats.accepted_per_position == (10, 9, 6)
    assert stats.acceptance_rate == pytest.approx(0.75)
    assert stats.mean_accepted_length == pytest.approx(7.0)
    assert stats.by_position() == pytest.approx([1.0, 0.9, 0.6])
    assert (stats.scope, stats.source, stats.final) == ("reply", "metrics", True)
    # another request ran meanwhile: two running at one sample
    window.add(Snapshot(t=2.0, drafts=93, draft_tokens=723, accepted=545, running=2, generated=2000))
    assert reply_stats("llama.cpp", window, streamed_tokens=generated, speculative=True).scope == "server-wide"
    # or more tokens generated than the reply streamed
    busy = ReplyWindow(before, after)
    assert reply_stats("llama.cpp", busy, streamed_tokens=generated // 3, speculative=True).scope == "server-wide"


def test_timings_are_the_reply_s_own_even_on_a_busy_server() -> None:
    before = Snapshot(t=0.0, drafts=0, draft_tokens=0, accepted=0, generated=0)
    after = Snapshot(t=1.0, drafts=50, draft_tokens=400, accepted=300, running=3, generated=500)
    window = ReplyWindow(before)
    window.add(after)
    stats = reply_stats("llama.cpp", window, streamed_tokens=100, speculative=True, timings=(80, 60))
    assert (stats.source, stats.scope) == ("timings", "reply")
    assert (stats.draft_tokens, stats.accepted) == (80, 60)
    assert stats.drafts is None and stats.accepted_per_position == ()  # the metrics' share is unknown


def test_a_restarted_server_counts_from_zero() -> None:
    before = Snapshot(t=0.0, drafts=500, draft_tokens=4000, accepted=3000)
    after = Snapshot(t=1.0, drafts=4, draft_tokens=32, accepted=20)
    stats = reply_stats("vllm", ReplyWindow(before, after), streamed_tokens=24, speculative=True)
    assert (stats.drafts, stats.draft_tokens, stats.accepted) == (4, 32, 20)


def test_text_that_is_not_prometheus_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse("<html>not metrics</html>\n", "vllm")


def test_server_stats_round_trip_inside_a_trace() -> None:
    server = ServerStats("llama.cpp", "timings", drafts=3, draft_tokens=24, accepted=20,
                         accepted_per_position=(3, 3, 2), final=True)  # fmt: skip
    stats = TurnStats(10, 1.0, 10.0, 0.1, 4, 24, 20, 20 / 24, 7.7, Mode.REMOTE, (), (), "eos", "x",
                      server=server)  # fmt: skip
    assert from_dict(to_dict(stats)) == stats
    assert from_dict(to_dict(server)) == server
