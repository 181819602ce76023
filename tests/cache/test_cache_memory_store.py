"""MemoryStore: LRU order, TTL expiry and the byte bound."""

from __future__ import annotations

import pytest

from services.cache.store import MemoryStore, StoreWrite
from tests.cache.helpers import FakeClock


async def test_get_returns_what_put_stored_and_none_for_unknown_keys() -> None:
    store = MemoryStore()
    assert await store.put("k", b"value", 60) is True
    assert await store.get("k") == b"value"
    assert await store.get("other") is None
    assert await store.put("k", b"newer", 60) is True
    assert await store.get("k") == b"newer"
    assert len(store) == 1 and store.nbytes == len("k") + len(b"newer")


async def test_evicts_least_recently_used_first() -> None:
    store = MemoryStore(max_entries=3)
    for key in ("a", "b", "c"):
        await store.put(key, b"x", 60)
    assert await store.get("a") == b"x"  # a is now the most recent
    assert store.keys() == ["b", "c", "a"]
    await store.put("d", b"x", 60)
    assert store.keys() == ["c", "a", "d"]
    assert await store.get("b") is None
    await store.put("c", b"y", 60)  # overwrite refreshes recency too
    await store.put("e", b"x", 60)
    assert store.keys() == ["d", "c", "e"]
    assert len(store) == 3


async def test_entries_expire_after_their_ttl() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.put("short", b"1", 10)
    await store.put("long", b"2", 100)
    clock.advance(9.999)
    assert await store.get("short") == b"1"
    clock.advance(0.001)
    assert await store.get("short") is None
    assert store.keys() == ["long"]  # dropped when read
    assert store.nbytes == len("long") + 1
    clock.advance(89.99)
    assert await store.get("long") == b"2"
    clock.advance(0.01)
    assert await store.get("long") is None
    assert len(store) == 0 and store.nbytes == 0


async def test_overwrite_resets_the_ttl() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.put("k", b"1", 10)
    clock.advance(8)
    await store.put("k", b"2", 10)
    clock.advance(8)
    assert await store.get("k") == b"2"


async def test_byte_bound_evicts_lru_until_it_fits() -> None:
    store = MemoryStore(max_entries=100, max_bytes=30)
    await store.put("a", b"x" * 9, 60)  # 10 bytes
    await store.put("b", b"x" * 9, 60)  # 20
    await store.put("c", b"x" * 9, 60)  # 30: full
    assert store.nbytes == 30 and store.keys() == ["a", "b", "c"]
    await store.get("a")
    await store.put("d", b"x" * 19, 60)  # 20 bytes: b and c go, a was used
    assert store.keys() == ["a", "d"]
    assert store.nbytes == 30


async def test_an_entry_larger_than_the_store_is_not_stored_and_drops_the_old_value() -> None:
    store = MemoryStore(max_bytes=30)
    await store.put("k", b"small", 60)
    await store.put("other", b"x", 60)
    assert await store.put("k", b"x" * 30, 60) is False  # 31 bytes with the key
    assert await store.get("k") is None
    assert store.keys() == ["other"] and store.nbytes == len("other") + 1
    assert await store.put("k", b"x" * 29, 60) is True  # exactly 30: fits alone
    assert store.keys() == ["k"] and store.nbytes == 30


@pytest.mark.parametrize("ttl", [0, -1.0])
async def test_ttl_must_be_positive(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        await MemoryStore().put("k", b"v", ttl)


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        MemoryStore(max_entries=0)
    with pytest.raises(ValueError):
        MemoryStore(max_bytes=0)


async def test_close_empties_the_store() -> None:
    store = MemoryStore()
    await store.put("k", b"v", 60)
    await store.close()
    assert len(store) == 0 and store.nbytes == 0


async def test_put_many_is_put_of_each_in_order() -> None:
    store = MemoryStore(max_bytes=20)
    results = await store.put_many([StoreWrite("a", b"1", 60), StoreWrite("big", b"x" * 30, 60),
                                    StoreWrite("a", b"2", 60)])
    assert results == [True, False, True]
    assert await store.get("a") == b"2" and await store.get("big") is None
