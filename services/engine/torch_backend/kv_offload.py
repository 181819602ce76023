"""The second KV tier: full prefix-cache blocks evicted from the KV pool, kept for later.

When the :class:`~services.engine.torch_backend.block_pool.BlockPool` evicts
a cached block (its hash dropped to make room), the
:class:`~services.engine.torch_backend.kv_cache_manager.KVCacheManager` first
copies the block's keys and values here, under the same chained block hash
(:mod:`services.common.block_hash`, which already carries the request's cache
scope: a tenant finds only its own blocks here too). A later prompt whose
leading blocks miss the pool but hit this tier gets them copied back into
fresh pool blocks instead of recomputed: its prefill starts after them. The
shape follows vLLM's CPU offloading connector, SGLang's HiCache host pool and
LMCache's local CPU backend (an LRU store of whole blocks keyed by block hash),
with the write moved from "every computed block" to "a block the pool evicts"
(one copy per eviction, none for blocks that die in the pool).

Storage: one key and one value tensor of ``capacity_blocks`` slots, each slot
one pool block in the pool's own layout and dtype (``[num_layers,
num_kv_heads, block_size, head_dim]``, keys transposed when the pool's are),
so a restored block is bit-identical to the evicted one and greedy outputs
are those of a run without the tier. On the CPU the pool and this tier are
both host memory; what makes the tier worth it there is that it grows past
the pool without slowing attention (the pool's size is fixed at start and
every step's gathers index into it) and, with ``directory``, that it is a
memory-mapped file the kernel may page out to local disk (a tier larger than
RAM). On CUDA the same tier is pinned host memory (copies over PCIe). Restoring a
block copies ``kv_block_bytes`` (0.7 MiB for SmolLM2-135M in fp32, ~0.1 ms)
where recomputing it costs a 16-token prefill (~10-50 ms here): the engine
measures both (``llmesh:kv_offload_restore_seconds``, the step profile's
prefill seconds per token).

Eviction is LRU: a store or a restore makes a block the most recent; a store
into a full tier drops the least recent one that is not pinned (pinned: to be
restored by the allocation in progress). The tier is inclusive: a restored
block stays here, so evicting it from the pool again costs no copy.

Lifetime: the index lives in the process only and the file (if any) is
unlinked as soon as it is mapped, so a restarted engine starts with an empty
tier and nothing is left on disk.

Not thread-safe: the engine thread owns it (through the KV cache manager).
"""

from __future__ import annotations

import collections
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from services.common.block_hash import BlockHash
from services.engine.host_memory import available_host_memory_bytes
from services.engine.torch_backend.block_pool import KVIntegrityError
from services.engine.types import OffloadStats


class KVStorage(Protocol):
    """The pool's KV storage as the tier reads it: ``k`` and ``v`` tensors with
    the block index in dimension 2
    (:class:`~services.engine.torch_backend.paged_kv.PagedKVCache`)."""

    k: torch.Tensor
    v: torch.Tensor


