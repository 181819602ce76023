"""The KV block pool: fixed-size blocks, reference counts, eviction order, prefix hashes.

Every KV block is in one of three states:

* **used**: ``ref_count > 0``; one or more sequences read it (a shared prefix
  block has one reference per sequence).
* **cached**: ``ref_count == 0`` but it carries a block hash, so a later
  sequence with the same prefix can take it back (a prefix-cache hit).
* **free**: ``ref_count == 0`` and no hash.

Cached and free blocks wait together in the *free queue*, ordered for eviction:
free blocks first, then cached ones least recently freed first.
:meth:`BlockPool.allocate` takes blocks from its head, so it evicts a cached
block (drops its hash, LRU) only when no free block is left;
:meth:`BlockPool.free` puts a block without a hash at the head and a cached
one at the tail. (vLLM's free queue appends both at the tail, so a stream of
short requests that cache nothing cycles through the whole pool and evicts
every cached prefix; SGLang's radix cache, like this pool, evicts only when
it must.) Taking a cached block back (:meth:`BlockPool.touch`) removes it
from the queue wherever it sits.

The pool owns the hash → block map and the KV event queue
(:mod:`services.common.kv_events`; the KV cache manager adds the offload
tier's events through :meth:`BlockPool.emit`, so one queue keeps their order).
An ``on_evict`` callback sees each evicted block while its keys and values are
still in the storage (the manager copies them to the offload tier there).
It knows nothing of sequences: the
:class:`~services.engine.torch_backend.kv_cache_manager.KVCacheManager` decides
which blocks a sequence holds and in which order they are freed. Not
thread-safe; the engine thread owns it (``take_events`` may be called from any
thread).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.common.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from services.engine.types import BlockCounts

__all__ = ["BlockCounts", "BlockPool", "KVBlock", "KVIntegrityError", "OutOfBlocksError"]

#: Events kept before the oldest are dropped when nobody drains them.
MAX_PENDING_EVENTS = 100_000

#: Called with ``(block_id, block_hash)`` of the cached blocks one allocation
#: evicts, before anything overwrites them.
EvictCallback = Callable[[list[tuple[int, BlockHash]]], None]


class KVIntegrityError(RuntimeError):
    """The block pool's bookkeeping is inconsistent (a leak or a double free)."""


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for (callers check ``num_free_blocks`` first)."""


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV storage.

    Attributes:
      block_id: index of the block in the KV storage, ``[0, num_blocks)``.
      ref_count: sequences holding the block.
      block_hash: chained hash of its tokens once it is full and computed; None otherwise.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """All KV blocks of one engine.

    Args:
      num_blocks: blocks in the KV storage.
      block_size: tokens per block (reported in :class:`BlockStored` events).
      enable_caching: keep hashes of full blocks for prefix reuse; when False no
        block is ever cached and no events are emitted.
      on_evict: see :data:`EvictCallback` (None: evicted blocks are dropped).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_evict: EvictCallback | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: collections.OrderedDict[int, KVBlock] = collections.OrderedDict(
            (block.block_id, block) for block in self._blocks)
        self._by_hash: dict[BlockHash, KVBlock] = {}
        self._events: collections.deque[KVEvent] = collections.deque()
        self._on_evict = on_evict
        #: Events dropped (oldest first) because nobody drained them in time.
        self.events_dropped = 0

    # ---- queries (pure) -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can hand out (free and cached)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1 (cached blocks count as free)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def block(self, block_id: int) -> KVBlock:
        """The block with id ``block_id``."""
        return self._blocks[block_id]

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The computed block with this hash (used or cached), or None."""
        return self._by_hash.get(block_hash)

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash of a computed block (used or cached), in no order."""
        return tuple(self._by_hash)

    def free_queue_ids(self) -> list[int]:
        """Ids in the free queue, next to be allocated (evicted) first."""
        return list(self._free)

    # ---- lifecycle (mutate) -----------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes ``num_blocks`` blocks from the head of the free queue, each with
        ``ref_count == 1``; cached ones among them are evicted (hash dropped,
        one :class:`BlockRemoved` event for all of them).

        Raises:
          OutOfBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        taken: list[KVBlock] = []
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append((block.block_id, block.block_hash))
                del self._by_hash[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        if evicted:
            self.emit(BlockRemoved(tuple(h for _, h in evicted)))
            if self._on_evict is not None:
                self._on_evict(evicted)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds one reference to each of ``blocks`` (a prefix hit); a cached block
        leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each of ``blocks``. Those left without any
        join the free queue in the given order (the first of them is taken
        first): cached ones at the tail, keeping their hash until evicted;
        blocks without a hash at the head, to be reused before any cached
        block is evicted.

        Raises:
          KVIntegrityError: a block had no reference left (double free).
        """
        plain: list[KVBlock] = []
        for block in blocks:
            if block.ref_count <= 0:
                raise KVIntegrityError(f"block {block.block_id} freed with ref_count "
                                       f"{block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    plain.append(block)
        for block in reversed(plain):
            self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Registers consecutive full, computed blocks under their chained hashes
        and emits one :class:`BlockStored` for those registered. A block whose
        hash another block already holds stays unregistered (it is freed as a
        plain block). No-op without caching.

        Args:
          blocks: the blocks, in sequence order.
          hashes: their hashes (same length).
          parent_hash: hash of the block before ``blocks[0]`` (None at position 0).
          token_ids: their tokens, ``block_size`` per block.
        """
        if not self.enable_caching or not blocks:
            return
        stored: list[BlockHash] = []
        tokens: list[int] = []
        first_parent = parent_hash
        size = self.block_size
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            if block.block_hash is not None or block_hash in self._by_hash:
                if not stored:  # events carry consecutive runs: restart after a gap
                    first_parent = block_hash
                    continue
                self._emit_stored(stored, first_parent, tokens)
                stored, tokens, first_parent = [], [], block_hash
                continue
            block.block_hash = block_hash
            self._by_hash[block_hash] = block
            stored.append(block_hash)
            tokens.extend(token_ids[i * size:(i + 1) * size])
        if stored:
            self._emit_stored(stored, first_parent, tokens)

    def reset_prefix_cache(self) -> bool:
        """Forgets every hash (no later prefix hit until blocks are recomputed).
        Only when no block is used, like vLLM's ``reset_prefix_cache``.

        Returns:
          True if the cache was reset, False if some block is still in use.
        """
        if self.num_used_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._by_hash.clear()
        if self.enable_caching:
            self.emit(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (thread-safe)."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def check_integrity(self) -> BlockCounts:
        """Checks the bookkeeping: the free queue holds exactly the blocks without
        references, the hash map and the blocks' hashes agree, and free + cached +
        used == total.

        Raises:
          KVIntegrityError: naming the first inconsistency.
        """
        free = cached = used = 0
        for block in self._blocks:
            in_queue = block.block_id in self._free
            if block.ref_count < 0 or in_queue != (block.ref_count == 0):
                raise KVIntegrityError(f"block {block.block_id}: ref_count {block.ref_count}, "
                                       f"in free queue {in_queue}")
            if block.block_hash is not None and self._by_hash.get(block.block_hash) is not block:
                raise KVIntegrityError(f"block {block.block_id} has a hash the map does not hold")
            if block.ref_count > 0:
                used += 1
            elif block.block_hash is not None:
                cached += 1
            else:
                free += 1
        if any(block.block_hash != key for key, block in self._by_hash.items()):
            raise KVIntegrityError("the hash map points at a block with another hash")
        counts = BlockCounts(free=free, cached=cached, used=used, total=self.num_blocks)
        if free + cached + used != self.num_blocks or len(self._free) != free + cached:
            raise KVIntegrityError(f"{counts} with {len(self._free)} blocks in the free queue")
        if not self.enable_caching and cached:
            raise KVIntegrityError(f"{cached} cached blocks with prefix caching off")
        return counts

    def emit(self, event: KVEvent) -> None:
        """Queues ``event``; beyond :data:`MAX_PENDING_EVENTS` the oldest is dropped
        and counted in ``events_dropped`` (a reader then needs a snapshot)."""
        if len(self._events) >= MAX_PENDING_EVENTS:
            with contextlib.suppress(IndexError):  # a reader emptied it meanwhile
                self._events.popleft()
                self.events_dropped += 1
        self._events.append(event)

    def _emit_stored(self, hashes: list[BlockHash], parent: BlockHash | None,
                     tokens: list[int]) -> None:
        self.emit(BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size))
