"""Meshes that several e2e modules share, each module with its own router flags
(``Mesh.restart_router``: a router restart takes a second or two, a mesh start
a model load and a tokenizer, cache and Envoy start). The modules that share
one run next to each other (:func:`pytest_collection_modifyitems`), so that no
shared mesh sits idle in memory (~1.6 GB an engine) while other modules run
theirs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli.mesh import Mesh, ModelSpec
from services.common.model_files import default_model_path
from services.tokenizer.model_parts import gemma3_270m_gguf_path
from tests.cache.redis_server import start_redis_server
from tests.e2e.fuzz_strategies import MESH_ENGINE_ARGS
from tests.e2e.shared_mesh import SharedMesh

#: Module → the module whose shared mesh it takes over (it runs right after
#: it). A chain is listed in its order: faults, then tenants, then fuzz.
RUNS_AFTER = {"test_mesh_tenants.py": "test_mesh_faults.py",
              "test_mesh_fuzz.py": "test_mesh_tenants.py",
              "test_mesh_cascade.py": "test_mesh_models.py"}


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
    """One engine with the fuzz strategies' 512-token window
    (``MESH_ENGINE_ARGS``; all CPUs: on one thread the fuzz's cases took twice
    as long and a stream script outlived its 20 s deadline at load ~13), the
    cache on a Redis of its own, 1 s drains: test_mesh_faults's mesh (which
    kills and restarts the tokenizer, cache and router), then
    test_mesh_tenants's (its router restarted with API keys), then
    test_mesh_fuzz's (its router restarted without them; it stops the mesh)."""
    with start_redis_server() as redis, SharedMesh(lambda router_args: Mesh(
            ingress_port=0, admin_port=0, run_dir=tmp_path_factory.mktemp("small-window-mesh"),
            redis_url=redis.url, drain_seconds=1.0,
            engine_args=list(MESH_ENGINE_ARGS),
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


@pytest.fixture(scope="session")
def two_model_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMesh]:
    """Two models in one mesh (``llmesh up --model NAME=PATH`` twice):
    SmolLM2-135M-Instruct (``smollm2``, chat, the default) and the Gemma 3 270M
    base model (``gemma3``), each with its own tokenizer and one engine
    (512-token window, 64 MiB of KV): test_mesh_models's mesh, then
    test_mesh_cascade's (its router restarted with ``--cascade``; it stops
    the mesh)."""
    with SharedMesh(lambda router_args: Mesh(
            ingress_port=0, admin_port=0, run_dir=tmp_path_factory.mktemp("two-model-mesh"),
            models=[ModelSpec("smollm2", str(default_model_path())),
                    ModelSpec("gemma3", str(gemma3_270m_gguf_path()))],
            engine_args=["--max-model-len", "512", "--kv-cache-bytes", str(64 << 20)],
            router_args=router_args)) as shared:
        yield shared
