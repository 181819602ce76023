"""The speculation cost rule (services/engine/torch_backend/spec_policy.py) and
the speculator that applies it, without a model: the step-time fit, the
greedy marginal rule at small and large batches, per-sequence calibration,
and proposals cut to what pays."""

from __future__ import annotations

import pytest

from services.common.sampling import SpeculativeMethod
from services.engine.torch_backend.spec_policy import (
    AcceptanceModel,
    StepCostModel,
    choose_lengths,
)
from services.engine.torch_backend.spec_options import SpeculativeConfig
from services.engine.torch_backend.speculative import Proposal, Speculator

from .kv_helpers import make_request

SUFFIX = SpeculativeMethod.SUFFIX
NGRAM = SpeculativeMethod.NGRAM


def fitted(a: float, b: float, rows: range = range(1, 20)) -> StepCostModel:
    model = StepCostModel()
    for _ in range(20):
        for r in rows:
            model.observe(r, a + b * r)
    return model


def test_the_cost_model_learns_the_step_time_and_ignores_one_stall() -> None:
    fresh = StepCostModel()
    # before any step: the prior's shape, 4.6 ms + 0.8 ms a row
    assert fresh.seconds(1) == pytest.approx(0.0054)
    assert fresh.seconds(4) == pytest.approx(0.0078)
    model = fitted(0.010, 0.002)
    for rows in (1, 4, 19):
        assert model.seconds(rows) == pytest.approx(0.010 + 0.002 * rows, rel=1e-6)
    model.observe(4, 5.0)  # a 5 s stall (GC, another process) counts as 3x the estimate
    assert model.seconds(4) == pytest.approx(0.018 * (1 + 0.1 * 2), rel=1e-6)
    # unseen counts: linear between trusted neighbours; above them the steeper
    # of their line (1 ms a row here) and the prior's shape; below, that shape
    sparse = StepCostModel()
    for _ in range(3):
        for rows, seconds in ((2, 0.006), (6, 0.010)):
            sparse.observe(rows, seconds)
    assert sparse.seconds(4) == pytest.approx(0.008)
    assert sparse.seconds(8) == pytest.approx(0.012)
    assert sparse.seconds(1) == pytest.approx(0.006 * (4.6 + 0.8) / (4.6 + 0.8 * 2))
    flat = StepCostModel()  # a flatter line than the prior's: the prior's slope
    for _ in range(3):
        for rows, seconds in ((2, 0.0060), (6, 0.0061)):
            flat.observe(rows, seconds)
    assert flat.seconds(8) == pytest.approx(0.0061 * (1 + 2 * 0.8 / (4.6 + 0.8 * 6)))
    with pytest.raises(ValueError, match="table_weight"):
        StepCostModel(table_weight=0)


def test_rows_timed_under_contention_are_tried_again_once_stale() -> None:
    """Steps of 2-3 rows timed while another process shared the cores (3x a
    1-row step) must not keep speculation off once the machine is quiet: the
    1-row steps that keep running are timed anew, the others go stale and are
    estimated from them until a new step times them."""
    quiet = {1: 0.0050, 2: 0.0057, 3: 0.0063}
    model = StepCostModel()
    for _ in range(10):
        for rows, seconds in quiet.items():
            model.observe(rows, seconds)
    for _ in range(30):  # contention: 2-3 row steps 3x slower, 1-row ones 1.2x
        for rows, seconds in quiet.items():
            model.observe(rows, seconds * (3.0 if rows > 1 else 1.2))
    assert model.seconds(2) / model.seconds(1) > 2
    # one sequence, a sure proposal: it does not pay while the table says 3x
    assert choose_lengths([(0.95, 0.9)], 1, model) == [0]
    for _ in range(model.stale_after - 1):  # quiet again: no speculation, 1 row only
        model.observe(1, quiet[1])
    assert choose_lengths([(0.95, 0.9)], 1, model) == [0]
    model.observe(1, quiet[1])  # the 2- and 3-row averages are now stale
    assert model.seconds(2) == pytest.approx(quiet[1] * (4.6 + 1.6) / (4.6 + 0.8), rel=0.01)
    assert choose_lengths([(0.95, 0.9)], 1, model) == [2]
    model.observe(3, quiet[3])  # the try: its new time replaces the stale average
    assert model.seconds(3) == pytest.approx(quiet[3], rel=0.02)
    # a count tried lately keeps its average, even a high one
    model.observe(3, 3 * quiet[3])
    assert model.seconds(3) > 1.1 * quiet[3]


