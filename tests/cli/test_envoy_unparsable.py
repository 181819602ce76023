"""Bytes that do not parse, sent through a real Envoy to a service on the server
kit: INVALID_ARGUMENT naming the message and field over gRPC (not UNKNOWN), 400
over JSON."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest

from llmesh.v1 import generation_pb2
from services.cli.mesh import EnvoyProcess

BAD_PROMPT = b"\x1a\x01\xff"  # GenerateRequest field 3 (prompt), length 1, byte 0xff


def test_invalid_utf8_through_envoy_is_invalid_argument_naming_the_field(
        envoy: EnvoyProcess) -> None:
    with grpc.insecure_channel(envoy.ingress_address) as channel:
        generate = channel.unary_stream(
            "/llmesh.v1.GenerationService/Generate", request_serializer=lambda raw: raw,
            response_deserializer=generation_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(BAD_PROMPT, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(
            "llmesh.v1.GenerateRequest: the request could not be parsed: field `prompt` holds "
            "invalid UTF-8")
        good = generation_pb2.GenerateRequest(prompt="still serving").SerializeToString()
        assert "".join(r.text for r in generate(good, timeout=10)) == "still serving "


def test_invalid_utf8_over_json_is_400(envoy: EnvoyProcess) -> None:
    request = urllib.request.Request(
        f"http://{envoy.ingress_address}/v1/generate", data=b'{"prompt": "\xff"}',
        headers={"content-type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
