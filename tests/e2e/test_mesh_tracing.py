"""Traces across the hops: a mesh started with ``--otlp-traces-endpoint``
exports one trace per request, with the spans of the router, tokenizer,
cache and engine (the tokenizer's only where it is asked: this mesh's router
runs with --no-tokenize-in-router, so that the service makes every prompt and
the tokenizer hop is traced), each the child of the span that called it,
under the client's own span (W3C ``traceparent`` in gRPC metadata or the HTTP header).

The services are separate processes, as users run them, exporting over
OTLP/gRPC to a real receiver in this process (:mod:`tests.e2e.otlp_receiver`)
rather than to an in-memory exporter inside one process: that checks the flag,
the launcher passing it to every service, the exporter and the context on the
wire on every hop. The batch processor's delay is cut to 0.1 s
(``OTEL_BSP_SCHEDULE_DELAY``) so the spans arrive at once.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import chat_request, collect
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.mesh

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory: pytest.TempPathFactory,
                receiver: OtlpReceiver) -> Iterator[Mesh]:
    run_dir: Path = tmp_path_factory.mktemp("traced-mesh")
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir, drain_seconds=1.0,
              engine_args=["--max-model-len", "512"],
              router_args=["--no-tokenize-in-router"],  # the tokenizer hop traced
              otlp_traces_endpoint=receiver.endpoint,
              env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as mesh:
        yield mesh


def _trace(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
    """The spans of ``trace_id`` by name, once all of ``names`` arrived (each once)."""
    spans = receiver.wait_for(
        lambda got: names <= {s.name for s in got if s.trace_id == trace_id})
    mine = [s for s in spans if s.trace_id == trace_id]
    by_name = {s.name: s for s in mine}
    assert len(by_name) == len(mine), sorted(s.name for s in mine)  # no name twice
    return by_name


ROUTER = {"llmesh.generate", "llmesh.tokenize", "llmesh.cache_lookup",
          "llmesh.admission_wait", "llmesh.first_token", "llmesh.decode"}
ENGINE = {"llmesh.engine.generate", "llmesh.engine.queue", "llmesh.engine.prefill",
          "llmesh.engine.decode"}


def test_one_trace_holds_every_service_s_spans_parent_to_child(
        traced_mesh: Mesh, receiver: OtlpReceiver) -> None:
    """A deterministic chat request (tokenized, looked up in the response
    cache, admitted, generated) through Envoy: one trace, under the client's span."""
    channel = grpc.insecure_channel(traced_mesh.ingress_address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request = chat_request(bypass_cache=False, temperature=0.0, max_tokens=12,
                           ignore_eos=True)
    request.request_id = "traced-1"
    out = collect(stub.Generate(request, timeout=120, metadata=(
        ("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)))
    assert len(out.token_ids) == 12
    names = ROUTER | ENGINE | {"llmesh.tokenizer.ApplyChatTemplate", "llmesh.cache.get"}
    spans = _trace(receiver, CLIENT_TRACE, names)
    # the tokenizer service made the prompt (--no-tokenize-in-router), and the span says so
    assert spans["llmesh.tokenize"].attributes["llmesh.tokenize.in_process"] is False

    def parent(child: str, of: str) -> None:
        assert spans[child].parent_id == spans[of].span_id, (child, of)

    root = spans["llmesh.generate"]
    assert root.parent_id == CLIENT_SPAN
    for name in ROUTER - {"llmesh.generate"}:
        parent(name, "llmesh.generate")
    parent("llmesh.tokenizer.ApplyChatTemplate", "llmesh.tokenize")
    parent("llmesh.cache.get", "llmesh.cache_lookup")
    parent("llmesh.engine.generate", "llmesh.generate")
    for name in ENGINE - {"llmesh.engine.generate"}:
        parent(name, "llmesh.engine.generate")
    assert {s.service for s in spans.values()} == {
        "llmesh-router", "llmesh-tokenizer", "llmesh-cache", "llmesh-engine"}
    # the stages in order, each inside its parent (one machine, one clock)
    queue, prefill, decode = (spans[f"llmesh.engine.{n}"] for n in ("queue", "prefill", "decode"))
    assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
    for span in spans.values():
        assert root.start_ns <= span.start_ns + 1_000_000
        assert span.end_ns <= root.end_ns + 500_000_000  # the engine ends its own
    assert root.attributes["gen_ai.request.model"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 12
    assert root.attributes["gen_ai.request.max_tokens"] == 12
    assert root.attributes["llmesh.request_id"] == "traced-1"
    assert root.attributes["llmesh.replica"]
    engine = spans["llmesh.engine.generate"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == 12
    assert engine.attributes["gen_ai.usage.input_tokens"] == root.attributes[
        "gen_ai.usage.input_tokens"]
    # no span per token or per step: 12 tokens, one decode span on each side
    assert sum(s.name.endswith("decode") for s in receiver.spans
               if s.trace_id == CLIENT_TRACE) == 2


def test_openai_http_traceparent_header_is_the_parent(
        traced_mesh: Mesh, receiver: OtlpReceiver) -> None:
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with urllib.request.urlopen(f"{traced_mesh.http_url}/v1/models", timeout=30) as models:
        model = json.load(models)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 3}).encode()
    request = urllib.request.Request(
        f"{traced_mesh.http_url}/v1/chat/completions", data=body, headers={
            "content-type": "application/json",
            "traceparent": f"00-{trace_id}-{span_id}-01"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    spans = _trace(receiver, trace_id, {"llmesh.generate", "llmesh.engine.generate"})
    assert spans["llmesh.generate"].parent_id == span_id
    assert spans["llmesh.engine.generate"].parent_id == spans["llmesh.generate"].span_id


def test_unary_calls_take_the_context_from_their_metadata(
        traced_mesh: Mesh, receiver: OtlpReceiver) -> None:
    """Callers other than the router (the bench tool, ``/tokenize``): the
    tokenizer's ``Tokenize`` and the engine's ``Generate`` take the
    ``traceparent`` of the call's metadata."""
    trace_id, span_id = "5c0ffee15c0ffee15c0ffee15c0ffee1", "1234567890abcdef"
    metadata = (("traceparent", f"00-{trace_id}-{span_id}-01"),)
    tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(
        grpc.insecure_channel(traced_mesh.services["tokenizer"].grpc_address))
    ids = tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text="Hello there"),
                             timeout=30, metadata=metadata).token_ids
    engine = engine_pb2_grpc.EngineServiceStub(
        grpc.insecure_channel(traced_mesh.engines[0].grpc_address))
    start = engine_pb2.EngineServiceGenerateRequest(start=engine_pb2.EngineRequest(
        request_id="traced-unary", prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)))
    list(engine.Generate(iter([start]), timeout=60, metadata=metadata))
    spans = _trace(receiver, trace_id, {"llmesh.tokenizer.Tokenize", *ENGINE})
    assert spans["llmesh.tokenizer.Tokenize"].parent_id == span_id
    assert spans["llmesh.engine.generate"].parent_id == span_id
    assert spans["llmesh.engine.generate"].attributes["gen_ai.usage.output_tokens"] == 3
