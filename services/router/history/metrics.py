"""History compaction's Prometheus metrics (:class:`HistoryMetrics`), per ``model_name``:

* ``llmesh:history_summary_lookups_total{model_name, result}``: chat
  requests that asked the cache service for a summary: ``hit``, ``miss``;
* ``llmesh:history_compactions_total{model_name, outcome}``: compactions a
  router started: ``stored`` (it wrote the summary), ``claimed_elsewhere``
  (another router holds the claim, or the summary exists: skipped),
  ``failed`` (the generation or the store failed; the claim's lease ends it),
  ``deferred`` (the chat's tenant was over one of its limits: a later turn
  tries again);
* ``llmesh:history_compactions_running{model_name}``: compactions under way
  in this router (gauge);
* ``llmesh:history_summarized_turns_total{model_name}``: turns the stored
  summaries read (an incremental compaction reads only the turns after the
  previous summary, so over a conversation this equals the turns its last
  summary covers);
* ``llmesh:history_summary_seconds{model_name}``: time to write one summary
  (claim to store, the generation included);
* ``llmesh:history_tokens_saved_total{model_name}``: prompt tokens the
  summaries saved, summed over the requests that used one (``usage.history_tokens_saved``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SUMMARY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass(frozen=True)
class HistoryMetrics:
    lookups: Counter
    compactions: Counter
    running: Gauge
    summarized_turns: Counter
    summary_seconds: Histogram
    tokens_saved: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> HistoryMetrics:
        """Registers the metrics in ``registry`` (once per registry)."""
        return cls(
            lookups=Counter("llmesh:history_summary_lookups",
                            "Chat requests that looked up a history summary, by result.",
                            ["model_name", "result"], registry=registry),
            compactions=Counter("llmesh:history_compactions",
                                "History compactions started, by outcome.",
                                ["model_name", "outcome"], registry=registry),
            running=Gauge("llmesh:history_compactions_running",
                          "History compactions under way in this router.",
                          ["model_name"], registry=registry),
            summarized_turns=Counter("llmesh:history_summarized_turns",
                                     "Turns read by the history summaries stored.",
                                     ["model_name"], registry=registry),
            summary_seconds=Histogram("llmesh:history_summary_seconds",
                                      "Time to write one history summary (seconds).",
                                      ["model_name"], buckets=SUMMARY_BUCKETS,
                                      registry=registry),
            tokens_saved=Counter("llmesh:history_tokens_saved",
                                 "Prompt tokens history summaries saved.",
                                 ["model_name"], registry=registry),
        )
