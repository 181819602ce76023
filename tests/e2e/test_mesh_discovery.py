"""Replica discovery and graceful engine drain (issue 17), on real processes:
a tokenizer, two SmolLM2 engines on the same port of two loopback addresses
(127.0.0.1 and 127.0.0.2), a router that follows ``dns:///engines.llmesh.test``
through a DNS server the test controls (``tests/router/dns_stub.py``).

* the router starts routing to an address added to the name and stops
  routing to one removed from it, whose in-flight streams finish; the router
  never restarts (same PID);
* SIGTERM to an engine running 5 streams: its health answers NOT_SERVING at
  once, new requests go to the other engine, the 5 streams finish whole, the
  engine exits 0 within its ``--drain-seconds``;
* the same for a router behind Envoy (two routers in Envoy's cluster, checked
  with gRPC health checks): Envoy stops sending to the draining one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import json
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.envoy_config import DESCRIPTOR_RELATIVE, EnvoySettings
from services.cli.mesh import (
    REPO_ROOT,
    EnvoyProcess,
    ServiceProcess,
    child_env,
    log_tail,
    stop_processes,
)
from tests.router.dns_stub import DnsStub

pytestmark = pytest.mark.mesh

NAME = "engines.llmesh.test"
#: Grace periods: generous, so that a loaded machine still drains in time
#: (measured on 2 CPUs: ~2 s for the engine, ~10 s for the router).
ENGINE_DRAIN_S = 60.0
ROUTER_DRAIN_S = 120.0
#: Seconds Envoy may take to act on a health flag its admin already shows
#: (measured: one request ~0.2 s after the flag still went to the old host).
ENVOY_SETTLE_S = 1.0
MAX_TOKENS = 96
#: Tokens of the streams that must outlive a change of records.
LONG = 400


@dataclass
class Cluster:
    dns: DnsStub
    port: int  # both engines' gRPC port
    services: dict[str, ServiceProcess]
    run_dir: Path

    @property
    def router(self) -> ServiceProcess:
        return self.services["router"]

    def engine(self, ip: str) -> ServiceProcess:
        return self.services[f"engine-{ip}"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_on_both() -> int:
    for _ in range(20):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def service(run_dir: Path, name: str, role: str, host: str, args: list[str],
            port: int = 0, drain_s: float = 10.0) -> ServiceProcess:
    port_file = run_dir / f"{name}.json"
    argv = [sys.executable, "-m", f"services.{role}", "--host", host, "--port", str(port),
            "--metrics-port", "0", "--port-file", str(port_file),
            "--drain-seconds", f"{drain_s:g}", *args]
    return ServiceProcess(name, argv, host, run_dir / f"{name}.log", port_file)


def is_serving(address: str, timeout: float = 1.0) -> int | None:
    """The health status of ``address`` (None: no answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return None


def wait_for(condition, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("discovery")
    dns = DnsStub()
    dns.records[NAME] = ["127.0.0.1"]
    port = free_port_on_both()
    engine_args = ["--max-model-len", "512", "--num-threads", "1", "--max-num-seqs", "8"]
    tokenizer = service(run_dir, "tokenizer", "tokenizer", "127.0.0.1", [])
    engines = [service(run_dir, f"engine-{ip}", "engine", ip,
                       [*engine_args, "--replica-id", f"discovery-{ip}"], port=port,
                       drain_s=ENGINE_DRAIN_S) for ip in ("127.0.0.1", "127.0.0.2")]
    started: list[ServiceProcess] = []
    try:
        for child in (tokenizer, *engines):
            child.spawn(child_env(), REPO_ROOT)
            started.append(child)
        wait_for(tokenizer.read_port_file, 120, "the tokenizer's port file")
        router = service(run_dir, "router", "router", "127.0.0.1", [
            "--tokenizer", tokenizer.grpc_address, "--engine", f"dns:///{NAME}:{port}",
            "--dns-nameserver", dns.address, "--engine-resolve-interval", "0.5"])
        router.spawn(child_env(), REPO_ROOT)
        started.append(router)
        for child in started:
            wait_for(child.read_port_file, 300, f"{child.name}'s port file")
            wait_for(lambda c=child: c.exit_code() is not None or is_serving(c.grpc_address)
                     == health_pb2.HealthCheckResponse.SERVING, 300, f"{child.name} serving")
            assert child.exit_code() is None, log_tail(child.log_path)
        yield Cluster(dns, port, {c.name: c for c in started}, run_dir)
    finally:
        stop_processes([c.process for c in started if c.process is not None], 10)
        dns.stop()


def routed(cluster: Cluster) -> dict[str, float]:
    """``llmesh:router_routed_requests_total`` by engine address, from the router."""
    url = f"http://{cluster.router.metrics_address}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    counts: dict[str, float] = collections.defaultdict(float)  # 0 for one never routed to
    for line in text.splitlines():
        if line.startswith("llmesh:router_routed_requests_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            counts[engine] += float(line.rsplit(" ", 1)[1])
    return counts


def router_metric(cluster: Cluster, series: str) -> float | None:
    """The value of one series (``name{labels}``) on the router's /metrics."""
    url = f"http://{cluster.router.metrics_address}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    prefix = f"{series} "
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), None)


def router_gauge(cluster: Cluster, engine: str) -> float | None:
    """``llmesh:router_replica_serving`` of ``engine`` (None: not a replica)."""
    return router_metric(cluster, f'llmesh:router_replica_serving{{engine="{engine}"}}')


class Streams:
    """Generate streams run in threads; ``tokens[i]`` counts what stream i got."""

    def __init__(self, address: str, count: int, max_tokens: int = MAX_TOKENS) -> None:
        self.tokens = [0] * count
        self.finish: list[int | None] = [None] * count
        self.errors: list[grpc.RpcError] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(count)
        self._channel = grpc.insecure_channel(address)
        self._futures = [self._pool.submit(self._run, i, max_tokens) for i in range(count)]

    def _run(self, index: int, max_tokens: int) -> None:
        stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        request = generation_pb2.GenerateRequest(
            prompt=f"Stream {index}: tell a long story about the sea.", bypass_cache=True,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True),
            # One engine step a token: with suffix decoding a stream that
            # falls into a loop ended its 400 tokens while the others had 60
            # (CI: [63, 400, 60, 60, 60]), before the drain it must outlast.
            speculative=common_pb2.SpeculativeParams(
                method=common_pb2.SPECULATIVE_METHOD_NONE))
        try:
            for response in stub.Generate(request, timeout=300):
                self.tokens[index] += len(response.token_ids)
                if response.finish_reason:
                    self.finish[index] = response.finish_reason
        except grpc.RpcError as err:
            self.errors.append(err)

    def join(self, timeout: float = 300) -> None:
        for future in self._futures:
            future.result(timeout=timeout)
        self._pool.shutdown()
        self._channel.close()


