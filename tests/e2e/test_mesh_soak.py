"""A short soak on the suite's shared mesh: benchmarks/soak.py's mix (complete,
client cancel, GenerateStream cancel, stop strings, short deadlines, a
subprocess client SIGKILLed mid-stream) with 500 requests at 16 concurrent,
and its checks: KV pool back to idle, RSS of each service within +50 MB of
its start, 0 lost requests, no INTERNAL / UNKNOWN / UNAVAILABLE."""

from __future__ import annotations

import pytest

from benchmarks.soak import Service, soak
from services.cli.mesh import Mesh

pytestmark = pytest.mark.mesh

REQUESTS = 500


def test_500_mixed_requests_leave_the_mesh_as_it_was(mesh: Mesh) -> None:
    services = [Service(name, s.pid, s.grpc_address) for name, s in mesh.services.items()
                if s.process is not None and s.process.poll() is None]
    report = soak(mesh.ingress_address, services, [e.grpc_address for e in mesh.engines],
                  requests=REQUESTS, concurrency=16)
    print(report.table())
    assert report.ok, report.failures
    assert sum(report.outcomes.values()) == REQUESTS
