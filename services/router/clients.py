"""Typed async clients for the services the router calls.

The engine's client is :mod:`services.router.engine_client`. The values the
clients exchange are the hops' wire types (:mod:`services.common.wire`: chat
messages and prompts, tokenizer info, cache keys and responses), which the
services at the other end import too.

Each client owns one long-lived channel (:func:`make_channel`), made when the
client is constructed and closed by :meth:`close`; no call sets up a
connection. Dataclasses go in and come out; protobuf stays in the clients and
the wire types' ``from_pb``/``to_pb``.

Every call takes the request id (sent on as ``x-request-id`` metadata) and the
absolute deadline of the client's call (``time.monotonic()`` seconds, or None
for none): each hop gets the time the client has left, not more.

Errors: a failed tokenizer or engine call raises :class:`UpstreamError` with
the upstream's status code and the service's name and address. The cache is
optional: :class:`CacheClient` never raises for an RPC failure; it logs a
warning and reports a miss (``get``) or "not stored" (``put``); lookups and
stores each travel batched on one long-lived call
(:mod:`services.router.cache_lookups`, :mod:`services.router.cache_stores`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.detokenizer import DEFINITION_FORMAT, TokenizersDecoder
from services.common.grpc_util import make_channel, request_id_metadata, status_code_of
from services.common.kv_events import PrefixMatch
from services.common.mux import MuxClient, StreamInbox, never_merge
from services.common.wire.cache import CachedResponse, CacheKey
from services.common.wire.chat import ChatMessage, ChatPrompt
from services.common.wire.tokenizer_info import TokenizerInfo
from services.common.wire.tools import FunctionTool
from services.router.cache_lookups import LookupStream
from services.router.cache_stores import OutcomeHook, StoreStream, store_timeout_for

log = structlog.get_logger()

_TOKENIZER = "tokenizer"
#: Pause between health probes of a service that is still starting (seconds).
_HEALTH_POLL_SECONDS = 0.2


class UpstreamError(Exception):
    """A call to another llmesh service failed.

    Attributes:
      service: ``"tokenizer"``, ``"engine"`` or ``"cache"``.
      target: the ``host:port`` called.
      code: the gRPC status the upstream returned (DEADLINE_EXCEEDED also when
        the client's deadline had already passed before the call).
      details: the upstream's status message.
      replica: the upstream's name a client may see (an engine's replica id),
        "" when it has none. ``target`` and ``details`` are for the router's
        log only (:func:`services.router.generation.upstream_to_generation_error`).
      client_message: what the client is told of a DEADLINE_EXCEEDED, when
        not its own deadline ran out ("" the usual advice).
    """

    def __init__(self, service: str, target: str, code: grpc.StatusCode, details: str,
                 *, replica: str = "", client_message: str = "") -> None:
        super().__init__(f"{service} at {target}: {code.name}: {details}")
        self.service = service
        self.target = target
        self.code = code
        self.details = details
        self.replica = replica
        self.client_message = client_message


# --------------------------------------------------------------------------- #
# Values exchanged with the clients.


@dataclass(frozen=True)
class TokenizerDefinition:
    """What ``GetTokenizer`` sends: the ``tokenizers`` JSON definition (UTF-8
    bytes, checked against its SHA-256), the vocabulary size, and the chat
    template (``""``: none; None: a service that does not send it) and named
    special tokens the service renders chats with."""

    target: str
    data: bytes
    sha256: str
    vocab_size: int
    chat_template: str | None
    special_tokens: dict[str, str]

    async def decoder(self) -> TokenizersDecoder:
        """The definition loaded for detokenization (on a worker thread).

        Raises:
          UpstreamError: DATA_LOSS when it does not load.
        """
        try:
            decoder = await asyncio.to_thread(TokenizersDecoder, self.data.decode(),
                                              self.vocab_size)
        except (ValueError, UnicodeDecodeError) as exc:
            raise UpstreamError(_TOKENIZER, self.target, grpc.StatusCode.DATA_LOSS,
                                f"GetTokenizer: {exc}") from exc
        log.info("tokenizer_definition_loaded", target=self.target, bytes=len(self.data),
                 sha256=self.sha256[:16], vocab_size=self.vocab_size)
        return decoder



# --------------------------------------------------------------------------- #
# Helpers.


def timeout_until(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic()`` based), None for none.

    Raises:
      UpstreamError: DEADLINE_EXCEEDED (service ``"router"``) when it has passed.
    """
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise UpstreamError("router", "-", grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the call's deadline passed")
    return remaining


def upstream_error(service: str, target: str, err: grpc.aio.AioRpcError) -> UpstreamError:
    return UpstreamError(service, target, err.code(), err.details() or "")


async def wait_until_serving(
    channel: grpc.aio.Channel, *, service: str, target: str, timeout: float
) -> None:
    """Waits until ``target``'s gRPC health says SERVING (model loaded).

    Args:
      timeout: seconds to wait in all.

    Raises:
      UpstreamError: UNAVAILABLE (or the last probe's code) when it is still not
        serving after ``timeout`` seconds.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamError(service, target, grpc.StatusCode.UNAVAILABLE,
                                f"not serving after {timeout:.0f} s ({last})")
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=min(remaining, 5.0),
                wait_for_ready=True,
            )
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as err:
            last = f"{err.code().name}: {err.details()}"
        await asyncio.sleep(min(_HEALTH_POLL_SECONDS, max(deadline - time.monotonic(), 0)))


# --------------------------------------------------------------------------- #
# Tokenizer.


class TokenizerClient:
    """Client of ``llmesh.v1.TokenizerService`` on one long-lived channel; prompts
    go over one long-lived ``Multiplex`` call on it."""

    service = _TOKENIZER

    def __init__(self, target: str) -> None:
        """Args:
          target: ``host:port`` of the tokenizer service.
        """
        self.target = target
        self._channel = make_channel(target)
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel)
        self._multiplex: _TokenizerMux | None = None
        self._call_ids = itertools.count(1)

    async def wait_until_serving(self, timeout: float) -> None:
        """See :func:`wait_until_serving`."""
        await wait_until_serving(self._channel, service=self.service, target=self.target,
                                 timeout=timeout)

    async def info(self, *, timeout: float | None = 10.0) -> TokenizerInfo:
        """``GetTokenizerInfo``. Raises :class:`UpstreamError`."""
        try:
            reply = await self._stub.GetTokenizerInfo(
                tokenizer_pb2.GetTokenizerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        return TokenizerInfo.from_pb(reply)

    async def decoder(self, *, timeout: float | None = 60.0) -> TokenizersDecoder:
        """``GetTokenizer``: the tokenizer's definition, checked (size and SHA-256)
        and loaded as a :class:`TokenizersDecoder`.

        Raises:
          UpstreamError: the call failed; DATA_LOSS for a definition whose size
            or digest does not match its header, or that does not load.
        """
        return await (await self.definition(timeout=timeout)).decoder()

    async def definition(self, *, timeout: float | None = 60.0) -> TokenizerDefinition:
        """``GetTokenizer``: the tokenizer's definition, checked (size and SHA-256).

        Raises:
          UpstreamError: the call failed; DATA_LOSS for a definition whose size
            or digest does not match its header.
        """
        chunks: list[bytes] = []
        head: tokenizer_pb2.GetTokenizerResponse | None = None
        try:
            async for reply in self._stub.GetTokenizer(tokenizer_pb2.GetTokenizerRequest(),
                                                       timeout=timeout):
                if head is None:
                    head = reply  # the header fields ride on the first message
                chunks.append(reply.definition_chunk)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        data = b"".join(chunks)

        def lost(why: str) -> UpstreamError:
            return UpstreamError(self.service, self.target, grpc.StatusCode.DATA_LOSS,
                                 f"GetTokenizer: {why}")

        if head is None or head.format != DEFINITION_FORMAT:
            raise lost(f"unknown definition format {head.format if head else None!r}")
        if len(data) != head.total_bytes or hashlib.sha256(data).hexdigest() != head.sha256:
            raise lost(f"{len(data)} bytes received, {head.total_bytes} announced, or their "
                       "SHA-256 differs")
        return TokenizerDefinition(
            self.target, data, head.sha256, head.vocab_size,
            head.chat_template if head.HasField("chat_template") else None,
            dict(head.special_tokens))

    async def tokenize(self, text: str, *, add_special_tokens: bool, request_id: str,
                       deadline: float | None, traceparent: str = "") -> tuple[int, ...]:
        """``Tokenize``: text to ids; ``traceparent``: the caller's span (W3C,
        "" when not traced). Raises :class:`UpstreamError`."""
        answer = await self._ask(tokenizer_pb2.TokenizerServiceMultiplexRequest(
            request_id=request_id, tokenize=tokenizer_pb2.TokenizeRequest(
                text=text, add_special_tokens=add_special_tokens),
            traceparent=traceparent), deadline)
        return tuple(answer.tokenize.token_ids)

    async def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
        max_prompt_tokens: int, request_id: str, deadline: float | None,
        allow_special_tokens: bool = False, traceparent: str = "",
        tools: Sequence[FunctionTool] = (),
    ) -> ChatPrompt:
        """``ApplyChatTemplate``: messages to prompt ids within ``max_prompt_tokens``;
        special-token text in contents stays text unless ``allow_special_tokens``;
        ``traceparent``: the caller's span (W3C, "" when not traced); ``tools``:
        the template's ``tools`` (the ``template`` tool format).

        Raises:
          UpstreamError: FAILED_PRECONDITION (no chat template), OUT_OF_RANGE
            (even the last message alone does not fit), or the transport error.
        """
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            messages=[m.to_pb() for m in messages],
            add_generation_prompt=add_generation_prompt, max_prompt_tokens=max_prompt_tokens,
            allow_special_tokens=allow_special_tokens, tools=[t.to_pb() for t in tools],
        )
        answer = await self._ask(tokenizer_pb2.TokenizerServiceMultiplexRequest(
            request_id=request_id, apply_chat_template=request, traceparent=traceparent),
            deadline)
        return ChatPrompt.from_pb(answer.apply_chat_template)

    async def _ask(self, message: tokenizer_pb2.TokenizerServiceMultiplexRequest,
                   deadline: float | None) -> tokenizer_pb2.TokenizerServiceMultiplexResponse:
        """``message``'s answer on the long-lived ``Multiplex`` call (opened on
        first use, and again after one fails).

        Raises:
          UpstreamError: the request's status when not OK (the unary call's),
            UNAVAILABLE when the call fails (the tokenizer died or is
            unreachable), DEADLINE_EXCEEDED when ``deadline`` passes first.
        """
        timeout = timeout_until(deadline)
        if self._multiplex is None or self._multiplex.failed is not None:
            self._multiplex = tokenizer_multiplex(self._stub.Multiplex(), self.target)
        answer = await ask(self._multiplex, next(self._call_ids), message, timeout)
        if answer.status_code:
            raise UpstreamError(self.service, self.target, status_code_of(answer.status_code),
                                answer.status_message)
        return answer

    async def close(self) -> None:
        if self._multiplex is not None:
            await self._multiplex.close()
        await self._channel.close()


_Answer = tokenizer_pb2.TokenizerServiceMultiplexResponse
_TokenizerMux = MuxClient[tokenizer_pb2.TokenizerServiceMultiplexRequest, _Answer]


def tokenizer_multiplex(call: object, target: str) -> _TokenizerMux:
    """The stream kit's client over a ``TokenizerService.Multiplex`` call: a
    request is one message each way on an open HTTP/2 stream, which costs the
    router and the tokenizer about half of what a new unary call does (no
    stream set-up, headers or call object)."""
    return MuxClient(call, pack=list, unpack=lambda answer: ((answer.call_id, answer),),
                     make_error=lambda code, details: UpstreamError(_TOKENIZER, target, code,
                                                                     details),
                     service=_TOKENIZER, target=target)


class _AnswerInbox(StreamInbox[int, _Answer]):
    """Where one request's one answer lands (a :class:`Receiver`)."""

    def __init__(self) -> None:
        super().__init__(never_merge)

    def deliver(self, update: _Answer) -> bool:
        self.put(0, update, last=True)
        return True


