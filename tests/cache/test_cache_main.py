"""``python -m services.cache`` as a process: serves, reports health and metrics, drains."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmesh.v1 import cache_pb2, cache_pb2_grpc

from tests.cache.helpers import make_key, make_response
from tests.cache.redis_server import RedisProcess

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services" / "gen")]))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen] = []

    def run(*flags: str) -> tuple[subprocess.Popen, dict]:
        port_file = tmp_path / f"ports-{len(started)}.json"
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cache", "--port", "0", "--metrics-port", "0",
             "--port-file", str(port_file), *flags],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        started.append(process)
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return process, json.loads(port_file.read_text())

    yield run
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def _wait_serving(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 20
        while True:
            status = health.Check(health_pb2.HealthCheckRequest(
                service="llmesh.v1.CacheService"), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _round_trip(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        key = make_key((3, 1, 4))
        assert not stub.GetCachedResponse(cache_pb2.GetCachedResponseRequest(key=key)).found
        assert stub.PutCachedResponse(cache_pb2.PutCachedResponseRequest(
            key=key, response=make_response())).stored
        hit = stub.GetCachedResponse(cache_pb2.GetCachedResponseRequest(key=key))
        assert hit.found and hit.response == make_response()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_serves_then_drains_on_sigterm(launch, backend: str, request: pytest.FixtureRequest,
                                       ) -> None:
    flags: tuple[str, ...] = ("--max-entries", "10")
    if backend == "redis":
        request.getfixturevalue("redis_client")  # empties the database
        server: RedisProcess = request.getfixturevalue("redis_server")
        flags = ("--redis-url", server.url)
    process, ports = launch(*flags)
    _wait_serving(ports["grpc_port"])
    _round_trip(ports["grpc_port"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics",
                                  timeout=5).read().decode()
    assert "llmesh:response_cache_hits_total 1.0" in text
    assert "llmesh:response_cache_stores_total 1.0" in text
    assert 'llmesh:cache_request_duration_seconds_count{method="GetCachedResponse"} 2.0' in text
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0


def test_unreachable_redis_fails_at_start_with_a_clear_message() -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "services.cache", "--port", "0", "--metrics-port", "-1",
         "--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in result.stderr
    assert "hunter2" not in result.stderr


def test_bad_flags_are_usage_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cache", "--ttl-seconds", "0"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--ttl-seconds must be > 0" in result.stderr
