"""Benchmark statistics, prompt files, interleaving and the A/B tests, on synthetic data;
several model configs in one run, on tiny models built in code."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from specchat.engine.config import Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.errors import OutOfMemoryError, QuantizationError
from specchat.engine.events import Provenance, RoundEvent, TokenEvent
from specchat.engine.metrics import (
    DecodeMetrics,
    acceptance_by_position,
    count_round,
    first_divergence,
    length_bands,
    position_bands,
)
from specchat.engine.tools.bench import (
    BenchConfig,
    BenchPrompt,
    BenchResult,
    ConfigLoadError,
    RunRecord,
    load_configs,
    run_bench,
    summarize,
)
from specchat.engine.tools.bench_runs import (
    ConfigSpecError,
    PromptFileError,
    find_arm,
    find_config,
    load_prompts,
    make_arms,
    parse_config_spec,
    parse_config_specs,
)
from specchat.engine.tools.bench_stats import (
    chi2_sf,
    chi_square_homogeneity,
    interleaved_order,
    median,
    paired_ratios,
    ratio,
    spread,
    total_variation,
)
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import loaded, tiny_llama

# -- medians, ratios, spreads ----------------------------------------------------


def test_median_ignores_missing_and_non_finite() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([1.0, float("nan"), 5.0, None]) == 3.0  # type: ignore[list-item]
    assert median([]) is None


def test_ratio_and_spread() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 1.0) is None
    assert spread([5.0, 1.0, 3.0]) == {"median": 3.0, "min": 1.0, "max": 5.0}
    assert spread([]) == {"median": None, "min": None, "max": None}


def test_paired_ratios_use_only_blocks_both_arms_completed() -> None:
    arm = {0: 20.0, 1: 30.0, 2: 12.0}
    ref = {0: 10.0, 1: 10.0, 3: 7.0}  # block 2 failed in the reference, 3 in the arm
    assert sorted(paired_ratios(arm, ref)) == [2.0, 3.0]


def test_paired_ratios_stay_exact_under_drift_that_spreads_the_raw_figures() -> None:
    # The machine slows down 3x during the run; B is 1.5x faster than A in every block.
    slowdown = [1.0, 1.0, 3.0, 3.0, 3.0]
    a = {blk: 10.0 / s for blk, s in enumerate(slowdown)}
    b = {blk: 15.0 / s for blk, s in enumerate(slowdown)}
    ratios = paired_ratios(b, a)
    assert spread(ratios) == pytest.approx({"median": 1.5, "min": 1.5, "max": 1.5})
    raw = spread(list(b.values()))
    assert raw["max"] / raw["min"] == pytest.approx(3.0)  # type: ignore[operator]


# -- interleaving ------------------------------------------------------------------


def test_interleaved_order_without_rotation_is_a_b_c_a_b_c() -> None:
    order = interleaved_order(["A", "B", "C"], n_prompts=2, repeats=1, rotate=False)
    assert [arm for _, _, arm in order] == ["A", "B", "C", "A", "B", "C"]
    assert [p for _, p, _ in order] == [0, 0, 0, 1, 1, 1]


def test_interleaved_order_rotates_so_every_arm_takes_every_slot() -> None:
    arms = ["A", "B", "C"]
    order = interleaved_order(arms, n_prompts=2, repeats=3, rotate=True)
    assert len(order) == 3 * 2 * 3
    blocks = [order[i : i + 3] for i in range(0, len(order), 3)]
    slot_counts: Counter[tuple[str, int]] = Counter()
    for blk in blocks:
        assert sorted(a for _, _, a in blk) == arms  # every arm once per block
        assert len({(r, p) for r, p, _ in blk}) == 1  # one (repeat, prompt) per block
        for slot, (_, _, a) in enumerate(blk):
            slot_counts[(a, slot)] += 1
    assert set(slot_counts.values()) == {2}  # 6 blocks: each arm twice in each slot
    assert [a for _, _, a in blocks[1]] == ["B", "C", "A"]


def test_interleaved_order_visits_prompts_within_each_repeat() -> None:
    order = interleaved_order(["A", "B"], n_prompts=3, repeats=2)
    assert [(r, p) for r, p, _ in order[::2]] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


# -- acceptance ---------------------------------------------------------------------


def test_positions_past_eight_are_pooled_in_doubling_bands() -> None:
    reached: Counter[int] = Counter()
    passed: Counter[int] = Counter()
    for k, accepted in [(31, 31), (16, 12), (4, 4)]:
        count_round(reached, passed, k, accepted)
    bands = position_bands(reached, passed)
    assert [label for label, _ in bands] == [*map(str, range(1, 9)), "9-16", "17-31"]
    assert bands[0] == ("1", 1.0)
    # 9-16: reached by the 31 (8 drafts, all accepted) and the 16 (positions 9-13 reached,
    # 9-12 accepted): 12 of 13
    assert bands[8] == ("9-16", 12 / 13)
    assert bands[9] == ("17-31", 1.0)
    assert position_bands(Counter(), Counter()) == []
    hist = [1, 0, 2] + [0] * 8 + [3] + [0] * 19 + [4]  # lengths 0, 2, 11, 31
    assert length_bands(hist) == [
        ("0", 1), ("1", 0), ("2", 2), *[(str(n), 0) for n in range(3, 9)], ("9-16", 3), ("17-31", 4)
    ]
    assert length_bands([2, 1]) == [("0", 2), ("1", 1)]


def test_acceptance_by_position_hand_computed() -> None:
    # K=3 rounds accepting 3, 1, 0 drafts: position 1 reached 3x, passed 2x;
    # position 2 reached 2x (rounds 1, 2), passed 1x; position 3 reached 1x, passed 1x.
    assert acceptance_by_position([(3, 3), (3, 1), (3, 0)]) == [2 / 3, 1 / 2, 1.0]
    assert acceptance_by_position([]) == []


def test_acceptance_by_position_matches_the_metrics_module() -> None:
    rng = random.Random(7)
    rounds = []
    for _ in range(200):
        k = rng.randint(1, 6)
        rounds.append((k, rng.randint(0, k)))
    m = DecodeMetrics(window=10_000)
    for i, (k, acc) in enumerate(rounds, 1):
        for pos in range(acc):
            m.observe(TokenEvent(5, "a", Provenance.ACCEPTED, i, pos, t=float(i)))
        m.observe(TokenEvent(6, "b", Provenance.CORRECTED, i, acc, t=float(i)))
        m.observe(RoundEvent(i, Mode.SPEC, k, acc, 1.0, 2.0))
    assert acceptance_by_position(rounds) == pytest.approx(m.acceptance_by_position())


# -- prompt files ---------------------------------------------------------------------


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_splits_system_history_and_prompt(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            json.dumps(
                {"id": "a", "kind": "facts", "messages": [{"role": "user", "content": "Q?"}]}
            ),
            "",
            json.dumps(
                {
                    "id": "b",
                    "kind": "multiturn",
                    "messages": [
                        {"role": "system", "content": "Be terse."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"},
                    ],
                }
            ),
        ],
    )
    a, b = load_prompts(path)
    assert (a.id, a.kind, a.prompt, a.history, a.system) == ("a", "facts", "Q?", (), None)
    assert b.system == "Be terse."
    assert b.history == (("user", "Hi"), ("assistant", "Hello"))
    assert b.prompt == "Bye"
    assert b.messages[-1] == ("user", "Bye")


def test_the_shared_dev_prompts_load() -> None:
    path = Path(__file__).resolve().parents[2].parent / "shared" / "prompts" / "dev_prompts.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    prompts = load_prompts(path)
    assert len(prompts) >= 2
    assert all(p.prompt for p in prompts)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"id": "x", "messages": [', "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"id": "x", "messages": []}', "non-empty list"),
        ('{"id": "x", "messages": [{"role": "bot", "content": "hi"}]}', "role 'bot'"),
        ('{"id": "x", "messages": [{"role": "user"}]}', 'no string "content"'),
        ('{"id": "x", "messages": [{"role": "assistant", "content": "hi"}]}', "last message"),
        (
            '{"id": "x", "messages": [{"role": "user", "content": "a"}, '
            '{"role": "system", "content": "b"}, {"role": "user", "content": "c"}]}',
            "only come first",
        ),
    ],
)
def test_a_malformed_line_is_reported_with_its_line_number(
    tmp_path: Path, line: str, needle: str
) -> None:
    good = json.dumps({"id": "ok", "messages": [{"role": "user", "content": "fine"}]})
    path = write(tmp_path, [good, good.replace('"ok"', '"ok2"'), line])
    with pytest.raises(PromptFileError) as exc:
        load_prompts(path)
    assert f"{path}:3:" in exc.value.message
    assert needle in exc.value.message


def test_duplicate_ids_missing_and_empty_files(tmp_path: Path) -> None:
    line = json.dumps({"id": "same", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(PromptFileError, match=r":2: duplicate prompt id 'same'"):
        load_prompts(write(tmp_path, [line, line]))
    with pytest.raises(PromptFileError, match="holds no prompts"):
        load_prompts(write(tmp_path, [""]))
    with pytest.raises(PromptFileError, match="cannot read"):
        load_prompts(tmp_path / "absent.jsonl")


# -- aggregation -------------------------------------------------------------------------


def record(arm: str, block: int, tps: float, tokens: list[int], **kw: object) -> RunRecord:
    rec = RunRecord(arm, f"p{block}", "kind-a" if block % 2 == 0 else "kind-b", 0, block, 0)
    rec.tokens = tokens
    rec.seconds = len(tokens) / tps
    rec.ttft_s = 0.1
    rec.chunks = [1] * len(tokens)
    rec.latencies_ms = [1000.0 / tps] * (len(tokens) - 1)
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_summarize_pairs_ratios_within_blocks_and_reports_unavailable_modes() -> None:
    plain = [record("plain", b, tps, [1, 2, 3, 4]) for b, tps in enumerate([10.0, 20.0, 40.0])]
    spec = [
        record(
            "spec", b, tps, [1, 2, 3, 4], rounds=[(4, 3)], spec_costs=[(40.0 + 8 * b, 120.0)],
            target_step_ms=100.0, catch_up_ms=30.0 * b,
        )
        for b, tps in enumerate([15.0, 30.0, 60.0])
    ]
    spec[2].tokens = [1, 2, 3, 9]  # one reply differs from plain
    early = [
        RunRecord("early-exit", f"p{b}", "kind-a", 0, b, 2, status="unavailable", error="no module")
        for b in range(3)
    ]
    result = BenchResult(
        config={},
        environment={},
        models={},
        arms=["plain", "spec", "early-exit"],
        load_start={},
        load_end={},
        records=plain + spec + early,
        warmup=[],
        unavailable={"early-exit": "no module"},
        seconds=1.0,
    )
    summarize(result)
    s = result.summary
    assert s["spec"]["speedup_vs_plain"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    # After the first token (0.1 s in every run): blocks 0 and 1 decode 3 tokens in 0.3 s
    # against 0.167 s, and 0.1 against 0.033 (block 2's replies end with their first token).
    assert s["spec"]["decode_speedup_vs_plain"] == pytest.approx(
        {"median": 2.4, "min": 1.8, "max": 3.0}
    )
    assert s["plain"]["decode_speedup_vs_plain"]["median"] == pytest.approx(1.0)
    assert s["spec"]["tokens_per_s"] == {"median": 30.0, "min": 15.0, "max": 60.0}
    assert s["spec"]["acceptance_rate"] == 0.75
    assert s["spec"]["mean_accepted_length"] == 4.0
    assert s["spec"]["acceptance_by_position"] == [1.0, 1.0, 1.0, 0.0]
    assert s["spec"]["same_tokens_as_plain"] == {"equal": 2, "compared": 3}
    # c and v as paid: draft ms per drafted token and verify ms per round, in target steps
    assert s["spec"]["cost_ratio_c"] == pytest.approx((40 + 48 + 56) / 12 / 100)
    assert s["spec"]["verify_ratio_v"] == pytest.approx(1.2)
    assert s["spec"]["catch_up_o"] == pytest.approx((0 + 30 + 60) / 3 / 100)  # per round
    assert s["plain"]["cost_ratio_c"] is None and s["plain"]["verify_ratio_v"] is None
    assert s["plain"]["catch_up_o"] is None
    assert s["early-exit"]["status"] == "unavailable"
    assert s["early-exit"]["reason"] == "no module"
    assert s["early-exit"]["tokens_per_s"]["median"] is None
    assert set(result.by_kind) == {"kind-a", "kind-b"}
    assert result.by_kind["kind-b"]["spec"]["runs"] == 1
    json.dumps(result.to_dict())  # every figure serialises


def test_summarize_takes_plain_ratios_within_each_config_and_the_reference_across() -> None:
    # Two configs, a and b; in every block spec@a is 1.5x plain@a, plain@b 2x plain@a,
    # spec@b 3x plain@a; hf-generate@a is the reference and equals plain@a.
    speeds = {"plain@a": 10.0, "spec@a": 15.0, "plain@b": 20.0, "spec@b": 30.0}
    speeds["hf-generate@a"] = 10.0
    drift = [1.0, 2.0, 0.5]
    records = [
        record(arm, b, tps / d, [1, 2, 3, 4], config=arm.partition("@")[2])
        for arm, tps in speeds.items()
        for b, d in enumerate(drift)
    ]
    result = BenchResult(
        config={},
        environment={},
        models={},
        arms=list(speeds),
        load_start={},
        load_end={},
        records=records,
        warmup=[],
        unavailable={},
        seconds=1.0,
        configs=[{"label": c, "memory": {"peak_rss_bytes": None}} for c in ("a", "b")],
    )
    summarize(result)
    s = result.summary
    assert result.reference == "hf-generate@a"  # the default when baselines ran
    assert (s["spec@b"]["mode"], s["spec@b"]["config"]) == ("spec", "b")
    assert s["spec@a"]["speedup_vs_plain"]["median"] == pytest.approx(1.5)
    assert s["spec@b"]["speedup_vs_plain"]["median"] == pytest.approx(1.5)  # against plain@b
    assert s["spec@b"]["speedup_vs_reference"]["median"] == pytest.approx(3.0)
    assert s["plain@b"]["speedup_vs_hf-generate"]["median"] == pytest.approx(2.0)
    assert s["hf-generate@a"]["speedup_vs_reference"]["median"] == pytest.approx(1.0)
    assert s["hf-generate@a"]["speedup_vs_plain"]["median"] == pytest.approx(1.0)  # plain@a
    assert s["spec@b"]["same_tokens_as_plain"] == {"equal": 3, "compared": 3}
    assert "same_tokens_as_plain" not in s["plain@b"]


def test_summarize_records_the_rss_peak_of_each_config() -> None:
    records = [
        record("plain@a", 0, 10.0, [1], config="a", rss_bytes=100),
        record("plain@b", 0, 10.0, [1], config="b", rss_bytes=300),
        record("plain@b", 1, 10.0, [1], config="b", rss_bytes=200),
    ]
    configs = [{"label": c, "memory": {"peak_rss_bytes": None}} for c in ("a", "b")]
    result = BenchResult({}, {}, {}, ["plain@a", "plain@b"], {}, {}, records, [], {}, 1.0)
    result.configs = configs
    summarize(result)
    assert [c["memory"]["peak_rss_bytes"] for c in result.configs] == [100, 300]
    assert result.reference == "plain@a"  # no baseline: the first arm


# -- several model configs ------------------------------------------------------------------


def test_parse_config_spec() -> None:
    s = parse_config_spec("int8/int4")
    assert (s.label, s.target_quant, s.draft_quant, s.dtype) == (
        "int8/int4",
        "int8",
        "int4",
        "auto",
    )
    s = parse_config_spec(" None:BFloat16 ", dtype="float32")
    assert (s.label, s.target_quant, s.draft_quant, s.dtype) == (
        "none:bfloat16",
        "none",
        "none",  # the draft takes the target's quantization
        "bfloat16",
    )
    assert parse_config_spec("w8a8", dtype="float32").dtype == "float32"  # from --dtype
    specs = parse_config_specs("none:bfloat16,int8/int4,w8a8/w8a8,int4/int4")
    assert [s.label for s in specs] == ["none:bfloat16", "int8/int4", "w8a8/w8a8", "int4/int4"]
    # Compared by meaning: int8 is int8/int8 at the default dtype.
    assert find_config(parse_config_specs("int8,int4"), "int8/int8:auto").label == "int8"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("int3", "unknown target quantization 'int3'"),
        ("int8/fp4", "unknown draft quantization 'fp4'"),
        ("int8/int4/none", "more than one '/'"),
        ("/int4", "target quantization is missing"),
        ("int8/", "draft quantization is missing"),
        ("int8:", "unknown dtype ''"),
        ("int8:float8", "unknown dtype 'float8'"),
        ("int8:bfloat16:x", "unknown dtype 'bfloat16:x'"),
        ("int8+v100", "+vN belongs to the draft"),
        ("int8/int4+100", "'100' is not vN"),
        ("int8/int4+vx", "'vx' is not vN"),
        ("int8/int4+v0", "at least 1"),
        ("w4a8~sse", "~sse is no w4a8 path"),
        ("int8/int4~avx2", "no model is w4a8"),
    ],
)
def test_a_bad_config_spec_says_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ConfigSpecError) as exc:
        parse_config_specs(f"none,{text}")
    assert f"bad config {text!r}" in exc.value.message
    assert needle in exc.value.message
    assert "TARGETQUANT[/DRAFTQUANT[+vN]][:DTYPE][~W4A8PATH]" in exc.value.hint


def test_a_draft_vocabulary_makes_a_config_of_its_own() -> None:
    full, short = parse_config_specs("w4a8,w4a8/w4a8+v65536:float32")
    assert (full.draft_vocab, short.draft_vocab) == (None, 65536)
    assert (short.target_quant, short.draft_quant, short.dtype) == ("w4a8", "w4a8", "float32")
    assert find_config([full, short], "w4a8/w4a8+v65536:float32") is short
    with pytest.raises(ConfigSpecError, match="same configuration"):
        parse_config_specs("w4a8/w4a8+v100,w4a8/w4a8+v100")


def test_a_w4a8_path_makes_a_config_of_its_own() -> None:
    """`~avx2` runs a config's turns on the kernel's AVX2 code: two paths, one interleaved run."""
    auto, avx2 = parse_config_specs("w4a8,w4a8~avx2")
    assert (auto.w4a8_path, avx2.w4a8_path) == (None, "avx2")
    assert (avx2.target_quant, avx2.draft_quant, avx2.label) == ("w4a8", "w4a8", "w4a8~avx2")
    assert parse_config_spec("int8/w4a8:float32~avx512vnni").w4a8_path == "avx512vnni"
    assert find_config([auto, avx2], "w4a8/w4a8~avx2") is avx2
    with pytest.raises(ConfigSpecError, match="same configuration"):
        parse_config_specs("w4a8~avx2,w4a8/w4a8~avx2")


def test_the_same_config_twice_and_an_unknown_one_are_errors() -> None:
    with pytest.raises(ConfigSpecError, match="'int8' and 'int8/int8' are the same"):
        parse_config_specs("int8,int8/int8")
    with pytest.raises(ConfigSpecError, match="not one of the configs"):
        find_config(parse_config_specs("int8,int4"), "w8a8")


def test_arm_labels_carry_the_config_only_when_there_are_several() -> None:
    one = make_arms(["int8"], ["plain", "spec"], ["hf-generate"], "int8")
    assert [a.label for a in one] == ["plain", "spec", "hf-generate"]
    two = make_arms(["int8/int4", "none"], ["plain", "spec"], ["hf-generate"], "none")
    assert [a.label for a in two] == [
        "plain@int8/int4",
        "spec@int8/int4",
        "plain@none",
        "spec@none",
        "hf-generate@none",
    ]
    specs = parse_config_specs("int8/int4,none")
    assert find_arm(two, "spec@int8/int4").config == "int8/int4"
    assert find_arm(two, "plain@none/none:auto", specs).label == "plain@none"
    with pytest.raises(ConfigSpecError, match="'hf-assisted@none' is not in this run"):
        find_arm(two, "hf-assisted@none", specs)


def tiny_session(seed: int) -> ChatSession:
    target = tiny_llama(seed=seed, layers=4)
    return ChatSession(loaded(target), loaded(layer_truncated(target, 2), "draft"))  # type: ignore[arg-type]


TINY_PROMPTS = [BenchPrompt("p0", "story", "Once upon a time"), BenchPrompt("p1", "code", "def")]


def test_two_configs_interleave_and_baselines_run_on_the_chosen_one() -> None:
    """Tiny models, 2 prompts x 2 repeats, 6 tokens; nothing timed is compared."""
    configs = [BenchConfig("a", tiny_session(0)), BenchConfig("b", tiny_session(1))]
    result = run_bench(
        configs,
        TINY_PROMPTS,
        arms=["plain", "spec"],
        baseline_config="b",
        max_new_tokens=6,
        repeats=2,
        warmup=False,
    )
    arms = ["plain@a", "spec@a", "plain@b", "spec@b", "hf-generate@b", "hf-assisted@b"]
    assert result.arms == arms
    assert result.reference == "hf-generate@b"
    assert result.config["baseline_config"] == "b"
    # Every block runs every (config, mode) arm once, in a rotating order.
    blocks: dict[int, list[str]] = {}
    for r in result.records:
        blocks.setdefault(r.block, []).append(r.arm)
        assert r.config == r.arm.partition("@")[2]
        assert r.ok, (r.arm, r.error)
    assert len(blocks) == 4
    assert all(sorted(b) == sorted(arms) for b in blocks.values())
    assert [b[0] for b in blocks.values()] == arms[:4]
    assert not any(r.arm.startswith("hf-") and r.config != "b" for r in result.records)
    # Ratios are paired within blocks: recompute them from the records.
    tps = {(r.arm, r.block): r.tokens_per_s for r in result.records}
    for arm in arms:
        ref = [tps[(arm, b)] / tps[("hf-generate@b", b)] for b in blocks]  # type: ignore[operator]
        plain = [tps[(arm, b)] / tps[(f"plain@{arm.partition('@')[2]}", b)] for b in blocks]  # type: ignore[operator]
        assert result.summary[arm]["speedup_vs_reference"]["median"] == pytest.approx(
            statistics.median(ref)
        )
        assert result.summary[arm]["speedup_vs_plain"]["median"] == pytest.approx(
            statistics.median(plain)
        )
    assert result.summary["hf-generate@b"]["speedup_vs_reference"]["max"] == pytest.approx(1.0)
    # Greedy and lossless: every arm of a config gives its plain's tokens.
    assert result.summary["spec@a"]["same_tokens_as_plain"] == {"equal": 4, "compared": 4}
    assert result.summary["hf-generate@b"]["same_tokens_as_plain"] == {"equal": 4, "compared": 4}
    # Per config: weights and KV bytes per token of both models, and the RSS peak.
    data = json.loads(json.dumps(result.to_dict()))
    assert [c["label"] for c in data["configs"]] == ["a", "b"]
    for c, bc in zip(data["configs"], configs, strict=True):
        info = bc.session.target.info
        assert c["memory"]["target_weight_bytes"] == info.weight_bytes > 0
        assert c["memory"]["target_kv_bytes_per_token"] == info.kv_bytes_per_token > 0
        assert c["memory"]["draft_weight_bytes"] > 0
        assert c["models"]["target"]["name"] == info.name
        assert c["memory"]["peak_rss_bytes"] > 0


def test_a_named_reference_and_no_baselines() -> None:
    configs = [BenchConfig("a", tiny_session(0)), BenchConfig("b", tiny_session(1))]
    kw: dict[str, Any] = {"arms": ["plain"], "max_new_tokens": 3, "warmup": False}
    result = run_bench(configs, TINY_PROMPTS[:1], baselines=False, **kw)
    assert result.arms == ["plain@a", "plain@b"]
    assert result.reference == "plain@a"  # the first arm
    result = run_bench(configs, TINY_PROMPTS[:1], baselines=False, reference="plain@b", **kw)
    assert result.summary["plain@b"]["speedup_vs_reference"]["median"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not an arm of this run"):
        run_bench(configs, TINY_PROMPTS[:1], reference="spec@a", **kw)
    with pytest.raises(ValueError, match="baseline config 'c'"):
        run_bench(configs, TINY_PROMPTS[:1], baseline_config="c", **kw)


def test_one_session_keeps_the_plain_mode_names() -> None:
    result = run_bench(tiny_session(0), TINY_PROMPTS[:1], arms=["plain"], max_new_tokens=3)
    assert result.arms == ["plain", "hf-generate", "hf-assisted"]
    assert result.reference == "hf-generate"
    assert [c["label"] for c in result.configs] == ["none/none:float32"]
    assert "speedup_vs_plain" in result.summary["hf-generate"]


def test_load_configs_names_the_config_that_did_not_load() -> None:
    specs = parse_config_specs("none,int8/int4")
    session = tiny_session(0)

    def load(spec: Any) -> ChatSession:
        if spec.label == "int8/int4":
            raise MemoryError("cannot allocate 6 GB")
        return session

    with pytest.raises(ConfigLoadError) as exc:
        load_configs(specs, load)
    assert exc.value.message == "config 'int8/int4' did not load: MemoryError: cannot allocate 6 GB"
    assert "none stayed loaded" in exc.value.hint

    def refuse(spec: Any) -> ChatSession:
        raise OutOfMemoryError("the target needs 9 GB, 2 GB free", hint="try --target-quant int4")

    with pytest.raises(ConfigLoadError) as exc:
        load_configs(specs, refuse)
    assert exc.value.message == "config 'none' did not load: the target needs 9 GB, 2 GB free"
    assert exc.value.hint == "try --target-quant int4"

    def unsupported(spec: Any) -> ChatSession:
        if spec.label == "none":
            return session
        raise QuantizationError("int8 needs in_features divisible by 8", hint="use none")

    with pytest.raises(ConfigLoadError) as exc:
        load_configs(specs, unsupported)
    assert exc.value.message.startswith("config 'int8/int4' did not load: int8 needs")
    assert exc.value.hint == "use none"  # not a memory question: no word on held configs
    (one,) = load_configs(specs[:1], lambda spec: session)
    assert (one.label, one.session, one.spec) == ("none", session, specs[0])
    assert set(one.load) == {"seconds", "rss_before_bytes", "rss_after_bytes"}


# -- the command, on tiny models ---------------------------------------------------------


def prompt_file(tmp_path: Path) -> Path:
    line = {"id": "p0", "kind": "story", "messages": [{"role": "user", "content": "Once upon"}]}
    return write(tmp_path, [json.dumps(line)])


@pytest.fixture
def fake_load(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """ChatSession.load answers with tiny models and records (target quant, draft quant, dtype);
    a target quant of bnb-int8 fails to load, as a model too big for memory would."""
    calls: list[tuple[str, str, str]] = []

    def load(target: Any, draft: Any, **kw: object) -> ChatSession:
        calls.append((str(target.quant), str(draft.quant), target.dtype))
        if target.quant == "bnb-int8":
            raise MemoryError("out of memory")
        return tiny_session(len(calls))

    monkeypatch.setattr(ChatSession, "load", load)
    return calls


def test_bench_command_with_configs(
    tmp_path: Path, fake_load: list[tuple[str, str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    out = tmp_path / "out"
    argv = ["bench", "--prompts", str(prompt_file(tmp_path)), "--modes", "plain,spec"]
    argv += ["--configs", "none:bfloat16,int8/int4", "--baseline-config", "int8/int4:auto"]
    argv += ["--reference", "plain@none:bfloat16", "--max-new-tokens", "4", "--repeats", "1"]
    argv += ["--out", str(out), "--no-plots", "--no-warmup"]
    assert main(argv) == 0
    assert fake_load == [("none", "none", "bfloat16"), ("int8", "int4", "auto")]
    data = json.loads((out / "result.json").read_text(encoding="utf-8"))
    assert data["arms"] == [
        "plain@none:bfloat16",
        "spec@none:bfloat16",
        "plain@int8/int4",
        "spec@int8/int4",
        "hf-generate@int8/int4",
        "hf-assisted@int8/int4",
    ]
    assert data["reference"] == "plain@none:bfloat16"
    assert [c["spec"]["draft_quant"] for c in data["configs"]] == ["none", "int4"]
    assert all(c["load"]["seconds"] >= 0 for c in data["configs"])
    text = " ".join(capsys.readouterr().out.split())
    assert "spec@int8/int4" in text and "×ref: against plain@none:bfloat16" in text
    assert "KV KB/tok" in text  # the per-config table
    assert main(["bench", "--show", str(out / "result.json")]) == 0
    # Where a config's load chose the w4a8 kernel's rows, --show says so for that config.
    assert [c["w4a8_vnni_rows"] for c in data["configs"]] == [None, None]  # no w4a8 here
    data["configs"][1]["w4a8_vnni_rows"] = {"from": 1, "why": "from one row, measured faster"}
    (out / "result.json").write_text(json.dumps(data), encoding="utf-8")
    capsys.readouterr()
    assert main(["bench", "--show", str(out / "result.json")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "int8/int4: w4a8 VNNI code from 1 row: from one row, measured faster" in text
    assert "none:bfloat16: w4a8" not in text


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--configs", "int8,int9"], "bad config 'int9': unknown target quantization"),
        (["--configs", "int8", "--target-quant", "int4"], "--configs sets the quantizations"),
        (["--baseline-config", "int8"], "--baseline-config needs --configs"),
        (["--configs", "int8,int4", "--baseline-config", "w8a8"], "'w8a8' is not one of"),
        (["--configs", "int8,int4", "--reference", "spec@w8a8"], "'spec@w8a8' is not in this"),
        (["--reference", "hf-generate", "--no-baseline"], "'hf-generate' is not in this run"),
    ],
)
def test_bench_command_refuses_bad_config_flags_before_loading(
    tmp_path: Path,
    fake_load: list[tuple[str, str, str]],
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    needle: str,
) -> None:
    from specchat.tui.cli import main

    assert main(["bench", "--prompts", str(prompt_file(tmp_path)), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert fake_load == []


def test_bench_command_names_the_config_that_did_not_load(
    tmp_path: Path, fake_load: list[tuple[str, str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    argv = ["bench", "--prompts", str(prompt_file(tmp_path)), "--configs", "none,bnb-int8"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config 'bnb-int8' did not load: MemoryError: out of memory" in err
    assert "none stayed loaded" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def legacy_result() -> dict[str, Any]:
    """A one-config result.json as written before there were configs and a reference."""
    plain = [record("plain", b, tps, [1, 2, 3]) for b, tps in enumerate([10.0, 12.0])]
    spec = [
        record("spec", b, tps, [1, 2, 3], rounds=[(3, 2)]) for b, tps in enumerate([15.0, 18.0])
    ]
    hf = [record("hf-generate", b, 10.0, [1, 2, 3]) for b in range(2)]
    result = BenchResult(
        config={
            "arms": ["plain", "spec", "hf-generate"],
            "prompts": [{"id": "p0"}, {"id": "p1"}],
            "repeats": 1,
            "seed": 0,
            "decode": {"max_new_tokens": 3, "temperature": 0.0},
            "cache_policy": "fresh",
        },
        environment={"device": "cpu", "torch_threads": 1, "torch": "2", "transformers": "5"},
        models={
            "target": {"name": "t", "dtype": "float32", "quant": "int8"},
            "draft": {"name": "d", "dtype": "float32", "quant": "int4"},
        },
        arms=["plain", "spec", "hf-generate"],
        load_start={"loadavg": [1.0, 1.0, 1.0], "cpu_percent": 50.0},
        load_end={"loadavg": None, "cpu_percent": None},
        records=plain + spec + hf,
        warmup=[],
        unavailable={},
        seconds=3.0,
    )
    summarize(result)
    data = result.to_dict()
    del data["configs"], data["reference"]
    for f in [
        *data["summary"].values(),
        *(a for k in data["by_kind"].values() for a in k.values()),
    ]:
        del f["speedup_vs_reference"], f["mode"], f["config"]
    for r in data["runs"]:
        del r["config"]
    return data


def test_show_prints_a_result_from_before_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specchat.tui.cli import main

    path = tmp_path / "result.json"
    path.write_text(json.dumps(legacy_result()), encoding="utf-8")
    assert main(["bench", "--show", str(path)]) == 0
    text = capsys.readouterr().out
    assert "target t (float32, int8), draft d (float32, int4)" in text
    spec_row = next(line for line in text.splitlines() if line.strip().startswith("spec "))
    assert "1.50x" in spec_row  # ×plain
    assert "×ref" not in text and "configs" not in text


def test_plots_of_several_configs_and_of_an_earlier_result(tmp_path: Path) -> None:
    from specchat.engine.tools.bench_plots import write_plots

    configs = [BenchConfig("a", tiny_session(0)), BenchConfig("b", tiny_session(1))]
    result = run_bench(configs, TINY_PROMPTS[:1], arms=["plain", "spec"], max_new_tokens=4)
    for data, name in ((result.to_dict(), "new"), (legacy_result(), "old")):
        files = write_plots(data, tmp_path / name)
        assert len(files) == 8
        assert all(f.stat().st_size > 0 for f in files)


# -- A/B helpers -------------------------------------------------------------------------


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_chi2_survival_function_known_values() -> None:
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(9.487729036781154, 4) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(200.0, 3) < 1e-40
    try:
        from scipy.stats import chi2
    except ImportError:
        return
    for x, k in [(0.3, 1), (2.0, 2), (20.0, 10), (100.0, 80), (7.0, 7), (55.0, 3)]:
        assert chi2_sf(x, k) == pytest.approx(chi2.sf(x, k), rel=1e-9, abs=1e-15)


def test_chi_square_homogeneity_accepts_one_distribution_and_rejects_two() -> None:
    """Seeded samples: N=2000 per side, 6 categories, significance 0.01."""
    rng = random.Random(1234)
    probs = [0.4, 0.2, 0.15, 0.1, 0.1, 0.05]
    shifted = [0.3, 0.25, 0.15, 0.1, 0.1, 0.1]  # total variation 0.1
    cats = list(range(6))
    a = Counter(rng.choices(cats, probs, k=2000))
    b = Counter(rng.choices(cats, probs, k=2000))
    c = Counter(rng.choices(cats, shifted, k=2000))
    _, dof, p_same = chi_square_homogeneity(a, b)
    assert dof == 5
    assert p_same > 0.01
    _, _, p_diff = chi_square_homogeneity(a, c)
    assert p_diff < 1e-6
    assert total_variation(a, c) == pytest.approx(0.1, abs=0.04)


def test_chi_square_pools_rare_categories() -> None:
    a = Counter({"x": 50, "y": 45, "r1": 1, "r2": 2, "r3": 2})
    b = Counter({"x": 48, "y": 47, "r1": 2, "r4": 3})
    stat, dof, p = chi_square_homogeneity(a, b)
    assert dof == 2  # x, y and the pooled rare categories
    assert 0.0 <= p <= 1.0 and stat >= 0.0
    assert chi_square_homogeneity(Counter({"x": 5}), Counter({"x": 9})) == (0.0, 0, 1.0)


def test_total_variation_bounds() -> None:
    assert total_variation(Counter("aab"), Counter("aab")) == 0.0
    assert total_variation(Counter("aa"), Counter("bb")) == 1.0


def test_a_server_arm_is_compared_with_plain_by_its_text() -> None:
    """A served engine sends text, not ids (-1): its =plain counts equal texts; its
    acceptance and accepted length are the server's own counts."""
    def rec(arm: str, block: int, text: str, tokens: list[int], server: dict | None = None) -> RunRecord:
        return RunRecord(arm, f"p{block}", "code", 0, block, 0, tokens=tokens, text=text, seconds=1.0,
                         chunks=[len(tokens)], server=server)  # fmt: skip

    served = {"drafts": 2, "draft_tokens": 8, "accepted": 6, "scope": "reply", "source": "timings"}
    records = [
        rec("plain", 0, "abc", [1, 2, 3]),
        rec("server2", 0, "abc", [-1, -1, -1], served),
        rec("plain", 1, "xyz", [4, 5, 6]),
        rec("server2", 1, "xy!", [-1, -1, -1], served),
    ]
    result = BenchResult(
        config={"server": {"server2": "llama.cpp server at …"}}, environment={}, models={},
        arms=["plain", "server2"], load_start={}, load_end={}, records=records, warmup=[],
        unavailable={}, seconds=1.0, reference="plain",
    )  # fmt: skip
    summarize(result)
    s = result.summary["server2"]
    assert s["same_tokens_as_plain"] == {"equal": 1, "compared": 2}
    assert s["acceptance_rate"] == pytest.approx(12 / 16)
    assert s["mean_accepted_length"] == pytest.approx((12 + 4) / 4)
    assert s["tokens_per_target_pass"] is None


def test_the_training_prompts_hold_out_eight_and_none_is_a_bench_prompt() -> None:
    """A head trained by train-draft is benchmarked on the bench sets: none of their
    prompts may be one it trained on, and its validation set stays the same 8 replies."""
    from specchat.engine.tools.train_prompts import PROMPTS, split, turns

    train, held = split()
    assert len(held) == 8 and not set(train) & set(held) and len(train) + 8 == len(set(PROMPTS))
    root = Path(__file__).resolve().parents[2]
    ours = sorted((root / "docs" / "bench-prompts").glob("*.jsonl"))
    dev = root.parent / "shared" / "prompts" / "dev_prompts.jsonl"  # absent on a bare clone
    bench = {m[1] for path in [*ours, dev] if path.is_file() for p in load_prompts(path) for m in p.messages}
    said = {text for p in PROMPTS for _, text in turns(p)}
    assert len(ours) >= 2 and len(bench) > 5 and not bench & said
