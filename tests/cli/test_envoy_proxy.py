"""A real Envoy, from our bootstrap, in front of a stand-in router.

The stand-in serves the real ``llmesh.v1.GenerationService`` proto (see
``fake_service.py``), so these tests check Envoy's part: routing, gRPC
pass-through, JSON transcoding, reflection through the proxy, timeouts,
retries and the Prometheus stats.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from cli_helpers import envoy_settings, wait_all_dead

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.mesh import EnvoyProcess, MeshStartError

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _stub(envoy: EnvoyProcess) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(envoy.ingress_address))


def _post_json(envoy: EnvoyProcess, path: str, body: dict) -> tuple[int, str, str]:
    request = urllib.request.Request(
        f"http://{envoy.ingress_address}{path}", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"}, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["content-type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read().decode()


def _admin(envoy: EnvoyProcess, path: str) -> str:
    with urllib.request.urlopen(f"{envoy.admin_url}{path}", timeout=5) as response:
        return response.read().decode()


def test_envoy_binds_free_ports_and_is_ready(envoy: EnvoyProcess) -> None:
    assert envoy.ingress_port not in (None, 0)
    assert envoy.admin_port not in (None, 0)
    assert envoy.ingress_port != envoy.admin_port
    assert envoy.ready_seconds is not None and envoy.ready_seconds < 10
    assert _admin(envoy, "/ready").strip() == "LIVE"


def test_grpc_stream_through_envoy(envoy: EnvoyProcess) -> None:
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(
            messages=[common_pb2.ChatMessage(role="user", content="hello big world")])
    )
    responses = list(_stub(envoy).Generate(request, timeout=10))
    assert [r.text for r in responses] == ["hello ", "big ", "world ", ""]
    assert [list(r.token_ids) for r in responses[:3]] == [[0], [1], [2]]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.prompt_tokens == 3
    assert responses[-1].usage.completion_tokens == 3
    # Envoy adds x-request-id; the router uses it as the request id.
    ids = {r.request_id for r in responses}
    assert len(ids) == 1 and UUID.match(ids.pop())


def test_grpc_error_status_passes_through(envoy: EnvoyProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(_stub(envoy).Generate(generation_pb2.GenerateRequest(prompt="fail"), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "prompt: fail was asked for"


def test_json_generate_returns_one_array(envoy: EnvoyProcess) -> None:
    status, content_type, body = _post_json(
        envoy, "/v1/generate", {"prompt": "one two three", "sampling": {"max_tokens": 2}}
    )
    assert status == 200
    assert content_type == "application/json"
    messages = json.loads(body)
    assert isinstance(messages, list) and len(messages) == 3
    assert [m.get("text") for m in messages] == ["one ", "two ", None]
    assert messages[0]["token_ids"] == [0]  # proto field names are kept
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}


def test_json_error_becomes_http_status_and_json_body(envoy: EnvoyProcess) -> None:
    status, content_type, body = _post_json(envoy, "/v1/generate", {"prompt": "fail"})
    assert status == 400
    assert content_type == "application/json"
    assert json.loads(body) == {"code": 3, "message": "prompt: fail was asked for"}


def test_json_list_models(envoy: EnvoyProcess) -> None:
    with urllib.request.urlopen(f"http://{envoy.ingress_address}/v1/llmesh/models", timeout=10) as reply:
        assert reply.status == 200
        body = json.loads(reply.read())
    assert body == {"models": [{"id": "fake-model", "max_model_len": 2048,
                                "max_tokens_cap": 256, "chat": True}]}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_post_returns_json_array(envoy: EnvoyProcess) -> None:
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", f"http://{envoy.ingress_address}/v1/generate",
         "-d", '{"prompt": "curl works"}'],
        capture_output=True, text=True, timeout=20, check=True,
    )
    messages = json.loads(result.stdout)
    assert "".join(m.get("text", "") for m in messages) == "curl works "
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl is not installed")
def test_grpcurl_lists_and_calls_through_envoy(envoy: EnvoyProcess) -> None:
    listed = subprocess.run(["grpcurl", "-plaintext", envoy.ingress_address, "list"],
                            capture_output=True, text=True, timeout=20, check=True)
    assert "llmesh.v1.GenerationService" in listed.stdout.split()
    called = subprocess.run(
        ["grpcurl", "-plaintext", "-d", '{"prompt": "via grpcurl"}', envoy.ingress_address,
         "llmesh.v1.GenerationService/Generate"],
        capture_output=True, text=True, timeout=20, check=True,
    )
    objects = [json.loads(chunk) for chunk in re.split(r"(?<=\})\n(?=\{)", called.stdout.strip())]
    assert [o.get("text") for o in objects] == ["via ", "grpcurl ", None]
    assert objects[-1]["finishReason"] == "FINISH_REASON_STOP"


def _prometheus_value(text: str, name: str, labels: dict[str, str]) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        label_text, value = line[len(name) + 1:].rsplit("} ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if found == labels:
            return float(value)
    return None


def test_prometheus_stats_keep_dotted_service_names(envoy: EnvoyProcess) -> None:
    list(_stub(envoy).Generate(generation_pb2.GenerateRequest(prompt="count me"), timeout=10))
    text = _admin(envoy, "/stats/prometheus")
    labels = {
        "envoy_grpc_bridge_service": "llmesh.v1.GenerationService",
        "envoy_grpc_bridge_method": "Generate",
        "envoy_cluster_name": "router",
    }
    _post_json(envoy, "/v1/generate", {"prompt": "count me too"})
    text = _admin(envoy, "/stats/prometheus")
    json_labels = {**labels, "envoy_grpc_bridge_method": "GenerateJson"}
    assert (_prometheus_value(text, "envoy_cluster_grpc_success", json_labels) or 0) >= 1
    success = _prometheus_value(text, "envoy_cluster_grpc_success", labels)
    total = _prometheus_value(text, "envoy_cluster_grpc_total", labels)
    assert success is not None and success >= 1
    assert total is not None and total >= success
    # Envoy's default extractors would have split the name at its dots.
    assert 'envoy_grpc_bridge_service="llmesh"' not in text
    assert 'envoy_grpc_bridge_method="v1"' not in text
    requests = _prometheus_value(text, "envoy_cluster_upstream_rq_total",
                                 {"envoy_cluster_name": "router"})
    assert requests is not None and requests >= 1


def test_silent_generation_outlives_the_stream_idle_timeout(envoy: EnvoyProcess) -> None:
    # The test Envoy's stream idle timeout is 2 s; the stand-in waits 4 s before
    # its first word (a request waiting in a queue). Envoy's idle timer is off
    # for the generation methods: the call must not end UNAVAILABLE "stream timeout".
    started = time.monotonic()
    responses = list(_stub(envoy).Generate(
        generation_pb2.GenerateRequest(prompt="sleep:4 late"), timeout=20))
    assert time.monotonic() - started > 3.9
    assert [r.text for r in responses] == ["late ", ""]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP


LONG_STREAM_TEST = "test_long_stream_outlives_envoy_default_route_timeout"


@dataclasses.dataclass
class LongStream:
    """A stream started in the background; ``future`` gives its responses and
    the time it ended."""

    started: float
    call: Any
    future: concurrent.futures.Future


@pytest.fixture(scope="module", autouse=True)
def long_stream(request: pytest.FixtureRequest) -> Iterator[LongStream | None]:
    """The 17 s stream of :func:`test_long_stream_outlives_envoy_default_route_timeout`,
    started before the module's first test so that its wait overlaps theirs
    (the stand-in router sleeps; nothing here is CPU-bound). Started only when
    that test is selected; cancelled at teardown if it never collected it."""
    if not any(item.name == LONG_STREAM_TEST and item.module is request.module
               for item in request.session.items):
        yield None
        return
    envoy = request.getfixturevalue("envoy")
    # 17 deltas 1 s apart: Envoy's default 15 s route timeout would cut it.
    words = " ".join(f"w{i}" for i in range(17))
    started = time.monotonic()
    call = _stub(envoy).Generate(
        generation_pb2.GenerateRequest(prompt=f"sleep:1 {words}"), timeout=60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: (list(call), time.monotonic()))
        yield LongStream(started, call, future)
        call.cancel()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_grpc_timeout_header_is_honoured(envoy: EnvoyProcess) -> None:
    # 10 deltas 0.5 s apart (5 s); a 1 s grpc-timeout must end it early.
    started = time.monotonic()
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", f"http://{envoy.ingress_address}/v1/generate",
         "-H", "grpc-timeout: 1S", "-d", '{"prompt": "sleep:0.5 a b c d e f g h i j"}'],
        capture_output=True, text=True, timeout=20,
    )
    assert time.monotonic() - started < 3.5
    assert '"text":"a "' in result.stdout
    assert '"text":"j "' not in result.stdout


def test_unreachable_router_is_retried_then_unavailable(tmp_path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    second = EnvoyProcess(tmp_path, envoy_settings(dead_port, num_retries=2))
    second.start()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            list(_stub(second).Generate(generation_pb2.GenerateRequest(prompt="x"), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = dict(
            line.split(": ", 1)
            for line in _admin(second, "/stats?filter=^cluster\\.router\\.upstream_").splitlines()
        )
        assert int(stats["cluster.router.upstream_rq_retry"]) == 2
        assert int(stats["cluster.router.upstream_cx_connect_fail"]) == 3
    finally:
        second.stop()
    assert wait_all_dead([second.pid]) == []


def test_two_envoys_coexist_and_stop_leaves_no_process(envoy: EnvoyProcess, tmp_path) -> None:
    assert envoy.process is not None and envoy.process.poll() is None
    other = EnvoyProcess(tmp_path, envoy.settings)  # same settings: ports 0
    other.start()
    try:
        assert other.ingress_port != envoy.ingress_port
        assert _admin(other, "/ready").strip() == "LIVE"
        assert _admin(envoy, "/ready").strip() == "LIVE"
    finally:
        other.stop()
    assert other.process is not None and other.process.returncode is not None
    assert wait_all_dead([other.pid]) == []
    assert envoy.process.poll() is None


def test_envoy_start_failure_quotes_its_log(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broken = EnvoyProcess(tmp_path, envoy_settings(50051, ingress_port=port))
        with pytest.raises(MeshStartError) as caught:
            broken.start(timeout_s=20)
    message = str(caught.value)
    assert "envoy exited with code" in message
    assert str(broken.log_path) in message
    assert "ddress already in use" in message
    assert broken.process is not None and broken.process.poll() is not None


def test_envoy_start_failure_quotes_only_its_own_lines_of_a_log_used_again(tmp_path) -> None:
    """A run directory used again appends to envoy.log: the failure quotes
    this Envoy's lines, not the earlier run's above them, and says where they
    start."""
    (tmp_path / "envoy.log").write_text("an earlier run's line\n" * 3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broken = EnvoyProcess(tmp_path, envoy_settings(50051, ingress_port=taken.getsockname()[1]))
        with pytest.raises(MeshStartError) as caught:
            broken.start(timeout_s=20)
    message = str(caught.value)
    assert f"full log: {broken.log_path} (its lines start at line 4; " in message
    assert "ddress already in use" in message and "an earlier run's line" not in message


# Last in the module: its stream has run in the background since the first test.
def test_long_stream_outlives_envoy_default_route_timeout(long_stream: LongStream | None) -> None:
    assert long_stream is not None
    responses, ended = long_stream.future.result(timeout=60)
    assert ended - long_stream.started > 16
    assert "".join(r.text for r in responses) == "".join(f"w{i} " for i in range(17))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
