"""Fixtures shared by the whole suite: the real mesh behind a real Envoy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh
from tests.cache.redis_server import RedisProcess, start_redis_server


@pytest.fixture(scope="session")
def mesh_redis() -> Iterator[RedisProcess]:
    """A real Redis (valkey) server on a free port for the mesh's cache service."""
    server = start_redis_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory, mesh_redis: RedisProcess) -> Iterator[Mesh]:
    """The whole mesh (tokenizer, cache on Redis, torch engine, router, Envoy) with
    the real SmolLM2 model, every port picked free, handed over once the router
    makes prompt ids in process (its default); stopped by PID at the end."""
    run_dir: Path = tmp_path_factory.mktemp("mesh")
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir, redis_url=mesh_redis.url) as running:
        # the default path from the first test on: prompt ids made in the router
        running.wait_prompts_in_router()
        yield running


@pytest.fixture(scope="session")
def ingress_channel(mesh: Mesh) -> Iterator[grpc.Channel]:
    """One long-lived client channel to Envoy's ingress."""
    with grpc.insecure_channel(mesh.ingress_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield channel
