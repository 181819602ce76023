"""The whole mesh with the real model, TLS at the ingress (``tls_self_signed``)
and mutual TLS on every internal gRPC hop (``internal_mtls``): router →
tokenizer, cache and engine, engine → cache (KV events), Envoy → router, and
the launcher's health probes. The Envoy-only properties (grpcurl, plaintext
refused, ops listener, size backstop) are in tests/cli/test_envoy_tls.py."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.mesh import Mesh
from tests.e2e.mesh_client import chat_request, generate

pytestmark = pytest.mark.mesh


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path_factory.mktemp("tlsmesh"),
              tls_self_signed=True, internal_mtls=True,
              engine_args=["--max-model-len", "512", "--num-threads", "1", "--quantization", "none"]) as mesh:
        yield mesh


def test_generate_over_tls_through_mtls_hops(tls_mesh: Mesh) -> None:
    assert tls_mesh.ca_path is not None and tls_mesh.http_url.startswith("https://")
    credentials = grpc.ssl_channel_credentials(root_certificates=tls_mesh.ca_path.read_bytes())
    with grpc.secure_channel(tls_mesh.ingress_address, credentials) as channel:
        answer = generate(channel, chat_request(max_tokens=8))
    assert "Paris" in answer.text
    # The prompt went router → tokenizer, the lookup router → cache, the
    # tokens router → engine: every hop over mutual TLS (no cleartext port).
    assert answer.last.usage.prompt_tokens > 0 and answer.last.usage.completion_tokens > 0
    context = ssl.create_default_context(cafile=str(tls_mesh.ca_path))
    with urllib.request.urlopen(f"{tls_mesh.http_url}/v1/models", timeout=10,
                                context=context) as reply:
        assert json.loads(reply.read())["data"][0]["id"]


def test_services_refuse_callers_without_a_mesh_certificate(tls_mesh: Mesh) -> None:
    launcher = tls_mesh.client_tls()
    assert launcher is not None
    no_cert = grpc.ssl_channel_credentials(root_certificates=launcher.ca.read_bytes())
    for name in ("router", "engine-0", "tokenizer", "cache"):
        address = tls_mesh.services[name].grpc_address
        for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, no_cert)):
            with channel, pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, launcher.channel_credentials()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


def test_prometheus_scrapes_envoy_on_the_ops_listener(tls_mesh: Mesh) -> None:
    assert tls_mesh.prometheus_config is not None
    targets = json.loads((tls_mesh.prometheus_config.parent / "targets.json").read_text())
    envoy = next(g for g in targets if g["labels"]["service"] == "envoy")
    assert envoy["targets"] == [tls_mesh.ops_url.removeprefix("http://")]
    with urllib.request.urlopen(f"{tls_mesh.ops_url}/stats/prometheus", timeout=10) as reply:
        assert b"envoy_cluster_upstream_cx_total" in reply.read()
