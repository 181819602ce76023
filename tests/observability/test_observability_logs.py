"""Logs of the real mesh: JSON lines, the request id at every hop, no text.

A request sent through Envoy with ``x-request-id`` metadata must show that id
in the log lines of the router and the engine about it (Envoy's access log has
it too, as ``rid=``, but flushes every 10 s: not checked); without one, Envoy
makes one and the same holds. The router makes the prompt ids in process (its
default, loaded before the session mesh is handed over), so the tokenizer
service logs nothing about the request (the id on the service's own lines,
when the router asks it, is tests/router's). The
prompt and the output are never written to any service's log (the router's
``--log-content`` is off in the session mesh).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import BidiSession, chat_request
from tests.observability.observability_scrape import wait_until

pytestmark = pytest.mark.mesh

#: The services whose log lines must carry a request's id (the cache logs per
#: request at debug level only; its hop is checked in test_observability_logging).
HOPS = ("router", "engine-0")


def _service_logs(mesh: Mesh) -> dict[str, Path]:
    return {name: service.log_path for name, service in mesh.services.items()}


def _records(path: Path) -> list[dict]:
    """Every line of a service log, parsed (fails on a line that is not JSON)."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise AssertionError(f"{path.name}:{number} is not JSON: {line!r}") from err
    return records


def _wait_for_id(mesh: Mesh, request_id: str) -> dict[str, list[dict]]:
    """The log records carrying ``request_id``, by service, once every hop has one."""
    found: dict[str, list[dict]] = {}

    def every_hop_logged() -> bool:
        found.clear()
        for name, path in _service_logs(mesh).items():
            found[name] = [r for r in _records(path) if r.get("request_id") == request_id]
        return all(found[hop] for hop in HOPS)

    try:
        wait_until(every_hop_logged, 5.0, f"log lines with request_id={request_id}")
    except AssertionError:
        missing = [hop for hop in HOPS if not found.get(hop)]
        raise AssertionError(f"no log line with request_id={request_id!r} in {missing}")
    return found


def _stream_text(call) -> tuple[str, generation_pb2.GenerateResponse]:
    text, last = [], None
    for response in call:
        text.append(response.text)
        last = response
    return "".join(text), last


def test_request_id_from_the_client_reaches_every_hop(mesh: Mesh,
                                                      ingress_channel: grpc.Channel) -> None:
    request_id = f"test-xyz-{uuid.uuid4().hex[:8]}"
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    call = stub.Generate(chat_request("Name a color.", max_tokens=6, bypass_cache=False),
                         metadata=((("x-request-id", request_id),)), timeout=60)
    _, last = _stream_text(call)
    assert last.request_id == request_id
    assert dict(call.trailing_metadata())["x-request-id"] == request_id

    found = _wait_for_id(mesh, request_id)
    finished = {name: [r for r in records if r["event"] == "request_finished"]
                for name, records in found.items()}
    assert len(finished["router"]) == 1 and finished["router"][0]["outcome"] in ("stop", "length")
    assert finished["router"][0]["completion_tokens"] == last.usage.completion_tokens
    # the router made the prompt ids and detokenizes in process: no tokenizer call
    assert found["tokenizer"] == []
    assert len(finished["engine-0"]) == 1
    for name, records in found.items():
        assert all(r["service"] == name.split("-")[0] for r in records), name


def test_envoy_makes_a_request_id_when_the_client_sends_none(
        mesh: Mesh, ingress_channel: grpc.Channel) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    _, last = _stream_text(stub.Generate(chat_request("Name a shape.", max_tokens=4),
                                         timeout=60))
    uuid.UUID(last.request_id)  # Envoy's: a UUID
    _wait_for_id(mesh, last.request_id)


def test_request_id_of_a_stream_start_reaches_every_hop(mesh: Mesh,
                                                        ingress_channel: grpc.Channel) -> None:
    request_id = f"obs-stream-{uuid.uuid4().hex[:8]}"
    session = BidiSession(ingress_channel, timeout=60)
    request = chat_request("Name an animal.", max_tokens=4)
    request.request_id = request_id
    session.start(request)
    while (last := session.next()).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        pass
    session.close()
    assert last.request_id == request_id
    _wait_for_id(mesh, request_id)


def test_prompt_and_output_never_reach_the_logs(mesh: Mesh,
                                                ingress_channel: grpc.Channel) -> None:
    marker = f"zq{uuid.uuid4().hex[:10]}"
    request_id = f"obs-private-{marker}"
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    prompt = f"Repeat this code word exactly: {marker}. Then tell a short joke about cats."
    output, _ = _stream_text(stub.Generate(
        chat_request(prompt, max_tokens=24, ignore_eos=True, bypass_cache=False),
        metadata=(("x-request-id", request_id),), timeout=60))
    _wait_for_id(mesh, request_id)
    assert len(output.strip()) >= 12, output
    for name, path in _service_logs(mesh).items():
        text = path.read_text()
        records = _records(path)  # every line is JSON
        assert marker not in text.replace(request_id, ""), f"{name} logged the prompt"
        assert output.strip() not in text, f"{name} logged the output"
        assert all({"event", "service", "level", "timestamp"} <= r.keys() for r in records), name