def assert_drained(streams: Streams, tokens: int, drained: ServiceProcess, signalled: float,
                   grace_s: float) -> None:
    """Every stream ended normally with all ``tokens``, and ``drained`` (sent
    SIGTERM at monotonic ``signalled``) exited 0 within ``grace_s``."""
    streams.join()
    assert not streams.errors, streams.errors
    assert streams.tokens == [tokens] * len(streams.tokens)
    assert streams.finish == [common_pb2.FINISH_REASON_LENGTH] * len(streams.tokens)
    assert drained.process is not None
    code = drained.process.wait(timeout=grace_s + 10)
    took = time.monotonic() - signalled
    assert code == 0, log_tail(drained.log_path)
    assert took < grace_s, f"{drained.name} exited {took:.1f} s after SIGTERM"


def ask_at(address: str, max_tokens: int = 4) -> None:
    streams = Streams(address, 1, max_tokens)
    streams.join()
    assert not streams.errors and streams.tokens == [max_tokens], streams.errors


def ask(cluster: Cluster, max_tokens: int = 4) -> None:
    ask_at(cluster.router.grpc_address, max_tokens)


def test_replicas_join_and_leave_with_the_records(cluster: Cluster) -> None:
    a, b = (f"{ip}:{cluster.port}" for ip in ("127.0.0.1", "127.0.0.2"))
    pid = cluster.router.pid
    before = routed(cluster)
    for _ in range(2):
        ask(cluster)
    running = Streams(cluster.router.grpc_address, 2, max_tokens=LONG)  # on A: alone
    wait_for(lambda: all(running.tokens), 60, "both long streams' first tokens")
    after = routed(cluster)
    assert after.get(a, 0) - before.get(a, 0) == 4 and after.get(b, 0) == 0
    assert router_gauge(cluster, b) is None  # not a replica yet

    cluster.dns.records[NAME] = ["127.0.0.1", "127.0.0.2"]
    wait_for(lambda: router_gauge(cluster, b) == 1.0, 30, "the added replica in routing")
    before = routed(cluster)
    for _ in range(2):
        ask(cluster)
    assert routed(cluster)[b] - before.get(b, 0) >= 1  # B takes requests (A is busy)

    # A leaves the name while its two streams run: they finish, A gets nothing new.
    cluster.dns.records[NAME] = ["127.0.0.2"]
    wait_for(lambda: router_gauge(cluster, a) is None, 30, "the removed replica out")
    assert not all(t == LONG for t in running.tokens), "streams ended before the removal"
    before = routed(cluster)
    for _ in range(3):
        ask(cluster)
    running.join()
    assert not running.errors and running.tokens == [LONG] * 2
    after = routed(cluster)
    assert after[a] == before[a] and after[b] - before[b] == 3
    assert cluster.router.pid == pid and cluster.router.exit_code() is None
    wait_for(lambda: '"engine_retired"' in cluster.router.log_path.read_text(), 10,
             "A's client closed")
    log = cluster.router.log_path.read_text()
    assert '"engine_added"' in log and '"engine_removed"' in log

    # No record at all: no replica, and requests say why.
    cluster.dns.records[NAME] = []
    wait_for(lambda: router_gauge(cluster, b) is None, 30, "the last replica out")
    empty = Streams(cluster.router.grpc_address, 1, 4)
    empty.join()
    assert [e.code() for e in empty.errors] == [grpc.StatusCode.UNAVAILABLE]
    assert "resolves to no address" in empty.errors[0].details()
    cluster.dns.records[NAME] = ["127.0.0.2"]
    wait_for(lambda: router_gauge(cluster, b) == 1.0, 30, "B back")
    ask(cluster)
    assert cluster.router.pid == pid and cluster.router.exit_code() is None


