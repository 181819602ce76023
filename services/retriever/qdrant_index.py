"""A Qdrant collection as a retriever collection's vector index (``--index qdrant``).

For deployments whose vectors outgrow one machine: the vectors live in a
`Qdrant <https://qdrant.tech>`_ server (its own HNSW, persistence, replication
and sharding), reached through the maintained ``qdrant-client`` package (the
optional extra ``retriever-qdrant``). The retriever keeps what it keeps for
every backend under ``--data-dir``: documents, chunk texts, metadata postings,
labels.

Mapping onto :class:`~services.retriever.index.VectorIndex`:

- each retriever collection is one Qdrant collection named
  ``<prefix><collection>`` (``--qdrant-collection-prefix``, default
  ``llmesh-``; the retriever's names, ``[A-Za-z0-9_.-]{1,128}``, are valid
  Qdrant names), cosine distance, the model's dimension; creating a retriever
  collection recreates it empty, deleting one deletes it;
- a label is the point id (an unsigned integer), the vector the point's
  vector, no payload; ``add`` upserts (a label added again replaces its
  vector), ``remove`` deletes by id (unknown ids are ignored);
- ``search`` is Qdrant's query with a ``has_id`` filter when the collection's
  metadata filter narrowed the labels (the retriever resolves metadata to
  labels itself, as for every backend), ``hnsw_ef`` as the default index's ef;
- ``save`` writes no vectors: the server persists them as they are written.
  It writes a small JSON file naming the Qdrant collection, so that ``load``
  re-attaches to it (ValueError when the server no longer has it). A saved
  collection is the server's vectors plus the retriever's JSON: after a crash
  the server can be ahead of the JSON by one save interval;
  :meth:`CollectionStore._load <services.retriever.store.CollectionStore>`
  reconciles the two through :meth:`QdrantIndex.labels`.

Calls are blocking (qdrant-client's synchronous client). The retriever makes
them where it calls every index: collection create, delete and the load at
start on its ingest thread, but ``search`` and an ingest's ``add``/``remove``
on the event loop (the collection's state is only changed and read there), so
against a server each of those blocks the loop for one round trip. Errors of
the server or the network propagate as ``qdrant_client`` / ``httpx``
exceptions: the RPC fails with UNKNOWN (gRPC's status for an unhandled
exception) and the retriever's state is unchanged only where the failing call
came first.

Tested here only against qdrant-client's embedded local mode
(``--qdrant-url :memory:`` or a directory), which runs the same client API in
process with exact search; no Qdrant server installs on the test machines.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.retriever.index import Hit

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

#: Environment variable holding the Qdrant API key (never a flag: flags show in ``ps``).
API_KEY_ENV = "QDRANT_API_KEY"

#: Points listed per page when reading every label (``labels``).
SCROLL_PAGE = 4096


class QdrantIndex:
    """One retriever collection's vectors in the Qdrant collection ``name``.

    Args:
      client: the backend's client (shared by its collections).
      name: the Qdrant collection (it exists).
      dimension: vector length.
      search_params: Qdrant's search parameters (None in local mode, which
        searches exactly and warns on any).
    """

    def __init__(self, client: QdrantClient, name: str, dimension: int,
                 search_params: object | None) -> None:
        self.dimension = dimension
        self.name = name
        self._client = client
        self._search_params = search_params

    def __len__(self) -> int:
        return int(self._client.count(self.name, exact=True).count)

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        from qdrant_client import models

        if len(labels):
            self._client.upsert(self.name, wait=True, points=models.Batch(
                ids=[int(label) for label in labels],
                vectors=np.asarray(vectors, dtype=np.float32).tolist()))

    def remove(self, labels: Iterable[int]) -> None:
        from qdrant_client import models

        ids = [int(label) for label in labels]
        if ids:
            self._client.delete(self.name, wait=True,
                                points_selector=models.PointIdsList(points=ids))

    def search(self, query: np.ndarray, k: int,
               allowed: Collection[int] | None = None) -> list[Hit]:
        from qdrant_client import models

        if k == 0 or (allowed is not None and not allowed):
            return []
        where = None if allowed is None else models.Filter(
            must=[models.HasIdCondition(has_id=[int(label) for label in allowed])])
        response = self._client.query_points(
            self.name, query=np.asarray(query, dtype=np.float32).tolist(), limit=k,
            query_filter=where, search_params=self._search_params,
            with_payload=False, with_vectors=False)
        return [(int(point.id), float(point.score)) for point in response.points]

    def vector(self, label: int) -> np.ndarray:
        records = self._client.retrieve(self.name, ids=[int(label)], with_vectors=True)
        if not records:
            raise KeyError(label)
        return np.asarray(records[0].vector, dtype=np.float32)

    def labels(self) -> set[int]:
        held: set[int] = set()
        offset = None
        while True:
            records, offset = self._client.scroll(self.name, limit=SCROLL_PAGE, offset=offset,
                                                  with_payload=False, with_vectors=False)
            held.update(int(record.id) for record in records)
            if offset is None:
                return held

    def save(self, path: Path) -> None:
        """Writes only which Qdrant collection holds the vectors (the server
        persists them)."""
        path.write_text(json.dumps({"qdrant_collection": self.name,
                                    "dimension": self.dimension}))


class QdrantBackend:
    """Qdrant collections as the indexes (:class:`~services.retriever.index.IndexBackend`).

    Args:
      url: ``http(s)://host:port`` of a Qdrant server (REST, port 6333), or
        qdrant-client's embedded local mode: ``:memory:`` or a directory.
      prefix: prepended to each retriever collection's name.
      hnsw_ef: the server's search-time candidate list size (as usearch's ef).
      api_key: for the server; default the ``QDRANT_API_KEY`` variable.
    """

    name = "qdrant"

    def __init__(self, url: str, *, prefix: str = "llmesh-", hnsw_ef: int = 128,
                 api_key: str | None = None) -> None:
        from qdrant_client import QdrantClient, models

        self.url = url
        self.prefix = prefix
        self.remote = url.startswith(("http://", "https://"))
        if self.remote:
            self.client = QdrantClient(url=url, api_key=api_key or os.environ.get(API_KEY_ENV))
            self._search_params: object | None = models.SearchParams(hnsw_ef=hnsw_ef)
        else:
            self.client = (QdrantClient(location=url) if url == ":memory:"
                           else QdrantClient(path=url))
            self._search_params = None

    def collection_name(self, collection: str) -> str:
        """The Qdrant collection of the retriever collection ``collection``."""
        return f"{self.prefix}{collection}"

    def create(self, collection: str, dimension: int) -> QdrantIndex:
        from qdrant_client import models

        name = self.collection_name(collection)
        if self.client.collection_exists(name):
            self.client.delete_collection(name)
        self.client.create_collection(name, vectors_config=models.VectorParams(
            size=dimension, distance=models.Distance.COSINE))
        return QdrantIndex(self.client, name, dimension, self._search_params)

    def load(self, path: Path, collection: str, dimension: int) -> QdrantIndex:
        saved = json.loads(path.read_text())
        name = saved["qdrant_collection"]
        if not self.client.collection_exists(name):
            raise ValueError(f"collection {collection!r}: its vectors were in Qdrant collection "
                             f"{name!r}, which {self.url} does not have")
        return QdrantIndex(self.client, name, saved["dimension"], self._search_params)

    def drop(self, collection: str) -> None:
        name = self.collection_name(collection)
        if self.client.collection_exists(name):
            self.client.delete_collection(name)
