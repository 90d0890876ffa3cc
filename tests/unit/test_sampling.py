"""Sampling functions and the speculative acceptance rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specchat.engine.decode import sampling, speculative
from specchat.engine.decode.sampling import (
    align_vocab,
    logits_to_probs,
    residual,
    sample,
    token_probs,
)
from tests.tinymodels import ConstantCoin


def test_temperature_one_is_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(logits_to_probs(logits), torch.softmax(logits, -1))


def test_low_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert logits_to_probs(logits, 0.1)[2] > logits_to_probs(logits, 1.0)[2]


def test_greedy_temperature_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(3), 0.0)


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]])
    p = logits_to_probs(logits, top_k=2)
    assert (p > 0).sum().item() == 2
    assert p[0, 1] > 0 and p[0, 2] > 0
    assert torch.isclose(p.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_covering_set() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = logits_to_probs(probs.log(), top_p=0.75)
    # 0.5 alone < 0.75, 0.5+0.3 >= 0.75: two tokens stay, renormalised.
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    # The most probable token always stays.
    assert logits_to_probs(probs.log(), top_p=0.01)[0] == 1.0


def test_residual_normalised_and_exact() -> None:
    pt = torch.tensor([0.5, 0.3, 0.2])
    pd = torch.tensor([0.2, 0.5, 0.3])
    r = residual(pt, pd)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual(pt, pt), pt)  # no mass left: fall back to p_target


def test_token_probs_matches_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ids = torch.tensor([3, 7, 0, 49])
    expect = torch.softmax(logits, -1)[torch.arange(4), ids]
    assert torch.allclose(token_probs(logits, ids), expect, atol=1e-6)


def test_align_vocab_pads_and_cuts() -> None:
    x = torch.zeros(2, 5)
    assert align_vocab(x, 7).shape == (2, 7)
    assert torch.isinf(align_vocab(x, 7)[:, 5:]).all()
    assert align_vocab(x, 3).shape == (2, 3)


def test_sample_follows_probs() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.6, 0.3]).expand(20_000, 3)
    counts = torch.bincount(sample(probs, g), minlength=3).numpy()
    assert chisquare(counts, 20_000 * np.array([0.1, 0.6, 0.3])).pvalue > 1e-3


P_TARGET = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
P_DRAFT = torch.tensor([0.05, 0.30, 0.30, 0.05, 0.10, 0.10, 0.05, 0.05])


def first_token_pvalue(k: int, n: int = 20_000, seed: int = 1234) -> float:
    """Chi-square p-value of the first token of n rounds of accept_or_resample vs P_TARGET.

    The rule is looked up on the engine module at call time, so a test can
    replace what it calls (residual, torch.rand) and see the statistic react.
    """
    g = torch.Generator().manual_seed(seed)
    drafts = sample(P_DRAFT.expand(n, k, 8), g)  # [n, k]
    pt = P_TARGET.expand(k + 1, 8)
    pd = P_DRAFT.expand(k, 8)
    firsts = []
    for i in range(n):
        n_acc, extra = speculative.accept_or_resample(pt, pd, drafts[i], g)
        firsts.append(int(drafts[i, 0]) if int(n_acc) > 0 else int(extra))
    counts = np.bincount(firsts, minlength=8)
    return float(chisquare(counts, n * P_TARGET.numpy()).pvalue)


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_rule_reproduces_target_distribution(k: int) -> None:
    """Chi-square: the first emitted token of a round is distributed as p_target.

    Fixed synthetic distributions over 8 tokens, draft tokens drawn from
    p_draft, seed 1234, N = 20,000 rounds; the test fails when the p-value of
    the goodness-of-fit test is below 1e-3. A broken rule gives p-values far
    below that (the test below). Every position of a round, with distinct
    rows, is checked in test_exactness_rounds.py.
    """
    assert first_token_pvalue(k) > 1e-3


@pytest.mark.parametrize("wrong", ["always accept (u = 0)", "resample from p_target"])
def test_chi_square_detects_a_wrong_rule(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    """The same statistic on the engine's own rule, broken on purpose, must reject.

    "always accept": the engine's coin u is 0, so every draft is accepted;
    "resample from p_target": the engine's residual returns p_target. Same
    seed 1234, N = 20,000, K = 3; p must fall below 1e-3.
    """
    if wrong == "always accept (u = 0)":
        monkeypatch.setattr(speculative, "torch", ConstantCoin(0.0))
    else:
        monkeypatch.setattr(speculative, "residual", lambda p_target, p_draft: p_target)
    assert first_token_pvalue(3) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_on_ties_nans_infinities_and_strided_rows(dtype: torch.dtype) -> None:
    """sampling.argmax (NumPy on the CPU) picks what torch.argmax picks, so greedy plain
    and speculative rounds, which both take it, choose the same tokens as before."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 4, (64, 33), generator=gen).to(dtype)  # many ties
    rows[3, 7] = rows[5, 2] = rows[5, 30] = float("nan")
    rows[8, 1] = rows[8, 9] = float("inf")
    rows[9] = float("-inf")
    for x in (rows, rows[:, ::3], rows[17], torch.randn(151_936, generator=gen).to(dtype)):
        got = sampling.argmax(x)
        want = torch.argmax(x, dim=-1)
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want)
