"""Typed async clients for the services the router calls.

The engine's client is :mod:`services.router.engine_client`; the values it
exchanges live here with the others.

Each client owns one long-lived channel (:func:`make_channel`), made when the
client is constructed and closed by :meth:`close`; no call sets up a
connection. Dataclasses go in and come out; protobuf stays in this module.

Every call takes the request id (sent on as ``x-request-id`` metadata) and the
absolute deadline of the client's call (``time.monotonic()`` seconds, or None
for none): each hop gets the time the client has left, not more.

Errors: a failed tokenizer or engine call raises :class:`UpstreamError` with
the upstream's status code and the service's name and address. The cache is
optional: :class:`CacheClient` never raises for an RPC failure; it logs a
warning and reports a miss (``get``) or "not stored" (``put``).
"""

from __future__ import annotations

import asyncio
import contextvars
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
    common_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.detokenizer import DEFINITION_FORMAT, TokenizersDecoder
from services.common.grpc_util import make_channel, request_id_metadata, status_code_of
from services.common.kv_events import PrefixMatch
from services.common.logprobs import PositionLogprobs
from services.common.sampling import FinishReason, SamplingOptions
from services.common.step_profile import StepProfile

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
    """

    def __init__(self, service: str, target: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{service} at {target}: {code.name}: {details}")
        self.service = service
        self.target = target
        self.code = code
        self.details = details


# --------------------------------------------------------------------------- #
# Values exchanged with the clients.


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn: ``role`` (``system``, ``user``, ...) and its UTF-8 ``content``."""

    role: str
    content: str


@dataclass(frozen=True)
class Usage:
    """Token counts of one request (tokens, not characters)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    def to_pb(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )


@dataclass(frozen=True)
class ReplicaInfo:
    """What an engine replica serves (``GetModelInfo``); lengths in tokens;
    ``max_num_seqs``, ``kv_capacity_tokens`` and ``kv_block_size`` are 0 when
    the engine does not say.
    ``replica_id`` names it in the prefix index; ``kv_hash_seed`` and
    ``kv_block_size`` let the router hash a prompt's blocks as it does
    (:mod:`services.common.block_hash`; empty / 0: no prefix cache)."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    backend: str
    max_num_seqs: int = 0
    kv_capacity_tokens: int = 0
    replica_id: str = ""
    kv_block_size: int = 0
    kv_hash_seed: bytes = b""


@dataclass(frozen=True)
class TokenizerInfo:
    """Facts about the tokenizer (``GetTokenizerInfo``)."""

    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    chat_roles: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class EngineLoad:
    """An engine replica's load: sequences running / waiting, KV usage in [0, 1],
    prompt tokens admitted and not yet computed, and its measured step costs
    (empty: none reported; the routing cost uses priors)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_pending_prefill_tokens: int = 0
    step_profile: StepProfile = StepProfile()


@dataclass(frozen=True)
class ChatPrompt:
    """Prompt ids from the chat template and how many old messages were dropped."""

    token_ids: tuple[int, ...]
    num_dropped_messages: int


@dataclass(frozen=True)
class EngineDelta:
    """One engine message: ids since the previous one; on the last, why.

    ``finish_reason`` is None on every message but the last. ``usage`` holds
    the engine's running counts (None from an engine that sends them only on
    the last message); its ``cached_prompt_tokens`` is known from the first
    message on. ``logprobs`` has one entry per id (with ``sampling.logprobs``),
    ``prompt_logprobs`` the prompt's (with ``sampling.prompt_logprobs``, on the
    first message), token text not filled in.
    ``index`` is the choice (``sampling.n`` > 1) the message belongs to: each
    choice has its own last message, and ``usage`` counts that choice's
    completion tokens.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class CacheKey:
    """Everything that decides a deterministic request's output, and the cache
    scope it may be shared in (:mod:`services.common.cache_scope`; "" shared)."""

    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_scope: str = ""

    def to_pb(self) -> cache_pb2.CacheKey:
        return cache_pb2.CacheKey(
            model=self.model, prompt_token_ids=list(self.prompt_token_ids),
            sampling=self.sampling.to_pb(), cache_scope=self.cache_scope,
        )


