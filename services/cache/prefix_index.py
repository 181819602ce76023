"""The prefix index: which engine replica holds the longest leading run of a prompt's KV blocks.

Engines publish KV events (:mod:`services.common.kv_events`) naming their
cached blocks by chained hash (:mod:`services.common.block_hash`); the cache
service feeds them to a :class:`PrefixIndex`, and the router asks it to
:meth:`~PrefixIndex.score` a prompt's hashes. Two stores keep the contract:
:class:`MemoryPrefixIndex` (embedded default, one process) and
:class:`RedisPrefixIndex` (Redis / Valkey, shared by several cache-service
instances). One contract test suite runs against both
(``tests/cache/test_prefix_index_contract.py``).

Publishers, epochs, liveness
  A replica publishes under an *epoch* (an int >= 0, larger for a later start
  of the engine). :meth:`~PrefixIndex.register` opens a publisher: the same
  epoch as held keeps the entries, a newer one (or none held) starts empty, an
  older one is refused, so a stale publisher never wins. Every other publish
  call names its epoch and is refused unless it is the held one. A replica
  whose last register / replace / apply / heartbeat is more than
  ``liveness_ttl_s`` seconds old is dead: no longer scored or sized, and its
  entries are removed (memory: at the next call that sees it; Redis: the keys
  expire). A refused call returns False and changes nothing, except for capacity:

Media
  A block a replica holds in its KV offload tier (events and snapshots with
  medium OFFLOAD, :class:`~services.common.kv_events.Medium`) is an entry of
  its own: the hash followed by :data:`OFFLOAD_TAG` (33 bytes), beside the
  plain hash of a block in its pool (a block may be in both). :meth:`~PrefixIndex.match`
  counts a prompt's leading blocks in the pool, then the blocks after those
  held in either medium (a restore there, not a prefill).

Capacity
  A replica holds at most ``capacity_blocks`` entries (its KV cache's size
  plus its offload tier's).
  :meth:`~PrefixIndex.replace` with more distinct hashes keeps the first
  ``capacity_blocks`` of them (in the order given) and returns False.
  :meth:`~PrefixIndex.apply` applies events in order up to the first hash that
  would not fit, applies nothing after it (that event's remaining hashes and
  the rest of the batch) and returns False. Either way what is kept is a part
  of what the publisher sent, and False asks it for a snapshot.

Outages
  Like the response store (:mod:`services.cache.store`), the index is optional
  to the router and never raises for a backend failure: a publish call returns
  False, ``score`` and ``sizes`` return ``{}``, ``drop`` does nothing (the
  entries then expire with the liveness). :class:`~services.cache.store.RedisGuard`
  bounds each call by its timeout, counts the error, logs a rate-limited
  warning and pauses Redis calls for the retry interval. Only ``start`` raises
  (:class:`~services.cache.store.StoreUnavailableError`). Every refused publish
  call counts ``llmesh:kv_index_resyncs_total{replica,reason}``.

Redis layout (prefix ``P``, default ``llmesh:kv:``)
  ``P replicas``: SET of replica ids that may be live (expired ones are
  removed by the next score / sizes / drop). ``P live:<replica>``: HASH
  ``epoch``, ``cap``, with ``PX liveness_ttl``. ``P blocks:<replica>:<epoch>``:
  SET of the block hashes (raw 32 bytes), with the same ``PX``; the epoch in
  the key means a stale publisher's writes could never land in the live set,
  and both keys are refreshed together, so Redis itself frees a vanished
  replica's entries. Each call is ONE Lua script (``EVALSHA``): atomic across
  cache-service instances and one round trip. Epochs travel as decimal
  strings and are compared by length then text, exact past 2^53 (Lua numbers
  are doubles). The scripts build their key names from the prefix, so the
  index runs on a standalone Redis / Valkey (or a primary with replicas), not
  on Redis Cluster. ``score`` reads each live replica's set with
  ``SMISMEMBER`` (Redis >= 6.2, Valkey), 32 hashes then 256 at a time, stopping at
  the first miss; the prompt's hashes travel as one argument, back to back.
  Measured p50 for 125 hashes and 4 replicas on loopback: ~0.3 ms on a loaded
  2-core VM (``tests/cache/bench_prefix_index.py``).

Threading: one event loop per index. The memory index never awaits inside a
method, so calls on one loop never interleave.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from services.cache.metrics import CacheMetrics, default_metrics
from services.cache.store import Clock, RedisGuard, RedisOptions
from services.common.block_hash import BlockHash
from services.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
    PrefixMatch,
)

__all__ = ["MemoryPrefixIndex", "PrefixIndex", "PrefixMatch", "RedisPrefixIndex"]

#: Bytes of a block hash (SHA-256).
HASH_BYTES = 32
#: Appended to a hash for its entry in the offload medium.
OFFLOAD_TAG = b"o"

#: An engine replica's id (``GetModelInfoResponse.replica_id``).
ReplicaId = str

# Reasons of llmesh:kv_index_resyncs_total (why a publish call was refused).
STALE_EPOCH = "stale_epoch"
NOT_REGISTERED = "not_registered"
CAPACITY = "capacity"
BACKEND = "backend"


def _entry(block_hash: BlockHash, medium: Medium) -> bytes:
    """The index entry of ``block_hash`` held in ``medium``."""
    return block_hash if medium is Medium.POOL else block_hash + OFFLOAD_TAG


def _entries(hashes: Sequence[BlockHash], offloaded: Sequence[BlockHash]) -> list[bytes]:
    """The entries of a snapshot: the pool's hashes, then the offload tier's tagged."""
    return [*hashes, *(_entry(h, Medium.OFFLOAD) for h in offloaded)]


def _check_publisher(replica: ReplicaId, epoch: int) -> None:
    if not replica:
        raise ValueError("replica id must not be empty")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")


class PrefixIndex(abc.ABC):
    """Which replicas hold which KV blocks, by chained block hash.

    Hashes are 32-byte :data:`~services.common.block_hash.BlockHash` values;
    only ``score`` checks their length (the service validates them at its
    edge; the Redis store sends a prompt's hashes back to back). Counts are in
    blocks, times in seconds. Methods marked "mutates" change the index; none
    raises for a backend failure (see the module docstring).

    Args:
      liveness_ttl_s: seconds a replica stays live after its last register,
        replace, apply or heartbeat (> 0).
      metrics: where to count (default: the process registry).

    Raises:
      ValueError: ``liveness_ttl_s`` is not > 0.
    """

    #: ``memory`` or ``redis``.
    backend: ClassVar[str]

    def __init__(self, *, liveness_ttl_s: float = 1.5, metrics: CacheMetrics | None = None,
                 ) -> None:
        if not liveness_ttl_s > 0:
            raise ValueError(f"liveness_ttl_s must be > 0, got {liveness_ttl_s}")
        self.liveness_ttl_s = liveness_ttl_s
        self._metrics = metrics or default_metrics()
        self._lookup = self._metrics.kv_index_lookup
        self._gauged: set[ReplicaId] = set()  # replicas with a kv_index_blocks label

    async def start(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Connects and checks the backend.

        Raises:
          StoreUnavailableError: the backend did not answer.
        """

    @abc.abstractmethod
    async def register(self, replica: ReplicaId, epoch: int, capacity_blocks: int) -> bool:
        """Opens (or refreshes) ``replica``'s publisher at ``epoch``. Mutates.

        The held epoch: keeps the entries, records ``capacity_blocks`` (entries
        already above a smaller capacity stay until the next replace), refreshes
        liveness. A newer epoch, or none held (never registered, expired,
        dropped): drops the replica's entries, records epoch and capacity, live
        for ``liveness_ttl_s``.

        Returns:
          True when registered; False when ``epoch`` is older than the held one
          (nothing changes) or the backend is down.

        Raises:
          ValueError: empty ``replica``, ``epoch`` < 0 or ``capacity_blocks`` < 1.
        """

    @abc.abstractmethod
    async def replace(self, replica: ReplicaId, epoch: int, hashes: Sequence[BlockHash],
                      offloaded: Sequence[BlockHash] = ()) -> bool:
        """A snapshot: ``replica`` holds exactly ``hashes`` in its pool and
        ``offloaded`` in its offload tier now. Mutates; refreshes liveness.

        Returns:
          True when held in full. False when more than ``capacity_blocks``
          distinct entries came (the first ``capacity_blocks`` are kept, the
          pool's first), or,
          changing nothing, when ``epoch`` is not the held one, the replica is
          not registered (or expired), or the backend is down.

        Raises:
          ValueError: empty ``replica`` or ``epoch`` < 0.
        """

    @abc.abstractmethod
    async def apply(self, replica: ReplicaId, epoch: int, events: Sequence[KVEvent]) -> bool:
        """Applies ``events`` in order. Mutates; refreshes liveness.

        ``BlockStored`` adds its ``block_hashes``, ``BlockRemoved`` removes its
        ``block_hashes`` (each in its event's medium), ``AllBlocksCleared``
        empties the replica's entries (both media).

        Returns:
          True when all applied. False when a hash would take the replica past
          ``capacity_blocks`` (the events before it and the hashes of its event
          before it are applied, nothing after), or, changing nothing, when
          ``epoch`` is not the held one, the replica is not registered (or
          expired), or the backend is down. On False the caller re-registers
          and sends a snapshot.

        Raises:
          ValueError: empty ``replica`` or ``epoch`` < 0.
          TypeError: an event that is not a :data:`KVEvent`.
        """

    @abc.abstractmethod
    async def heartbeat(self, replica: ReplicaId, epoch: int) -> bool:
        """Keeps ``replica`` live for ``liveness_ttl_s`` more. Mutates (liveness only).

        Returns:
          False when the index no longer holds ``replica`` at ``epoch``
          (expired, Redis restarted empty, superseded) or the backend is down.

        Raises:
          ValueError: empty ``replica`` or ``epoch`` < 0.
        """

    @abc.abstractmethod
    async def drop(self, replica: ReplicaId, epoch: int) -> None:
        """Removes ``replica``'s entries and registration if the held epoch is ``epoch``.

        Mutates. A newer publisher is left alone. A backend failure is
        swallowed (the entries expire with the liveness).

        Raises:
          ValueError: empty ``replica`` or ``epoch`` < 0.
        """

    async def match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, PrefixMatch]:
        """How many leading ``hashes`` each live replica holds in its pool
        (counting stops at its first miss), and how many after those in its
        offload tier or pool (stopping at the first block held in neither).

        Only replicas holding the first block (in either medium) appear.
        Removes expired replicas' entries (garbage collection, the only
        mutation). Observes ``llmesh:kv_index_lookup_seconds``.

        Returns:
          ``{replica: match}``; ``{}`` when the backend is down.

        Raises:
          ValueError: a hash is not 32 bytes.
        """
        started = time.perf_counter()
        if set(map(len, hashes)) - {HASH_BYTES}:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
        matches = await self._match(hashes) if hashes else {}
        self._lookup.observe(time.perf_counter() - started)
        return matches

    async def score(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Leading ``hashes`` each live replica holds in its pool (:meth:`match`'s
        ``blocks``; only replicas with at least 1)."""
        return {replica: found.blocks for replica, found in (await self.match(hashes)).items()
                if found.blocks}

    async def sizes(self) -> dict[ReplicaId, int]:
        """Entries held per live replica (0 included). Sets ``llmesh:kv_index_blocks``.

        Removes expired replicas' entries, like :meth:`score`.

        Returns:
          ``{replica: entries}``; ``{}`` when the backend is down.
        """
        sizes = await self._sizes()
        if sizes is None:
            return {}
        for replica in self._gauged - sizes.keys():
            self._forget(replica)
        for replica, size in sizes.items():
            self._held(replica, size)
        return sizes

    @abc.abstractmethod
    async def held_epoch(self, replica: ReplicaId) -> int | None:
        """The epoch the index holds for live ``replica``; None for none (or the
        backend is down). Pure (tells a refused :meth:`register` of a stale
        publisher from an outage)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections and memory; the index is unusable afterwards."""

    @abc.abstractmethod
    async def _match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, PrefixMatch]:
        """:meth:`match` of a non-empty ``hashes``."""

    @abc.abstractmethod
    async def _sizes(self) -> dict[ReplicaId, int] | None:
        """Entries per live replica; None when the backend is down."""

    def _held(self, replica: ReplicaId, size: int) -> None:
        self._metrics.kv_index_blocks.labels(replica).set(size)
        self._gauged.add(replica)

    def _forget(self, replica: ReplicaId) -> None:
        if replica in self._gauged:
            self._gauged.discard(replica)
            self._metrics.kv_index_blocks.remove(replica)

    def _refuse(self, replica: ReplicaId, reason: str) -> bool:
        """Counts a refused publish call; returns False for the caller to return."""
        self._metrics.kv_index_resyncs.labels(replica, reason).inc()
        return False


# The embedded store ------------------------------------------------------------


@dataclass(slots=True)
class _Replica:
    epoch: int
    capacity: int
    expires_at: float  # clock() seconds
    hashes: set[BlockHash]


def _add_within(held: set[BlockHash], capacity: int, hashes: Iterable[BlockHash]) -> bool:
    """Adds ``hashes`` in order until one would take ``held`` past ``capacity`` (then False)."""
    for block in hashes:
        if block not in held:
            if len(held) >= capacity:
                return False
            held.add(block)
    return True


def _apply_events(held: set[BlockHash], capacity: int, events: Sequence[KVEvent]) -> bool:
    """Applies ``events`` to ``held`` in order; False (and stops) at the first overflow."""
    for event in events:
        match event:
            case BlockStored():
                entries = (_entry(h, event.medium) for h in event.block_hashes)
                if not _add_within(held, capacity, entries):
                    return False
            case BlockRemoved():
                held.difference_update(_entry(h, event.medium) for h in event.block_hashes)
            case AllBlocksCleared():
                held.clear()
            case _:
                raise TypeError(f"not a KV event: {type(event).__name__}")
    return True


def _match(held: set[BlockHash], hashes: Sequence[BlockHash]) -> PrefixMatch:
    """The leading run of ``hashes`` in the pool, then in either medium."""
    pool = 0
    for block in hashes:
        if block not in held:
            break
        pool += 1
    more = 0
    for block in hashes[pool:]:
        if block not in held and block + OFFLOAD_TAG not in held:
            break
        more += 1
    return PrefixMatch(pool, more)


class MemoryPrefixIndex(PrefixIndex):
    """The embedded default: one set of hashes per replica, in this process.

    ``score`` walks each live replica's set up to its first miss: O(replicas ×
    matched blocks), ~15 µs for 125 hashes and 4 replicas. Memory is about 100
    bytes per entry; expired replicas are removed by the next ``score`` or
    ``sizes`` (or a publish call for them), so it stays bounded by the live
    replicas' capacities.

    Args:
      liveness_ttl_s: seconds a replica stays live after its last publish call (> 0).
      clock: seconds, monotonic (injectable for tests).
      metrics: where to count (default: the process registry).
    """

    backend = "memory"

    def __init__(self, *, liveness_ttl_s: float = 1.5, clock: Clock = time.monotonic,
                 metrics: CacheMetrics | None = None) -> None:
        super().__init__(liveness_ttl_s=liveness_ttl_s, metrics=metrics)
        self._clock = clock
        self._replicas: dict[ReplicaId, _Replica] = {}

    def _expire(self) -> None:
        now = self._clock()
        for replica in [r for r, held in self._replicas.items() if held.expires_at <= now]:
            self._remove(replica)

    def _remove(self, replica: ReplicaId) -> None:
        del self._replicas[replica]
        self._forget(replica)

    def _live(self, replica: ReplicaId) -> _Replica | None:
        held = self._replicas.get(replica)
        if held is not None and held.expires_at <= self._clock():
            self._remove(replica)
            return None
        return held

    def _publisher(self, replica: ReplicaId, epoch: int) -> _Replica | None:
        """The live entry of ``replica`` at ``epoch`` with liveness refreshed, or None (counted)."""
        _check_publisher(replica, epoch)
        held = self._live(replica)
        if held is None or held.epoch != epoch:
            self._refuse(replica, NOT_REGISTERED if held is None else STALE_EPOCH)
            return None
        held.expires_at = self._clock() + self.liveness_ttl_s
        return held

    async def register(self, replica: ReplicaId, epoch: int, capacity_blocks: int) -> bool:
        _check_publisher(replica, epoch)
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        held = self._live(replica)
        if held is not None and held.epoch > epoch:
            return False
        if held is None or held.epoch < epoch:
            held = self._replicas[replica] = _Replica(epoch, capacity_blocks, 0.0, set())
        held.capacity = capacity_blocks
        held.expires_at = self._clock() + self.liveness_ttl_s
        self._held(replica, len(held.hashes))
        return True

    async def replace(self, replica: ReplicaId, epoch: int, hashes: Sequence[BlockHash],
                      offloaded: Sequence[BlockHash] = ()) -> bool:
        held = self._publisher(replica, epoch)
        if held is None:
            return False
        held.hashes = set()
        fits = _add_within(held.hashes, held.capacity, _entries(hashes, offloaded))
        self._held(replica, len(held.hashes))
        return fits or self._refuse(replica, CAPACITY)

    async def apply(self, replica: ReplicaId, epoch: int, events: Sequence[KVEvent]) -> bool:
        held = self._publisher(replica, epoch)
        if held is None:
            return False
        fits = _apply_events(held.hashes, held.capacity, events)
        self._held(replica, len(held.hashes))
        return fits or self._refuse(replica, CAPACITY)

    async def heartbeat(self, replica: ReplicaId, epoch: int) -> bool:
        return self._publisher(replica, epoch) is not None

    async def drop(self, replica: ReplicaId, epoch: int) -> None:
        _check_publisher(replica, epoch)
        held = self._live(replica)
        if held is not None and held.epoch == epoch:
            self._remove(replica)

    async def _match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, PrefixMatch]:
        self._expire()
        matches = {}
        for replica, held in self._replicas.items():
            found = _match(held.hashes, hashes)
            if found.blocks or found.offloaded:
                matches[replica] = found
        return matches

    async def held_epoch(self, replica: ReplicaId) -> int | None:
        held = self._live(replica)
        return None if held is None else held.epoch

    async def _sizes(self) -> dict[ReplicaId, int]:
        self._expire()
        return {replica: len(held.hashes) for replica, held in self._replicas.items()}

    async def close(self) -> None:
        for replica in list(self._replicas):
            self._remove(replica)


# The Redis store -----------------------------------------------------------------

# Status codes the publish scripts answer with (first item of their reply).
_OK, _NOT_REGISTERED, _STALE_EPOCH, _CAPACITY, _OLDER_EPOCH = 1, 2, 3, 4, 5
_REASONS = {_NOT_REGISTERED: NOT_REGISTERED, _STALE_EPOCH: STALE_EPOCH, _CAPACITY: CAPACITY}

# Shared by every script. ARGV[1] is the key prefix; publish scripts take
# ARGV[2] replica, ARGV[3] epoch (decimal), ARGV[4] liveness ttl (ms).
_PRELUDE = """
local prefix = ARGV[1]
local replicas_key = prefix .. 'replicas'
local OK, NOT_REGISTERED, STALE_EPOCH, CAPACITY, OLDER_EPOCH = 1, 2, 3, 4, 5
local function live_key(r) return prefix .. 'live:' .. r end
local function blocks_key(r, e) return prefix .. 'blocks:' .. r .. ':' .. e end
-- epochs are decimal strings without leading zeros: compare exactly past 2^53
local function newer(a, b) return #a > #b or (#a == #b and a > b) end
-- status of a publisher of replica r at epoch e, and the capacity held
local function check(r, e)
  local held = redis.call('HMGET', live_key(r), 'epoch', 'cap')
  if not held[1] then return NOT_REGISTERED, 0 end
  if held[1] ~= e then return STALE_EPOCH, 0 end
  return OK, tonumber(held[2])
