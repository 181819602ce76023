"""Speculative decoding without a model: the n-gram proposer, the acceptance rules,
the rejection sampler's distribution (synthetic target/draft pairs, fixed seeds),
and the scheduler's bookkeeping of lookahead tokens (exact block ids, rollback of
``num_computed_tokens``, budget, prefix-cache hashing of verified tokens only)."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.common.sampling import FinishReason, SpeculativeMethod, SpeculativeOptions
from services.common.block_hash import block_hash_seed, hash_block
from services.engine.torch_backend.rejection_sampler import verify_greedy, verify_sampled
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.speculative import (
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    propose_ngram,
)
from services.engine.torch_backend.step_sampler import StepRow, sample_step
from services.engine.torch_backend.spec_options import SuffixOptions
from services.engine.torch_backend.suffix_proposer import SuffixProposer

from .kv_helpers import book, create_scheduler, make_request

#: chi-square critical values at p = 0.01 by degrees of freedom (scipy.stats.chi2.ppf(0.99, df)).
CHI2_CRITICAL_P01 = {4: 13.277, 5: 15.086}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---- n-gram proposer ---------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurs at 0 and 6: the latest (6) wins; k caps the proposal
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]
    assert propose_ngram(tokens, 5, 1, 3) == [7, 8, 6, 1, 2]


def test_ngram_prefers_the_longest_n() -> None:
    # suffix (5, 1, 2): the 3-gram occurs at 0 (-> 8); the 2-gram (1, 2) also at 5 (-> 9)
    tokens = [5, 1, 2, 8, 0, 1, 2, 9, 4, 5, 1, 2]
    assert propose_ngram(tokens, 1, 2, 3) == [8]
    assert propose_ngram(tokens, 1, 2, 2) == [9]  # max 2: the latest 2-gram
    assert propose_ngram(tokens, 3, 1, 1) == [9, 4, 5]


def test_ngram_without_a_match_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 1, 5, 2], 3, 2, 3) == []  # (5, 2) never occurred before
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []  # k = 0


def test_ngram_match_may_overlap_the_suffix_and_stops_at_the_end() -> None:
    assert propose_ngram([4, 4, 4, 4], 3, 1, 3) == [4]  # the 3-gram at 0..2 then one token
    assert propose_ngram([1, 2, 3, 1, 2], 4, 2, 2) == [3, 1, 2]


def test_short_ngram_matches_propose_one_token() -> None:
    tokens = [5, 1, 2, 3, 9, 8, 7, 6, 1, 2, 3]  # the 3-gram (1, 2, 3) recurs
    assert propose_ngram(tokens, 3, 1, 4, full_len=3) == [9, 8, 7]
    assert propose_ngram(tokens, 3, 1, 4, full_len=4) == [9]  # a 3-gram is short of 4
    assert propose_ngram([4, 6, 4], 3, 1, 4, full_len=3) == [6]  # only a 1-gram matches
    assert NgramProposer(1, 4, full_len=3).propose(
        [(make_request("short", [4, 6, 0, 4]), 3)]) == [[6]]


def test_ngram_proposer_searches_a_bounded_window() -> None:
    seq = make_request("w", [1, 2, 3, 9, 9, 9, 9, 9, 1, 2])
    assert NgramProposer(2, 2, window=100).propose([(seq, 2)]) == [[3, 9]]
    assert NgramProposer(2, 2, window=5).propose([(seq, 2)]) == [[]]


# ---- acceptance rules ---------------------------------------------------------------


def test_greedy_accepts_the_longest_matching_prefix_plus_the_target_token() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # mismatch at 1: target's token
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]  # none accepted: still one token
    assert verify_greedy([3], []) == [3]


def test_verify_mixes_plain_greedy_and_speculative_rows() -> None:
    logits = torch.full((7, 10), -5.0)
    for row, token in enumerate([1, 2, 3, 9, 4, 5, 0]):
        logits[row, token] = 5.0
    greedy = SamplingRow()
    rows = [StepRow(greedy), StepRow(greedy, (2, 3)), StepRow(greedy, (4, 6))]
    # rows: [1] | [2, 3, 9] | [4, 5, 0]: plain 1; all accepted + 9; 4 accepted, 6 -> 5
    assert sample_step(logits, rows) == [[1], [2, 3, 9], [4, 5]]
    with pytest.raises(ValueError):
        sample_step(logits[:6], rows)


# ---- rejection sampling keeps the target distribution -------------------------------

TARGET = torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.07, 0.03], [0.05, 0.05, 0.5, 0.2, 0.1, 0.1]])
DRAFT = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.3, 0.1, 0.2, 0.2, 0.1, 0.1]])


def suffix_proposal() -> list[int]:
    """The suffix proposer's first proposal after "4 2 3", an earlier output
    having gone "4 2 3 1 5": token 1."""
    proposer = SuffixProposer(SuffixOptions(min_token_prob=0.0))
    done = make_request("earlier", (0,), max_tokens=8)
    done.token_ids.extend([4, 2, 3, 1, 5])
    done.finish_reason = FinishReason.STOP
    proposer.finished([done])
    now = make_request("now", (0, 4, 2, 3), max_tokens=8)
    (proposal,) = proposer.propose([(now, 1)])
    return list(proposal)


@pytest.mark.parametrize("proposer", ["fixed", "suffix"])
def test_point_mass_proposals_keep_the_target_distribution(proposer: str) -> None:
    # Proposing token 1 (p = 0.25) deterministically: P(accept) = 0.25, and the first
    # token follows the target exactly (coupling: one draw from p per emitted token).
    # The suffix proposer's proposals are such point masses too.
    proposal = [1] if proposer == "fixed" else suffix_proposal()
    assert proposal == [1]
    generator = torch.Generator().manual_seed(1234)
    trials = 20_000
    first = torch.zeros(6)
    accepted = 0
    for _ in range(trials):
        out = verify_sampled(TARGET, proposal, generator)
        first[out[0]] += 1
        accepted += len(out) == 2
    assert chi_square(first, TARGET[0]) < CHI2_CRITICAL_P01[5]
    assert abs(accepted / trials - 0.25) < 0.015  # 4.9 standard deviations


def test_sampled_draft_proposals_keep_the_target_distribution() -> None:
    # Leviathan/Chen with a real draft distribution q: proposals drawn from q, first
    # and second emitted tokens must follow the target's rows.
    generator = torch.Generator().manual_seed(99)
    draft_gen = torch.Generator().manual_seed(7)
    trials = 20_000
    first, second = torch.zeros(6), torch.zeros(6)
    accepted = 0
    for _ in range(trials):
        proposal = [int(torch.multinomial(DRAFT[0], 1, generator=draft_gen)),
                    int(torch.multinomial(DRAFT[1], 1, generator=draft_gen))]
        out = verify_sampled(torch.cat([TARGET, TARGET[:1]]), proposal, generator, DRAFT)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            accepted += 1
    assert chi_square(first, TARGET[0]) < CHI2_CRITICAL_P01[5]
    # the second token, given the first was accepted, follows the target's second row
    assert chi_square(second, TARGET[1]) < CHI2_CRITICAL_P01[5]
    # P(accept the first) = sum(min(p, q))
    expected = float(torch.minimum(TARGET[0], DRAFT[0]).sum())
    assert abs(accepted / trials - expected) < 0.02


def test_point_mass_verification_draws_like_plain_sampling() -> None:
    # The same generator state gives the same tokens with and without speculation:
    # with proposals equal to what plain sampling draws, all are accepted.
    probs = TARGET[torch.tensor([0, 1, 0, 1])]
    plain_gen = torch.Generator().manual_seed(5)
    plain = [int(torch.multinomial(row, 1, generator=plain_gen)) for row in probs]
    spec = verify_sampled(probs, plain[:3], torch.Generator().manual_seed(5))
    assert spec == plain
    wrong = [plain[0], (plain[1] + 1) % 6, plain[2]]
    assert verify_sampled(probs, wrong, torch.Generator().manual_seed(5)) == plain[:2]


# ---- the speculator ------------------------------------------------------------------


class FixedProposer:
    """Proposes ``tokens`` (cut to k) for every sequence; records the calls."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls: list[list[tuple[str, int]]] = []

    def propose(self, requests):
        self.calls.append([(seq.request_id, k) for seq, k in requests])
        return [self.tokens[:k] for _, k in requests]

    def retain(self, request_ids) -> None:
        pass


