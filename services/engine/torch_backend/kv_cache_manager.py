"""Per-sequence KV block tables on top of the :class:`BlockPool`.

The scheduler speaks to this manager only: "what prefix of this sequence is
already computed" (:meth:`KVCacheManager.find_prefix`), "give it room for N more
tokens" (:meth:`KVCacheManager.allocate_slots`), "its tokens up to here are
computed" (:meth:`KVCacheManager.cache_computed_blocks`) and "it is done"
(:meth:`KVCacheManager.free`). Block objects, reference counts and hashes stay
behind this interface; the model runner reads block ids
(:meth:`KVCacheManager.block_ids`).

Block hashes are chained, as :mod:`services.common.block_hash` defines them
for engine, router and cache alike, from a seed (model id and KV layout,
salted by the request's cache scope: ``SequenceRequest.cache_scope``) before
block 0: a sequence finds only blocks computed in its own scope. Only full
blocks are hashed, and a block joins the prefix cache only once its keys and
values are computed.

Role-aware hashes (``role_aware=True``, for a model whose prompt tokens take
other projections than its generated tokens: ``LlamaModel.add_prompt_projections``):
a block holding generated tokens also hashes how many of its tokens are prompt
tokens, so its keys/values (computed the generated way) never stand in for the
same tokens given as a prompt (computed the prompt way), e.g. a previous
answer quoted in the next turn of a chat. Blocks of prompt tokens only hash as
before.

Offload tier (``offload``, :mod:`~services.engine.torch_backend.kv_offload`):
a cached block the pool evicts is copied there first (``BlockStored`` with
medium OFFLOAD; the tier's own LRU drops send ``BlockRemoved`` OFFLOAD), and
:meth:`find_prefix` goes on past the pool's leading hits into the tier: the
blocks found there are copied into fresh pool blocks by
:meth:`allocate_slots`, registered in the prefix cache at once (they are
computed) and counted as computed tokens, so the prefill starts after them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.block_hash import BlockHash, block_hash_seed, hash_block, scoped_seed
from services.common.kv_events import BlockRemoved, BlockStored, KVEvent, Medium
from services.engine.torch_backend.block_pool import (
    BlockCounts,
    BlockPool,
    KVBlock,
    KVIntegrityError,
)
from services.engine.torch_backend.kv_offload import KVOffloadTier
from services.engine.torch_backend.sequence import Sequence


@dataclass(frozen=True)
class PrefixHit:
    """Leading full blocks of a sequence found computed in the prefix cache.

    Attributes:
      blocks: the pool's blocks, in sequence order (opaque to the scheduler).
      num_tokens: tokens computed from the start: the pool's blocks and then
        the restored ones (``(len(blocks) + len(restore)) * block_size``).
      restore: hashes of the blocks after ``blocks`` found in the offload tier,
        in order (copied into new pool blocks by ``allocate_slots``).
      offload_queries: blocks looked up in the offload tier (0 without one).
    """

    blocks: tuple[KVBlock, ...] = ()
    num_tokens: int = 0
    restore: tuple[BlockHash, ...] = ()
    offload_queries: int = 0

    @property
    def num_pool_tokens(self) -> int:
        """Tokens of the pool's blocks alone (the prefix cache's hit)."""
        total = len(self.blocks) + len(self.restore)
        return self.num_tokens * len(self.blocks) // total if total else 0


NO_HIT = PrefixHit()


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One KV block to copy in every layer's storage before the next forward.

    Attributes:
      src: block id copied from.
      dst: block id copied to.
    """

    src: int
    dst: int