end
-- keeps replica r at epoch e live for ttl ms more (its entries too)
local function refresh(r, e, ttl)
  redis.call('SADD', replicas_key, r)
  redis.call('PEXPIRE', live_key(r), ttl)
  redis.call('PEXPIRE', blocks_key(r, e), ttl)
end
-- {replica, epoch} of each live replica; forgets the expired ones
local function live_replicas()
  local live = {}
  for _, r in ipairs(redis.call('SMEMBERS', replicas_key)) do
    local e = redis.call('HGET', live_key(r), 'epoch')
    if e then live[#live + 1] = {r, e} else redis.call('SREM', replicas_key, r) end
  end
  return live
end
"""

_REGISTER = """
local r, e, ttl, cap = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local held = redis.call('HGET', live_key(r), 'epoch')
if held and newer(held, e) then return {OLDER_EPOCH, 0} end
if held ~= e then
  if held then redis.call('DEL', blocks_key(r, held)) end
  redis.call('DEL', blocks_key(r, e))
end
redis.call('HSET', live_key(r), 'epoch', e, 'cap', cap)
refresh(r, e, ttl)
return {OK, redis.call('SCARD', blocks_key(r, e))}
"""

# ARGV[5..]: distinct hashes.
_REPLACE = """
local r, e, ttl = ARGV[2], ARGV[3], ARGV[4]
local status, cap = check(r, e)
if status ~= OK then return {status, 0} end
local key = blocks_key(r, e)
redis.call('DEL', key)
local last = math.min(#ARGV, 4 + cap)
for i = 5, last, 1000 do
  redis.call('SADD', key, unpack(ARGV, i, math.min(i + 999, last)))
end
refresh(r, e, ttl)
if last < #ARGV then status = CAPACITY end
return {status, last - 4}
"""

# ARGV[5..]: events, each a kind ('S' stored, 'R' removed, 'C' cleared), a
# count and that many hashes.
_APPLY = """
local r, e, ttl = ARGV[2], ARGV[3], ARGV[4]
local status, cap = check(r, e)
if status ~= OK then return {status, 0} end
local key = blocks_key(r, e)
local size = redis.call('SCARD', key)
local i = 5
while i <= #ARGV and status == OK do
  local kind, last = ARGV[i], i + 1 + tonumber(ARGV[i + 1])
  if kind == 'C' then
    redis.call('DEL', key)
    size = 0
  elseif kind == 'R' then
    for j = i + 2, last do size = size - redis.call('SREM', key, ARGV[j]) end
  else
    for j = i + 2, last do
      if size >= cap and redis.call('SISMEMBER', key, ARGV[j]) == 0 then
        status = CAPACITY
        break
      end
      size = size + redis.call('SADD', key, ARGV[j])
    end
  end
  i = last + 1
end
refresh(r, e, ttl)
return {status, size}
"""

_HEARTBEAT = """
local r, e, ttl = ARGV[2], ARGV[3], ARGV[4]
local status = check(r, e)
if status ~= OK then return {status, 0} end
refresh(r, e, ttl)
return {OK, redis.call('SCARD', blocks_key(r, e))}
"""

# Answers 1 when it dropped the replica.
_DROP = """
local r, e = ARGV[2], ARGV[3]
local held = redis.call('HGET', live_key(r), 'epoch')
if held and held ~= e then return 0 end
redis.call('SREM', replicas_key, r)
if not held then return 0 end
redis.call('DEL', live_key(r), blocks_key(r, e))
return 1
"""

# ARGV[2]: the prompt's hashes back to back, 32 bytes each (one argument: 126
# of them cost the client more than the script); ARGV[3]: the offload tag.
# Each replica's set is probed with 32 hashes, then 256 at a time, stopping at
# the first miss: plain hashes (the pool), then from there plain or tagged
# (either medium). Answers replica, pool count, more, replica, ...
_SCORE = """
local blob, tag = ARGV[2], ARGV[3]
local hashes = {}
for i = 1, #blob, 32 do hashes[#hashes + 1] = string.sub(blob, i, i + 31) end
local function probe(key, first, last, suffix)
  if suffix == '' then return redis.call('SMISMEMBER', key, unpack(hashes, first, last)) end
  local members = {}
  for i = first, last do members[#members + 1] = hashes[i] .. suffix end
  return redis.call('SMISMEMBER', key, unpack(members))
end
-- leading hits from hashes[from]: plain ones only, or with either_medium tagged ones too
local function leading(key, from, either_medium)
  local count, first, size = 0, from, 32
  while first <= #hashes do
    local last = math.min(first + size - 1, #hashes)
    local plain = probe(key, first, last, '')
    local tagged = either_medium and probe(key, first, last, tag) or nil
    for j = 1, #plain do
      if plain[j] == 0 and (tagged == nil or tagged[j] == 0) then return count end
      count = count + 1
    end
    first, size = last + 1, 256
  end
  return count
end
local scores = {}
for _, live in ipairs(live_replicas()) do
  local key = blocks_key(live[1], live[2])
  local pool = leading(key, 1, false)
  local more = leading(key, pool + 1, true)
  if pool + more > 0 then
    scores[#scores + 1] = live[1]; scores[#scores + 1] = pool; scores[#scores + 1] = more
  end
end
return scores
"""

# Answers replica, size, replica, size, ...
_SIZES = """
local sizes = {}
for _, live in ipairs(live_replicas()) do
  sizes[#sizes + 1] = live[1]
  sizes[#sizes + 1] = redis.call('SCARD', blocks_key(live[1], live[2]))
end
return sizes
"""

_SCRIPTS = {"register": _REGISTER, "replace": _REPLACE, "apply": _APPLY,
            "heartbeat": _HEARTBEAT, "drop": _DROP, "score": _SCORE, "sizes": _SIZES}


def _encode_events(events: Sequence[KVEvent]) -> list[bytes | str | int]:
    """The apply script's ARGV[5..] for ``events``."""
    args: list[bytes | str | int] = []
    for event in events:
        match event:
            case BlockStored():
                args += ["S", len(event.block_hashes),
                         *(_entry(h, event.medium) for h in event.block_hashes)]
            case BlockRemoved():
                args += ["R", len(event.block_hashes),
                         *(_entry(h, event.medium) for h in event.block_hashes)]
            case AllBlocksCleared():
                args += ["C", 0]
            case _:
                raise TypeError(f"not a KV event: {type(event).__name__}")
    return args


def _matches(reply: list) -> dict[ReplicaId, PrefixMatch]:
    """``{replica: match}`` from a flat ``[replica, blocks, offloaded, ...]`` script reply."""
    items = iter(reply)
    return {replica.decode(): PrefixMatch(int(blocks), int(more))
            for replica, blocks, more in zip(items, items, items)}


def _pairs(reply: list) -> dict[ReplicaId, int]:
    """``{replica: n}`` from a flat ``[replica, n, ...]`` script reply."""
    items = iter(reply)
    return {replica.decode(): int(count) for replica, count in zip(items, items)}


class RedisPrefixIndex(PrefixIndex):
    """The index in Redis (or Valkey), shared by every cache-service instance on it.

    The key layout and scripts are in the module docstring. Each call is one
    ``EVALSHA`` through a :class:`~services.cache.store.RedisGuard` (bounded
    pool, timeout, retry pause, ``llmesh:cache_backend_up{backend="redis"}``,
    errors counted with operation ``kv_<method>``).

    Args:
      url: ``redis://[[user]:password@]host:port/db``, ``rediss://`` or ``unix://``.
      key_prefix: prepended to every key.
      liveness_ttl_s: seconds a replica stays live after its last publish call
        (> 0; Redis keeps it to the millisecond, at least 1 ms).
      options: timeouts, retry pause, pool size, the guard's clock.
      metrics: where to count (default: the process registry).
    """

    backend = "redis"

    def __init__(self, url: str, *, key_prefix: str = "llmesh:kv:",
                 liveness_ttl_s: float = 1.5, options: RedisOptions | None = None,
                 metrics: CacheMetrics | None = None) -> None:
        super().__init__(liveness_ttl_s=liveness_ttl_s, metrics=metrics)
        self.key_prefix = key_prefix
        self._ttl_ms = max(1, round(liveness_ttl_s * 1000))
        self._guard = RedisGuard(url, component="redis prefix index",
                                 degraded="answering no scores / refusing publishes",
                                 options=options or RedisOptions(), metrics=self._metrics)
        self.url = self._guard.url
        client = self._guard.client
        self._scripts = {name: client.register_script(_PRELUDE + body)
                         for name, body in _SCRIPTS.items()}

    async def start(self) -> None:
        await self._guard.start()

    async def _run(self, name: str, args: list) -> list | int | None:
        """The reply of script ``name``; None when Redis failed or is paused."""
        script = self._scripts[name]
        return await self._guard.call(f"kv_{name}", lambda: script(args=args), None)

    async def _publish(self, name: str, replica: ReplicaId, epoch: int,
                       extra: Sequence[bytes | str | int] = ()) -> tuple[int, int] | None:
        """(status, entries held) of a publish script; None when Redis failed."""
        _check_publisher(replica, epoch)
        reply = await self._run(name, [self.key_prefix, replica, str(epoch), self._ttl_ms,
                                       *extra])
        return None if reply is None else (int(reply[0]), int(reply[1]))

    def _outcome(self, replica: ReplicaId, reply: tuple[int, int] | None) -> bool:
        """A publish call's answer; refusals counted, the size gauge set."""
        if reply is None:
            return self._refuse(replica, BACKEND)
        status, size = reply
        if status not in (_OK, _CAPACITY):
            return self._refuse(replica, _REASONS[status])
        self._held(replica, size)
        return status == _OK or self._refuse(replica, CAPACITY)

    async def register(self, replica: ReplicaId, epoch: int, capacity_blocks: int) -> bool:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        reply = await self._publish("register", replica, epoch, [capacity_blocks])
        if reply is None or reply[0] != _OK:
            return False
        self._held(replica, reply[1])
        return True

    async def replace(self, replica: ReplicaId, epoch: int, hashes: Sequence[BlockHash],
                      offloaded: Sequence[BlockHash] = ()) -> bool:
        distinct = list(dict.fromkeys(_entries(hashes, offloaded)))
        return self._outcome(replica, await self._publish("replace", replica, epoch, distinct))

    async def apply(self, replica: ReplicaId, epoch: int, events: Sequence[KVEvent]) -> bool:
        args = _encode_events(events)
        return self._outcome(replica, await self._publish("apply", replica, epoch, args))

    async def heartbeat(self, replica: ReplicaId, epoch: int) -> bool:
        return self._outcome(replica, await self._publish("heartbeat", replica, epoch))

    async def drop(self, replica: ReplicaId, epoch: int) -> None:
        _check_publisher(replica, epoch)
        if await self._run("drop", [self.key_prefix, replica, str(epoch)]) == 1:
            self._forget(replica)

    async def held_epoch(self, replica: ReplicaId) -> int | None:
        client = self._guard.client
        key = f"{self.key_prefix}live:{replica}"
        value = await self._guard.call("kv_held_epoch", lambda: client.hget(key, "epoch"), None)
        return None if value is None else int(value)

    async def _match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, PrefixMatch]:
        reply = await self._run("score", [self.key_prefix, b"".join(hashes), OFFLOAD_TAG])
        return {} if reply is None else _matches(reply)

    async def _sizes(self) -> dict[ReplicaId, int] | None:
        reply = await self._run("sizes", [self.key_prefix])
        return None if reply is None else _pairs(reply)

    async def close(self) -> None:
        await self._guard.close()
