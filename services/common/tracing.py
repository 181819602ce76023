"""Traces across the hops: OpenTelemetry spans, W3C trace context on every hop.

Off unless configured: :func:`configure` with an endpoint (the services'
``--otlp-traces-endpoint``, vLLM's flag name, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` environment variable) installs an SDK
``TracerProvider`` whose ``BatchSpanProcessor`` exports over OTLP/gRPC
(``host:port`` or ``http://host:port``: cleartext; ``https://host:port``:
TLS). Without one, every function here returns at its first line (no SDK
object is made, nothing is parsed) and :func:`start_span` gives None, which
every other function takes as "not traced".

A request's trace context travels as a W3C ``traceparent`` string
(``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``,
https://www.w3.org/TR/trace-context/): in gRPC metadata on unary calls
(:func:`metadata_of`, :func:`context_from_metadata`), in the per-request
``traceparent`` field on the long-lived multiplexed calls (router to engine
and tokenizer), and as the HTTP header on the OpenAI endpoint. A malformed
``traceparent`` is ignored (a new trace starts), as the W3C spec asks, and a
malformed ``tracestate`` is dropped (the parent kept): both are checked here
(:func:`context_of`) before OpenTelemetry's propagator sees them, which would
log a warning per request for an oversized value or a bad tracestate member,
and counted in ``llmesh:trace_context_invalid_total{header}`` instead of logged.

Spans of a request's stages that are known only by their timestamps (the
engine's queue, prefill and decode; the router's first token and decode) are
made once the request finished, with explicit start and end times
(:func:`record_span`), as vLLM does: never a span per token or per step.
Times given here are ``time.monotonic()`` seconds; they are converted to the
wall-clock nanoseconds OpenTelemetry wants.

Attribute names follow the OpenTelemetry gen_ai semantic conventions where
one exists (``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` ...),
else ``llmesh.*``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import prometheus_client
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span
from opentelemetry.trace.propagation import tracecontext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import _member_pattern as _TRACESTATE_MEMBER

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

#: The standard environment variable for the endpoint (used when no flag is given).
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
#: Its standard companion for the export timeout.
TIMEOUT_ENV = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
#: Seconds one export may take, retries included, unless :data:`TIMEOUT_ENV` is set.
EXPORT_TIMEOUT_S = 2.0
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# gen_ai semantic conventions (opentelemetry-semantic-conventions, gen_ai_attributes)
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.choice.count"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
RESPONSE_ID = "gen_ai.response.id"
# llmesh's own
REQUEST_ID = "llmesh.request_id"
TENANT = "llmesh.tenant"
REPLICA = "llmesh.replica"
CACHED_TOKENS = "llmesh.usage.cached_prompt_tokens"
OUTCOME = "llmesh.outcome"

_PROPAGATOR = TraceContextTextMapPropagator()
#: The propagator's length limits (512 and 8192 characters in 1.45): past them
#: it logs a warning per request.
TRACEPARENT_MAX_CHARS = TraceContextTextMapPropagator._TRACEPARENT_MAXIMUM_LENGTH
TRACESTATE_MAX_CHARS = tracecontext._TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH
INVALID_CONTEXT = prometheus_client.Counter(
    "llmesh:trace_context_invalid",
    "Incoming W3C trace context headers ignored as malformed or oversized (traceparent: "
    "a new trace started; tracestate: dropped, the parent kept).", ["header"])
#: The SDK provider while tracing is on (None: off, the default).
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
#: Wall-clock minus monotonic nanoseconds (:func:`wall_ns`).
_offset_ns = time.time_ns() - time.monotonic_ns()

Attributes = Mapping[str, str | int | float | bool | Sequence[str]]


def otlp_endpoint(value: str) -> str:
    """``--otlp-traces-endpoint``'s value checked (an ``argparse`` type):
    ``host:port``, ``http://host:port`` or ``https://host:port``, port in
    [1, 65535]; "" is tracing off.

    Raises:
      argparse.ArgumentTypeError: anything else (argparse reports it naming
        the flag), so a typo fails the start instead of logging an export
        error every batch.
    """
    if value == "":
        return value
    rest = value.split("://", 1)[1] if value.startswith(("http://", "https://")) else value
    host, sep, port = rest.rstrip("/").rpartition(":")
    if "://" in rest or not sep or not host or " " in host or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: expected host:port, "
                                         f"http://host:port or https://host:port")
    return value


def add_tracing_arguments(parser: object) -> None:
    """Adds ``--otlp-traces-endpoint`` to an ``argparse`` parser."""
    parser.add_argument(  # type: ignore[attr-defined]
        "--otlp-traces-endpoint", default=None, metavar="HOST:PORT|URL", type=otlp_endpoint,
        help="export OpenTelemetry traces over OTLP/gRPC to this collector (host:port or "
             "http://host:port: cleartext, https://...: TLS); default: "
             f"${ENDPOINT_ENV} if set, else tracing off")


def configure(service: str, endpoint: str | None, *,
              exporter: SpanExporter | None = None) -> bool:
    """Turns tracing on for this process when ``endpoint`` (else
    ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or ``exporter`` is given.

    Args:
      service: the ``service.name`` resource (``llmesh-<service>``).
      endpoint: the OTLP/gRPC collector, or None.
      exporter: export here instead (tests: the SDK's in-memory exporter),
        through a simple (synchronous) span processor.

    Returns:
      Whether tracing is on.
    """
    global _provider, _tracer, _offset_ns
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or None
    if endpoint is None and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"llmesh-{service}"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        assert endpoint is not None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        secure = endpoint.startswith("https://")
        # An export (retries included) gives up after EXPORT_TIMEOUT_S unless
        # the standard variable says otherwise: a collector that is down must
        # not hold a service's exit (the last export runs at shutdown).
        timeout = None if os.environ.get(TIMEOUT_ENV) else EXPORT_TIMEOUT_S
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, insecure=not secure, timeout=timeout)))
    _provider = provider
    _tracer = provider.get_tracer("llmesh." + service)
    _offset_ns = time.time_ns() - time.monotonic_ns()
    return True


def shutdown() -> None:
    """Exports the spans still buffered and turns tracing off (at exit)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def enabled() -> bool:
    """Whether :func:`configure` turned tracing on."""
    return _tracer is not None


def context_of(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The remote parent a ``traceparent`` (and ``tracestate``) names; None
    when tracing is off, none is given or it is malformed (over
    :data:`TRACEPARENT_MAX_CHARS`, not the W3C grammar, an all-zero id).
    A malformed ``tracestate`` (over :data:`TRACESTATE_MAX_CHARS`, a bad
    member) is dropped. Each ignored header counts once in
    :data:`INVALID_CONTEXT`; nothing is logged."""
    if _tracer is None or not traceparent:
        return None
    if len(traceparent) > TRACEPARENT_MAX_CHARS:
        INVALID_CONTEXT.labels(TRACEPARENT).inc()
        return None
    carrier = {TRACEPARENT: traceparent}
    if tracestate and _valid_tracestate(tracestate):
        carrier[TRACESTATE] = tracestate
    elif tracestate:
        INVALID_CONTEXT.labels(TRACESTATE).inc()
    context = _PROPAGATOR.extract(carrier)
    if trace.get_current_span(context).get_span_context().is_valid:
        return context
    INVALID_CONTEXT.labels(TRACEPARENT).inc()
    return None


def _valid_tracestate(tracestate: str) -> bool:
    """Whether OpenTelemetry parses ``tracestate`` without a warning (its
    length limit and member grammar; empty members are allowed)."""
    return len(tracestate) <= TRACESTATE_MAX_CHARS and all(
        not member or _TRACESTATE_MEMBER.fullmatch(member)
        for member in (m.strip(" \t") for m in tracestate.split(",")))


def context_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None
                          ) -> Context | None:
    """The remote parent in a gRPC call's invocation metadata, or None."""
    if _tracer is None or not metadata:
        return None
    found = {key: value for key, value in metadata
             if key in (TRACEPARENT, TRACESTATE) and isinstance(value, str)}
    return context_of(found.get(TRACEPARENT), found.get(TRACESTATE))


def start_span(name: str, parent: Span | Context | None = None, *,
               attributes: Attributes | None = None, start: float | None = None,
               root_if_no_parent: bool = True) -> Span | None:
    """A started span (end it with :func:`end_span`), or None when tracing is off.

    Args:
      parent: a span of this process, a remote context (:func:`context_of`),
        or None: a new trace (or no span at all when ``root_if_no_parent``
        is false).
      start: its start (``time.monotonic()`` seconds); default now.
    """
    if _tracer is None or (parent is None and not root_if_no_parent):
        return None
    context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return _tracer.start_span(name, context=context, attributes=attributes,
                              start_time=None if start is None else wall_ns(start))


def end_span(span: Span | None, *, attributes: Attributes | None = None,
             end: float | None = None, error: str = "") -> None:
    """Ends ``span`` (None: nothing), with ``attributes`` set first, its status
    ERROR with ``error`` when given, at ``end`` (monotonic seconds; default now)."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end(end_time=None if end is None else wall_ns(end))


#: What :func:`span` gives when there is nothing to trace (reusable: it holds no state).
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def span(name: str, parent: Span | Context | None, *,
         attributes: Attributes | None = None
         ) -> contextlib.AbstractContextManager[Span | None]:
    """A child of ``parent`` around a block (None and no cost when ``parent``
    is None or tracing is off); an exception leaving the block marks it ERROR."""
    if _tracer is None or parent is None:
        return _NO_SPAN
    return _live_span(name, parent, attributes)


@contextlib.contextmanager
def _live_span(name: str, parent: Span | Context,
               attributes: Attributes | None) -> Iterator[Span | None]:
    child = start_span(name, parent, attributes=attributes)
    try:
        yield child
    except BaseException as err:
        end_span(child, error=f"{type(err).__name__}: {err}")
        raise
    end_span(child)


def record_span(name: str, parent: Span | Context | None, start: float | None,
                end: float | None, attributes: Attributes | None = None, *,
                error: str = "") -> Span | None:
    """A finished span from ``start`` to ``end`` (monotonic seconds) under
    ``parent``: a stage known by its timestamps (status ERROR with ``error``
    when given). Nothing when either time is None, ``parent`` is None or
    tracing is off."""
    if start is None or end is None:
        return None
    child = start_span(name, parent, attributes=attributes, start=start,
                       root_if_no_parent=False)
    end_span(child, end=end, error=error)
    return child


def traceparent_of(span: Span | None) -> str:
    """``span``'s W3C ``traceparent`` ("" for None): what a child on another
    service is started from. Written here as the SDK's propagator writes it
    (a fifth of its cost: it is on the first token's path)."""
    if span is None:
        return ""
    context = span.get_span_context()
    if context == trace.INVALID_SPAN_CONTEXT:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def metadata_of(span: Span | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``span``'s trace context (() for None)."""
    return tuple(_carrier(span).items())


def _carrier(span: Span | None) -> dict[str, str]:
    """``span``'s context as W3C headers (``traceparent``, and ``tracestate``
    when it has one); {} for None."""
    carrier: dict[str, str] = {}
    if span is not None:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def wall_ns(monotonic_s: float) -> int:
    """``time.monotonic()`` seconds as wall-clock nanoseconds since the epoch,
    by the clocks' offset read once (at :func:`configure`): one timestamp
    gives the same time in every span it bounds."""
    return _offset_ns + int(monotonic_s * 1e9)