def test_sigterm_to_an_engine_drains_it_while_the_router_moves_on(cluster: Cluster) -> None:
    """E (127.0.0.2) runs 5 streams, the other engine (127.0.0.1) joins, then E
    gets SIGTERM."""
    a, e = (f"{ip}:{cluster.port}" for ip in ("127.0.0.1", "127.0.0.2"))
    cluster.dns.records[NAME] = ["127.0.0.2"]
    wait_for(lambda: router_gauge(cluster, a) is None and router_gauge(cluster, e) == 1.0, 30,
             "E alone in routing")
    before = routed(cluster)
    streams = Streams(cluster.router.grpc_address, 5)
    wait_for(lambda: all(streams.tokens), 60, "the 5 streams' first tokens")
    assert routed(cluster)[e] - before[e] == 5
    cluster.dns.records[NAME] = ["127.0.0.1", "127.0.0.2"]
    wait_for(lambda: router_gauge(cluster, a) == 1.0, 30, "the other engine in routing")

    engine = cluster.engine("127.0.0.2")
    engine.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    at_signal = list(streams.tokens)
    assert wait_for(lambda: is_serving(e) == health_pb2.HealthCheckResponse.NOT_SERVING, 2,
                    "NOT_SERVING")
    assert all(0 < t < MAX_TOKENS for t in at_signal), at_signal
    before = routed(cluster)
    wait_for(lambda: router_gauge(cluster, e) == 0.0, 5, "the router taking E out")
    # The router's probe read NOT_SERVING (not a refused connection): E kept
    # answering health checks while it drained.
    assert router_metric(cluster, 'llmesh:router_replica_failovers_total{engine="'
                                  f'{e}",reason="not_serving"}}') == 1.0
    assert is_serving(e) == health_pb2.HealthCheckResponse.NOT_SERVING
    for _ in range(2):
        ask(cluster)
    after = routed(cluster)
    assert after.get(e, 0) == before.get(e, 0) and after[a] - before[a] == 2
    assert_drained(streams, MAX_TOKENS, engine, signalled, ENGINE_DRAIN_S)
    ask(cluster)  # the router still serves, from the other engine


