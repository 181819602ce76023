"""Meshes that several e2e modules share, each module with its own router flags
(``Mesh.restart_router``: a router restart takes a second or two, two engines
take a model load each). The modules that share one run next to each other
(:func:`pytest_collection_modifyitems`), so that no shared mesh sits idle in
memory (~1.6 GB an engine) while other modules run theirs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli.mesh import Mesh
from tests.e2e.shared_mesh import SharedMesh

#: Module → the module whose shared mesh it takes over (it runs right after it).
RUNS_AFTER = {"test_mesh_tenants.py": "test_mesh_faults.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves each module of :data:`RUNS_AFTER` right behind the module it
    follows (when both are selected), keeping every other test's order."""
    def module(item: pytest.Item) -> str:
        return Path(str(item.fspath)).name

    followers = {name: [i for i in items if module(i) == name] for name in RUNS_AFTER}
    moved = {id(i) for name, group in followers.items() for i in group
             if any(module(j) == RUNS_AFTER[name] for j in items)}
    ordered = [i for i in items if id(i) not in moved]
    for name, group in followers.items():
        group = [i for i in group if id(i) in moved]
        if group:
            last = max(n for n, i in enumerate(ordered) if module(i) == RUNS_AFTER[name])
            ordered[last + 1:last + 1] = group
    items[:] = ordered


@pytest.fixture(scope="session")
def small_window_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMesh]:
    """One engine with a 512-token window on one thread, 1 s drains:
    test_mesh_faults's mesh (which kills and restarts the tokenizer, cache and
    router) and then test_mesh_tenants's, its router restarted with API keys."""
    with SharedMesh(lambda router_args: Mesh(
            ingress_port=0, admin_port=0, run_dir=tmp_path_factory.mktemp("small-window-mesh"),
            drain_seconds=1.0, engine_args=["--max-model-len", "512", "--num-threads", "1"],
            router_args=router_args)) as shared:
        yield shared


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[openai.OpenAI]:
    """The official ``openai`` client on the session mesh's Envoy listener."""
    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The session mesh's (first) served model."""
    return client.models.list().data[0].id
