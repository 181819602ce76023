"""``python -m services.engine`` as the CLI launches it: port file, health,
a stream, Prometheus metrics, and a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from .prompts import CHAT

pytestmark = pytest.mark.model
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[subprocess.Popen, dict]]:
    port_file = tmp_path_factory.mktemp("engine") / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.engine", "--backend", "torch", "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "128", "--port", "0", "--metrics-port", "0",
         "--port-file", str(port_file), "--drain-seconds", "5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'services' / 'gen'}"})
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"engine did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.1)
    yield process, json.loads(port_file.read_text())
    if process.poll() is None:
        process.kill()
        process.wait()


async def wait_serving(channel: grpc.aio.Channel, within: float = 60.0) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        check = await health.Check(health_pb2.HealthCheckRequest(service="llmesh.v1.EngineService"))
        if check.status == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.1)
    pytest.fail("engine never became SERVING")


async def test_engine_process_serves_and_drains(engine_process: tuple[subprocess.Popen, dict]
                                                ) -> None:
    process, ports = engine_process
    assert ports["pid"] == process.pid
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['grpc_port']}") as channel:
        await wait_serving(channel)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        assert (info.model, info.max_model_len, info.backend) == (
            "SmolLM2-135M-Instruct", 128, "torch")
        start = engine_pb2.EngineServiceGenerateRequest(start=engine_pb2.EngineRequest(
            request_id="cli", prompt_token_ids=CHAT,
            sampling=common_pb2.SamplingParams(max_tokens=3)))

        async def requests():
            yield start

        responses = [r async for r in stub.Generate(requests())]
        assert responses[-1].usage.completion_tokens == 3
    url = f"http://127.0.0.1:{ports['metrics_port']}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'llmesh:request_success_total{finished_reason="length"} 1.0' in text
    assert "llmesh:generation_tokens_total 3.0" in text
    assert "llmesh:engine_step_duration_seconds_count" in text
    process.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    assert process.returncode == 0, stderr[-2000:]
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert "engine_ready" in events and events[-1] == "stopped"
