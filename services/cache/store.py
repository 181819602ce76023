"""Byte stores behind the response cache: embedded in-memory LRU, or Redis.

A :class:`ResponseStore` maps a string key to bytes with a lifetime in seconds.
It knows nothing about protobuf or cache keys; the prefix index (fed by the
engines' KV events) sits beside it with its own stores
(:mod:`services.cache.prefix_index`).

The cache is optional to the router, so a store never fails a request for a
backend reason: :class:`RedisStore` turns an outage into a miss (``get`` returns
None) or not-stored (``put`` returns False), logs a warning (rate-limited), counts
the error and stops calling Redis for ``retry_interval_seconds`` before trying again.
Only :meth:`ResponseStore.start` fails loudly, so a misconfigured URL is caught
at start-up rather than running as a cache that never hits. That policy lives
in :class:`RedisGuard`, which every Redis-backed store of the cache service
(this one and :class:`~services.cache.prefix_index.RedisPrefixIndex`) calls through.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.cache.metrics import CacheMetrics, default_metrics

log = structlog.get_logger()

Clock = Callable[[], float]
T = TypeVar("T")
F = TypeVar("F")


class StoreWrite(NamedTuple):
    """One :meth:`ResponseStore.put`'s arguments, for :meth:`ResponseStore.put_many`."""

    key: str
    value: bytes
    ttl_seconds: float


class StoreUnavailableError(RuntimeError):
    """The backend could not be reached at start-up (:meth:`ResponseStore.start`)."""


