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

import enum
from dataclasses import dataclass

from llmesh.v1 import cache_pb2
from services.common.block_hash import BlockHash


class Medium(enum.Enum):
    """Where a replica holds a block (vLLM's KV events carry a ``medium`` too).

    POOL: the engine's working KV pool (a hit costs nothing).
    OFFLOAD: its second tier (``--kv-offload-bytes``): a hit costs a copy back
    into the pool, less than recomputing the block.
    """

    POOL = "pool"
    OFFLOAD = "offload"


#: The protobuf ``KvMedium`` of each medium (the pool is the unset value, what
#: publishers without a medium send), and back.
MEDIUM_TO_PB = {Medium.POOL: cache_pb2.KV_MEDIUM_UNSPECIFIED,
                Medium.OFFLOAD: cache_pb2.KV_MEDIUM_OFFLOAD}
MEDIUM_FROM_PB = {value: medium for medium, value in MEDIUM_TO_PB.items()}


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence became reusable.

    Attributes:
      block_hashes: the blocks' hashes in sequence order (each chained to the previous).
      parent_hash: hash of the block before the first one; None when the first
        block starts at position 0.
      token_ids: the blocks' token ids back to back (``block_size`` per block;
        empty for OFFLOAD: the tier keeps no tokens).
      block_size: tokens per block.
      medium: where they are now held.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium = Medium.POOL


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted from ``medium``: their hashes no longer hit there
    (a block evicted from the pool may still be held by the OFFLOAD tier).

    Attributes:
      block_hashes: hashes of the evicted blocks.
      medium: where they were held.
    """

    block_hashes: tuple[BlockHash, ...]
    medium: Medium = Medium.POOL


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica dropped its whole prefix cache, every medium (no hash hits any more)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class PrefixMatch:
    """A replica's hold on a prompt's leading KV blocks, as the prefix index
    answers it (``ScorePrefix``).

    Attributes:
      blocks: leading blocks in its KV pool.
      offloaded: blocks right after those held in its offload tier (or pool),
        up to the first block held in neither.
    """

    blocks: int
    offloaded: int = 0


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a replica's prefix cache holds at one moment.

    Attributes:
      block_hashes: the hashes in the pool (used and cached blocks), in no order.
      offloaded_hashes: the hashes in the OFFLOAD tier (the tier is inclusive:
        a hash may be in both).
      events_dropped: the engine's running count of events its bounded buffer
        dropped, as of the snapshot (a publisher that sees it grow sends a new
        snapshot).
    """

    block_hashes: tuple[BlockHash, ...]
    events_dropped: int = 0
    offloaded_hashes: tuple[BlockHash, ...] = ()
