"""Requests the OpenAI endpoint cannot parse or take: OpenAI's error shape.

aiohttp refuses a request it cannot parse (a header line over
``max_field_size``, too many headers, a malformed request line) before any
handler or middleware runs: its ``RequestHandler.handle_error`` answered a
plain-text 400 and logged the error with its traceback at error level. The
router's connections use :class:`JsonErrorRequestHandler` instead, which
answers in OpenAI's error shape and logs one ``http_request_unparsable``
warning (status, reason, peer), no traceback:

* a request line or header line over :data:`MAX_HEADER_LINE_BYTES`
  (aiohttp's ``LineTooLong``, which does not say which): 431
  ``request_header_fields_too_large`` (RFC 6585); the line is not quoted (it
  may be a credential);
* anything else aiohttp refuses as malformed (``BadHttpMessage``, its status
  kept: 400): ``invalid_request_error``.

The limits (:data:`MAX_HEADER_LINE_BYTES`) are the gRPC servers' metadata
limit, above the 96 KiB Envoy forwards: a header Envoy let through reaches the
router on HTTP as on gRPC (where an unusable ``traceparent`` is ignored and
counted by :mod:`services.common.tracing`).

A body over the app's ``client_max_size`` (aiohttp raises
``HTTPRequestEntityTooLarge`` from ``request.read()``, which the handlers
caught as a bug: 500) is :func:`request_too_large`: 413
``request_too_large``, naming the limit. Envoy's own 413 on the OpenAI
routes (its ``max_request_bytes``, lower) has the same shape
(``services.cli.envoy_config``).

aiohttp (3.14) builds its ``RequestHandler`` in ``Server.__call__``, which
:class:`OpenAIAppRunner` replaces through ``AppRunner._make_server`` (no
public hook exists for the error answer).
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web, web_protocol, web_server
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_request import BaseRequest

from services.common.grpc_util import MAX_METADATA_BYTES
from services.router.openai_format import OpenAIError

log = structlog.get_logger()

#: Most bytes of the request line and of one header line (aiohttp's default: 8190).
MAX_HEADER_LINE_BYTES = MAX_METADATA_BYTES
#: The longest reason quoted in the answer and the log line.
_REASON_CHARS = 200


def unparsable_error(exc: HttpProcessingError) -> OpenAIError:
    """The OpenAI error answer for a request aiohttp could not parse."""
    if isinstance(exc, LineTooLong):
        return OpenAIError(431, f"request header fields too large: a line of the request "
                           f"is over {MAX_HEADER_LINE_BYTES} bytes", "invalid_request_error",
                           None, "request_header_fields_too_large")
    reason = " ".join(str(exc.message).split())[:_REASON_CHARS]
    return OpenAIError(exc.code if 400 <= exc.code < 500 else 400,
                       f"malformed HTTP request: {reason}", "invalid_request_error", None,
                       "malformed_request")


def request_too_large(limit_bytes: int) -> OpenAIError:
    """The OpenAI error for a request body over ``limit_bytes`` (HTTP 413)."""
    return OpenAIError(413, f"request body too large: this endpoint takes at most {limit_bytes} "
                       "bytes; send a shorter prompt or fewer, smaller tools",
                       "invalid_request_error", None, "request_too_large")


class JsonErrorRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering unparsable requests in OpenAI's
    error shape with one warning line (see the module doc); other errors as
    aiohttp does."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        err = unparsable_error(exc)
        log.warning("http_request_unparsable", status=err.status, reason=err.message,
                    peer=request.remote)
        response = web.json_response(err.body(), status=err.status)
        response.force_close()
        return response


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`JsonErrorRequestHandler`
    with the :data:`MAX_HEADER_LINE_BYTES` limits."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, max_line_size=MAX_HEADER_LINE_BYTES,
                         max_field_size=MAX_HEADER_LINE_BYTES, **kwargs)

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same state; only how connections are made differs
        return server
