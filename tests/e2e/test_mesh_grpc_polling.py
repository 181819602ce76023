"""Every service of a running mesh reads its sockets on the ``grpc.aio``
poller thread (``read_on_poller()`` first thing in its ``__main__``): a call
to it wakes none of gRPC's EventEngine pool threads (``tests/poller_reads.py``).
Seen from ``/proc`` of the real processes ``llmesh up`` started; the
retriever's is in ``tests/retriever/test_retriever_service.py``."""

from __future__ import annotations

import pytest

from services.cli.mesh import Mesh
from tests.poller_reads import MAX_POLLER_WAKEUPS_PER_CALL, wakeups_per_call

pytestmark = pytest.mark.mesh


@pytest.mark.parametrize("name", ["tokenizer", "cache", "engine-0", "router"])
def test_each_service_reads_its_sockets_on_the_poller_thread(mesh: Mesh, name: str) -> None:
    service = mesh.services[name]
    per_call = wakeups_per_call(service.pid, service.grpc_address)
    assert per_call < MAX_POLLER_WAKEUPS_PER_CALL, (
        f"{name}: {per_call:.2f} EventEngine wake-ups per call (GRPC_EXPERIMENTS not set "
        "before grpc was imported?)")
