"""Checks shared by the hostile tests and scripts (fuzz, soak, faults, slow
reader): service PIDs, gRPC health, Envoy's readiness, resident memory, the
engines' KV pool.

Everything here reads a running mesh from outside: PIDs and ``/proc``,
``grpc.health.v1``, Envoy's admin ``/ready``, the engine's ``GetLoad`` RPC.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import engine_pb2, engine_pb2_grpc

if TYPE_CHECKING:  # the launcher pulls in Envoy's config types (~2 s of imports):
    # benchmarks/soak.py's subprocess clients import this module, and start cold
    from services.cli.mesh import Mesh


#: The name Envoy goes by among the watched processes.
ENVOY = "envoy"


@dataclass(frozen=True)
class Watched:
    """One process of a mesh under test.

    Attributes:
      name: the service's name (``router``, ``engine-0``, ...) or :data:`ENVOY`.
      pid: its PID when the run began (a restart gives it another).
      address: a service's gRPC ``host:port``; Envoy's admin URL (``http://host:port``).
    """

    name: str
    pid: int
    address: str


def watched(mesh: Mesh) -> list[Watched]:
    """The services of ``mesh`` that run (a router :meth:`Mesh.remove_router`
    stopped is not one) and its Envoy."""
    found = [Watched(name, service.pid, service.grpc_address)
             for name, service in mesh.services.items()
             if service.process is not None and service.process.poll() is None]
    if mesh.envoy is not None:
        found.append(Watched(ENVOY, mesh.envoy.pid, mesh.envoy.admin_url))
    return found


def envoy_pid(run_dir: Path) -> int | None:
    """The PID of the Envoy that runs ``RUN_DIR/envoy.yaml`` (``llmesh up``
    starts it as ``envoy -c RUN_DIR/envoy.yaml ...``), found in ``/proc``; None
    when none runs."""
    config = str(Path(run_dir).resolve() / "envoy.yaml")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for index, arg in enumerate(argv[:-1]):
            if arg == b"-c" and argv[index + 1].decode(errors="replace") == config:
                return int(entry.name)
    return None


def watched_from_run_dir(run_dir: Path) -> tuple[list[Watched], list[str]]:
    """The processes of the mesh ``llmesh up --run-dir RUN_DIR`` runs (each
    service's port file holds its PID and ports; Envoy is found by its config
    path and its admin address file), and the engines' gRPC addresses."""
    processes, engines = [], []
    for port_file in sorted(Path(run_dir).glob("*.json")):
        data = json.loads(port_file.read_text())
        if "pid" not in data or "grpc_port" not in data:
            continue
        address = f"127.0.0.1:{data['grpc_port']}"
        processes.append(Watched(port_file.stem, int(data["pid"]), address))
        if port_file.stem.startswith("engine"):
            engines.append(address)
    pid = envoy_pid(run_dir)
    admin = Path(run_dir) / "envoy-admin-address"
    if pid is not None and admin.exists():
        processes.append(Watched(ENVOY, pid, f"http://{admin.read_text().strip()}"))
    return processes, engines


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def envoy_ready(admin_url: str, timeout_s: float = 2.0) -> bool:
    """True when Envoy's admin ``/ready`` answers 200 (it is LIVE)."""
    try:
        with urllib.request.urlopen(f"{admin_url}/ready", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def problems(processes: Sequence[Watched]) -> list[str]:
    """What is no longer as it was, one line each: a process that does not
    run under its PID any more (it died, or was restarted), a service whose
    gRPC health is not SERVING, an Envoy whose ``/ready`` is not 200."""
    found = []
    for process in processes:
        if not alive(process.pid):
            found.append(f"{process.name} (pid {process.pid}) is gone: it died or restarted")
        elif process.name == ENVOY:
            if not envoy_ready(process.address):
                found.append(f"{process.name} is not ready (admin /ready)")
        elif not serving(process.address):
            found.append(f"{process.name} is not SERVING")
    return found


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