class ResponseStore(abc.ABC):
    """Async byte store with per-entry lifetime.

    Implementations are used from one event loop; no method is safe to call from
    another thread. ``get`` and ``put`` never raise for a backend failure.
    """

    #: Label value of the ``backend`` metric label (``memory``, ``redis``).
    backend: ClassVar[str]

    async def start(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Connects and checks the backend.

        Raises:
          StoreUnavailableError: the backend did not answer.
        """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None (absent, expired, backend down).
        Mutates recency (LRU) where the store has one."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        """Stores ``value`` under ``key`` for ``ttl_seconds`` seconds (> 0),
        replacing any earlier value.

        Returns:
          True when stored; False when the value cannot be held (larger than the
          store) or the backend is down.

        Raises:
          ValueError: ``ttl_seconds`` is not > 0 (a caller bug, not a backend state).
        """

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in order (Redis: one ``MGET``)."""
        return [await self.get(key) for key in keys]

    async def put_many(self, writes: Sequence[StoreWrite]) -> list[bool]:
        """:meth:`put` of each write, in order (a later write of a key wins),
        each write's result as :meth:`put` gives it (Redis: one pipeline).

        Raises:
          ValueError: a ``ttl_seconds`` is not > 0 (nothing is written).
        """
        for write in writes:
            _check_ttl(write.ttl_seconds)
        return [await self.put(*write) for write in writes]

    @abc.abstractmethod
    async def claim(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        """Stores ``value`` under ``key`` for ``ttl_seconds`` only when no live
        value is there (Redis ``SET NX PX``): True when this call stored it;
        False when the key is held, or the backend is down.

        Raises:
          ValueError: ``ttl_seconds`` is not > 0.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections and memory; the store is unusable afterwards."""


def _check_ttl(ttl_seconds: float) -> None:
    if not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")


@dataclass(slots=True)
class _Entry:
    value: bytes
    expires_at: float  # clock() seconds
    size: int  # bytes charged against max_bytes


class MemoryStore(ResponseStore):
    """The embedded default: an LRU bounded by entry count and bytes, with TTLs.

    Size of an entry is ``len(key) + len(value)`` bytes (keys are ASCII). When a
    put goes over ``max_entries`` or ``max_bytes``, least recently used entries
    are evicted first; expired entries are dropped when read, or evicted in LRU
    order like the rest. The store owns its state alone: every method runs to
    completion without awaiting, so concurrent calls on one loop never interleave.

    Args:
      max_entries: most entries held (>= 1).
      max_bytes: most bytes held (>= 1); a single larger entry is not stored.
      clock: seconds, monotonic (injectable for tests).
    """

    backend = "memory"

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 256 * 1024 * 1024,
                 clock: Clock = time.monotonic) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got "
                             f"{max_entries} and {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included."""
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of entry sizes)."""
        return self._bytes

    def keys(self) -> list[str]:
        """Keys from least to most recently used (for tests and debugging)."""
        return list(self._entries)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        _check_ttl(ttl_seconds)
        size = len(key) + len(value)
        self._remove(key)
        if size > self.max_bytes:
            return False
        self._entries[key] = _Entry(value, self._clock() + ttl_seconds, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        return True

    async def claim(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        _check_ttl(ttl_seconds)
        if await self.get(key) is not None:
            return False
        return await self.put(key, value, ttl_seconds)

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@dataclass(frozen=True)
class RedisOptions:
    """How the Redis-backed stores talk to Redis (shared by :class:`RedisGuard`'s users).

    Attributes:
      timeout_seconds: most time one call may spend on Redis in all (pool wait,
        connect, one retry on a dropped connection, reply).
      retry_interval_seconds: pause after a failure before calling Redis again.
      max_connections: pool size; callers beyond it wait (within the timeout).
      warn_interval_seconds: at most one outage warning per this many seconds.
      clock: seconds, monotonic, for the pause and the warnings (injectable for tests).
    """

    timeout_seconds: float = 0.5
    retry_interval_seconds: float = 1.0
    max_connections: int = 64
    warn_interval_seconds: float = 10.0
    clock: Clock = time.monotonic


#: What a failed Redis call raises: a refused or dropped connection, a Redis
#: error reply (a script error included), or the guard's timeout.
REDIS_FAILURES = (RedisError, OSError, TimeoutError)


class RedisGuard:
    """One bounded connection pool to Redis, and the outage policy of every call on it.

    A call that fails or takes longer than ``timeout_seconds`` answers the
    caller's fallback instead of raising, counts
    ``llmesh:cache_backend_errors_total{backend="redis",operation}``, sets
    ``llmesh:cache_backend_up{backend="redis"}`` to 0, logs a warning (at most one
    per ``warn_interval_seconds``, with the count of failures since the last
    one) and leaves Redis alone for ``retry_interval_seconds``: calls in that
    pause answer the fallback at once, without touching the network. The first
    call that succeeds after it sets the gauge back to 1 and logs the recovery.

    Args:
      url: ``redis://[[user]:password@]host:port/db``, ``rediss://`` or ``unix://``.
      component: who is guarded, for the log lines (``"redis store"``).
      degraded: what callers get during an outage, for the warning.
      options: timeouts, pause, pool size, clock.
      metrics: where errors and up/down are counted.
    """

    def __init__(self, url: str, *, component: str, degraded: str, options: RedisOptions,
                 metrics: CacheMetrics) -> None:
        self.url = redact_url(url)
        self.options = options
        self._component = component
        self._degraded = degraded
        self._metrics = metrics
        self._clock = options.clock
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=options.max_connections, timeout=options.timeout_seconds,
            socket_timeout=options.timeout_seconds,
            socket_connect_timeout=options.timeout_seconds,
            # redis-py's default is 10 retries with backoff: seconds of stall per
            # call while Redis is down. One immediate retry covers a pooled
            # connection that Redis dropped (restart, idle timeout).
            retry=Retry(NoBackoff(), 1), client_name="llmesh-cache",
        )
        #: The client on the pool; call it only through :meth:`call`.
        self.client = aioredis.Redis.from_pool(pool)
        self._up = metrics.backend_up.labels("redis")
        self._retry_at = 0.0  # clock() before which Redis is not called; 0 while healthy
        self._down_since = 0.0
        self._warned_at = float("-inf")
        self._unlogged_failures = 0

    async def start(self) -> None:
        """Pings Redis once (within ``timeout_seconds``).

        Raises:
          StoreUnavailableError: Redis did not answer.
        """
        try:
            async with asyncio.timeout(self.options.timeout_seconds):
                await self.client.ping()
        except REDIS_FAILURES as exc:
            self._up.set(0)
            raise StoreUnavailableError(
                f"cannot reach Redis at {self.url} (--redis-url): "
                f"{type(exc).__name__}: {exc}") from exc
        self._up.set(1)
        log.info(f"{self._component} connected", url=self.url)

    async def call(self, operation: str, make: Callable[[], Awaitable[T]],
                   fallback: F) -> T | F:
        """``await make()`` within the timeout; ``fallback`` if Redis failed or is paused.

        Args:
          operation: the ``operation`` label of the error counter (``"get"``).
          make: starts the Redis call (called at most once, not during a pause).
          fallback: what to answer instead of raising.
        """
        if self._retry_at != 0.0 and self._clock() < self._retry_at:
            return fallback
        try:
            async with asyncio.timeout(self.options.timeout_seconds):
                value = await make()
        except REDIS_FAILURES as exc:
            self._failed(operation, exc)
            return fallback
        if self._retry_at != 0.0:
            self._recovered()
        return value

    def _failed(self, operation: str, exc: BaseException) -> None:
        now = self._clock()
        self._metrics.backend_errors.labels("redis", operation).inc()
        self._up.set(0)
        if self._retry_at == 0.0:
            self._down_since = now
        self._retry_at = now + self.options.retry_interval_seconds
        self._unlogged_failures += 1
        if now - self._warned_at >= self.options.warn_interval_seconds:
            log.warning(f"{self._component} unavailable; {self._degraded}",
                        url=self.url, operation=operation, error=f"{type(exc).__name__}: {exc}",
                        failures=self._unlogged_failures,
                        retry_in_seconds=self.options.retry_interval_seconds)
            self._warned_at = now
            self._unlogged_failures = 0

    def _recovered(self) -> None:
        self._retry_at = 0.0
        self._up.set(1)
        self._warned_at = float("-inf")
        self._unlogged_failures = 0
        log.info(f"{self._component} recovered", url=self.url,
                 down_seconds=round(self._clock() - self._down_since, 3))

    async def close(self) -> None:
        """Closes the pool's connections."""
        await self.client.aclose()


class RedisStore(ResponseStore):
    """Redis (or Valkey) through ``redis.asyncio``: ``SET key value PX ttl`` and
    ``GET`` (a batch of puts in one pipeline, of gets in one ``MGET``).

    Every call goes through a :class:`RedisGuard`: one bounded pool reused by
    every call, each call bounded by ``timeout_seconds`` in all, and a failure
    degrades to a miss / not-stored, then Redis is left alone for
    ``retry_interval_seconds`` (calls answer at once without touching the
    network) before the next call tries it again.

    Args:
      url: ``redis://[[user]:password@]host:port/db``, ``rediss://`` or ``unix://``.
      timeout_seconds: most time one get or put may spend on Redis.
      retry_interval_seconds: pause after a failure before calling Redis again.
      max_connections: pool size; callers beyond it wait (within the timeout).
      warn_interval_seconds: at most one outage warning per this many seconds.
      metrics: where errors and up/down are counted (default: process registry).
      clock: seconds, monotonic (injectable for tests).
    """

    backend = "redis"

    def __init__(self, url: str, *, timeout_seconds: float = 0.5,
                 retry_interval_seconds: float = 1.0, max_connections: int = 64,
                 warn_interval_seconds: float = 10.0, metrics: CacheMetrics | None = None,
                 clock: Clock = time.monotonic) -> None:
        options = RedisOptions(timeout_seconds, retry_interval_seconds, max_connections,
                               warn_interval_seconds, clock)
        self._guard = RedisGuard(url, component="redis store",
                                 degraded="answering miss / not stored", options=options,
                                 metrics=metrics or default_metrics())
        self.url = self._guard.url
        self._client = self._guard.client

    async def start(self) -> None:
        await self._guard.start()

    async def get(self, key: str) -> bytes | None:
        return await self._guard.call("get", lambda: self._client.get(key), None)

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        _check_ttl(ttl_seconds)
        ttl_ms = max(1, round(ttl_seconds * 1000))
        stored = await self._guard.call(
            "put", lambda: self._client.set(key, value, px=ttl_ms), False)
        return bool(stored)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = await self._guard.call("get", lambda: self._client.mget(list(keys)), None)
        return [None] * len(keys) if values is None else list(values)

    async def put_many(self, writes: Sequence[StoreWrite]) -> list[bool]:
        """Every write's ``SET key value PX ttl`` in one pipeline (one round
        trip, not a transaction), within one guarded call: an outage makes
        every write False; a write Redis refuses alone (an error reply) is
        False and the others keep their results."""
        for write in writes:
            _check_ttl(write.ttl_seconds)
        if not writes:
            return []

        async def pipelined() -> list[object]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value, ttl_seconds in writes:
                    pipe.set(key, value, px=max(1, round(ttl_seconds * 1000)))
                return await pipe.execute(raise_on_error=False)

        replies = await self._guard.call("put", pipelined, None)
        if replies is None:
            return [False] * len(writes)
        return [reply is True for reply in replies]

    async def claim(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        _check_ttl(ttl_seconds)
        ttl_ms = max(1, round(ttl_seconds * 1000))
        stored = await self._guard.call(
            "claim", lambda: self._client.set(key, value, px=ttl_ms, nx=True), False)
        return bool(stored)

    async def close(self) -> None:
        await self._guard.close()
