"""The KV offload tier (second KV tier) alone and behind the KV cache manager:
capacity, LRU order, pinning, bit-exact copies, cache-scope keeping, events
and stats. No model: the pool's storage is a small random tensor pair."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.common.kv_events import BlockRemoved, BlockStored, Medium
from services.engine.config import EngineConfig
from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.torch_backend.kv_offload import KVOffloadTier
from services.engine.torch_backend.start_checks import check_config
from tests.engine.kv_helpers import compute, make_request

LAYERS, HEADS, BLOCK, DIM = 2, 2, 4, 8
#: Bytes of one block's keys and values (fp32).
BLOCK_BYTES = 2 * LAYERS * HEADS * BLOCK * DIM * 4


def storage(num_blocks: int) -> SimpleNamespace:
    """Pool storage in PagedKVCache's layout, each block filled with distinct values."""
    shape = (LAYERS, HEADS, num_blocks, BLOCK, DIM)
    return SimpleNamespace(k=torch.randn(shape), v=torch.randn(shape))


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_capacity_is_whole_blocks_and_too_small_is_refused() -> None:
    tier = KVOffloadTier(storage(4), 3 * BLOCK_BYTES + BLOCK_BYTES // 2)
    assert tier.capacity_blocks == 3 and tier.capacity_bytes == 3 * BLOCK_BYTES
    with pytest.raises(ValueError, match="holds no KV block"):
        KVOffloadTier(storage(4), BLOCK_BYTES - 1)


def test_store_and_restore_are_bit_exact() -> None:
    pool = storage(4)
    tier = KVOffloadTier(pool, 2 * BLOCK_BYTES)
    k1, v1 = pool.k[:, :, 1].clone(), pool.v[:, :, 1].clone()
    assert tier.store(1, h(1)) == (True, [])
    pool.k.zero_()
    pool.v.zero_()
    tier.restore([h(1)], [3])
    assert torch.equal(pool.k[:, :, 3], k1) and torch.equal(pool.v[:, :, 3], v1)
    assert pool.k[:, :, 1].abs().sum() == 0  # only the target block was written


def test_lru_drops_the_least_recent_and_skips_pinned() -> None:
    tier = KVOffloadTier(storage(8), 3 * BLOCK_BYTES)
    for i in range(3):
        tier.store(i, h(i))
    assert tier.store(0, h(0)) == (False, [])  # held: made most recent, no copy
    assert tier.hashes() == (h(1), h(2), h(0))
    tier.pin([h(1)])
    assert tier.store(3, h(3)) == (True, [h(2)])  # h(1) is pinned: h(2) goes
    tier.restore([h(1)], [5])  # unpins, most recent
    assert tier.store(4, h(4)) == (True, [h(0)])
    assert tier.hashes() == (h(3), h(1), h(4))
    tier.pin(tier.hashes())
    assert tier.store(6, h(6)) == (False, [])  # all pinned: not stored
    stats = tier.take_stats()
    assert (stats.stored, stats.evicted, stats.restored) == (5, 2, 1)
    assert stats.num_bytes == 3 * BLOCK_BYTES
    assert len(stats.restore_seconds) == 1
    assert tier.take_stats().stored == 0  # deltas
    tier.check_integrity()


def test_directory_tier_is_a_mapped_file_left_nowhere(tmp_path: Path) -> None:
    pool = storage(2)
    tier = KVOffloadTier(pool, 2 * BLOCK_BYTES, directory=tmp_path)
    assert os.listdir(tmp_path) == []  # unlinked once mapped: a restart starts empty
    tier.store(0, h(0))
    expected = pool.k[:, :, 0].clone()
    pool.k.zero_()
    tier.restore([h(0)], [1])
    assert torch.equal(pool.k[:, :, 1], expected)


def test_a_tier_its_filesystem_or_memory_cannot_hold_is_refused_at_start(tmp_path: Path) -> None:
    """The file's space is reserved up front (a sparse file killed the engine
    with SIGBUS at the first write past the free space); each refusal names its flag."""
    blocks = shutil.disk_usage(tmp_path).free // BLOCK_BYTES + 1024
    with pytest.raises(ValueError, match=r"--kv-offload-dir .*cannot hold"):
        KVOffloadTier(storage(4), blocks * BLOCK_BYTES, directory=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match=r"--kv-offload-dir .*file"):
        KVOffloadTier(storage(4), 2 * BLOCK_BYTES, directory=not_a_dir)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        available = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                         if line.startswith("MemAvailable:"))
        with pytest.raises(ValueError, match=r"--kv-offload-bytes .*exceeds"):
            KVOffloadTier(storage(4), available + 1024 * BLOCK_BYTES)


def manager_with_tier(num_blocks: int = 4, tier_blocks: int = 8) -> KVCacheManager:
    pool = storage(num_blocks)
    return KVCacheManager(num_blocks, BLOCK, model_id="test-model",
                          offload=KVOffloadTier(pool, tier_blocks * BLOCK_BYTES))


