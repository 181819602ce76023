"""Suffix decoding's structures without a model (services/engine/torch_backend/
suffix_cache.py, suffix_proposer.py): exact matches, continuations and
probabilities on hand-made token streams, the ring's eviction and its index
compaction, tenant isolation, and the cache's memory against its bound over
10,000 outputs (tracemalloc)."""

from __future__ import annotations

import dataclasses
import random
import tracemalloc

import numpy as np
import pytest

from services.common.sampling import FinishReason, SamplingOptions
from services.engine.torch_backend.sequence import Sequence
from services.engine.torch_backend.speculative import Proposal
from services.engine.torch_backend.suffix_cache import (
    KEY_BYTES,
    SuffixCache,
    best_path,
    longest_match,
    request_continuation,
)
from services.engine.torch_backend.spec_options import SuffixOptions
from services.engine.torch_backend.suffix_proposer import SuffixProposer
from services.engine.types import SequenceRequest

from .kv_helpers import make_request


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


# ---- matching and continuations ---------------------------------------------------------


def test_the_longest_suffix_match_keeps_only_the_deepest_occurrences() -> None:
    buffer = ids(7, 1, 2, 3, 9, 4, 2, 3, 5, 1, 2, 3)
    ends = np.flatnonzero(buffer[:-1] == 3)  # occurrences of the last token: 3, 7
    length, found = longest_match(buffer, ends, buffer, matched=1, max_match=8, low=0)
    assert (length, found.tolist()) == (3, [3])  # "1 2 3" only at 1..3
    length, found = longest_match(buffer, ends, buffer, matched=1, max_match=2, low=0)
    assert (length, found.tolist()) == (2, [3, 7])  # capped at 2: "2 3" twice
    # positions before ``low`` are gone (a ring's overwritten part)
    length, found = longest_match(buffer, ends, buffer, matched=1, max_match=8, low=2)
    assert (length, found.tolist()) == (2, [3, 7])


def test_the_best_path_follows_the_majority_with_its_share_as_probability() -> None:
    # after "a": b c (x2), b d (x1), end of data (x1)
    a, b, c, d = 1, 2, 3, 4
    buffer = ids(a, b, c, 0, a, b, c, 0, a, b, d, 0, a)
    ends = ids(0, 4, 8, 12)
    tokens, probs = best_path(buffer, ends, high=buffer.shape[0], depth=4, min_prob=0.0)
    assert tokens == (b, c, 0, a)  # both "b c" occurrences go on with "0 a"
    assert probs == pytest.approx((0.75, 0.5, 0.5, 0.5))
    # cut before the probability falls below the bar
    tokens, probs = best_path(buffer, ends, high=buffer.shape[0], depth=4, min_prob=0.6)
    assert tokens == (b,) and probs == pytest.approx((0.75,))


def test_a_request_continues_from_its_own_earlier_tokens() -> None:
    tokens = ids(1, 2, 3, 9, 1, 2, 3, 9, 5, 1, 2, 3)
    found = request_continuation(tokens, depth=3, max_match=8, min_prob=0.1, window=64)
    assert found.match_len == 3
    assert found.tokens == (9, 1, 2)  # both occurrences say 9; then one says 1, one 5
    assert found.probs == pytest.approx((1.0, 0.5, 0.5))
    assert found.score == pytest.approx(2.0)
    # the window: the earlier occurrences out of reach, nothing proposed
    assert request_continuation(tokens, depth=3, max_match=8, min_prob=0.1,
                                window=3).tokens == ()
    assert request_continuation(ids(5), depth=3, max_match=8, min_prob=0.1,
                                window=64).tokens == ()


def test_the_cache_matches_across_outputs_but_never_across_their_boundary() -> None:
    cache = SuffixCache(max_tokens=64)
    cache.insert([10, 11, 12, 13, 14])
    cache.insert([20, 10, 11, 12, 15])
    context = ids(99, 10, 11, 12)
    found = cache.continuation(context, depth=4, max_match=8, min_prob=0.0)
    assert found.match_len == 3
    assert found.tokens[:1] in ((13,), (15,)) and found.probs[0] == pytest.approx(0.5)
    # the first output's continuation stops at its end (14), it never runs into
    # the second output
    only = cache.continuation(ids(12, 13), depth=5, max_match=8, min_prob=0.0)
    assert only.tokens == (14,) and only.probs == (1.0,)
    assert cache.continuation(ids(14, 20), depth=3, max_match=8, min_prob=0.0).tokens == ()
    # a lookup leaves nothing that pins the index: the same bigram takes more outputs
    cache.insert([10, 11, 12, 13, 16])
    again = cache.continuation(context, depth=2, max_match=8, min_prob=0.0)
    assert again.tokens == (13, 14) and again.probs == pytest.approx((2 / 3, 1 / 3))


def test_tenants_never_see_each_others_outputs() -> None:
    cache = SuffixCache(max_tokens=64)
    cache.insert([1, 2, 3, 4, 5], scope="tenant-a")
    assert cache.continuation(ids(1, 2), "tenant-a", depth=3, max_match=8,
                              min_prob=0.0).tokens == (3, 4, 5)
    for scope in ("tenant-b", ""):
        assert cache.continuation(ids(1, 2), scope, depth=3, max_match=8,
                                  min_prob=0.0).tokens == ()


