"""The router's replica set on real gRPC servers (fake engines on loopback): a
replica leaves routing when it stops, drains or goes silent, its streams end
UNAVAILABLE instead of hanging, and it rejoins when it serves again."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from llmesh.v1 import engine_pb2_grpc
from services.common.sampling import Priority, SamplingOptions
from services.router.admission import ReplicaCapacity
from services.router.clients import UpstreamError
from services.router.engine_client import EngineClient
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet
from services.router.routing import ReplicaPicker, RouteHint, RoutingPolicy

from tests.router.router_fakes import FakeEngine, serve

INTERVAL, TIMEOUT = 0.05, 0.2


class StallingHealth(health_pb2_grpc.HealthServicer):
    """Health that answers SERVING, or nothing at all while ``stalled`` (a hung process)."""

    def __init__(self) -> None:
        self.stalled = False
        self.status = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request, context):
        while self.stalled:
            await asyncio.sleep(0.01)
        return health_pb2.HealthCheckResponse(status=self.status)


async def serve_engine(fake: FakeEngine, port: int = 0,
                       health: StallingHealth | None = None) -> tuple[grpc.aio.Server, str]:
    if health is None and port == 0:
        return await serve(engine_pb2_grpc.add_EngineServiceServicer_to_server, fake)
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(health or StallingHealth(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


async def until(predicate, timeout: float = 3.0) -> float:
    """Waits for ``predicate``; returns the seconds it took."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "condition not reached in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - began


@pytest.fixture
def metrics() -> RouterMetrics:
    return RouterMetrics(CollectorRegistry())


async def test_a_stopped_replica_leaves_routing_and_rejoins_when_it_serves_again(
        metrics: RouterMetrics) -> None:
    fakes = [FakeEngine(), FakeEngine()]
    servers = [await serve_engine(f) for f in fakes]
    engines = [EngineClient(target) for _, target in servers]
    changes: list[dict[EngineClient, ReplicaCapacity]] = []
    replicas = ReplicaSet(engines, [ReplicaCapacity(2, 0)] * 2, on_change=changes.append,
                          metrics=metrics, probe_interval_s=INTERVAL, probe_timeout_s=TIMEOUT)
    replicas.start()
    restarted = None
    try:
        assert replicas.serving() == engines
        port = int(servers[0][1].rsplit(":", 1)[1])
        await servers[0][0].stop(None)
        took = await until(lambda: replicas.serving() == [engines[1]])
        assert took < INTERVAL + TIMEOUT + 0.1
        assert changes[-1] == {engines[1]: ReplicaCapacity(2, 0)}
        sample = metrics.registry.get_sample_value
        assert sample("llmesh:router_replica_serving", {"engine": engines[0].target}) == 0
        assert sample("llmesh:router_replica_failovers_total",
                      {"engine": engines[0].target, "reason": "call_failed"}) == 1
        # The same address serves again (a restarted engine): back within about a second
        # (the channel's reconnect backoff is at most 1 s).
        restarted = await serve_engine(fakes[0], port=port)
        await until(lambda: replicas.serving() == engines, timeout=3.0)
        # Its capacity is read again (GetModelInfo: the fake reports none).
        assert changes[-1] == {engines[0]: ReplicaCapacity(0, 0),
                               engines[1]: ReplicaCapacity(2, 0)}
        assert sample("llmesh:router_replica_serving", {"engine": engines[0].target}) == 1
    finally:
        await replicas.close()
        for engine in engines:
            await engine.close()
        for server, _ in [*servers[1:], *([restarted] if restarted else [])]:
            await server.stop(None)


async def test_a_restarted_replica_gets_its_load_back_when_it_rejoins_and_takes_requests(
        metrics: RouterMetrics) -> None:
    """An engine down for seconds (as a SIGKILLed one restarting is) serves
    again on its port: its load stream is back as soon as the replica is in
    routing, and kv_aware picks it, idle, over the busy survivor. (A load
    stream reopened on a blind backoff that grew while the engine was down,
    0.1 s doubling to 2 s, came back up to 2 s after the replica rejoined; its
    stale load priced it as saturated, so every request in between went to
    the survivor.)"""
    fakes = [FakeEngine(), FakeEngine()]
    fakes[1].step_delay = 10.0  # the survivor runs a long stream throughout
    servers = [await serve_engine(f) for f in fakes]
    engines = [EngineClient(target) for _, target in servers]
    replicas = ReplicaSet(engines, [ReplicaCapacity(2, 0)] * 2, metrics=metrics,
                          probe_interval_s=INTERVAL, probe_timeout_s=TIMEOUT)
    picker = ReplicaPicker(RoutingPolicy.KV_AWARE, None, metrics)
    for engine in engines:
        engine.load_watch.start()
    replicas.start()
    restarted = None
    busy = engines[1].start((1, 2, 3), SamplingOptions(max_tokens=50),
                            priority=Priority.INTERACTIVE, request_id="busy", deadline=None)
    try:
        await until(lambda: all(not e.load_watch.current().stale for e in engines)
                    and engines[1].load_watch.current().load.num_running == 1)
        port = int(servers[0][1].rsplit(":", 1)[1])
        await servers[0][0].stop(None)
        await until(lambda: replicas.serving() == [engines[1]])
        await asyncio.sleep(3.3)  # down long enough for any backoff to reach its cap
        restarted = await serve_engine(fakes[0], port=port)
        await until(lambda: replicas.serving() == engines, timeout=3.0)
        lag = await until(lambda: not engines[0].load_watch.current().stale, timeout=3.0)
        assert lag < 0.3, f"the load stream came back {lag:.2f} s after the replica rejoined"
        choice = await picker.choose(replicas.serving(), Priority.INTERACTIVE, RouteHint(8))
        assert choice.order[0] is engines[0], choice.costs
    finally:
        busy.close()
        await replicas.close()
        for engine in engines:
            await engine.close()
        for server, _ in [*servers[1:], *([restarted] if restarted else [])]:
            await server.stop(None)


