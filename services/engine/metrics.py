"""Prometheus metrics of the engine, named after vLLM's where the concept matches.

One :class:`EngineMetrics` per process in production (default registry, served
on ``--metrics-port`` by the server kit); tests pass their own registry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.sampling import FinishReason
from services.engine.types import (BlockCounts, EngineResources, LoadStats, OffloadStats,
                                  StepStats, TokenDelta)

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5, 5.0)
#: vLLM's buckets for tokens per step, cut at 8192.
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_RESTORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0)


class EngineMetrics:
    """The engine's metrics.

    Metrics (all prefixed ``llmesh:``): ``num_requests_running``,
    ``num_requests_waiting``, ``kv_cache_usage_perc`` (gauges, read from the
    backend's ``load()`` at scrape time); ``prompt_tokens_total``,
    ``generation_tokens_total`` (counters); ``request_success_total`` by
    ``finished_reason`` (stop, length, cancelled, error);
    ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (counters,
    prompt tokens looked up in / found in the prefix cache);
    ``prompt_tokens_computed_total`` (counter: prompt tokens the forwards
    computed, once per request whatever its ``sampling.n``, prefix-cache hits
    left out, recomputations after a preemption counted);
    ``prompt_tokens_deferred_by_priority_total`` (counter: prompt tokens of
    lower priorities a step held back beside a higher-priority decode or
    prompt, computed in later steps; docs/engine.md's scheduler);
    ``num_preemptions_total`` (counter); and histograms of each engine step:
    ``engine_step_duration_seconds``, ``iteration_tokens_total`` (tokens
    computed, vLLM's name) and ``batch_size`` (sequences in the step).
    Speculative decoding (vLLM's names, counters): ``spec_decode_num_drafts``
    (sequences whose proposals a step scored), ``spec_decode_num_draft_tokens``,
    ``spec_decode_num_accepted_tokens`` and
    ``spec_decode_num_accepted_tokens_per_pos`` by ``position`` (0-based);
    mean acceptance length = 1 + accepted / drafts. Suffix decoding's cache
    of earlier outputs (gauges): ``spec_decode_suffix_cache_tokens`` and
    ``spec_decode_suffix_cache_bytes`` (estimated memory).
    The KV offload tier (``--kv-offload-bytes``; counters in blocks):
    ``kv_offload_queries_total`` (prompt blocks the pool missed, looked up in
    the tier), ``kv_offload_hits_total`` (found there; hit rate = hits /
    queries), ``kv_offload_stored_blocks_total`` (copied in from the pool),
    ``kv_offload_restored_blocks_total`` (copied back), and
    ``kv_offload_evicted_blocks_total`` (dropped by its LRU); gauges
    ``kv_offload_bytes`` (held) and ``kv_offload_capacity_bytes`` (set at
    start, :meth:`EngineMetrics.observe_resources`); histogram
    ``kv_offload_restore_seconds`` (one sequence's restore). Block
    bookkeeping (gauges read at scrape time from the backend's integrity
    check, -1 when it fails): ``kv_cache_blocks{state}`` (free, cached,
    used) and ``kv_cache_num_blocks``; after a run, idle, used == 0 and
    free + cached == num_blocks (no leaked block).
    CPU contention
    (the torch engine's thread governor, docs/engine.md): ``engine_num_threads``
    (gauge: the step's compute threads, from start: the governor's ceiling, or
    ``--num-threads`` without it), ``cpu_throttled_seconds_total``
    (counter: time the cgroup's CPU quota held the engine back) and
    ``cpu_contention_events_total`` (counter: threads dropped because the
    engine's threads waited for cores).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else prometheus_client.REGISTRY
        self.registry = registry
        self.num_requests_running = Gauge(
            "llmesh:num_requests_running", "Sequences in the running batch.", registry=registry)
        self.num_requests_waiting = Gauge(
            "llmesh:num_requests_waiting", "Sequences admitted but not yet running.",
            registry=registry)
        self.kv_cache_usage = Gauge(
            "llmesh:kv_cache_usage_perc", "Fraction of KV cache in use, 0..1.", registry=registry)
        self.prompt_tokens = Counter(
            "llmesh:prompt_tokens", "Prompt tokens prefilled.", registry=registry)
        self.prompt_tokens_computed = Counter(
            "llmesh:prompt_tokens_computed",
            "Prompt tokens whose keys/values the engine computed.", registry=registry)
        self.prompt_tokens_deferred = Counter(
            "llmesh:prompt_tokens_deferred_by_priority",
            "Prompt tokens of lower priorities held back from a step beside a "
            "higher-priority decode or prompt (computed in later steps).", registry=registry)
        self.generation_tokens = Counter(
            "llmesh:generation_tokens", "Tokens generated.", registry=registry)
        self.request_success = Counter(
            "llmesh:request_success", "Finished requests by finish reason.",
            ["finished_reason"], registry=registry)
        self.step_duration = Histogram(
            "llmesh:engine_step_duration_seconds", "Duration of one engine step.",
            buckets=_STEP_BUCKETS, registry=registry)
        self.iteration_tokens = Histogram(
            "llmesh:iteration_tokens_total", "Tokens computed per engine step.",
            buckets=_TOKEN_BUCKETS, registry=registry)
        self.batch_size = Histogram(
            "llmesh:batch_size", "Sequences computing tokens per engine step.",
            buckets=_BATCH_BUCKETS, registry=registry)
        self.prefix_cache_queries = Counter(
            "llmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            registry=registry)
        self.prefix_cache_hits = Counter(
            "llmesh:prefix_cache_hits", "Prompt tokens found computed in the prefix cache.",
            registry=registry)
        self.num_preemptions = Counter(
            "llmesh:num_preemptions", "Sequences preempted (blocks freed, recomputed later).",
            registry=registry)
        self.spec_decode_num_drafts = Counter(
            "llmesh:spec_decode_num_drafts", "Speculative drafts scored (sequences x steps).",
            registry=registry)
        self.spec_decode_num_draft_tokens = Counter(
            "llmesh:spec_decode_num_draft_tokens", "Speculative tokens proposed and scored.",
            registry=registry)
        self.spec_decode_num_accepted_tokens = Counter(
            "llmesh:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
            registry=registry)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "llmesh:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the draft (0-based).",
            ["position"], registry=registry)
        self.spec_decode_suffix_cache_tokens = Gauge(
            "llmesh:spec_decode_suffix_cache_tokens",
            "Tokens of earlier outputs held by the suffix decoding cache.", registry=registry)
        self.spec_decode_suffix_cache_bytes = Gauge(
            "llmesh:spec_decode_suffix_cache_bytes",
            "Estimated bytes held by the suffix decoding cache (ring and index).",
            registry=registry)
        self.engine_num_threads = Gauge(
            "llmesh:engine_num_threads", "Compute threads of the engine's step.",
            registry=registry)
        self.cpu_throttled_seconds = Counter(
            "llmesh:cpu_throttled_seconds", "Seconds the cgroup's CPU quota held the engine back.",
            registry=registry)
        self.cpu_contention_events = Counter(
            "llmesh:cpu_contention_events",
            "Threads dropped because the engine's threads waited for cores.", registry=registry)
        self.kv_events_published = Counter(
            "llmesh:kv_events_published", "KV cache events sent to the prefix index.",
            registry=registry)
        self.kv_events_dropped = Counter(
            "llmesh:kv_event_buffer_dropped",
            "KV cache events dropped undrained (bounded buffer full); a snapshot follows.",
            registry=registry)
        self.kv_event_snapshots = Counter(
            "llmesh:kv_event_snapshots", "Snapshots of the prefix cache sent to the index, "
            "by reason (connect, reconnect, resync, dropped).", ["reason"], registry=registry)

        self.kv_offload_queries = Counter(
            "llmesh:kv_offload_queries",
            "Prompt KV blocks the pool missed, looked up in the offload tier.",
            registry=registry)
        self.kv_offload_hits = Counter(
            "llmesh:kv_offload_hits", "KV blocks found in the offload tier (then restored).",
            registry=registry)
        self.kv_offload_stored_blocks = Counter(
            "llmesh:kv_offload_stored_blocks",
            "KV blocks copied into the offload tier (evicted from the pool).", registry=registry)
        self.kv_offload_restored_blocks = Counter(
            "llmesh:kv_offload_restored_blocks",
            "KV blocks copied from the offload tier back into the pool.", registry=registry)
        self.kv_offload_evicted_blocks = Counter(
            "llmesh:kv_offload_evicted_blocks", "KV blocks dropped by the offload tier's LRU.",
            registry=registry)
        self.kv_offload_bytes = Gauge(
            "llmesh:kv_offload_bytes", "Bytes of KV blocks held by the offload tier.",
            registry=registry)
        self.kv_offload_capacity_bytes = Gauge(
            "llmesh:kv_offload_capacity_bytes", "Capacity of the KV offload tier in bytes.",
            registry=registry)
        self.kv_offload_restore_seconds = Histogram(
            "llmesh:kv_offload_restore_seconds",
            "Seconds to copy one sequence's blocks from the offload tier into the pool.",
            buckets=_RESTORE_BUCKETS, registry=registry)
        self.kv_cache_blocks = Gauge(
            "llmesh:kv_cache_blocks", "KV blocks by state: free, cached (prefix cache, "
            "unused), used (held by sequences); -1 when the bookkeeping is inconsistent.",
            ["state"], registry=registry)
        self.kv_cache_num_blocks = Gauge(
            "llmesh:kv_cache_num_blocks", "KV blocks in the pool (-1: bookkeeping inconsistent).",
            registry=registry)

    def track_blocks(self, counts: Callable[[], BlockCounts | None]) -> None:
        """Makes the block gauges read ``counts()`` at each scrape (None: -1 each)."""
        for state in ("free", "cached", "used", "total"):
            gauge = (self.kv_cache_num_blocks if state == "total"
                     else self.kv_cache_blocks.labels(state=state))
            gauge.set_function(functools.partial(_count, counts, state))

    def track_load(self, load: Callable[[], LoadStats]) -> None:
        """Makes the load gauges read ``load()`` at each scrape."""
        self.num_requests_running.set_function(lambda: load().num_running)
        self.num_requests_waiting.set_function(lambda: load().num_waiting)
        self.kv_cache_usage.set_function(lambda: load().kv_cache_usage)

    def observe_resources(self, resources: EngineResources) -> None:
        """Sets the gauges of what the engine runs on, once it has started (the
        thread count then follows each step's ``StepStats.num_threads``)."""
        self.engine_num_threads.set(resources.num_threads)
        self.kv_offload_capacity_bytes.set(resources.kv_offload_capacity_bytes)

    def observe_step(self, stats: StepStats) -> None:
        """Records one engine step (thread-safe; called on the engine thread)."""
        self.step_duration.observe(stats.duration_s)
        self.iteration_tokens.observe(stats.num_scheduled_tokens)
        self.batch_size.observe(stats.batch_size)
        if stats.num_prompt_tokens_computed:
            self.prompt_tokens_computed.inc(stats.num_prompt_tokens_computed)
        if stats.num_prompt_tokens_deferred:
            self.prompt_tokens_deferred.inc(stats.num_prompt_tokens_deferred)
        if stats.prefix_queries:
            self.prefix_cache_queries.inc(stats.prefix_queries)
            self.prefix_cache_hits.inc(stats.prefix_hits)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.offload is not None:
            self._observe_offload(stats.offload)
        self.spec_decode_suffix_cache_tokens.set(stats.suffix_cache_tokens)
        self.spec_decode_suffix_cache_bytes.set(stats.suffix_cache_bytes)
        if stats.num_threads:
            self.engine_num_threads.set(stats.num_threads)
        if stats.cpu_throttled_s:
            self.cpu_throttled_seconds.inc(stats.cpu_throttled_s)
        if stats.contention_events:
            self.cpu_contention_events.inc(stats.contention_events)
        if stats.spec_num_drafts:
            self.spec_decode_num_drafts.inc(stats.spec_num_drafts)
            self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
            for position, count in enumerate(stats.spec_accepted_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(position=str(position)).inc(
                    count)

    def _observe_offload(self, stats: OffloadStats) -> None:
        self.kv_offload_queries.inc(stats.queries)
        self.kv_offload_hits.inc(stats.hits)
        self.kv_offload_stored_blocks.inc(stats.stored)
        self.kv_offload_restored_blocks.inc(stats.restored)
        self.kv_offload_evicted_blocks.inc(stats.evicted)
        self.kv_offload_bytes.set(stats.num_bytes)
        for seconds in stats.restore_seconds:
            self.kv_offload_restore_seconds.observe(seconds)

    def observe_delta(self, delta: TokenDelta, first: bool, last: bool | None = None) -> None:
        """Counts a delta's tokens; ``first`` marks a request's first delta (its
        prompt was prefilled); ``last`` its last (default: the delta finishes;
        with ``sampling.n`` > 1 only the last choice's last), which counts the
        request by finish reason."""
        if first and delta.num_generated_tokens:
            self.prompt_tokens.inc(delta.num_prompt_tokens)
        self.generation_tokens.inc(len(delta.token_ids))
        if delta.finished if last is None else last:
            self.request_success.labels(finished_reason=delta.finish_reason.name.lower()).inc()

    def observe_unseen_end(self, reason: FinishReason) -> None:
        """Counts a request whose last delta was never read (the client dropped the
        call, so the engine cancelled it; or the stream failed) by ``reason``."""
        self.request_success.labels(finished_reason=reason.name.lower()).inc()


def _count(counts: Callable[[], BlockCounts | None], state: str) -> float:
    found = counts()
    return -1.0 if found is None else float(getattr(found, state))


@functools.cache
def default_metrics() -> EngineMetrics:
    """The process-wide metrics on Prometheus' default registry (created once)."""
    return EngineMetrics()
