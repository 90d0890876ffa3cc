"""The EAGLE-3 draft head: its passes, the drafter, exactness, the speculators layout,
training through `train-draft`'s own code path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specchat.engine.config import DecodeConfig, Mode
from specchat.engine.decode.session import ChatSession
from specchat.engine.errors import EngineError
from specchat.engine.events import RoundEvent, TokenEvent
from specchat.engine.model.eagle import EagleHead, HeadCache, HeadConfig, init_head
from specchat.engine.model.eagle_io import config_from_speculators, load_head, save_head
from specchat.engine.model.runner import ModelRunner
from specchat.engine.tools.train_draft import (
    DataStore,
    Sequence,
    TrainOptions,
    featurize,
    label_logits,
    learning_rate,
    new_head,
    train,
    validate,
    weights_id,
)
from tests.tinymodels import chatml_tokenizer, loaded, tiny_llama

PROMPT = "one two three four one two"


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, tokenizer=chatml_tokenizer())


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A head trained 60 optimizer steps (seed 0) through train-draft's own code path,
    the learning rate decaying over the last 12."""
    folder = tmp_path_factory.mktemp("head")
    tgt = loaded(target, tokenizer=chatml_tokenizer())
    opts = TrainOptions(minutes=5, max_steps=60, reply_tokens=24, max_texts=30, draft_vocab=64,
                        out=folder, eval_every_s=1e9, decay=0.2, reply_rounds=1)
    return tgt, opts, train(tgt, opts)


def random_head(
    target: torch.nn.Module, seed: int = 0, vocab: int = 40, fc_norm: bool = False
) -> EagleHead:
    c = HeadConfig.for_target(target.config, draft_vocab=vocab, target_sha256="", fc_norm=fc_norm)
    head = init_head(EagleHead(c), seed)
    if head.fc_norm is not None:  # norms of their own, not ones: a load that drops them shows
        for i, norm in enumerate(head.fc_norm):
            norm.weight.data.fill_(0.5 + i)
    head.set_vocab(torch.arange(0, 2 * vocab, 2))  # every other id: some ids have p_draft = 0
    return head.eval().requires_grad_(False)


def session(target: torch.nn.Module, head: EagleHead | None) -> ChatSession:
    return ChatSession(loaded(target, tokenizer=chatml_tokenizer()), head=head)


