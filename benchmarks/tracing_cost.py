"""What tracing costs a request, off and on (``services/common/tracing.py``).

Times, in this process and without the mesh, the tracing hooks one request
passes through on the router (its ``llmesh.generate`` span, the tokenize,
cache-lookup and admission spans with the context sent on, the first-token
and decode spans at the end) and on the engine (its record and its spans at
the end), and what one delta pays per token on the engine (the branch on its
first delta). Off (no ``--otlp-traces-endpoint``) and on (the SDK with a
synchronous in-memory exporter: an upper bound of the batch processor's cost
on the request's path). The rounds alternate off and on; each round's figure
is the mean of ``--calls`` requests; prints the median, p10 and p90 of the
rounds, in microseconds, and the load average.

Usage: ``python benchmarks/tracing_cost.py [--rounds 15] [--calls 2000]``
Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing
from services.common.sampling import FinishReason, Priority, SamplingOptions
from services.engine.request_record import RequestRecord
from services.engine.types import TokenDelta
from services.router.request_trace import end_request_span, start_request_span
from services.router.validation import GenerationRequest

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Progress:
    prompt_tokens, completion_tokens, cached_prompt_tokens = 37, 64, 0


class _Timing:
    def __init__(self, now: float) -> None:
        self.dispatched_at, self.first_token_at, self.last_token_at = now, now + 0.01, now + 0.2


_DELTA = TokenDelta("r", (1,), FinishReason.NONE, 37, 1, scheduled_at=time.monotonic())


def one_request(request: GenerationRequest) -> None:
    """The hooks of one request, router then engine, in the order they run."""
    span = start_request_span(request)
    with tracing.span("llmesh.tokenize", span) as tokenize:
        tracing.traceparent_of(tokenize)
    with tracing.span("llmesh.cache_lookup", span) as lookup:
        tracing.metadata_of(lookup)
    with tracing.span("llmesh.admission_wait", span):
        pass
    record = RequestRecord(37, 1, tracing.context_of(tracing.traceparent_of(span)))
    if record.trace_parent is not None:
        record.first_delta(_DELTA)
    record.record_spans("r", "engine-0")
    end_request_span(span, request, outcome="length", progress=_Progress(),
                     timing=_Timing(time.monotonic()), info={"engine": "127.0.0.1:1"})


def per_delta(record: RequestRecord, deltas: int, *, check: bool) -> None:
    """``deltas`` deltas of the engine's loop, with (``check``) or without
    the tracing branch ``RequestSink.deliver`` has."""
    for n in range(deltas):
        first = n == 0
        if check and first and record.trace_parent is not None:
            pass


def mean_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ.pop(tracing.ENDPOINT_ENV, None)
    request = GenerationRequest("bench-1", "SmolLM2", None, (), SamplingOptions(max_tokens=64),
                                Priority.INTERACTIVE, traceparent=PARENT)
    figures: dict[str, list[float]] = {"off": [], "on": [], "delta_off": []}
    exporter = InMemorySpanExporter()
    load_start = os.getloadavg()
    for _ in range(args.rounds):
        assert not tracing.enabled()
        figures["off"].append(mean_us(lambda: one_request(request), args.calls))
        record = RequestRecord(37, 1, None)
        figures["delta_off"].append(
            (mean_us(lambda: per_delta(record, 64, check=True), args.calls)
             - mean_us(lambda: per_delta(record, 64, check=False), args.calls)) / 64)
        tracing.configure("bench", None, exporter=exporter)
        figures["on"].append(mean_us(lambda: one_request(request), args.calls))
        tracing.shutdown()
        exporter.clear()
    load_end = os.getloadavg()
    for name, what in (("off", "per request, tracing off"), ("on", "per request, tracing on"),
                       ("delta_off", "per delta, off (the branch)")):
        values = sorted(figures[name])
        q = statistics.quantiles(values, n=10)
        print(f"{what:28s} median {statistics.median(values):8.3f} us   "
              f"p10 {q[0]:8.3f}   p90 {q[-1]:8.3f}   ({args.rounds} rounds x {args.calls})")
    print(f"spans per traced request here: 10 (router 6, engine 4; the tokenizer's and the "
          f"cache's are made in their own processes); load average "
          f"{load_start[0]:.2f} -> {load_end[0]:.2f}")


if __name__ == "__main__":
    main()
