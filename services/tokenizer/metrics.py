"""Prometheus metrics of the tokenizer service.

One :class:`TokenizerMetrics` per registry: the process-wide default
(:func:`default_metrics`, registered on first use, never at import) serves
``/metrics``; tests pass their own ``CollectorRegistry`` to read exact values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Request latency buckets in seconds: most calls take tens to hundreds of µs.
LATENCY_BUCKETS_SECONDS = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 1.0, 2.5,
)


@dataclass(frozen=True)
class TokenizerMetrics:
    """The tokenizer service's metrics.

    Attributes:
      registry: where the metrics are registered.
      request_duration: ``llmesh:tokenizer_request_duration_seconds{method}``,
        handler time in seconds of one unary call, or of one message of a
        ``Detokenize`` stream (message received to response handed to gRPC).
      requests: ``llmesh:tokenizer_requests_total{method,code}``, calls (for
        Detokenize: messages, plus a rejected stream) by gRPC status code name.
      tokens: ``llmesh:tokenizer_tokens_total{method}``, token ids produced
        (Tokenize, ApplyChatTemplate) or consumed (Detokenize).
      dropped_messages: ``llmesh:tokenizer_dropped_messages_total``, chat
        messages left out to fit ``max_prompt_tokens``.
      detokenize_streams: ``llmesh:tokenizer_detokenize_streams``, open
        Detokenize streams.
    """

    registry: CollectorRegistry
    request_duration: Histogram
    requests: Counter
    tokens: Counter
    dropped_messages: Counter
    detokenize_streams: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> TokenizerMetrics:
        """Registers the metrics in ``registry`` (once per registry)."""
        return cls(
            registry=registry,
            request_duration=Histogram(
                "llmesh:tokenizer_request_duration_seconds",
                "Tokenizer RPC handling time in seconds (per message for Detokenize).",
                ["method"], buckets=LATENCY_BUCKETS_SECONDS, registry=registry),
            requests=Counter(
                "llmesh:tokenizer_requests",
                "Tokenizer calls (Detokenize: messages) by gRPC status code.",
                ["method", "code"], registry=registry),
            tokens=Counter(
                "llmesh:tokenizer_tokens",
                "Token ids produced (Tokenize, ApplyChatTemplate) or consumed (Detokenize).",
                ["method"], registry=registry),
            dropped_messages=Counter(
                "llmesh:tokenizer_dropped_messages",
                "Chat messages dropped to fit max_prompt_tokens.", registry=registry),
            detokenize_streams=Gauge(
                "llmesh:tokenizer_detokenize_streams", "Open Detokenize streams.",
                registry=registry),
        )


@functools.cache
def default_metrics() -> TokenizerMetrics:
    """The metrics in the process-wide registry that ``/metrics`` serves."""
    return TokenizerMetrics.create(prometheus_client.REGISTRY)
