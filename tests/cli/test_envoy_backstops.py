"""Envoy's own limits, exercised: the backstops behind the router's admission
control (``services.cli.envoy_config``: ``max_concurrent_streams``,
``max_downstream_connections``, the overload manager's heap watch).

A real Envoy in front of the stand-in router (``fake_service.py``), with each
limit set small enough to reach in a test. ``max_request_bytes`` is exercised
in ``test_envoy_tls.py``.

* Streams per connection: Envoy advertises the limit in its HTTP/2 SETTINGS
  (SETTINGS_MAX_CONCURRENT_STREAMS); a client that opens more anyway loses
  the connection (Envoy's codec treats it as a protocol error of the
  connection, not of the stream: RFC 9113 §5.1.2 allows either). gRPC's
  client honours the SETTINGS and queues calls beyond the limit, so every
  call of a well-behaved client completes.
* Connections: past the limit Envoy closes a new connection as soon as it is
  accepted; the ``ops`` listener (probes, scraping) is exempt, so a connection
  flood cannot fail Envoy's readiness probe and get it restarted.
* Envoy's own error answers on the OpenAI paths (a 503 when the router's
  HTTP port does not answer) come in OpenAI's error shape.
* Heap: past ``stop_accepting_requests_threshold`` of ``max_heap_bytes`` every
  new request is answered 503 at once (gRPC: UNAVAILABLE) and Envoy lives on.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.connection
import h2.events
import h2.settings
import pytest
from cli_helpers import envoy_settings, start_fake_router

from llmesh.v1 import generation_pb2, generation_pb2_grpc
from services.cli.mesh import EnvoyProcess, ServiceProcess, stop_processes

GENERATE_PATH = "/llmesh.v1.GenerationService/Generate"
STREAMS = 2
CONNECTIONS = 3


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = start_fake_router(tmp_path_factory.mktemp("backstops") / "router")
    try:
        yield service
    finally:
        assert service.process is not None
        stop_processes([service.process], 5.0)


def _envoy(run_dir: Path, router: ServiceProcess, **limits: object) -> EnvoyProcess:
    assert router.grpc_port is not None
    envoy = EnvoyProcess(run_dir, envoy_settings(router.grpc_port, openai_port=None,
                                                 ops_port=0, **limits))
    envoy.start()
    return envoy


@pytest.fixture(scope="module")
def limited_envoy(tmp_path_factory: pytest.TempPathFactory,
                  router: ServiceProcess) -> Iterator[EnvoyProcess]:
    envoy = _envoy(tmp_path_factory.mktemp("envoy-limits"), router,
                   max_concurrent_streams=STREAMS, max_downstream_connections=CONNECTIONS)
    try:
        yield envoy
    finally:
        envoy.stop()


def _generate(address: str, prompt: str) -> str:
    request = generation_pb2.GenerateRequest(prompt=prompt)
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return "".join(r.text for r in stub.Generate(request, timeout=10))


def _h2_client(address: str) -> tuple[socket.socket, h2.connection.H2Connection]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def _events(sock: socket.socket, conn: h2.connection.H2Connection,
            until: type, seconds: float = 5.0) -> list[h2.events.Event]:
    """Reads frames until an event of type ``until`` arrives (or ``seconds``)."""
    seen: list[h2.events.Event] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65_536)
        except ConnectionResetError:
            break
        if not data:
            break
        seen.extend(conn.receive_data(data))
        sock.sendall(conn.data_to_send())
        if any(isinstance(event, until) for event in seen):
            break
    return seen


def _grpc_headers(address: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":authority", address),
            (":path", GENERATE_PATH), ("content-type", "application/grpc"), ("te", "trailers")]


def test_streams_over_the_per_connection_limit_end_the_connection_and_grpc_queues_them(
        limited_envoy: EnvoyProcess) -> None:
    address = limited_envoy.ingress_address
    sock, conn = _h2_client(address)
    with sock:
        settings = [e for e in _events(sock, conn, h2.events.RemoteSettingsChanged)
                    if isinstance(e, h2.events.RemoteSettingsChanged)]
        advertised = settings[0].changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS]
        assert advertised.new_value == STREAMS
        # Open one stream more than allowed (request bodies not ended: all stay
        # open). The h2 client enforces the limit itself: lift it locally.
        conn.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = STREAMS + 10
        conn.remote_settings.acknowledge()
        for _ in range(STREAMS + 1):
            conn.send_headers(conn.get_next_available_stream_id(), _grpc_headers(address))
        sock.sendall(conn.data_to_send())
        # Envoy's codec takes the extra stream as a protocol error of the
        # connection (access log flag DPE): the whole connection is closed.
        _events(sock, conn, h2.events.ConnectionTerminated)
        sock.settimeout(2.0)
        try:
            assert sock.recv(65_536) == b""
        except ConnectionResetError:
            pass
    # A gRPC client honours the SETTINGS: calls beyond the limit wait for a
    # slot on the connection, none fails. (Connected first: grpc-core 1.85's
    # client can stall every call of a connection when calls it sent before
    # the first SETTINGS come back REFUSED_STREAM; docs/security.md.)
    request = generation_pb2.GenerateRequest(prompt="sleep:0.2 a b c")
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        calls = [stub.Generate(request, timeout=20) for _ in range(STREAMS * 3)]
        texts = ["".join(r.text for r in call) for call in calls]
    assert texts == ["a b c "] * (STREAMS * 3)


def _ready(envoy: EnvoyProcess) -> int:
    try:
        with urllib.request.urlopen(f"{envoy.ops_url}/ready", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _accepted(address: str) -> socket.socket | None:
    """A connection Envoy accepted (its SETTINGS came), or None if it closed it."""
    sock, _ = _h2_client(address)
    sock.settimeout(2.0)
    try:
        if sock.recv(9):
            return sock
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        raise AssertionError("Envoy neither answered nor closed a connection in 2 s") from None
    sock.close()
    return None


def test_connections_over_the_limit_are_closed_and_probes_still_pass(
        limited_envoy: EnvoyProcess) -> None:
    address = limited_envoy.ingress_address
    held: list[socket.socket] = []
    try:
        # Connections of earlier tests may still count for a moment: open
        # until Envoy has accepted as many as the limit.
        deadline = time.monotonic() + 10
        while len(held) < CONNECTIONS:
            assert time.monotonic() < deadline, f"only {len(held)} connections accepted"
            sock = _accepted(address)
            if sock is None:
                time.sleep(0.2)
            else:
                held.append(sock)
        for _ in range(3):
            assert _accepted(address) is None
        # The ops listener is exempt: readiness and scraping keep working.
        assert _ready(limited_envoy) == 200
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _generate(address, "back again") == "back again "
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "Envoy did not accept connections again"
            time.sleep(0.2)


def _overload_stat(envoy: EnvoyProcess, name: str) -> int:
    url = f"{envoy.admin_url}/stats?filter=^overload\\.envoy\\.overload_actions\\."
    with urllib.request.urlopen(url, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key == f"overload.envoy.overload_actions.{name}":
                return int(value)
    raise AssertionError(f"no stat {name}")


def test_over_the_heap_limit_new_requests_get_503_and_envoy_lives(
        tmp_path: Path, router: ServiceProcess) -> None:
    # Envoy's heap is several MiB after start: 1 MiB is far past every threshold.
    envoy = _envoy(tmp_path / "envoy-heap", router, max_heap_bytes=1 << 20)
    try:
        # The overload manager samples the heap every 0.25 s.
        deadline = time.monotonic() + 10
        while _overload_stat(envoy, "stop_accepting_requests.active") != 1:
            assert time.monotonic() < deadline, "stop_accepting_requests never became active"
            time.sleep(0.1)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                _generate(envoy.ingress_address, "one two")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _overload_stat(envoy, "shrink_heap.active") == 1
        assert envoy.process is not None and envoy.process.poll() is None
        # Probes say so: readiness through the ops listener fails while it lasts.
        assert _ready(envoy) == 503
    finally:
        envoy.stop()


def test_envoys_own_errors_on_openai_paths_have_openai_shape(
        tmp_path: Path, router: ServiceProcess) -> None:
    """Envoy's 503 (here: nothing listens at the router's OpenAI port) was its
    plain text "upstream connect error..."; the OpenAI client wants JSON."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # closed again before Envoy starts
    assert router.grpc_port is not None
    envoy = EnvoyProcess(tmp_path / "envoy-openai", envoy_settings(
        router.grpc_port, openai_port=dead_port, ops_port=0))
    envoy.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{envoy.ingress_address}/v1/models", timeout=10)
        assert refused.value.code == 503
        assert refused.value.headers["content-type"] == "application/json"
        error = json.loads(refused.value.read())["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "service_unavailable_error", None, "service_unavailable")
        assert error["message"].startswith("upstream connect error")
    finally:
        envoy.stop()
