"""Publishes this replica's KV cache events to the cache service's prefix index.

One long-lived ``CacheService.PublishKvEvents`` call (bidirectional) per
engine, opened at start and opened again after it fails:

* the first message carries the :class:`KvEventsHello` (replica id, epoch,
  block size, capacity) and a snapshot of every block hash the prefix cache
  holds; every later message carries the events drained since the previous
  one (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, in order);
* a message goes out at most every ``interval_s`` (default 20 ms: a KV
  event reaches the index within about one decode step) and at least every
  ``heartbeat_s`` (empty when nothing happened), so the index knows the
  replica is alive; it drops a replica silent for 1.5 s;
* gaps are never silent. The block pool's buffer is bounded (100,000
  events) and counts what it drops; when the count grew, or the index
  answers ``resync`` (its store lost the entries: Redis restarted), or the
  call was opened again, the next message carries a new snapshot, taken
  atomically with discarding the undrained events (see
  :meth:`EngineBackend.kv_snapshot`).

The epoch is the engine's start time in nanoseconds: a restarted engine has a
larger one, and the index drops what the old process published.

Metrics: ``llmesh:kv_events_published_total``,
``llmesh:kv_event_buffer_dropped_total`` (the pool's gap counter) and
``llmesh:kv_event_snapshots_total{reason}``.

Threading: runs on the engine service's event loop; the backend's drain and
snapshot are thread-safe and cheap (a snapshot copies the hash map under the
engine's state lock, ~1 ms per 10,000 blocks).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from llmesh.v1 import cache_pb2, cache_pb2_grpc
from services.common.grpc_util import make_channel
from services.common.kv_events import (
    MEDIUM_TO_PB,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from services.common.tasks import cancel_and_wait
from services.engine.backend import EngineBackend
from services.engine.metrics import EngineMetrics

log = structlog.get_logger()

#: Seconds between two messages at most (events wait this long at most).
DEFAULT_INTERVAL_S = 0.02
#: Seconds without a message before an empty one is sent.
DEFAULT_HEARTBEAT_S = 0.5
#: Seconds before the call is opened again after it failed (doubling to 2 s).
_RETRY_S = (0.1, 2.0)


@dataclass(frozen=True)
class PublisherIdentity:
    """Who publishes: the hello's fields.

    Attributes:
      replica_id: the replica's id (as in ``GetModelInfo``).
      epoch: the engine's start time in ns (larger after each restart).
      model: the served model id.
      block_size: tokens per KV block.
      capacity_blocks: blocks in the KV cache.
      offload_capacity_blocks: blocks in the KV offload tier (0: none).
    """

    replica_id: str
    epoch: int
    model: str
    block_size: int
    capacity_blocks: int
    offload_capacity_blocks: int = 0

    def hello(self) -> cache_pb2.KvEventsHello:
        return cache_pb2.KvEventsHello(
            replica_id=self.replica_id, epoch=self.epoch, model=self.model,
            block_size=self.block_size, capacity_blocks=self.capacity_blocks,
            offload_capacity_blocks=self.offload_capacity_blocks)


def event_to_pb(event: KVEvent) -> cache_pb2.KvEvent:
    """The protobuf form of one KV event (token ids stay in the engine: the
    index needs only the hashes)."""
    if isinstance(event, BlockStored):
        return cache_pb2.KvEvent(stored=cache_pb2.KvBlocksStored(
            block_hashes=list(event.block_hashes), parent_hash=event.parent_hash or b"",
            medium=MEDIUM_TO_PB[event.medium]))
    if isinstance(event, BlockRemoved):
        return cache_pb2.KvEvent(removed=cache_pb2.KvBlocksRemoved(
            block_hashes=list(event.block_hashes), medium=MEDIUM_TO_PB[event.medium]))
    assert isinstance(event, AllBlocksCleared)
    return cache_pb2.KvEvent(cleared=cache_pb2.KvAllBlocksCleared())


class KvEventPublisher:
    """The publishing task of one engine (see the module docstring).

    Args:
      backend: the started backend (``drain_kv_events`` / ``kv_snapshot``).
      target: ``host:port`` of the cache service.
      identity: the hello's fields.
      metrics: where to count.
      interval_s, heartbeat_s: see the module docstring (seconds).
    """

    def __init__(self, backend: EngineBackend, target: str, identity: PublisherIdentity,
                 metrics: EngineMetrics, *, interval_s: float = DEFAULT_INTERVAL_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self._backend = backend
        self.target = target
        self.identity = identity
        self._metrics = metrics
        self._interval = interval_s
        self._heartbeat = heartbeat_s
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._snapshot_reason: str | None = "connect"  # the next message carries one
        self._dropped_seen = 0

    def start(self) -> None:
        """Starts the publishing task (idempotent)."""
        if self._task is None:
            self._channel = make_channel(self.target)
            self._task = asyncio.create_task(self._run(), context=contextvars.Context(),
                                             name="kv-event-publisher")

    async def close(self) -> None:
        """Stops publishing; the index drops this replica when the call ends."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    # ---- internals -----------------------------------------------------------------

    async def _run(self) -> None:
        retry = _RETRY_S[0]
        while True:
            assert self._channel is not None
            stub = cache_pb2_grpc.CacheServiceStub(self._channel)
            call = stub.PublishKvEvents(self._messages())
            try:
                async for reply in call:
                    retry = _RETRY_S[0]
                    if reply.resync:
                        self._snapshot_reason = "resync"
                log.warning("kv_event_call_ended", target=self.target)
            except grpc.aio.AioRpcError as err:
                log.warning("kv_event_call_failed", target=self.target, code=err.code().name,
                            details=err.details(), retry_in_s=retry)
            finally:
                call.cancel()
            self._snapshot_reason = "reconnect"
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_S[1])

    async def _messages(self) -> AsyncIterator[cache_pb2.PublishKvEventsRequest]:
        first = self._message()
        first.hello.CopyFrom(self.identity.hello())
        yield first
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        while True:
            await asyncio.sleep(self._interval)
            message = self._message()
            now = loop.time()
            if message.events or message.HasField("snapshot") or now - sent_at >= self._heartbeat:
                sent_at = now
                yield message

    def _message(self) -> cache_pb2.PublishKvEventsRequest:
        """The next message: a snapshot when one is due, then the drained events."""
        message = cache_pb2.PublishKvEventsRequest()
        dropped = self._backend.kv_events_dropped()
        if dropped > self._dropped_seen:
            message.dropped_events = dropped - self._dropped_seen
            self._metrics.kv_events_dropped.inc(dropped - self._dropped_seen)
            self._dropped_seen = dropped
            self._snapshot_reason = self._snapshot_reason or "dropped"
        if self._snapshot_reason is not None:
            snapshot = self._backend.kv_snapshot()
            if snapshot is not None:
                message.snapshot.block_hashes.extend(snapshot.block_hashes)
                message.snapshot.offloaded_block_hashes.extend(snapshot.offloaded_hashes)
                self._dropped_seen = max(self._dropped_seen, snapshot.events_dropped)
            else:
                message.snapshot.SetInParent()
            self._metrics.kv_event_snapshots.labels(self._snapshot_reason).inc()
            self._snapshot_reason = None
        events = self._backend.drain_kv_events()
        if events:
            message.events.extend(event_to_pb(event) for event in events)
            self._metrics.kv_events_published.inc(len(events))
        return message
