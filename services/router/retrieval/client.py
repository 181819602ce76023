"""The retriever's client (``llmesh.v1.RetrieverService``): Query and Embed.

One long-lived channel (:func:`make_channel`), made at construction and closed
by :meth:`RetrieverClient.close`. Every call takes the request id (sent on as
``x-request-id``) and a timeout in seconds (the caller derives it from the
request's deadline and the router's ``--retrieval-timeout-ms``). A failed call
raises :class:`UpstreamError` with ``service="retriever"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from llmesh.v1 import retriever_pb2, retriever_pb2_grpc
from services.common.grpc_util import make_channel, request_id_metadata
from services.router.clients import UpstreamError
from services.router.retrieval.placement import Passage

RETRIEVER = "retriever"


@dataclass(frozen=True)
class QueryAnswer:
    """A Query's answer.

    Attributes:
      passages: the top-k chunks, best first.
      version: the collection's version they came from.
      embed_ms, search_ms: the retriever's stages (0 on a cache hit).
      cache_hit: the top-k came from the retriever's result cache.
    """

    passages: tuple[Passage, ...]
    version: int
    embed_ms: float
    search_ms: float
    cache_hit: bool


@dataclass(frozen=True)
class Embeddings:
    """An Embed answer: one unit vector per text, the model, its token count."""

    vectors: tuple[tuple[float, ...], ...]
    model: str
    prompt_tokens: int


class RetrieverClient:
    """Calls one retriever at ``target`` (``host:port``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = make_channel(target)
        self._stub = retriever_pb2_grpc.RetrieverServiceStub(self._channel)

    async def query(self, collection: str, query: str, *, top_k: int,
                    filter: Mapping[str, object], request_id: str, timeout: float,
                    cache_scope: str = "",
                    metadata: tuple[tuple[str, str], ...] = ()) -> QueryAnswer:
        """Top-k chunks of ``collection`` for ``query``; the retriever's caches reuse only
        work of the same ``cache_scope`` (:mod:`services.common.cache_scope`).

        Raises:
          UpstreamError: the retriever's status (NOT_FOUND, INVALID_ARGUMENT
            naming its field, UNAVAILABLE, DEADLINE_EXCEEDED after ``timeout``).
        """
        pb = retriever_pb2.QueryRequest(collection=collection, query=query, top_k=top_k,
                                        cache_scope=cache_scope)
        if filter:
            pb.filter.CopyFrom(to_struct(filter))
        answer = await self._call(self._stub.Query, pb, request_id, timeout, metadata)
        return QueryAnswer(
            tuple(Passage(c.chunk_id, c.document_id, c.text, c.score) for c in answer.chunks),
            answer.version, answer.timing.embed_ms, answer.timing.search_ms,
            answer.timing.cache_hit)

    async def embed(self, texts: Sequence[str], *, request_id: str,
                    timeout: float) -> Embeddings:
        """Embeddings of ``texts``, in order.

        Raises:
          UpstreamError: the retriever's status (INVALID_ARGUMENT naming
            ``texts[i]``, UNAVAILABLE, DEADLINE_EXCEEDED).
        """
        answer = await self._call(self._stub.Embed, retriever_pb2.EmbedRequest(texts=texts),
                                  request_id, timeout, ())
        return Embeddings(tuple(tuple(e.values) for e in answer.embeddings), answer.model,
                          answer.prompt_tokens)

    async def _call(self, method: Any, pb: Message, request_id: str, timeout: float,
                    metadata: tuple[tuple[str, str], ...]) -> Any:
        if timeout <= 0:
            raise UpstreamError(RETRIEVER, self.target, grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the call's deadline passed before retrieval")
        try:
            return await method(pb, timeout=timeout,
                                metadata=(*request_id_metadata(request_id), *metadata))
        except grpc.aio.AioRpcError as err:
            raise UpstreamError(RETRIEVER, self.target, err.code(),
                                err.details() or "") from None

    async def close(self) -> None:
        await self._channel.close()


def to_struct(values: Mapping[str, object]) -> struct_pb2.Struct:
    """A flat mapping as a ``google.protobuf.Struct``."""
    out = struct_pb2.Struct()
    out.update(dict(values))
    return out
