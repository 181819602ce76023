"""The slow-reader budget on the real mesh: a client that stops reading is
cancelled at the engine (its KV blocks freed) about ``--client-write-timeout-s``
after its writes block, and ends RESOURCE_EXHAUSTED once it reads again.

A second router with a 1 s budget joins the suite's shared mesh (same
tokenizer, cache and engine). It is called directly (the router's own
flow control), and through an Envoy of its own rendered by
services/cli/envoy_config.py: Envoy holds a stalled stream's answer up to its
ingress stream window plus the router's stream window, then stops reading
from the router, whose writes block. That Envoy's ingress window is 64 KiB
(the mesh's is 1 MiB: the same limit, so a shorter answer fills it; see
tests/e2e/slow_reader_client.py). Both ``Generate`` and ``GenerateStream``.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from services.cli.envoy_config import DESCRIPTOR_RELATIVE, REPO_ROOT, EnvoySettings
from services.cli.mesh import EnvoyProcess, Mesh, ServiceProcess
from tests.e2e.hostile_checks import wait_kv_idle
from tests.e2e.slow_reader_client import (
    HEAVY_TOKENS,
    StalledCall,
    heavy_request,
    stalled_generate,
    stalled_stream,
)
from tests.e2e.test_mesh_overload import metric

pytestmark = pytest.mark.mesh

BUDGET_S = 1.0
#: The ingress stream window of the test's Envoy (bytes; Envoy's minimum is 65,535).
ENVOY_WINDOW_BYTES = 65_536
#: Bytes Envoy may read from the router past its two windows: response
#: headers, frame headers, health-check answers during the test.
ENVOY_SLACK_BYTES = 16_384


@pytest.fixture(scope="module")
def strict_router(mesh: Mesh) -> Iterator[ServiceProcess]:
    router = mesh.add_router("router-slow-reader",
                             ["--client-write-timeout-s", f"{BUDGET_S:g}"])
    yield router
    mesh.remove_router(router.name)


@pytest.fixture(scope="module")
def strict_ingress(strict_router: ServiceProcess,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyProcess]:
    """An Envoy in front of the strict router (``llmesh up``'s rendering but
    for the ports, no OpenAI routes and a 64 KiB ingress stream window)."""
    envoy = EnvoyProcess(tmp_path_factory.mktemp("slow-reader-envoy"), EnvoySettings(
        ingress_port=0, admin_port=0, router_host=strict_router.host,
        router_port=strict_router.grpc_port, openai_port=None,
        descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE),
        downstream_stream_window_bytes=ENVOY_WINDOW_BYTES))
    envoy.start()
    yield envoy
    envoy.stop()


def envoy_counter(envoy: EnvoyProcess, name: str) -> int:
    """The value of Envoy's counter ``name`` (admin ``/stats``; 0 when not yet created)."""
    body = urllib.request.urlopen(f"{envoy.admin_url}/stats?filter=^{re.escape(name)}$",
                                  timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)}: (\d+)$", body, re.M)
    return int(match.group(1)) if match else 0


def stall_until_cancelled(mesh: Mesh, router: ServiceProcess, address: str,
                          method: str) -> tuple[StalledCall, float]:
    """Starts :func:`heavy_request` with ``method`` at ``address`` (the
    router, or an Envoy in front of it), stops reading after one message and
    waits (30 s at most) until the engine is idle; asserts that ``router``
    counted one slow-client cancel. Returns the stalled call and the seconds
    from the stall to the idle engine."""
    engines = [e.grpc_address for e in mesh.engines]
    wait_kv_idle(engines, 10)
    cancels = metric(router.metrics_address, "llmesh:router_slow_client_cancels_total")
    stall = stalled_generate if method == "Generate" else stalled_stream
    stalled = stall(address, heavy_request())
    idle_after = time.monotonic()
    wait_kv_idle(engines, 30)
    idle_after = time.monotonic() - idle_after
    assert metric(router.metrics_address,
                  "llmesh:router_slow_client_cancels_total") == cancels + 1
    return stalled, idle_after


def resume_to_the_budget_status(stalled: StalledCall) -> tuple[int, str]:
    """Reads the rest of ``stalled``; asserts it ends RESOURCE_EXHAUSTED naming
    the budget, short of the whole answer. Returns (messages read, status message)."""
    read, code, details = stalled.resume()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "--client-write-timeout-s" in details
    assert 0 < read < HEAVY_TOKENS - 1  # cut short: not the whole answer
    return read, details


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_a_client_that_stops_reading_is_cancelled_after_the_budget_and_its_blocks_freed(
        mesh: Mesh, strict_router: ServiceProcess, method: str) -> None:
    exhausted = metric(strict_router.metrics_address, "llmesh:requests_total",
                       outcome="resource_exhausted")
    # The answer (~800 KB) outgrows the client's stream window after ~130
    # tokens; the write then blocks, and the budget cancels the sequence 1 s later.
    stalled, idle_after = stall_until_cancelled(mesh, strict_router,
                                                strict_router.grpc_address, method)
    read, details = resume_to_the_budget_status(stalled)
    print(f"engine idle {idle_after:.1f} s after the client stopped reading; it then read "
          f"{read} buffered messages and got RESOURCE_EXHAUSTED: {details}")
    assert metric(strict_router.metrics_address, "llmesh:requests_total",
                  outcome="resource_exhausted") == exhausted + 1


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_a_client_that_stops_reading_through_envoy_is_cancelled_and_sees_the_budget_status(
        mesh: Mesh, strict_router: ServiceProcess, strict_ingress: EnvoyProcess,
        method: str) -> None:
    received = envoy_counter(strict_ingress, "cluster.router.upstream_cx_rx_bytes_total")
    paused = envoy_counter(strict_ingress,
                           "cluster.router.upstream_flow_control_paused_reading_total")
    # Envoy takes ~128 KiB of the ~800 KB answer (its two windows) and stops
    # reading from the router; the router's write blocks, the budget cancels.
    stalled, idle_after = stall_until_cancelled(mesh, strict_router,
                                                strict_ingress.ingress_address, method)
    held = envoy_counter(strict_ingress, "cluster.router.upstream_cx_rx_bytes_total") - received
    assert envoy_counter(strict_ingress,
                         "cluster.router.upstream_flow_control_paused_reading_total") > paused
    assert held <= ENVOY_WINDOW_BYTES + EnvoySettings().upstream_stream_window_bytes \
        + ENVOY_SLACK_BYTES
    # Envoy passes the router's trailers on: the client sees the budget's status.
    read, details = resume_to_the_budget_status(stalled)
    print(f"through Envoy: engine idle {idle_after:.1f} s after the client stopped reading; "
          f"Envoy had read {held} bytes from the router; the client then read {read} "
          f"messages and got RESOURCE_EXHAUSTED: {details}")
