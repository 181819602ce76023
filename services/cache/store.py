"""Byte stores behind the response cache: embedded in-memory LRU, or Redis.

A :class:`ResponseStore` maps a string key to bytes with a lifetime in seconds.
It knows nothing about protobuf or cache keys, so the prefix index (fed by the
engines' KV events) can sit beside it later with its own store.

The cache is optional to the router, so a store never fails a request for a
backend reason: :class:`RedisStore` turns an outage into a miss (``get`` returns
None) or not-stored (``put`` returns False), logs a warning (rate-limited), counts
the error and stops calling Redis for ``retry_interval_seconds`` before trying again.
Only :meth:`ResponseStore.start` fails loudly, so a misconfigured URL is caught
at start-up rather than running as a cache that never hits.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.cache.metrics import CacheMetrics, default_metrics

log = structlog.get_logger()

Clock = Callable[[], float]


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


class RedisStore(ResponseStore):
    """Redis (or Valkey) through ``redis.asyncio``: ``SET key value PX ttl`` and ``GET``.

    One bounded connection pool is created here and reused by every call. Each
    call is bounded by ``timeout_seconds`` in all (pool wait, connect, one retry
    on a dropped connection, reply). A failure degrades to a miss / not-stored,
    then Redis is left alone for ``retry_interval_seconds`` (calls answer at once
    without touching the network) before the next call tries it again.

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
        self.url = redact_url(url)
        self._timeout = timeout_seconds
        self._retry_interval = retry_interval_seconds
        self._warn_interval = warn_interval_seconds
        self._metrics = metrics or default_metrics()
        self._clock = clock
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_seconds,
            socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
            # redis-py's default is 10 retries with backoff: seconds of stall per
            # call while Redis is down. One immediate retry covers a pooled
            # connection that Redis dropped (restart, idle timeout).
            retry=Retry(NoBackoff(), 1), client_name="llmesh-cache",
        )
        self._client = aioredis.Redis.from_pool(pool)
        self._up = self._metrics.backend_up.labels(self.backend)
        self._errors_get = self._metrics.backend_errors.labels(self.backend, "get")
        self._errors_put = self._metrics.backend_errors.labels(self.backend, "put")
        self._retry_at = 0.0  # clock() before which Redis is not called; 0 while healthy
        self._down_since = 0.0
        self._warned_at = float("-inf")
        self._unlogged_failures = 0

    async def start(self) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self._up.set(0)
            raise StoreUnavailableError(
                f"cannot reach Redis at {self.url} (--redis-url): "
                f"{type(exc).__name__}: {exc}") from exc
        self._up.set(1)
        log.info("redis store connected", url=self.url)

    def _available(self) -> bool:
        return self._retry_at == 0.0 or self._clock() >= self._retry_at

    def _failed(self, operation: str, exc: BaseException) -> None:
        now = self._clock()
        (self._errors_get if operation == "get" else self._errors_put).inc()
        self._up.set(0)
        if self._retry_at == 0.0:
            self._down_since = now
        self._retry_at = now + self._retry_interval
        self._unlogged_failures += 1
        if now - self._warned_at >= self._warn_interval:
            log.warning("redis store unavailable; answering miss / not stored",
                        url=self.url, operation=operation, error=f"{type(exc).__name__}: {exc}",
                        failures=self._unlogged_failures,
                        retry_in_seconds=self._retry_interval)
            self._warned_at = now
            self._unlogged_failures = 0

    def _succeeded(self) -> None:
        if self._retry_at != 0.0:
            self._retry_at = 0.0
            self._up.set(1)
            self._warned_at = float("-inf")
            self._unlogged_failures = 0
            log.info("redis store recovered", url=self.url,
                     down_seconds=round(self._clock() - self._down_since, 3))

    async def get(self, key: str) -> bytes | None:
        if not self._available():
            return None
        try:
            async with asyncio.timeout(self._timeout):
                value = await self._client.get(key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("get", exc)
            return None
        self._succeeded()
        return value

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        _check_ttl(ttl_seconds)
        if not self._available():
            return False
        try:
            async with asyncio.timeout(self._timeout):
                stored = await self._client.set(key, value, px=max(1, round(ttl_seconds * 1000)))
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("put", exc)
            return False
        self._succeeded()
        return bool(stored)

    async def close(self) -> None:
        await self._client.aclose()
