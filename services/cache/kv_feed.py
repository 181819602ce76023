"""The cache service's side of KV events: one engine replica's stream into the prefix index.

``CacheService.PublishKvEvents`` hands each call to :meth:`KvEventFeed.run`,
which keeps the index exact for that replica or says it is not:

1. the first message must carry a ``hello`` (INVALID_ARGUMENT otherwise, and
   for a ``hello`` on a later message) and registers the replica at its
   epoch: a newer epoch drops what an older process of the same replica
   published; an older epoch than the index holds ends the call
   FAILED_PRECONDITION, at once or as soon as a newer one takes over (a
   stale publisher never wins, and two engines sharing one ``--replica-id``
   are told);
2. a ``snapshot`` replaces the replica's entries; ``events`` apply in order
   on top; an empty message refreshes the replica's liveness;
3. when the index loses the replica's entries (a store call failed: Redis
   down or restarted empty; a store beyond the replica's capacity; the
   engine reported dropped events without a snapshot), the feed stops
   applying events, registers the replica again and answers
   ``resync: true``; the events that arrive before the engine's snapshot
   are discarded (they would apply to entries the index no longer has);
4. when the call ends (engine stopped or died: its connection resets), the
   replica's entries are dropped at once; a replica that goes silent with its
   connection open (hung) expires from the index 1.5 s after its last message
   (the store's liveness TTL), and the engine sends one at least every 0.5 s.

Every hash must be 32 bytes (INVALID_ARGUMENT). Metrics:
``llmesh:kv_events_received_total{replica}``,
``llmesh:kv_events_dropped_total{replica}`` (what the engine reports dropped),
``llmesh:kv_index_resyncs_total{replica, reason}`` (the index counts its own
refusals; the feed adds ``engine_dropped``) and ``llmesh:kv_index_blocks{replica}``
(set by the index).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from llmesh.v1 import cache_pb2
from services.cache.metrics import CacheMetrics
from services.cache.prefix_index import HASH_BYTES, PrefixIndex
from services.common.kv_events import (
    MEDIUM_FROM_PB,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
)

log = structlog.get_logger()

#: Longest replica id accepted, in characters.
MAX_REPLICA_ID_CHARS = 256

_Requests = AsyncIterator[cache_pb2.PublishKvEventsRequest]


class FeedError(Exception):
    """A stream the feed cannot serve: ends the call with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _State(enum.Enum):
    EXACT = "exact"  # the index holds exactly what the replica published
    WAITING_SNAPSHOT = "waiting_snapshot"  # resync asked; events discarded until a snapshot
    LOST = "lost"  # the store failed; register again on the next message


@dataclass(frozen=True)
class Publisher:
    """A validated hello."""

    replica_id: str
    epoch: int
    block_size: int
    capacity_blocks: int
    offload_capacity_blocks: int = 0

    @property
    def index_capacity(self) -> int:
        """Entries the index may hold for it: its pool's and its offload tier's blocks."""
        return self.capacity_blocks + self.offload_capacity_blocks

    @classmethod
    def from_pb(cls, hello: cache_pb2.KvEventsHello) -> Publisher:
        """Raises FeedError (INVALID_ARGUMENT) naming the first bad field."""
        if not hello.replica_id or len(hello.replica_id) > MAX_REPLICA_ID_CHARS:
            raise FeedError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"hello.replica_id: must be 1 to {MAX_REPLICA_ID_CHARS} characters")
        for name in ("epoch", "block_size", "capacity_blocks"):
            if getattr(hello, name) <= 0:
                raise FeedError(grpc.StatusCode.INVALID_ARGUMENT, f"hello.{name}: must be > 0")
        return cls(hello.replica_id, hello.epoch, hello.block_size, hello.capacity_blocks,
                   hello.offload_capacity_blocks)


def check_hashes(hashes: Sequence[bytes], field: str) -> None:
    """Raises FeedError (INVALID_ARGUMENT) when a hash is not 32 bytes."""
    for i, value in enumerate(hashes):
        if len(value) != HASH_BYTES:
            raise FeedError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{field}[{i}]: a block hash is {HASH_BYTES} bytes, got {len(value)}")


def events_from_pb(events: Sequence[cache_pb2.KvEvent], block_size: int) -> list[KVEvent]:
    """The typed events of a message (hashes checked; token ids are not sent).

    Raises:
      FeedError: INVALID_ARGUMENT for a bad hash or an event with no kind.
    """
    out: list[KVEvent] = []
    for i, event in enumerate(events):
        kind = event.WhichOneof("event")
        if kind == "stored":
            check_hashes(event.stored.block_hashes, f"events[{i}].stored.block_hashes")
            out.append(BlockStored(tuple(event.stored.block_hashes),
                                   event.stored.parent_hash or None, (), block_size,
                                   _medium(event.stored.medium, f"events[{i}].stored.medium")))
        elif kind == "removed":
            check_hashes(event.removed.block_hashes, f"events[{i}].removed.block_hashes")
            out.append(BlockRemoved(tuple(event.removed.block_hashes),
                                    _medium(event.removed.medium, f"events[{i}].removed.medium")))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
        else:
            raise FeedError(grpc.StatusCode.INVALID_ARGUMENT, f"events[{i}]: no event set")
    return out


def _medium(value: int, field: str) -> Medium:
    """Raises FeedError (INVALID_ARGUMENT) for a medium this index does not know."""
    medium = MEDIUM_FROM_PB.get(value)
    if medium is None:
        raise FeedError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: unknown medium {value}")
    return medium


