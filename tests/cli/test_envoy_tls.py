"""TLS at the Envoy ingress, the locked-down admin, the request-size backstop
and mutual TLS from Envoy to the router, with a real Envoy in front of the
stand-in router (``fake_service.py``: no model needed for these properties).

One module-scoped set-up: certificates from :mod:`services.common.tls_certs`
(a self-signed ingress CA; a mesh CA with Envoy's, the router's and a test
client's certificates), the stand-in router requiring mesh client certificates
(``--tls-cert --tls-key --tls-ca``, the server kit), and Envoy terminating TLS
on its ingress, reaching the router over mTLS, with its ``ops`` listener.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cli_helpers import envoy_settings, start_fake_router

from llmesh.v1 import generation_pb2, generation_pb2_grpc
from services.cli.envoy_config import TlsFiles, build_bootstrap
from services.cli.main import main as llmesh
from services.cli.mesh import EnvoyProcess, ServiceProcess, stop_processes
from services.common import tls_certs
from services.common.grpc_util import MeshTls

#: The request-size backstop in these tests (bytes), small so the test body is.
MAX_BODY = 64 * 1024
GENERATE = "llmesh.v1.GenerationService/Generate"


@dataclass
class TlsMesh:
    envoy: EnvoyProcess
    router: ServiceProcess
    ca: Path
    client: MeshTls

    @property
    def address(self) -> str:
        return self.envoy.ingress_address


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    folder = tmp_path_factory.mktemp("tls")
    ingress = tls_certs.write_self_signed(folder / "ingress")
    pki = tls_certs.write_mesh_pki(folder / "mtls", ["envoy", "router", "client"])
    router_pair = pki.pairs["router"]
    router = start_fake_router(folder / "router", "--openai-port", "0",
                               "--tls-cert", str(router_pair.cert),
                               "--tls-key", str(router_pair.key), "--tls-ca", str(pki.ca))
    envoy_pair = pki.pairs["envoy"]
    assert router.grpc_port is not None
    envoy = EnvoyProcess(folder / "envoy", envoy_settings(
        router.grpc_port, openai_port=router.extra_ports["openai_port"], ops_port=0,
        tls=TlsFiles(str(ingress.server.cert), str(ingress.server.key)),
        router_tls=TlsFiles(str(envoy_pair.cert), str(envoy_pair.key), str(pki.ca)),
        max_request_bytes=MAX_BODY))
    try:
        envoy.start()
        client = pki.pairs["client"]
        yield TlsMesh(envoy, router, ingress.ca, MeshTls(client.cert, client.key, pki.ca))
    finally:
        envoy.stop()
        assert router.process is not None
        stop_processes([router.process], 5.0)


def _request(prompt: str = "one two three") -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=prompt)
    request.sampling.max_tokens = 8
    return request


def _generate(channel: grpc.Channel, prompt: str = "one two three") -> str:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return "".join(r.text for r in stub.Generate(_request(prompt), timeout=10))


def _tls_channel(tls_mesh: TlsMesh) -> grpc.Channel:
    return grpc.secure_channel(tls_mesh.address, grpc.ssl_channel_credentials(
        root_certificates=tls_mesh.ca.read_bytes()))


def _https(tls_mesh: TlsMesh, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(tls_mesh.ca))
    request = urllib.request.Request(f"https://{tls_mesh.address}{path}", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _http(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method),
                                    timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_grpcurl_generates_over_tls_with_the_ca(tls_mesh: TlsMesh) -> None:
    body = json.dumps({"prompt": "over tls", "sampling": {"max_tokens": 8}})
    out = subprocess.run(["grpcurl", "-cacert", str(tls_mesh.ca), "-d", body,
                          tls_mesh.address, GENERATE],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    texts = [m.get("text", "") for m in map(json.loads, _json_objects(out.stdout))]
    assert "".join(texts) == "over tls "


def _json_objects(text: str) -> list[str]:
    """grpcurl prints one pretty JSON object per message, back to back."""
    decoder, objects, index = json.JSONDecoder(), [], 0
    while index < len(text.strip()):
        _, end = decoder.raw_decode(text, index)
        objects.append(text[index:end])
        index = end
        while index < len(text) and text[index].isspace():
            index += 1
    return objects


def test_python_grpc_and_the_llmesh_cli_generate_over_tls(
        tls_mesh: TlsMesh, capsys: pytest.CaptureFixture[str]) -> None:
    with _tls_channel(tls_mesh) as channel:
        assert _generate(channel) == "one two three "
    url = f"https://{tls_mesh.address}"
    assert llmesh(["generate", "--raw", "--url", url, "--cacert", str(tls_mesh.ca),
                   "--max-tokens", "8", "cli over tls"]) == 0
    assert capsys.readouterr().out == "cli over tls \n"
    assert llmesh(["models", "--url", url, "--cacert", str(tls_mesh.ca)]) == 0
    assert "fake-model" in capsys.readouterr().out
    # Without the CA the server is not trusted (system roots): one clear error.
    assert llmesh(["models", "--url", url, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "give its CA with --cacert or LLMESH_CACERT" in err
    assert "is `llmesh up` running" not in err
    # A CA that did not sign it, and cleartext to the TLS port: each its own hint.
    other_ca = tls_certs.write_self_signed(tls_mesh.ca.parent.parent / "other").ca
    assert llmesh(["models", "--url", url, "--cacert", str(other_ca), "--timeout", "5"]) == 1
    assert f"the CA in {other_ca} did not sign the mesh's certificate" in capsys.readouterr().err
    assert llmesh(["models", "--url", tls_mesh.address, "--timeout", "5"]) == 1
    assert f"call it with --url https://{tls_mesh.address}" in capsys.readouterr().err


def test_openai_http_over_tls(tls_mesh: TlsMesh) -> None:
    status, body = _https(tls_mesh, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "fake-model"
    chat = json.dumps({"messages": [{"role": "user", "content": "hi there"}], "stream": True})
    status, body = _https(tls_mesh, "/v1/chat/completions", chat.encode())
    assert status == 200 and b"data: [DONE]" in body


def test_an_unknown_v1_route_is_an_openai_shaped_404(tls_mesh: TlsMesh) -> None:
    for path, body in [("/v1/nothing", b"{}"), ("/v1/chat/complete", b"{}"),
                       ('/v1/x"y', None)]:
        status, reply = _https(tls_mesh, path.replace('"', "%22"), body)
        assert status == 404, path
        error = json.loads(reply)["error"]
        # The router's own unknown-route reply (openai_http.py), word for word.
        assert error == {"code": "unknown_url", "type": "invalid_request_error", "param": None,
                         "message": f"unknown route {'POST' if body else 'GET'} "
                                    f"{path.replace(chr(34), '%22')}; this server has POST "
                                    "/v1/chat/completions, POST /v1/completions, GET "
                                    "/v1/models, POST /tokenize, POST /detokenize and POST "
                                    "/v1/embeddings"}
    # Elsewhere Envoy's own reply stays as it was.
    status, reply = _https(tls_mesh, "/nothing", b"{}")
    assert status == 404 and not reply.startswith(b"{")


def test_plaintext_is_refused_and_no_plaintext_listener_is_bound(tls_mesh: TlsMesh) -> None:
    with grpc.insecure_channel(tls_mesh.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _generate(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{tls_mesh.address}/v1/models", timeout=5)
    _, listeners = _admin_get(tls_mesh, "/listeners?format=json")
    names = {entry["name"] for entry in json.loads(listeners)["listener_statuses"]}
    assert names == {"ingress", "ops"}


def _admin_get(tls_mesh: TlsMesh, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"{tls_mesh.envoy.admin_url}{path}", timeout=5) as reply:
        return reply.status, reply.read().decode()


def _non_loopback_address() -> str | None:
    """An address of this machine other than loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_admin_is_loopback_only_and_ops_serves_only_ready_and_stats(tls_mesh: TlsMesh) -> None:
    envoy = tls_mesh.envoy
    assert envoy.settings.admin_host == "127.0.0.1"
    address = _non_loopback_address()
    if address is not None:
        with pytest.raises(OSError):
            socket.create_connection((address, envoy.admin_port), timeout=2).close()
    with pytest.raises(ValueError, match="loopback"):
        build_bootstrap(envoy_settings(1, admin_host="0.0.0.0"))
    assert _http(f"{envoy.ops_url}/ready") == 200
    with urllib.request.urlopen(f"{envoy.ops_url}/stats/prometheus", timeout=5) as reply:
        assert b"envoy_cluster_upstream_cx_total" in reply.read()
    for path in ("/quitquitquit", "/config_dump", "/listeners", "/stats"):
        assert _http(f"{envoy.ops_url}{path}", method="POST") == 404, path
        assert _http(f"{envoy.ops_url}{path}") == 404, path
    assert envoy.process is not None and envoy.process.poll() is None


