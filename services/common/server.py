"""The server kit every llmesh service runs on.

One :func:`run_service` call gives a service its ``grpc.aio`` server, gRPC
health (``grpc.health.v1``, NOT_SERVING until :meth:`Service.start` returns),
server reflection, a Prometheus ``/metrics`` port, structlog JSON logs and a
graceful drain on SIGTERM/SIGINT: health turns NOT_SERVING, the service stops
admitting work (:meth:`Service.drain`), in-flight calls get up to
``drain_seconds`` to finish while the server still answers (health checks say
NOT_SERVING, new work gets the service's UNAVAILABLE), then the server stops
and the process exits: as soon as the last call ends, or at the deadline
(:mod:`services.common.active_calls`). A second SIGTERM/SIGINT during the
drain stops at once (logged ``drain_forced``): in-flight calls are cancelled.
A failed :meth:`Service.start` is one ``start_failed`` error line (the cause's
type and message) and exit status 1 (:class:`StartFailed`), not a traceback;
unless the service logged it already (:data:`LOGGED_ATTRIBUTE`).

``/metrics`` serves the process-wide registry: the service's own metrics, the
process and Python collectors of ``prometheus_client``, and, where a GPU is
visible, the GPU gauges of :mod:`services.common.gpu_telemetry` (by default
in the engine only: ``--gpu-telemetry`` / ``--no-gpu-telemetry``). The
``*_created`` series of counters and histograms are not exported.

Every request that does not parse (a ``string`` field with invalid UTF-8, a
corrupt wire format) ends INVALID_ARGUMENT naming the message and the field,
logged once per interval at most (:mod:`services.common.request_guard`); a
service that counts its requests learns of each through its optional
:data:`UNPARSABLE_HOOK` method.

The bound ports (``--port 0`` picks a free one) are logged as the event
``listening`` and, with ``--port-file``, written there as JSON so a launcher
never has to guess a free port. A service with other listeners (the
router's OpenAI HTTP port) binds them in its optional :data:`EXTRA_PORTS_HOOK`
method, whose ports join the file's keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

import grpc
import prometheus_client
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.common import tracing
from services.common.active_calls import ActiveCalls
from services.common.gpu_telemetry import register_gpu_telemetry
from services.common.grpc_util import SERVER_OPTIONS, MeshTls, use_mesh_tls
from services.common.cli_args import env_default, non_negative_float
from services.common.logging import LOG_LEVEL_ENV, LOG_LEVELS, configure_logging, log_level
from services.common.reflection import enable_reflection
from services.common.request_guard import RequestGuard

T = TypeVar("T")


#: An exception out of :meth:`Service.start` with this attribute true was
#: logged by the service already: :func:`run_service` re-raises it as it is
#: (the service's ``__main__`` maps it to an exit status) instead of logging
#: ``start_failed`` and raising :class:`StartFailed`.
LOGGED_ATTRIBUTE = "logged"


class StartFailed(SystemExit):
    """:meth:`Service.start` failed (already logged as ``start_failed``): the
    process exits with status 1 and no traceback. ``error`` (also the
    ``__cause__``) is what start raised, for a caller that maps it to another
    status."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(1)
        self.error = error


class Service(Protocol):
    """What a service hands to :func:`run_service`."""

    #: Full gRPC service names, e.g. ``("llmesh.v1.EngineService",)``.
    service_names: tuple[str, ...]

    def register(self, server: grpc.aio.Server) -> None:
        """Adds the servicers to ``server`` (called before it starts)."""

    async def start(self) -> None:
        """Loads what the service needs (model, tokenizer, connections) and warms
        up. Health says SERVING only after this returns."""

    async def drain(self) -> None:
        """Stops admitting new work; running work may finish (UNAVAILABLE for new calls)."""

    async def close(self) -> None:
        """Releases resources after the server stopped."""


#: The optional ``Service`` method ``count_unparsable_request(method: str) -> None``:
#: called with the full method name (``/llmesh.v1.GenerationService/Generate``)
#: for each request (or request-stream message) the server refused because its
#: bytes did not parse (no handler saw them), e.g. to count it with the
#: service's other refusals.
UNPARSABLE_HOOK = "count_unparsable_request"
#: The optional ``Service`` method ``async listen_extra(host: str) -> dict[str, int]``:
#: binds the service's other listeners (before ``start``, after the gRPC port)
#: and returns their ports by name (``{"openai_port": 8000}``), logged and
#: written to the port file beside ``grpc_port``; the service closes them in
#: ``close``.
EXTRA_PORTS_HOOK = "listen_extra"


