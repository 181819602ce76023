"""A collection: its documents, their chunks, the metadata postings and the vector index.

One :class:`Collection` owns all of its state; the servicer mutates it only
through :meth:`Collection.replace` and :meth:`Collection.delete` (under the
collection's lock), which bump :attr:`Collection.version` once per ingest and
once per delete that removed anything. Chunks carry integer labels (the
index's keys), never reused within a collection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.retriever.chunker import Chunking
from services.retriever.index import VectorIndex

#: A metadata value as filters compare it: the type is part of it (``True`` ≠ ``1``).
Scalar = str | float | bool
MetadataKey = tuple[str, Scalar]


def value_key(value: Scalar) -> MetadataKey:
    """``value`` tagged with its type name, so that ``True`` and ``1.0`` differ."""
    return (type(value).__name__, value)


class UnknownFilterField(ValueError):
    """A filter names a field no document of the collection has."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.field = name


@dataclass(frozen=True)
class Chunk:
    """One chunk of a document.

    Attributes:
      label: the index's key for its vector.
      index: its position in the document (``chunk_id`` is ``<document>#<index>``).
      document_id: the owning document.
      text: the chunk's text (a slice of the document).
      digest: :func:`~services.retriever.caches.content_hash` of the text.
    """

    label: int
    index: int
    document_id: str
    text: str
    digest: str

    @property
    def chunk_id(self) -> str:
        return f"{self.document_id}#{self.index}"


@dataclass(frozen=True)
class DocumentRecord:
    """A stored document: its flat metadata and the labels of its chunks, in order."""

    id: str
    metadata: Mapping[str, Scalar]
    labels: tuple[int, ...]


@dataclass(frozen=True)
class PreparedDocument:
    """A document ready to store: chunk texts, their digests and vectors
    (``[len(texts), dimension]`` float32, unit length)."""

    id: str
    metadata: Mapping[str, Scalar]
    texts: Sequence[str]
    digests: Sequence[str]
    vectors: np.ndarray


@dataclass(frozen=True)
class SearchHit:
    """A chunk found by a query, with its document's metadata and cosine score."""

    chunk: Chunk
    score: float
    metadata: Mapping[str, Scalar]


@dataclass
class Collection:
    """A named set of documents searched by vector.

    Attributes:
      name: the collection's name.
      chunking: how its documents are cut.
      index: the vector index of its chunks (owned here).
      version: bumped by every :meth:`replace` and every :meth:`delete` that removed
        a document.
      documents, chunks: by document id and by label.
    """

    name: str
    chunking: Chunking
    index: VectorIndex
    version: int = 0
    documents: dict[str, DocumentRecord] = field(default_factory=dict)
    chunks: dict[int, Chunk] = field(default_factory=dict)
    next_label: int = 0
    _postings: dict[str, dict[MetadataKey, set[str]]] = field(default_factory=dict)

    def replace(self, documents: Iterable[PreparedDocument]) -> tuple[list[Chunk], list[Chunk]]:
        """Adds the documents, replacing those with the same id; bumps the
        version. Returns (chunks added, chunks removed), for the embedding
        cache's pins.

        Each document changes the index first, then this collection's state,
        so an index that fails (a Qdrant server: any exception of its client)
        leaves the collection consistent with it: the documents before the
        failing one are in, the failing one's old version may be out, and the
        version is bumped when anything changed (cached answers of the old
        version are never served)."""
        added: list[Chunk] = []
        removed: list[Chunk] = []
        completed = False
        try:
            for document in documents:
                chunks = [Chunk(self.next_label + i, i, document.id, text, digest)
                          for i, (text, digest) in enumerate(
                              zip(document.texts, document.digests, strict=True))]
                old = self.documents.get(document.id)
                if old is not None:
                    self.index.remove(old.labels)
                    removed += self._forget_document(document.id)
                if chunks:
                    self.index.add(np.array([c.label for c in chunks], dtype=np.int64),
                                   document.vectors)
                self.next_label += len(chunks)
                self._add_document(DocumentRecord(document.id, dict(document.metadata),
                                                  tuple(c.label for c in chunks)), chunks)
                added += chunks
            completed = True
        finally:
            if completed or added or removed:
                self.version += 1
        return added, removed

    def delete(self, document_ids: Iterable[str]) -> tuple[list[str], list[Chunk], list[str]]:
        """Removes these documents: their vectors from the index, then their
        chunks and metadata postings; bumps the version when any was removed.
        Returns (the ids removed; their chunks, for the embedding cache's pins;
        the ids this collection does not hold), each in the given order.

        As in :meth:`replace`, each document leaves the index before the
        state, so a failing index (a Qdrant server) leaves the documents
        before the failing one removed, the rest whole, and the version
        bumped when anything was removed."""
        deleted: list[str] = []
        removed: list[Chunk] = []
        absent: list[str] = []
        try:
            for document_id in document_ids:
                record = self.documents.get(document_id)
                if record is None:
                    absent.append(document_id)
                    continue
                self.index.remove(record.labels)
                removed += self._forget_document(document_id)
                deleted.append(document_id)
        finally:
            if deleted:
                self.version += 1
        return deleted, removed, absent

    def restore(self, record: DocumentRecord, chunks: Sequence[Chunk]) -> None:
        """Re-enters a persisted document whose vectors the index already holds."""
        self._add_document(record, chunks)

    def _add_document(self, record: DocumentRecord, chunks: Sequence[Chunk]) -> None:
        self.documents[record.id] = record
        for chunk in chunks:
            self.chunks[chunk.label] = chunk
        for name, value in record.metadata.items():
            self._postings.setdefault(name, {}).setdefault(value_key(value), set()).add(record.id)

    def _forget_document(self, document_id: str) -> list[Chunk]:
        """Drops a document from the state (its vectors are already removed)."""
        record = self.documents.pop(document_id)
        for name, value in record.metadata.items():
            values = self._postings[name]
            holders = values[value_key(value)]
            holders.discard(document_id)
            if not holders:
                del values[value_key(value)]
            if not values:
                del self._postings[name]
        return [self.chunks.pop(label) for label in record.labels]

    def search(self, query: np.ndarray, k: int,
               where: Mapping[str, Scalar] | None = None) -> list[SearchHit]:
        """The ``k`` chunks closest to ``query`` (``[dimension]``, unit length),
        best first, among the documents whose metadata equals every field of
        ``where``.

        Raises:
          UnknownFilterField: a field of ``where`` no document has.
        """
        allowed = self._allowed_labels(where) if where else None
        hits = self.index.search(query, k, allowed)
        return [SearchHit(chunk, score, self.documents[chunk.document_id].metadata)
                for chunk, score in ((self.chunks[label], score) for label, score in hits)]

    def _allowed_labels(self, where: Mapping[str, Scalar]) -> set[int]:
        for name in where:
            if name not in self._postings:
                raise UnknownFilterField(name)
        holders = [self._postings[name].get(value_key(value), set())
                   for name, value in where.items()]
        documents = set.intersection(*holders)
        return {label for document in documents for label in self.documents[document].labels}
