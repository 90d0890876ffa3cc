"""Speculative sampling is exact at every position of a round, not only the first.

The claim (Leviathan et al. 2023, Theorem 1; Chen et al. 2023): the tokens a
round emits are distributed as the target alone would sample them. Position
by position: the token at output position j of a round, given the tokens
before it in the round, follows the target's processed distribution there
(temperature, top-k and top-p applied), whether it is an accepted draft, the
residual sample at a rejection, or the bonus token after K acceptances.

Each test below checks that with one chi-square test per position (cells with
an expected count under 5 pooled, groups of the same position added up), and
states its seed, N and threshold. The tests at the end run the same
statistics on the engine's own functions with a wrong rule injected and
require them to reject: the statistics have the power to fail.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specchat.engine.config import DecodeConfig
from specchat.engine.decode import speculative
from specchat.engine.decode.sampling import logits_to_probs, sample
from specchat.engine.decode.speculative import ModelDrafter, accept_or_resample, speculative_round
from specchat.engine.model.runner import ModelRunner
from tests.tinymodels import ConstantCoin, perturbed, tiny_llama, widened

ALPHA = 1e-3  # every p-value must be above this; a wrong rule must push one below it
MIN_EXPECTED = 5.0  # cells expected below this are pooled (the chi-square approximation)

Rounds = list[list[int]]  # the tokens each round emitted, in order
Rule = Callable[..., tuple[int, int]]


def grouped_chisquare(groups: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int]:
    """One chi-square test over groups of (counts [V], probs [V]); (p-value, samples used).

    A group is one conditioning context: how often each token was emitted
    there and the distribution it should follow. Within a group, cells with an
    expected count under MIN_EXPECTED are merged, smallest first; a group left
    with one cell says nothing and is skipped. Statistics and degrees of
    freedom add up over groups. A count on a token of probability 0 gives
    p = 0: the rule emitted what the target never would.
    """
    stat, dof, used = 0.0, 0, 0
    for counts, probs in groups:
        if counts[probs <= 0].sum() > 0:
            return 0.0, used
        n = int(counts.sum())
        cells = sorted(
            zip((n * probs[probs > 0]).tolist(), counts[probs > 0].tolist(), strict=True)
        )
        while len(cells) > 1 and cells[0][0] < MIN_EXPECTED:
            (e0, o0), (e1, o1) = cells[0], cells[1]
            cells = sorted([(e0 + e1, o0 + o1), *cells[2:]])
        if len(cells) < 2:
            continue
        stat += sum((o - e) ** 2 / e for e, o in cells)
        dof += len(cells) - 1
        used += n
    return (float(chi2.sf(stat, dof)) if dof else 1.0), used


def position_test(
    rounds: Rounds,
    j: int,
    law: Callable[[tuple[int, ...]], np.ndarray],
    key: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda prefix: prefix,
) -> tuple[float, int, int]:
    """Chi-square of the token at position j of the rounds that reached it; (p, used, reached).

    The rounds are grouped by key(tokens before position j); law(key) is the
    distribution the token should follow in that group.
    """
    by_key: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for emitted in rounds:
        if len(emitted) > j:
            by_key[key(tuple(emitted[:j]))].append(emitted[j])
    groups = []
    for k, tokens in by_key.items():
        probs = law(k)
        groups.append((np.bincount(tokens, minlength=len(probs)), probs))
    p, used = grouped_chisquare(groups)
    return p, used, sum(len(t) for t in by_key.values())


# -- the rule on fixed per-position distributions ------------------------------------------

V, K = 8, 3
PROCESSING = {  # (temperature, top_k, top_p)
    "temperature": (0.7, 0, 1.0),
    "top-k": (1.0, 4, 1.0),
    "top-p": (1.3, 0, 0.8),
    "all three": (0.9, 5, 0.85),
}


def fixed_rows(temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed p_target [K+1, V] and p_draft [K, V]: a distinct row at every position.

    Logits from torch seed 21: the target's N(0, 1), the draft's the target's
    plus N(0, 0.7^2). The two overlap (each position accepts 0.6-0.8 of the
    time, so deep positions are reached) but differ (each position rejects,
    and top-k/top-p keep different tokens of the two).
    """
    gen = torch.Generator().manual_seed(21)
    target_logits = torch.randn(K + 1, V, generator=gen)
    draft_logits = target_logits[:K] + 0.7 * torch.randn(K, V, generator=gen)
    return (
        logits_to_probs(target_logits, temperature, top_k, top_p),
        logits_to_probs(draft_logits, temperature, top_k, top_p),
    )