def snapshot_from_pb(snapshot: cache_pb2.KvSnapshot) -> tuple[list[bytes], list[bytes]]:
    """The pool's and the offload tier's hashes of a snapshot (checked).

    Raises:
      FeedError: INVALID_ARGUMENT for a bad hash.
    """
    check_hashes(snapshot.block_hashes, "snapshot.block_hashes")
    check_hashes(snapshot.offloaded_block_hashes, "snapshot.offloaded_block_hashes")
    return list(snapshot.block_hashes), list(snapshot.offloaded_block_hashes)


class KvEventFeed:
    """Applies one replica's ``PublishKvEvents`` call to the index (see the module doc).

    Args:
      index: the prefix index (shared by every feed and ``ScorePrefix``).
      metrics: the cache service's metrics.
    """

    def __init__(self, index: PrefixIndex, metrics: CacheMetrics) -> None:
        self._index = index
        self._metrics = metrics

    async def run(self, requests: _Requests) -> AsyncIterator[cache_pb2.PublishKvEventsResponse]:
        """Consumes the call's messages; yields a ``resync`` answer when the index
        lost the replica's entries. Drops the replica when the messages end.

        Raises:
          FeedError: INVALID_ARGUMENT (no hello first, bad field) or
            FAILED_PRECONDITION (an older epoch than the index holds).
        """
        first = await anext(requests, None)
        if first is None:
            return
        if not first.HasField("hello"):
            raise FeedError(grpc.StatusCode.INVALID_ARGUMENT,
                            "the first message must carry `hello`")
        who = Publisher.from_pb(first.hello)
        state = await self._register(who)
        log.info("kv_publisher_connected", replica=who.replica_id, epoch=who.epoch,
                 capacity_blocks=who.capacity_blocks,
                 offload_capacity_blocks=who.offload_capacity_blocks, state=state.value)
        try:
            message: cache_pb2.PublishKvEventsRequest | None = first
            while message is not None:
                state, resync = await self._handle(who, state, message)
                if resync:
                    yield cache_pb2.PublishKvEventsResponse(resync=True)
                message = await anext(requests, None)
                if message is not None and message.HasField("hello"):
                    raise FeedError(grpc.StatusCode.INVALID_ARGUMENT,
                                    "hello: only on the first message of a call")
        finally:
            await self._index.drop(who.replica_id, who.epoch)
            for counter in (self._metrics.kv_events_received, self._metrics.kv_events_dropped):
                with contextlib.suppress(KeyError):  # no series left per vanished replica
                    counter.remove(who.replica_id)
            log.info("kv_publisher_gone", replica=who.replica_id, epoch=who.epoch)

    async def _register(self, who: Publisher) -> _State:
        if await self._index.register(who.replica_id, who.epoch, who.index_capacity):
            return _State.EXACT
        held = await self._index.held_epoch(who.replica_id)
        if held is not None and held > who.epoch:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"replica {who.replica_id!r} publishes with a newer epoch "
                            f"({held} > {who.epoch}): this engine process is stale, or two "
                            "engines share one --replica-id")
        return _State.LOST

    async def _handle(self, who: Publisher, state: _State,
                      message: cache_pb2.PublishKvEventsRequest) -> tuple[_State, bool]:
        """Applies one message; returns the new state and whether to ask for a snapshot."""
        replica = who.replica_id
        events = events_from_pb(message.events, who.block_size)
        self._count(replica, len(events), message.dropped_events)
        snapshot = snapshot_from_pb(message.snapshot) if message.HasField("snapshot") else None
        if state is _State.LOST:
            return await self._recover(who, snapshot)
        if snapshot is not None:
            if not await self._index.replace(replica, who.epoch, *snapshot):
                return await self._lost(who, "snapshot_refused")
            state = _State.EXACT
        elif message.dropped_events:
            self._metrics.kv_index_resyncs.labels(replica, "engine_dropped").inc()
            return await self._lost(who, "engine_dropped_events")
        if state is _State.WAITING_SNAPSHOT:
            return state, False
        if events:
            if not await self._index.apply(replica, who.epoch, events):
                return await self._lost(who, "apply_refused")
        elif not message.HasField("snapshot"):
            if not await self._index.heartbeat(replica, who.epoch):
                return await self._lost(who, "heartbeat_refused")
        return _State.EXACT, False

    async def _lost(self, who: Publisher, reason: str) -> tuple[_State, bool]:
        """The index no longer holds the replica exactly: register it again and
        ask for a snapshot (or retry on the next message if the store is down).

        Raises:
          FeedError: FAILED_PRECONDITION when a newer epoch of the replica took
            over (two engines with one ``--replica-id``: this one is superseded).
        """
        log.warning("kv_index_resync", replica=who.replica_id, reason=reason)
        if await self._register(who) is _State.EXACT:
            return _State.WAITING_SNAPSHOT, True
        return _State.LOST, False

    async def _recover(self, who: Publisher, snapshot: tuple[list[bytes], list[bytes]] | None
                       ) -> tuple[_State, bool]:
        """A message while the store was down: register again; a snapshot in the
        same message makes the index exact at once, else ask for one."""
        if await self._register(who) is _State.LOST:
            return _State.LOST, False
        if snapshot is not None and await self._index.replace(who.replica_id, who.epoch,
                                                              *snapshot):
            return _State.EXACT, False
        return _State.WAITING_SNAPSHOT, True

    def _count(self, replica: str, received: int, dropped: int) -> None:
        if received:
            self._metrics.kv_events_received.labels(replica).inc(received)
        if dropped:
            self._metrics.kv_events_dropped.labels(replica).inc(dropped)
