"""The benchmark and the A/B protocol end to end on the real tiny model.

Target stories260k (5 layers), draft its first 2 layers (`layer_truncated`),
float32 on the CPU; small settings (2 prompts, 16 tokens, 1 repeat).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specchat.engine.config import QuantMode
from specchat.engine.decode.session import ChatSession
from specchat.engine.tools.ab import distribution_check, run_ab
from specchat.engine.tools.bench import BenchPrompt, load_prompts, run_bench
from specchat.engine.tools.bench_plots import write_plots
from specchat.engine.weights.loading import LoadedModel, describe, layer_truncated
from tests.stories import STORIES, load_stories, needs_stories

pytestmark = needs_stories

PROMPT_LINES = [
    {"id": "s1", "kind": "story", "messages": [{"role": "user", "content": "Once upon a time"}]},
    {
        "id": "m1",
        "kind": "multiturn",
        "messages": [
            {"role": "system", "content": "Lily and Tom"},
            {"role": "user", "content": "Tom had a big red ball."},
            {"role": "assistant", "content": "He liked to play."},
            {"role": "user", "content": "One day, a cat"},
        ],
    },
]
ALL_MODES = ["plain", "spec", "self-spec", "early-exit"]


def as_loaded(model: torch.nn.Module, tok: object, role: str, name: str) -> LoadedModel:
    cpu = torch.device("cpu")
    info = describe(model, role, name, str(STORIES), cpu, torch.float32, QuantMode.NONE)  # type: ignore[arg-type]
    return LoadedModel(model, tok, cpu, torch.float32, info)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def session() -> ChatSession:
    model, tok = load_stories()
    target = as_loaded(model, tok, "target", "stories260k")
    draft = as_loaded(layer_truncated(model, 2), tok, "draft", "stories260k-2-layers")  # type: ignore[arg-type]
    return ChatSession(target, draft)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> list[BenchPrompt]:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPT_LINES) + "\n", encoding="utf-8")
    return load_prompts(path)


def test_bench_end_to_end_writes_json_and_plots(
    session: ChatSession, prompts: list[BenchPrompt], tmp_path: Path
) -> None:
    result = run_bench(session, prompts, arms=ALL_MODES, max_new_tokens=16, repeats=1)
    path = result.write_json(tmp_path / "result.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    arms = ALL_MODES + ["hf-generate", "hf-assisted"]
    assert data["arms"] == arms
    assert len(data["runs"]) == len(arms) * len(prompts)
    assert data["models"]["target"]["name"] == "stories260k"
    assert data["models"]["native_decoder"] == "on"  # a Llama in float32 on the CPU
    assert data["environment"]["torch"] == torch.__version__
    assert data["config"]["decode"]["max_new_tokens"] == 16
    for arm in arms:
        s = data["summary"][arm]
        if s["status"] == "unavailable":  # reported, not measured as plain
            assert s["reason"]
            assert all(r["status"] == "unavailable" for r in data["runs"] if r["arm"] == arm)
            continue
        assert s["status"] == "ok", (arm, s["reason"])
        assert s["tokens_per_s"]["median"] > 0
        assert s["latency_ms"]["p50"] is not None
        assert s["peak_rss_bytes"] > 0
    runs = {(r["arm"], r["prompt_id"]): r for r in data["runs"]}
    for p in prompts:
        plain = runs[("plain", p.id)]
        assert 0 < len(plain["tokens"]) <= 16
        # Same prompt ids for the session and transformers; lossless modes give the same tokens.
        for arm in ("spec", "hf-generate", "hf-assisted"):
            assert runs[(arm, p.id)]["prompt_tokens"] == plain["prompt_tokens"]
            assert runs[(arm, p.id)]["tokens"] == plain["tokens"], arm
    spec = data["summary"]["spec"]
    assert 0.0 <= spec["acceptance_rate"] <= 1.0
    assert spec["acceptance_by_position"]
    assert set(data["by_kind"]) == {"story", "multiturn"}
    # Interleaved: every block runs every arm once.
    blocks: dict[int, list[str]] = {}
    for r in data["runs"]:
        blocks.setdefault(r["block"], []).append(r["arm"])
    assert all(sorted(b) == sorted(arms) for b in blocks.values())

    files = write_plots(data, tmp_path / "plots")
    names = {f.name for f in files}
    for stem in ("tokens_per_s", "acceptance_by_position", "latency", "exit_layers"):
        assert {f"{stem}.png", f"{stem}.svg"} <= names
    for f in files:
        head = f.read_bytes()[:8]
        assert head.startswith(b"\x89PNG") if f.suffix == ".png" else b"<" in head


def test_a_mode_that_cannot_run_is_reported_not_measured_as_plain(
    session: ChatSession, prompts: list[BenchPrompt]
) -> None:
    no_draft = ChatSession(session.target)
    result = run_bench(no_draft, prompts[:1], arms=["plain", "spec"], max_new_tokens=4)
    assert result.summary["spec"]["status"] == "unavailable"
    assert "no draft" in result.summary["spec"]["reason"]
    assert result.summary["spec"]["tokens_per_s"]["median"] is None
    assert result.summary["hf-assisted"]["status"] == "unavailable"
    assert result.summary["plain"]["status"] == "ok"


def test_ab_greedy_spec_is_token_identical_to_plain_in_float32(
    session: ChatSession, prompts: list[BenchPrompt]
) -> None:
    result = run_ab(session, prompts, "plain", "spec", max_new_tokens=16)
    data = result.to_dict()
    assert data["identical"] == data["compared"] == len(prompts)
    assert result.ok
    for c in result.comparisons:
        assert c.agreement_a == 1.0 and c.agreement_b == 1.0


def test_ab_early_exit_reports_divergence_margin_and_agreement(
    session: ChatSession, prompts: list[BenchPrompt]
) -> None:
    result = run_ab(session, prompts, "plain", "early-exit", max_new_tokens=16)
    for c in result.comparisons:
        if c.status == "unavailable":
            pytest.skip(f"early exit is not available: {c.error}")
        assert c.agreement_b is not None and 0.0 <= c.agreement_b <= 1.0
        if c.first_divergence is not None:
            assert c.verdict == "lossy (expected)"
            assert c.top2_margin is not None and c.top2_margin >= 0.0
            assert c.top1 is not None and c.top1 != c.top2


def test_sampled_spec_matches_plain_in_distribution(session: ChatSession) -> None:
    """First 2 tokens after a fixed prompt, 150 seeds per mode (seeds 0..149), temperature 1:
    chi-square homogeneity at significance 0.01. Deterministic: the seeds are fixed."""
    prompt = BenchPrompt("lily", "story", "Lily")
    check = distribution_check(session, prompt, "plain", "spec", seeds=150, n_tokens=2)
    assert sum(check.counts_a.values()) == sum(check.counts_b.values()) == 150
    assert check.dof >= 1  # the prompt does not make the reply deterministic
    assert check.passed, (check.p_value, check.total_variation)


def test_bench_command_runs_from_flags_and_serves_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPT_LINES[0]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["bench", "--prompts", str(prompts), "--target", str(STORIES), "--draft", str(STORIES)]
    argv += ["--modes", "plain,spec", "--max-new-tokens", "8", "--repeats", "1", "--threads", "1"]
    argv += ["--out", str(out), "--metrics-port", "0", "--no-plots"]
    assert main(argv) == 0
    data = json.loads((out / "result.json").read_text(encoding="utf-8"))
    assert data["arms"] == ["plain", "spec", "hf-generate", "hf-assisted"]
    assert data["models"]["draft"] is not None
    captured = capsys.readouterr()
    assert "metrics: http://127.0.0.1:" in captured.err
    assert "tok/s" in captured.out
    assert main(["bench", "--show", str(out / "result.json")]) == 0


def test_bench_command_names_the_bad_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPT_LINES[0]) + "\n{not json\n", encoding="utf-8")
    assert main(["bench", "--prompts", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err


def test_bench_command_compares_two_configs_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """float32 and bfloat16 of the same pair, interleaved; 1 prompt, 1 repeat, 8 tokens."""
    from specchat.tui.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPT_LINES) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["bench", "--prompts", str(prompts), "--target", str(STORIES), "--draft", str(STORIES)]
    argv += ["--configs", "none,none:bfloat16", "--modes", "plain,spec", "--limit", "1"]
    # K fixed: in 8 tokens the adaptive controller would not pay for the draft's prompt read.
    argv += ["--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--k", "2"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "result.json").read_text(encoding="utf-8"))
    arms = ["plain@none", "spec@none", "plain@none:bfloat16", "spec@none:bfloat16"]
    assert data["arms"] == [*arms, "hf-generate@none", "hf-assisted@none"]
    assert data["reference"] == "hf-generate@none"
    assert len(data["runs"]) == len(data["arms"])  # one block: every arm once
    for arm in data["arms"]:
        s = data["summary"][arm]
        assert s["status"] == "ok", (arm, s["reason"])
        assert s["speedup_vs_reference"]["median"] > 0
    assert data["summary"]["spec@none:bfloat16"]["acceptance_rate"] is not None
    f32, bf16 = data["configs"]
    assert (f32["label"], bf16["label"]) == ("none", "none:bfloat16")
    assert f32["models"]["target"]["dtype"] == "float32"
    assert bf16["models"]["target"]["dtype"] == bf16["models"]["draft"]["dtype"] == "bfloat16"
    # Half the bytes per value: the KV cache per token halves, and so do the weights.
    mem32, mem16 = f32["memory"], bf16["memory"]
    assert mem16["target_kv_bytes_per_token"] * 2 == mem32["target_kv_bytes_per_token"]
    assert mem16["draft_kv_bytes_per_token"] * 2 == mem32["draft_kv_bytes_per_token"]
    assert mem16["target_weight_bytes"] < mem32["target_weight_bytes"]
    assert mem16["peak_rss_bytes"] > 0
    assert "spec@none:bfloat16" in capsys.readouterr().out
    assert {"tokens_per_s.png", "latency.svg"} <= {f.name for f in out.iterdir()}
    assert main(["bench", "--show", str(out / "result.json")]) == 0
