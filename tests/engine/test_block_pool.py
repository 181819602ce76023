"""The block pool and the KV cache manager without a model: exact block ids, reference
counts, eviction order, prefix hits and KV events (vLLM's ``test_prefix_caching`` style)."""

from __future__ import annotations

import pytest

from services.common.block_hash import (
    block_hash_seed,
    hash_block,
    prompt_block_hashes,
    scoped_seed,
)
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.engine.torch_backend import block_pool
from services.engine.torch_backend.block_pool import BlockCounts, BlockPool, KVIntegrityError
from services.engine.torch_backend.kv_cache_manager import KVCacheManager

from .kv_helpers import compute, create_manager, make_request

SEED = block_hash_seed("test-model")


def refs(manager, ids) -> list[int]:
    return [manager.pool.block(i).ref_count for i in ids]


def test_allocate_takes_the_head_of_the_free_queue() -> None:
    manager = create_manager(num_blocks=10, block_size=4)
    a = make_request("a", 10)
    assert manager.allocate_slots(a, 10)
    assert manager.block_ids(a) == [0, 1, 2]
    assert refs(manager, [0, 1, 2]) == [1, 1, 1]
    assert manager.pool.free_queue_ids() == [3, 4, 5, 6, 7, 8, 9]
    # Two more tokens fit in block 2; the third needs block 3.
    a.num_computed_tokens = 10
    assert manager.allocate_slots(a, 2)
    assert manager.block_ids(a) == [0, 1, 2]
    assert manager.allocate_slots(a, 3)
    assert manager.block_ids(a) == [0, 1, 2, 3]
    assert manager.check_integrity() == BlockCounts(free=6, cached=0, used=4, total=10)


def test_allocate_is_all_or_nothing() -> None:
    manager = create_manager(num_blocks=4, block_size=4)
    a, b = make_request("a", 12), make_request("b", 8)
    assert manager.allocate_slots(a, 12)
    assert not manager.allocate_slots(b, 8)
    assert manager.block_ids(b) == []
    assert manager.pool.free_queue_ids() == [3]
    assert manager.check_integrity().used == 3


def test_free_returns_the_last_block_first() -> None:
    manager = create_manager(num_blocks=6, block_size=4)
    a = make_request("a", 12)
    manager.allocate_slots(a, 12)
    manager.free(a)  # nothing computed, so no hash: back to the head, last block first
    assert manager.pool.free_queue_ids() == [2, 1, 0, 3, 4, 5]
    assert refs(manager, range(6)) == [0] * 6
    assert manager.check_integrity(idle=True) == BlockCounts(free=6, cached=0, used=0, total=6)