def envoy_health(envoy: EnvoyProcess, port: int) -> str:
    """Envoy's health flags of the router endpoint at ``port`` (admin /clusters)."""
    text = urllib.request.urlopen(f"{envoy.admin_url}/clusters", timeout=5).read().decode()
    prefix = f"router::127.0.0.1:{port}::health_flags::"
    return next((line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)),
                "")


def router_process(cluster: Cluster, name: str, port: int) -> ServiceProcess:
    router = service(cluster.run_dir, name, "router", "127.0.0.1", [
        "--tokenizer", cluster.services["tokenizer"].grpc_address,
        "--engine", f"127.0.0.1:{cluster.port}"], port=port, drain_s=ROUTER_DRAIN_S)
    router.spawn(child_env(), REPO_ROOT)
    return router


def logged_at(line: str) -> datetime.datetime:
    """The time of one JSON log line."""
    return datetime.datetime.fromisoformat(json.loads(line)["timestamp"])


def routed_total(router: ServiceProcess) -> float:
    url = f"http://{router.metrics_address}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmesh:router_routed_requests_total{"))


def test_sigterm_to_a_router_behind_envoy_drains_it(cluster: Cluster) -> None:
    """R1 runs 5 streams through Envoy while R2 is down; R2 comes up and Envoy
    finds it healthy; then R1 gets SIGTERM."""
    ports = free_port(), free_port()
    envoy = EnvoyProcess(cluster.run_dir / "envoy", EnvoySettings(
        ingress_port=0, admin_port=0, router_port=ports[0],
        more_routers=(f"127.0.0.1:{ports[1]}",), openai_port=None,
        descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE)))
    r1 = router_process(cluster, "router-1", ports[0])
    routers = [r1]
    try:
        wait_for(lambda: r1.exit_code() is not None or is_serving(f"127.0.0.1:{ports[0]}")
                 == health_pb2.HealthCheckResponse.SERVING, 120, "R1 serving")
        wait_for(r1.read_port_file, 10, "R1's port file")
        envoy.start()
        wait_for(lambda: envoy_health(envoy, ports[0]) == "healthy", 10, "R1 healthy in Envoy")
        assert "failed_active_hc" in envoy_health(envoy, ports[1])  # R2 is not up
        streams = Streams(envoy.ingress_address, 5, max_tokens=LONG)
        wait_for(lambda: all(streams.tokens), 60, "the 5 streams' first tokens")
        assert routed_total(r1) == 5

        r2 = router_process(cluster, "router-2", ports[1])
        routers.append(r2)
        wait_for(lambda: r2.exit_code() is not None
                 or envoy_health(envoy, ports[1]) == "healthy", 120, "R2 healthy in Envoy")
        assert r2.exit_code() is None, log_tail(r2.log_path)
        wait_for(r2.read_port_file, 10, "R2's port file")

        r1.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        at_signal = list(streams.tokens)
        assert wait_for(lambda: is_serving(f"127.0.0.1:{ports[0]}")
                        == health_pb2.HealthCheckResponse.NOT_SERVING, 2, "R1 NOT_SERVING")
        assert all(0 < t < LONG for t in at_signal), at_signal
        r2_before = routed_total(r2)
        # Before Envoy knows, a request may reach R1: R1 refuses it UNAVAILABLE and
        # Envoy retries it on R2 (the client sees no error).
        ask_at(envoy.ingress_address)
        wait_for(lambda: "failed_active_hc" in envoy_health(envoy, ports[0]), 5,
                 "Envoy's health check taking R1 out")
        time.sleep(ENVOY_SETTLE_S)
        settled = datetime.datetime.now(datetime.UTC)
        for _ in range(3):  # Envoy sends them to R2 only
            ask_at(envoy.ingress_address)
        assert routed_total(r2) - r2_before == 4
        assert routed_total(r1) == 5
        late = [line for line in r1.log_path.read_text().splitlines()
                if '"request_refused"' in line and logged_at(line) > settled]
        assert not late, late
        assert_drained(streams, LONG, r1, signalled, ROUTER_DRAIN_S)
        ask_at(envoy.ingress_address)
    finally:
        envoy.stop()
        stop_processes([r.process for r in routers if r.process is not None], 10)