def test_speculator_caps_k_by_max_tokens_and_context_and_batch_size() -> None:
    proposer = FixedProposer([1, 2, 3, 4, 5, 6])
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_batch_size=2,
                                        cost_model=False),
                      max_model_len=20, proposers={SpeculativeMethod.NGRAM: proposer})
    assert spec.resolve(SpeculativeOptions()) == (SpeculativeMethod.NGRAM, 4)
    assert spec.resolve(SpeculativeOptions(SpeculativeMethod.NONE, 3)) == (
        SpeculativeMethod.NONE, 0)
    assert spec.resolve(SpeculativeOptions(None, 6)) == (SpeculativeMethod.NGRAM, 6)
    # no draft proposer here: a request asking for one runs without speculation
    assert spec.resolve(SpeculativeOptions(SpeculativeMethod.DRAFT)) == (SpeculativeMethod.NONE, 0)
    near_max = make_request("a", 5, max_tokens=4)
    near_max.token_ids.append(9)  # 1 of 4 generated: at most 2 proposals (+1 token)
    near_ctx = make_request("b", 16, max_tokens=100)  # context 20: 16 + k + 1 <= 20
    off = make_request("c", 5, max_tokens=100)
    for seq, method in [(near_max, SpeculativeMethod.NGRAM), (near_ctx, SpeculativeMethod.NGRAM),
                        (off, SpeculativeMethod.NONE)]:
        seq.spec_method, seq.num_spec_tokens = method, 4
    spec.propose([near_max, near_ctx, off], num_running=2)
    assert proposer.calls == [[("a", 2), ("b", 3)]]
    assert (near_max.spec_token_ids, near_ctx.spec_token_ids, off.spec_token_ids) == (
        [1, 2], [1, 2, 3], [])
    near_max.spec_token_ids.clear()
    spec.propose([near_max], num_running=3)  # above disable_batch_size: nothing
    assert near_max.spec_token_ids == [] and len(proposer.calls) == 1