def test_an_oversize_body_is_refused_and_the_mesh_keeps_serving(tls_mesh: TlsMesh) -> None:
    big = "word " * (MAX_BODY // 4)
    chat = json.dumps({"messages": [{"role": "user", "content": big}]}).encode()
    for path in ("/v1/chat/completions", "/tokenize"):
        status, reply = _https(tls_mesh, path, chat)
        assert status == 413
        # The router's own 413 (openai_http_errors.request_too_large), Envoy's limit named.
        error = json.loads(reply)["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", None, "request_too_large")
        assert f"at most {MAX_BODY} bytes" in error["message"]
    with _tls_channel(tls_mesh) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _generate(channel, big)
        # A size refusal (Envoy alone would say UNKNOWN) naming the limit and the
        # remedy (Envoy alone: "Payload Too Large").
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = refused.value.details() or ""
        assert f"over {MAX_BODY} bytes" in details and "max_request_bytes" in details
        assert _generate(channel) == "one two three "


def test_the_router_requires_a_mesh_client_certificate(tls_mesh: TlsMesh) -> None:
    router = tls_mesh.router.grpc_address
    client = tls_mesh.client
    no_cert = grpc.ssl_channel_credentials(root_certificates=client.ca.read_bytes())
    for channel in (grpc.insecure_channel(router), grpc.secure_channel(router, no_cert)):
        with channel, pytest.raises(grpc.RpcError) as refused:
            _generate(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(router, client.channel_credentials()) as channel:
        assert _generate(channel) == "one two three "
    # Envoy presents its own certificate: the mesh serves through it.
    with _tls_channel(tls_mesh) as channel:
        assert _generate(channel, "still served") == "still served "
