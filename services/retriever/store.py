"""The collections of one retriever, and their files under ``--data-dir``.

Layout: ``DATA_DIR/c-<hex of the name>/`` per collection (hex: a name may be
``..``), holding ``collection.json`` (name, chunking, version, documents with
metadata, chunks with text and content hash) and ``index-<version>.<backend>``
(the vector index, vectors included; for ``qdrant`` only the name of the
Qdrant collection holding them). A save writes the index file, then the
JSON to a temporary name renamed over the old one (atomic), then deletes
older index files: a crash mid-save leaves the previous complete state.
An index kept outside the data directory (Qdrant) is written as changes
happen, so after a crash it can be ahead of the JSON: a load deletes the
vectors of chunks the JSON does not list and leaves out (with a warning) the
documents whose vectors are missing; ingest those again.

Saves are deferred: :meth:`CollectionStore.mark_dirty` records a change and
:meth:`CollectionStore.save_dirty` (every ``--save-interval-seconds``, and at
drain) writes the changed collections, so a burst of ingests writes once. A
crash (SIGKILL) loses at most the changes of the last interval; a restart
through SIGTERM loses none.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import structlog

from services.retriever.chunker import Chunking
from services.retriever.collection import Chunk, Collection, DocumentRecord
from services.retriever.index import IndexBackend

log = structlog.get_logger()

STATE_FILE = "collection.json"


class CollectionStore:
    """Collections by name, persisted under ``data_dir`` (None: memory only).

    Args:
      data_dir: where collections live; created if missing.
      backend: makes each collection's index (``--index``).
      dimension: the embedding model's dimension.
    """

    def __init__(self, data_dir: Path | None, backend: IndexBackend, dimension: int) -> None:
        self.data_dir = data_dir
        self.backend = backend
        self.dimension = dimension
        self.collections: dict[str, Collection] = {}
        self._dirty: set[str] = set()

    def create(self, name: str, chunking: Chunking) -> Collection:
        """A new empty collection (the caller checked the name is free);
        blocking I/O for a server-side index."""
        collection = Collection(name, chunking, self.backend.create(name, self.dimension))
        self.collections[name] = collection
        self.mark_dirty(name)
        return collection

    def delete(self, name: str) -> Collection:
        """Forgets a collection and deletes its files and its server-side
        index (blocking I/O). KeyError when unknown."""
        collection = self.collections[name]
        self.backend.drop(name)  # first: a server that fails leaves the collection whole
        del self.collections[name]
        self._dirty.discard(name)
        if self.data_dir is not None:
            shutil.rmtree(self._directory(name), ignore_errors=True)
        return collection

    def mark_dirty(self, name: str) -> None:
        """The collection changed: the next :meth:`save_dirty` writes it."""
        self._dirty.add(name)

    def save_dirty(self) -> list[str]:
        """Writes every changed collection (blocking I/O); returns their names."""
        saved = sorted(self._dirty)
        self._dirty.clear()
        if self.data_dir is not None:
            for name in saved:
                if name in self.collections:
                    self._save(self.collections[name])
        return saved

    def _directory(self, name: str) -> Path:
        assert self.data_dir is not None
        return self.data_dir / f"c-{name.encode().hex()}"

    def _save(self, collection: Collection) -> None:
        directory = self._directory(collection.name)
        directory.mkdir(parents=True, exist_ok=True)
        index_file = f"index-{collection.version}.{self.backend.name}"
        collection.index.save(directory / index_file)
        state = {
            "name": collection.name,
            "chunking": asdict(collection.chunking),
            "version": collection.version,
            "next_label": collection.next_label,
            "backend": self.backend.name,
            "index_file": index_file,
            "documents": [
                {"id": record.id, "metadata": dict(record.metadata),
                 "chunks": [[c.label, c.index, c.text, c.digest]
                            for c in (collection.chunks[label] for label in record.labels)]}
                for record in collection.documents.values()],
        }
        temporary = directory / f"{STATE_FILE}.tmp"
        temporary.write_text(json.dumps(state))
        os.replace(temporary, directory / STATE_FILE)
        for old in directory.glob("index-*"):
            if old.name != index_file:
                old.unlink()

    def load_all(self) -> list[Collection]:
        """Reads every collection saved under ``data_dir`` (none without one).

        Raises:
          ValueError: a collection was saved with another index backend or
            embedding dimension (start with the same flags, or move the
            data directory away).
        """
        if self.data_dir is None:
            return []
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for state_path in sorted(self.data_dir.glob(f"c-*/{STATE_FILE}")):
            collection = self._load(state_path)
            self.collections[collection.name] = collection
        return list(self.collections.values())

    def _load(self, state_path: Path) -> Collection:
        state = json.loads(state_path.read_text())
        if state["backend"] != self.backend.name:
            raise ValueError(f"collection {state['name']!r} in {state_path.parent} was saved "
                             f"with index {state['backend']!r}, not {self.backend.name!r}")
        index = self.backend.load(state_path.parent / state["index_file"], state["name"],
                                  self.dimension)
        if index.dimension != self.dimension:
            raise ValueError(f"collection {state['name']!r}: dimension {index.dimension}, "
                             f"the model's is {self.dimension}")
        collection = Collection(state["name"], Chunking(**state["chunking"]), index,
                                version=state["version"], next_label=state["next_label"])
        held = index.labels()
        listed: set[int] = set()
        for document in state["documents"]:
            chunks = [Chunk(label, position, document["id"], text, digest)
                      for label, position, text, digest in document["chunks"]]
            labels = tuple(c.label for c in chunks)
            if not held.issuperset(labels):
                log.warning("document_vectors_missing", collection=collection.name,
                            document=document["id"])
                self.mark_dirty(collection.name)  # the next save forgets it
                continue
            listed.update(labels)
            collection.restore(DocumentRecord(document["id"], document["metadata"], labels),
                               chunks)
        if held - listed:
            log.warning("unlisted_vectors_removed", collection=collection.name,
                        vectors=len(held - listed))
            index.remove(held - listed)
        return collection
