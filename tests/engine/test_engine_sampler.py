"""The sampler on hand-made logits: greedy, seeded sampling, top-k / top-p masks."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingOptions
from services.engine.torch_backend.sampler import (
    SamplingRow,
    apply_top_k_top_p,
    probabilities,
    sample,
)

NEG_INF = float("-inf")
#: Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 in a shuffled order (ids 3, 0, 4, 1, 2).
PROBS = torch.tensor([[0.2, 0.1, 0.05, 0.5, 0.15]])
LOGITS = PROBS.log()


def seeded(seed: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingRow:
    options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return SamplingRow.from_options(options)


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in masked]


def draws(logits: torch.Tensor, row: SamplingRow, n: int) -> list[int]:
    return [int(sample(logits, [row])[0]) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingRow()] * 4)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_greedy_row_has_no_generator() -> None:
    assert SamplingRow.from_options(SamplingOptions(temperature=0.0, seed=3)).generator is None


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is up to the generator
    first = draws(logits, seeded(1234), 20)
    again = draws(logits, seeded(1234), 20)
    other = draws(logits, seeded(4321), 20)
    assert first == again
    assert first != other
    assert len(set(first)) > 10


def test_seeded_row_is_independent_of_other_rows() -> None:
    logits = torch.zeros(3, 1000)
    alone = draws(logits[:1], seeded(7), 5)
    rows = [seeded(7), SamplingRow(), seeded(99, temperature=0.5, top_k=5)]
    together = [sample(logits, rows) for _ in range(5)]
    assert [int(t[0]) for t in together] == alone
    assert all(int(t[1]) == 0 for t in together)  # greedy row: argmax of all-equal logits


def test_top_k_keeps_exactly_k_largest() -> None:
    masked = apply_top_k_top_p(LOGITS, torch.tensor([3]), torch.tensor([1.0]))
    assert kept(masked) == [{3, 0, 4}]
    torch.testing.assert_close(masked[0, [3, 0, 4]], LOGITS[0, [3, 0, 4]])


def test_top_k_zero_or_vocab_keeps_all() -> None:
    masked = apply_top_k_top_p(LOGITS.repeat(2, 1), torch.tensor([0, 5]), torch.tensor([1.0, 1.0]))
    assert kept(masked) == [{0, 1, 2, 3, 4}] * 2


@pytest.mark.parametrize(("top_p", "expected"), [
    (0.3, {3}),              # 0.5 alone reaches 0.3
    (0.6, {3, 0}),           # 0.5 < 0.6 <= 0.7
    (0.75, {3, 0, 4}),       # 0.7 < 0.75 <= 0.85
    (0.9, {3, 0, 4, 1}),     # 0.85 < 0.9 <= 0.95
    (1.0, {0, 1, 2, 3, 4}),  # off
])
def test_top_p_keeps_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    masked = apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([top_p]))
    assert kept(masked) == [expected]


def test_top_p_applies_after_top_k() -> None:
    # Within the top-2 (0.5, 0.2) renormalized to (0.714, 0.286), p=0.6 keeps only id 3.
    masked = apply_top_k_top_p(LOGITS, torch.tensor([2]), torch.tensor([0.6]))
    assert kept(masked) == [{3}]


def test_masks_are_per_row() -> None:
    masked = apply_top_k_top_p(LOGITS.repeat(3, 1), torch.tensor([1, 0, 4]),
                               torch.tensor([1.0, 0.6, 0.9]))
    assert kept(masked) == [{3}, {3, 0}, {3, 0, 4, 1}]


def test_temperature_scales_logits() -> None:
    rows = [SamplingRow(temperature=0.5), SamplingRow(temperature=2.0)]
    probs = probabilities(LOGITS.repeat(2, 1), rows)
    torch.testing.assert_close(probs[0], (LOGITS[0] / 0.5).softmax(-1))
    torch.testing.assert_close(probs[1], (LOGITS[0] / 2.0).softmax(-1))
    assert math.isclose(probs[0].sum().item(), 1.0, rel_tol=1e-6)


def test_samples_stay_inside_the_mask() -> None:
    row = seeded(5, temperature=5.0, top_k=3)  # hot: tail tokens would show up if allowed
    assert set(draws(LOGITS, row, 300)) == {3, 0, 4}
    # Top-p applies to the tempered distribution: at T=1 the nucleus of 0.6 is {3, 0}.
    row = seeded(5, temperature=1.0, top_p=0.6)
    assert set(draws(LOGITS, row, 300)) == {3, 0}


def test_row_count_must_match() -> None:
    with pytest.raises(ValueError, match="2 rows of logits but 1 sampling rows"):
        sample(torch.zeros(2, 10), [SamplingRow()])
