"""Prometheus metrics of the retriever service (``llmesh:retriever_*``).

One :class:`RetrieverMetrics` per registry: the process-wide default
(:func:`default_metrics`, registered on first use) serves ``/metrics``;
tests pass their own ``CollectorRegistry``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Stage latency buckets in seconds: a cached top-k in tens of microseconds,
#: a query embedding in milliseconds, an ingest batch in seconds.
LATENCY_BUCKETS_SECONDS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
#: Texts per embedding call.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class RetrieverMetrics:
    """The retriever's metrics.

    Attributes:
      query_stage: ``llmesh:retriever_query_stage_seconds{stage}``, time of each
        query stage: ``embed`` (query embedding, cache misses only),
        ``search`` (index search, result-cache misses only), ``total``.
      cache_queries: ``llmesh:retriever_cache_queries_total{cache}``, lookups of
        the ``query_embedding``, ``result`` and ``chunk_embedding`` caches.
      cache_hits: ``llmesh:retriever_cache_hits_total{cache}``, of those, hits.
      embed_batch_size: ``llmesh:retriever_embedding_batch_size``, texts per
        call of the model (ingest, query and Embed).
      embedded_texts: ``llmesh:retriever_embedded_texts_total{caller}``, texts
        the model embedded (``ingest``, ``query``, ``embed``); with
        ``embed_seconds`` it gives the throughput.
      embed_seconds: ``llmesh:retriever_embedding_seconds_total{caller}``, time
        the model spent embedding.
      chunks: ``llmesh:retriever_chunks{collection}``, chunks held.
      collections: ``llmesh:retriever_collections``, collections held.
      requests: ``llmesh:retriever_requests_total{method,code}``, RPCs by status.
    """

    registry: CollectorRegistry
    query_stage: Histogram
    cache_queries: Counter
    cache_hits: Counter
    embed_batch_size: Histogram
    embedded_texts: Counter
    embed_seconds: Counter
    chunks: Gauge
    collections: Gauge
    requests: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RetrieverMetrics:
        """Registers the metrics in ``registry`` (once per registry)."""
        return cls(
            registry=registry,
            query_stage=Histogram("llmesh:retriever_query_stage_seconds",
                                  "Retriever query time by stage in seconds.", ["stage"],
                                  buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
            cache_queries=Counter("llmesh:retriever_cache_queries",
                                  "Retriever cache lookups.", ["cache"], registry=registry),
            cache_hits=Counter("llmesh:retriever_cache_hits",
                               "Retriever cache lookups that hit.", ["cache"],
                               registry=registry),
            embed_batch_size=Histogram("llmesh:retriever_embedding_batch_size",
                                       "Texts per call of the embedding model.",
                                       buckets=BATCH_BUCKETS, registry=registry),
            embedded_texts=Counter("llmesh:retriever_embedded_texts",
                                   "Texts the embedding model embedded.", ["caller"],
                                   registry=registry),
            embed_seconds=Counter("llmesh:retriever_embedding_seconds",
                                  "Seconds the embedding model spent embedding.", ["caller"],
                                  registry=registry),
            chunks=Gauge("llmesh:retriever_chunks", "Chunks held per collection.",
                         ["collection"], registry=registry),
            collections=Gauge("llmesh:retriever_collections", "Collections held.",
                              registry=registry),
            requests=Counter("llmesh:retriever_requests", "Retriever RPCs by status code.",
                             ["method", "code"], registry=registry),
        )

    def cache_lookup(self, cache: str, hit: bool) -> None:
        """Counts one lookup of ``cache``."""
        self.cache_queries.labels(cache).inc()
        if hit:
            self.cache_hits.labels(cache).inc()


@functools.cache
def default_metrics() -> RetrieverMetrics:
    """The metrics in the process-wide registry that ``/metrics`` serves."""
    return RetrieverMetrics.create(prometheus_client.REGISTRY)
