"""The cache service's history summaries as typed calls (:class:`SummaryStore`).

Like the response cache, optional to a request: any RPC error is logged and
answers a miss / not claimed / not stored, so a cache outage leaves chats
trimmed, never failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from llmesh.v1 import cache_pb2, cache_pb2_grpc

from services.common.grpc_util import request_id_metadata

log = structlog.get_logger()


@dataclass(frozen=True)
class Summary:
    """A stored summary.

    Attributes:
      text: what the summariser wrote.
      summarized_messages: turns (after the system turns) it replaces.
      summarized_tokens: prompt tokens those turns took.
      summary_tokens: tokens of ``text`` (the served model's tokenizer).
      model: the model that wrote it.
    """

    text: str
    summarized_messages: int
    summarized_tokens: int
    summary_tokens: int
    model: str

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens the summary saves (never below 0)."""
        return max(0, self.summarized_tokens - self.summary_tokens)

    def to_pb(self) -> cache_pb2.HistorySummary:
        return cache_pb2.HistorySummary(
            text=self.text, summarized_messages=self.summarized_messages,
            summarized_tokens=self.summarized_tokens, summary_tokens=self.summary_tokens,
            model=self.model)

    @classmethod
    def from_pb(cls, pb: cache_pb2.HistorySummary) -> Summary:
        return cls(pb.text, pb.summarized_messages, pb.summarized_tokens, pb.summary_tokens,
                   pb.model)


@dataclass(frozen=True)
class Lookup:
    """What the store holds for a conversation.

    Attributes:
      summary: the summary of the longest prefix stored, or None.
      index: which of the asked hashes it covers (-1: none).
      pending: a longer prefix is being summarised (claimed) now.
    """

    summary: Summary | None = None
    index: int = -1
    pending: bool = False


class SummaryStore:
    """``GetHistorySummary`` / ``ClaimHistorySummary`` / ``PutHistorySummary``.

    Args:
      stub: the cache service's stub (:attr:`CacheClient.stub`).
      timeout: most seconds one call may take.
    """

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, *, timeout: float) -> None:
        self._stub = stub
        self._timeout = timeout

    async def lookup(self, scope: str, hashes: Sequence[bytes], *, request_id: str) -> Lookup:
        """The longest stored prefix of ``hashes`` (a miss on any error)."""
        try:
            reply = await self._stub.GetHistorySummary(
                cache_pb2.GetHistorySummaryRequest(cache_scope=scope, prefix_hashes=hashes),
                timeout=self._timeout, metadata=request_id_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            log.warning("history_lookup_failed", code=err.code().name, details=err.details())
            return Lookup()
        if not reply.found:
            return Lookup(pending=reply.pending)
        return Lookup(Summary.from_pb(reply.summary), reply.prefix_index, reply.pending)

    async def claim(self, scope: str, prefix_hash: bytes, *, lease_seconds: int,
                    request_id: str) -> bool:
        """True when this router now writes the prefix's summary."""
        try:
            reply = await self._stub.ClaimHistorySummary(
                cache_pb2.ClaimHistorySummaryRequest(
                    cache_scope=scope, prefix_hash=prefix_hash, lease_seconds=lease_seconds),
                timeout=self._timeout, metadata=request_id_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            log.warning("history_claim_failed", code=err.code().name, details=err.details())
            return False
        return reply.claimed

    async def put(self, scope: str, prefix_hash: bytes, summary: Summary, *,
                  request_id: str) -> bool:
        """Stores ``summary``; True when the cache kept it."""
        try:
            reply = await self._stub.PutHistorySummary(
                cache_pb2.PutHistorySummaryRequest(
                    cache_scope=scope, prefix_hash=prefix_hash, summary=summary.to_pb()),
                timeout=self._timeout, metadata=request_id_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            log.warning("history_put_failed", code=err.code().name, details=err.details())
            return False
        return reply.stored