def test_the_marginal_rule_speculates_at_one_sequence_and_only_sure_tokens_in_a_batch() -> None:
    cost = fitted(0.0046, 0.00055)
    # one sequence: the first token's bar is b / (a + b) ~ 0.107; it rises with the
    # step's tokens per second as likely tokens are added (0.15 < b * 2.8 / 6.8 ms)
    assert choose_lengths([(0.9, 0.6, 0.3, 0.15, 0.05)], 1, cost) == [3]
    assert choose_lengths([(0.9, 0.6, 0.25, 0.2)], 1, cost) == [3]
    # sixteen sequences: the bar is 16b / (a + 16b) ~ 0.66 and rises as rows are added
    probs = [(0.99, 0.98, 0.97, 0.5)] + [(0.6, 0.3)] * 15
    assert choose_lengths(probs, 16, cost) == [3] + [0] * 15
    # the most likely tokens go first across sequences, and each keeps a prefix
    assert choose_lengths([(0.5, 0.4), (0.95, 0.9, 0.2)], 2, cost) == [2, 2]
    assert choose_lengths([], 1, cost) == []


def test_calibration_follows_what_a_sequence_and_a_position_really_accept() -> None:
    model = AcceptanceModel()
    assert model.factor(1) == 1.0
    assert model.by_position(SUFFIX, (1.0, 1.0, 1.0), 3) == (1.0, 1.0, 1.0)
    for step in range(10):  # the proposer says 1.0 for 3 tokens; 0 or 1 are accepted
        predicted = model.by_position(SUFFIX, (1.0, 1.0, 1.0), 3)
        model.observe(1, SUFFIX, (1.0, 1.0, 1.0), predicted, accepted=step % 2)
    first, second, third = model.by_position(SUFFIX, (1.0, 1.0, 1.0), 3)
    assert 0.35 < first < 0.75 and second < 0.25 and third <= second  # by position
    assert model.factor(1) < 1.5  # the positions explain it: the sequence is as predicted
    assert model.factor(2) == 1.0  # a new sequence has no record of its own
    # a sequence in a copy region accepts everything: its own factor rises
    for _ in range(6):
        predicted = model.by_position(SUFFIX, (1.0, 1.0, 1.0), 3)
        model.observe(7, SUFFIX, (1.0, 1.0, 1.0), predicted, accepted=3)
    assert model.factor(7) > 2
    # proposers without probabilities: the measured acceptance by position
    for _ in range(30):
        model.observe(3, NGRAM, None, model.by_position(NGRAM, None, 3), accepted=1)
    prior = model.by_position(NGRAM, None, 3)
    assert prior[0] > 0.8 and prior[1] < 0.2 and prior[2] <= prior[1]
    assert model.ceiling(9, NGRAM) > 0.8
    model.retain({3})
    assert set(model._sequences) == {3}


class ScoredProposer:
    """Proposes fixed tokens with fixed probabilities."""

    def __init__(self, tokens: list[int], probs: tuple[float, ...] | None) -> None:
        self.tokens, self.probs = tokens, probs

    def propose(self, requests):
        return [Proposal(self.tokens[:k], None if self.probs is None else self.probs[:k])
                for _, k in requests]

    def retain(self, keys) -> None:
        pass


def seqs(count: int, method: SpeculativeMethod):
    out = [make_request(f"s{i}", 5, max_tokens=100) for i in range(count)]
    for seq in out:
        seq.spec_method, seq.num_spec_tokens = method, 6
    return out


def test_the_speculator_cuts_proposals_to_what_pays_and_learns_from_verification() -> None:
    proposer = ScoredProposer([1, 2, 3, 4, 5, 6], (0.95, 0.9, 0.85, 0.4, 0.08, 0.01))
    spec = Speculator(SpeculativeConfig(), max_model_len=512, proposers={SUFFIX: proposer})
    spec.cost = fitted(0.0046, 0.00055)
    (alone,) = seqs(1, SUFFIX)
    spec.propose([alone], num_running=1)
    assert alone.spec_token_ids == [1, 2, 3, 4]  # 0.08 is under the ~0.11 bar
    batch = seqs(16, SUFFIX)
    spec.propose(batch, num_running=16)
    # at 16 the bar is ~0.66 and climbs past 0.8: 0.4 no longer pays
    assert [seq.spec_token_ids for seq in batch] == [[1, 2, 3]] * 16
    # verification: `alone` accepts none of its proposals: after a few steps it
    # only tries a token again now and then
    scored = []
    for _ in range(60):
        rows = 1 + len(alone.spec_token_ids)
        spec.observe_step([(alone, rows - 1, 0)], 0.0046 + 0.00055 * rows, rows, True)
        alone.spec_token_ids.clear()
        spec.propose([alone], num_running=1)
        scored.append(len(alone.spec_token_ids))
    assert 0 < sum(scored) and sum(1 for n in scored[10:] if n) <= 4, scored  # rare retries
    # without the cost model every proposal stands
    spec.config = SpeculativeConfig(cost_model=False)
    (fresh,) = seqs(1, SUFFIX)
    spec.propose([fresh], num_running=16)
    assert fresh.spec_token_ids == [1, 2, 3, 4, 5, 6]