# ---- scheduler bookkeeping -------------------------------------------------------------


def plan_of(out):
    return [(s.seq.request_id, s.start, s.num_tokens, s.samples, s.spec_token_ids)
            for s in out.scheduled]


def test_lookahead_slots_then_rollback_of_rejected_tokens() -> None:
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    kv = scheduler.kv
    seq = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=20)
    scheduler.add(seq)
    out = scheduler.schedule()
    book(scheduler, out, [7])
    assert (seq.num_tokens, seq.num_computed_tokens, kv.block_ids(seq)) == (7, 6, [0, 1])

    # 3 proposals: 4 tokens computed (positions 6..9), a third block reserved
    seq.spec_token_ids[:] = [50, 51, 52]
    out = scheduler.schedule()
    assert plan_of(out) == [("a", 6, 4, True, (50, 51, 52))]
    assert out.num_scheduled_tokens == 4
    assert kv.block_ids(seq) == [0, 1, 2]
    # 50 and 51 accepted, the target's own token 9 instead of 52
    (update,) = book(scheduler, out, [[50, 51, 9]])
    assert update.token_ids == (50, 51, 9) and not update.finished
    assert seq.token_ids[6:] == [7, 50, 51, 9]
    assert seq.num_computed_tokens == 9  # 52's slot (position 9) is not computed
    assert seq.spec_token_ids == []
    pool = kv.pool
    assert [pool.block(b).block_hash is not None for b in (0, 1, 2)] == [True, True, False]
    assert pool.block(1).block_hash == hash_block(
        hash_block(block_hash_seed("test-model"), [10, 11, 12, 13]), [14, 15, 7, 50])

    # all rejected: a fourth block was reserved for positions 12..15 and stays held
    seq.spec_token_ids[:] = [60, 61, 62]
    out = scheduler.schedule()
    assert plan_of(out) == [("a", 9, 4, True, (60, 61, 62))]
    assert kv.block_ids(seq) == [0, 1, 2, 3]
    book(scheduler, out, [[70]])
    assert seq.token_ids[9:] == [9, 70] and seq.num_computed_tokens == 10
    assert kv.block_ids(seq) == [0, 1, 2, 3]
    assert pool.block(2).block_hash is None  # holds 60's keys at position 10: not hashed
    kv.check_integrity()

    # plain steps overwrite position 10 and 11; block 2 is then hashed with verified tokens
    for token in (8, 6):
        out = scheduler.schedule()
        assert plan_of(out) == [("a", seq.num_tokens - 1, 1, True, ())]
        book(scheduler, out, [token])
    assert seq.num_computed_tokens == 12
    assert pool.block(2).block_hash == hash_block(pool.block(1).block_hash, [51, 9, 70, 8])
    assert kv.block_ids(seq) == [0, 1, 2, 3]  # the reserved block is now in use
    scheduler.abort(seq)
    scheduler.schedule()
    kv.check_integrity(idle=True)


