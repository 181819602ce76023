"""A short soak on the suite's shared mesh: benchmarks/soak.py's mix (complete,
client cancel, GenerateStream cancel, stop strings, short deadlines, a
subprocess client SIGKILLed mid-stream) with 500 requests at 16 concurrent,
and its checks: KV pool back to idle, RSS of every process, Envoy included,
within +50 MB of its value after a 32-request warm-up (start, warmed-up and
end values reported), every process still under its PID and serving, 0 lost
requests, no INTERNAL / UNKNOWN / UNAVAILABLE."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import soak
from services.cli.mesh import Mesh
from tests.e2e.hostile_checks import ENVOY, watched

pytestmark = pytest.mark.mesh

REQUESTS = 500


def test_500_mixed_requests_leave_the_mesh_as_it_was(mesh: Mesh) -> None:
    processes = watched(mesh)
    report = soak(mesh.ingress_address, processes, [e.grpc_address for e in mesh.engines],
                  requests=REQUESTS, concurrency=16)
    print(report.table())
    assert report.ok, report.failures
    assert sum(report.outcomes.values()) == REQUESTS
    names = {p.name for p in processes}
    assert ENVOY in names and {"router", "tokenizer", "cache"} <= names
    as_json = json.loads(json.dumps(report.as_dict()))
    for name in names:  # every process's start, warmed-up and end RSS, Envoy's too
        rss = as_json["rss_mb"][name]
        assert 0 < rss["start"] and 0 < rss["after_warmup"] and 0 < rss["end"], (name, rss)
        assert rss["growth"] == pytest.approx(rss["end"] - rss["after_warmup"])
