"""The router's Prometheus metrics (names follow vLLM's where the concept matches).

All times are in seconds, measured at the router with ``time.monotonic()``
from the moment the router received the request:

* ``llmesh:time_to_first_token_seconds``: receipt to the first generated
  token leaving the router (for a cache hit: the replayed answer).
* ``llmesh:inter_token_latency_seconds``: between consecutive token-carrying
  deltas of one request (one engine step, or more with speculation).
* ``llmesh:e2e_request_latency_seconds``: receipt to the final message.
* ``llmesh:request_queue_time_seconds``: receipt to the request being sent
  to an engine replica (validation, tokenization, cache lookup, replica choice).
* ``llmesh:requests_total{outcome, priority}``: finished requests; ``outcome``
  is the finish reason (``stop``, ``length``, ``cancelled``) or, for a failed
  call, the gRPC status in lower case (``invalid_argument``, ``unavailable``...).
* ``llmesh:prompt_tokens_total`` / ``llmesh:generation_tokens_total``.
* ``llmesh:response_cache_queries_total`` / ``llmesh:response_cache_hits_total``.

Every metric carries ``model_name``. Nothing is observed per token inside the
decode loop beyond one histogram observation per delta.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

# Bucket bounds in seconds; the low end resolves single milliseconds.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)
E2E_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)
QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


class RouterMetrics:
    """The router's metric families, registered once per process.

    Tests pass their own ``CollectorRegistry`` so several routers may live in
    one process.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = prometheus_client.REGISTRY if registry is None else registry
        self.registry = reg
        self.time_to_first_token = Histogram(
            "llmesh:time_to_first_token_seconds",
            "Time from the router receiving a request to its first token (seconds).",
            ["model_name"], buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            "llmesh:inter_token_latency_seconds",
            "Time between consecutive token deltas of a request (seconds).",
            ["model_name"], buckets=ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            "llmesh:e2e_request_latency_seconds",
            "Time from the router receiving a request to its final message (seconds).",
            ["model_name"], buckets=E2E_BUCKETS, registry=reg)
        self.request_queue_time = Histogram(
            "llmesh:request_queue_time_seconds",
            "Time from the router receiving a request to sending it to an engine (seconds).",
            ["model_name"], buckets=QUEUE_BUCKETS, registry=reg)
        self.requests = Counter(
            "llmesh:requests",
            "Finished requests by outcome (finish reason or gRPC status) and priority class.",
            ["model_name", "outcome", "priority"], registry=reg)
        self.prompt_tokens = Counter(
            "llmesh:prompt_tokens", "Prompt tokens of finished requests.",
            ["model_name"], registry=reg)
        self.generation_tokens = Counter(
            "llmesh:generation_tokens", "Tokens generated for finished requests.",
            ["model_name"], registry=reg)
        self.cache_queries = Counter(
            "llmesh:response_cache_queries", "Response cache lookups.",
            ["model_name"], registry=reg)
        self.cache_hits = Counter(
            "llmesh:response_cache_hits", "Response cache lookups that found an answer.",
            ["model_name"], registry=reg)

    def observe_finished(self, *, model: str, outcome: str, priority: str,
                         prompt_tokens: int, generation_tokens: int, e2e_seconds: float) -> None:
        """Records one finished request (any outcome)."""
        self.requests.labels(model, outcome, priority).inc()
        self.e2e_request_latency.labels(model).observe(e2e_seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.labels(model).inc(generation_tokens)