def test_proposals_share_the_token_budget() -> None:
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a = make_request("a", 3, max_tokens=20)
    scheduler.add(a)
    book(scheduler, scheduler.schedule(), [7])
    b = make_request("b", 10, max_tokens=2)
    scheduler.add(b)
    a.spec_token_ids[:] = [1, 2, 3, 4, 5]
    out = scheduler.schedule()
    # a takes 1 + 5 = 6 of the 8 tokens, b's prompt chunk the remaining 2
    assert plan_of(out) == [("a", 3, 6, True, (1, 2, 3, 4, 5)), ("b", 0, 2, False, ())]
    book(scheduler, out, [[1, 2, 3]])
    assert a.num_computed_tokens == 6 and a.num_tokens == 7
    scheduler.kv.check_integrity()
    # a budget smaller than 1 + k cuts the proposals
    tight = create_scheduler(max_num_batched_tokens=3)
    c = make_request("c", 2, max_tokens=20)
    tight.add(c)
    book(tight, tight.schedule(), [7])
    c.spec_token_ids[:] = [1, 2, 3, 4]
    out = tight.schedule()
    assert plan_of(out) == [("c", 2, 3, True, (1, 2))]
    book(tight, out, [[1, 2, 5]])
    assert c.token_ids[2:] == [7, 1, 2, 5] and c.num_computed_tokens == 5


def test_short_of_blocks_proposals_are_dropped_not_others_preempted() -> None:
    scheduler = create_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=16)
    a, b = make_request("a", 4, max_tokens=10), make_request("b", 3, max_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    book(scheduler, scheduler.schedule(), [7, 8])
    assert (scheduler.kv.block_ids(a), scheduler.kv.block_ids(b)) == ([0], [1])
    a.spec_token_ids[:] = [1, 2, 3, 4, 5]  # positions 4..9 need 2 more blocks; 1 is free
    out = scheduler.schedule()
    assert plan_of(out) == [("a", 4, 1, True, ()), ("b", 3, 1, True, ())]
    assert not out.preempted
    assert (scheduler.kv.block_ids(a), scheduler.kv.block_ids(b)) == ([0, 2], [1])
    book(scheduler, out, [1, 2])
    scheduler.kv.check_integrity()


@pytest.mark.parametrize("stop", ["stop_id", "eos", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_the_sequence_there(stop: str) -> None:
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    seq = make_request("a", [10, 11, 12], max_tokens=4 if stop == "max_tokens" else 20,
                       ignore_eos=stop != "eos", stop_token_ids=(51,) if stop == "stop_id" else ())
    scheduler.add(seq)
    book(scheduler, scheduler.schedule(), [7])
    seq.spec_token_ids[:] = [50, 2 if stop == "eos" else 51, 52, 53]
    out = scheduler.schedule()
    verified = [50, 2 if stop == "eos" else 51, 52, 53, 54]
    (update,) = book(scheduler, out, [verified])
    expected = {"stop_id": (50, 51), "eos": (50, 2), "max_tokens": (50, 51, 52)}[stop]
    assert update.token_ids == expected and update.finished
    assert seq.token_ids[3:] == [7, *expected]
    assert seq.finish_reason is (FinishReason.LENGTH if stop == "max_tokens"
                                 else FinishReason.STOP)
    assert seq.num_generated_tokens == 1 + len(expected)
    scheduler.kv.check_integrity(idle=True)


def test_cancel_mid_speculation_frees_every_reserved_block() -> None:
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    seq = make_request("a", [10, 11, 12], max_tokens=20)
    scheduler.add(seq)
    book(scheduler, scheduler.schedule(), [7])
    seq.spec_token_ids[:] = [1, 2, 3, 4, 5, 6, 7, 8]
    out = scheduler.schedule()
    assert len(scheduler.kv.block_ids(seq)) == 3  # positions 3..11 reserved
    scheduler.abort(seq)  # cancelled while its step runs
    (update,) = book(scheduler, out, [[1, 2, 3]])
    assert update.finished and update.token_ids == ()
    assert seq.finish_reason is FinishReason.CANCELLED
    assert scheduler.kv.check_integrity(idle=True).used == 0


def test_random_speculative_runs_leave_no_block_behind() -> None:
    rng = __import__("random").Random(6)
    scheduler = create_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=24)
    names = (f"r{i}" for i in itertools.count())
    for _ in range(600):
        if rng.random() < 0.3:
            scheduler.add(make_request(next(names), rng.randint(1, 12),
                                       max_tokens=rng.randint(1, 15),
                                       stop_token_ids=(5,), ignore_eos=True))
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort(rng.choice(scheduler.running))
        out = scheduler.schedule()
        sampled = []
        for item in out.scheduled:
            if item.samples:
                k = len(item.spec_token_ids)
                accepted = rng.randint(0, k)
                sampled.append(list(item.spec_token_ids[:accepted]) + [rng.randint(0, 9)])
        book(scheduler, out, sampled)
        for seq in scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                seq.spec_token_ids[:] = [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]
        scheduler.kv.check_integrity()
        for seq in scheduler.running:
            assert seq.num_computed_tokens <= seq.num_tokens
    while scheduler.has_work():
        out = scheduler.schedule()
        book(scheduler, out, [[1] for s in out.scheduled if s.samples])
    scheduler.kv.check_integrity(idle=True)
