"""The cascade's Prometheus metrics (``llmesh:cascade_*``, label ``model_name``:
the alias), on the router's registry.

* ``llmesh:cascade_requests_total{model_name, path, reason}``: requests to the
  alias by the path they took (``small``, ``escalated``, ``large``) and why
  (:class:`~.path.AnswerPath` reasons), once the path is decided.
* ``llmesh:cascade_escalations_total{model_name, reason}``: small generations
  cancelled for the large model (``low_confidence``, ``low_margin``).
* ``llmesh:cascade_held_back_seconds{model_name}``: from the small
  generation's start to the rule's decision (the latency the window adds to
  TTFT when the small answer is kept; before the large model starts when it
  is not).
* ``llmesh:cascade_discarded_tokens_total{model_name}``: tokens the small
  model generated in windows that were discarded (compute spent for nothing).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.router.cascade.path import AnswerPath
from services.router.metrics import TTFT_BUCKETS


class CascadeMetrics:
    """The families above (registered once per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "llmesh:cascade_requests", "Requests to the cascade alias by path and reason.",
            ["model_name", "path", "reason"], registry=registry)
        self.escalations = Counter(
            "llmesh:cascade_escalations", "Small generations escalated to the large model.",
            ["model_name", "reason"], registry=registry)
        self.held_back = Histogram(
            "llmesh:cascade_held_back_seconds",
            "Small generation start to the confidence rule's decision.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=registry)
        self.discarded_tokens = Counter(
            "llmesh:cascade_discarded_tokens",
            "Small-model tokens generated in discarded (escalated) windows.",
            ["model_name"], registry=registry)

    def decided(self, alias: str, path: AnswerPath, *, held_back_s: float | None,
                discarded_tokens: int) -> None:
        """Counts one decided path (and its window, when one was held)."""
        self.requests.labels(alias, path.name, path.reason).inc()
        if held_back_s is not None:
            self.held_back.labels(alias).observe(held_back_s)
        if path.escalated:
            self.escalations.labels(alias, path.reason).inc()
            self.discarded_tokens.labels(alias).inc(discarded_tokens)


__all__ = ["CascadeMetrics"]