def test_the_ring_forgets_the_oldest_outputs_and_the_index_drops_them() -> None:
    cache = SuffixCache(max_tokens=32)
    cache.insert([1, 2, 3, 4, 5, 6, 7])  # 8 slots with its end marker
    for n in range(10):  # 10 more outputs of 6 tokens: the first is overwritten
        cache.insert([100 + n, 200 + n, 300 + n, 400 + n, 500 + n])
    assert cache.continuation(ids(1, 2), depth=3, max_match=8, min_prob=0.0).tokens == ()
    newest = cache.continuation(ids(109, 209), depth=3, max_match=8, min_prob=0.0)
    assert newest.tokens == (309, 409, 509)
    assert cache.num_tokens == 32
    # stale positions are compacted away once they outnumber the ring
    assert cache._positions <= 2 * cache.max_tokens
    assert sum(len(p) for p in cache._index.values()) == cache._positions


def test_the_cache_memory_stays_under_its_bound_over_10000_outputs() -> None:
    rng = random.Random(3)
    max_tokens = 50_000
    vocabulary = 49_152
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(max_tokens=max_tokens)
        peak_estimate = 0
        phrases = [[rng.randrange(vocabulary) for _ in range(12)] for _ in range(300)]
        for _ in range(10_000):
            output = []
            while len(output) < rng.randint(20, 120):  # repeated phrases and fresh tokens
                output += (rng.choice(phrases) if rng.random() < 0.5
                           else [rng.randrange(vocabulary) for _ in range(8)])
            cache.insert(output)
            peak_estimate = max(peak_estimate, cache.nbytes())
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.num_inserted == 10_000 and cache.num_tokens == max_tokens
    # the documented bound: ring + at most 2 positions a slot + a key per position
    bound = 4 * max_tokens + 2 * max_tokens * (8 + KEY_BYTES)
    print(f"10,000 outputs, ring of {max_tokens} tokens: {held / 1e6:.1f} MB held "
          f"(estimate {cache.nbytes() / 1e6:.1f} MB, peak estimate {peak_estimate / 1e6:.1f} "
          f"MB, bound {bound / 1e6:.1f} MB), {cache.num_keys} keys")
    assert peak_estimate <= bound
    assert held <= bound
    assert 0.5 * held <= cache.nbytes() <= 1.5 * held  # the gauge says what it holds


# ---- the proposer -------------------------------------------------------------------------


def finished(seq: Sequence, output: list[int]) -> Sequence:
    seq.token_ids.extend(output)
    seq.finish_reason = FinishReason.STOP
    return seq


def with_scope(seq: Sequence, scope: str) -> Sequence:
    seq.request = dataclasses.replace(seq.request, cache_scope=scope)
    return seq


def test_the_proposer_prefers_the_better_scored_source_and_cuts_by_match_length() -> None:
    proposer = SuffixProposer(SuffixOptions(spec_factor=1.0, min_token_prob=0.0))
    # an earlier request answered "5 6 7 8 9 10 11" after "... 5"
    proposer.finished([finished(make_request("old", (1, 2, 3, 4)), [5, 6, 7, 8, 9, 10, 11])])
    seq = make_request("new", (40, 41, 4))
    seq.token_ids.extend([5, 6, 7])  # matches "5 6 7" (outputs only are cached: not 4)
    (proposal,) = proposer.propose([(seq, 8)])
    assert isinstance(proposal, Proposal)
    assert proposal == [8, 9, 10]  # ceil(1.0 * 3) tokens
    assert proposal.probs == (1.0, 1.0, 1.0)
    # a longer spec factor reaches the end of the stored output
    longer = SuffixProposer(SuffixOptions(spec_factor=4.0, min_token_prob=0.0))
    longer.cache = proposer.cache
    assert longer.propose([(seq, 16)]) == [[8, 9, 10, 11]]
    # the sequence's own tokens win where they match further
    own = make_request("own", (7, 8, 9, 1, 5, 6, 7, 8, 9, 2, 5, 6, 7))
    (proposal,) = proposer.propose([(own, 8)])
    assert proposal[:2] == [8, 9]


def test_the_proposer_keeps_cache_scopes_apart_by_default_and_frees_finished_state() -> None:
    scoped = SuffixProposer(SuffixOptions(min_token_prob=0.0))  # the default scope: tenant
    assert scoped.options.scope == "tenant"
    scoped.finished([finished(with_scope(make_request("a", (1, 2)), "a"), [3, 4, 5, 6])])
    # the same tenant under another name, but another cache scope: nothing to propose
    probe_b = with_scope(make_request("b", (9, 3, 4)), "b")
    probe_b.request = dataclasses.replace(probe_b.request, tenant="a")
    probe_a = with_scope(make_request("a2", (9, 3, 4)), "a")
    assert scoped.propose([(probe_b, 4), (probe_a, 4)]) == [[], [5, 6]]
    assert set(scoped._mirrors) == {probe_b.arrival, probe_a.arrival}
    scoped.retain({probe_a.arrival})
    assert set(scoped._mirrors) == {probe_a.arrival}
    shared = SuffixProposer(SuffixOptions(scope="global", min_token_prob=0.0))
    shared.cache = scoped.cache
    shared.options = dataclasses.replace(shared.options, scope="global")
    assert shared.propose([(probe_b, 4)]) == [[]]  # stored under tenant a's scope


def test_short_outputs_and_no_cache_are_fine() -> None:
    proposer = SuffixProposer(SuffixOptions(cache_tokens=0))
    assert proposer.cache is None
    proposer.finished([finished(make_request("x", (1, 2)), [3, 4])])
    seq = Sequence(SequenceRequest("y", (1, 2, 1), SamplingOptions(max_tokens=8)), 99)
    assert proposer.propose([(seq, 4)]) == [[2]]  # "1" -> "2": a 1-token match, 1 token


@pytest.mark.parametrize("bad", [dict(max_match=1), dict(spec_factor=0.0),
                                 dict(min_token_prob=1.0), dict(window=1),
                                 dict(cache_tokens=1), dict(scope="user")])
def test_bad_options_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SuffixOptions(**bad)
