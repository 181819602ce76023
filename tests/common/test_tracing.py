"""services.common.tracing: off and free by default; W3C context in and out;
spans from timestamps with explicit times (the SDK's in-memory exporter)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", None, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_off_without_an_endpoint_makes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert not tracing.configure("test", None)
    assert not tracing.enabled()
    assert tracing.context_of(PARENT) is None
    assert tracing.start_span("llmesh.generate") is None
    assert tracing.metadata_of(None) == () and tracing.traceparent_of(None) == ""
    with tracing.span("llmesh.tokenize", None) as child:
        assert child is None


def test_the_environment_variable_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://127.0.0.1:1")
    try:
        assert tracing.configure("test", None) and tracing.enabled()
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_a_remote_parent_passes_on_through_traceparent(
        exported: InMemorySpanExporter) -> None:
    root = tracing.start_span("llmesh.generate", tracing.context_of(PARENT))
    assert root is not None
    with tracing.span("llmesh.tokenize", root) as child:
        carried = tracing.traceparent_of(child)
    # the next hop: its span is the child of the one whose context it was sent
    remote = tracing.start_span("llmesh.tokenizer.Tokenize", tracing.context_of(carried))
    tracing.end_span(remote)
    (key, value), = tracing.metadata_of(root)
    assert key == "traceparent" and value.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    tracing.end_span(root)
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert {s.context.trace_id for s in spans.values()} == {
        0x4bf92f3577b34da6a3ce929d0e0e4736}
    assert spans["llmesh.generate"].parent.span_id == 0x00f067aa0ba902b7
    assert spans["llmesh.tokenize"].parent.span_id == spans["llmesh.generate"].context.span_id
    assert (spans["llmesh.tokenizer.Tokenize"].parent.span_id
            == spans["llmesh.tokenize"].context.span_id)


def test_a_malformed_traceparent_starts_a_new_trace(exported: InMemorySpanExporter) -> None:
    assert tracing.context_of("00-not-a-trace-01") is None
    root = tracing.start_span("llmesh.generate", tracing.context_of("garbage"))
    tracing.end_span(root)
    (span,) = exported.get_finished_spans()
    assert span.parent is None


def test_recorded_spans_take_their_times_from_monotonic_timestamps(
        exported: InMemorySpanExporter) -> None:
    root = tracing.start_span("llmesh.engine.generate")
    now = time.monotonic()
    tracing.record_span("llmesh.engine.prefill", root, now - 0.250, now - 0.050)
    assert tracing.record_span("llmesh.engine.decode", root, None, now) is None
    assert tracing.record_span("llmesh.engine.decode", None, now, now) is None
    tracing.end_span(root, error="cancelled")
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"llmesh.engine.generate", "llmesh.engine.prefill"}
    prefill = spans["llmesh.engine.prefill"]
    assert prefill.end_time - prefill.start_time == pytest.approx(200e6, abs=1e6)
    assert abs(prefill.end_time - (time.time_ns() - 50e6)) < 20e6
    assert not spans["llmesh.engine.generate"].status.is_ok


def test_an_exception_in_a_span_marks_it_failed(exported: InMemorySpanExporter) -> None:
    root = tracing.start_span("llmesh.generate")
    with pytest.raises(ValueError), tracing.span("llmesh.cache_lookup", root):
        raise ValueError("boom")
    (span,) = exported.get_finished_spans()
    assert span.status.description == "ValueError: boom"


def test_a_collector_that_is_down_does_not_hold_the_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last export runs at shutdown (the service's exit): against a closed
    port it gives up after ``EXPORT_TIMEOUT_S`` (2 s), not the exporter's
    default 10 s of retries (6-7 s measured here)."""
    monkeypatch.delenv(tracing.TIMEOUT_ENV, raising=False)
    assert tracing.configure("test", "127.0.0.1:1")
    tracing.end_span(tracing.start_span("llmesh.generate"))
    began = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - began < 4.5


@pytest.mark.parametrize("value", ["not a url", "http://", ":::", "collector", "host:0",
                                   "127.0.0.1:99999", "grpc://host:4317", "host:port"])
def test_a_malformed_endpoint_is_a_usage_error_naming_the_flag(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="svc")
    tracing.add_tracing_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--otlp-traces-endpoint", value])
    assert exited.value.code == 2
    assert "argument --otlp-traces-endpoint" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["127.0.0.1:4317", "http://collector:4317",
                                   "https://collector.example:443/", "[::1]:4317", ""])
def test_a_well_formed_endpoint_is_taken_as_given(value: str) -> None:
    parser = argparse.ArgumentParser(prog="svc")
    tracing.add_tracing_arguments(parser)
    assert parser.parse_args(["--otlp-traces-endpoint", value]).otlp_traces_endpoint == value


def _invalid(header: str) -> float:
    return tracing.INVALID_CONTEXT.labels(header)._value.get()


def test_a_malformed_or_oversized_context_is_ignored_counted_and_not_logged(
        exported: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    before = {h: _invalid(h) for h in (tracing.TRACEPARENT, tracing.TRACESTATE)}
    for _ in range(3):  # a header sent on every request: counted each time, never logged
        assert tracing.context_of("00-" + "a" * 60_000) is None
        assert tracing.context_of("not a traceparent") is None
        kept = tracing.context_of(PARENT, "k=v,bad member!," + "x" * 9000)
        assert kept is not None  # the parent stays, the tracestate goes
        span = tracing.start_span("llmesh.generate", kept)
        assert span is not None
        assert format(span.get_span_context().trace_id, "032x") == PARENT[3:35]
        assert not span.get_span_context().trace_state
        tracing.end_span(span)
    assert _invalid(tracing.TRACEPARENT) - before[tracing.TRACEPARENT] == 6
    assert _invalid(tracing.TRACESTATE) - before[tracing.TRACESTATE] == 3
    assert [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"] == []
    assert tracing.context_of(PARENT, "k=v") is not None
    assert _invalid(tracing.TRACESTATE) - before[tracing.TRACESTATE] == 3


def test_traceparent_of_writes_what_the_propagator_writes(
        exported: InMemorySpanExporter) -> None:
    unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    for parent in (None, tracing.context_of(PARENT), tracing.context_of(unsampled)):
        span = tracing.start_span("llmesh.generate", parent)
        carrier: dict[str, str] = {}
        tracing._PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        assert tracing.traceparent_of(span) == carrier["traceparent"]
        tracing.end_span(span)
    assert tracing.traceparent_of(trace.INVALID_SPAN) == ""
