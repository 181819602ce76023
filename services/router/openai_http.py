"""The router's OpenAI-compatible HTTP server (aiohttp), on its own port.

Routes (OpenAI API reference; vLLM's OpenAI-compatible server for the extras):

* ``POST /v1/chat/completions``, ``POST /v1/completions``: the body is parsed
  by :mod:`services.router.openai_protocol` into a ``GenerateRequest``, then
  runs exactly the gRPC path: :meth:`RouterService.validate`
  (``validate_request``: every range check and message), then the model's
  :meth:`GenerationPipeline.run` (admission, routing, stop strings). Answers
  are formatted by :mod:`services.router.openai_format`.
* ``GET /v1/models``: the served models in OpenAI's list shape (with vLLM's
  ``max_model_len``); ``GET /v1/models/{id}`` one of them.
* ``POST /tokenize``, ``POST /detokenize``: vLLM's tokenizer endpoints
  (:mod:`services.router.openai_tokenize`), same auth and error shapes.
* Anything else: 404 in OpenAI's error shape (a known path with the wrong
  method: 405). A body over :data:`MAX_BODY_BYTES`: 413
  ``request_too_large``. A request aiohttp cannot parse (a header line over
  256 KiB, a malformed request line): 431 or 400 in the same shape, one
  warning line (:mod:`services.router.openai_http_errors`). Every error this
  server answers has OpenAI's shape, ``{"error": {"message", "type",
  "param", "code"}}``.

Streaming (``stream: true``): Server-Sent Events, ``data: {chunk}\\n\\n`` per
router event as it arrives (each written to the socket at once: no buffering
here; Envoy streams HTTP/1.1 chunked bodies as they come), then
``data: [DONE]\\n\\n``. The response starts only when the first event is
there, so refusals before it (400, 404, 429, 503...) keep their HTTP status;
an error after it is one ``data: {"error": ...}`` event, then the stream ends
(no ``[DONE]``).

Auth (:mod:`services.router.tenancy`, the router runs with ``--api-keys``):
the key comes in ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``, as on
gRPC. No key or an unknown one: 401 (``code`` ``missing_api_key`` /
``invalid_api_key``, type ``invalid_request_error``, as OpenAI answers a
bad key); a model the key's tenant may not use: 403 (``model_not_allowed``).
``GET /v1/models`` lists only the tenant's models. A tenant over one of its
limits: 429 with ``Retry-After``, like an admission refusal.

Statuses (:func:`error_for_status`): 400 invalid (``param`` = the OpenAI
parameter), 404 unknown model (the message lists the served ids) or route,
429 admission refusal with ``Retry-After`` (seconds, from the router's drain
rate), 503 starting / draining / no engine, 504 deadline
(``x-request-timeout`` header, seconds), 500 a bug (the message has the
request id). A field the engine cannot honour is a 400 naming it, never a
5xx (which the official client retries).

Disconnect: the server runs with ``handler_cancellation``, so a client that
goes away cancels its handler task wherever it waits; the pipeline's
``finally`` blocks then cancel the engine sequence (its KV blocks are freed).
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from aiohttp import web
from llmesh.v1 import generation_pb2

from services.common.logging import REQUEST_ID_METADATA_KEY, bind_request_id
from services.common.tracing import TRACEPARENT, TRACESTATE
from services.common.sampling import InvalidRequestError
from services.router.generation import (
    RETRY_AFTER_METADATA_KEY,
    Delta,
    Event,
    Finished,
    GenerationError,
)
from services.router.openai_format import OpenAIError, ResponseBuilder, error_for_status
from services.router.openai_http_errors import OpenAIAppRunner, request_too_large
from services.router.prompt_echo import echo_request
from services.router.retrieval.openai import EMBEDDINGS_PATH, embeddings, retrieval_headers
from services.router.openai_protocol import (
    Endpoint,
    OpenAIRequest,
    load_body,
    openai_param,
    parse_request,
)
from services.router.openai_tokenize import (
    DETOKENIZE_PATH,
    TOKENIZE_PATH,
    Validate,
    detokenize,
    tokenize,
)
from services.router.api_keys import API_KEY_HEADER, AUTHORIZATION_HEADER, Tenant
from services.router.cascade.policy import MODE_HEADER
from services.router.tenancy import AuthError
from services.router.validation import TENANT_METADATA_KEY, UNKNOWN_MODEL_CODE, ModelLimits

if TYPE_CHECKING:
    from services.router.service import RouterService

log = structlog.get_logger()

#: Header with the request's time limit in seconds (the HTTP edge's deadline).
TIMEOUT_HEADER = "x-request-timeout"
#: Most bytes of a request body (a context window of text is far less).
MAX_BODY_BYTES = 16 * 1024 * 1024
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _json_error(err: OpenAIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers())


class OpenAIServer:
    """The aiohttp app and its listener; one per router process.

    Args:
      router: the gRPC service whose validation and pipeline it shares.
      host, port: where to listen (port 0: a free one).
    """

    def __init__(self, router: RouterService, host: str, port: int) -> None:
        self.router = router
        self.host = host
        self.port = port
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._http_errors])
        app.router.add_post(Endpoint.CHAT.value, self._chat)
        app.router.add_post(Endpoint.COMPLETIONS.value, self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post(TOKENIZE_PATH, self._tokenize)
        app.router.add_post(DETOKENIZE_PATH, self._detokenize)
        app.router.add_post(EMBEDDINGS_PATH, self._embeddings)
        return app

    async def start(self) -> int:
        """Listens; returns the bound port."""
        self._runner = OpenAIAppRunner(self.app(), handler_cancellation=True, access_log=None,
                                       shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port (of port 0) only here
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stops listening; requests still running get a second, then are cancelled."""
        if self._runner is not None:
            await self._runner.cleanup()

    # ---------------------------------------------------------------- routes

    @web.middleware
    async def _http_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's routing errors (no route, wrong method) in OpenAI's error
        shape instead of its plain text; the handlers answer every other error
        themselves (:meth:`_error`)."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _json_error(OpenAIError(
                404, f"unknown route {request.method} {request.path}; this server has POST "
                "/v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, "
                "POST /detokenize and POST /v1/embeddings",
                "invalid_request_error", None, "unknown_url"))
        except web.HTTPMethodNotAllowed as err:
            return _json_error(OpenAIError(
                405, f"{request.path} takes {', '.join(sorted(err.allowed_methods))}",
                "invalid_request_error", None, "method_not_allowed"))

    def _tenant(self, request: web.Request) -> Tenant | None:
        """The caller's tenant (None: auth off). Raises AuthError (401)."""
        return self.router.authenticate(request.headers.get(AUTHORIZATION_HEADER),
                                        request.headers.get(API_KEY_HEADER))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
        except AuthError as err:
            return _json_error(_auth_error(err))
        return web.json_response({"object": "list", "data": [
            self._card(m) for m in self.router.model_cards(tenant)]})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            tenant = self._tenant(request)
        except AuthError as err:
            return _json_error(_auth_error(err))
        card = next((m for m in self.router.model_cards(tenant) if m.model == name), None)
        if card is None:
            return _json_error(self._unknown_model(name))
        return web.json_response(self._card(card))

    def _card(self, limits: ModelLimits) -> dict[str, Any]:
        return {"id": limits.model, "object": "model", "created": self.created,
                "owned_by": "llmesh", "max_model_len": limits.max_model_len}

    def _unknown_model(self, name: str) -> OpenAIError:
        known = ", ".join(repr(m) for m in sorted(self.router.models))
        return error_for_status(UNKNOWN_MODEL_CODE, f"The model {name!r} does not exist; this "
                                f"mesh serves {known}", unknown_model=True)

    async def _tokenize(self, request: web.Request) -> web.Response:
        async def answer(validate: Validate, data: dict[str, Any], request_id: str,
                         deadline: float | None) -> dict[str, Any]:
            return await tokenize(self.router, validate, data, request_id=request_id,
                                  deadline=deadline)
        return await self._tokenizer_call(request, answer)

    async def _detokenize(self, request: web.Request) -> web.Response:
        async def answer(validate: Validate, data: dict[str, Any], _: str,
                         __: float | None) -> dict[str, Any]:
            return detokenize(self.router, validate, data)
        return await self._tokenizer_call(request, answer)

    async def _embeddings(self, request: web.Request) -> web.Response:
        async def answer(_: Validate, data: dict[str, Any], request_id: str,
                         deadline: float | None) -> dict[str, Any]:
            return await embeddings(self.router.retrieval, data, request_id=request_id,
                                    deadline=deadline)
        return await self._tokenizer_call(request, answer)

    async def _tokenizer_call(self, request: web.Request, answer: Callable[
            [Validate, dict[str, Any], str, float | None], Awaitable[dict[str, Any]]]
                              ) -> web.Response:
        """Authenticates, reads the body, answers with ``answer`` (errors in
        OpenAI's shape, as for a generation)."""
        received_at = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_METADATA_KEY) or uuid.uuid4().hex
        try:
            deadline = _deadline(request, received_at)
            tenant = self._tenant(request)
            self.router.check_accepting()
            data = load_body(await request.read())
            validate = functools.partial(
                self.router.validate, request_id=request_id,
                header_request_id=request.headers.get(REQUEST_ID_METADATA_KEY),
                header_tenant=request.headers.get(TENANT_METADATA_KEY), tenant=tenant)
            body = await answer(validate, data, request_id, deadline)
        except Exception as err:  # noqa: BLE001 - every refusal becomes an OpenAI error
            return _json_error(self._error(err, None, request_id))
        return web.json_response(body, headers={"x-request-id": request_id})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    # ------------------------------------------------------------ generation

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        received_at = time.monotonic()
        header_id = request.headers.get(REQUEST_ID_METADATA_KEY)
        request_id = uuid.uuid4().hex
        bind_request_id(request_id)
        parsed: OpenAIRequest | None = None
        try:
            tenant = self._tenant(request)
            parsed = parse_request(endpoint, await request.read())
            if header_id:
                request_id = header_id  # checked by validation (x-request-id)
            validated = self.router.validate(
                parsed.generate, request_id, header_request_id=header_id,
                header_tenant=request.headers.get(TENANT_METADATA_KEY), tenant=tenant,
                traceparent=request.headers.get(TRACEPARENT),
                tracestate=request.headers.get(TRACESTATE),
                header_cascade=request.headers.get(MODE_HEADER))
            bind_request_id(request_id)
            self.router.check_accepting()
            deadline = _deadline(request, received_at)
            echo = None
            if parsed.echo and validated.cascade is not None:
                raise InvalidRequestError("echo", "is for a named model: the cascade's "
                                          "models tokenize the prompt apart")
            if parsed.echo:
                validated, echo = await echo_request(
                    self.router.pipeline_for(validated), validated, only=parsed.echo_only,
                    deadline=deadline)
            events = self.router.run(tenant, validated, received_at=received_at,
                                     deadline=deadline)
        except Exception as err:  # noqa: BLE001 - every refusal becomes an OpenAI error
            self.router.count_refused(parsed.generate if parsed else
                                      generation_pb2.GenerateRequest(), _code(err))
            return _json_error(self._error(err, parsed, request_id))
        builder = ResponseBuilder(endpoint, request_id, validated.model,
                                  logprobs=validated.sampling.logprobs is not None,
                                  include_usage=parsed.include_usage, echo=echo,
                                  show_prompt_logprobs=parsed.prompt_logprobs)
        choices = validated.sampling.n
        if parsed.stream:
            return await self._stream(request, events, builder, choices, parsed, request_id)
        try:
            async for event in _until_all_finished(events, choices):
                builder.add(event)
        except Exception as err:  # noqa: BLE001 - becomes an OpenAI error
            return _json_error(self._error(err, parsed, request_id))
        return web.json_response(builder.response(), headers={
            "x-request-id": request_id, **_path_headers(builder),
            **retrieval_headers(builder.retrieval)})

    async def _stream(self, request: web.Request, events: AsyncIterator[Event],
                      builder: ResponseBuilder, choices: int, parsed: OpenAIRequest,
                      request_id: str) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        stream = _until_all_finished(events, choices)
        try:
            async for event in stream:
                chunks = builder.chunks(event)
                if response is None:  # the first event: errors before it keep their status
                    response = web.StreamResponse(headers={
                        **_SSE_HEADERS, "x-request-id": request_id, **_path_headers(builder)})
                    await response.prepare(request)
                for chunk in chunks:
                    await response.write(_sse(chunk))
            if response is None:
                response = web.StreamResponse(headers=_SSE_HEADERS)
                await response.prepare(request)
            if builder.include_usage:
                await response.write(_sse(builder.usage_chunk()))
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            raise  # the client left: aclose below cancels the generation
        except Exception as err:  # noqa: BLE001 - an error event, or the status
            error = self._error(err, parsed, request_id)
            if response is None:
                return _json_error(error)
            await response.write(_sse(error.body()))
        finally:
            await stream.aclose()
        await response.write_eof()
        return response

    def _error(self, err: BaseException, parsed: OpenAIRequest | None,
               request_id: str) -> OpenAIError:
        if isinstance(err, AuthError):
            return _auth_error(err)
        if isinstance(err, web.HTTPRequestEntityTooLarge):  # from request.read()
            return request_too_large(MAX_BODY_BYTES)
        if isinstance(err, InvalidRequestError):
            if err.field == "model" and err.code == UNKNOWN_MODEL_CODE:
                return (self._unknown_model(parsed.model) if parsed is not None
                        else error_for_status(err.code, str(err), unknown_model=True))
            return error_for_status(err.code, _message(err, parsed),
                                    param=openai_param(err.field, parsed))
        if isinstance(err, GenerationError):
            if err.field is not None:  # an upstream refused a field: name the parameter
                return error_for_status(
                    err.code, _message(InvalidRequestError(err.field, err.message[
                        len(err.field) + 2:], err.code), parsed),
                    param=openai_param(err.field, parsed))
            retry = dict(err.trailing_metadata).get(RETRY_AFTER_METADATA_KEY)
            return error_for_status(err.code, err.message,
                                    retry_after_s=int(retry) if retry else None)
        log.error("internal_error", exc_info=err)
        return error_for_status(grpc.StatusCode.INTERNAL, f"internal error in the router "
                                f"(request_id={request_id}); see its logs")


