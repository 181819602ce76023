"""Engine replicas from DNS: the router follows a name's A/AAAA records without a restart.

An ``--engine`` (or ``--model-pool`` engine) value is either a static
``HOST:PORT`` (one replica, as always) or ``dns:///NAME:PORT`` (gRPC's naming
syntax): every address NAME resolves to, at PORT, is a replica. That is how a
Kubernetes headless Service is used: one A record per ready pod. Both forms may
be mixed in one pool.

:class:`Discovery` owns the resolution loop of one pool: every
``interval_s`` seconds (and soon after a replica's call fails: a pod may have
gone) it resolves each name and hands the difference to the pool's
:class:`~services.router.replicas.ReplicaSet` on the event loop:

* a new address becomes a new replica: its client is made, its health probe
  starts, and it joins routing once it answers SERVING and its
  ``GetModelInfo`` fits the pool (same model; see ``ReplicaSet``);
* a vanished address leaves routing at once; its in-flight requests may
  finish (a pod that left the Service is usually draining), and its client
  closes when the last one ends (or after ``ReplicaSet``'s retire bound);
* a failed resolution (NXDOMAIN, timeout, no nameserver answers) keeps the
  name's last known addresses; an answer with no records (a Service with no
  ready pod) leaves the name with no replica. With no replica left, requests
  end UNAVAILABLE (the pipeline says so), as when every replica is out.

Resolvers: :class:`SystemResolver` (the default) asks the C library
(``getaddrinfo``: ``/etc/hosts``, ``resolv.conf`` with its search domains and
``ndots``, as every other program on a Kubernetes pod); :class:`DnsResolver`
asks one nameserver directly with dnspython (``--dns-nameserver IP[:PORT]``:
tests, or a cluster DNS the pod's ``resolv.conf`` does not name).

Metrics: ``llmesh:router_discovery_resolutions_total{name, outcome}``
(``ok``, ``no_records``, ``nxdomain``, ``timeout``, ``error``) and
``llmesh:router_discovery_replicas{name}`` (addresses the name has now).

Threading: everything runs on the router's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from services.router.metrics import RouterMetrics

log = structlog.get_logger()

#: Seconds between two resolutions of every name (``--engine-resolve-interval``).
DEFAULT_RESOLVE_INTERVAL_S = 5.0
#: Most seconds one resolution may take before it counts as ``timeout``.
DEFAULT_RESOLVE_TIMEOUT_S = 2.0
#: Fewest seconds between two resolutions asked for by failures (a burst of
#: failing replicas costs one lookup, not one each).
MIN_RESOLVE_GAP_S = 0.5

_DNS_SCHEME = "dns:"


@dataclass(frozen=True)
class EngineTarget:
    """One ``--engine`` value: a static address or a DNS name to follow.

    Attributes:
      host: an IP literal or host name (static), or the name to resolve (dns).
      port: the engines' gRPC port.
      dns: True for ``dns:///NAME:PORT``.
    """

    host: str
    port: int
    dns: bool = False

    @classmethod
    def parse(cls, text: str) -> EngineTarget:
        """``HOST:PORT``, ``[IPV6]:PORT``, ``dns:///NAME:PORT`` or ``dns:NAME:PORT``.

        Raises:
          ValueError: no port, a port outside 1..65535, an empty host, or a DNS
            authority (``dns://SERVER/NAME``: use ``--dns-nameserver``).
        """
        value = text.strip()
        dns = value.startswith(_DNS_SCHEME)
        if dns:
            value = value[len(_DNS_SCHEME):]
            if value.startswith("//"):
                authority, _, value = value[2:].partition("/")
                if authority:
                    raise ValueError(
                        f"engine {text!r}: a DNS server in the target (dns://SERVER/...) is "
                        "not supported; write dns:///NAME:PORT and give the server with "
                        "--dns-nameserver IP[:PORT]")
        host, port = split_host_port(value, what=f"engine {text!r}")
        return cls(host, port, dns)

    def __str__(self) -> str:
        address = join_host_port(self.host, self.port)
        return f"dns:///{address}" if self.dns else address


def split_host_port(text: str, *, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` → (host, port).

    Raises:
      ValueError: ``what`` and the expected form.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT or dns:///NAME:PORT with a port in "
                         "1..65535 (e.g. 127.0.0.1:50061 or "
                         "dns:///engine-headless.default.svc.cluster.local:50061)")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (gRPC's target form)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def engine_target(text: str) -> str:
    """argparse ``type`` of ``--engine``: checks the value, keeps the text.

    Raises:
      argparse.ArgumentTypeError: what :meth:`EngineTarget.parse` refuses (its
        message, which argparse prints; it hides a ValueError's).
    """
    try:
        EngineTarget.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip()


class ResolveError(Exception):
    """A resolution that gave no answer; ``outcome`` is its metric label
    (``nxdomain``, ``timeout``, ``error``)."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class Resolver(Protocol):
    async def resolve(self, name: str) -> frozenset[str]:
        """The IP addresses of ``name`` (empty: the name has no A/AAAA record).

        Raises:
          ResolveError: no answer (the caller keeps what it knew).
        """
        ...


class SystemResolver:
    """The C library's resolver (``getaddrinfo``) run in the loop's executor.

    glibc does not always tell "no such name" from "no address records"; both
    come back as ``nxdomain`` here, so a name keeps its last addresses until an
    answer says otherwise (a vanished pod still leaves routing through its
    failing health probe).
    """

    def __init__(self, timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    async def resolve(self, name: str) -> frozenset[str]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):  # never swallows a cancel
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except TimeoutError as err:
            raise ResolveError("timeout", f"no answer within {self.timeout_s:g} s") from err
        except socket.gaierror as err:
            if err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
                raise ResolveError("nxdomain", str(err)) from err
            if err.errno == socket.EAI_AGAIN:
                raise ResolveError("timeout", str(err)) from err
            raise ResolveError("error", str(err)) from err
        return frozenset(str(info[4][0]) for info in infos
                         if info[0] in (socket.AF_INET, socket.AF_INET6))


class DnsResolver:
    """Asks one nameserver (UDP, then TCP when truncated) for A and AAAA records
    with dnspython; no search domains: give a fully qualified name.

    Args:
      nameserver: ``IP[:PORT]`` of the DNS server (port 53 when none is given).
      timeout_s: most seconds one resolution may take.

    Raises:
      ValueError: ``nameserver`` is not ``IP[:PORT]`` (see :func:`parse_nameserver`).
    """

    def __init__(self, nameserver: str, timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S) -> None:
        import dns.asyncresolver  # only routers pointed at a nameserver need it

        host, port = parse_nameserver(nameserver)
        self.nameserver = nameserver
        self._resolver = dns.asyncresolver.Resolver(configure=False)
        self._resolver.nameservers = [host]
        self._resolver.port = port
        self._resolver.lifetime = timeout_s
        self.timeout_s = timeout_s

    async def resolve(self, name: str) -> frozenset[str]:
        import dns.exception
        import dns.resolver

        addresses: set[str] = set()
        missing = 0
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(name, rdtype, search=False)
            except dns.resolver.NXDOMAIN as err:
                raise ResolveError("nxdomain", f"{name} does not exist") from err
            except dns.resolver.NoAnswer:
                missing += 1
                continue
            except dns.exception.Timeout as err:
                raise ResolveError("timeout", f"{self.nameserver} gave no answer within "
                                              f"{self.timeout_s:g} s") from err
            except dns.exception.DNSException as err:
                raise ResolveError("error", f"{type(err).__name__}: {err}") from err
            addresses.update(record.address for record in answer)
        return frozenset(addresses)


class ReplicaMembership(Protocol):
    """What :class:`Discovery` asks of the replica set (see ``ReplicaSet``)."""

    def targets(self) -> set[str]: ...

    def add(self, target: str) -> None: ...

    def remove(self, target: str) -> None: ...


class Discovery:
    """Keeps one pool's replicas equal to its static targets plus what its DNS
    names resolve to (see the module docstring).

    Args:
      targets: the pool's ``--engine`` values, parsed.
      resolver: how names are resolved.
      metrics: the router's metrics.
      interval_s: seconds between resolutions.
    """

    def __init__(self, targets: Sequence[EngineTarget], resolver: Resolver,
                 metrics: RouterMetrics | None = None, *,
                 interval_s: float = DEFAULT_RESOLVE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"the resolve interval must be > 0 seconds, got {interval_s:g}")
        self.static = [str(t) for t in targets if not t.dns]
        self.names = [t for t in targets if t.dns]
        self.resolver = resolver
        self.replicas: ReplicaMembership | None = None
        self.metrics = metrics
        self.interval_s = interval_s
        self._known: dict[EngineTarget, frozenset[str]] = {}  # last answer per name
        self._soon = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def wanted(self) -> list[str]:
        """The replica addresses the pool should have now: static ones first,
        then each name's last known addresses (sorted)."""
        wanted = list(self.static)
        for name in self.names:
            wanted += sorted(join_host_port(ip, name.port) for ip in self._known.get(name, ()))
        return list(dict.fromkeys(wanted))

    async def resolve_all(self) -> list[str]:
        """Resolves every name once (concurrently) and returns :meth:`wanted`;
        never raises (a failed name keeps its last addresses)."""
        await asyncio.gather(*(self._resolve(name) for name in self.names))
        return self.wanted()

    async def _resolve(self, name: EngineTarget) -> None:
        try:
            addresses = await self.resolver.resolve(name.host)
        except ResolveError as err:
            self._count(name, err.outcome)
            log.warning("engine_resolution_failed", name=name.host, outcome=err.outcome,
                        why=str(err), keeping=len(self._known.get(name, ())))
            return
        self._count(name, "ok" if addresses else "no_records")
        if addresses != self._known.get(name):
            log.info("engine_addresses", name=name.host, addresses=sorted(addresses))
        self._known[name] = addresses
        if self.metrics is not None:
            self.metrics.discovery_replicas.labels(name.host).set(len(addresses))

    def _count(self, name: EngineTarget, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.discovery_resolutions.labels(name.host, outcome).inc()

    def attach(self, replicas: ReplicaMembership) -> None:
        """Gives discovery the replica set it feeds (the pool's; it owns the
        clients). Resolution works before, for the pool's first replicas."""
        self.replicas = replicas

    def apply(self) -> None:
        """Adds the wanted replicas the set lacks and removes the ones no longer
        wanted (after :meth:`attach`)."""
        assert self.replicas is not None, "attach() the replica set first"
        wanted = self.wanted()
        have = self.replicas.targets()
        for target in wanted:
            if target not in have:
                self.replicas.add(target)
        for target in sorted(have - set(wanted)):
            self.replicas.remove(target)

    def resolve_soon(self, _why: str = "") -> None:
        """Asks for a resolution now (at most one per :data:`MIN_RESOLVE_GAP_S`)."""
        self._soon.set()

    def start(self) -> None:
        """Starts the loop when there is a name to follow (idempotent)."""
        if self.names and self._task is None:
            self._task = asyncio.create_task(self._run(), context=contextvars.Context(),
                                             name="engine discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._soon.wait()
            self._soon.clear()
            await self.resolve_all()
            try:
                self.apply()
            except Exception:  # never let one bad change stop discovery
                log.exception("engine_discovery_apply_failed")
            await asyncio.sleep(min(MIN_RESOLVE_GAP_S, self.interval_s))


def parse_nameserver(text: str) -> tuple[str, int]:
    """``--dns-nameserver``: ``IP``, ``IP:PORT`` or ``[IPV6]:PORT`` → (ip, port);
    without a port, 53.

    Raises:
      ValueError: empty, not an IP literal, or a port outside 1..65535.
    """
    value = text.strip()
    usage = (f"--dns-nameserver {text!r}: expected IP[:PORT] of a DNS server, e.g. "
             "10.96.0.10:53 (an IP address; port 53 when none is given)")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(value)), 53  # 10.96.0.10, fd00::a (no port)
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(usage)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(usage) from None
    return host, int(port)


def make_resolver(nameserver: str | None, timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S
                  ) -> Resolver:
    """:class:`DnsResolver` for ``nameserver`` (``IP[:PORT]``; an empty one is
    refused), else (None) the system's."""
    return (DnsResolver(nameserver, timeout_s) if nameserver is not None
            else SystemResolver(timeout_s))
