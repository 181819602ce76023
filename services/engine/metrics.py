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
from services.engine.types import LoadStats, StepStats, TokenDelta

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5, 5.0)
#: vLLM's buckets for tokens per step, cut at 8192.
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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
    ``num_preemptions_total`` (counter); and histograms of each engine step:
    ``engine_step_duration_seconds``, ``iteration_tokens_total`` (tokens
    computed, vLLM's name) and ``batch_size`` (sequences in the step).
    Speculative decoding (vLLM's names, counters): ``spec_decode_num_drafts``
    (sequences whose proposals a step scored), ``spec_decode_num_draft_tokens``,
    ``spec_decode_num_accepted_tokens`` and
    ``spec_decode_num_accepted_tokens_per_pos`` by ``position`` (0-based);
    mean acceptance length = 1 + accepted / drafts. Suffix decoding's cache
    of earlier outputs (gauges): ``spec_decode_suffix_cache_tokens`` and
    ``spec_decode_suffix_cache_bytes`` (estimated memory). CPU contention
    (the torch engine's thread governor, docs/engine.md): ``engine_num_threads``
    (gauge: the step's compute threads), ``cpu_throttled_seconds_total``
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

    def track_load(self, load: Callable[[], LoadStats]) -> None:
        """Makes the load gauges read ``load()`` at each scrape."""
        self.num_requests_running.set_function(lambda: load().num_running)
        self.num_requests_waiting.set_function(lambda: load().num_waiting)
        self.kv_cache_usage.set_function(lambda: load().kv_cache_usage)

    def observe_step(self, stats: StepStats) -> None:
        """Records one engine step (thread-safe; called on the engine thread)."""
        self.step_duration.observe(stats.duration_s)
        self.iteration_tokens.observe(stats.num_scheduled_tokens)
        self.batch_size.observe(stats.batch_size)
        if stats.num_prompt_tokens_computed:
            self.prompt_tokens_computed.inc(stats.num_prompt_tokens_computed)
        if stats.prefix_queries:
            self.prefix_cache_queries.inc(stats.prefix_queries)
            self.prefix_cache_hits.inc(stats.prefix_hits)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
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


@functools.cache
def default_metrics() -> EngineMetrics:
    """The process-wide metrics on Prometheus' default registry (created once)."""
    return EngineMetrics()