class KVCacheManager:
    """Block tables of the sequences in the running batch.

    Args:
      num_blocks: KV blocks in the storage.
      block_size: tokens per block.
      enable_caching: reuse computed full blocks across sequences (prefix caching).
      model_id: seeds the block hashes (equal hashes mean same model, same tokens).
      kv_layout: the rest of the seed: what else decides the KV values
        (:func:`~services.common.block_hash.block_hash_seed`).
      role_aware: blocks with generated tokens hash their prompt/generated split
        (see the module docstring).
      offload: the second KV tier (None: evicted blocks are dropped); needs caching.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 model_id: str = "", role_aware: bool = False, kv_layout: str = "",
                 offload: KVOffloadTier | None = None) -> None:
        self.block_size = block_size
        self.role_aware = role_aware
        self.enable_caching = enable_caching
        self.offload = offload if enable_caching else None
        self.pool = BlockPool(num_blocks, block_size, enable_caching,
                              on_evict=None if self.offload is None else self._offload)
        self.hash_seed = block_hash_seed(model_id, kv_layout)
        self._tables: dict[int, list[KVBlock]] = {}  # by Sequence.arrival
        self._num_registered: dict[int, int] = {}

    # ---- queries (pure) -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1."""
        return self.pool.usage

    def seed_of(self, seq: Sequence) -> BlockHash:
        """The parent hash of ``seq``'s block 0: the seed in its request's cache
        scope (:func:`~services.common.block_hash.scoped_seed`)."""
        return scoped_seed(self.hash_seed, seq.request.cache_scope)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq: Sequence) -> list[int]:
        """Ids of the blocks holding ``seq``'s tokens, in position order."""
        return [block.block_id for block in self._tables.get(seq.arrival, ())]

    def holds(self, seq: Sequence) -> bool:
        """True while ``seq`` has a block table."""
        return seq.arrival in self._tables

    # ---- lifecycle (mutate) -----------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest run of ``seq``'s leading full blocks already computed (by
        any sequence), leaving at least its last token to compute (the step that
        computes it yields the next token's logits). Computes missing block
        hashes into ``seq.block_hashes``; takes no reference yet.
        """
        if not self.enable_caching or seq.num_computed_tokens:
            return NO_HIT
        self._hash_full_blocks(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in seq.block_hashes[:limit]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        restore: list[BlockHash] = []
        if self.offload is not None:
            for block_hash in seq.block_hashes[len(hits):limit]:
                if block_hash not in self.offload or self.pool.get_cached_block(block_hash):
                    break
                restore.append(block_hash)
        if not hits and not restore:
            return NO_HIT if self.offload is None else PrefixHit(offload_queries=limit)
        return PrefixHit(tuple(hits), (len(hits) + len(restore)) * self.block_size,
                         tuple(restore), 0 if self.offload is None else limit - len(hits))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       prefix: PrefixHit = NO_HIT) -> bool:
        """Makes room for ``seq``'s next ``num_new_tokens`` tokens after its
        computed ones and, first, takes a reference on the ``prefix`` blocks
        (from :meth:`find_prefix` in the same step) and copies its offloaded
        blocks back into the first new blocks (registered in the prefix cache
        at once). All or nothing.

        Returns:
          False (and changes nothing) when too few blocks are free.
        """
        table = self._tables.get(seq.arrival)
        held = 0 if table is None else len(table)
        computed = seq.num_computed_tokens + prefix.num_tokens
        new_blocks = self.blocks_for(computed + num_new_tokens) - held - len(prefix.blocks)
        reclaimed = sum(1 for block in prefix.blocks if block.ref_count == 0)
        if max(new_blocks, 0) > self.pool.num_free_blocks - reclaimed:
            return False
        if table is None:
            table = self._tables[seq.arrival] = []
            self._num_registered[seq.arrival] = 0
        if prefix.blocks:
            self.pool.touch(prefix.blocks)
            table.extend(prefix.blocks)
            self._num_registered[seq.arrival] = len(table)
        offload = self.offload
        if offload is not None and prefix.offload_queries:
            offload.count_lookup(prefix.offload_queries, len(prefix.restore))
            offload.pin(prefix.restore)  # the allocation's evictions must not drop them
        if new_blocks > 0:
            table.extend(self.pool.allocate(new_blocks))
        if prefix.restore:
            self._restore(seq, table, prefix.restore)
        return True

    def _restore(self, seq: Sequence, table: list[KVBlock],
                 restore: tuple[BlockHash, ...]) -> None:
        """Copies the offloaded blocks ``restore`` into ``seq``'s blocks after its
        registered ones and registers them in the prefix cache."""
        assert self.offload is not None
        done = self._num_registered[seq.arrival]
        blocks = table[done:done + len(restore)]
        self.offload.restore(restore, [block.block_id for block in blocks])
        size = self.block_size
        parent = seq.block_hashes[done - 1] if done else None
        self.pool.cache_full_blocks(blocks, restore, parent,
                                    seq.token_ids[done * size:(done + len(restore)) * size])
        self._num_registered[seq.arrival] = done + len(restore)

    def _offload(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """Copies the blocks the pool evicts into the offload tier (the pool's
        ``on_evict``) and emits the tier's events."""
        assert self.offload is not None
        stored: list[BlockHash] = []
        dropped: list[BlockHash] = []
        for block_id, block_hash in evicted:
            new, lost = self.offload.store(block_id, block_hash)
            dropped.extend(lost)
            if new:
                stored.append(block_hash)
        if dropped:
            self.pool.emit(BlockRemoved(tuple(dropped), Medium.OFFLOAD))
        if stored:
            self.pool.emit(BlockStored(tuple(stored), None, (), self.block_size, Medium.OFFLOAD))

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> BlockCopy | None:
        """Gives ``child`` (holding no blocks) a block table for ``parent``'s first
        ``num_tokens`` computed tokens (parallel sampling: a prompt prefilled
        once, see :class:`~services.engine.torch_backend.sequence.ChoiceGroup`).
        Full blocks are shared (one more reference each, as vLLM's block
        manager forks a sequence group); the partially filled last block, which
        each choice writes its own next token into, is copied into a new block
        of ``child`` (copy-on-write at the first divergent block, done at once
        because the child writes into it at its next step). ``child``'s hashes
        of the shared full blocks are ``parent``'s.

        Returns:
          the copy the KV storage must make before ``child``'s next forward,
          None when ``num_tokens`` fills whole blocks.

        Raises:
          OutOfBlocksError: no block free for the copy (nothing changed).
        """
        table = self._tables[parent.arrival]
        size = self.block_size
        full = num_tokens // size
        partial = num_tokens % size != 0
        copy: BlockCopy | None = None
        own: list[KVBlock] = []
        if partial:
            own = self.pool.allocate(1)  # raises before anything changed
            copy = BlockCopy(table[full].block_id, own[0].block_id)
        shared = table[:full]
        self.pool.touch(shared)
        self._tables[child.arrival] = list(shared) + own
        self._num_registered[child.arrival] = min(self._num_registered[parent.arrival], full)
        self._hash_full_blocks(parent)
        child.block_hashes = list(parent.block_hashes[:full])
        return copy

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers ``seq``'s blocks that became full and computed (up to
        ``seq.num_computed_tokens``) in the prefix cache. No-op without caching."""
        if not self.enable_caching:
            return
        table = self._tables.get(seq.arrival)
        if table is None:
            return
        done = self._num_registered[seq.arrival]
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        self._hash_full_blocks(seq)
        size = self.block_size
        parent = seq.block_hashes[done - 1] if done else None
        self.pool.cache_full_blocks(table[done:full], seq.block_hashes[done:full], parent,
                                    seq.token_ids[done * size:full * size])
        self._num_registered[seq.arrival] = full

    def free(self, seq: Sequence) -> None:
        """Returns all of ``seq``'s blocks, its last block first into the free
        queue (so a shared prefix outlives its tails in the cache). No-op if it
        holds none."""
        table = self._tables.pop(seq.arrival, None)
        self._num_registered.pop(seq.arrival, None)
        if table:
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """See :meth:`BlockPool.reset_prefix_cache`; the offload tier is emptied too."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        return True

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash in the prefix cache (used and cached blocks)."""
        return self.pool.cached_hashes()

    def offloaded_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash in the offload tier (empty without one)."""
        return () if self.offload is None else self.offload.hashes()

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (thread-safe)."""
        return self.pool.take_events()

    def check_integrity(self, idle: bool = False) -> BlockCounts:
        """Checks the pool (see :meth:`BlockPool.check_integrity`) and that the
        block tables account for every reference; with ``idle``, also that no
        block is used.

        Raises:
          KVIntegrityError: naming the first inconsistency.
        """
        counts = self.pool.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        references: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                references[block.block_id] = references.get(block.block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            expected = references.get(block_id, 0)
            if self.pool.block(block_id).ref_count != expected:
                raise KVIntegrityError(f"block {block_id}: ref_count "
                                       f"{self.pool.block(block_id).ref_count}, "
                                       f"{expected} block tables hold it")
        if idle and (counts.used or self._tables):
            raise KVIntegrityError(f"idle but {counts.used} blocks are used by "
                                   f"the sequences of arrivals {sorted(self._tables)}")
        return counts

    def _hash_full_blocks(self, seq: Sequence) -> None:
        hashes = seq.block_hashes
        tokens = seq.token_ids
        size = self.block_size
        prompt_len = seq.num_prompt_tokens if self.role_aware else None
        for index in range(len(hashes), len(tokens) // size):
            parent = hashes[index - 1] if index else self.seed_of(seq)
            roles = None if prompt_len is None else max(prompt_len - index * size, 0)
            hashes.append(hash_block(parent, tokens[index * size:(index + 1) * size], roles))
