"""What a round costs beyond the model: host reads, sampling work, the stop-string search."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specchat.engine.config import DecodeConfig
from specchat.engine.decode import sampling, speculative
from specchat.engine.decode.lookup import LookupDrafter
from specchat.engine.decode.speculative import Drafter, ModelDrafter, speculative_round
from specchat.engine.decode.text import ReplyFilter, find_stop
from specchat.engine.model.runner import ModelRunner
from specchat.engine.weights.loading import layer_truncated
from tests.tinymodels import tiny_llama

HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def counting_host_reads() -> Iterator[collections.Counter[str]]:
    """Counts every read of a tensor's values into Python (a host sync on a GPU)."""
    counts: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counter(name: str):  # type: ignore[no-untyped-def]
        real = saved[name]

        def read(self: torch.Tensor, *a: object, **kw: object) -> object:
            counts[name] += 1
            return real(self, *a, **kw)

        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counter(name))
        yield counts
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, layers=4)


SEQ = [5, 9, 11, 40, 41, 42, 9, 11, 40, 41, 17, 23, 5, 9, 11]


def drafters(target: torch.nn.Module) -> dict[str, Drafter]:
    runner = ModelRunner(layer_truncated(target, 2), torch.device("cpu"))
    return {"model": ModelDrafter(runner, vocab=runner.vocab), "lookup": LookupDrafter(runner.vocab)}


@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize(
    "cfg", [DecodeConfig(), DecodeConfig(temperature=0.8, top_k=50, top_p=0.9)], ids=["greedy", "sampled"]
)
def test_a_round_reads_the_device_once(target: torch.nn.Module, kind: str, cfg: DecodeConfig) -> None:
    """Acceptance, the correction or bonus and every probability come back in one read
    (six reads a round before: each is a host sync on a GPU)."""
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = drafters(target)[kind]
    runner.prefill(SEQ)
    drafter.catch_up(SEQ)
    for k in (1, 4):
        with counting_host_reads() as counts:
            res = speculative_round(runner, drafter, list(SEQ), k, cfg, torch.Generator().manual_seed(1))
        assert res.k >= 1
        assert sum(counts.values()) == 1, dict(counts)


def test_a_sampled_top_p_round_on_a_wide_vocabulary_reads_an_accelerator_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past TOP_P_CANDIDATES ids the CPU asks whether the candidates cover top_p (a read
    of host memory); an accelerator sorts instead, so its round still reads once."""
    wide = tiny_llama(seed=0, layers=2, vocab=4 * sampling.TOP_P_CANDIDATES)
    cfg = DecodeConfig(temperature=0.8, top_k=0, top_p=0.9)
    for on_host, most in ((True, None), (False, 1)):
        monkeypatch.setattr(sampling, "branches_on_host", lambda x, on_host=on_host: on_host)
        runner = ModelRunner(wide, torch.device("cpu"))
        drafter = drafters(wide)["model"]
        runner.prefill(SEQ)
        drafter.catch_up(SEQ)
        with counting_host_reads() as counts:
            speculative_round(runner, drafter, list(SEQ), 4, cfg, torch.Generator().manual_seed(1))
        if most is None:
            assert sum(counts.values()) > 1  # the CPU's covering checks are reads
        else:
            assert sum(counts.values()) == most, dict(counts)


def test_a_sampled_round_processes_each_draft_row_once(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's probabilities come from propose; the round no longer recomputes them."""
    rows: list[int] = []
    real = speculative.logits_to_probs

    def counted(logits: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        rows.append(1 if logits.dim() == 1 else int(logits.shape[0]))
        return real(logits, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(speculative, "logits_to_probs", counted)
    runner = ModelRunner(target, torch.device("cpu"))
    drafter = drafters(target)["model"]
    cfg = DecodeConfig(temperature=0.8, top_p=0.9)
    k = 4
    speculative_round(runner, drafter, list(SEQ), k, cfg, torch.Generator().manual_seed(0))
    assert sum(rows) == k + (k + 1)  # k draft rows, k + 1 target rows


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole row (the definition).

    The row's probabilities are sorted, not its logits: a softmax summed in
    another order rounds differently in the last bit, and on a flat row that
    moves the cut by a token on some CPUs (AVX2's reduction order, not AVX-512's).
    """
    sorted_p, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.softmax(logits.masked_fill(drop, float("-inf")), dim=-1)


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked rows: the candidates decide; flat: full sort
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
@pytest.mark.parametrize("on_host", [True, False], ids=["cpu-candidates", "accelerator-sort"])
def test_top_p_on_candidates_keeps_what_sorting_the_row_keeps(
    scale: float, top_p: float, on_host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampling, "branches_on_host", lambda x: on_host)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 20_000, generator=gen) * scale
    got = sampling.logits_to_probs(logits, 1.0, 0, top_p)
    want = reference_top_p(logits, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@dataclass(frozen=True)
class Piece:
    text: str


@example(pieces=["ba", "\n"], stops=["a", "ba\n"])  # the shorter stop is found first
@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab\n", min_size=0, max_size=3), max_size=40),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_reply_filter_cuts_where_a_search_of_the_whole_reply_cuts(
    pieces: list[str], stops: list[str]
) -> None:
    """Searching the new text and a stop's length before it finds what the whole text finds."""
    f: ReplyFilter[Piece] = ReplyFilter(tuple(stops))
    released: list[Piece] = []
    for text in pieces:
        released += f.push(Piece(text))
        if f.stopped:
            break
    released += f.finish()
    whole = "".join(pieces)
    hit = find_stop(whole, tuple(stops))
    assert f.text == (whole[:hit] if hit >= 0 else whole)
    assert "".join(p.text for p in released) == f.text
    assert f.stopped == (hit >= 0)
