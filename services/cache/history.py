"""Stored summaries of chat history (the router's history compaction).

The router (:mod:`services.router.history`) names a conversation's prefixes
by chained hashes (32 bytes each: the leading system messages, then one
message at a time). This module keeps, per cache scope (tenant or cache group,
and ``cache_salt``: :mod:`services.common.cache_scope`) and prefix hash:

* the summary of that prefix (a ``HistorySummary`` protobuf, with a TTL:
  ``--ttl-seconds`` unless the caller gives one);
* a claim on it while one router writes it (``SET NX`` with a lease, so that
  one summary is written per compaction whatever the number of routers; a
  claim whose writer died ends with its lease).

Lookups take every candidate prefix of a conversation at once (one ``MGET`` of
the summaries and the claims) and answer the longest prefix summarised, and
whether a longer one is being written (``pending``).

Keys are SHA-256 over the scope and the hash (:func:`summary_key`), in the
store the response cache uses (memory, or Redis: shared by every cache service
and router).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from google.protobuf.message import DecodeError
from llmesh.v1 import cache_pb2

from services.cache.store import ResponseStore
from services.common.cache_scope import check_scope
from services.common.sampling import InvalidRequestError

#: Key prefixes in the store (versioned: bump on any encoding change).
SUMMARY_NAMESPACE = "llmesh:v1:hist:"
CLAIM_NAMESPACE = "llmesh:v1:hist-claim:"
#: Most prefix hashes one lookup may carry.
MAX_PREFIX_HASHES = 4096
#: A claim's lease when the caller gives none (seconds).
DEFAULT_LEASE_SECONDS = 60
_HASH_BYTES = 32


def _digest(scope: str, prefix_hash: bytes) -> str:
    return hashlib.sha256(b"llmesh.history.v1\x00" + scope.encode() + b"\x00"
                          + prefix_hash).hexdigest()


def summary_key(scope: str, prefix_hash: bytes) -> str:
    """The store key of the summary of ``prefix_hash`` in ``scope``."""
    return SUMMARY_NAMESPACE + _digest(scope, prefix_hash)


def claim_key(scope: str, prefix_hash: bytes) -> str:
    """The store key of the claim on ``prefix_hash`` in ``scope``."""
    return CLAIM_NAMESPACE + _digest(scope, prefix_hash)


def _check(scope: str, hashes: Sequence[bytes], field: str) -> None:
    """Raises InvalidRequestError (INVALID_ARGUMENT) for a bad scope or hash."""
    check_scope(scope)
    if len(hashes) > MAX_PREFIX_HASHES:
        raise InvalidRequestError(field, f"at most {MAX_PREFIX_HASHES}, got {len(hashes)}")
    for i, value in enumerate(hashes):
        if len(value) != _HASH_BYTES:
            name = f"{field}[{i}]" if field.endswith("s") else field
            raise InvalidRequestError(name, f"must be {_HASH_BYTES} bytes, got {len(value)}")


class HistorySummaries:
    """Summaries and claims in a :class:`ResponseStore` (which it does not own).

    Args:
      store: the cache service's store.
      default_ttl_seconds: lifetime of a summary stored with ``ttl_seconds`` 0.
    """

    def __init__(self, store: ResponseStore, default_ttl_seconds: int) -> None:
        self._store = store
        self._ttl = default_ttl_seconds

    async def get(self, request: cache_pb2.GetHistorySummaryRequest
                  ) -> cache_pb2.GetHistorySummaryResponse:
        """The longest stored prefix, and whether a longer one is claimed.

        Raises:
          InvalidRequestError: a bad scope or hash (INVALID_ARGUMENT).
        """
        hashes = list(request.prefix_hashes)
        _check(request.cache_scope, hashes, "prefix_hashes")
        if not hashes:
            return cache_pb2.GetHistorySummaryResponse()
        scope = request.cache_scope
        values = await self._store.get_many(
            [summary_key(scope, h) for h in hashes] + [claim_key(scope, h) for h in hashes])
        summaries, claims = values[:len(hashes)], values[len(hashes):]
        reply = cache_pb2.GetHistorySummaryResponse()
        found = -1
        for index in reversed(range(len(hashes))):
            if summaries[index] is None:
                continue
            try:
                reply.summary.ParseFromString(summaries[index])
            except DecodeError:
                continue
            found = index
            reply.found, reply.prefix_index = True, index
            break
        reply.pending = any(claim is not None for claim in claims[found + 1:])
        return reply

    async def claim(self, request: cache_pb2.ClaimHistorySummaryRequest) -> bool:
        """True when this caller now holds the prefix's claim (no summary stored,
        no live claim).

        Raises:
          InvalidRequestError: a bad scope or hash (INVALID_ARGUMENT).
        """
        _check(request.cache_scope, [request.prefix_hash], "prefix_hash")
        scope, prefix = request.cache_scope, request.prefix_hash
        if await self._store.get(summary_key(scope, prefix)) is not None:
            return False
        lease = request.lease_seconds or DEFAULT_LEASE_SECONDS
        return await self._store.claim(claim_key(scope, prefix), b"1", lease)

    async def put(self, request: cache_pb2.PutHistorySummaryRequest) -> bool:
        """Stores the summary (a claim on it then no longer counts as pending).

        Raises:
          InvalidRequestError: a bad scope or hash (INVALID_ARGUMENT).
        """
        _check(request.cache_scope, [request.prefix_hash], "prefix_hash")
        return await self._store.put(summary_key(request.cache_scope, request.prefix_hash),
                                     request.summary.SerializeToString(),
                                     request.ttl_seconds or self._ttl)
