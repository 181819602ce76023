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

#: Prefix-index lookup buckets in seconds: the embedded index scores a prompt in
#: tens of microseconds, Redis in one loopback round trip (~0.1-0.3 ms).
LOOKUP_BUCKETS_SECONDS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 1.0,
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
        0 after a failure until it answers again (the response store and the
        prefix index on Redis share ``backend="redis"``).
      kv_index_blocks: ``llmesh:kv_index_blocks{replica}``, entries the prefix
        index holds for a replica, set after each of this process's mutations
        and by ``sizes()``; the label is removed when the replica is dropped or
        this process sees it expired.
      kv_index_lookup: ``llmesh:kv_index_lookup_seconds``, time of one prefix
        ``score`` in seconds (a Redis round trip included).
      kv_events_received: ``llmesh:kv_events_received_total{replica}``, KV events
        received from a replica (counted by the service).
      kv_events_dropped: ``llmesh:kv_events_dropped_total{replica}``, KV events a
        replica reported it dropped (counted by the service).
      kv_index_resyncs: ``llmesh:kv_index_resyncs_total{replica,reason}``, publish
        calls (replace / apply / heartbeat) the index refused, each asking the
        publisher for a snapshot; reason ``stale_epoch``, ``not_registered``
        (unknown or expired), ``capacity`` or ``backend`` (store down).
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
            **_kv_index_metrics(registry),
        )


def _kv_index_metrics(registry: CollectorRegistry) -> dict[str, Gauge | Histogram | Counter]:
    """The prefix index's metrics (:mod:`services.cache.prefix_index`), by field name."""
    return {
        "kv_index_blocks": Gauge("llmesh:kv_index_blocks",
                                 "Prefix-index entries (KV block hashes) held per replica.",
                                 ["replica"], registry=registry),
        "kv_index_lookup": Histogram("llmesh:kv_index_lookup_seconds",
                                     "Prefix-index score time in seconds.",
                                     buckets=LOOKUP_BUCKETS_SECONDS, registry=registry),
        "kv_events_received": Counter("llmesh:kv_events_received",
                                      "KV events received from engine replicas.",
                                      ["replica"], registry=registry),
        "kv_events_dropped": Counter("llmesh:kv_events_dropped",
                                     "KV events engine replicas reported dropped.",
                                     ["replica"], registry=registry),
        "kv_index_resyncs": Counter("llmesh:kv_index_resyncs",
                                    "Publish calls the prefix index refused (a snapshot is due).",
                                    ["replica", "reason"], registry=registry),
    }


@functools.cache
def default_metrics() -> CacheMetrics:
    """The metrics in the process-wide registry that ``/metrics`` serves."""
    return CacheMetrics.create(prometheus_client.REGISTRY)
