"""What a response says about its retrieval: the chunks used and the latency.

One :class:`RetrievalReport` per request, made by :mod:`.stage` once the
passages are in (or retrieval degraded), carried on each choice's last event
(:class:`services.router.generation.Finished`), converted here for the three
edges: gRPC (``GenerateResponse.retrieval`` / ``retrieval_latency``), the
OpenAI body's ``llmesh_retrieval`` key, and the ``request_finished`` log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmesh.v1 import generation_pb2
from services.router.retrieval.placement import Passage


@dataclass(frozen=True)
class RetrievalReport:
    """A request's retrieval, as its response reports it.

    Attributes:
      collection: the collection searched.
      passages: the chunks inserted, best first (none when degraded).
      passages_message: the exact text inserted ("" none).
      version: the collection's version they came from (0 when degraded).
      degraded_reason: why the answer has no passages ("" not degraded).
      embed_ms, search_ms, cache_hit: the retriever's own stages.
      call_ms: the Query call as the router measured it, start to answer.
      wait_ms: of ``call_ms``, the time the request waited for it after the
        rest of its preparation and after its admission slot was granted
        (what retrieval added to TTFT).
    """

    collection: str
    passages: tuple[Passage, ...]
    passages_message: str
    version: int
    degraded_reason: str
    embed_ms: float
    search_ms: float
    cache_hit: bool
    call_ms: float
    wait_ms: float

    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reason)

    @property
    def overlap_ms(self) -> float:
        """Of ``call_ms``, the time that ran beside the rest of the preparation."""
        return max(0.0, self.call_ms - self.wait_ms)

    def used_pb(self) -> generation_pb2.RetrievalUsed:
        return generation_pb2.RetrievalUsed(
            chunks=[generation_pb2.UsedChunk(chunk_id=p.chunk_id, document_id=p.document_id,
                                             score=p.score) for p in self.passages],
            passages_message=self.passages_message, degraded=self.degraded,
            degraded_reason=self.degraded_reason, collection_version=self.version)

    def latency_pb(self) -> generation_pb2.RetrievalLatency:
        return generation_pb2.RetrievalLatency(
            embed_ms=self.embed_ms, search_ms=self.search_ms, cache_hit=self.cache_hit,
            call_ms=self.call_ms, wait_ms=self.wait_ms, overlap_ms=self.overlap_ms)

    def openai_body(self) -> dict[str, Any]:
        """The OpenAI response's ``llmesh_retrieval`` value."""
        return {
            "chunks": [{"chunk_id": p.chunk_id, "document_id": p.document_id,
                        "score": p.score} for p in self.passages],
            "passages_message": self.passages_message, "degraded": self.degraded,
            "degraded_reason": self.degraded_reason, "collection_version": self.version,
            "latency_ms": {"embed": self.embed_ms, "search": self.search_ms,
                           "cache_hit": self.cache_hit, "call": self.call_ms,
                           "wait": self.wait_ms, "overlap": self.overlap_ms},
        }

    def log_fields(self) -> dict[str, object]:
        """The ``request_finished`` log line's retrieval fields."""
        return dict(retrieval_collection=self.collection, retrieval_chunks=len(self.passages),
                    retrieval_ms=round(self.call_ms, 3),
                    retrieval_wait_ms=round(self.wait_ms, 3),
                    retrieval_embed_ms=round(self.embed_ms, 3),
                    retrieval_search_ms=round(self.search_ms, 3),
                    retrieval_cache_hit=self.cache_hit,
                    **({"retrieval_degraded": self.degraded_reason} if self.degraded else {}))
