"""Checks shared by the hostile tests and scripts (fuzz, soak, faults, slow
reader): service PIDs, gRPC health, resident memory, the engines' KV pool.

Everything here reads a running mesh from outside: PIDs and ``/proc``,
``grpc.health.v1``, the engine's ``GetLoad`` RPC.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import engine_pb2, engine_pb2_grpc
from services.cli.mesh import Mesh


def pids(mesh: Mesh) -> dict[str, int]:
    """Service name → PID (Envoy included)."""
    found = {name: service.pid for name, service in mesh.services.items()}
    if mesh.envoy is not None:
        found["envoy"] = mesh.envoy.pid
    return found


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (``VmRSS`` of ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rss_by_service(mesh: Mesh) -> dict[str, float]:
    """Service name → resident MB."""
    return {name: rss_mb(pid) for name, pid in pids(mesh).items()}


def rss_growth(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Service name → MB grown (services in both maps)."""
    return {name: after[name] - before[name] for name in before if name in after}


def serving(address: str, timeout_s: float = 2.0) -> bool:
    """True when the gRPC server at ``address`` answers health SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def not_serving(mesh: Mesh) -> list[str]:
    """Names of services whose health is not SERVING."""
    return [name for name, service in mesh.services.items()
            if not serving(service.grpc_address)]


def engine_load(address: str) -> engine_pb2.GetLoadResponse:
    """The engine's ``GetLoad``: running, waiting, KV usage (cached blocks count free)."""
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetLoad(
            engine_pb2.GetLoadRequest(), timeout=5)


def wait_kv_idle(addresses: list[str], within_s: float) -> dict[str, engine_pb2.GetLoadResponse]:
    """Waits until every engine is idle: no running or waiting sequence and
    KV usage 0 (free + cached blocks == total). Returns the last loads.

    Raises:
      AssertionError: an engine is not idle after ``within_s`` seconds.
    """
    deadline = time.monotonic() + within_s
    while True:
        loads = {a: engine_load(a) for a in addresses}
        if all(l.num_running == 0 and l.num_waiting == 0 and l.kv_cache_usage == 0
               for l in loads.values()):
            return loads
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not idle after {within_s} s: "
                                 + "; ".join(f"{a}: {str(l).strip()}"
                                             for a, l in loads.items()))
        time.sleep(0.05)