def run(manager: KVCacheManager, seq, extra_tokens: int = 0) -> None:
    """Admits ``seq`` (prefix lookup included), computes it and frees it."""
    hit = manager.find_prefix(seq)
    assert manager.allocate_slots(seq, seq.num_tokens - hit.num_tokens, hit)
    compute(manager, seq)
    manager.free(seq)


def test_evicted_blocks_come_back_from_the_tier_with_their_keys_and_values() -> None:
    manager = manager_with_tier(num_blocks=4)
    storage_k = manager.offload._storage.k  # noqa: SLF001 - the pool's storage
    first = make_request("a", 13)  # 3 full blocks + 1 token
    run(manager, first)
    evicted_keys = {h: storage_k[:, :, manager.pool.get_cached_block(h).block_id].clone()
                    for h in first.block_hashes}
    manager.take_events()
    run(manager, make_request("b", list(range(500, 516))))  # 4 blocks: evicts all of a's
    events = manager.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium is Medium.OFFLOAD]
    assert [e.medium for e in removed] == [Medium.POOL]
    assert set(stored[0].block_hashes) == set(first.block_hashes)
    assert set(manager.offloaded_hashes()) == set(first.block_hashes)

    manager.offload.take_stats()
    again = make_request("a2", 13)
    hit = manager.find_prefix(again)
    assert hit.blocks == () and hit.restore == tuple(first.block_hashes)
    assert hit.num_tokens == 12 and hit.num_pool_tokens == 0
    assert manager.allocate_slots(again, 1, hit)
    for index, block_hash in enumerate(first.block_hashes):
        block_id = manager.block_ids(again)[index]
        assert torch.equal(storage_k[:, :, block_id], evicted_keys[block_hash])
        assert manager.pool.get_cached_block(block_hash).block_id == block_id  # registered
    stats = manager.offload.take_stats()
    assert (stats.queries, stats.hits, stats.restored) == (3, 3, 3)
    compute(manager, again)
    manager.free(again)
    counts = manager.check_integrity(idle=True)
    assert counts.used == 0 and counts.free + counts.cached == counts.total


def test_the_tier_keeps_the_cache_scope() -> None:
    manager = manager_with_tier(num_blocks=4)
    run(manager, make_request("a", 13, cache_scope="tenant-a"))
    run(manager, make_request("b", list(range(500, 516))))  # evicts a's blocks to the tier
    other = make_request("c", 13, cache_scope="tenant-b")
    hit = manager.find_prefix(other)
    assert hit.num_tokens == 0 and hit.restore == ()
    same = make_request("d", 13, cache_scope="tenant-a")
    assert len(manager.find_prefix(same).restore) == 3


def test_reset_prefix_cache_empties_the_tier() -> None:
    manager = manager_with_tier(num_blocks=4)
    run(manager, make_request("a", 13))
    run(manager, make_request("b", list(range(500, 516))))
    assert manager.offloaded_hashes()
    assert manager.reset_prefix_cache()
    assert manager.offloaded_hashes() == ()
    assert manager.find_prefix(make_request("a2", 13)).num_tokens == 0


def test_a_tier_directory_without_a_tier_size_is_refused(tmp_path: Path) -> None:
    """``--kv-offload-dir`` alone was ignored silently (the engine served with no tier);
    both refusals are start checks (``llmesh up`` runs them before anything starts)."""
    with pytest.raises(ValueError, match="--kv-offload-dir needs --kv-offload-bytes"):
        check_config(EngineConfig(kv_offload_dir=tmp_path))
    with pytest.raises(ValueError, match="--kv-offload-bytes needs prefix caching"):
        check_config(EngineConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False))


def test_a_tier_directory_that_cannot_take_the_file_is_refused_by_the_start_check(
        tmp_path: Path) -> None:
    """QA: a missing directory, a file, or too little free space failed only at
    model load (exit 1, after ``llmesh up`` had started the other services)."""
    missing, a_file = tmp_path / "none", tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="--kv-offload-dir .*none: no such directory"):
        check_config(EngineConfig(kv_offload_bytes=1 << 20, kv_offload_dir=missing))
    with pytest.raises(ValueError, match="--kv-offload-dir .*file: not a directory"):
        check_config(EngineConfig(kv_offload_bytes=1 << 20, kv_offload_dir=a_file))
    too_big = shutil.disk_usage(tmp_path).free + (1 << 30)
    with pytest.raises(ValueError, match=r"bytes free, the tier \(--kv-offload-bytes\) needs"):
        check_config(EngineConfig(kv_offload_bytes=too_big, kv_offload_dir=tmp_path))
    check_config(EngineConfig(kv_offload_bytes=1 << 20, kv_offload_dir=tmp_path))