@dataclass(frozen=True)
class ServerConfig:
    """Network and lifecycle settings common to every service.

    Attributes:
      name: service name in logs (``router``, ``tokenizer``, ``cache``, ``engine``).
      host: address to bind, e.g. ``127.0.0.1``.
      port: gRPC port; 0 picks a free one.
      metrics_port: Prometheus port; 0 picks a free one, -1 disables it.
      port_file: where to write ``{"grpc_port", "metrics_port", "pid"}`` once bound.
      drain_seconds: how long in-flight calls may run after SIGTERM (seconds).
      log_level: structlog level name.
      gpu_telemetry: export the GPU gauges (absent anyway without a GPU);
        None: only in the engine (one process per host reports the devices).
      tls: mutual TLS inside the mesh (``--tls-cert --tls-key --tls-ca``): the
        gRPC port requires client certificates signed by the mesh CA, and the
        service's own channels (:func:`~services.common.grpc_util.make_channel`)
        present its certificate; None: cleartext (the default; bind loopback).
        The ``/metrics`` port and the router's OpenAI HTTP port stay cleartext.
      otlp_traces_endpoint: export OpenTelemetry traces there over OTLP/gRPC
        (:mod:`services.common.tracing`); None: ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
        if set, else tracing off.
      reflected_services: more services server reflection lists beside the
        service's own (``--reflect-service``): those an ingress in front of
        this service routes to another one (``llmesh up --retrieval`` gives
        the router ``llmesh.v1.RetrieverService``), so ``grpcurl list``
        through the ingress names every service it can call. Each must be in
        this process's descriptor pool (describe then works too).
    """

    name: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    port_file: Path | None = None
    drain_seconds: float = 10.0
    log_level: str = "info"
    gpu_telemetry: bool | None = None
    tls: MeshTls | None = None
    otlp_traces_endpoint: str | None = None
    reflected_services: tuple[str, ...] = ()

    @property
    def exports_gpu_telemetry(self) -> bool:
        """Whether this service registers the GPU gauges."""
        if self.gpu_telemetry is None:
            return self.name == "engine"
        return self.gpu_telemetry


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--host --port --metrics-port --port-file --drain-seconds --log-level
    --[no-]gpu-telemetry --tls-{cert,key,ca} --otlp-traces-endpoint
    --reflect-service``."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus port (0: a free one, -1: off)"
    )
    parser.add_argument("--port-file", type=Path, default=None)
    parser.add_argument("--drain-seconds", type=non_negative_float, default=10.0)
    parser.add_argument(
        "--log-level", type=log_level, default=env_default(LOG_LEVEL_ENV, "info"),
        choices=LOG_LEVELS, help=f"(env {LOG_LEVEL_ENV}; default: info)")
    parser.add_argument(
        "--gpu-telemetry", action=argparse.BooleanOptionalAction, default=None,
        help="export GPU utilisation and memory on /metrics when a GPU is visible "
             "(default: in the engine only)")
    for flag, what in (("cert", "this service's certificate (PEM)"),
                       ("key", "its private key (PEM)"),
                       ("ca", "the mesh CA that signs every service's certificate")):
        parser.add_argument(f"--tls-{flag}", type=Path, default=None,
                            help=f"mutual TLS inside the mesh: {what}; the three go together")
    parser.add_argument("--reflect-service", action="append", default=[], metavar="NAME",
                        help="also list this service (full name) in server reflection: one "
                             "the ingress in front routes elsewhere; repeatable")
    tracing.add_tracing_arguments(parser)


def server_config_from_args(name: str, args: argparse.Namespace) -> ServerConfig:
    """Builds a :class:`ServerConfig` from :func:`add_server_arguments` flags."""
    return ServerConfig(
        name=name,
        tls=_mesh_tls_from_args(args),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        port_file=args.port_file,
        drain_seconds=args.drain_seconds,
        log_level=args.log_level,
        gpu_telemetry=getattr(args, "gpu_telemetry", None),
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
        reflected_services=tuple(getattr(args, "reflect_service", ())),
    )


def _mesh_tls_from_args(args: argparse.Namespace) -> MeshTls | None:
    """``--tls-cert --tls-key --tls-ca`` as a :class:`MeshTls` (None if none given).

    Raises:
      SystemExit(2): some but not all of the three were given, or a file is
        not readable (one line on stderr, as argparse does).
    """
    given = {flag: getattr(args, f"tls_{flag}", None) for flag in ("cert", "key", "ca")}
    if not any(given.values()):
        return None
    missing = [f"--tls-{flag}" for flag, path in given.items() if path is None]
    unreadable = [str(path) for path in given.values() if path is not None
                  and not os.access(path, os.R_OK)]
    if missing or unreadable:
        why = (f"missing {', '.join(missing)}" if missing
               else f"cannot read {', '.join(unreadable)}")
        print(f"error: --tls-cert, --tls-key and --tls-ca go together: {why}", file=sys.stderr)
        raise SystemExit(2)
    return MeshTls(given["cert"], given["key"], given["ca"])


async def _set_health(
    health: health_aio.HealthServicer, names: tuple[str, ...], status: int
) -> None:
    for name in ("", *names):
        await health.set(name, status)


def _start_metrics(config: ServerConfig) -> int:
    if config.metrics_port < 0:
        return -1
    # One process per service: these settings and collectors are process-wide.
    prometheus_client.disable_created_metrics()
    if config.exports_gpu_telemetry:
        register_gpu_telemetry()
    server, _ = prometheus_client.start_http_server(config.metrics_port, addr=config.host)
    return server.server_port


