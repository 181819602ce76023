"""Server reflection on the real server kit: every method of every service is
describable (``grpcurl describe llmesh.v1.EngineService.Generate`` said
"Symbol not found": protobuf's upb pool does not resolve method names)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from cli_helpers import start_fake_router

from services.cli.mesh import stop_processes
from services.common.reflection import enable_reflection


def grpcurl(address: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["grpcurl", "-plaintext", address, *argv],
                          capture_output=True, text=True, timeout=30, check=False)


def test_every_method_is_describable_and_an_unknown_one_is_not(tmp_path: Path) -> None:
    router = start_fake_router(tmp_path / "router")
    try:
        address = router.grpc_address
        services = grpcurl(address, "list").stdout.split()
        assert "llmesh.v1.GenerationService" in services
        methods = [m for s in services for m in grpcurl(address, "list", s).stdout.split()]
        assert "llmesh.v1.GenerationService.Generate" in methods
        assert "grpc.health.v1.Health.Check" in methods
        for method in methods:
            described = grpcurl(address, "describe", method)
            assert described.returncode == 0, described.stderr
            assert described.stdout.startswith(f"{method} is a method:"), described.stdout
        unknown = grpcurl(address, "describe", "llmesh.v1.GenerationService.Nope")
        assert unknown.returncode != 0 and "Symbol not found" in unknown.stderr
    finally:
        assert router.process is not None
        stop_processes([router.process], 5.0)


async def test_a_reflected_service_this_process_cannot_describe_is_refused() -> None:
    # In a running loop: grpc.aio.server() needs the thread's event loop, which an
    # earlier test on the same xdist worker may have closed.
    server = grpc.aio.server()
    with pytest.raises(ValueError, match="--reflect-service: no service 'llmesh.v1.Nope'"):
        enable_reflection(["llmesh.v1.GenerationService"], server, also=["llmesh.v1.Nope"])