class KVOffloadTier:
    """An LRU store of KV blocks by block hash (see the module docstring).

    Args:
      storage: the pool's KV storage (blocks in dimension 2).
      capacity_bytes: memory for the tier; whole blocks only.
      directory: back the tier by a memory-mapped file created (and at once
        unlinked) there; None: anonymous host memory (pinned on CUDA).

    Raises:
      ValueError: ``capacity_bytes`` holds no block.
    """

    def __init__(self, storage: KVStorage, capacity_bytes: int,
                 directory: Path | None = None) -> None:
        self._storage = storage
        key_shape = storage.k[:, :, 0].shape
        value_shape = storage.v[:, :, 0].shape
        dtype = storage.k.dtype
        self.block_bytes = (key_shape.numel() + value_shape.numel()) * storage.k.element_size()
        self.capacity_blocks = capacity_bytes // self.block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"--kv-offload-bytes {capacity_bytes} holds no KV block "
                             f"({self.block_bytes} bytes each)")
        keys = self.capacity_blocks * key_shape.numel()
        buffer = _buffer(keys + self.capacity_blocks * value_shape.numel(), dtype, directory,
                         pin=storage.k.is_cuda)
        self._k = buffer[:keys].view(self.capacity_blocks, *key_shape)
        self._v = buffer[keys:].view(self.capacity_blocks, *value_shape)
        self._slots: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        self._pinned: set[BlockHash] = set()
        self._counts = dict.fromkeys(("queries", "hits", "stored", "restored", "evicted"), 0)
        self._restore_seconds: list[float] = []
        self._restored_total = 0  # blocks, since start
        self._restore_total_s = 0.0

    # ---- queries (pure) -------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def restore_block_s(self) -> float:
        """Mean seconds to restore one block, measured since start (0: none yet)."""
        return self._restore_total_s / self._restored_total if self._restored_total else 0.0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def hashes(self) -> tuple[BlockHash, ...]:
        """Every hash held, least recently used first."""
        return tuple(self._slots)

    # ---- lifecycle (mutate) -----------------------------------------------------------

    def store(self, block_id: int, block_hash: BlockHash) -> tuple[bool, list[BlockHash]]:
        """Copies pool block ``block_id`` in under ``block_hash`` (the most recent
        entry now); a hash held already is only made the most recent.

        Returns:
          whether the hash is new here, and the hashes the LRU dropped to make
          room (nothing is stored when every held block is pinned).
        """
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return False, []
        dropped: list[BlockHash] = []
        if not self._free_slots:
            victim = next((h for h in self._slots if h not in self._pinned), None)
            if victim is None:
                return False, []
            self._free_slots.append(self._slots.pop(victim))
            dropped.append(victim)
            self._counts["evicted"] += 1
        slot = self._free_slots.pop()
        self._k[slot].copy_(self._storage.k[:, :, block_id])
        self._v[slot].copy_(self._storage.v[:, :, block_id])
        self._slots[block_hash] = slot
        self._counts["stored"] += 1
        return True, dropped

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        """Keeps ``hashes`` from the LRU until :meth:`restore` copies them out."""
        self._pinned.update(hashes)

    def restore(self, hashes: Iterable[BlockHash], block_ids: Iterable[int]) -> None:
        """Copies the blocks of ``hashes`` (held, e.g. pinned) into pool blocks
        ``block_ids`` (same length), makes them the most recent and unpins them.

        Raises:
          KeyError: a hash is not held.
        """
        began = time.perf_counter()
        count = 0
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            slot = self._slots[block_hash]
            self._slots.move_to_end(block_hash)
            self._storage.k[:, :, block_id].copy_(self._k[slot])
            self._storage.v[:, :, block_id].copy_(self._v[slot])
            self._pinned.discard(block_hash)
            count += 1
        if count:
            seconds = time.perf_counter() - began
            self._counts["restored"] += count
            self._restore_seconds.append(seconds)
            self._restored_total += count
            self._restore_total_s += seconds

    def count_lookup(self, queries: int, hits: int) -> None:
        """Counts one prompt's lookup: ``queries`` blocks the pool missed, ``hits`` found here."""
        self._counts["queries"] += queries
        self._counts["hits"] += hits

    def clear(self) -> None:
        """Drops every block (the prefix cache was reset)."""
        self._free_slots.extend(self._slots.values())
        self._slots.clear()
        self._pinned.clear()

    def take_stats(self) -> OffloadStats:
        """The stats since the last call (counts reset), with the bytes held now."""
        stats = OffloadStats(**self._counts, restore_seconds=tuple(self._restore_seconds),
                             num_bytes=len(self._slots) * self.block_bytes)
        self._counts = dict.fromkeys(self._counts, 0)
        self._restore_seconds.clear()
        return stats

    def check_integrity(self) -> None:
        """Every slot is either free or held by exactly one hash.

        Raises:
          KVIntegrityError: naming the inconsistency.
        """
        used = list(self._slots.values())
        if len(set(used)) != len(used) or set(used) & set(self._free_slots) or \
                len(used) + len(self._free_slots) != self.capacity_blocks:
            raise KVIntegrityError(f"KV offload tier: {len(used)} held + "
                                 f"{len(self._free_slots)} free slots != {self.capacity_blocks}")


def _buffer(numel: int, dtype: torch.dtype, directory: Path | None, pin: bool) -> torch.Tensor:
    """A flat ``numel`` tensor of ``dtype``: a shared mapping of a fresh file in
    ``directory`` (unlinked once mapped; its disk space reserved up front with
    ``posix_fallocate``, so a tier larger than its filesystem is refused here
    instead of the engine dying of SIGBUS at the first write past the free
    space), else anonymous memory (pinned with ``pin``; refused above the
    host's available memory, ``MemAvailable``, which the tier would exhaust as
    it fills).

    Raises:
      ValueError: the memory or the disk space is not there, or ``directory``
        cannot hold the file; the message names the flag.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if directory is None:
        available = available_host_memory_bytes()
        if available is not None and nbytes > available:
            raise ValueError(f"--kv-offload-bytes {nbytes} exceeds the {available} bytes of "
                             f"memory available on this host (MemAvailable); use less, or "
                             f"--kv-offload-dir for a disk-backed tier")
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=pin)
        except RuntimeError as error:
            raise ValueError(f"--kv-offload-bytes {nbytes}: cannot allocate the tier "
                             f"({str(error).splitlines()[0][:200]})") from error
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix="llmesh-kv-offload-") as file:
            os.posix_fallocate(file.fileno(), 0, nbytes)
            return torch.from_file(file.name, shared=True, size=numel, dtype=dtype)
    except OSError as error:
        raise ValueError(f"--kv-offload-dir {directory}: cannot hold a {nbytes}-byte tier "
                         f"({error.strerror or error})") from error