def make_server(service: Service, calls: ActiveCalls | None = None) -> grpc.aio.Server:
    """The ``grpc.aio`` server a service runs on, with ``service`` registered:
    the kit's :data:`SERVER_OPTIONS` and the :class:`RequestGuard` (reporting to
    the service's :data:`UNPARSABLE_HOOK` method where it has one). A test that
    serves a service in process and checks the kit's behaviour builds it here.
    ``calls`` counts the calls in progress (for the drain)."""
    guard = RequestGuard(on_refused=getattr(service, UNPARSABLE_HOOK, None), calls=calls)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(guard,))
    service.register(server)
    return server


async def run_service(config: ServerConfig, service: Service) -> None:
    """Runs ``service`` until SIGTERM/SIGINT, then drains and returns."""
    log = configure_logging(config.name, config.log_level)
    _start_tracing(config, log)
    calls = ActiveCalls()
    server = make_server(service, calls)
    health = health_aio.HealthServicer()
    await _listen(config, service, server, health, log)

    stop = asyncio.Event()
    forced = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        # The first signal drains; a second one stops at once (in-flight calls
        # are cancelled), as an impatient operator or a supervisor expects.
        if not stop.is_set():
            stop.set()
        elif not forced.is_set():
            log.warning("drain_forced", signal=signal.Signals(signum).name,
                        calls=calls.working())
            forced.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    starting = asyncio.create_task(service.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        if (error := starting.exception()) is not None:
            await server.stop(None)
            _raise_start_failure(error, log)
        await _set_health(health, service.service_names, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving")
        await stopping
    else:
        starting.cancel()

    log.info("draining", drain_seconds=config.drain_seconds, calls=calls.working())
    began = loop.time()
    await health.enter_graceful_shutdown()
    idle = False
    if await _unless_forced(service.drain(), forced):
        # Still serving (health answers NOT_SERVING) until the work is done;
        # stop() would refuse health checks at once.
        finished = await _unless_forced(calls.wait_idle(config.drain_seconds), forced)
        idle = bool(finished and finished[0])
    left = 0.0 if forced.is_set() else max(0.0, config.drain_seconds - (loop.time() - began))
    log.info("drained" if idle else "drain_aborted" if forced.is_set() else "drain_deadline",
             seconds=round(loop.time() - began, 3), calls=calls.working())
    await server.stop(grace=left)
    await service.close()
    tracing.shutdown()  # exports what is still buffered
    log.info("stopped")


def _start_tracing(config: ServerConfig, log: structlog.stdlib.BoundLogger) -> None:
    """Traces exported over OTLP when ``--otlp-traces-endpoint`` (or its
    environment variable) asks (:mod:`services.common.tracing`); else off."""
    if tracing.configure(config.name, config.otlp_traces_endpoint):
        log.info("tracing", otlp_traces_endpoint=config.otlp_traces_endpoint
                 or os.environ.get(tracing.ENDPOINT_ENV))


def _raise_start_failure(error: BaseException, log: structlog.stdlib.BoundLogger) -> NoReturn:
    """Re-raises a failed ``start()``: as it is when the service logged it (its
    ``__main__`` maps it to a status), else logged in one line (the cause is in
    the message, no traceback wall) and raised as :class:`StartFailed`."""
    if getattr(error, LOGGED_ATTRIBUTE, False):
        raise error
    log.error("start_failed", error=f"{type(error).__name__}: {error}")
    log.debug("start_failed_traceback", exc_info=error)
    raise StartFailed(error) from error


async def _listen(config: ServerConfig, service: Service, server: grpc.aio.Server,
                  health: health_aio.HealthServicer, log: structlog.stdlib.BoundLogger) -> None:
    """Starts ``server`` with ``health`` (NOT_SERVING until the service has
    started) and reflection on ``config``'s port, then the metrics port and
    the service's extra ports; logs them (``listening``) and writes
    ``config.port_file``."""
    await _set_health(health, service.service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(service.service_names, server, also=config.reflected_services)
    address = f"{config.host}:{config.port}"
    use_mesh_tls(config.tls)  # before start(): the service opens its channels there
    grpc_port = (server.add_insecure_port(address) if config.tls is None
                 else server.add_secure_port(address, config.tls.server_credentials()))
    await server.start()
    metrics_port = _start_metrics(config)
    listen_extra = getattr(service, EXTRA_PORTS_HOOK, None)
    extra = await listen_extra(config.host) if listen_extra is not None else {}
    log.info("listening", grpc_port=grpc_port, metrics_port=metrics_port, pid=os.getpid(),
             **extra)
    if config.port_file is not None:
        config.port_file.write_text(json.dumps(
            {"grpc_port": grpc_port, "metrics_port": metrics_port, "pid": os.getpid(), **extra}))


async def _unless_forced(work: Coroutine[object, object, T], forced: asyncio.Event
                         ) -> tuple[T] | None:
    """Runs ``work`` until it ends (``(result,)``) or ``forced`` is set (None:
    ``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(forced.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return (task.result(),)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
