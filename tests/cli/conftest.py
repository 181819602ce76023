"""Fixtures for the launcher tests: a stand-in router and an Envoy in front of it."""

from __future__ import annotations

import pytest
from cli_helpers import envoy_settings, start_fake_router

from services.cli.mesh import EnvoyProcess, ServiceProcess, stop_processes


@pytest.fixture(scope="module")
def fake_router(tmp_path_factory: pytest.TempPathFactory):
    """A stand-in router (real GenerationService proto) on a free port."""
    service = start_fake_router(tmp_path_factory.mktemp("router"))
    yield service
    assert service.process is not None
    stop_processes([service.process], 5.0)


@pytest.fixture(scope="module")
def envoy(fake_router: ServiceProcess, tmp_path_factory: pytest.TempPathFactory):
    """Envoy on free ports in front of the stand-in router; stream idle timeout 2 s."""
    assert fake_router.grpc_port is not None
    process = EnvoyProcess(
        tmp_path_factory.mktemp("envoy"),
        envoy_settings(fake_router.grpc_port, stream_idle_timeout_s=2.0),
    )
    process.start()
    yield process
    process.stop()
