"""Vector indexes of the retriever: one interface, an ANN backend and exact search.

:class:`VectorIndex` is what a collection needs of its index;
:class:`IndexBackend` makes one per collection (``--index``): the in-process
ones here keep the index in a file under the data directory
(:class:`FileBackend`), ``qdrant`` (:mod:`services.retriever.qdrant_index`)
keeps it in a Qdrant server.

Vectors are float32 rows of the embedding model's dimension, unit length
(the embedder normalises them), so cosine similarity is their dot product.
Each vector has an integer label (``int``, ≥ 0) the collection store owns.

:class:`UsearchIndex` (HNSW from `usearch <https://github.com/unum-cloud/usearch>`_)
is the default. Measured against hnswlib and faiss-cpu's ``IndexHNSWFlat`` at
the same M/efConstruction/ef on the shipped corpus (``benchmarks/retrieval.py
--parts ann``, docs/bench.md): equal recall@10 (0.97), usearch 1.6 ms per
search against 0.7 ms through Python; kept for what the store needs beside
search: removing a replaced document's vectors (faiss's HNSW cannot),
reading stored vectors by key, one self-describing file.

:class:`ExactIndex` scans every vector with one matrix product (numpy): exact,
and faster than building a graph for a few thousand vectors; tests use it
where they check exact rankings.

A filtered search (``allowed`` labels) is exact over the allowed vectors when
they are few (:data:`EXACT_FILTER_MAX`); otherwise the ANN over-fetches
(``k × total / allowed``, doubled until enough matches or the whole index was
asked) so that ``k`` results come back whenever ``k`` allowed vectors exist.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

#: Allowed sets this small (or smaller than 1/16 of the index) are searched
#: exactly over their own vectors: a product of at most this many rows costs
#: less than an ANN over-fetch deep enough to find them.
EXACT_FILTER_MAX = 4096

Hit = tuple[int, float]
"""(label, cosine similarity), best first in a result list."""


class VectorIndex(Protocol):
    """What the collection store needs of an index.

    ``add`` and ``remove`` mutate; ``search`` and ``vectors`` do not. A label
    added again replaces its vector.
    """

    dimension: int

    def __len__(self) -> int: ...

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        """Adds ``vectors`` (``[n, dimension]`` float32) under ``labels`` (``[n]`` int)."""

    def remove(self, labels: Iterable[int]) -> None:
        """Removes these labels (unknown ones are ignored)."""

    def search(self, query: np.ndarray, k: int,
               allowed: Collection[int] | None = None) -> list[Hit]:
        """The ``k`` nearest labels to ``query`` (``[dimension]``), best first;
        only labels in ``allowed`` when given. Fewer when fewer exist."""

    def vector(self, label: int) -> np.ndarray:
        """The vector stored under ``label``. KeyError when absent."""

    def labels(self) -> set[int]:
        """Every label the index holds."""

    def save(self, path: Path) -> None:
        """Writes the index to ``path`` (a file the backend owns)."""


class IndexBackend(Protocol):
    """Makes, reloads and drops the index of each collection (``--index``).

    ``name`` is recorded in a saved collection, which reloads only under the
    same backend.
    """

    name: str

    def create(self, collection: str, dimension: int) -> VectorIndex:
        """A new empty index for ``collection`` (one left by an earlier
        collection of that name is emptied)."""

    def load(self, path: Path, collection: str, dimension: int) -> VectorIndex:
        """The index that ``save(path)`` of ``collection``'s index wrote.

        Raises:
          ValueError: the saved index cannot be found or read.
        """

    def drop(self, collection: str) -> None:
        """Deletes what the backend holds for ``collection`` outside the data
        directory (nothing for a file backend)."""


class ExactIndex:
    """Exact cosine search over all vectors (a matrix product per query)."""

    def __init__(self, dimension: int) -> None:
        self.dimension = dimension
        self._rows: dict[int, int] = {}  # label -> row in _matrix
        self._labels = np.empty(0, dtype=np.int64)
        self._matrix = np.empty((0, dimension), dtype=np.float32)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        self.remove(int(label) for label in labels if int(label) in self._rows)
        start = len(self._labels)
        self._labels = np.concatenate([self._labels, np.asarray(labels, dtype=np.int64)])
        self._matrix = np.concatenate([self._matrix, np.asarray(vectors, dtype=np.float32)])
        for offset, label in enumerate(labels):
            self._rows[int(label)] = start + offset

    def remove(self, labels: Iterable[int]) -> None:
        drop = {label for label in labels if label in self._rows}
        if not drop:
            return
        keep = np.array([int(label) not in drop for label in self._labels], dtype=bool)
        self._labels, self._matrix = self._labels[keep], self._matrix[keep]
        self._rows = {int(label): row for row, label in enumerate(self._labels)}

    def search(self, query: np.ndarray, k: int,
               allowed: Collection[int] | None = None) -> list[Hit]:
        if allowed is None:
            return top_k(self._labels, self._matrix, query, k)
        rows = [self._rows[label] for label in allowed if label in self._rows]
        return top_k(self._labels[rows], self._matrix[rows], query, k)

    def vector(self, label: int) -> np.ndarray:
        return self._matrix[self._rows[label]]

    def labels(self) -> set[int]:
        return set(self._rows)

    def save(self, path: Path) -> None:
        with path.open("wb") as file:
            np.savez(file, labels=self._labels, matrix=self._matrix)

    @classmethod
    def load(cls, path: Path, dimension: int) -> ExactIndex:
        """The index :meth:`save` wrote."""
        index = cls(dimension)
        with np.load(path) as saved:
            index.add(saved["labels"], saved["matrix"])
        return index


class UsearchIndex:
    """HNSW (usearch) with cosine metric and float32 vectors.

    Args:
      dimension: vector length.
      connectivity: graph degree M (usearch's default 16).
      expansion_add, expansion_search: candidate list sizes when building and
        searching (efConstruction / ef): ef 64 gave recall@10 0.94 on the
        corpus at 21k chunks, 128 is the default (docs/bench.md).
    """

    def __init__(self, dimension: int, *, connectivity: int = 16, expansion_add: int = 128,
                 expansion_search: int = 128) -> None:
        from usearch.index import Index

        self.dimension = dimension
        self._index = Index(ndim=dimension, metric="cos", dtype="f32",
                            connectivity=connectivity, expansion_add=expansion_add,
                            expansion_search=expansion_search)

    def __len__(self) -> int:
        return len(self._index)

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        labels = np.asarray(labels, dtype=np.uint64)
        present = [int(label) for label in labels if int(label) in self._index]
        self.remove(present)
        if len(labels):
            self._index.add(labels, np.asarray(vectors, dtype=np.float32))

    def remove(self, labels: Iterable[int]) -> None:
        present = [label for label in labels if label in self._index]
        if present:
            self._index.remove(np.asarray(present, dtype=np.uint64))

    def search(self, query: np.ndarray, k: int,
               allowed: Collection[int] | None = None) -> list[Hit]:
        total = len(self._index)
        if total == 0 or k == 0:
            return []
        if allowed is not None and (len(allowed) <= EXACT_FILTER_MAX
                                    or len(allowed) * 16 < total):
            return self._exact_over(query, k, allowed)
        want = k if allowed is None else min(total, math.ceil(k * total / max(len(allowed), 1)))
        while True:
            hits = self._ann(query, want)
            if allowed is not None:
                hits = [hit for hit in hits if hit[0] in allowed]
            if len(hits) >= k or want >= total:
                return hits[:k]
            want = min(total, want * 2)

    def _ann(self, query: np.ndarray, count: int) -> list[Hit]:
        # One thread: usearch's default (threads=0) readies its thread pool for
        # every call, and iterating its arrays makes a numpy scalar per element;
        # together they took 0.45 of a search's 0.8 ms (docs/bench.md "Retrieval").
        matches = self._index.search(np.asarray(query, dtype=np.float32), count, threads=1)
        # usearch's cosine "distance" is 1 - cosine similarity.
        return list(zip(matches.keys.tolist(), (1.0 - matches.distances).tolist(), strict=True))

    def _exact_over(self, query: np.ndarray, k: int, allowed: Collection[int]) -> list[Hit]:
        labels = np.fromiter((label for label in allowed if label in self._index),
                             dtype=np.int64)
        if len(labels) == 0:
            return []
        matrix = np.asarray(self._index.get(labels.astype(np.uint64)), dtype=np.float32)
        return top_k(labels, matrix, query, k)

    def vector(self, label: int) -> np.ndarray:
        if label not in self._index:
            raise KeyError(label)
        return np.asarray(self._index.get(label), dtype=np.float32)

    def labels(self) -> set[int]:
        return set(np.asarray(self._index.keys).tolist())

    def save(self, path: Path) -> None:
        self._index.save(str(path))

    @classmethod
    def load(cls, path: Path, dimension: int) -> UsearchIndex:
        """The index :meth:`save` wrote (read into memory)."""
        index = cls(dimension)
        expansion_search = index._index.expansion_search
        index._index.load(str(path))
        index._index.expansion_search = expansion_search  # a search setting, not the file's
        return index


def top_k(labels: np.ndarray, matrix: np.ndarray, query: np.ndarray, k: int) -> list[Hit]:
    """Exact top ``k`` of ``matrix`` rows (``[n, d]``) by dot product with
    ``query`` (``[d]``), as ``(label, score)`` best first."""
    if len(labels) == 0 or k == 0:
        return []
    scores = matrix @ np.asarray(query, dtype=np.float32)
    count = min(k, len(scores))
    best = np.argpartition(-scores, count - 1)[:count]
    best = best[np.argsort(-scores[best], kind="stable")]
    return [(int(labels[row]), float(scores[row])) for row in best]


@dataclass(frozen=True)
class FileBackend:
    """An in-process index class saved whole to one file under the data
    directory (the collection's name is not needed)."""

    name: str
    index_class: type[ExactIndex | UsearchIndex]

    def create(self, collection: str, dimension: int) -> VectorIndex:
        return self.index_class(dimension)

    def load(self, path: Path, collection: str, dimension: int) -> VectorIndex:
        return self.index_class.load(path, dimension)

    def drop(self, collection: str) -> None:
        """Nothing: the index is a file the store deletes with the collection."""


#: The in-process backends by name (``--index``); ``qdrant`` is made by
#: :class:`services.retriever.qdrant_index.QdrantBackend` from its flags.
FILE_BACKENDS: dict[str, FileBackend] = {
    "usearch": FileBackend("usearch", UsearchIndex),
    "exact": FileBackend("exact", ExactIndex),
}