async def ask(mux: _TokenizerMux, call_id: int,
              message: tokenizer_pb2.TokenizerServiceMultiplexRequest,
              timeout: float | None) -> _Answer:
    """Sends ``message`` as ``call_id`` (set here) and waits up to ``timeout``
    seconds (None: no limit) for its answer.

    Raises:
      UpstreamError: UNAVAILABLE (the call failed), DEADLINE_EXCEEDED.
    """
    message.call_id = call_id
    inbox = _AnswerInbox()
    mux.open(call_id, inbox, message)
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the
        # answer when it lands as the caller is cancelled, swallowing the
        # cancel (a cancelled GenerateStream turn then ran on: issue 18's fuzz)
        async with asyncio.timeout(timeout):
            _, answer = await inbox.read()
            return answer
    except TimeoutError:
        raise UpstreamError(_TOKENIZER, mux.target, grpc.StatusCode.DEADLINE_EXCEEDED,
                            "no answer before the call's deadline") from None
    finally:
        mux.forget(call_id)


# --------------------------------------------------------------------------- #
# Cache.


class CacheClient:
    """Client of ``llmesh.v1.CacheService``; optional, so it never fails a request.

    Any RPC error (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is logged as a warning
    and reported as a miss / not stored.
    """

    service = "cache"

    def __init__(self, target: str, *, timeout: float = 0.5,
                 on_store: OutcomeHook | None = None, max_pending_stores: int = 1024,
                 store_timeout: float | None = None) -> None:
        """Args:
          target: ``host:port`` of the cache service.
          timeout: the most seconds one cache lookup may take (also bounded by
            the client's deadline): a slow cache must not slow requests.
          store_timeout: the most seconds a store may go unanswered on a
            connected channel (stall detection); None:
            :func:`~services.router.cache_stores.store_timeout_for` ``timeout``.
          on_store: called with (model, outcome) as each store ends.
          max_pending_stores: the most stores waiting for their result; more
            are dropped.
        """
        self.target = target
        self.timeout = timeout
        self._channel = make_channel(target)
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)
        #: The response lookups' long-lived call.
        self.lookups = LookupStream(self._stub, target)
        #: The response stores' long-lived call.
        if store_timeout is None:
            store_timeout = store_timeout_for(timeout)
        self.stores = StoreStream(self._stub, target, timeout_s=store_timeout,
                                  connected=self.connected,
                                  max_pending=max_pending_stores, on_outcome=on_store)

    async def wait_until_serving(self, timeout: float) -> None:
        """See :func:`wait_until_serving`."""
        await wait_until_serving(self._channel, service=self.service, target=self.target,
                                 timeout=timeout)

    @property
    def stub(self) -> cache_pb2_grpc.CacheServiceStub:
        """The service's stub on this client's channel, for the router's other
        users of the cache service (:mod:`services.router.history.store`)."""
        return self._stub

    def _timeout(self, deadline: float | None) -> float:
        remaining = timeout_until(deadline)
        return self.timeout if remaining is None else min(self.timeout, remaining)

    async def get(self, key: CacheKey, *, request_id: str, deadline: float | None,
                  trace_metadata: Sequence[tuple[str, str]] = ()) -> CachedResponse | None:
        """The cached response for ``key``, or None (miss, or any cache error),
        on the channel's one ``GetCachedResponses`` call
        (:mod:`services.router.cache_lookups`); ``trace_metadata``: the
        caller's span's W3C trace context
        (:func:`services.common.tracing.metadata_of`).

        Raises:
          UpstreamError: DEADLINE_EXCEEDED when ``deadline`` passed before the lookup.
        """
        return await self.lookups.get(key, request_id=request_id,
                                      timeout=self._timeout(deadline),
                                      trace_metadata=trace_metadata)

    def put(self, key: CacheKey, response: CachedResponse, *,
            request_id: str) -> asyncio.Future[bool]:
        """Queues the store of ``response`` on the channel's one
        ``PutCachedResponses`` call (:mod:`services.router.cache_stores`); the
        future resolves True once the cache kept it, False on anything else
        (never raises). Does not wait."""
        return self.stores.put(key, response, request_id=request_id)

    def connected(self) -> bool:
        """Whether the channel is connected now (READY): a store in flight may
        land soon; while not, a lookup would miss anyway."""
        return self._channel.get_state() == grpc.ChannelConnectivity.READY

    async def score_prefix(self, block_hashes: Sequence[bytes], *,
                           deadline: float | None) -> dict[str, PrefixMatch] | None:
        """``ScorePrefix``: leading blocks of ``block_hashes`` each live replica
        holds, in its pool and then in its offload tier (replica id → match,
        only those holding the first block); None on any error (logged: the
        router then routes by load)."""
        try:
            reply = await self._stub.ScorePrefix(
                cache_pb2.ScorePrefixRequest(block_hashes=block_hashes),
                timeout=self._timeout(deadline))
        except grpc.aio.AioRpcError as err:
            log.warning("prefix_score_failed", target=self.target, code=err.code().name,
                        details=err.details())
            return None
        return {score.replica_id: PrefixMatch(score.matched_blocks, score.offloaded_blocks)
                for score in reply.scores}

    async def close(self) -> None:
        await self.lookups.close()
        await self.stores.close()
        await self._channel.close()
