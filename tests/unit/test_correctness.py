"""Wrong-output defects, each pinned by a test that failed before its fix.

Tiny models built in code (tests/tinymodels.py); greedy unless stated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specchat.engine.config import MAX_K, DecodeConfig, Mode
from specchat.engine.decode import speculative
from specchat.engine.decode.session import ChatSession
from specchat.engine.decode.speculative import ModelDrafter, accept_or_resample
from specchat.engine.events import Failed, TokenEvent, TurnFinished, TurnStarted
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import loaded, tiny_llama, tiny_tokenizer
from tests.tinymodels import pair_session as make
from tests.tinymodels import turn_finished as finished


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4, max_positions=256)


def tokens(events: list[object]) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


# -- stop strings and EOS ---------------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.SPEC])
def test_eos_ends_the_reply_when_its_text_ends_in_a_stop_prefix(
    target: torch.nn.Module, mode: Mode
) -> None:
    """A reply whose text at EOS ends with the first character of a stop string stops at EOS.

    Before the fix the stop-string hold-back skipped the EOS check: decoding went
    on to max_new_tokens.
    """
    cfg = DecodeConfig(mode=mode, k=2, max_new_tokens=30)
    ids = [e.token_id for e in tokens(list(make(target).stream("Once upon a time", cfg)))]
    # Declare a token of the reply the end of sequence, at its first occurrence.
    j = next(i for i in range(6, len(ids)) if ids[i] not in ids[:i])
    s = make(target)
    s.eos = frozenset({ids[j]})
    before = tiny_tokenizer().decode(ids[:j], skip_special_tokens=True)
    assert before.strip()
    stop = before[-1] + "\x00never"  # the reply at EOS ends with this stop string's prefix
    events = list(s.stream("Once upon a time", cfg.with_(stop=(stop,))))
    stats = finished(events).stats
    assert stats.stop_reason == "eos"
    assert [e.token_id for e in tokens(events)] == ids[: j + 1]
    assert stats.text == before
    assert "".join(e.text for e in tokens(events)) == stats.text


# -- early exit's estimated K/V ---------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.PLAIN, Mode.SPEC])
def test_a_lossless_turn_after_an_early_exit_turn_reads_no_estimated_kv(
    target: torch.nn.Module, tmp_cache: Path, mode: Mode
) -> None:
    """The K/V an early exit fills in for skipped layers must not condition a lossless turn.

    The turn after an early-exit turn must score exactly as after a fresh
    prefill of the same conversation (p_target to float32 noise of the block
    sizes; the estimated K/V moved it by far more before the fix).
    """
    lossy = DecodeConfig(mode=Mode.EARLY_EXIT, exit_threshold=0.0, max_new_tokens=12)
    cfg = DecodeConfig(mode=mode, k=2, max_new_tokens=10)
    s = make(target)
    first = list(s.stream("Once upon a time", lossy))
    assert any(e.exit_layer is not None for e in tokens(first))
    after = tokens(list(s.stream("and then?", cfg)))

    fresh = make(target)
    fresh.reset(s.messages[:2])
    want = tokens(list(fresh.stream("and then?", cfg)))
    assert [e.token_id for e in after] == [e.token_id for e in want]
    got_p = torch.tensor([e.p_target for e in after])
    want_p = torch.tensor([e.p_target for e in want])
    torch.testing.assert_close(got_p, want_p, rtol=1e-4, atol=1e-6)


def test_early_exit_turns_keep_reusing_their_own_cache(
    target: torch.nn.Module, tmp_cache: Path
) -> None:
    """Lossy turns may reuse estimated K/V (approximate by design); lossless ones recompute it."""
    lossy = DecodeConfig(mode=Mode.EARLY_EXIT, exit_threshold=0.0, max_new_tokens=8)

    def second_turn(cfg: DecodeConfig) -> TurnStarted:
        s = make(target)
        list(s.stream("Once upon a time", lossy))
        started = list(s.stream("and then?", cfg))[0]
        assert isinstance(started, TurnStarted)
        return started

    again = second_turn(lossy)
    exact = second_turn(lossy.with_(mode=Mode.PLAIN))
    assert again.prompt_tokens == exact.prompt_tokens
    assert again.new_prompt_tokens < exact.new_prompt_tokens < exact.prompt_tokens


# -- a mode switch between turns --------------------------------------------------


def test_the_draft_cache_follows_the_conversation_across_a_turn_in_another_mode(
    target: torch.nn.Module,
) -> None:
    """spec, lookup, spec: the third turn's draft scores as if every turn had been spec.

    Before the fix only the current mode's drafter was rolled back, so the draft
    model kept K/V of turn 1's tokens past where turn 2's conversation differs.
    """
    spec = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=12)
    prompts = ["Once upon a time", "def add(a, b):", "and then?"]

    def run(modes: list[Mode]) -> list[TokenEvent]:
        s = make(target)
        out: list[TokenEvent] = []
        for prompt, mode in zip(prompts, modes, strict=True):
            out = tokens(list(s.stream(prompt, spec.with_(mode=mode))))
        return out

    switched = run([Mode.SPEC, Mode.LOOKUP, Mode.SPEC])
    always = run([Mode.SPEC, Mode.SPEC, Mode.SPEC])
    assert [e.token_id for e in switched] == [e.token_id for e in always]
    assert [e.provenance for e in switched] == [e.provenance for e in always]
    p_switched = [e.p_draft for e in switched if e.p_draft is not None]
    p_always = [e.p_draft for e in always if e.p_draft is not None]
    assert p_switched
    torch.testing.assert_close(torch.tensor(p_switched), torch.tensor(p_always), rtol=1e-4, atol=1e-6)


# -- K and the row-wise limit -----------------------------------------------------


def test_k_is_bounded_where_verify_blocks_stay_row_wise() -> None:
    DecodeConfig(k=MAX_K, k_max=MAX_K)
    with pytest.raises(ValueError, match=f"1..{MAX_K}"):
        DecodeConfig(k=MAX_K + 1)
    with pytest.raises(ValueError, match=f"<= {MAX_K}"):
        DecodeConfig(k_max=64)


def test_greedy_spec_at_the_largest_k_equals_plain(target: torch.nn.Module) -> None:
    draft = target  # the target drafts for itself: every block is MAX_K + 1 rows long
    plain = DecodeConfig(mode=Mode.PLAIN, max_new_tokens=40)
    s = ChatSession(loaded(target), loaded(draft, "draft"))
    want = [e.token_id for e in tokens(list(s.stream("Once upon a time", plain)))]
    s = ChatSession(loaded(target), loaded(draft, "draft"))
    events = list(s.stream("Once upon a time", plain.with_(mode=Mode.SPEC, k=MAX_K)))
    assert [e.token_id for e in tokens(events)] == want
    assert max(e.position or 0 for e in tokens(events)) == MAX_K  # a whole block was accepted


# -- a draft with a larger vocabulary ----------------------------------------------


def wide_draft(target: torch.nn.Module, extra: int = 16) -> torch.nn.Module:
    """A draft with `extra` ids the target lacks, which it rates above every other token."""
    vocab = int(target.config.vocab_size)
    draft = tiny_llama(seed=1, layers=2, vocab=vocab + extra)
    with torch.no_grad():
        draft.lm_head.weight[vocab:] = draft.lm_head.weight[:vocab].abs().max(0).values * 3
    return draft


def test_draft_with_a_larger_vocabulary_never_drafts_ids_the_target_lacks(
    target: torch.nn.Module,
) -> None:
    vocab = int(target.config.vocab_size)
    drafter = ModelDrafter(ModelRunner(wide_draft(target), torch.device("cpu")), vocab=vocab)
    seq = tiny_tokenizer()("Once upon a time")["input_ids"]
    for cfg in (DecodeConfig(), DecodeConfig(temperature=1.0, top_p=0.9)):
        drafter.reset()
        gen = torch.Generator().manual_seed(0)
        prop = drafter.propose(seq, 4, cfg, gen)
        assert prop.logits is not None and prop.logits.shape == (4, vocab)
        assert int(prop.ids.max()) < vocab
        if prop.probs is not None:  # sampled from exactly the rows acceptance uses
            assert prop.probs.shape == (4, vocab)
            torch.testing.assert_close(prop.probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spec_with_a_wider_draft_vocabulary_runs_and_greedy_equals_plain(
    target: torch.nn.Module, temperature: float
) -> None:
    cfg = DecodeConfig(mode=Mode.SPEC, k=3, max_new_tokens=16, temperature=temperature, seed=3)
    s = ChatSession(loaded(target), loaded(wide_draft(target), "draft"))
    events = list(s.stream("Once upon a time", cfg))
    assert finished(events).stats.tokens == 16
    assert all(e.token_id < target.config.vocab_size for e in tokens(events))
    if temperature == 0.0:
        plain = ChatSession(loaded(target))
        want = tokens(list(plain.stream("Once upon a time", cfg.with_(mode=Mode.PLAIN))))
        assert [e.token_id for e in tokens(events)] == [e.token_id for e in want]


# -- the acceptance test ----------------------------------------------------------


def test_a_token_the_target_rules_out_is_never_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """u = 0 exactly (torch.rand can return it) must not accept a token with p_target = 0."""
    vocab = 5
    p_target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5])  # [k+1, V], k = 1
    p_draft = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])
    draft_ids = torch.tensor([0])
    real_rand = torch.rand

    def zeros(*size: int, **kw: object) -> torch.Tensor:
        kw.pop("generator", None)
        return torch.zeros(*size, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(speculative.torch, "rand", zeros)
    n_acc, last = accept_or_resample(p_target, p_draft, draft_ids, torch.Generator().manual_seed(0))
    monkeypatch.setattr(speculative.torch, "rand", real_rand)
    assert int(n_acc) == 0
    assert int(last) in (1, 2)  # from the residual, never the ruled-out token
    assert vocab == p_target.shape[1]


# -- nothing the user had is lost ------------------------------------------------


def test_a_prompt_that_overflows_keeps_the_history(target: torch.nn.Module) -> None:
    s = make(target)
    cfg = DecodeConfig(max_new_tokens=8)
    list(s.stream("Once upon a time", cfg))
    list(s.stream("and then?", cfg))
    history = s.messages
    events = list(s.stream("word " * 400, cfg))
    assert isinstance(events[-1], Failed) and "context holds" in events[-1].message
    assert s.messages == history  # before the fix, older turns were dropped before failing
    assert finished(list(s.stream("more", cfg))).stats.tokens == 8


def test_a_full_context_drops_turns_in_steps_and_keeps_the_conversation(
    target: torch.nn.Module,
) -> None:
    """Once the window moves, the next turns reuse the cache instead of re-prefilling it all."""
    s = make(target, system_prompt="sys")
    cfg = DecodeConfig(max_new_tokens=16)
    started: list[TurnStarted] = []
    for i in range(14):
        events = list(s.stream(f"turn {i}: " + "story " * 3, cfg))
        assert isinstance(events[-1], TurnFinished)
        (first,) = [e for e in events if isinstance(e, TurnStarted)]
        started.append(first)
    assert len(s.messages) == 28  # every turn kept
    assert s.messages[-2][1].startswith("turn 13")
    # A turn re-prefills the conversation when it reuses less than half of what the
    # cache held; dropping one turn at a time did that on every turn once the context
    # was full (10 of these 14), dropping in steps on every third or fourth.
    reprefills = [
        i
        for i in range(1, len(started))
        if started[i].prompt_tokens - started[i].new_prompt_tokens < started[i - 1].prompt_tokens // 2
    ]
    assert len(reprefills) in range(1, 5), [(t.prompt_tokens, t.new_prompt_tokens) for t in started]


def test_streamed_text_equals_the_reply_wherever_the_limit_cuts(target: torch.nn.Module) -> None:
    """A reply cut inside a multi-byte character streams and keeps the same text."""
    for n in range(1, 25):
        events = list(make(target).stream("emoji 🙂 東京", DecodeConfig(max_new_tokens=n, k=2)))
        streamed = "".join(e.text for e in tokens(events))
        assert finished(events).stats.text == streamed, n


def test_a_cut_reply_continues_to_what_an_uncut_reply_says(target: torch.nn.Module) -> None:
    cfg = DecodeConfig(max_new_tokens=40, k=2)
    whole = finished(list(make(target).stream("emoji 🙂 東京", cfg))).stats
    assert whole.stop_reason == "max_tokens"
    for cut in (7, 13, 22):
        s = make(target)
        first = finished(list(s.stream("emoji 🙂 東京", cfg.with_(max_new_tokens=cut)))).stats
        assert first.stop_reason == "max_tokens" and s.can_continue
        events = list(s.continue_reply(cfg.with_(max_new_tokens=40 - cut)))
        more = finished(events).stats
        assert more.tokens == 40 - cut
        assert more.text == whole.text, cut
        assert first.text + "".join(e.text for e in tokens(events)) == whole.text
        assert s.messages[-1] == ("assistant", whole.text)
        assert len(s.messages) == 2


def test_only_a_cut_reply_can_be_continued(target: torch.nn.Module) -> None:
    s = make(target)
    events = list(s.continue_reply(DecodeConfig()))
    assert isinstance(events[-1], Failed) and "no cut reply" in events[-1].message
    base = finished(list(s.stream("hello", DecodeConfig(max_new_tokens=30)))).stats.text
    assert s.can_continue
    s = make(target)
    stats = finished(list(s.stream("hello", DecodeConfig(max_new_tokens=30, stop=(base[4:7],)))))
    assert stats.stats.stop_reason == "stop_string" and not s.can_continue


# -- a draft made of a model's first layers ---------------------------------------


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_layer_truncated_draft_scores_row_wise_like_its_runner_says(
    native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The truncated copy shares the layers, whose attention reads the original's config:
    switching only the copy's config left its layers on SDPA (block != single rows)."""
    from specchat.engine.config import QuantMode
    from specchat.engine.model import quant
    from tests.tinymodels import tiny_llama as fresh

    monkeypatch.setenv("SPECCHAT_NATIVE_DECODER", native)
    model = fresh(seed=2, layers=4)
    quant.apply(model, QuantMode.W8A8)
    runner = ModelRunner(layer_truncated(model, 2), torch.device("cpu"))
    seq = list(range(5, 25))
    runner.prefill(seq)
    block = runner.feed(seq[-1:] + [7, 8, 9], keep=4)
    runner.crop_to(len(seq) - 1)
    rows = torch.cat([runner.feed([t], keep=1) for t in seq[-1:] + [7, 8, 9]])
    assert torch.equal(block, rows)


def test_the_ready_notes_say_where_greedy_identity_holds(target: torch.nn.Module) -> None:
    notes = make(target).ready.notes
    (line,) = [n for n in notes if n.startswith("greedy exactness: ")]
    assert line == "greedy exactness: " + make(target).target_runner.exactness.reason
