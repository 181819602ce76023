"""The retriever tests' real service: one ``python -m services.retriever``
process per module (the embedding model loads in it), restartable on its data
directory."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmesh.v1 import retriever_pb2_grpc

from services.cli.mesh import REPO_ROOT, ServiceProcess, child_env, stop_processes

SERVICE = "llmesh.v1.RetrieverService"


class Retriever:
    """A retriever child on ``data_dir``, with a channel and a stub to it."""

    def __init__(self, run_dir: Path, *flags: str) -> None:
        self.run_dir = run_dir
        self.data_dir = run_dir / "data"
        self.flags = flags
        self.process: ServiceProcess | None = None
        self.channel: grpc.Channel | None = None
        self.stub: retriever_pb2_grpc.RetrieverServiceStub | None = None
        self._deadline = 0.0

    def start(self, timeout_s: float = 120.0) -> None:
        """Spawns it and waits until health says SERVING."""
        self.spawn(timeout_s)
        self.wait_serving()

    def spawn(self, timeout_s: float = 120.0) -> None:
        """Spawns it and waits until its port is bound (the model still loading);
        :attr:`stub` is usable from then on."""
        port_file = self.run_dir / "retriever.json"
        argv = [sys.executable, "-m", "services.retriever", "--port", "0", "--metrics-port", "0",
                "--port-file", str(port_file), "--data-dir", str(self.data_dir),
                "--drain-seconds", "5", *self.flags]
        self.process = ServiceProcess("retriever", argv, "127.0.0.1",
                                      self.run_dir / "retriever.log", port_file)
        self.process.spawn(child_env(), REPO_ROOT)
        deadline = time.monotonic() + timeout_s
        while not self.process.read_port_file():
            self._check(deadline)
        self._deadline = deadline
        self.channel = grpc.insecure_channel(self.process.grpc_address)
        self.stub = retriever_pb2_grpc.RetrieverServiceStub(self.channel)

    def wait_serving(self) -> None:
        """Waits until health says SERVING."""
        deadline = self._deadline
        health = health_pb2_grpc.HealthStub(self.channel)
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status \
                != health_pb2.HealthCheckResponse.SERVING:
            self._check(deadline)

    def _check(self, deadline: float) -> None:
        assert self.process is not None
        if self.process.exit_code() is not None or time.monotonic() > deadline:
            raise self.process.failure("did not start")
        time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM (the drain saves the collections), SIGKILL after 10 s."""
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.process is not None:
            stop_processes([self.process.process], 10.0)

    def metric(self, name: str, labels: str = "") -> float:
        """A sample of its ``/metrics`` (0 when absent), e.g.
        ``metric("llmesh:retriever_embedded_texts_total", 'caller="ingest"')``."""
        assert self.process is not None
        with urllib.request.urlopen(f"http://{self.process.metrics_address}/metrics",
                                    timeout=5) as response:
            text = response.read().decode()
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Retriever]:
    """One retriever for the module (exact index: rankings are checkable)."""
    service = Retriever(tmp_path_factory.mktemp("retriever"), "--index", "exact",
                        "--save-interval-seconds", "0.2")
    service.start()
    yield service
    service.stop()
