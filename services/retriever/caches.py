"""The retriever's caches: embeddings by content hash, query embeddings and top-k results.

* :class:`EmbeddingCache`: a chunk's vector under ``sha256(model id, text)``
  (:func:`content_hash`), filled at ingestion and from the persisted
  collections at start, so unchanged text is never embedded twice. Entries
  stay while a collection holds a chunk with that hash (the collection store
  is the owner of those vectors) and up to ``capacity`` more, least recently
  used first out.
* :class:`LruCache` keyed by the cache scope and the normalised query text
  (:func:`normalise_query`) for query embeddings, and by :class:`ResultKey`
  (cache scope, collection, version, normalised query, top_k, filter) for
  top-k results. The scope (``QueryRequest.cache_scope``: the tenant's, as the
  router resolves it, :mod:`services.common.cache_scope`) is in both keys: a
  hit's timing would otherwise tell one tenant that another asked the same
  question (a query embedding is reused across collections, so it tells that
  too). A collection's
  version changes with every ingest, replace or delete, so a stale result is
  never looked up again; :meth:`LruCache.drop` removes a changed collection's
  entries at once instead of waiting for them to age out.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def content_hash(model_id: str, text: str) -> str:
    """Hex sha256 of the model id and the text (NUL between): the embedding cache key."""
    return hashlib.sha256(f"{model_id}\0{text}".encode()).hexdigest()


def normalise_query(text: str) -> str:
    """The query as the caches see it: trimmed, runs of whitespace made one space."""
    return " ".join(text.split())


def canonical_filter(fields: dict[str, object]) -> str:
    """A filter as a stable string (sorted keys) for cache keys."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ResultKey:
    """What a cached top-k result depends on (``scope``: the query's cache scope)."""

    scope: str
    collection: str
    version: int
    query: str
    top_k: int
    filter: str


class LruCache(Generic[K, V]):
    """A bounded map, least recently used entry evicted first.

    Args:
      capacity: most entries held (0 disables the cache: nothing is stored).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recent), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Stores ``value``, evicting the least recent entries over capacity."""
        if self.capacity == 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def drop(self, stale: Callable[[K], bool]) -> int:
        """Removes the entries whose key ``stale`` accepts; returns how many."""
        keys = [key for key in self._entries if stale(key)]
        for key in keys:
            del self._entries[key]
        return len(keys)


class EmbeddingCache:
    """Chunk vectors by content hash.

    ``pinned`` counts, per hash, the chunks of all collections that hold it:
    a pinned vector stays; unpinned ones (their chunks deleted) stay in an
    LRU of ``capacity`` entries in case the text comes back.
    """

    def __init__(self, capacity: int = 50_000) -> None:
        self._pinned: dict[str, tuple[int, np.ndarray]] = {}
        self._loose: LruCache[str, np.ndarray] = LruCache(capacity)

    def __len__(self) -> int:
        return len(self._pinned) + len(self._loose)

    def get(self, digest: str) -> np.ndarray | None:
        """The vector of a content hash, or None."""
        pinned = self._pinned.get(digest)
        return pinned[1] if pinned is not None else self._loose.get(digest)

    def pin(self, digest: str, vector: np.ndarray) -> None:
        """One more chunk holds this hash's vector."""
        count = self._pinned.get(digest, (0, vector))[0]
        self._pinned[digest] = (count + 1, vector)

    def unpin(self, digest: str) -> None:
        """A chunk holding this hash is gone; the last one moves the vector to the LRU."""
        count, vector = self._pinned[digest]
        if count > 1:
            self._pinned[digest] = (count - 1, vector)
        else:
            del self._pinned[digest]
            self._loose.put(digest, vector)
