"""``llmesh.v1.TokenizerService``: the model's tokenizer and chat template over gRPC.

Calls and their gRPC statuses:

* ``Tokenize``: text to ids. Texts longer than ``inline_encode_max_chars``
  are encoded on a worker thread with the GIL released, so a long input never
  stalls the event loop (other calls, health checks); short ones run inline
  (a thread hop costs more than encoding them).
* ``ApplyChatTemplate``: chat messages to prompt ids, trimmed to
  ``max_prompt_tokens`` (see :meth:`Tokenizer.apply_chat_template`). Special-
  token text in message content is tokenized as plain text unless the request
  sets ``allow_special_tokens``. INVALID_ARGUMENT: no messages, an empty role
  or one outside ``chat_roles`` (the message names ``messages[i].role`` and
  lists the roles), or the template rejected the conversation.
  FAILED_PRECONDITION: the model has no chat template.
  OUT_OF_RANGE: even the system message(s) plus the last message do not fit.
* ``Multiplex`` (bidi): ``Tokenize`` and ``ApplyChatTemplate`` requests of
  many callers' requests on one long-lived call (the router keeps one), each
  message carrying a ``call_id`` that its one answer echoes with the status the
  unary call would have returned (the call goes on past a failed request). A
  short input is answered before the next message is read; a long one (over
  ``inline_encode_max_chars``) runs in its own task, so it holds up no later
  request. INVALID_ARGUMENT ends the call when a ``call_id`` is reused while
  its request is open. Counted and logged as the unary calls are.
* ``Detokenize`` (bidi): one stream per generated sequence. One response per
  request message, carrying the text that the ids so far made final (see
  :class:`IncrementalDetokenizer`); never half a UTF-8 character.
  ``skip_special_tokens`` and ``token_text_ends`` are read from the first
  message only; with ``token_text_ends`` each response also says, per id,
  how much of its text was final after that id. A message with
  ``flush`` also returns the held-back text and ends the sequence: a later
  message on the same stream starts a new sequence (same
  ``skip_special_tokens``). INVALID_ARGUMENT (ending the stream) for an id
  that is negative or not below the vocabulary size.
* ``GetTokenizerInfo``: model name, vocabulary size, EOS/BOS ids, whether a
  chat template exists, and the chat roles it accepts.
* ``GetTokenizer`` (server streaming): the ``tokenizers`` JSON definition that
  Detokenize decodes with, in chunks of :data:`DEFINITION_CHUNK_BYTES`, with its
  SHA-256 and size on the first message; serialized once, in :meth:`start`.
  The router decodes in process from it (no round trip per token).

Every call answers UNAVAILABLE before :meth:`TokenizerService.start` finished
and after :meth:`TokenizerService.drain` began (open Detokenize streams keep
running). An unexpected exception answers INTERNAL and is logged; the
service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import structlog

from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import tracing
from services.common.detokenizer import DEFINITION_FORMAT, IncrementalDetokenizer
from services.common.grpc_util import request_id_from
from services.common.logging import bind_request_id
from services.common.mux import MuxServer, ProtocolViolation, never_merge
from services.common.wire.chat import ChatMessage
from services.common.wire.tools import FunctionTool
from services.tokenizer.metrics import TokenizerMetrics, default_metrics
from services.tokenizer.status import status_of_error
from services.tokenizer.tokenizer import (
    DEFAULT_CHAT_ROLES,
    DEFAULT_INLINE_ENCODE_MAX_CHARS,
    Tokenizer,
)

log = structlog.get_logger()

_T = TypeVar("_T")

_METHODS = ("Tokenize", "ApplyChatTemplate", "Detokenize", "GetTokenizerInfo", "GetTokenizer")
#: Calls that make a request's prompt: one ``tokenize_finished`` log line each.
_PROMPT_METHODS = frozenset({"Tokenize", "ApplyChatTemplate"})
#: Bytes of the tokenizer definition per GetTokenizer message (well under
#: gRPC's default 4 MiB receive limit).
DEFINITION_CHUNK_BYTES = 1 << 20
#: Characters of a Multiplex message's request_id kept for the log (the router's
#: ids are at most 128).
_MAX_LOGGED_REQUEST_ID = 128
_SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name

class _Unavailable(Exception):
    """Not serving (loading or draining): gRPC UNAVAILABLE."""


def _status_of(err: Exception) -> grpc.StatusCode:
    if isinstance(err, _Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    return status_of_error(err)


class TokenizerService(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """The tokenizer service; implements :class:`services.common.server.Service`."""

    service_names = (_SERVICE_NAME,)

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        model_name: str | None = None,
        chat_template: str | None = None,
        chat_roles: Sequence[str] = DEFAULT_CHAT_ROLES,
        inline_encode_max_chars: int = DEFAULT_INLINE_ENCODE_MAX_CHARS,
        encode_threads: int = 2,
        metrics: TokenizerMetrics | None = None,
    ) -> None:
        """Args:
          model_path: GGUF file or Hugging Face checkpoint directory whose
            tokenizer to load in :meth:`start`.
          tokenizer: an already loaded tokenizer instead (tests share one).
          model_name: name reported by GetTokenizerInfo (default: from the file name).
          chat_template: Jinja chat template used instead of the GGUF's own
            (only with ``model_path``; an already loaded tokenizer keeps its own).
          chat_roles: the message roles ApplyChatTemplate accepts (only with
            ``model_path``).
          inline_encode_max_chars: longer texts are encoded on a worker thread.
          encode_threads: worker threads for long encodes.
          metrics: where to count (default: the process registry).

        Raises:
          ValueError: neither ``model_path`` nor ``tokenizer`` given.
        """
        if model_path is None and tokenizer is None:
            raise ValueError("TokenizerService needs model_path or tokenizer")
        self._model_path = model_path
        self._model_name = model_name
        self._chat_template = chat_template
        self._chat_roles = tuple(chat_roles)
        self._tok: Tokenizer | None = tokenizer
        self._inline_max = inline_encode_max_chars
        self._threads = max(1, encode_threads)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="tokenize")
        self._ready = False
        self._draining = False
        self._info_reply: tokenizer_pb2.GetTokenizerInfoResponse | None = None
        self._definition: bytes = b""
        self._definition_sha256 = ""
        self._metrics = metrics or default_metrics()
        self._durations = {m: self._metrics.request_duration.labels(m) for m in _METHODS}
        self._ok = {m: self._metrics.requests.labels(m, "OK") for m in _METHODS}
        self._tokens = {m: self._metrics.tokens.labels(m) for m in _METHODS}

    # -- Service protocol ---------------------------------------------------

    def register(self, server: grpc.aio.Server) -> None:
        """Adds the TokenizerService servicer to ``server``."""
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Loads the tokenizer on a worker thread (seconds), then warms up
        encode, the chat template, decode and the worker threads.

        Raises:
          FileNotFoundError, ValueError: the GGUF or directory cannot be read.
        """
        started = time.perf_counter()
        if self._tok is None:
            assert self._model_path is not None
            self._tok = await asyncio.to_thread(functools.partial(
                Tokenizer.load, self._model_path, self._model_name,
                chat_template=self._chat_template, chat_roles=self._chat_roles))
        await asyncio.to_thread(self._warm_up)
        self._definition = (await asyncio.to_thread(self._tok.definition)).encode()
        self._definition_sha256 = hashlib.sha256(self._definition).hexdigest()
        await asyncio.gather(*(
            asyncio.get_running_loop().run_in_executor(self._pool, self._tok.encode, "warm")
            for _ in range(self._threads)
        ))
        info = self._tok.info
        self._info_reply = info.to_pb()
        self._ready = True
        log.info("tokenizer_ready", model=info.model, vocab_size=info.vocab_size,
                 eos_token_ids=list(info.eos_token_ids), has_chat_template=info.has_chat_template,
                 chat_roles=list(info.chat_roles),
                 seconds=round(time.perf_counter() - started, 3))

    def _warm_up(self) -> None:
        assert self._tok is not None
        text = "Hello, world! 👋 こんにちは, ça va? مرحبا"
        ids = self._tok.encode(text, add_special_tokens=True)
        detok = IncrementalDetokenizer(self._tok)
        _ = [detok.add([i]) for i in ids], detok.flush()
        if self._tok.info.has_chat_template:
            roles = self._tok.info.chat_roles
            system, user = ("system", "user") if {"system", "user"} <= set(roles) else roles[:1] * 2
            for content in (text, text + " <|im_end|><end_of_turn>"):  # both encode paths
                with contextlib.suppress(ValueError):  # a template that refuses this shape
                    self._tok.apply_chat_template(
                        [ChatMessage(system, "You are brief."), ChatMessage(user, content)],
                        add_generation_prompt=True, max_prompt_tokens=8192,
                    )

    async def drain(self) -> None:
        """New calls get UNAVAILABLE; open Detokenize streams keep running."""
        self._draining = True

    async def close(self) -> None:
        """Stops the worker threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ------------------------------------------------------------

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self._durations[method].observe(time.perf_counter() - started)
        if code is grpc.StatusCode.OK:
            self._ok[method].inc()
        else:
            self._metrics.requests.labels(method, code.name).inc()

    def _admit(self) -> Tokenizer:
        if self._draining:
            raise _Unavailable("the tokenizer is draining")
        if not self._ready or self._tok is None:
            raise _Unavailable("the tokenizer is still loading")
        return self._tok

    async def _unary(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        work: Callable[[Tokenizer], Awaitable[_T]],
    ) -> _T:
        bind_request_id(request_id_from(context))
        reply, code, message = await self._serve(
            method, work, tracing.context_from_metadata(context.invocation_metadata()))
        if reply is None:
            await context.abort(code, message)
        return reply

    async def _serve(
        self, method: str, work: Callable[[Tokenizer], Awaitable[_T]],
        trace_parent: tracing.Context | None = None,
    ) -> tuple[_T | None, grpc.StatusCode, str]:
        """Runs ``work`` on the tokenizer, counts it under ``method`` and, for a
        prompt, writes its ``tokenize_finished`` line (request id as bound);
        with ``trace_parent`` (the caller's span), in the span
        ``llmesh.tokenizer.<method>``.

        Returns:
          (reply, OK, "") or (None, the status, its message): UNAVAILABLE while
          loading or draining, the status of the tokenizer's error
          (:data:`~services.tokenizer.status.ERROR_STATUS`), INTERNAL (logged) for anything else.
        """
        started = time.perf_counter()
        try:
            with tracing.span(f"llmesh.tokenizer.{method}", trace_parent):
                reply = await work(self._admit())
        except asyncio.CancelledError:
            self._record(method, grpc.StatusCode.CANCELLED, started)
            raise
        except Exception as err:  # mapped to a status; the service keeps serving
            return None, *self._failed(method, err, started)
        self._record(method, grpc.StatusCode.OK, started)
        if method in _PROMPT_METHODS:
            # One line per prompt, written after the reply is on its way (the
            # next loop turn), off the request's first-token path.
            asyncio.get_running_loop().call_soon(functools.partial(
                log.info, "tokenize_finished", method=method,
                tokens=len(getattr(reply, "token_ids", ())),
                handler_ms=round((time.perf_counter() - started) * 1e3, 3)))
        return reply, grpc.StatusCode.OK, ""

    def _failed(self, method: str, err: Exception,
                started: float) -> tuple[grpc.StatusCode, str]:
        """Counts and logs a failed call; returns its status and message
        (INTERNAL for an unexpected exception, logged with its traceback)."""
        code = _status_of(err)
        self._record(method, code, started)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("tokenizer_internal_error", method=method)
            return code, f"internal error: {type(err).__name__}: {err}"
        log.info("tokenizer_request_rejected", method=method, code=code.name, error=str(err))
        return code, str(err)

    async def _offload(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _is_long(self, request: tokenizer_pb2.TokenizeRequest
                 | tokenizer_pb2.ApplyChatTemplateRequest) -> bool:
        """True when ``request``'s text is encoded on a worker thread."""
        if isinstance(request, tokenizer_pb2.TokenizeRequest):
            return len(request.text) > self._inline_max
        return sum(len(m.content) for m in request.messages) > self._inline_max

    async def _admit_call(self, method: str, context: grpc.aio.ServicerContext,
                          started: float) -> Tokenizer:
        """The tokenizer for a streaming call (its request id bound); while loading
        or draining the call ends UNAVAILABLE (counted)."""
        bind_request_id(request_id_from(context))
        try:
            return self._admit()
        except _Unavailable as err:
            self._record(method, grpc.StatusCode.UNAVAILABLE, started)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            raise  # unreachable: abort raises

    async def _tokenize(self, tok: Tokenizer, request: tokenizer_pb2.TokenizeRequest,
                        ) -> tokenizer_pb2.TokenizeResponse:
        text, special = request.text, request.add_special_tokens
        if self._is_long(request):
            ids = await self._offload(tok.encode, text, special)
        else:
            ids = tok.encode(text, special)
        self._tokens["Tokenize"].inc(len(ids))
        log.debug("tokenized", chars=len(text), tokens=len(ids))
        return tokenizer_pb2.TokenizeResponse(token_ids=ids)

    async def _apply_chat_template(self, tok: Tokenizer,
                                   request: tokenizer_pb2.ApplyChatTemplateRequest,
                                   ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        messages = [ChatMessage.from_pb(m) for m in request.messages]
        args = (messages, request.add_generation_prompt, request.max_prompt_tokens,
                request.allow_special_tokens, [FunctionTool.from_pb(t) for t in request.tools])
        if self._is_long(request):
            prompt = await self._offload(tok.apply_chat_template, *args)
        else:
            prompt = tok.apply_chat_template(*args)
        self._tokens["ApplyChatTemplate"].inc(len(prompt.token_ids))
        if prompt.num_dropped_messages:
            self._metrics.dropped_messages.inc(prompt.num_dropped_messages)
        log.debug("chat_template_applied", messages=len(messages),
                  tokens=len(prompt.token_ids), dropped=prompt.num_dropped_messages)
        return prompt.to_pb()

    async def _answer(self, message: tokenizer_pb2.TokenizerServiceMultiplexRequest,
                      ) -> tokenizer_pb2.TokenizerServiceMultiplexResponse:
        """One Multiplex request's answer: the unary call's reply or status."""
        answer = tokenizer_pb2.TokenizerServiceMultiplexResponse(call_id=message.call_id)
        kind = message.WhichOneof("request")
        if kind == "tokenize":
            reply, code, text = await self._serve(
                "Tokenize", functools.partial(self._tokenize, request=message.tokenize),
                tracing.context_of(message.traceparent))
            if reply is not None:
                answer.tokenize.CopyFrom(reply)
        elif kind == "apply_chat_template":
            reply, code, text = await self._serve(
                "ApplyChatTemplate", functools.partial(
                    self._apply_chat_template, request=message.apply_chat_template),
                tracing.context_of(message.traceparent))
            if reply is not None:
                answer.apply_chat_template.CopyFrom(reply)
        else:
            code, text = grpc.StatusCode.INVALID_ARGUMENT, (
                "request: set `tokenize` or `apply_chat_template`")
            self._metrics.requests.labels("Multiplex", code.name).inc()
            log.info("tokenizer_request_rejected", method="Multiplex", code=code.name, error=text)
        answer.status_code, answer.status_message = code.value[0], text
        return answer

    # -- RPCs -----------------------------------------------------------------

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        """Text to ids (UNAVAILABLE while loading or draining)."""
        return await self._unary("Tokenize", context,
                                 functools.partial(self._tokenize, request=request))

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        """Chat messages to prompt ids; see the module docstring for statuses."""
        return await self._unary("ApplyChatTemplate", context,
                                 functools.partial(self._apply_chat_template, request=request))

    async def Multiplex(
        self, request_iterator: AsyncIterator[tokenizer_pb2.TokenizerServiceMultiplexRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.TokenizerServiceMultiplexResponse]:
        """Tokenize / ApplyChatTemplate requests on one call, one answer each
        (see the module docstring). A short input is answered before the next
        message is read; a long one runs in its own task, so it holds up no other.
        Ends INVALID_ARGUMENT when a ``call_id`` is reused while still open."""
        server: MuxServer[int, tokenizer_pb2.TokenizerServiceMultiplexResponse] = MuxServer(
            merge=never_merge, pack=dict.values)
        answer_order = itertools.count()  # outbox keys: answers are never merged
        long_running: dict[int, asyncio.Task[None]] = {}

        async def answer_later(message: tokenizer_pb2.TokenizerServiceMultiplexRequest) -> None:
            try:
                server.outbox.put(next(answer_order), await self._answer(message))
            finally:
                long_running.pop(message.call_id, None)

        async def handle(message: tokenizer_pb2.TokenizerServiceMultiplexRequest) -> None:
            if message.call_id in long_running:
                raise ProtocolViolation(f"call_id {message.call_id} is still open on this "
                                        "call; use a new id for each request")
            # For the log line only; a caller's overlong id is cut, not trusted.
            bind_request_id(message.request_id[:_MAX_LOGGED_REQUEST_ID] or uuid.uuid4().hex)
            request = getattr(message, message.WhichOneof("request") or "tokenize")
            if self._is_long(request):
                long_running[message.call_id] = asyncio.create_task(answer_later(message))
            else:
                server.outbox.put(next(answer_order), await self._answer(message))

        async def finish() -> None:  # the caller half-closed: finish what it asked
            while long_running:
                await asyncio.wait(list(long_running.values()))

        try:
            async for answer in server.serve(request_iterator, context, handle=handle,
                                             finish=finish):
                yield answer
        finally:
            for task in list(long_running.values()):
                task.cancel()

    async def GetTokenizerInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.GetTokenizerInfoResponse:
        """Model name, vocabulary size, EOS/BOS ids, has_chat_template, chat_roles."""

        async def work(tok: Tokenizer) -> tokenizer_pb2.GetTokenizerInfoResponse:
            assert self._info_reply is not None
            return self._info_reply

        return await self._unary("GetTokenizerInfo", context, work)

    async def GetTokenizer(
        self, request: tokenizer_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.GetTokenizerResponse]:
        """The tokenizer's definition in chunks, with the chat template and special
        tokens on the first (UNAVAILABLE while loading or draining)."""
        started = time.perf_counter()
        tok = await self._admit_call("GetTokenizer", context, started)
        data, step = self._definition, DEFINITION_CHUNK_BYTES
        for offset in range(0, max(len(data), 1), step):
            reply = tokenizer_pb2.GetTokenizerResponse(definition_chunk=data[offset:offset + step])
            if offset == 0:
                reply.format = DEFINITION_FORMAT
                reply.total_bytes = len(data)
                reply.sha256 = self._definition_sha256
                reply.vocab_size = tok.info.vocab_size
                reply.chat_template = tok.chat_template or ""
                reply.special_tokens.update(tok.special_tokens)
            yield reply
        self._record("GetTokenizer", grpc.StatusCode.OK, started)

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        """Ids in, text deltas out: one response per request message. Deprecated
        in the proto (no llmesh service calls it: the router decodes in process
        from ``GetTokenizer``); kept for outside callers and as the tests'
        reference decoder."""
        started = time.perf_counter()
        tok = await self._admit_call("Detokenize", context, started)
        self._metrics.detokenize_streams.inc()
        tokens = self._tokens["Detokenize"]
        detok: IncrementalDetokenizer | None = None
        want_ends = False
        opened = started
        num_messages = num_tokens = 0
        outcome = "cancelled"  # unless the stream ends otherwise
        try:
            async for request in request_iterator:
                started = time.perf_counter()
                ids = list(request.token_ids)
                try:
                    if detok is None:
                        detok = IncrementalDetokenizer(tok, request.skip_special_tokens)
                        want_ends = request.token_text_ends
                    tok.check_token_ids(ids)
                    if want_ends:
                        text, ends = detok.add_with_ends(ids, flush=request.flush)
                    else:
                        text, ends = detok.add(ids), []
                        if request.flush:
                            text += detok.flush()
                except Exception as err:  # mapped to a status; ends this stream only
                    code, message = self._failed("Detokenize", err, started)
                    outcome = code.name.lower()
                    await context.abort(code, message)
                tokens.inc(len(ids))
                num_messages += 1
                num_tokens += len(ids)
                self._record("Detokenize", grpc.StatusCode.OK, started)
                yield tokenizer_pb2.DetokenizeResponse(text=text, token_text_ends=ends)
            outcome = "ok"
        finally:
            self._metrics.detokenize_streams.dec()
            # One line per stream (per generation), after its last answer: never text.
            log.info("detokenize_finished", outcome=outcome, messages=num_messages,
                     tokens=num_tokens, stream_ms=round((time.perf_counter() - opened) * 1e3, 3))
