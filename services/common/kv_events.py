"""KV cache events: which prefix blocks an engine replica holds, for KV-aware routing.

A backend with prefix caching emits one event when full KV blocks become
reusable (:class:`BlockStored`), when it evicts them (:class:`BlockRemoved`) and
when it drops its whole prefix cache (:class:`AllBlocksCleared`). The cache
service indexes them by hash to tell the router which replica holds the longest
prefix of a prompt (the indexing comes later; backends already emit them,
drained with ``drain_kv_events()``); each engine publishes them to the cache
service (``CacheService.PublishKvEvents``), whose prefix index tells the router
which replica holds the longest prefix of a prompt.

Hashes are chained (:mod:`services.common.block_hash`): a block's hash covers
its parent's hash and its own token ids, and the first block's parent is a
seed derived from the model id and KV layout, so equal hashes mean the same
model and the same tokens from position 0 on.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence became reusable.

    Attributes:
      block_hashes: the blocks' hashes in sequence order (each chained to the previous).
      parent_hash: hash of the block before the first one; None when the first
        block starts at position 0.
      token_ids: the blocks' token ids back to back (``block_size`` per block).
      block_size: tokens per block.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted: their hashes no longer hit on this replica.

    Attributes:
      block_hashes: hashes of the evicted blocks.
    """

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica dropped its whole prefix cache (no hash hits any more)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a replica's prefix cache holds at one moment.

    Attributes:
      block_hashes: the hashes (used and cached blocks), in no order.
      events_dropped: the engine's running count of events its bounded buffer
        dropped, as of the snapshot (a publisher that sees it grow sends a new
        snapshot).
    """

    block_hashes: tuple[BlockHash, ...]
    events_dropped: int = 0