def run_rule(
    p_target: torch.Tensor, p_draft: torch.Tensor, n: int, seed: int, rule: Rule | None = None
) -> Rounds:
    """n rounds of the rule: drafts d_i ~ p_draft[i], then accept / resample / bonus."""
    rule = rule or accept_or_resample
    g = torch.Generator().manual_seed(seed)
    drafts = sample(p_draft.expand(n, K, V), g)  # [n, K]
    rounds = []
    for d in drafts:
        n_acc, last = rule(p_target, p_draft, d, g)
        rounds.append([*d[: int(n_acc)].tolist(), int(last)])
    return rounds


def rule_pvalues(rounds: Rounds, p_target: torch.Tensor) -> list[tuple[float, int, int]]:
    """Position j's token vs p_target[j], grouped by the token emitted before it."""
    rows = p_target.double().numpy()
    return [
        position_test(rounds, j, lambda _key, j=j: rows[j], key=lambda prefix: prefix[-1:])
        for j in range(K + 1)
    ]


@pytest.mark.parametrize("processing", PROCESSING.values(), ids=PROCESSING.keys())
def test_every_position_of_the_rule_follows_the_target(
    processing: tuple[float, int, float],
) -> None:
    """accept_or_resample on distinct rows per position: position j emits ~ p_target[j].

    K = 3 over V = 8 tokens (rows: fixed_rows); seed 2024, N = 20,000 rounds.
    Position j (0..3) is tested on the rounds that reached it, grouped by the
    token emitted at j - 1 (an accepted draft), so it checks the law of a
    token given the one before it; p > 1e-3 at every position. Every position
    before K must have rejected (the residual row is used) and accepted in
    300 rounds at least, and the bonus row must have been sampled as often.
    """
    p_target, p_draft = fixed_rows(*processing)
    rounds = run_rule(p_target, p_draft, 20_000, seed=2024)
    lengths = np.bincount([len(r) for r in rounds], minlength=K + 2)
    assert lengths[1 : K + 1].min() >= 300, f"rejections per position {lengths[1 : K + 1]}"
    assert lengths[K + 1] >= 300, f"only {lengths[K + 1]} bonus tokens"
    for j, (p, used, reached) in enumerate(rule_pvalues(rounds, p_target)):
        assert used >= 0.95 * reached, f"position {j}: only {used} of {reached} rounds tested"
        assert p > ALPHA, f"position {j}: chi-square p = {p:.2e}"


# -- end to end: speculative_round on tiny models ---------------------------------------

E2E_CFG = DecodeConfig(temperature=1.5, top_k=6, top_p=0.9)
E2E_PROMPT = [1, 5, 9, 3, 7, 11, 4, 8]
E2E_VOCAB = 16


