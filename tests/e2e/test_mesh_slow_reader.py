"""The slow-reader budget on the real mesh: a client that stops reading is
cancelled at the engine (its KV blocks freed) about ``--client-write-timeout-s``
after its writes block, and ends RESOURCE_EXHAUSTED once it reads again.

A second router with a 1 s budget joins the suite's shared mesh (same
tokenizer, cache and engine) and is called directly: Envoy's ~1 MiB per
stream would absorb this answer (see tests/e2e/slow_reader_client.py).
Both ``Generate`` and ``GenerateStream``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from services.cli.mesh import Mesh, ServiceProcess
from tests.e2e.hostile_checks import wait_kv_idle
from tests.e2e.slow_reader_client import (
    HEAVY_TOKENS,
    heavy_request,
    stalled_generate,
    stalled_stream,
)
from tests.e2e.test_mesh_overload import metric

pytestmark = pytest.mark.mesh

BUDGET_S = 1.0


@pytest.fixture(scope="module")
def strict_router(mesh: Mesh) -> Iterator[ServiceProcess]:
    router = mesh.add_router("router-slow-reader",
                             ["--client-write-timeout-s", f"{BUDGET_S:g}"])
    yield router
    mesh.remove_router(router.name)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_a_client_that_stops_reading_is_cancelled_after_the_budget_and_its_blocks_freed(
        mesh: Mesh, strict_router: ServiceProcess, method: str) -> None:
    engines = [e.grpc_address for e in mesh.engines]
    wait_kv_idle(engines, 10)
    cancels = metric(strict_router.metrics_address, "llmesh:router_slow_client_cancels_total")
    exhausted = metric(strict_router.metrics_address, "llmesh:requests_total",
                       outcome="resource_exhausted")
    stall = stalled_generate if method == "Generate" else stalled_stream
    stalled = stall(strict_router.grpc_address, heavy_request())
    # The answer (~800 KB) outgrows the stream window after ~130 tokens; the
    # write then blocks, and the budget cancels the sequence 1 s later.
    idle_after = time.monotonic()
    wait_kv_idle(engines, 30)
    idle_after = time.monotonic() - idle_after
    assert metric(strict_router.metrics_address,
                  "llmesh:router_slow_client_cancels_total") == cancels + 1
    read, code, details = stalled.resume()
    print(f"engine idle {idle_after:.1f} s after the client stopped reading; it then read "
          f"{read} buffered messages and got {code.name}: {details}")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "--client-write-timeout-s" in details
    assert 0 < read < HEAVY_TOKENS - 1  # cut short: not the whole answer
    assert metric(strict_router.metrics_address, "llmesh:requests_total",
                  outcome="resource_exhausted") == exhausted + 1