#: A field of the gRPC API named inside a message (``sampling.top_p``,
#: ``sampling.structured_output.choice``).
_GRPC_FIELD = re.compile(r"\bsampling(?:\.[a-z_]+)+")


def _message(err: InvalidRequestError, parsed: OpenAIRequest | None) -> str:
    """The shared validation's message with every field it names (the one it is
    about, and any other it cites, such as the constraint beside
    ``min_tokens``) renamed as the client wrote it."""
    text = str(err)
    prefix = f"{err.field}:"
    if text.startswith(prefix):
        text = f"{openai_param(err.field, parsed)}:{text[len(prefix):]}"
    return _GRPC_FIELD.sub(lambda match: openai_param(match.group(0), parsed), text)


def _auth_error(err: AuthError) -> OpenAIError:
    """401 (no key, unknown key) or 403 (model not allowed) in OpenAI's shape."""
    if err.code == grpc.StatusCode.PERMISSION_DENIED:
        return OpenAIError(403, err.message, "invalid_request_error", "model", err.reason)
    code = "missing_api_key" if err.reason == "missing_key" else "invalid_api_key"
    return OpenAIError(401, err.message, "invalid_request_error", None, code)


def _code(err: BaseException) -> grpc.StatusCode:
    if isinstance(err, (InvalidRequestError, GenerationError, AuthError)):
        return err.code
    return grpc.StatusCode.INTERNAL


def _deadline(request: web.Request, received_at: float) -> float | None:
    """``received_at`` + the ``x-request-timeout`` header's seconds, or None.

    Raises:
      InvalidRequestError: the header is not a positive number.
    """
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidRequestError(TIMEOUT_HEADER, f"must be a positive number of seconds, "
                                                  f"got {value[:40]!r}")
    return received_at + seconds


def _path_headers(builder: ResponseBuilder) -> dict[str, str]:
    """``x-llmesh-model`` and ``x-llmesh-cascade-path`` for an answer to the
    cascade alias (:class:`~services.router.cascade.path.AnswerPath`), else none."""
    return {} if builder.path is None else builder.path.headers()


async def _until_all_finished(events: AsyncIterator[Event], choices: int
                              ) -> AsyncIterator[Delta | Finished]:
    """The pipeline's events until each of ``choices`` has finished; closes
    the pipeline's stream when left early (client gone)."""
    finished = 0
    try:
        async for event in events:
            yield event
            if isinstance(event, Finished):
                finished += 1
                if finished >= choices:
                    return
    finally:
        await events.aclose()  # type: ignore[attr-defined]


__all__ = ["TIMEOUT_HEADER", "OpenAIServer"]
