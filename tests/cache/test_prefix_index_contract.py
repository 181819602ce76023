"""The PrefixIndex contract, run against both stores: memory and a real Redis (valkey).

Hashes are real chained block hashes of a synthetic prompt. Liveness is tested
with a 0.2 s ttl: an injected clock moves for the memory store, real time
passes for Redis.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from services.cache.metrics import CacheMetrics
from services.cache.prefix_index import (
    MemoryPrefixIndex,
    PrefixIndex,
    PrefixMatch,
    RedisPrefixIndex,
)
from services.common.block_hash import block_hash_seed, prompt_block_hashes
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from tests.cache.helpers import FakeClock, sample

#: Liveness of the expiry tests (seconds); the other tests use a long one.
SHORT_TTL_S = 0.2
LONG_TTL_S = 30.0

SEED = block_hash_seed("smollm2")
#: 200 chained hashes of one prompt (block size 16).
H = prompt_block_hashes(SEED, list(range(3200)), 16)
#: 50 hashes of another prompt.
OTHER = prompt_block_hashes(SEED, list(range(5000, 5800)), 16)


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=None, token_ids=(), block_size=16)


def removed(*hashes: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(hashes))


@dataclass
class Stores:
    """Opens indexes of one kind on one backend and lets liveness time pass for them."""

    kind: str
    metrics: CacheMetrics
    build: Callable[[float], PrefixIndex]
    pass_time: Callable[[float], Awaitable[None]]
    opened: list[PrefixIndex] = field(default_factory=list)

    async def open(self, liveness_ttl_s: float = LONG_TTL_S) -> PrefixIndex:
        index = self.build(liveness_ttl_s)
        await index.start()
        self.opened.append(index)
        return index


def _memory_stores(metrics: CacheMetrics) -> Stores:
    clock = FakeClock()

    async def pass_time(seconds: float) -> None:
        clock.advance(seconds)

    return Stores("memory", metrics, lambda ttl: MemoryPrefixIndex(
        liveness_ttl_s=ttl, clock=clock, metrics=metrics), pass_time)


def _redis_stores(url: str, metrics: CacheMetrics) -> Stores:
    return Stores("redis", metrics, lambda ttl: RedisPrefixIndex(
        url, liveness_ttl_s=ttl, metrics=metrics), asyncio.sleep)


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest, metrics: CacheMetrics,
                 ) -> AsyncIterator[Stores]:
    """Both kinds; Redis is the session server with its database emptied."""
    if request.param == "memory":
        made = _memory_stores(metrics)
    else:
        request.getfixturevalue("redis_client")  # empties the database
        made = _redis_stores(request.getfixturevalue("redis_server").url, metrics)
    yield made
    for index in made.opened:
        await index.close()


@pytest.fixture
async def index(stores: Stores) -> PrefixIndex:
    return await stores.open()


def resyncs(stores: Stores, replica: str, reason: str) -> float:
    return sample(stores.metrics, "llmesh:kv_index_resyncs_total", replica=replica, reason=reason)


# Register, replace, score ----------------------------------------------------


async def test_a_snapshot_scores_its_leading_blocks(index: PrefixIndex) -> None:
    assert await index.register("a", 1, capacity_blocks=100) is True
    assert await index.replace("a", 1, H[:5]) is True
    assert await index.score(H[:8]) == {"a": 5}
    assert await index.score(H[:3]) == {"a": 3}
    assert await index.sizes() == {"a": 5}


async def test_offloaded_blocks_count_after_the_pool_run(index: PrefixIndex) -> None:
    """A block in the offload tier is an entry of its own: counted after the
    pool's leading run (up to the first block held in neither medium), never
    in it; removing it from one medium leaves the other."""
    await index.register("a", 1, 100)
    assert await index.replace("a", 1, [H[0], H[1], H[3]], offloaded=[H[2], H[4], H[1]])
    assert await index.match(H[:8]) == {"a": PrefixMatch(2, 3)}  # H2 tier, H3 pool, H4 tier
    assert await index.score(H[:8]) == {"a": 2}
    assert await index.match(H[2:8]) == {"a": PrefixMatch(0, 3)}  # listed: held offloaded
    assert await index.score(H[2:8]) == {}
    assert await index.sizes() == {"a": 6}
    offload = Medium.OFFLOAD
    assert await index.apply("a", 1, [BlockRemoved((H[1],)), BlockRemoved((H[2],), offload),
                                      BlockStored((H[5],), None, (), 16, offload)])
    assert await index.match(H[:8]) == {"a": PrefixMatch(1, 1)}  # H1 now in the tier only
    assert await index.apply("a", 1, [BlockStored((H[2],), None, (), 16, offload)])
    assert await index.match(H[:8]) == {"a": PrefixMatch(1, 5)}
    assert await index.apply("a", 1, [AllBlocksCleared()])
    assert await index.match(H[:8]) == {}


async def test_a_hole_stops_the_count(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    await index.replace("a", 1, [H[0], H[1], H[3], H[4]])
    assert await index.score(H[:5]) == {"a": 2}
    assert await index.score(H[2:5]) == {}  # the first hash missing: not listed at all
    assert await index.score(H[3:5]) == {"a": 2}


async def test_no_hashes_and_no_replicas_score_empty(index: PrefixIndex) -> None:
    assert await index.score(H[:5]) == {}
    assert await index.sizes() == {}
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:5])
    assert await index.score([]) == {}


async def test_a_registered_replica_without_entries_is_sized_not_scored(index: PrefixIndex,
                                                                       ) -> None:
    await index.register("a", 1, 100)
    assert await index.sizes() == {"a": 0}
    assert await index.score(H[:5]) == {}


async def test_replace_replaces(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:10])
    assert await index.replace("a", 1, OTHER[:4]) is True
    assert await index.score(H[:10]) == {}
    assert await index.score(OTHER) == {"a": 4}
    assert await index.replace("a", 1, []) is True
    assert await index.sizes() == {"a": 0}


async def test_two_replicas_sharing_hashes_are_scored_apart(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    await index.register("b", 7, 100)
    await index.replace("a", 1, H[:6])
    await index.replace("b", 7, [*H[:3], *OTHER[:2]])
    assert await index.score(H[:10]) == {"a": 6, "b": 3}
    assert await index.apply("b", 7, [removed(H[0])]) is True
    assert await index.score(H[:10]) == {"a": 6}
    assert await index.score(OTHER) == {"b": 2}
    assert await index.sizes() == {"a": 6, "b": 4}


async def test_long_prompts_and_large_snapshots(index: PrefixIndex) -> None:
    many = prompt_block_hashes(SEED, list(range(16 * 2500)), 16)
    await index.register("a", 1, capacity_blocks=3000)
    assert await index.replace("a", 1, many) is True  # past any per-call chunk
    assert await index.sizes() == {"a": 2500}
    assert await index.score(many[:400]) == {"a": 400}
    await index.apply("a", 1, [removed(many[300])])
    assert await index.score(many[:400]) == {"a": 300}


# Apply -------------------------------------------------------------------------


async def test_events_apply_in_order(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    assert await index.apply("a", 1, [stored(*H[:4]), removed(H[1]), stored(H[4])]) is True
    assert await index.score(H[:5]) == {"a": 1}
    assert await index.sizes() == {"a": 4}
    assert await index.apply("a", 1, [stored(H[1]), removed(H[9])]) is True  # unknown: no-op
    assert await index.score(H[:8]) == {"a": 5}
    assert await index.apply("a", 1, [removed(H[2]), stored(H[2])]) is True
    assert await index.score(H[:8]) == {"a": 5}


async def test_all_blocks_cleared_empties_then_later_events_apply(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:20])
    assert await index.apply("a", 1, [AllBlocksCleared(), stored(OTHER[0])]) is True
    assert await index.sizes() == {"a": 1}
    assert await index.score(H[:20]) == {}
    assert await index.score(OTHER) == {"a": 1}
    assert await index.apply("a", 1, [stored(*H[:3]), AllBlocksCleared()]) is True
    assert await index.sizes() == {"a": 0}


async def test_an_empty_batch_applies(index: PrefixIndex) -> None:
    await index.register("a", 1, 100)
    assert await index.apply("a", 1, []) is True


# Epochs --------------------------------------------------------------------------


async def test_registering_the_held_epoch_keeps_the_entries(index: PrefixIndex) -> None:
    await index.register("a", 5, 100)
    await index.replace("a", 5, H[:7])
    assert await index.register("a", 5, 100) is True
    assert await index.score(H) == {"a": 7}


async def test_a_newer_epoch_drops_the_old_entries(stores: Stores, index: PrefixIndex) -> None:
    await index.register("a", 5, 100)
    await index.replace("a", 5, H[:7])
    assert await index.register("a", 6, 100) is True
    assert await index.score(H) == {}
    assert await index.sizes() == {"a": 0}
    assert await index.apply("a", 5, [stored(H[0])]) is False  # the old publisher
    assert await index.score(H) == {}
    assert resyncs(stores, "a", "stale_epoch") == 1


async def test_an_older_epoch_is_refused_and_changes_nothing(index: PrefixIndex) -> None:
    await index.register("a", 5, 100)
    await index.replace("a", 5, H[:7])
    assert await index.register("a", 4, 1000) is False
    assert await index.score(H) == {"a": 7}
    assert await index.apply("a", 5, [stored(*H[7:9])]) is True  # still the publisher
    assert await index.score(H) == {"a": 9}


async def test_stale_epoch_publish_calls_are_refused_and_change_nothing(
        stores: Stores, index: PrefixIndex) -> None:
    await index.register("a", 2, 100)
    await index.replace("a", 2, H[:3])
    assert await index.apply("a", 1, [AllBlocksCleared(), stored(*OTHER)]) is False
    assert await index.replace("a", 1, OTHER) is False
    assert await index.heartbeat("a", 1) is False
    assert await index.apply("a", 3, [stored(H[3])]) is False  # newer but not registered
    assert await index.score(H) == {"a": 3}
    assert await index.score(OTHER) == {}
    assert resyncs(stores, "a", "stale_epoch") == 4


async def test_publish_calls_before_register_are_refused(stores: Stores,
                                                         index: PrefixIndex) -> None:
    assert await index.replace("a", 1, H[:3]) is False
    assert await index.apply("a", 1, [stored(H[0])]) is False
    assert await index.heartbeat("a", 1) is False
    assert await index.sizes() == {}
    assert resyncs(stores, "a", "not_registered") == 3


async def test_epochs_compare_exactly_past_2_to_the_53(index: PrefixIndex) -> None:
    big = 2**63 + 1  # a nanosecond timestamp and beyond: not exact as a double
    assert await index.register("a", big, 100) is True
    await index.replace("a", big, H[:2])
    assert await index.register("a", big - 1, 100) is False
    assert await index.register("a", 9, 100) is False  # fewer digits
    assert await index.heartbeat("a", big - 1) is False
    assert await index.score(H) == {"a": 2}
    assert await index.register("a", big + 1, 100) is True
    assert await index.sizes() == {"a": 0}


# Capacity ------------------------------------------------------------------------


async def test_a_snapshot_over_capacity_keeps_its_first_hashes(stores: Stores,
                                                               index: PrefixIndex) -> None:
    await index.register("a", 1, capacity_blocks=3)
    assert await index.replace("a", 1, [H[0], H[0], H[1], H[2]]) is True  # 3 distinct
    assert await index.replace("a", 1, H[:5]) is False
    assert await index.sizes() == {"a": 3}
    assert await index.score(H) == {"a": 3}
    assert resyncs(stores, "a", "capacity") == 1


async def test_apply_never_grows_past_capacity(stores: Stores, index: PrefixIndex) -> None:
    await index.register("a", 1, capacity_blocks=4)
    await index.replace("a", 1, H[:3])
    # The part that fits is applied (H[3]); from H[4] on, nothing (nor the next event).
    assert await index.apply("a", 1, [stored(*H[3:6]), removed(H[0])]) is False
    assert await index.sizes() == {"a": 4}
    assert await index.score(H) == {"a": 4}
    assert await index.apply("a", 1, [stored(H[0], H[2])]) is True  # held already: fits
    assert await index.apply("a", 1, [removed(H[3]), stored(OTHER[0])]) is True
    assert await index.sizes() == {"a": 4}
    assert resyncs(stores, "a", "capacity") == 1


async def test_re_registering_records_a_new_capacity(index: PrefixIndex) -> None:
    await index.register("a", 1, capacity_blocks=2)
    await index.replace("a", 1, H[:2])
    assert await index.apply("a", 1, [stored(H[2])]) is False
    assert await index.register("a", 1, capacity_blocks=3) is True
    assert await index.apply("a", 1, [stored(H[2])]) is True
    assert await index.score(H) == {"a": 3}


# Liveness ------------------------------------------------------------------------


async def test_a_silent_replica_expires_and_its_entries_go(stores: Stores) -> None:
    index = await stores.open(SHORT_TTL_S)
    await index.register("a", 3, 100)
    await index.replace("a", 3, H[:5])
    await stores.pass_time(SHORT_TTL_S + 0.1)
    assert await index.score(H) == {}
    assert await index.sizes() == {}
    assert await index.heartbeat("a", 3) is False
    assert await index.apply("a", 3, [stored(H[0])]) is False
    assert resyncs(stores, "a", "not_registered") == 2
    assert await index.register("a", 2, 100) is True  # none held: even an older epoch
    assert await index.sizes() == {"a": 0}


async def test_heartbeats_keep_a_replica_live(stores: Stores) -> None:
    index = await stores.open(SHORT_TTL_S)
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:5])
    for _ in range(8):  # 0.4 s in all, twice the ttl
        await stores.pass_time(SHORT_TTL_S / 4)
        assert await index.heartbeat("a", 1) is True
    assert await index.score(H) == {"a": 5}


async def test_apply_and_replace_refresh_liveness(stores: Stores) -> None:
    index = await stores.open(SHORT_TTL_S)
    await index.register("a", 1, 100)
    for block in range(4):
        await stores.pass_time(SHORT_TTL_S / 2)
        assert await index.apply("a", 1, [stored(H[block])]) is True
    await stores.pass_time(SHORT_TTL_S / 2)
    assert await index.replace("a", 1, H[:6]) is True
    await stores.pass_time(SHORT_TTL_S / 2)
    assert await index.score(H) == {"a": 6}


async def test_one_replica_expiring_leaves_the_other(stores: Stores) -> None:
    index = await stores.open(SHORT_TTL_S)
    await index.register("a", 1, 100)
    await index.register("b", 1, 100)
    await index.replace("a", 1, H[:5])
    await index.replace("b", 1, H[:2])
    await stores.pass_time(SHORT_TTL_S * 0.6)
    assert await index.heartbeat("b", 1) is True
    await stores.pass_time(SHORT_TTL_S * 0.6)
    assert await index.score(H) == {"b": 2}
    assert await index.sizes() == {"b": 2}


# Drop --------------------------------------------------------------------------


async def test_drop_removes_only_the_named_epoch(index: PrefixIndex) -> None:
    await index.register("a", 2, 100)
    await index.replace("a", 2, H[:4])
    await index.drop("a", 1)  # an older publisher ending: the newer one stays
    await index.drop("a", 3)
    assert await index.score(H) == {"a": 4}
    await index.drop("a", 2)
    assert await index.score(H) == {}
    assert await index.sizes() == {}
    assert await index.heartbeat("a", 2) is False
    await index.drop("a", 2)  # twice, and an unknown replica: no error
    await index.drop("nobody", 1)


# Metrics and input errors --------------------------------------------------------


async def test_the_blocks_gauge_follows_the_entries(stores: Stores, index: PrefixIndex) -> None:
    def blocks(replica: str) -> float | None:
        return stores.metrics.registry.get_sample_value("llmesh:kv_index_blocks",
                                                        {"replica": replica})

    await index.register("a", 1, 100)
    assert blocks("a") == 0
    await index.replace("a", 1, H[:5])
    assert blocks("a") == 5
    await index.apply("a", 1, [removed(H[0])])
    assert blocks("a") == 4
    await index.drop("a", 1)
    assert blocks("a") is None


async def test_score_latency_is_observed(stores: Stores, index: PrefixIndex) -> None:
    await index.score(H[:5])
    await index.score(H[:5])
    assert sample(stores.metrics, "llmesh:kv_index_lookup_seconds_count") == 2


async def test_caller_bugs_raise(index: PrefixIndex) -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        await index.register("a", 1, 0)
    with pytest.raises(ValueError, match="replica id"):
        await index.register("", 1, 10)
    with pytest.raises(ValueError, match="epoch"):
        await index.heartbeat("a", -1)
    await index.register("a", 1, 10)
    with pytest.raises(ValueError, match="32 bytes"):
        await index.score([H[0], H[1][:31]])
    with pytest.raises(TypeError, match="not a KV event"):
        await index.apply("a", 1, ["stored"])  # type: ignore[list-item]


def test_liveness_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="liveness_ttl_s"):
        MemoryPrefixIndex(liveness_ttl_s=0)


# Latency (a generous bound; tests/cache/bench_prefix_index.py measures) ------------


async def fill_replicas(index: PrefixIndex, prompt: list[bytes], replicas: int,
                        blocks: int) -> None:
    """``replicas`` replicas of ``blocks`` entries; replica i holds the prompt's first 125 // (i+1)."""
    for replica in range(replicas):
        leading = prompt[:len(prompt) // (replica + 1)]
        filler = prompt_block_hashes(block_hash_seed(f"filler-{replica}"),
                                     list(range(16 * (blocks - len(leading)))), 16)
        await index.register(f"r{replica}", 1, blocks)
        assert await index.replace(f"r{replica}", 1, [*leading, *filler]) is True


async def test_score_of_a_2000_token_prompt_is_fast(index: PrefixIndex) -> None:
    prompt = H[:125]
    await fill_replicas(index, prompt, replicas=4, blocks=2000)
    assert await index.score(prompt) == {"r0": 125, "r1": 62, "r2": 41, "r3": 31}
    samples = []
    for _ in range(300):
        started = time.perf_counter()
        await index.score(prompt)
        samples.append(time.perf_counter() - started)
    assert statistics.median(samples) < 0.005