def test_full_computed_blocks_are_hashed_chained_and_announced() -> None:
    manager = create_manager(num_blocks=10, block_size=4)
    a = make_request("a", 10)  # tokens 100..109: blocks [100..103] [104..107] [108, 109]
    manager.allocate_slots(a, 10)
    compute(manager, a)
    h0 = hash_block(SEED, [100, 101, 102, 103])
    h1 = hash_block(h0, [104, 105, 106, 107])
    assert a.block_hashes == [h0, h1]
    assert [manager.pool.block(i).block_hash for i in (0, 1, 2)] == [h0, h1, None]
    assert manager.take_events() == [BlockStored((h0, h1), None, tuple(range(100, 108)), 4)]
    # A decoded token fills block 2 once computed; its event chains to h1.
    a.token_ids += [110, 111]
    manager.allocate_slots(a, 2)
    compute(manager, a, 12)
    h2 = hash_block(h1, [108, 109, 110, 111])
    assert manager.take_events() == [BlockStored((h2,), h1, (108, 109, 110, 111), 4)]
    assert manager.take_events() == []


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    manager = create_manager(num_blocks=10, block_size=4)
    a = make_request("a", 12)
    manager.allocate_slots(a, 12)
    compute(manager, a)
    b = make_request("b", list(range(100, 108)) + [7, 7, 7])  # shares a's first 2 blocks
    hit = manager.find_prefix(b)
    assert hit.num_tokens == 8
    assert manager.allocate_slots(b, 3, hit)
    assert manager.block_ids(b) == [0, 1, 3]
    assert refs(manager, [0, 1, 2, 3]) == [2, 2, 1, 1]
    manager.free(a)
    assert refs(manager, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert manager.pool.free_queue_ids() == [4, 5, 6, 7, 8, 9, 2]
    manager.free(b)
    # b's tail (3, never computed: no hash) goes to the head; the shared blocks
    # to the tail once their last holder left.
    assert manager.pool.free_queue_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert manager.check_integrity(idle=True) == BlockCounts(free=7, cached=3, used=0, total=10)


@pytest.mark.parametrize(("role_aware", "hit_tokens"), [(True, 4), (False, 12)])
def test_role_aware_hashes_keep_generated_blocks_from_standing_in_for_prompts(
        role_aware: bool, hit_tokens: int) -> None:
    """a: prompt 6 tokens, then 8 generated. b's prompt is a's tokens plus more
    (a chat's next turn): with roles, only a's all-prompt first block is a hit."""
    manager = KVCacheManager(10, 4, True, model_id="test-model", role_aware=role_aware)
    a = make_request("a", 6)
    a.token_ids.extend(range(200, 208))
    manager.allocate_slots(a, 14)
    compute(manager, a)
    manager.free(a)
    b = make_request("b", a.token_ids + [9, 9, 9])
    assert manager.find_prefix(b).num_tokens == hit_tokens
    plain = [hash_block(SEED, a.token_ids[:4])]
    plain.append(hash_block(plain[0], a.token_ids[4:8]))
    assert (a.block_hashes[0], a.block_hashes[1] == plain[1]) == (plain[0], not role_aware)
    assert b.block_hashes[:2] == plain  # all-prompt blocks hash as they always did
    # The same sequence looked up again (a recompute after preemption) hits all of it.
    again = make_request("a2", 6)
    again.token_ids.extend(range(200, 208))
    assert manager.find_prefix(again).num_tokens == 12


@pytest.mark.parametrize(("prompt_len", "hit_tokens"), [(7, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_a_hit_leaves_the_last_token_to_compute(prompt_len: int, hit_tokens: int) -> None:
    manager = create_manager(num_blocks=10, block_size=4)
    a = make_request("a", 16)
    manager.allocate_slots(a, 16)
    compute(manager, a)
    manager.free(a)
    b = make_request("b", prompt_len)  # a prefix of a's tokens
    assert manager.find_prefix(b).num_tokens == hit_tokens


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    manager = create_manager(num_blocks=6, block_size=4)
    a, b = make_request("a", 8), make_request("b", list(range(200, 208)))
    for seq in (a, b):
        manager.allocate_slots(seq, 8)
        compute(manager, seq)
    manager.take_events()
    manager.free(a)  # free queue: 4 5 | a: 1 0
    manager.free(b)  # then b: 3 2
    assert manager.pool.free_queue_ids() == [4, 5, 1, 0, 3, 2]
    c = make_request("c", list(range(300, 312)))
    manager.allocate_slots(c, 12)
    assert manager.block_ids(c) == [4, 5, 1]
    assert manager.take_events() == [BlockRemoved((a.block_hashes[1],))]
    assert manager.pool.get_cached_block(a.block_hashes[1]) is None
    assert manager.pool.get_cached_block(a.block_hashes[0]).block_id == 0
    # a's first block still hits; its second was evicted, so the hit stops there.
    again = make_request("a2", 9)
    assert manager.find_prefix(again).blocks == (manager.pool.block(0),)
    assert manager.check_integrity() == BlockCounts(free=0, cached=3, used=3, total=6)


def test_requests_that_cache_nothing_reuse_free_blocks_and_evict_no_prefix() -> None:
    """A stream of short requests (under one block: nothing to cache) takes
    free blocks back, not cached ones: a cached prefix survives any number of
    them while a free block is left (with freed blocks appended at the tail,
    like vLLM's queue, 20 such requests through 8 blocks evicted all of a)."""
    manager = create_manager(num_blocks=8, block_size=4)
    a = make_request("a", 12)
    manager.allocate_slots(a, 12)
    compute(manager, a)
    manager.free(a)
    manager.take_events()
    for i in range(20):
        short = make_request(f"s{i}", list(range(500 + 3 * i, 503 + 3 * i)))
        assert manager.allocate_slots(short, 3)
        compute(manager, short)
        manager.free(short)
    assert manager.take_events() == []  # no BlockRemoved
    assert manager.find_prefix(make_request("a2", 13)).num_tokens == 12
    assert manager.check_integrity(idle=True) == BlockCounts(free=5, cached=3, used=0, total=8)


def test_a_hit_takes_a_cached_block_out_of_the_middle_of_the_free_queue() -> None:
    manager = create_manager(num_blocks=6, block_size=4)
    a = make_request("a", 8)
    manager.allocate_slots(a, 8)
    compute(manager, a)
    manager.free(a)
    assert manager.pool.free_queue_ids() == [2, 3, 4, 5, 1, 0]
    b = make_request("b", 6)  # hits block 0 only
    hit = manager.find_prefix(b)
    assert manager.allocate_slots(b, 2, hit)
    assert manager.block_ids(b) == [0, 2]
    assert manager.pool.free_queue_ids() == [3, 4, 5, 1]
    assert refs(manager, [0, 1, 2]) == [1, 0, 1]


def test_a_hit_on_a_cached_block_counts_against_free_blocks() -> None:
    manager = create_manager(num_blocks=3, block_size=4)
    a = make_request("a", 8)
    manager.allocate_slots(a, 8)
    compute(manager, a)
    manager.free(a)  # 3 free blocks, 2 of them cached
    b = make_request("b", list(range(100, 108)) + [1] * 8)  # hits 2 blocks, needs 2 more
    hit = manager.find_prefix(b)
    assert hit.num_tokens == 8
    assert not manager.allocate_slots(b, 8, hit)
    assert refs(manager, [0, 1, 2]) == [0, 0, 0]
    assert manager.allocate_slots(b, 4, hit)
    assert manager.block_ids(b) == [0, 1, 2]


def test_an_equal_block_computed_twice_is_registered_once() -> None:
    manager = create_manager(num_blocks=8, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)  # same tokens, computed side by side
    manager.allocate_slots(a, 8)
    manager.allocate_slots(b, 8)
    compute(manager, a)
    compute(manager, b)
    assert [manager.pool.block(i).block_hash is not None for i in range(4)] == [
        True, True, False, False]
    assert len(manager.take_events()) == 1
    manager.free(a)
    manager.free(b)
    assert manager.check_integrity(idle=True) == BlockCounts(free=6, cached=2, used=0, total=8)


def test_prefix_caching_off_never_hashes_or_hits() -> None:
    manager = create_manager(num_blocks=6, block_size=4, enable_caching=False)
    a = make_request("a", 8)
    manager.allocate_slots(a, 8)
    compute(manager, a)
    manager.free(a)
    assert manager.find_prefix(make_request("b", 8)).num_tokens == 0
    assert a.block_hashes == []
    assert manager.take_events() == []
    assert manager.check_integrity(idle=True) == BlockCounts(free=6, cached=0, used=0, total=6)


def test_reset_prefix_cache_only_when_idle() -> None:
    manager = create_manager(num_blocks=4, block_size=4)
    a = make_request("a", 8)
    manager.allocate_slots(a, 8)
    compute(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    manager.take_events()
    assert manager.reset_prefix_cache() is True
    assert manager.take_events() == [AllBlocksCleared()]
    assert manager.find_prefix(make_request("b", 9)).num_tokens == 0
    assert manager.check_integrity(idle=True).cached == 0


def test_integrity_check_catches_double_frees_and_leaks() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(KVIntegrityError, match="freed with ref_count 0"):
        pool.free(blocks[:1])
    manager = create_manager(num_blocks=4, block_size=4)
    a = make_request("a", 4)
    manager.allocate_slots(a, 4)
    with pytest.raises(KVIntegrityError, match="idle but 1 blocks are used"):
        manager.check_integrity(idle=True)
    manager.pool.block(0).ref_count = 2  # a reference no block table accounts for
    with pytest.raises(KVIntegrityError, match="block 0: ref_count 2, 1 block tables"):
        manager.check_integrity()


def test_cached_hashes_are_what_a_client_computes_from_the_prompt() -> None:
    manager = create_manager(num_blocks=10, block_size=4)
    seq = make_request("a", 10)
    manager.allocate_slots(seq, 10, manager.find_prefix(seq))
    compute(manager, seq)
    expected = prompt_block_hashes(manager.hash_seed, seq.token_ids, 4)
    assert len(expected) == 2
    assert sorted(manager.cached_hashes()) == sorted(expected)


def test_prefix_blocks_are_reused_only_within_a_cache_scope() -> None:
    # Tenant a's prompt is cached; tenant b sending the same ids finds nothing,
    # a's next request (and the shared scope's, separately) finds its own.
    manager = create_manager(num_blocks=16, block_size=4)
    first = make_request("a1", 9, cache_scope="scope-a")
    assert manager.find_prefix(first).num_tokens == 0
    manager.allocate_slots(first, 9)
    compute(manager, first)
    other = make_request("b1", 9, cache_scope="scope-b")
    assert manager.find_prefix(other).num_tokens == 0
    shared = make_request("s1", 9)
    assert manager.find_prefix(shared).num_tokens == 0
    again = make_request("a2", 9, cache_scope="scope-a")
    assert manager.find_prefix(again).num_tokens == 8
    # the hashes the engine publishes are what the router computes for the scope
    # (KV-aware routing looks a prompt up with the same scoped seed)
    expected = prompt_block_hashes(scoped_seed(manager.hash_seed, "scope-a"),
                                   first.token_ids, 4)
    assert sorted(manager.cached_hashes()) == sorted(expected)
    assert scoped_seed(manager.hash_seed, "") == manager.hash_seed  # shared: unchanged


def test_a_full_event_buffer_drops_the_oldest_and_counts_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_pool, "MAX_PENDING_EVENTS", 2)
    manager = create_manager(num_blocks=10, block_size=4)
    for name in "abc":  # three sequences, one BlockStored event each
        seq = make_request(name, [ord(name)] * 4 + [1])
        manager.allocate_slots(seq, 5, manager.find_prefix(seq))
        compute(manager, seq)
    assert manager.pool.events_dropped == 1
    events = manager.take_events()
    assert [e.token_ids[0] for e in events] == [ord("b"), ord("c")]  # type: ignore[union-attr]


def test_kv_seed_separates_models_layouts_and_salts() -> None:
    seeds = {block_hash_seed("m"), block_hash_seed("m", "int4/float32"),
             block_hash_seed("m", "int8/float32"), block_hash_seed("m2"),
             scoped_seed(block_hash_seed("m"), "tenant-a")}
    assert len(seeds) == 5 and all(len(seed) == 32 for seed in seeds)
    assert KVCacheManager(4, 4, model_id="m", kv_layout="int4/float32").hash_seed == \
        block_hash_seed("m", "int4/float32")