async def test_a_draining_replica_leaves_routing_and_comes_back_when_serving(
        metrics: RouterMetrics) -> None:
    health = StallingHealth()
    server, target = await serve_engine(FakeEngine(), health=health)
    engine = EngineClient(target)
    replicas = ReplicaSet([engine], [ReplicaCapacity()], metrics=metrics,
                          probe_interval_s=INTERVAL, probe_timeout_s=TIMEOUT)
    replicas.start()
    try:
        health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await until(lambda: not replicas.serving())
        assert metrics.registry.get_sample_value(
            "llmesh:router_replica_failovers_total",
            {"engine": target, "reason": "not_serving"}) == 1
        health.status = health_pb2.HealthCheckResponse.SERVING
        await until(lambda: replicas.serving() == [engine])
    finally:
        await replicas.close()
        await engine.close()
        await server.stop(None)


async def test_a_silent_replica_leaves_routing_and_its_streams_end_unavailable(
        metrics: RouterMetrics) -> None:
    """A replica that answers nothing (a hung process keeps its connection) goes
    out after one probe timeout (as the only replica it still takes requests);
    its open streams end UNAVAILABLE once it has been silent for
    ``fail_silent_after_s``, not when TCP keepalive notices."""
    fake, health = FakeEngine(), StallingHealth()
    fake.step_delay = 10.0  # the stream would stay open for minutes
    server, target = await serve_engine(fake, health=health)
    engine = EngineClient(target)
    replicas = ReplicaSet([engine], [ReplicaCapacity()], metrics=metrics,
                          probe_interval_s=INTERVAL, probe_timeout_s=TIMEOUT,
                          fail_silent_after_s=0.5)
    replicas.start()
    try:
        stream = engine.start((1, 2, 3), SamplingOptions(max_tokens=50),
                              priority=Priority.INTERACTIVE, request_id="r", deadline=None)
        await stream.read()  # the first token
        health.stalled = True
        stalled_at = time.monotonic()
        gauge = {"engine": target}
        await until(lambda: metrics.registry.get_sample_value(
            "llmesh:router_replica_serving", gauge) == 0)
        assert time.monotonic() - stalled_at < 2 * TIMEOUT + INTERVAL + 0.1
        # The only replica: still used for new requests (it may only be slow), and
        # its capacity still counts.
        assert replicas.serving() == [engine] and replicas.capacities() == {engine: ReplicaCapacity()}
        with pytest.raises(UpstreamError) as failed:
            while True:
                await asyncio.wait_for(stream.read(), 3.0)
        ended = time.monotonic() - stalled_at
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "the router ended the Multiplex call" in failed.value.details
        assert "no health probe" in failed.value.details
        assert 0.5 <= ended < 0.5 + TIMEOUT + INTERVAL + 0.3, ended
        assert metrics.registry.get_sample_value(
            "llmesh:router_replica_failovers_total", {"engine": target, "reason": "silent"}) == 1
        stream.close()
        health.stalled = False
        await until(lambda: metrics.registry.get_sample_value(
            "llmesh:router_replica_serving", gauge) == 1)
    finally:
        await replicas.close()
        await engine.close()
        await server.stop(None)


async def test_new_requests_avoid_a_silent_replica_while_another_serves(
        metrics: RouterMetrics) -> None:
    health = StallingHealth()
    servers = [await serve_engine(FakeEngine(), health=health), await serve_engine(FakeEngine())]
    engines = [EngineClient(target) for _, target in servers]
    replicas = ReplicaSet(engines, [ReplicaCapacity(2, 0)] * 2, metrics=metrics,
                          probe_interval_s=INTERVAL, probe_timeout_s=TIMEOUT)
    replicas.start()
    try:
        health.stalled = True
        await until(lambda: replicas.serving() == [engines[1]])
        assert not replicas.is_serving(engines[0])
        assert list(replicas.capacities().values()) == [ReplicaCapacity(2, 0)] * 2  # still counted
        health.stalled = False
        await until(lambda: replicas.serving() == engines)
    finally:
        await replicas.close()
        for engine in engines:
            await engine.close()
        for server, _ in servers:
            await server.stop(None)