def tokens(events: list[object]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_unrolled_training_pass_scores_each_step_as_the_decoding_chain_does(target) -> None:
    """Training-time test is only right if step s of `unrolled` at row j is what the
    s-th draft of a chain leaving the target at row j - s computes."""
    head = random_head(target)
    torch.manual_seed(0)
    s = 80  # past the cache's first allocation (64 rows): it grows mid-chain
    feats = torch.randn(s, head.fc.in_features)
    embeds = torch.randn(s, head.config.hidden_size)
    steps = head.unrolled(embeds, feats, 4)
    m = 62  # the chain leaves the target after rows 0..m
    cache = HeadCache()
    out, logits = head.step(embeds[: m + 1], feats[: m + 1], cache)
    torch.testing.assert_close(logits, steps[0][: m + 1], rtol=1e-5, atol=1e-5)
    state = out[-1:]
    for i in range(1, 4):
        state, logits = head.step(embeds[m + i : m + i + 1], state, cache)
        torch.testing.assert_close(logits[0], steps[i][m], rtol=1e-5, atol=1e-5)  # from row i


@pytest.mark.parametrize("first", [0, 1, 2, 5, 41, 79])
def test_unrolled_rows_asked_for_score_as_the_whole_pass_does(target, first: int) -> None:
    """Training computes only what the loss rows depend on (a prompt's rows give keys and
    values alone): those rows' logits, and the gradients through them, must be the ones a
    pass over every row gives."""
    head = random_head(target).requires_grad_(True)
    torch.manual_seed(1)
    s, steps = 80, 3
    feats = torch.randn(s, head.fc.in_features)
    embeds = torch.randn(s, head.config.hidden_size)
    whole = head.unrolled(embeds, feats, steps)  # step t: rows t..
    asked = head.unrolled(embeds, feats, steps, first)
    for t in range(steps):
        assert asked[t].shape[0] == s - max(first, t)
        torch.testing.assert_close(asked[t], whole[t][max(first, t) - t :], rtol=1e-5, atol=1e-5)
    grads = []
    for outs, cut in ((whole, lambda t: max(first, t) - t), (asked, lambda t: 0)):
        head.zero_grad()
        sum(o[cut(t) :].square().mean() for t, o in enumerate(outs)).backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_runner_hands_over_features_equal_to_transformers_hidden_states(target) -> None:
    runner = ModelRunner(target, torch.device("cpu"))
    layers = (0, 2, 3)
    got: list[tuple[int, torch.Tensor]] = []
    runner.capture, runner.on_features = layers, lambda start, f: got.append((start, f))
    ids = list(range(5, 25))
    runner.feed(ids[:15], keep=1)  # a first pass: transformers' forward
    runner.feed(ids[15:], keep=1)  # a block: the layer stack (native where built)
    ref = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i][0] for i in layers], dim=-1)
    assert [start for start, _ in got] == [0, 15]
    torch.testing.assert_close(torch.cat([f for _, f in got]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compose", [False, True])
def test_greedy_eagle_equals_plain(target, compose: bool) -> None:
    cfg = DecodeConfig(mode=Mode.EAGLE, max_new_tokens=40, compose=compose)
    plain = tokens(list(session(target, None).stream(PROMPT, cfg.with_(mode=Mode.PLAIN))))
    chat = session(target, random_head(target))
    events = list(chat.stream(PROMPT, cfg.with_(k=3)))
    assert tokens(events) == plain
    rounds = [e for e in events if isinstance(e, RoundEvent) and e.k]
    assert rounds and {e.drafter for e in rounds} >= {"draft head"}
    # A second turn reuses the caches and stays exact.
    again = list(chat.stream("three four", cfg.with_(k=2)))
    fresh = session(target, None)
    list(fresh.stream(PROMPT, cfg.with_(mode=Mode.PLAIN)))
    assert tokens(again) == tokens(list(fresh.stream("three four", cfg.with_(mode=Mode.PLAIN))))


def test_other_modes_skip_the_capture_and_eagle_catches_up_after_them(target) -> None:
    cfg = DecodeConfig(mode=Mode.EAGLE, k=2, max_new_tokens=16, compose=False)
    chat = session(target, random_head(target))
    ref = session(target, None)
    for mode in (Mode.EAGLE, Mode.PLAIN, Mode.EAGLE):
        prompt = f"{mode.value} one two"
        got = tokens(list(chat.stream(prompt, cfg.with_(mode=mode))))
        assert got == tokens(list(ref.stream(prompt, cfg.with_(mode=Mode.PLAIN))))
        capturing = chat.target_runner.on_features is not None
        assert capturing == (mode is Mode.EAGLE)


def test_eagle_without_a_head_says_so_and_decodes_plainly(target) -> None:
    events = list(session(target, None).stream(PROMPT, DecodeConfig(mode=Mode.EAGLE, max_new_tokens=8)))
    notices = [getattr(e, "message", "") for e in events]
    assert any("no draft head" in n and "train-draft" in n for n in notices)
    assert len(tokens(events)) == 8


def test_save_load_gives_identical_logits_in_the_speculators_layout(target, tmp_path: Path) -> None:
    head = random_head(target, seed=3)
    save_head(head, tmp_path, {"note": "x"}, ["LlamaForCausalLM"])
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["speculators_config"]["algorithm"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layers)
    assert raw["transformer_layer_config"]["vocab_size"] == target.config.vocab_size
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    q = load_file(str(tmp_path / "model.safetensors"))["layers.0.self_attn.q_proj.weight"]
    assert q.shape[1] == 2 * head.config.hidden_size  # embedding and features side by side
    back = load_head(tmp_path, target_config=target.config)
    assert config_from_speculators(raw) .draft_vocab_size == head.config.draft_vocab_size
    feats = torch.randn(6, head.fc.in_features)
    embeds = torch.randn(6, head.config.hidden_size)
    a = head.step(embeds, feats, HeadCache())[1]
    b = back.step(embeds, feats, HeadCache())[1]
    assert torch.equal(a, b)
    assert torch.equal(head.d2t, back.d2t) and torch.equal(head.t2d, back.t2d)


def test_fc_norm_norms_each_feature_layer_and_round_trips(target, tmp_path: Path) -> None:
    """With fc_norm each feature layer reaches fc at its own RMS (a layer scaled by 10
    gives the same drafts); the config field and the norms' weights survive a save."""
    head = random_head(target, seed=5, fc_norm=True)
    torch.manual_seed(0)
    ht = head.config.target_hidden_size
    feats = torch.randn(6, head.fc.in_features)
    embeds = torch.randn(6, head.config.hidden_size)
    louder = feats.clone()
    louder[:, ht : 2 * ht] *= 10.0  # the middle layer's residual stream, ten times larger
    a = head.step(embeds, feats, HeadCache())[1]
    torch.testing.assert_close(head.step(embeds, louder, HeadCache())[1], a, rtol=1e-4, atol=1e-4)
    plain = random_head(target, seed=5)  # the same weights but fc, without the norms
    assert not torch.allclose(plain.step(embeds, louder, HeadCache())[1], plain.step(embeds, feats, HeadCache())[1])
    save_head(head, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["fc_norm"] is True and config_from_speculators(raw).fc_norm
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(tmp_path / "model.safetensors")))
    back = load_head(tmp_path, target_config=target.config)
    assert torch.equal(back.step(embeds, feats, HeadCache())[1], a)


def test_greedy_eagle_with_fc_norm_equals_plain(target) -> None:
    cfg = DecodeConfig(mode=Mode.EAGLE, max_new_tokens=24, k=3)
    plain = tokens(list(session(target, None).stream(PROMPT, cfg.with_(mode=Mode.PLAIN))))
    assert tokens(list(session(target, random_head(target, fc_norm=True)).stream(PROMPT, cfg))) == plain


def test_published_names_load_midlayer_and_no_t2d(target, tmp_path: Path) -> None:
    """EAGLE's own checkpoints say `midlayer.`; vLLM does not need t2d: both load."""
    head = random_head(target, seed=4)
    save_head(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "t2d"}
    state["embed_tokens.weight"] = torch.zeros(target.config.vocab_size, head.config.hidden_size)
    save_file(state, str(tmp_path / "model.safetensors"))
    back = load_head(tmp_path)
    assert torch.equal(back.t2d, head.t2d)


def test_a_head_for_other_weights_or_shapes_is_refused(target, tmp_path: Path) -> None:
    head = random_head(target)
    save_head(head, tmp_path, {"target_sha256": "a" * 64})
    with pytest.raises(EngineError, match="trained on other weights"):
        load_head(tmp_path, target_sha256="b" * 64)
    other = tiny_llama(seed=0, layers=2, hidden=32, tokenizer=chatml_tokenizer())
    with pytest.raises(EngineError, match="does not fit this target"):
        load_head(tmp_path, target_config=other.config)
    (tmp_path / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(EngineError, match="cannot be read"):
        load_head(tmp_path)
    with pytest.raises(EngineError, match="no draft head"):
        load_head(tmp_path / "missing")


def test_sampled_eagle_follows_the_target_distribution_at_every_position(target, trained) -> None:
    """Chi-square, seed 0: 6,000 rounds of K = 3 from one context with the trained
    head (temperature 1, top-k 6); at each of the round's positions the emitted
    token after the most frequent prefix must follow the target's probabilities
    (p > 0.001). The head's vocabulary leaves out ids the target can emit, so the
    residual carries them."""
    from scipy.stats import chisquare

    from specchat.engine.decode.head import HeadDrafter
    from specchat.engine.decode.speculative import speculative_round

    head = trained[2].head
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = HeadDrafter(head, runner)
    cfg = DecodeConfig(mode=Mode.EAGLE, temperature=1.0, top_k=6)
    seq = session(target, None).render([("user", PROMPT)])  # a context like those it trained on
    gen = torch.Generator().manual_seed(0)
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for _ in range(6000):
        res = speculative_round(runner, drafter, seq, 3, cfg, gen)
        out = [t.token_id for t in res.tokens]
        for i, tok in enumerate(out):
            by_prefix.setdefault(tuple(out[:i]), []).append(tok)
        runner.crop_to(len(seq) - 1)
        drafter.rollback(len(seq))
    from specchat.engine.decode.sampling import logits_to_probs

    for depth in range(3):
        prefix, seen = max(((p, s) for p, s in by_prefix.items() if len(p) == depth), key=lambda x: len(x[1]))
        with torch.no_grad():
            logits = target(torch.tensor([seq + list(prefix)])).logits[0, -1]
        p = logits_to_probs(logits, 1.0, 6, 1.0)
        support = torch.nonzero(p > 0).flatten().tolist()
        counts = [seen.count(t) for t in support]
        assert len(seen) >= 40, (depth, len(seen))  # enough rounds reach this position
        assert sum(counts) == len(seen)  # nothing outside the target's top-6
        q = p.double()[support]
        expected = (q / q.sum() * len(seen)).tolist()
        assert chisquare(counts, expected).pvalue > 0.001, (depth, len(seen))


def test_the_training_loop_ends_at_the_decayed_rate(trained) -> None:
    """The checkpoint's optimizer holds the rate of the last step: 60 steps with a decay
    over the last 0.2 of them (12), so its last step ran at 1/12 of --lr."""
    _tgt, opts, _result = trained
    ckpt = torch.load(opts.out / "work" / "checkpoint.pt", weights_only=False)
    assert ckpt["optim"]["param_groups"][0]["lr"] == pytest.approx(opts.lr * (1 / 60) / 0.2)


def test_training_through_train_draft_accepts_more_than_a_random_head(trained) -> None:
    """The held-out replies' first-draft acceptance after 60 steps must beat the
    untrained head's by 0.1 or more (seed 0; measured on this tiny model: 0.16 before,
    see the assertion message for after). Then an interrupted run (its checkpoint)
    resumes at its step, and the saved head names the weights it was trained on."""
    tgt, opts, result = trained
    folder = opts.out
    assert (folder / "model.safetensors").is_file()
    held = [q for q in DataStore(folder / "work").load()[0] if q.held_out]
    assert held
    after = result.report["acceptance_by_position"][0]
    untrained_head = new_head(tgt, opts, result.head.draft_to_target, weights_id(tgt)).eval()
    before = validate(untrained_head, tgt.model.get_input_embeddings(), held)["acceptance_by_position"][0]
    assert after >= before + 0.1, (after, before)
    said: list[str] = []
    train(tgt, TrainOptions(**{**vars(opts), "max_steps": 65}), say=said.append)
    assert any("resuming training at step 60" in s for s in said), said
    assert load_head(folder, target_sha256=weights_id(tgt)).config.target_sha256 == weights_id(tgt)


def test_the_report_gives_acceptance_on_replies_trained_on_beside_the_held_out(trained) -> None:
    """The report's `seen_top1` is the first-draft acceptance on greedy training replies
    (one spread over the prompts for each held-out reply; sampled replies and answers are
    not read as greedy), and the terminal report names memorizing only where that is far
    above the held-out figure."""
    from dataclasses import replace

    from specchat.engine.tools.train_draft import MEMORIZING, describe_report, seen_replies

    tgt, opts, result = trained
    seqs = DataStore(opts.out / "work").load()[0]
    held = [q for q in seqs if q.held_out]
    seen = seen_replies([q for q in seqs if not q.held_out], len(held))
    assert len(seen) == len(held) and all(q.reply and not q.sampled and not q.held_out for q in seen)
    assert len({tuple(q.ids[: q.start]) for q in seen}) == len(seen)  # other prompts
    want = validate(result.head.eval(), tgt.model.get_input_embeddings(), seen)["acceptance_by_position"][0]
    assert result.report["seen_top1"] == pytest.approx(want)
    assert [q.reply for q in seen_replies([Sequence([1], 0), Sequence([1], 0, reply=True, sampled=True)], 1)] == []
    held_top1 = result.report["acceptance_by_position"][0]
    for seen_top1, says in ((held_top1 + MEMORIZING + 0.01, True), (held_top1 + MEMORIZING - 0.01, False)):
        text = describe_report(replace(result, report={**result.report, "seen_top1": seen_top1}))
        assert f"replies it trained on: {seen_top1:.2f}" in text
        assert ("memorizes" in text) == says, text


def test_feature_noise_scales_with_each_layers_rms() -> None:
    """Two feature layers 1000x apart in scale: each row's slice of each layer moves by at
    most share x its own RMS, and by a fair part of it (uniform noise: RMS share / sqrt 3);
    one absolute width would drown the small layer or leave the large one untouched."""
    from specchat.engine.tools.train_draft import noisy

    torch.manual_seed(0)
    small, large = torch.randn(50, 64), 1000 * torch.randn(50, 64)
    feats = torch.cat([small, large], dim=-1)
    got = noisy(feats, 2, 0.2)
    assert got.shape == feats.shape
    for part, moved in ((small, got[:, :64] - small), (large, got[:, 64:] - large)):
        rms = part.pow(2).mean(-1, keepdim=True).sqrt()
        assert (moved.abs() <= 0.2 * rms + 1e-3).all()
        ratio = float((moved.pow(2).mean(-1, keepdim=True).sqrt() / rms).mean())
        assert 0.09 < ratio < 0.14, ratio  # 0.2 / sqrt(3) = 0.115
    assert torch.equal(noisy(feats, 2, 0.0), feats)


def test_learning_rate_warms_up_holds_then_decays_to_zero_over_the_last_share() -> None:
    base = 3e-4
    assert learning_rate(base, 0, 0.0, 0.2) == pytest.approx(base / 50)
    assert learning_rate(base, 49, 0.1, 0.2) == pytest.approx(base)
    assert learning_rate(base, 500, 0.8, 0.2) == pytest.approx(base)
    assert learning_rate(base, 500, 0.9, 0.2) == pytest.approx(base / 2)
    assert learning_rate(base, 500, 1.0, 0.2) == 0.0
    assert learning_rate(base, 500, 1.3, 0.2) == 0.0  # past the budget: still zero, never negative
    assert learning_rate(base, 500, 0.99, 0.0) == pytest.approx(base)  # --decay 0: constant


def test_featurize_keeps_what_gives_the_target_logits_back(target) -> None:
    """The label of a position is the target's LM head over the kept hidden state: it
    must give the target's own logits (here over the whole vocabulary)."""
    runner = ModelRunner(target, torch.device("cpu"))
    seq = Sequence(list(range(3, 30)), 10)
    featurize(runner, seq, (0, 1, 3))
    assert seq.feats is not None and seq.last is not None
    assert seq.feats.shape == (27, 3 * target.config.hidden_size)
    tgt = loaded(target, tokenizer=chatml_tokenizer())
    logits = label_logits(tgt, torch.arange(target.config.vocab_size))(seq.last)
    with torch.no_grad():
        want = target(torch.tensor([seq.ids])).logits[0]
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9  # near-ties may flip
    torch.testing.assert_close(logits, want, rtol=0.05, atol=0.05)  # bfloat16 storage


def test_a_broken_head_in_the_cache_is_a_note_not_a_failed_start(target, tmp_path: Path) -> None:
    import dataclasses

    from specchat.engine import paths
    from specchat.engine.decode.head import load_draft_head

    tgt = dataclasses.replace(loaded(target, tokenizer=chatml_tokenizer()), weights_sha256="ab" * 32)
    folder = paths.heads_dir(tmp_path) / ("ab" * 32)[:20]
    save_head(random_head(target), folder, {"target_sha256": "ab" * 32})
    head, note = load_draft_head("auto", tgt, tmp_path)
    assert head is not None and note and "draft head" in note
    (folder / "model.safetensors").write_bytes(b"torn")
    head, note = load_draft_head("auto", tgt, tmp_path)
    assert head is None and note and "was not loaded" in note and "cannot be read" in note
    with pytest.raises(EngineError, match="cannot be read"):  # asked for by name: an error
        load_draft_head(str(folder), tgt, tmp_path)


def test_batched_replies_are_the_chats_greedy_replies_in_the_prompts_order(target, monkeypatch) -> None:
    """Training replies are decoded several prompts at a time, left-padded: on a float32
    model (no near-tie to flip) each is the reply the chat gives the prompt alone, eos
    included, in the prompts' order, one item per prompt; a conversation prompt (a system
    turn, earlier turns) reaches the model whole on both paths; the model's attention path
    is put back after; a deadline already passed asks nothing."""
    import time as _time

    from specchat.engine.decode.text import render_chat
    from specchat.engine.tools.train_draft import batched_replies, target_replies
    from specchat.engine.tools.train_prompts import Prompt, chat

    tgt = loaded(target, tokenizer=chatml_tokenizer())
    prompts: list[Prompt] = [
        "one two", "three four one two three four", "two", "four three two one", "one",
        (("system", "two two"), ("user", "one three")),
        (("user", "four"), ("assistant", "three one"), ("user", "two four")),
    ]
    first = next(target_replies(tgt, prompts[1:2], 12, _time.monotonic() + 600, lambda _e: None, False))
    assert first is not None
    # A token of that reply ends replies: some stop of themselves, mid-batch.
    monkeypatch.setattr(type(tgt), "eos_ids", property(lambda _s: frozenset({first.ids[first.start + 5]})))
    alone = list(target_replies(tgt, prompts, 12, _time.monotonic() + 600, lambda _e: None, False))
    impl = target.config._attn_implementation
    # a checkpoint's generation defaults do not change what greedy means here
    monkeypatch.setattr(target.generation_config, "repetition_penalty", 3.0, raising=False)
    together = list(batched_replies(tgt, prompts, 12, _time.monotonic() + 600, lambda _e: None, batch=2))
    assert target.config._attn_implementation == impl
    assert len(together) == len(prompts) and all(q is not None for q in alone)
    for a, b in zip(alone, together, strict=True):
        assert b is not None and a is not None
        assert (b.ids, b.start, b.reply, b.held_out) == (a.ids, a.start, True, False)
    for p, a in zip(prompts, alone, strict=True):
        assert a is not None and a.ids[: a.start] == render_chat(tgt.tokenizer, chat(p))
    assert "three one" in tgt.tokenizer.decode(alone[-1].ids[: alone[-1].start])
    assert "two two" in tgt.tokenizer.decode(alone[-2].ids[: alone[-2].start])
    assert any(q.ids[-1] in tgt.eos_ids for q in alone)  # some stopped of themselves
    assert not list(batched_replies(tgt, prompts, 12, _time.monotonic() - 1, lambda _e: None))


def test_sampled_replies_are_the_seeds_and_leave_the_global_generator_alone(target) -> None:
    """Later rounds sample the replies: the same seed gives the same replies, another
    seed others, the prompts stay as they are, and the caller's random state is untouched."""
    import time as _time

    from specchat.engine.decode.text import render_chat
    from specchat.engine.tools.train_draft import batched_replies
    from specchat.engine.tools.train_prompts import chat

    tgt = loaded(target, tokenizer=chatml_tokenizer())
    prompts = ["one two", "three four one two three four", "two", "four three two one", "one"]

    def replies(seed: int | None) -> list[list[int]]:
        got = batched_replies(tgt, prompts, 12, _time.monotonic() + 600, lambda _e: None, batch=2, seed=seed)
        return [q.ids if q is not None else [] for q in got]

    torch.manual_seed(7)
    state = torch.get_rng_state()
    greedy, first, again, other = replies(None), replies(1), replies(1), replies(2)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == again and first != other and first != greedy
    for p, a in zip(prompts, first, strict=True):
        asked = render_chat(tgt.tokenizer, chat(p))
        assert a[: len(asked)] == asked and len(a) > len(asked)


def test_ctrl_c_while_collecting_keeps_what_was_collected(target, tmp_path: Path) -> None:
    """A KeyboardInterrupt in the middle of the replies (raised where the run checks for
    a stop) leaves work/data/ with the replies featurized so far; the next run asks on."""
    import time as _time

    from specchat.engine.tools.train_draft import Budget, collect
    from specchat.engine.tools.train_prompts import PROMPTS

    tgt = loaded(target, tokenizer=chatml_tokenizer())
    # 48 prompts: 6 held out, 42 to train on, asked twice (greedy, then sampled)
    opts = TrainOptions(reply_tokens=8, max_texts=4, reply_rounds=2, prompts=PROMPTS[:48])
    calls = {"n": 0}

    def stop_after_five() -> bool:
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return False

    budget = Budget(_time.monotonic(), 600)
    with pytest.raises(KeyboardInterrupt):
        collect(tgt, opts, tmp_path, budget, lambda _e: None, lambda _m: None, stop_after_five)
    seqs, state = DataStore(tmp_path).load()
    assert seqs and all(q.feats is not None for q in seqs)
    held = sum(q.held_out for q in seqs)
    # Stopped at the sixth check, before the sixth held-out prompt: the five replies asked
    # before it are kept, and no training prompt was asked yet.
    assert calls["n"] == 6 and held == 5 and len(seqs) == held and state["asked"] == 0
    assert all(q.reply for q in seqs)
    said: list[str] = []
    more = collect(tgt, opts, tmp_path, budget, lambda _e: None, said.append, lambda: False)
    assert len(more) > len(seqs) and any("resuming" in s for s in said)
    # two rounds over the training prompts: the second asks each again, sampled
    assert DataStore(tmp_path).load()[1]["asked"] == 2 * 42
    replies = [q for q in more if q.reply and not q.held_out]
    assert len(replies) == 2 * 42
    greedy, sampled = replies[:42], replies[42:]
    assert [q.ids[: q.start] for q in greedy] == [q.ids[: q.start] for q in sampled]
    assert not any(q.sampled for q in greedy) and all(q.sampled for q in sampled)
    assert sum(a.ids != b.ids for a, b in zip(greedy, sampled, strict=True)) > 21
    # --no-collect: the data as it is, nothing asked of the target
    frozen = collect(tgt, TrainOptions(**{**vars(opts), "collect": False}), tmp_path, budget,
                     lambda _e: None, said.append, lambda: False)  # fmt: skip
    assert len(frozen) == len(more) and any("--no-collect" in s for s in said)
    with pytest.raises(ValueError, match="no data collected before"):
        collect(tgt, TrainOptions(**{**vars(opts), "collect": False}), tmp_path / "empty", budget,
                lambda _e: None, said.append, lambda: False)  # fmt: skip


def _seq(n: int) -> Sequence:
    return Sequence([n, n + 1, n + 2], 1, reply=n % 2 == 0, feats=torch.full((3, 4), float(n)),
                    last=torch.zeros(3, 2))


def test_collected_data_is_saved_in_files_each_written_once(tmp_path: Path, monkeypatch) -> None:
    """Saved as collect() saves (every SHARD sequences, and once at the end), each full
    file is written once and only the last, partial one again: what a save writes does
    not grow with what was collected. A later load gives back every sequence and the
    state; a torn state file gives nothing rather than a wrong count."""
    from specchat.engine.tools import train_draft as td

    written: list[str] = []
    real = td._replace
    monkeypatch.setattr(td, "_replace", lambda path, write: (written.append(path.name), real(path, write)))
    store, seqs = DataStore(tmp_path), []
    for n in range(4 * td.SHARD + 3):
        seqs.append(_seq(n))
        if len(seqs) % td.SHARD == 0:
            store.save(seqs, {"asked": n, "texts": 1})
    store.save(seqs, {"asked": 99, "texts": 2})
    files = [w for w in written if w.endswith(".pt")]
    assert sorted(files) == ["00000.pt", "00001.pt", "00002.pt", "00003.pt", "00004.pt"]
    got, state = DataStore(tmp_path).load()
    assert state == {"asked": 99, "texts": 2}
    assert [q.ids for q in got] == [q.ids for q in seqs]
    assert all(torch.equal(a.feats, b.feats) and a.reply == b.reply for a, b in zip(got, seqs, strict=True))
    # a store that resumes writes only the partial file and what follows it
    written.clear()
    again = DataStore(tmp_path)
    more = again.load()[0] + [_seq(500)]
    again.save(more, state)
    assert [w for w in written if w.endswith(".pt")] == ["00004.pt"]
    assert len(DataStore(tmp_path).load()[0]) == len(seqs) + 1
    (tmp_path / "data" / "state.json").write_text("{not json")
    assert DataStore(tmp_path).load() == ([], {"asked": 0, "texts": 0})


def test_a_data_pt_from_before_is_read_and_carried_over(tmp_path: Path) -> None:
    """work/data.pt, one file as earlier versions saved it, loads (its sequences marked
    replies or answers from the count asked), and the next save moves it into files."""
    old = [_seq(n) for n in range(30)]
    rows = [{k: v for k, v in vars(q).items() if k not in ("reply", "sampled")} for q in old]
    torch.save({"state": {"asked": 3, "texts": 27}, "seqs": rows}, tmp_path / "data.pt")
    seqs, state = DataStore(tmp_path).load()
    assert [q.ids for q in seqs] == [q.ids for q in old] and state == {"asked": 3, "texts": 27}
    assert [q.reply for q in seqs[:4]] == [True, True, True, False]
    store = DataStore(tmp_path)
    store.load()
    store.save(seqs, state)
    assert not (tmp_path / "data.pt").exists()
    again, state2 = DataStore(tmp_path).load()
    assert [q.ids for q in again] == [q.ids for q in old] and state2 == state


def test_replies_are_drawn_reply_weight_times_as_often_and_old_data_says_which() -> None:
    """One reply among seven sequences: weight 6 draws it 6/12 of the time, weight 1 1/7.
    12,000 draws each (seed 0): a share's binomial sd is at most 0.005, the bound 0.02."""
    import random as _random

    from specchat.engine.tools.train_draft import _mark_replies, sampler

    seqs = [Sequence([1, 2], 1, reply=True)] + [Sequence([1, 2], 1) for _ in range(6)]
    for weight, share in ((6.0, 0.5), (1.0, 1 / 7)):
        draw = sampler(seqs, weight, _random.Random(0))
        drawn = sum(draw() is seqs[0] for _ in range(12_000)) / 12_000
        assert abs(drawn - share) < 0.02, (weight, drawn)
    # data.pt from before sequences were marked: held out first, then one training reply
    # per prompt asked, then the answers
    rows = [{"held_out": h} for h in (True, True, False, False, False)]
    _mark_replies(rows, asked=2)
    assert [r["reply"] for r in rows] == [True, True, True, True, False]


def test_validation_counts_every_chain_as_one_chain_at_a_time_would(trained) -> None:
    """validate() takes all chains of a reply in one tensor operation per draft position;
    a chain leaving at row m, counted alone, must give the same acceptance (the trained
    head of the fixture, its held-out replies, K=4)."""
    tgt, opts, result = trained
    held = [q for q in DataStore(opts.out / "work").load()[0] if q.held_out]
    head, embed, k = result.head.eval(), tgt.model.get_input_embeddings(), 4
    t2d = head.target_to_draft()
    reach, chains = torch.zeros(k), 0
    with torch.inference_mode():
        for seq in held:
            ids = torch.tensor(seq.ids)
            outs = head.unrolled(embed(ids[1:]).float(), seq.feats[: len(ids) - 1].float(), k)
            greedy = torch.cat([t2d[ids[2:]], t2d.new_full((1,), -1)])
            for m in range(max(seq.start - 2, 0), len(ids) - 1 - k):
                ok = True
                for i in range(k):
                    ok = ok and int(outs[i][m].argmax()) == int(greedy[m + i])  # from row i
                    reach[i] += ok
                chains += 1
    got = validate(head, embed, held, k)
    assert got["chains"] == chains > 0
    assert got["mean_accepted"][k] == pytest.approx(float(reach.sum()) / chains)
    assert got["acceptance_by_position"][0] == pytest.approx(float(reach[0]) / chains)


def test_train_draft_cli_defaults_are_the_training_defaults() -> None:
    """The command's parser is built without torch (a cheap start), so it repeats
    TrainOptions' defaults: they must not drift apart."""
    from specchat.tui.cli import build_parser

    args = build_parser().parse_args(["train-draft"])
    opts = TrainOptions()
    got = (args.minutes, args.head_vocab, args.intermediate, args.lr, args.decay,
           args.reply_tokens, args.reply_weight, args.reply_rounds, args.seed, args.collect,
           args.feature_noise)
    want = (opts.minutes, opts.draft_vocab, opts.intermediate, opts.lr, opts.decay,
            opts.reply_tokens, opts.reply_weight, opts.reply_rounds, opts.seed, opts.collect,
            opts.feature_noise)
    assert got == want


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--minutes", "0"], "--minutes must be > 0"),
        (["--minutes", "nan"], "--minutes must be > 0"),
        (["--decay", "1.5"], "--decay must be between 0 and 1"),
        (["--decay", "nan"], "--decay must be between 0 and 1"),
        (["--reply-weight", "0"], "--reply-weight must be a number > 0"),
        (["--reply-weight", "inf"], "--reply-weight must be a number > 0"),
        (["--reply-rounds", "0"], "--reply-rounds must be >= 1"),
        (["--head-vocab", "0"], "--head-vocab must be >= 1"),
        (["--feature-noise", "-0.1"], "--feature-noise must be a number >= 0"),
        (["--feature-noise", "nan"], "--feature-noise must be a number >= 0"),
    ],
)
def test_train_draft_refuses_bad_flags_with_a_message_before_loading(flags, message, capsys) -> None:
    """A bad flag is a line saying which and why, before any model loads."""
    from specchat.tui.cli import main

    assert main(["train-draft", *flags, "--target", "/nonexistent/model"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "nonexistent" not in err