@pytest.fixture(scope="module")
def e2e_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 2-layer target over 16 tokens and a draft: its copy with head noise of std 0.1."""
    target = tiny_llama(seed=0, layers=2, vocab=E2E_VOCAB)
    return target, perturbed(target, 0.1, seed=1)


def e2e_rounds(
    models: tuple[torch.nn.Module, torch.nn.Module], n: int, seed: int, k: int = K
) -> Rounds:
    """n rounds of speculative_round from the same prompt (each rolls both caches back)."""
    target, draft = models
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = ModelDrafter(ModelRunner(draft, torch.device("cpu")))
    g = torch.Generator().manual_seed(seed)
    rounds = []
    for _ in range(n):
        res = speculative_round(runner, drafter, E2E_PROMPT, k, E2E_CFG, g)
        assert res.k == k
        rounds.append([e.token_id for e in res.tokens])
    return rounds


def target_law(
    target: torch.nn.Module, cfg: DecodeConfig = E2E_CFG
) -> Callable[[tuple[int, ...]], np.ndarray]:
    """The target's processed next-token distribution after E2E_PROMPT + prefix (memoised)."""
    runner = ModelRunner(target, torch.device("cpu"))
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def law(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in memo:
            runner.reset()
            logits = runner.forward(E2E_PROMPT + list(prefix))[-1]
            probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            memo[prefix] = probs.double().numpy()
        return memo[prefix]

    return law


def e2e_pvalues(rounds: Rounds, target: torch.nn.Module) -> list[tuple[float, int, int]]:
    law = target_law(target)
    return [position_test(rounds, j, law) for j in range(K + 1)]


def test_every_position_of_a_round_follows_the_target(
    e2e_models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    """speculative_round with temperature 1.5, top-k 6 and top-p 0.9 applied to both models.

    The draft (the target with noise on its head) proposes K = 3 tokens after
    a fixed prompt; seed 9, N = 2,000 rounds. The token at position j is
    tested against the target's own processed distribution after the prompt
    and the j tokens before it (rounds grouped by that prefix, cells pooled
    to an expected count of 5); p > 1e-3 at every position. Every position
    before K must reject in 100 rounds at least, and 300 rounds must reach
    the bonus token; at each position 70% of the rounds that reach it must
    fall in groups large enough to test.
    """
    rounds = e2e_rounds(e2e_models, 2000, seed=9)
    lengths = np.bincount([len(r) for r in rounds], minlength=K + 2)
    assert lengths[1 : K + 1].min() >= 100, f"rejections per position {lengths[1 : K + 1]}"
    assert lengths[K + 1] >= 300, f"only {lengths[K + 1]} bonus tokens"
    for j, (p, used, reached) in enumerate(e2e_pvalues(rounds, e2e_models[0])):
        assert used >= 0.7 * reached, f"position {j}: only {used} of {reached} rounds tested"
        assert p > ALPHA, f"position {j}: chi-square p = {p:.2e}"


def test_a_draft_with_more_token_ids_drafts_as_its_fit_to_the_target_vocabulary(
    e2e_models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    """A draft with 4 ids the target lacks rounds exactly as the same draft without them.

    The wide draft is the draft above plus 4 ids that hold 30% or more of its
    processed mass after the prompt; fitted to the target's 16 ids before
    sampling, its rows are the narrow draft's. Seed 9, N = 300 rounds of
    K = 3: the emitted tokens must be identical round for round, so the
    per-position exactness shown for the narrow draft holds for the wide one.
    """
    target, narrow = e2e_models
    wide = widened(narrow, 4)
    cpu = torch.device("cpu")
    fitted_away = logits_to_probs(
        ModelRunner(wide, cpu).forward(E2E_PROMPT)[-1],
        E2E_CFG.temperature,
        E2E_CFG.top_k,
        E2E_CFG.top_p,
    )[E2E_VOCAB:].sum()
    assert fitted_away >= 0.3, "the extra ids must matter for the test to mean anything"

    def rounds(draft: torch.nn.Module) -> Rounds:
        runner = ModelRunner(target, cpu)
        drafter = ModelDrafter(ModelRunner(draft, cpu), vocab=E2E_VOCAB)
        g = torch.Generator().manual_seed(9)
        return [
            [
                e.token_id
                for e in speculative_round(runner, drafter, E2E_PROMPT, K, E2E_CFG, g).tokens
            ]
            for _ in range(300)
        ]

    assert rounds(wide) == rounds(narrow)


# -- the statistics reject wrong rules ----------------------------------------------------


def _bonus_from_the_last_draft_row(
    p_target: torch.Tensor, p_draft: torch.Tensor, d: torch.Tensor, g: torch.Generator
) -> tuple[int, int]:
    """The rule, but the bonus drawn from p_target[K-1] instead of p_target[K]."""
    shifted = p_target.clone()
    shifted[-1] = p_target[-2]
    return accept_or_resample(shifted, p_draft, d, g)


def inject(monkeypatch: pytest.MonkeyPatch, wrong: str) -> Rule:
    """Break the engine's rule in one way; returns the rule function to call."""
    real_residual = speculative.residual
    if wrong == "residual is p_target":
        monkeypatch.setattr(speculative, "residual", lambda p_target, p_draft: p_target)
    elif wrong == "residual with p_target and p_draft swapped":
        monkeypatch.setattr(
            speculative, "residual", lambda p_target, p_draft: real_residual(p_draft, p_target)
        )
    elif wrong == "u = 0: every draft the target allows is accepted":
        monkeypatch.setattr(speculative, "torch", ConstantCoin(0.0))
    elif wrong == "no coin: accepted when p_draft <= p_target":
        monkeypatch.setattr(speculative, "torch", ConstantCoin(1.0))
    elif wrong == "bonus from the last draft row":
        return _bonus_from_the_last_draft_row
    else:
        raise AssertionError(wrong)
    return speculative.accept_or_resample


WRONG_RULES = [
    "residual is p_target",
    "residual with p_target and p_draft swapped",
    "u = 0: every draft the target allows is accepted",
    "no coin: accepted when p_draft <= p_target",
    "bonus from the last draft row",
]


@pytest.mark.parametrize("wrong", WRONG_RULES)
def test_the_position_statistics_reject_a_wrong_rule(
    monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    """The statistics of the per-position rule test, on the engine's rule broken on purpose.

    Same rows ("all three" processing), seed 2024 and N = 20,000 rounds as the
    exactness test; some position must give p < 1e-3.
    """
    rule = inject(monkeypatch, wrong)
    p_target, p_draft = fixed_rows(*PROCESSING["all three"])
    rounds = run_rule(p_target, p_draft, 20_000, seed=2024, rule=rule)
    pvalues = [p for p, _, _ in rule_pvalues(rounds, p_target)]
    assert min(pvalues) < ALPHA, f"{wrong}: p-values {pvalues}"


def test_the_round_statistics_reject_top_p_applied_to_neither_model(
    e2e_models: tuple[torch.nn.Module, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-to-end statistics when the round (and the drafter) drop top-p.

    The engine's logits_to_probs replaced, inside the round's module, by one
    that ignores top_p: the round then samples the target's temperature and
    top-k distribution, not the one with top-p. Seed 9, N = 500 rounds; some
    position must give p < 1e-3.
    """
    real = speculative.logits_to_probs

    def without_top_p(
        logits: torch.Tensor, temperature: float, top_k: int, top_p: float
    ) -> torch.Tensor:
        return real(logits, temperature, top_k, 1.0)

    monkeypatch.setattr(speculative, "logits_to_probs", without_top_p)
    rounds = e2e_rounds(e2e_models, 500, seed=9)
    pvalues = [p for p, _, _ in e2e_pvalues(rounds, e2e_models[0])]
    assert min(pvalues) < ALPHA, f"p-values {pvalues}"


# -- one-hot drafts (prompt lookup): p_draft is 1 on the copied token --------------------


def run_one_hot(p_target: torch.Tensor, drafts: torch.Tensor, n: int, seed: int) -> Rounds:
    """n rounds of the rule on the same copied drafts [K], as a lookup proposes them."""
    g = torch.Generator().manual_seed(seed)
    rounds = []
    for _ in range(n):
        n_acc, last = accept_or_resample(p_target, None, drafts, g)
        rounds.append([*drafts[: int(n_acc)].tolist(), int(last)])
    return rounds


@pytest.mark.parametrize("wrong", [False, True], ids=["engine", "residual-keeps-the-draft"])
def test_one_hot_drafts_follow_the_target_at_every_position(
    wrong: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's copied drafts: accepted with p_target(d), else resampled from p_target without d.

    Rows: fixed_rows' target at temperature 0.7 (top tokens 0.3-0.6), drafts the
    rows' most probable tokens; seed 7, N = 20,000 rounds; p > 1e-3 at every
    position. With the residual left at p_target (the copied token not removed),
    some position must fall below 1e-3: the test can fail.
    """
    p_target, _ = fixed_rows(0.7, 0, 1.0)
    drafts = p_target[:K].argmax(dim=-1)
    if wrong:
        monkeypatch.setattr(speculative, "residual_one_hot", lambda p, ids: p)
    rounds = run_one_hot(p_target, drafts, 20_000, seed=7)
    lengths = np.bincount([len(r) for r in rounds], minlength=K + 2)
    assert lengths[1:].min() >= 300, f"rounds ending at each position {lengths[1:]}"
    pvalues = [p for p, _, _ in rule_pvalues(rounds, p_target)]
    if wrong:
        assert min(pvalues) < ALPHA, pvalues
    else:
        assert min(pvalues) > ALPHA, pvalues