@dataclass(frozen=True)
class CachedResponse:
    """A finished generation as the client saw it."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    matched_stop: str = ""


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


def finish_reason_of(value: int) -> FinishReason:
    """``value`` as a :class:`FinishReason`; an unknown value counts as ERROR."""
    try:
        return FinishReason(value)
    except ValueError:
        return FinishReason.ERROR


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
        self._multiplex: _TokenizerMultiplex | None = None

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
        return TokenizerInfo(
            model=reply.model, vocab_size=reply.vocab_size,
            eos_token_ids=tuple(reply.eos_token_ids),
            bos_token_id=reply.bos_token_id if reply.HasField("bos_token_id") else None,
            has_chat_template=reply.has_chat_template,
            chat_roles=tuple(reply.chat_roles),
        )

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
                       deadline: float | None) -> tuple[int, ...]:
        """``Tokenize``: text to ids. Raises :class:`UpstreamError`."""
        answer = await self._ask(tokenizer_pb2.TokenizerServiceMultiplexRequest(
            request_id=request_id, tokenize=tokenizer_pb2.TokenizeRequest(
                text=text, add_special_tokens=add_special_tokens)), deadline)
        return tuple(answer.tokenize.token_ids)

    async def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
        max_prompt_tokens: int, request_id: str, deadline: float | None,
        allow_special_tokens: bool = False,
    ) -> ChatPrompt:
        """``ApplyChatTemplate``: messages to prompt ids within ``max_prompt_tokens``;
        special-token text in contents stays text unless ``allow_special_tokens``.

        Raises:
          UpstreamError: FAILED_PRECONDITION (no chat template), OUT_OF_RANGE
            (even the last message alone does not fit), or the transport error.
        """
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            messages=[common_pb2.ChatMessage(role=m.role, content=m.content) for m in messages],
            add_generation_prompt=add_generation_prompt, max_prompt_tokens=max_prompt_tokens,
            allow_special_tokens=allow_special_tokens,
        )
        answer = await self._ask(tokenizer_pb2.TokenizerServiceMultiplexRequest(
            request_id=request_id, apply_chat_template=request), deadline)
        reply = answer.apply_chat_template
        return ChatPrompt(tuple(reply.token_ids), reply.num_dropped_messages)

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
            self._multiplex = _TokenizerMultiplex(self._stub, self.target)
        answer = await self._multiplex.ask(message, timeout)
        if answer.status_code:
            raise UpstreamError(self.service, self.target, status_code_of(answer.status_code),
                                answer.status_message)
        return answer

    async def close(self) -> None:
        if self._multiplex is not None:
            await self._multiplex.close()
        await self._channel.close()


class _TokenizerMultiplex:
    """One ``TokenizerService.Multiplex`` call and the requests waiting on it
    (owned by :class:`TokenizerClient`): a request is one message each way on
    an open HTTP/2 stream, which costs the router and the tokenizer about half
    of what a new unary call does (no stream set-up, headers or call object).
    A reader task hands each answer to its waiting request by ``call_id``."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerServiceStub, target: str) -> None:
        self._target = target
        self._call = stub.Multiplex()
        self._waiting: dict[int, asyncio.Future[
            tokenizer_pb2.TokenizerServiceMultiplexResponse]] = {}
        self._call_ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        #: Set once the call failed: every later :meth:`ask` raises it.
        self.failed: UpstreamError | None = None
        # A context of its own: it serves every request, so its log lines must
        # not carry the id of the request that happened to open the call.
        self._reader = asyncio.create_task(self._read(), context=contextvars.Context())

    async def ask(self, message: tokenizer_pb2.TokenizerServiceMultiplexRequest,
                  timeout: float | None) -> tokenizer_pb2.TokenizerServiceMultiplexResponse:
        """Sends ``message`` (its ``call_id`` set here) and waits up to
        ``timeout`` seconds (None: no limit) for its answer.

        Raises:
          UpstreamError: UNAVAILABLE (the call failed), DEADLINE_EXCEEDED.
        """
        if self.failed is not None:
            raise self.failed
        call_id = next(self._call_ids)
        message.call_id = call_id
        answer = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        try:
            try:
                async with self._write_lock:
                    await self._call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError,
                    asyncio.InvalidStateError) as err:
                # This request raises below, not through its future (which the
                # reader may already have failed, and emptied the table, when
                # the call broke while this write waited).
                self._waiting.pop(call_id, None)
                if answer.done():
                    answer.exception()  # retrieved: asyncio must not log it
                self._fail("writing to it failed: " + (
                    f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError)
                    else f"{type(err).__name__}: {err}"))
                assert self.failed is not None
                raise self.failed from err
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the
            # answer when it lands as the caller is cancelled, swallowing the
            # cancel (a cancelled GenerateStream turn then ran on: issue 18's fuzz)
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise UpstreamError(_TOKENIZER, self._target, grpc.StatusCode.DEADLINE_EXCEEDED,
                                "no answer before the call's deadline") from None
        finally:
            self._waiting.pop(call_id, None)

    async def _read(self) -> None:
        why = "the tokenizer ended the Multiplex call"
        try:
            while (answer := await self._call.read()) is not grpc.aio.EOF:
                waiting = self._waiting.pop(answer.call_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except grpc.aio.AioRpcError as err:
            why = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            self._fail("the router closed the call")
            raise
        self._fail(why)

    def _fail(self, why: str) -> None:
        """Fails the call and every request waiting on it with UNAVAILABLE."""
        if self.failed is None:
            self.failed = UpstreamError(_TOKENIZER, self._target, grpc.StatusCode.UNAVAILABLE,
                                        f"the Multiplex call failed: {why}")
            if self._waiting:
                log.warning("tokenizer_call_failed", tokenizer=self._target, why=why,
                            waiting_requests=len(self._waiting))
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(self.failed)
        self._waiting.clear()
        self._call.cancel()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()

    async def close(self) -> None:
        self._reader.cancel()
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


# --------------------------------------------------------------------------- #
# Cache.


class CacheClient:
    """Client of ``llmesh.v1.CacheService``; optional, so it never fails a request.

    Any RPC error (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is logged as a warning
    and reported as a miss / not stored.
    """

    service = "cache"

    def __init__(self, target: str, *, timeout: float = 0.5) -> None:
        """Args:
          target: ``host:port`` of the cache service.
          timeout: the most seconds one cache call may take (also bounded by
            the client's deadline): a slow cache must not slow requests.
        """
        self.target = target
        self.timeout = timeout
        self._channel = make_channel(target)
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)

    async def wait_until_serving(self, timeout: float) -> None:
        """See :func:`wait_until_serving`."""
        await wait_until_serving(self._channel, service=self.service, target=self.target,
                                 timeout=timeout)

    def _timeout(self, deadline: float | None) -> float:
        remaining = timeout_until(deadline)
        return self.timeout if remaining is None else min(self.timeout, remaining)

    async def get(self, key: CacheKey, *, request_id: str,
                  deadline: float | None) -> CachedResponse | None:
        """The cached response for ``key``, or None (miss, or any cache error)."""
        try:
            reply = await self._stub.GetCachedResponse(
                cache_pb2.GetCachedResponseRequest(key=key.to_pb()),
                timeout=self._timeout(deadline), metadata=request_id_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            log.warning("cache_get_failed", target=self.target, code=err.code().name,
                        details=err.details())
            return None
        if not reply.found:
            return None
        r = reply.response
        return CachedResponse(tuple(r.token_ids), r.text, finish_reason_of(r.finish_reason),
                              r.matched_stop)

    async def put(self, key: CacheKey, response: CachedResponse, *, request_id: str) -> bool:
        """Stores ``response``; True when the cache kept it (False on any error)."""
        request = cache_pb2.PutCachedResponseRequest(
            key=key.to_pb(),
            response=cache_pb2.CachedResponse(
                token_ids=list(response.token_ids), text=response.text,
                finish_reason=int(response.finish_reason), matched_stop=response.matched_stop,
            ),
        )
        try:
            reply = await self._stub.PutCachedResponse(
                request, timeout=self.timeout, metadata=request_id_metadata(request_id))
        except grpc.aio.AioRpcError as err:
            log.warning("cache_put_failed", target=self.target, code=err.code().name,
                        details=err.details())
            return False
        return reply.stored

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
        await self._channel.close()
