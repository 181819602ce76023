"""Which threads of a running service read its sockets: gRPC's EventEngine
pool (gRPC 1.85's default) or the ``grpc.aio`` poller thread
(``services.common.grpc_polling.read_on_poller``), seen from outside the
process in ``/proc``.

With EventEngine reads every call's request wakes a pool thread (named
``event_engine``) at least once; on the poller thread the pool sleeps (a few
wake-ups for timers). Measured on a bare ``grpc.aio`` server and client in
one process, 200 unary calls: 1,236 voluntary context switches of its
``event_engine`` threads against 6.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: The name gRPC core gives the threads of its EventEngine pool.
EVENT_ENGINE_THREAD = "event_engine"
#: Most pool wake-ups per call of a process that reads on the poller thread.
#: Measured in a mesh (200 calls, twice per service, 2026-12-07): 3.0-3.9 a
#: call on gRPC's default (main's router, cache and tokenizer); 0.03-0.49 on
#: the poller thread (every service here; main's engine 0.14-0.17): the pool's
#: timers and a service's own background streams (3-37 wake-ups a second when
#: idle, more per call when the machine is busy and the calls slower).
MAX_POLLER_WAKEUPS_PER_CALL = 1.5


def event_engine_wakeups(pid: int) -> int:
    """Voluntary context switches (sleeps, each ended by a wake-up) of process
    ``pid``'s ``event_engine`` threads so far, summed; a thread that ended
    since an earlier reading no longer counts."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != EVENT_ENGINE_THREAD:
                continue
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between listing and reading
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def wakeups_per_call(pid: int, address: str, calls: int = 200) -> float:
    """``event_engine`` wake-ups of process ``pid`` per gRPC health check sent
    to it at ``address`` (``host:port``, plaintext), ``calls`` of them one after
    the other on one channel, after one uncounted call that connects it."""
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        check(health_pb2.HealthCheckRequest(), timeout=10)
        before = event_engine_wakeups(pid)
        for _ in range(calls):
            check(health_pb2.HealthCheckRequest(), timeout=10)
        return (event_engine_wakeups(pid) - before) / calls
