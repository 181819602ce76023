"""Fixtures shared by the whole suite: the real mesh behind a real Envoy."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh
from tests.cache.redis_server import RedisProcess, start_redis_server
from tests.machine_share import machine_share

#: The session's meshes (this file's and tests/e2e/conftest.py's): a test that
#: asks for one runs on the pytest-xdist worker that holds them all.
MESH_FIXTURES = frozenset({"mesh", "ingress_channel", "small_window_engine",
                           "two_small_engines", "two_model_mesh"})


def on_a_session_mesh(item: pytest.Item) -> bool:
    """Whether ``item`` uses a session-scoped mesh fixture (a module's own
    ``mesh``, which overrides the session's, does not count)."""
    definitions = getattr(item, "_fixtureinfo").name2fixturedefs
    return any(definitions[name][-1].scope == "session"
               for name in MESH_FIXTURES.intersection(item.fixturenames) if name in definitions)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker (``-n N --dist loadgroup``): one work unit per
    test module (its module fixtures start once), and one for every test on a
    session mesh (each mesh starts once, on one worker, and the modules that
    share one run in tests/e2e/conftest.py's order)."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        group = "session-meshes" if on_a_session_mesh(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, object, object]:
    """On a pytest-xdist worker, a test marked ``whole_machine`` (one that
    times the machine against itself: contention, CPU shares) runs alone,
    fixtures set up and torn down in its turn included; serially a no-op."""
    if not hasattr(item.config, "workerinput"):
        return (yield)
    whole = item.get_closest_marker("whole_machine") is not None
    # xdist gives each worker a temp folder inside the run's own
    with machine_share(Path(item.config.option.basetemp).parent, whole):
        return (yield)


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