def test_a_method_whose_first_drafts_failed_is_tried_again_in_a_batch() -> None:
    """A cold start: the method's first drafts all fail, then four sequences
    whose proposals the proposer is sure of run together. Only drafts update
    the method's per-position record, so without relaxing it while the method
    scores nothing, its ceiling stayed under the 4-sequence bar for good."""
    proposer = ScoredProposer([1, 2, 3, 4, 5, 6], (1.0,) * 6)
    spec = Speculator(SpeculativeConfig(), max_model_len=512, proposers={SUFFIX: proposer})
    spec.cost = fitted(0.0046, 0.00055)
    for _ in range(6):  # warm-up requests whose drafts all fail
        (cold,) = seqs(1, SUFFIX)
        spec.propose([cold], num_running=1)
        scored = len(cold.spec_token_ids)
        if scored:
            spec.observe_step([(cold, scored, 0)], 0.005, 1 + scored, True)
    batch = seqs(4, SUFFIX)
    spec.propose(batch, num_running=4)
    assert not any(seq.spec_token_ids for seq in batch)  # under the bar now
    for step in range(1, 401):
        spec.propose(batch, num_running=4)
        if any(seq.spec_token_ids for seq in batch):
            break
    assert 50 < step < 400, step  # not at once (the failures count), but not never
    # and once its drafts are accepted, the method speculates every step
    for _ in range(20):
        drafted = [(seq, len(seq.spec_token_ids), len(seq.spec_token_ids))
                   for seq in batch if seq.spec_token_ids]
        spec.observe_step(drafted, 0.008, 4 + sum(n for _, n, _ in drafted), True)
        for seq in batch:
            seq.spec_token_ids.clear()
        spec.propose(batch, num_running=4)
    assert all(len(seq.spec_token_ids) >= 3 for seq in batch)


def test_suffix_requests_get_their_own_default_length() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3,
                                        suffix_num_speculative_tokens=12),
                      max_model_len=512, proposers={SUFFIX: ScoredProposer([], None),
                                                   NGRAM: ScoredProposer([], None)})
    from services.common.sampling import SpeculativeOptions

    assert spec.resolve(SpeculativeOptions(SUFFIX)) == (SUFFIX, 12)
    assert spec.resolve(SpeculativeOptions(NGRAM)) == (NGRAM, 3)
    assert spec.resolve(SpeculativeOptions(SUFFIX, 5)) == (SUFFIX, 5)


def test_a_sequence_that_stopped_speculating_tries_again_later() -> None:
    model = AcceptanceModel(min_factor=0.02)
    for _ in range(6):
        model.observe(1, SUFFIX, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), accepted=0)
    low = model.factor(1)
    assert low < 0.1
    for _ in range(60):  # steps without a scored proposal
        model.idle(1)
    assert model.factor(1) > 3 * low


def test_measured_step_times_replace_the_line_and_the_rule_sees_their_jumps() -> None:
    # rows in groups of four: 1-4 rows ~5-7 ms, 5 rows 9 ms (the integer kernels)
    measured = {1: 0.0048, 2: 0.0056, 3: 0.0062, 4: 0.0072, 5: 0.0090, 6: 0.0095,
                7: 0.0105, 8: 0.0118}
    model = StepCostModel()
    for _ in range(5):
        for rows, seconds in measured.items():
            model.observe(rows, seconds)
    assert model.seconds(5) == pytest.approx(0.0090, rel=0.01)
    assert model.seconds(40) > model.seconds(8)  # unseen: the linear fit
    # one sequence, 5 likely tokens: 4 rows (3 proposals) beat 5 rows (4 proposals)
    # since the 5th row costs 1.8 ms for 0.5 expected tokens
    assert choose_lengths([(0.9, 0.8, 0.7, 0.5, 0.45)], 1, model) == [3]
    # all but sure tokens fill the next group of four
    assert choose_lengths([(1.0,) * 7], 1, model) == [7]
