"""A real OTLP/gRPC trace receiver for tests: what an OpenTelemetry collector
(Jaeger, Tempo, otel-collector) is to a mesh started with
``--otlp-traces-endpoint``. It keeps every span it is sent, in memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: ids as hex (``parent_id`` "" for a root)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    status_code: int


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves ``opentelemetry.proto.collector.trace.v1.TraceService`` on a free
    loopback port (:attr:`endpoint`); :meth:`stop` ends it."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{port}"
        self._server.start()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(
                    service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.start_time_unix_nano, s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes}, s.status.code)
                    for s in scope_spans.spans]
        with self._lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool],
                 timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans received once ``done(spans)`` holds (polled; raises
        AssertionError with what arrived after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans after {timeout_s} s: "
                                     f"{sorted((s.service, s.name) for s in spans)}")
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.stop(None)


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None
