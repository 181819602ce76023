"""Engine replicas from DNS, on real gRPC servers and a real DNS server (the
stub in ``dns_stub.py``): ``dns:///NAME:PORT`` targets parse, the resolver
reads A/AAAA records, and a pool's replicas follow the records without a
restart: a new address joins once SERVING, a vanished one leaves routing at
once and its client closes when its last request ends, a failed resolution
keeps the last known set, an empty answer leaves none."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, generate_latest

from llmesh.v1 import engine_pb2_grpc, tokenizer_pb2_grpc
from services.common.sampling import Priority, SamplingOptions
from services.router.admission import AdmissionConfig
from services.router.discovery import (
    DnsResolver,
    EngineTarget,
    ResolveError,
    SystemResolver,
    make_resolver,
    parse_nameserver,
)
from services.router.metrics import RouterMetrics
from services.router.model_pool import PoolConfig, PoolSettings, open_pool
from services.router.routing import CostWeights, RoutingPolicy

from tests.router.dns_stub import DnsStub
from tests.router.router_fakes import FakeEngine, FakeTokenizer, encode, serve

NAME = "engines.llmesh.test"


def test_targets_parse_static_and_dns_forms() -> None:
    assert EngineTarget.parse("127.0.0.1:50061") == EngineTarget("127.0.0.1", 50061)
    assert EngineTarget.parse("[::1]:7") == EngineTarget("::1", 7)
    k8s = EngineTarget.parse("dns:///engine-headless.ns.svc.cluster.local:50061")
    assert k8s == EngineTarget("engine-headless.ns.svc.cluster.local", 50061, dns=True)
    assert str(k8s) == "dns:///engine-headless.ns.svc.cluster.local:50061"
    assert EngineTarget.parse("dns:engines:1") == EngineTarget("engines", 1, dns=True)
    for bad, says in [("engines", "HOST:PORT"), ("dns:///engines", "HOST:PORT"),
                      ("h:0", "1..65535"), ("dns://10.0.0.1/engines:1", "--dns-nameserver")]:
        with pytest.raises(ValueError, match=says):
            EngineTarget.parse(bad)
    with pytest.raises(ValueError, match="--model-pool.*dns:///NAME:PORT"):
        PoolConfig.parse("t:1=engines")
    assert PoolConfig.parse("t:1=dns:///e:2,h:3").engines == ("dns:///e:2", "h:3")


def test_the_nameserver_is_an_ip_with_an_optional_port() -> None:
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("10.96.0.10:5353") == ("10.96.0.10", 5353)
    assert parse_nameserver("fd00::a") == ("fd00::a", 53)
    assert parse_nameserver("[fd00::a]:54") == ("fd00::a", 54)
    for bad in ("", "  ", "dns.local:53", "10.96.0.10:0", "10.96.0.10:x"):
        with pytest.raises(ValueError, match=r"expected IP\[:PORT\] of a DNS server, "
                                             r"e\.g\. 10\.96\.0\.10:53"):
            parse_nameserver(bad)
    with pytest.raises(ValueError, match="DNS server"):
        make_resolver("")  # refused, not the system resolver
    assert isinstance(make_resolver(None), SystemResolver)
    resolver = make_resolver("127.0.0.1")
    assert isinstance(resolver, DnsResolver) and resolver._resolver.port == 53


def test_the_router_cli_refuses_a_bad_nameserver_with_its_own_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    from services.router.__main__ import main
    # main() is a process's entry: it ignores SIGHUP until its reload handler is
    # installed; put this process's disposition back, or every child started
    # later by the suite inherits SIG_IGN (test_api_keys' forwarded SIGHUP did
    # not end its child when this module ran first)
    previous = signal.getsignal(signal.SIGHUP)
    try:
        _refuses_bad_nameservers(main, capsys)
    finally:
        signal.signal(signal.SIGHUP, previous)


def _refuses_bad_nameservers(main: Callable[[list[str]], None],
                             capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("", "dns.local"):
        with pytest.raises(SystemExit) as exited:
            main(["--tokenizer", "t:1", "--engine", "e:2", "--dns-nameserver", bad])
        assert exited.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert "expected IP[:PORT] of a DNS server" in error and "dns:///" not in error


async def test_the_resolver_reads_a_and_aaaa_and_tells_nxdomain_from_no_records() -> None:
    stub = DnsStub()
    try:
        resolver = DnsResolver(stub.address, timeout_s=2)
        stub.records[NAME] = ["127.0.0.2", "127.0.0.1", "::1"]
        assert await resolver.resolve(NAME) == {"127.0.0.1", "127.0.0.2", "::1"}
        stub.records[NAME] = []
        assert await resolver.resolve(NAME) == frozenset()
        with pytest.raises(ResolveError) as err:
            await resolver.resolve("missing.llmesh.test")
        assert err.value.outcome == "nxdomain"
    finally:
        stub.stop()
    with pytest.raises(ValueError, match="IP address"):
        DnsResolver("dns.example:53")


async def test_the_system_resolver_reads_the_hosts_file() -> None:
    assert "127.0.0.1" in await SystemResolver().resolve("localhost")


async def serve_at(host: str, port: int, fake: FakeEngine) -> grpc.aio.Server:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(fake, server)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    assert server.add_insecure_port(f"{host}:{port}") == port
    await server.start()
    return server


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_pool_follows_its_dns_name_without_a_restart() -> None:
    stub = DnsStub()
    metrics = RouterMetrics(CollectorRegistry())
    tok_server, tok_target = await serve(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                                         FakeTokenizer())
    probe = grpc.aio.server()
    port = probe.add_insecure_port("127.0.0.1:0")  # a free port number for both engines
    await probe.stop(None)
    fakes = {ip: FakeEngine() for ip in ("127.0.0.1", "127.0.0.2")}
    fakes["127.0.0.3"] = FakeEngine(model="another-model")
    servers = [await serve_at(ip, port, fake) for ip, fake in fakes.items()]
    a, b, other = (f"{ip}:{port}" for ip in fakes)
    stub.records[NAME] = ["127.0.0.1"]
    settings = PoolSettings(default_max_tokens=16, max_tokens_cap=64, startup_timeout=10,
                            admission=AdmissionConfig(enabled=False),
                            routing_policy=RoutingPolicy.LEAST_LOAD,
                            routing_weights=CostWeights(), log_content=False,
                            resolve_interval_s=0.1)
    pool = await open_pool(PoolConfig(tok_target, (f"dns:///{NAME}:{port}",)), settings, None,
                           metrics, DnsResolver(stub.address))
    try:
        def serving() -> list[str]:
            return [e.target for e in pool.replicas.serving()]

        assert serving() == [a]
        stub.records[NAME] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        await until(lambda: sorted(serving()) == [a, b])
        assert pool.replicas.targets() == {a, b, other}  # the other model's stays out
        await asyncio.sleep(0.3)
        assert other not in serving()
        # A request running on A when A leaves DNS finishes; A's client closes after.
        fakes["127.0.0.1"].step_delay = 0.05
        engine_a = next(e for e in pool.engines if e.target == a)
        opened = engine_a.opened(Priority.INTERACTIVE)
        stream = engine_a.start(encode("hi"), SamplingOptions(max_tokens=8),
                                priority=Priority.INTERACTIVE, request_id="r", deadline=None)
        stub.records[NAME] = ["127.0.0.2"]
        await until(lambda: serving() == [b])
        assert pool.replicas.retiring() == [a]  # its request still runs
        assert a not in pool.replicas.targets() and other not in pool.replicas.targets()
        ids: list[int] = []
        while True:
            delta = await stream.read()
            ids.extend(delta.token_ids)
            if delta.finished:
                break
        assert len(ids) == 8
        stream.close()
        engine_a.closed(opened)
        await until(lambda: pool.replicas.retiring() == [], timeout=5)
        # A resolution that fails keeps what was known; an empty answer leaves none.
        del stub.records[NAME]
        await asyncio.sleep(0.5)
        assert serving() == [b]
        stub.records[NAME] = []
        await until(lambda: serving() == [])
        text = metrics_text(metrics)
        assert f'llmesh:router_discovery_resolutions_total{{name="{NAME}",outcome="nxdomain"}}' \
            in text
        assert f'llmesh:router_discovery_replicas{{name="{NAME}"}} 0.0' in text
    finally:
        await pool.close()
        for server in (*servers, tok_server):
            await server.stop(None)
        stub.stop()


def metrics_text(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()
