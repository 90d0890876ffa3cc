"""Early exit on the target: exit rule, K/V fill of skipped layers, calibration."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.early_exit import EarlyExitStepper
from specchat.engine.decode.exit_policy import (
    Calibration,
    ExitPolicy,
    LayerRecords,
    Measure,
    default_exit_layers,
    exits_at,
    load_calibration,
    policy_for,
    select_threshold,
    weights_key,
)
from specchat.engine.decode.session import ChatSession
from specchat.engine.events import Provenance, TokenEvent, TurnFinished
from specchat.engine.model.runner import ModelRunner
from specchat.engine.tools.calibration import collect
from tests.tinymodels import loaded, tiny_llama

PROMPTS = ("Once upon a time", "def add(a, b):")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, max_positions=256)


def run_chat(
    target: torch.nn.Module, cfg: DecodeConfig
) -> tuple[list[TokenEvent], list[TurnFinished]]:
    """Two turns (the second reuses the first's cache); token events and turn stats."""
    session = ChatSession(loaded(target))
    tokens: list[TokenEvent] = []
    stats: list[TurnFinished] = []
    for prompt in PROMPTS:
        for ev in session.stream(prompt, cfg):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            elif isinstance(ev, TurnFinished):
                stats.append(ev)
    assert len(stats) == len(PROMPTS)
    return tokens, stats


@pytest.fixture(scope="module")
def plain_ids(target: torch.nn.Module) -> list[int]:
    tokens, _ = run_chat(target, DecodeConfig(mode=Mode.PLAIN, max_new_tokens=16))
    return [t.token_id for t in tokens]


# -- the exit rule ------------------------------------------------------------------


def test_default_exit_layers_are_quarters() -> None:
    assert default_exit_layers(28) == (7, 14, 21)
    assert default_exit_layers(4) == (1, 2, 3)
    assert default_exit_layers(2) == (1,)


def test_threshold_one_or_more_never_exits() -> None:
    assert not exits_at(1.0, 1.0)  # a top-1 probability can round to exactly 1.0
    assert not exits_at(1.0, 1.5)
    assert exits_at(0.0, 0.0)
    assert exits_at(0.9, 0.9) and not exits_at(0.89, 0.9)


@pytest.mark.parametrize("threshold", [1.0, 1.5])
def test_exit_off_is_plain_decoding(
    target: torch.nn.Module, plain_ids: list[int], threshold: float, tmp_cache: Path
) -> None:
    cfg = DecodeConfig(mode=Mode.EARLY_EXIT, exit_threshold=threshold, max_new_tokens=16)
    tokens, stats = run_chat(target, cfg)
    assert [t.token_id for t in tokens] == plain_ids
    assert all(t.provenance is Provenance.TARGET and t.exit_layer is None for t in tokens)
    assert all(s.stats.early_exits == 0 and s.stats.mean_layers == 4.0 for s in stats)


def test_threshold_zero_exits_at_the_first_exit_layer(
    target: torch.nn.Module, tmp_cache: Path
) -> None:
    cfg = DecodeConfig(mode=Mode.EARLY_EXIT, exit_threshold=0.0, max_new_tokens=12)
    tokens, stats = run_chat(target, cfg)
    assert tokens and all(t.provenance is Provenance.EARLY_EXIT for t in tokens)
    assert {t.exit_layer for t in tokens} == {1}
    assert all(t.confidence is not None and 0.0 < t.confidence <= 1.0 for t in tokens)
    assert all(t.p_target is not None and t.p_target == pytest.approx(t.confidence) for t in tokens)
    for s in stats:
        assert s.stats.early_exits == s.stats.tokens
        assert s.stats.mean_layers == 1.0


def test_cache_stays_whole_after_exits(target: torch.nn.Module) -> None:
    """Every layer holds K/V for exactly `cached` tokens, whatever layer each token left at."""
    runner = ModelRunner(target, torch.device("cpu"))
    seq = [1, 40, 41, 42, 43]
    runner.prefill(seq)
    stepper = EarlyExitStepper(runner, ExitPolicy((1, 2, 3), (0.0, 0.0, 0.0)))
    cfg = DecodeConfig(mode=Mode.EARLY_EXIT)
    for _ in range(6):
        res = stepper.step(seq, cfg, None)
        seq.append(res.tokens[0].token_id)
        assert res.layers_run == [1]
        assert runner.cached == len(seq) - 1
        assert [layer.get_seq_length() for layer in runner.cache.layers] == [runner.cached] * 4
    assert stepper.counts.exits == [6, 0, 0]


def test_sampled_early_exit_is_seeded(target: torch.nn.Module, tmp_cache: Path) -> None:
    cfg = DecodeConfig(
        mode=Mode.EARLY_EXIT, exit_threshold=0.1, temperature=0.8, seed=7, max_new_tokens=10
    )
    a, _ = run_chat(target, cfg)
    b, _ = run_chat(target, cfg)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert all(t.p_target is not None and 0.0 < t.p_target <= 1.0 for t in a)


def test_impossible_precheck_never_pays_the_head(target: torch.nn.Module) -> None:
    """Saturation is a cosine (<= 1): a pre-check of 2.0 skips every LM head at exit points."""
    runner = ModelRunner(target, torch.device("cpu"))
    seq = [1, 40, 41, 42, 43]
    runner.prefill(seq)
    policy = ExitPolicy((1, 2, 3), (0.0, 0.0, 0.0), Measure.SOFTMAX, gates=(2.0, 2.0, 2.0))
    stepper = EarlyExitStepper(runner, policy)
    for _ in range(5):
        seq.append(stepper.step(seq, DecodeConfig(), None).tokens[0].token_id)
    assert stepper.counts.head_evals == [0, 0, 0]
    assert stepper.counts.gated == [5, 5, 5]
    assert stepper.counts.exits == [0, 0, 0]


# -- the K/V fill -------------------------------------------------------------------


def hand_kv(
    model: torch.nn.Module, h: torch.Tensor, layer: int, pos: int
) -> tuple[torch.Tensor, ...]:
    """K/V one skipped layer owes position `pos`, written out from the weights.

    h [H] is the exit layer's hidden state; returns k, v as [1, Hkv, 1, D].
    """
    cfg = model.config
    block = model.model.layers[layer]
    w_norm = block.input_layernorm.weight
    x = h * torch.rsqrt(h.pow(2).mean() + cfg.rms_norm_eps) * w_norm  # RMSNorm
    d = cfg.hidden_size // cfg.num_attention_heads
    k = (block.self_attn.k_proj.weight @ x).view(cfg.num_key_value_heads, d)  # [Hkv, D]
    v = (block.self_attn.v_proj.weight @ x).view(cfg.num_key_value_heads, d)
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    angle = pos * torch.cat([inv_freq, inv_freq])  # [D]
    rotated = torch.cat([-k[:, d // 2 :], k[:, : d // 2]], dim=-1)
    k = k * torch.cos(angle) + rotated * torch.sin(angle)
    return k.view(1, -1, 1, d), v.view(1, -1, 1, d)


def test_kv_fill_matches_a_hand_reference(target: torch.nn.Module) -> None:
    exit_layer, big_l = 2, 4
    seq = [1, 40, 41, 42, 43, 44]
    pos = len(seq) - 1

    # The stepper: seq[-1] leaves after 2 layers; layers 2 and 3 are filled.
    runner = ModelRunner(target, torch.device("cpu"))
    runner.prefill(seq)
    stepper = EarlyExitStepper(runner, ExitPolicy((exit_layer,), (0.0,)))
    res = stepper.step(seq, DecodeConfig(), None)
    (em,) = res.tokens
    assert em.exit_layer == exit_layer and res.layers_run == [exit_layer]
    nxt = seq + [em.token_id]
    got = runner.forward(nxt)[-1]  # next-token logits over the filled cache [V]

    # The reference: a full pass over seq, then the last position's K/V in the
    # skipped layers replaced by K/V computed by hand from the layer-2 hidden state.
    with torch.no_grad():
        ref_cache = DynamicCache(config=target.config)
        out = target(
            input_ids=torch.tensor([seq]),
            cache=ref_cache,
            use_cache=True,
            output_hidden_states=True,
        )
        h = out.hidden_states[exit_layer][0, -1]  # [H] after 2 layers
        for i in range(exit_layer, big_l):
            k, v = hand_kv(target, h, i, pos)
            assert torch.allclose(runner.cache.layers[i].keys[..., pos : pos + 1, :], k, atol=1e-5)
            assert torch.allclose(
                runner.cache.layers[i].values[..., pos : pos + 1, :], v, atol=1e-5
            )
            layer = ref_cache.layers[i]
            layer.keys = torch.cat([layer.keys[..., :pos, :], k], dim=-2)
            layer.values = torch.cat([layer.values[..., :pos, :], v], dim=-2)
        want = target(
            input_ids=torch.tensor([[em.token_id]]), cache=ref_cache, use_cache=True
        ).logits[0, -1]
        # Without the fill (true K/V of all layers) the logits differ: the test can fail.
        full = target(input_ids=torch.tensor([nxt])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, full, atol=1e-3)


# -- calibration --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), min_size=1, max_size=60),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_thresholds_rise_with_the_budget(
    rows: list[tuple[float, bool]], b1: float, b2: float
) -> None:
    lo, hi = sorted((b1, b2))
    conf = [c for c, _ in rows]
    agree = [a for _, a in rows]
    t_lo, t_hi = select_threshold(conf, agree, lo), select_threshold(conf, agree, hi)
    assert t_lo <= t_hi
    for budget, t in ((lo, t_lo), (hi, t_hi)):
        if math.isfinite(t):
            chosen = [a for c, a in rows if c >= t]
            assert chosen and sum(chosen) / len(chosen) >= budget


def test_threshold_is_the_lowest_meeting_the_budget() -> None:
    conf = [0.99, 0.95, 0.9, 0.8, 0.7]
    agree = [True, True, False, True, False]
    assert select_threshold(conf, agree, 1.0) == 0.95
    assert select_threshold(conf, agree, 0.75) == 0.8  # 3 of 4
    assert select_threshold(conf, agree, 0.6) == 0.7  # 3 of 5
    assert select_threshold([0.9], [False], 0.5) == math.inf


def synthetic(head_cost: float, exit_share: float) -> Calibration:
    """Layer 2 of 4: `exit_share` of positions are confident and right, the rest unsure."""
    n = 200
    k = int(n * exit_share)
    conf = np.r_[np.full(k, 0.99), np.full(n - k, 0.3)]
    rec = LayerRecords(conf, conf, np.r_[np.full(k, 0.9), np.full(n - k, 0.5)], conf > 0.5)
    return Calibration("syn", "w", 4, (2,), {2: rec}, np.ones(n, bool), head_cost, 0.05)


def test_policy_keeps_exits_that_pay_and_drops_those_that_do_not() -> None:
    cheap = synthetic(head_cost=0.5, exit_share=0.5)
    pol = cheap.policy(0.95)
    assert pol.thresholds == (0.99,)
    s = cheap.summary(0.95)
    assert s.exit_rate == pytest.approx(0.5) and s.agreement == 1.0 and s.speedup > 1.0
    # The pre-check (saturation 0.9 vs 0.5) lets it skip the head on unsure positions.
    assert pol.gates is not None and 0.5 < pol.gates[0] <= 0.9
    costly = synthetic(head_cost=50.0, exit_share=0.01)
    costly_rec = costly.records[2]
    costly_rec.saturation[:] = 0.7  # no pre-check can separate them: every position pays the head
    assert costly.policy(0.95).thresholds == (math.inf,)
    assert costly.summary(0.95).speedup == pytest.approx(1.0)


def test_calibration_round_trip_and_session_policy(
    target: torch.nn.Module, tmp_cache: Path
) -> None:
    model = loaded(target)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    cal = collect(model, chats, new_tokens=8)
    assert cal.layers == (1, 2, 3) and cal.positions > 16
    assert cal.reply.sum() == 2 * 9  # last prompt token + 8 generated, per chat
    assert cal.weights == weights_key(model)
    path = cal.save()
    assert path.parent == tmp_cache / "calibration"
    again = load_calibration(model)
    assert again is not None
    for b in (0.3, 0.6, 0.95):
        assert again.thresholds(b) == pytest.approx(cal.thresholds(b), abs=1e-5)
    summary = again.summary(0.95)
    assert summary.budget == 0.95 and summary.agreement >= 0.95 and summary.source == str(path)

    session = ChatSession(model)
    calibrated = policy_for(session.target, DecodeConfig(mode=Mode.EARLY_EXIT))
    assert calibrated.source == "calibrated"
    assert calibrated.layers == cal.layers
    override = policy_for(session.target, DecodeConfig(mode=Mode.EARLY_EXIT, exit_threshold=0.4))
    assert override.thresholds == (0.4, 0.4, 0.4) and override.gates is None


def test_uncalibrated_model_uses_the_default(target: torch.nn.Module, tmp_cache: Path) -> None:
    session = ChatSession(loaded(target))
    policy = policy_for(session.target, DecodeConfig(mode=Mode.EARLY_EXIT))
    assert policy.source == "default"
    assert load_calibration(session.target) is None


def test_state_dict_hash_follows_the_weights() -> None:
    a = loaded(tiny_llama(seed=1, layers=2))
    b = loaded(tiny_llama(seed=1, layers=2))
    assert weights_key(a) == weights_key(b)
    assert weights_key(loaded(tiny_llama(seed=2, layers=2))) != weights_key(a)
    assert weights_key(a).startswith("state-")
