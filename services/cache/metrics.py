"""Prometheus metrics of the cache service.

One :class:`CacheMetrics` per registry: the process-wide default
(:func:`default_metrics`, registered on first use, never at import) serves
``/metrics``; tests pass their own ``CollectorRegistry`` to read exact values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Request latency buckets in seconds: the cache answers in well under a millisecond.
LATENCY_BUCKETS_SECONDS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)


@dataclass(frozen=True)
class CacheMetrics:
    """The cache service's metrics.

    Attributes:
      registry: where the metrics are registered.
      queries: ``llmesh:response_cache_queries_total``, lookups of cacheable
        (deterministic) requests that reached the store.
      hits: ``llmesh:response_cache_hits_total``, lookups that found a response.
      stores: ``llmesh:response_cache_stores_total``, responses written to the store.
      request_duration: ``llmesh:cache_request_duration_seconds{method}``, handler
        time of each RPC in seconds (``GetCachedResponse``, ``PutCachedResponse``).
      backend_errors: ``llmesh:cache_backend_errors_total{backend,operation}``,
        failed store calls (each degraded to a miss or not-stored).
      backend_up: ``llmesh:cache_backend_up{backend}``, 1 while the store answers,
        0 after a failure until it answers again.
    """

    registry: CollectorRegistry
    queries: Counter
    hits: Counter
    stores: Counter
    request_duration: Histogram
    backend_errors: Counter
    backend_up: Gauge
    kv_index_blocks: Gauge
    kv_index_lookup: Histogram
    kv_events_received: Counter
    kv_events_dropped: Counter
    kv_index_resyncs: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> CacheMetrics:
        """Registers the metrics in ``registry`` (once per registry)."""
        return cls(
            registry=registry,
            queries=Counter("llmesh:response_cache_queries",
                            "Response-cache lookups of deterministic requests.",
                            registry=registry),
            hits=Counter("llmesh:response_cache_hits", "Response-cache lookups that hit.",
                         registry=registry),
            stores=Counter("llmesh:response_cache_stores", "Responses stored in the cache.",
                           registry=registry),
            request_duration=Histogram(
                "llmesh:cache_request_duration_seconds",
                "Cache service RPC handling time in seconds.", ["method"],
                buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
            backend_errors=Counter(
                "llmesh:cache_backend_errors",
                "Failed calls to the cache's backend store (degraded to miss / not stored).",
                ["backend", "operation"], registry=registry),
            backend_up=Gauge("llmesh:cache_backend_up",
                             "1 while the backend store answers, 0 after a failure.",
                             ["backend"], registry=registry),
            kv_index_blocks=Gauge("llmesh:kv_index_blocks",
                                  "Block hashes the prefix index holds per replica.",
                                  ["replica"], registry=registry),
            kv_index_lookup=Histogram("llmesh:kv_index_lookup_seconds",
                                      "ScorePrefix lookups in the prefix index.",
                                      buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
            kv_events_received=Counter("llmesh:kv_events_received",
                                       "KV events received from engines.", ["replica"],
                                       registry=registry),
            kv_events_dropped=Counter("llmesh:kv_events_dropped",
                                      "KV events engines reported dropped.", ["replica"],
                                      registry=registry),
            kv_index_resyncs=Counter("llmesh:kv_index_resyncs",
                                     "Times the index lost a replica's entries and asked "
                                     "for a snapshot.", ["replica", "reason"],
                                     registry=registry),
        )


@functools.cache
def default_metrics() -> CacheMetrics:
    """The metrics in the process-wide registry that ``/metrics`` serves."""
    return CacheMetrics.create(prometheus_client.REGISTRY)
