"""``llmesh.v1.RetrieverService``: collections, ingest, query and embed.

The servicer validates each request once (:mod:`services.retriever.requests`),
runs the model and the chunker off the event loop (which keeps answering
health checks and cached queries meanwhile): ingest work on one thread, the
embedding of queries and ``Embed`` texts on another, so a query never waits
behind an ingest's batch. It owns the caches:

* ingest: chunks (:mod:`~services.retriever.chunker`) whose content hash is in
  the :class:`~services.retriever.caches.EmbeddingCache` are not embedded
  again; the rest are embedded in one batched call;
* delete (``DeleteDocuments``): the documents' vectors leave the index and
  their chunks the collection, whose version increases; the chunks' pins in
  the embedding cache are released and the collection's cached top-k dropped;
* query: the top-k result cache (key: cache scope, collection, version,
  normalised query, top_k, filter) answers first; else the query-embedding
  cache (key: cache scope, normalised query), else the model's query encoder;
  then the collection's index.

Statuses are the proto's (``proto/llmesh/v1/retriever.proto``); every RPC
answers UNAVAILABLE while the service drains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
import structlog
from google.protobuf import struct_pb2
from llmesh.v1 import retriever_pb2, retriever_pb2_grpc

from services.retriever.caches import EmbeddingCache, LruCache, ResultKey, content_hash
from services.retriever.chunker import chunk_text
from services.retriever.collection import (
    Chunk,
    Collection,
    PreparedDocument,
    SearchHit,
    UnknownFilterField,
)
from services.retriever.embedder import Embedder
from services.retriever.metrics import RetrieverMetrics, default_metrics
from services.retriever.requests import (
    DocumentInput,
    InvalidField,
    Limits,
    QuerySpec,
    parse_chunking,
    parse_document_ids,
    parse_documents,
    parse_name,
    parse_query,
    parse_texts,
)
from services.retriever.store import CollectionStore

log = structlog.get_logger()

SERVICE_NAME = retriever_pb2.DESCRIPTOR.services_by_name["RetrieverService"].full_name

T = TypeVar("T")
Request = TypeVar("Request")
Response = TypeVar("Response")


@dataclass(frozen=True)
class CacheSizes:
    """Entries each cache holds at most (0 turns a cache off)."""

    query_embeddings: int = 10_000
    results: int = 10_000
    loose_chunk_embeddings: int = 50_000


class RetrieverService(retriever_pb2_grpc.RetrieverServiceServicer):
    """The retriever servicer, run by :func:`services.common.server.run_service`.

    Args:
      load_embedder: loads the model (blocking; run on the worker thread at start).
      store: the collections and where they persist.
      limits: request limits.
      cache_sizes: capacities of the caches.
      save_interval_s: seconds between saves of changed collections.
      metrics: where to count (default: the process registry).
    """

    service_names = (SERVICE_NAME,)

    def __init__(self, load_embedder: Callable[[], Embedder], store: CollectionStore, *,
                 limits: Limits | None = None, cache_sizes: CacheSizes | None = None,
                 save_interval_s: float = 2.0, metrics: RetrieverMetrics | None = None) -> None:
        sizes = cache_sizes or CacheSizes()
        self.store = store
        self.limits = limits or Limits()
        self.embedder: Embedder | None = None
        self.chunk_embeddings = EmbeddingCache(sizes.loose_chunk_embeddings)
        # Keys: (cache scope, normalised query); see services.retriever.caches.
        self.query_embeddings: LruCache[tuple[str, str], np.ndarray] = LruCache(
            sizes.query_embeddings)
        self.results: LruCache[ResultKey, list[SearchHit]] = LruCache(sizes.results)
        self._load_embedder = load_embedder
        self._save_interval_s = save_interval_s
        self._metrics = metrics or default_metrics()
        # Ingest work (chunking, batch embedding, saves) and query work (a query
        # or Embed call's embedding) on two threads: a query never waits behind
        # an ingest's batch.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever-ingest")
        self._query_worker = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="retriever-query")
        self._mutating = asyncio.Lock()  # a save never sees a half-applied change
        self._saver: asyncio.Task[None] | None = None
        self._started = False
        self._draining = False

    # Service protocol -------------------------------------------------------

    def register(self, server: grpc.aio.Server) -> None:
        """Adds the servicer to ``server``."""
        retriever_pb2_grpc.add_RetrieverServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Loads the model and the persisted collections (SERVING after this).

        Raises:
          FileNotFoundError: the model package is missing.
          ValueError: a persisted collection does not fit the flags.
        """
        self.embedder = await self._on_worker(self._load_embedder)
        if self.embedder.dimension != self.store.dimension:
            raise ValueError(f"model dimension {self.embedder.dimension}, "
                             f"store expects {self.store.dimension}")
        collections = await self._on_worker(self.store.load_all)
        for collection in collections:
            for chunk in collection.chunks.values():
                self.chunk_embeddings.pin(chunk.digest, collection.index.vector(chunk.label))
            self._count_chunks(collection)
        self._metrics.collections.set(len(self.store.collections))
        self._saver = asyncio.create_task(self._save_periodically())
        self._started = True
        log.info("retriever_ready", model=self.embedder.model_id, backend=self.store.backend.name,
                 data_dir=str(self.store.data_dir), collections=len(collections),
                 chunks=sum(len(c.chunks) for c in collections))

    async def drain(self) -> None:
        """New calls get UNAVAILABLE from now on; changed collections are saved."""
        self._draining = True
        await self._save()

    async def close(self) -> None:
        """Saves what changed and stops the worker thread."""
        if self._saver is not None:
            self._saver.cancel()
        await self._save()
        self._worker.shutdown(wait=True)
        self._query_worker.shutdown(wait=True)

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._save_interval_s)
            await self._save()

    async def _save(self) -> None:
        async with self._mutating:
            saved = await self._on_worker(self.store.save_dirty)
        if saved:
            log.debug("collections_saved", collections=saved)

    async def _on_worker(self, work: Callable[[], T], *, query: bool = False) -> T:
        """Runs blocking ``work`` on the ingest thread (or the query thread)."""
        worker = self._query_worker if query else self._worker
        return await asyncio.get_running_loop().run_in_executor(worker, work)

    # RPCs ---------------------------------------------------------------------

    async def CreateCollection(self, request: retriever_pb2.CreateCollectionRequest,
                               context: grpc.aio.ServicerContext
                               ) -> retriever_pb2.CreateCollectionResponse:
        return await self._call("CreateCollection", self._create, request, context)

    async def DeleteCollection(self, request: retriever_pb2.DeleteCollectionRequest,
                               context: grpc.aio.ServicerContext
                               ) -> retriever_pb2.DeleteCollectionResponse:
        return await self._call("DeleteCollection", self._delete, request, context)

    async def ListCollections(self, request: retriever_pb2.ListCollectionsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> retriever_pb2.ListCollectionsResponse:
        return await self._call("ListCollections", self._list, request, context)

    async def Ingest(self, request: retriever_pb2.IngestRequest,
                     context: grpc.aio.ServicerContext) -> retriever_pb2.IngestResponse:
        return await self._call("Ingest", self._ingest, request, context)

    async def DeleteDocuments(self, request: retriever_pb2.DeleteDocumentsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> retriever_pb2.DeleteDocumentsResponse:
        return await self._call("DeleteDocuments", self._delete_documents, request, context)

    async def Query(self, request: retriever_pb2.QueryRequest,
                    context: grpc.aio.ServicerContext) -> retriever_pb2.QueryResponse:
        return await self._call("Query", self._query, request, context)

    async def Embed(self, request: retriever_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> retriever_pb2.EmbedResponse:
        return await self._call("Embed", self._embed_texts, request, context)

    async def _call(self, method: str, handler: Callable[[Request], Awaitable[Response]],
                    request: Request, context: grpc.aio.ServicerContext) -> Response:
        """Runs ``handler``; its :class:`InvalidField` becomes the call's status.
        UNAVAILABLE before :meth:`start` finished (model and collections
        loading: a collection is not yet known, not absent) and while draining."""
        if self._draining or not self._started:
            self._metrics.requests.labels(method, grpc.StatusCode.UNAVAILABLE.name).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "retriever is draining"
                                if self._draining else "retriever is starting")
        try:
            response = await handler(request)
        except InvalidField as refused:
            self._metrics.requests.labels(method, refused.code.name).inc()
            await context.abort(refused.code, str(refused))
        self._metrics.requests.labels(method, grpc.StatusCode.OK.name).inc()
        return response

    def _collection(self, name: str, field: str) -> Collection:
        collection = self.store.collections.get(parse_name(name, field))
        if collection is None:
            raise InvalidField(field, f"no collection {name!r}", grpc.StatusCode.NOT_FOUND)
        return collection

    async def _create(self, request: retriever_pb2.CreateCollectionRequest
                      ) -> retriever_pb2.CreateCollectionResponse:
        name = parse_name(request.name)
        chunking = parse_chunking(request, self.limits)
        if name in self.store.collections:
            raise InvalidField("name", f"collection {name!r} exists",
                               grpc.StatusCode.ALREADY_EXISTS)
        async with self._mutating:
            collection = await self._on_worker(lambda: self.store.create(name, chunking))
        self._metrics.collections.set(len(self.store.collections))
        self._count_chunks(collection)
        return retriever_pb2.CreateCollectionResponse(collection=self._info(collection))

    async def _delete(self, request: retriever_pb2.DeleteCollectionRequest
                      ) -> retriever_pb2.DeleteCollectionResponse:
        collection = self._collection(request.name, "name")
        async with self._mutating:
            await self._on_worker(lambda: self.store.delete(collection.name))
        for chunk in collection.chunks.values():
            self.chunk_embeddings.unpin(chunk.digest)
        self.results.drop(lambda key: key.collection == collection.name)
        self._metrics.collections.set(len(self.store.collections))
        self._metrics.chunks.remove(collection.name)
        return retriever_pb2.DeleteCollectionResponse()

    async def _list(self, _: retriever_pb2.ListCollectionsRequest
                    ) -> retriever_pb2.ListCollectionsResponse:
        return retriever_pb2.ListCollectionsResponse(collections=[
            self._info(collection) for _, collection in sorted(self.store.collections.items())])

    async def _ingest(self, request: retriever_pb2.IngestRequest
                      ) -> retriever_pb2.IngestResponse:
        collection = self._collection(request.collection, "collection")
        documents = parse_documents(request, self.limits)
        prepared, embedded = await self._prepare(collection, documents)
        if self.store.collections.get(collection.name) is not collection:
            raise InvalidField("collection", f"collection {collection.name!r} was deleted",
                               grpc.StatusCode.NOT_FOUND)
        async with self._mutating:
            added, removed = collection.replace(prepared)
            self.store.mark_dirty(collection.name)
        for chunk, vector in zip(added, (v for d in prepared for v in d.vectors), strict=True):
            self.chunk_embeddings.pin(chunk.digest, vector)
        self._forget_chunks(collection, removed)
        return retriever_pb2.IngestResponse(documents=len(prepared), chunks=len(added),
                                            chunks_embedded=embedded,
                                            version=collection.version)

    async def _delete_documents(self, request: retriever_pb2.DeleteDocumentsRequest
                                ) -> retriever_pb2.DeleteDocumentsResponse:
        """Removes documents (:meth:`Collection.delete`); the collection is saved
        without them at the next save, and its cached top-k results drop."""
        collection = self._collection(request.collection, "collection")
        document_ids = parse_document_ids(request)
        async with self._mutating:
            try:
                deleted, removed, absent = collection.delete(document_ids)
            finally:
                self.store.mark_dirty(collection.name)
        self._forget_chunks(collection, removed)
        return retriever_pb2.DeleteDocumentsResponse(
            documents=len(deleted), chunks=len(removed), not_found=absent,
            version=collection.version)

    def _forget_chunks(self, collection: Collection, removed: list[Chunk]) -> None:
        """After chunks left ``collection``: their embedding-cache pins released,
        the collection's cached top-k results dropped, its chunk gauge set."""
        for chunk in removed:
            self.chunk_embeddings.unpin(chunk.digest)
        self.results.drop(lambda key: key.collection == collection.name)
        self._count_chunks(collection)

    async def _prepare(self, collection: Collection, documents: list[DocumentInput]
                       ) -> tuple[list[PreparedDocument], int]:
        """Chunks the documents and finds each chunk's vector: from the
        embedding cache, else embedded now (one batch for all, each distinct
        text once). Returns the documents and how many texts were embedded."""
        embedder = self._ready_embedder()
        texts = await self._on_worker(lambda: [
            chunk_text(d.text, embedder.tokenizer, collection.chunking) for d in documents])
        digests = [[content_hash(embedder.model_id, text) for text in chunks] for chunks in texts]
        # Cached vectors are taken now: a delete during the embedding below
        # may unpin (and the LRU evict) them.
        found: dict[str, np.ndarray] = {}
        missing: dict[str, str] = {}
        for chunks, hashes in zip(texts, digests, strict=True):
            for text, digest in zip(chunks, hashes, strict=True):
                vector = found.get(digest)
                if vector is None and digest not in missing:
                    vector = self.chunk_embeddings.get(digest)
                self._metrics.cache_lookup("chunk_embedding", vector is not None)
                if vector is None:
                    missing[digest] = text
                else:
                    found[digest] = vector
        found.update(zip(missing, await self._embed(list(missing.values()), "ingest"),
                         strict=True))
        prepared = []
        for document, chunks, hashes in zip(documents, texts, digests, strict=True):
            vectors = [found[h] for h in hashes]
            prepared.append(PreparedDocument(
                document.id, document.metadata, chunks, hashes,
                np.stack(vectors) if vectors else np.empty((0, embedder.dimension), np.float32)))
        return prepared, len(missing)

    async def _query(self, request: retriever_pb2.QueryRequest) -> retriever_pb2.QueryResponse:
        began = time.perf_counter()
        spec = parse_query(request, self.limits)
        collection = self._collection(spec.collection, "collection")
        key = ResultKey(spec.cache_scope, collection.name, collection.version, spec.query,
                        spec.top_k, spec.where_key)
        hits = self.results.get(key)
        self._metrics.cache_lookup("result", hits is not None)
        embed_s = search_s = 0.0
        cache_hit = hits is not None
        if hits is None:
            vector, embed_s = await self._query_vector(spec)
            searched = time.perf_counter()
            hits = self._search(collection, vector, spec)
            search_s = time.perf_counter() - searched
            self._metrics.query_stage.labels("search").observe(search_s)
            self.results.put(ResultKey(spec.cache_scope, collection.name, collection.version,
                                       spec.query, spec.top_k, spec.where_key), hits)
        total_s = time.perf_counter() - began
        self._metrics.query_stage.labels("total").observe(total_s)
        return retriever_pb2.QueryResponse(
            chunks=[_chunk_message(hit) for hit in hits], version=collection.version,
            timing=retriever_pb2.RetrievalTiming(
                embed_ms=embed_s * 1e3, search_ms=search_s * 1e3,
                cache_hit=cache_hit, total_ms=total_s * 1e3))

    async def _query_vector(self, spec: QuerySpec) -> tuple[np.ndarray, float]:
        """The query's embedding and the seconds spent embedding it (0 on a cache hit)."""
        vector = self.query_embeddings.get((spec.cache_scope, spec.query))
        self._metrics.cache_lookup("query_embedding", vector is not None)
        if vector is not None:
            return vector, 0.0
        began = time.perf_counter()
        vector = (await self._embed([spec.query], "query"))[0]
        embed_s = time.perf_counter() - began
        self._metrics.query_stage.labels("embed").observe(embed_s)
        self.query_embeddings.put((spec.cache_scope, spec.query), vector)
        return vector, embed_s

    @staticmethod
    def _search(collection: Collection, vector: np.ndarray, spec: QuerySpec) -> list[SearchHit]:
        try:
            return collection.search(vector, spec.top_k, spec.where)
        except UnknownFilterField as unknown:
            raise InvalidField(f"filter.{unknown.field}", "no document of collection "
                               f"{collection.name!r} has this field") from unknown

    async def _embed_texts(self, request: retriever_pb2.EmbedRequest
                           ) -> retriever_pb2.EmbedResponse:
        texts = parse_texts(request, self.limits)
        embedder = self._ready_embedder()
        vectors = await self._embed(texts, "embed")
        tokens = await self._on_worker(lambda: sum(embedder.count_tokens(t) for t in texts),
                                       query=True)
        return retriever_pb2.EmbedResponse(
            embeddings=[retriever_pb2.Embedding(values=vector.tolist()) for vector in vectors],
            model=embedder.model_id, prompt_tokens=tokens)

    async def _embed(self, texts: list[str], caller: str) -> np.ndarray:
        """Embeds ``texts`` on the worker thread, counting the batch; ``caller`` "query"
        (one text) takes the query encoder (:meth:`Embedder.embed_query`)."""
        embedder = self._ready_embedder()
        if not texts:
            return np.empty((0, embedder.dimension), dtype=np.float32)
        began = time.perf_counter()
        if caller == "query":
            vectors = (await self._on_worker(lambda: embedder.embed_query(texts[0]),
                                             query=True))[np.newaxis]
        else:
            vectors = await self._on_worker(lambda: embedder.embed(texts),
                                            query=caller != "ingest")
        self._metrics.embed_seconds.labels(caller).inc(time.perf_counter() - began)
        self._metrics.embedded_texts.labels(caller).inc(len(texts))
        self._metrics.embed_batch_size.observe(len(texts))
        return vectors

    def _ready_embedder(self) -> Embedder:
        if self.embedder is None:
            raise InvalidField("", "the embedding model is loading", grpc.StatusCode.UNAVAILABLE)
        return self.embedder

    def _count_chunks(self, collection: Collection) -> None:
        self._metrics.chunks.labels(collection.name).set(len(collection.chunks))

    def _info(self, collection: Collection) -> retriever_pb2.CollectionInfo:
        return retriever_pb2.CollectionInfo(
            name=collection.name, documents=len(collection.documents),
            chunks=len(collection.chunks), version=collection.version,
            chunking=retriever_pb2.ChunkingOptions(
                chunk_tokens=collection.chunking.chunk_tokens,
                overlap_tokens=collection.chunking.overlap_tokens),
            embedding_model=self.embedder.model_id if self.embedder else "",
            dimension=self.store.dimension)


def _chunk_message(hit: SearchHit) -> retriever_pb2.RetrievedChunk:
    metadata = struct_pb2.Struct()
    metadata.update(dict(hit.metadata))
    return retriever_pb2.RetrievedChunk(
        chunk_id=hit.chunk.chunk_id, document_id=hit.chunk.document_id, text=hit.chunk.text,
        score=hit.score, metadata=metadata)
