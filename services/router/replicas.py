"""Which engine replicas take new requests: failover by health and liveness.

:class:`ReplicaSet` owns the routing state of the router's engine replicas:
one probe task per replica calls ``grpc.health.v1.Health/Check`` every
``probe_interval_s`` with a ``probe_timeout_s`` deadline. A replica takes new
requests while it is *in*:

* it goes **out** at once when its ``Multiplex`` call fails (the engine died:
  the connection reset), when a probe fails or answers anything but SERVING
  (it drains), or when a probe gets no answer in time (it went silent: a
  hung or stopped process keeps its connection open and answers nothing;
  a silent replica still takes requests when no other is in, and keeps its
  capacity, since it may only be slow). A replica silent for
  ``fail_silent_after_s`` has its ``Multiplex`` call
  failed by the router, so that its in-flight streams end UNAVAILABLE
  instead of hanging until TCP keepalive notices (later than going out, so
  that one slow answer from a busy engine never ends healthy streams);
* it comes back **in** when a probe says SERVING again (a restarted engine on
  the same address), after its ``GetModelInfo`` is read again (its capacity
  may have changed).

Membership changes at run time (:mod:`services.router.discovery` owns it):
:meth:`ReplicaSet.add` makes a client for a new address and probes it; it
joins routing once a probe says SERVING and its ``GetModelInfo`` fits the pool
(``admit``: the same model, a context window no smaller than the pool's).
:meth:`ReplicaSet.remove` takes a replica out of routing at once and retires
it: its in-flight requests may finish, and its client is closed when the last
one ends, or after ``retire_after_s`` (then they end UNAVAILABLE).

Every change calls ``on_change`` with the capacities of the replicas now in,
by client, which the router passes to admission control (its concurrency cap
follows the replicas that serve, and a request running on a replica that
left holds none of the others' slots: :mod:`services.router.admission`). Metrics: ``llmesh:router_replica_serving{engine}``
(1 in, 0 out) and ``llmesh:router_replica_failovers_total{engine, reason}``
(a replica leaving the routing set: ``call_failed``, ``not_serving``,
``silent``, ``removed``); a removed replica's ``serving`` series is dropped.

Failover of requests themselves is the pipeline's
(:mod:`services.router.generation`): a request whose replica fails before
its first token is retried once on each other replica in; one that already
streamed tokens ends UNAVAILABLE.

Threading: everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.wire.engine_info import ModelInfo
from services.router.admission import ReplicaCapacity
from services.router.clients import UpstreamError
from services.router.engine_client import EngineClient
from services.router.metrics import RouterMetrics

log = structlog.get_logger()

#: Seconds between health probes of each replica.
DEFAULT_PROBE_INTERVAL_S = 0.25
#: Seconds a probe waits for its answer before the replica counts as silent.
DEFAULT_PROBE_TIMEOUT_S = 0.75
#: Seconds of silence after which a replica's in-flight requests are failed.
DEFAULT_FAIL_SILENT_AFTER_S = 3.0
#: Most seconds a removed replica's in-flight requests may still run.
DEFAULT_RETIRE_AFTER_S = 600.0

CapacityListener = Callable[[dict[EngineClient, ReplicaCapacity]], None]
#: Why a new replica may not join the pool (None: it may), from its model info.
AdmitCheck = Callable[[ModelInfo], "str | None"]


class ReplicaSet:
    """The engine replicas and which of them take new requests.

    Args:
      engines: every configured replica (in: all of them at start, which the
        router has just seen SERVING).
      capacities: each replica's capacity from ``GetModelInfo``, same order.
      on_change: called with the capacities of the replicas in after each change.
      metrics: the router's metrics.
      probe_interval_s, probe_timeout_s, fail_silent_after_s: see the module
        docstring (seconds).
    """

    def __init__(self, engines: Sequence[EngineClient], capacities: Sequence[ReplicaCapacity],
                 *, on_change: CapacityListener | None = None,
                 metrics: RouterMetrics | None = None,
                 probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 fail_silent_after_s: float = DEFAULT_FAIL_SILENT_AFTER_S,
                 make_client: Callable[[str], EngineClient] = EngineClient,
                 admit: AdmitCheck | None = None,
                 on_lost: Callable[[str], None] | None = None,
                 retire_after_s: float = DEFAULT_RETIRE_AFTER_S) -> None:
        """Further args (for :meth:`add` and :meth:`remove`):
          make_client: makes the client of an added ``host:port``.
          admit: why an added replica may not join (see :data:`AdmitCheck`).
          on_lost: called with the reason when a replica's call fails or it
            stops serving (discovery resolves again soon: a pod may be gone).
          retire_after_s: most seconds a removed replica's requests may run.
        """
        self.engines = list(engines)
        self._capacity = dict(zip(self.engines, capacities, strict=True))
        self._in = set(self.engines)
        self._silent: set[EngineClient] = set()  # out of routing while another is in
        self._on_change = on_change
        self._metrics = metrics
        self._interval = probe_interval_s
        self._timeout = probe_timeout_s
        self._fail_silent_after = fail_silent_after_s
        self._make_client = make_client
        self._admit = admit
        self._on_lost = on_lost
        self._retire_after = retire_after_s
        self._started = False
        self._tasks: dict[EngineClient, asyncio.Task[None]] = {}
        self._retiring: dict[EngineClient, asyncio.Task[None]] = {}
        self._refused: dict[EngineClient, str] = {}  # added, but its info does not fit
        self._wake = {engine: asyncio.Event() for engine in self.engines}
        for engine in self.engines:
            self._gauge(engine, 1)
            engine.on_call_failed = functools.partial(self._call_failed, engine)

    # ---- queries -----------------------------------------------------------

    def serving(self) -> list[EngineClient]:
        """The replicas that take new requests, in configuration order: those in,
        or, when none is, the silent ones (a replica that is only slow to answer
        its probes is better than none; one whose call failed or that drains
        never is)."""
        chosen = self._in or self._silent
        return [engine for engine in self.engines if engine in chosen]

    def is_serving(self, engine: EngineClient) -> bool:
        return engine in (self._in or self._silent)

    def is_member(self, engine: EngineClient) -> bool:
        """False once ``engine`` was removed (its client is retiring)."""
        return engine in self._wake

    def retiring(self) -> list[str]:
        """The ``host:port`` of removed replicas whose clients are not closed yet."""
        return [engine.target for engine in self._retiring]

    def targets(self) -> set[str]:
        """The ``host:port`` of every member replica, in routing or not."""
        return {engine.target for engine in self.engines}

    def capacities(self) -> dict[EngineClient, ReplicaCapacity]:
        """The capacities of the replicas in or silent, by client, in
        configuration order (a silent replica may be only slow: its running
        requests still count)."""
        return {e: self._capacity[e] for e in self.engines
                if e in self._in or e in self._silent}

    # ---- verbs -------------------------------------------------------------

    def start(self) -> None:
        """Starts one probe task per replica (idempotent)."""
        self._started = True
        for engine in self.engines:
            if engine not in self._tasks:
                self._tasks[engine] = asyncio.create_task(
                    self._probe(engine), context=contextvars.Context(),
                    name=f"probe {engine.target}")

    def add(self, target: str) -> EngineClient:
        """A new replica at ``target`` (``host:port``): out of routing until a
        probe says SERVING and its model info is admitted. Returns its client."""
        engine = self._make_client(target)
        self.engines.append(engine)
        self._wake[engine] = asyncio.Event()
        engine.on_call_failed = functools.partial(self._call_failed, engine)
        self._gauge(engine, 0)
        log.info("engine_added", engine=target, replicas=len(self.engines))
        if self._started:
            self.start()
        return engine

    def remove(self, target: str) -> None:
        """Takes the replica at ``target`` out of routing and membership at once;
        its client closes when its in-flight requests end (at most
        ``retire_after_s`` later). Unknown targets are ignored."""
        engine = next((e for e in self.engines if e.target == target), None)
        if engine is None:
            return
        was_serving = engine in self._in or engine in self._silent
        self.engines.remove(engine)
        self._in.discard(engine)
        self._silent.discard(engine)
        self._capacity.pop(engine, None)
        self._refused.pop(engine, None)
        self._wake.pop(engine, None)
        engine.on_call_failed = None
        probe = self._tasks.pop(engine, None)
        if probe is not None:
            probe.cancel()
        if self._metrics is not None:
            with contextlib.suppress(KeyError):
                self._metrics.replica_serving.remove(engine.target)
            if was_serving:
                self._metrics.replica_failovers.labels(engine.target, "removed").inc()
        log.info("engine_removed", engine=target, in_flight=engine.in_flight,
                 serving=len(self._in), replicas=len(self.engines))
        self._retiring[engine] = asyncio.create_task(
            self._retire(engine), context=contextvars.Context(), name=f"retire {target}")
        if was_serving:
            self._changed()

    async def _retire(self, engine: EngineClient) -> None:
        """Closes a removed replica's client once it carries no request."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._retire_after
        try:
            while engine.in_flight > 0 and loop.time() < until:
                await asyncio.sleep(0.05)
            if engine.in_flight > 0:
                engine.fail_calls(f"the replica left discovery {self._retire_after:g} s ago")
            await engine.close()
            log.info("engine_retired", engine=engine.target)
        finally:
            self._retiring.pop(engine, None)

    async def close(self) -> None:
        """Stops the probes and closes the removed replicas' clients (the
        members' clients are the pool's to close)."""
        tasks = [*self._tasks.values(), *self._retiring.values()]
        retiring = list(self._retiring)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in retiring), return_exceptions=True)
        self._tasks = {}
        self._retiring = {}

    # ---- internals -----------------------------------------------------------

    def _call_failed(self, engine: EngineClient, why: str) -> None:
        self._take_out(engine, "call_failed", why)
        self._wake[engine].set()  # probe now: a replica that only dropped its call is back at once

    async def _probe(self, engine: EngineClient) -> None:
        stub = health_pb2_grpc.HealthStub(engine.channel)
        request = health_pb2.HealthCheckRequest(service="")
        loop = asyncio.get_running_loop()
        silent_since: float | None = None
        while True:
            try:
                reply = await stub.Check(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    silent_since = None
                    self._take_out(engine, "call_failed", f"{err.code().name}: {err.details()}")
                else:
                    now = loop.time()
                    silent_since = now - self._timeout if silent_since is None else silent_since
                    self._go_silent(engine)
                    if now - silent_since >= self._fail_silent_after:
                        engine.fail_calls(f"the replica answered no health probe for "
                                          f"{now - silent_since:.1f} s")
            else:
                silent_since = None
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    await self._bring_in(engine)
                else:
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    self._take_out(engine, "not_serving", f"health is {status}")
            wake = self._wake.get(engine)
            if wake is None:  # removed
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await wake.wait()
            wake.clear()

    async def _bring_in(self, engine: EngineClient) -> None:
        if engine in self._in:
            return
        if engine in self._silent:  # it answers again: it only was slow or stopped
            self._silent.discard(engine)
            self._in.add(engine)
            self._gauge(engine, 1)
            log.info("engine_answers_again", engine=engine.target, serving=len(self._in))
            self._changed()
            return
        try:
            info = await engine.model_info(timeout=self._timeout * 4)
        except UpstreamError as err:
            log.warning("engine_rejoin_failed", engine=engine.target, code=err.code.name,
                        details=err.details)
            return
        if not self.is_member(engine):  # removed while its info was read
            return
        refusal = self._admit(info) if self._admit is not None else None
        if refusal is not None:
            if self._refused.get(engine) != refusal:
                log.warning("engine_not_admitted", engine=engine.target, why=refusal)
            self._refused[engine] = refusal
            return
        self._refused.pop(engine, None)
        self._capacity[engine] = ReplicaCapacity(info.max_num_seqs, info.kv_capacity_tokens)
        self._in.add(engine)
        self._gauge(engine, 1)
        log.info("engine_rejoined", engine=engine.target, serving=len(self._in),
                 max_num_seqs=info.max_num_seqs)
        self._changed()

    def _go_silent(self, engine: EngineClient) -> None:
        if engine not in self._in:
            return
        self._in.discard(engine)
        self._silent.add(engine)
        self._gauge(engine, 0)
        if self._metrics is not None:
            self._metrics.replica_failovers.labels(engine.target, "silent").inc()
        log.warning("engine_out_of_routing", engine=engine.target, reason="silent",
                    why=f"no health answer within {self._timeout:g} s", serving=len(self._in))
        self._changed()

    def _take_out(self, engine: EngineClient, reason: str, why: str) -> None:
        if engine not in self._in and engine not in self._silent:
            return
        was_in = engine in self._in
        self._in.discard(engine)
        self._silent.discard(engine)
        self._gauge(engine, 0)
        if self._metrics is not None and was_in:
            self._metrics.replica_failovers.labels(engine.target, reason).inc()
        log.warning("engine_out_of_routing", engine=engine.target, reason=reason, why=why,
                    serving=len(self._in))
        self._changed()
        if self._on_lost is not None:
            self._on_lost(why)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.capacities())

    def _gauge(self, engine: EngineClient, value: int) -> None:
        if self._metrics is not None:
            self._metrics.replica_serving.labels(engine.target).set(value)
