"""TensorRT-LLM's KV cache events, iteration stats and streamed outputs in
llmesh's terms, without TensorRT-LLM (events and stats in the documented
dict shape of ``get_kv_cache_events_async`` / ``get_stats_async``)."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from services.common.block_hash import block_hash_seed, hash_block
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import FinishReason
from services.engine.tensorrt_llm_backend.kv_events import KvEventConverter
from services.engine.tensorrt_llm_backend.outputs import finish_reason, position_logprobs
from services.engine.tensorrt_llm_backend.stats import capped_load, parse_iteration_stats
from services.engine.types import LoadStats

from .kv_helpers import compute, create_manager, make_request

SEED = block_hash_seed("test-model")


def block(trt_hash: int, token_ids: list[int], extra: int = 0) -> dict:
    return {"type": "stored_block", "block_hash": trt_hash, "cache_level": 0, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra}
                       for t in token_ids]}


def stored(parent: int | None, *blocks: dict, event_id: int = 1) -> dict:
    return {"event_id": event_id, "window_size": 4096,
            "data": {"type": "stored", "parent_hash": parent, "blocks": list(blocks)}}


def removed(*hashes: int) -> dict:
    return {"event_id": 9, "window_size": 4096,
            "data": {"type": "removed", "block_hashes": list(hashes)}}


def test_stored_chains_are_rehashed_with_our_block_hash() -> None:
    converter = KvEventConverter(SEED, block_size=4)
    h0 = hash_block(SEED, [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert converter.convert(stored(None, block(901, [1, 2, 3, 4]), block(902, [5, 6, 7, 8]))) \
        == [BlockStored((h0, h1), None, (1, 2, 3, 4, 5, 6, 7, 8), 4)]
    h2 = hash_block(h1, [9, 9, 9, 9])  # a later event continues from TRT's parent 902
    assert converter.convert(stored(902, block(903, [9, 9, 9, 9]))) == [
        BlockStored((h2,), h1, (9, 9, 9, 9), 4)]
    assert set(converter.block_hashes()) == {h0, h1, h2}


def test_the_same_tokens_hash_alike_from_either_backend() -> None:
    """The prefix index cannot tell which backend published: the torch block
    pool and the TensorRT-LLM converter name the same blocks the same way."""
    manager = create_manager(num_blocks=10, block_size=4)  # model "test-model"
    seq = make_request("a", 10)  # tokens 100..109: two full blocks
    manager.allocate_slots(seq, 10)
    compute(manager, seq)
    [from_torch] = manager.take_events()
    converter = KvEventConverter(manager.hash_seed, block_size=4)
    [from_trt] = converter.convert(stored(None, block(0xAB, list(range(100, 104))),
                                          block(0xCD, list(range(104, 108)))))
    assert from_trt == from_torch


def test_removed_translates_known_hashes_and_skips_unknown_ones() -> None:
    converter = KvEventConverter(SEED, block_size=4)
    [event] = converter.convert(stored(None, block(1, [1, 2, 3, 4]), block(2, [5, 6, 7, 8])))
    assert isinstance(event, BlockStored)
    assert converter.convert(removed(2, 77)) == [BlockRemoved((event.block_hashes[1],))]
    assert converter.convert(removed(77)) == []
    assert converter.block_hashes() == (event.block_hashes[0],)


def test_a_stored_event_with_an_unknown_parent_is_dropped_and_counted() -> None:
    converter = KvEventConverter(SEED, block_size=4)
    assert converter.convert(stored(555, block(3, [1, 2, 3, 4]))) == []
    assert (converter.dropped_events, converter.block_hashes()) == (1, ())
    assert converter.convert(removed(3)) == []  # nor can its removal be named


def test_partial_and_multimodal_blocks_end_the_chain() -> None:
    converter = KvEventConverter(SEED, block_size=4)
    h0 = hash_block(SEED, [1, 2, 3, 4])
    assert converter.convert(stored(None, block(1, [1, 2, 3, 4]), block(2, [5, 6]))) == [
        BlockStored((h0,), None, (1, 2, 3, 4), 4)]
    assert converter.convert(stored(None, block(3, [7, 7, 7, 7], extra=12))) == []
    assert converter.convert(removed(2, 3)) == []


def test_created_clears_everything_and_updated_changes_nothing() -> None:
    converter = KvEventConverter(SEED, block_size=4)
    converter.convert(stored(None, block(1, [1, 2, 3, 4])))
    updated = {"event_id": 3, "data": {"type": "updated", "block_hash": 1,
                                       "cache_level": {"type": "event_diff", "new_value": 1,
                                                       "old_value": 0}}}
    assert converter.convert(updated) == []
    assert len(converter.block_hashes()) == 1
    created = {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}
    assert converter.convert(created) == [AllBlocksCleared()]
    assert converter.block_hashes() == ()


def test_a_malformed_event_raises_for_the_reader_to_log() -> None:
    with pytest.raises(KeyError):
        KvEventConverter(SEED, 4).convert({"event_id": 1})


# ---- iteration stats ------------------------------------------------------------------------


STATS = {
    "iter": 12, "iterLatencyMS": 8.0, "numActiveRequests": 3, "numQueuedRequests": 1,
    "maxNumActiveRequests": 64,
    "inflightBatchingStats": {"numScheduledRequests": 3, "numContextRequests": 1,
                              "numGenRequests": 2, "numPausedRequests": 2, "numCtxTokens": 512},
    "kvCacheStats": {"maxNumBlocks": 400, "freeNumBlocks": 300, "usedNumBlocks": 100,
                     "tokensPerBlock": 32},
    "specDecodingStats": {"numDraftTokens": 6, "numAcceptedTokens": 4,
                          "numRequestsWithDraftTokens": 2},
}


def test_iteration_stats_become_load_and_step_stats() -> None:
    snapshot = parse_iteration_stats(STATS)
    assert snapshot.load == LoadStats(num_running=3, num_waiting=3, kv_cache_usage=0.25)
    step = snapshot.step
    assert (step.duration_s, step.num_scheduled_tokens, step.batch_size) == (0.008, 520, 3)
    assert (step.spec_num_drafts, step.spec_num_draft_tokens,
            step.spec_num_accepted_tokens) == (2, 6, 4)
    assert (snapshot.kv_capacity_blocks, snapshot.tokens_per_block) == (400, 32)
    assert parse_iteration_stats(json.dumps(STATS)) == snapshot  # older releases: JSON text


def test_missing_sections_count_as_zero_and_non_objects_are_refused() -> None:
    snapshot = parse_iteration_stats({"numActiveRequests": 1})
    assert snapshot.load == LoadStats(1, 0, 0.0)
    assert (snapshot.step.duration_s, snapshot.kv_capacity_blocks) == (0.0, 0)
    with pytest.raises(ValueError, match="JSON object"):
        parse_iteration_stats("[1, 2]")


def test_load_is_capped_by_the_requests_in_flight() -> None:
    last = LoadStats(num_running=3, num_waiting=2, kv_cache_usage=0.4)
    assert capped_load(last, in_flight=10, with_output=3) == last
    # The engine idled after its last iteration: nothing is in flight any more.
    assert capped_load(last, in_flight=0, with_output=0) == LoadStats(0, 0, 0.4)
    assert capped_load(last, in_flight=4, with_output=4) == LoadStats(3, 1, 0.4)
    assert capped_load(None, in_flight=3, with_output=1) == LoadStats(1, 2, 0.0)


# ---- streamed outputs ----------------------------------------------------------------------

Logprob = namedtuple("Logprob", "logprob rank")  # tensorrt_llm.executor.result.Logprob's shape


def test_finish_reasons() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "cancelled", "timeout", None)] == [
        FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.CANCELLED,
        FinishReason.NONE]


def test_logprobs_keep_the_top_k_by_rank_and_the_chosen_token() -> None:
    entries = [{5: Logprob(-0.1, 1), 9: Logprob(-2.5, 2), 4: Logprob(-3.0, 7)},
               {8: Logprob(-0.7, 1)}]
    assert position_logprobs((4, 8), entries, keep=2) == (
        PositionLogprobs(TokenLogprob(4, -3.0, 7),
                         (TokenLogprob(5, -0.1, 1), TokenLogprob(9, -2.5, 2))),
        PositionLogprobs(TokenLogprob(8, -0.7, 1), (TokenLogprob(8, -0.7, 1),)))
    assert position_logprobs((8,), entries[1:], keep=0) == (
        PositionLogprobs(TokenLogprob(8, -0.7, 1)),)


def test_logprobs_without_ranks_are_ranked_by_value() -> None:
    entries = [{3: Logprob(-1.0, None), 6: Logprob(-0.2, None)}]
    assert position_logprobs((3,), entries, keep=1) == (
        PositionLogprobs(TokenLogprob(3, -1.0, 2), (TokenLogprob(6, -0.2, 1),)),)


def test_logprobs_in_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="2 log-probability entries for 1 tokens"):
        position_logprobs((1,), [{1: Logprob(-1.0, 1)}] * 2, keep=0)
    with pytest.raises(ValueError, match="no log-probability of the chosen token 1"):
        position_logprobs((1,), [-0.5], keep=0)  # type: ignore[list-item]
