"""Envoy's bootstrap for the llmesh front proxy, built from typed protos.

One function, :func:`build_bootstrap`, turns :class:`EnvoySettings` (ports,
paths, timeouts) into an ``envoy.config.bootstrap.v3.Bootstrap`` built from
``envoy-data-plane``'s betterproto2 dataclasses, so a misspelt field fails here
rather than inside Envoy. :func:`render_yaml` writes it as YAML (snake_case
field names, ``@type`` on every typed config). ``llmesh up`` renders one for
the router port it started; ``envoy/envoy.yaml`` is the rendering for the
default ports, refreshed with::

    python -m services.cli.envoy_config --write envoy/envoy.yaml

and a test fails when the checked-in file drifts from the builder.

What the config does (see ``envoy/README.md`` for the why):

* one ingress listener, HTTP connection manager with codec AUTO (HTTP/2 gRPC
  and HTTP/1.1 JSON on the same port);
* HTTP filters: ``grpc_json_transcoder`` (``POST /v1/generate``,
  ``GET /v1/llmesh/models`` → ``llmesh.v1.GenerationService``), ``grpc_stats``
  (per-method counters for the public methods), ``router``;
* the OpenAI-compatible paths (``OPENAI_PATHS``: ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/models``, vLLM's ``/tokenize`` and
  ``/detokenize``, ``/v1/embeddings``, and ``/v1/models/{id}``) → cluster
  ``router_openai``, the router's HTTP/1.1 port (``--openai-port``), with the
  transcoder disabled on those routes (it would answer 404 for a path it does
  not know) and no idle timeout (a request may wait silently in the router's
  queue); Server-Sent Events stream through: Envoy forwards each chunk of a
  chunked HTTP/1.1 body as it arrives (no buffering filter on the route);
* routes → cluster ``router`` with the route timeout disabled (0 s),
  ``grpc-timeout`` honoured and retries on ``unavailable``/``reset`` only
  (Envoy never retries once response bytes went downstream): one per
  generation method (``GENERATION_METHODS``) with Envoy's stream idle timeout
  disabled, since a generation may wait silently in a queue and a
  ``GenerateStream`` idles between turns (the router owns those limits, and
  HTTP/2 keepalive PINGs find dead peers); then ``/`` for everything else,
  under the connection manager's stream idle timeout;
* cluster ``router``: HTTP/2 with keepalive pings, circuit breakers;
* admin on ``admin_host:admin_port`` (``/stats/prometheus``, ``/ready``), with
  stat tags that keep dotted gRPC service names whole;
* with ``tls`` set, TLS termination on the ingress (TLS 1.2+, ALPN
  ``h2,http/1.1``) and no cleartext listener unless ``plaintext_port`` asks
  for one (``ingress-plaintext``); with ``router_tls``, mutual TLS to the
  router (docs/security.md);
* backstops: a request body over ``max_request_bytes`` gets 413 (gRPC:
  RESOURCE_EXHAUSTED; both name the limit; OpenAI paths: OpenAI's error
  JSON) on the one-message routes, at most
  ``max_concurrent_streams`` HTTP/2 streams per client connection, a
  ``downstream_stream_window_bytes`` window (and buffer) per client stream,
  ``max_downstream_connections`` connections, and the overload manager's
  ``fixed_heap`` monitor (shrink the heap, then refuse new requests);
* admin only on loopback (:func:`build_bootstrap` refuses anything else);
* with ``ops_port`` set (``llmesh up --ops-port``, default 9902, and the
  Kubernetes rendering, :func:`kubernetes_settings`),
  a second listener ``ops`` that forwards only ``GET /ready`` and
  ``GET /stats/prometheus`` to the admin interface (kept on 127.0.0.1: its
  other endpoints, such as ``/quitquitquit``, are never reachable from outside
  the pod) and answers 404 to everything else. Rendered with::

    python -m services.cli.envoy_config --k8s --write deploy/k8s/base/envoy/envoy.yaml
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import re
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any as AnyType

import betterproto2
import yaml

with warnings.catch_warnings():
    # envoy-data-plane 2.2's generated classes trip a pydantic 2.12 DeprecationWarning
    # at import (about 100 of them); it is theirs, not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.accesslog.v3 import (
        AccessLog,
        AccessLogFilter,
        AndFilter,
        ComparisonFilter,
        ComparisonFilterOp,
        HeaderFilter,
        StatusCodeFilter,
    )
    from envoy_data_plane.envoy.config.bootstrap.v3 import (
        Admin,
        Bootstrap,
        BootstrapStaticResources,
    )
    from envoy_data_plane.envoy.config.cluster.v3 import (
        CircuitBreakers,
        CircuitBreakersThresholds,
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        DataSource,
        GrpcMethodList,
        HealthCheck,
        HealthCheckGrpcHealthCheck,
        HeaderValue,
        HeaderValueOption,
        HeaderValueOptionHeaderAppendAction,
        RuntimeUInt32,
        GrpcMethodListService,
        Http1ProtocolOptions,
        Http2ProtocolOptions,
        HttpProtocolOptions as CoreHttpProtocolOptions,
        KeepaliveSettings,
        RoutingPriority,
        SocketAddress,
        SubstitutionFormatString,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.envoy.config.metrics.v3 import StatsConfig, TagSpecifier
    from envoy_data_plane.envoy.config.core.v3 import TransportSocket
    from envoy_data_plane.envoy.config.overload.v3 import (
        OverloadAction,
        OverloadManager,
        ResourceMonitor,
        ThresholdTrigger,
        Trigger,
    )
    from envoy_data_plane.envoy.config.route.v3 import (
        DirectResponseAction,
        FilterConfig,
        HeaderMatcher,
        RetryPolicy,
        RetryPolicyRetryBackOff,
        RetryPolicyRetryHostPredicate,
        Route,
        RouteAction,
        RouteActionMaxStreamDuration,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.access_loggers.file.v3 import FileAccessLog
    from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer, BufferPerRoute
    from envoy_data_plane.envoy.extensions.filters.http.grpc_json_transcoder.v3 import (
        GrpcJsonTranscoder,
        GrpcJsonTranscoderPrintOptions,
        GrpcJsonTranscoderRequestValidationOptions,
    )
    from envoy_data_plane.envoy.extensions.filters.http.grpc_stats.v3 import (
        FilterConfig as GrpcStats,
    )
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpConnectionManagerCodecType,
        HttpFilter,
        LocalReplyConfig,
        ResponseMapper,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import (
        DownstreamConnectionsConfig,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.fixed_heap.v3 import (
        FixedHeapConfig,
    )
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CertificateValidationContext,
        CommonTlsContext,
        DownstreamTlsContext,
        SubjectAltNameMatcher,
        SubjectAltNameMatcherSanType,
        TlsCertificate,
        TlsParameters,
        TlsParametersTlsProtocol,
        UpstreamTlsContext,
    )
    from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import (
        PreviousHostsPredicate,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher, StringMatcher
    from envoy_data_plane.google.protobuf import Any, Struct

#: The public gRPC service Envoy transcodes and counts.
PUBLIC_SERVICE = "llmesh.v1.GenerationService"
PUBLIC_METHODS = ("Generate", "GenerateJson", "GenerateStream", "ListModels")

#: Methods whose streams may stay silent for long: a request queued before its
#: first token, a GenerateStream between turns. Envoy's idle timer is off for
#: them; the router ends them cleanly (client deadline, session idle limit).
GENERATION_METHODS = ("Generate", "GenerateJson", "GenerateStream")

#: Envoy cluster that points at the router.
ROUTER_CLUSTER = "router"
#: Envoy cluster of the retriever service (``llmesh up --retrieval``), and the
#: gRPC path prefix routed to it.
RETRIEVER_CLUSTER = "retriever"
RETRIEVER_SERVICE = "llmesh.v1.RetrieverService"
RETRIEVER_PREFIX = f"/{RETRIEVER_SERVICE}/"
#: Envoy cluster that points at the router's OpenAI-compatible HTTP port.
OPENAI_CLUSTER = "router_openai"
#: Paths routed to it (exact), and the prefix of ``GET /v1/models/{id}``.
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
                "/detokenize", "/v1/embeddings")
OPENAI_PREFIX = "/v1/models/"
_TRANSCODER = "envoy.filters.http.grpc_json_transcoder"

#: Envoy cluster of the admin interface, behind the ``ops`` listener.
ADMIN_CLUSTER = "admin"
#: The admin paths the ``ops`` listener forwards (GET only, exact path).
OPS_PATHS = ("/ready", "/stats/prometheus")

#: The Kubernetes rendering (``deploy/k8s/base``): namespace, the router's
#: headless Service (Envoy resolves every router pod and balances per request),
#: and the ports the manifests give the router and Envoy.
K8S_NAMESPACE = "llmesh"
K8S_ROUTER_HOST = f"router-headless.{K8S_NAMESPACE}.svc.cluster.local"
K8S_OPS_PORT = 9902
K8S_CONFIG_RELATIVE = "deploy/k8s/base/envoy/envoy.yaml"

#: Repository root (``services/cli/envoy_config.py`` → three levels up).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Descriptor set for the transcoder, as written by ``make generate``.
DESCRIPTOR_RELATIVE = "envoy/llmesh_descriptor.binpb"

#: Default ports of ``envoy/envoy.yaml`` and ``llmesh up``.
DEFAULT_INGRESS_PORT = 8080
DEFAULT_ADMIN_PORT = 9901
#: Fixed router port the checked-in ``envoy/envoy.yaml`` points at (start the
#: router with ``--port 50051`` to use that file by hand).
DEFAULT_ROUTER_PORT = 50051
#: Fixed OpenAI HTTP port of the router in ``envoy/envoy.yaml`` (``--openai-port
#: 8000``, vLLM's default port).
DEFAULT_OPENAI_PORT = 8000

#: Client-controlled values are cut (``:N``): the router refuses an
#: ``x-request-id`` over 128 characters, but Envoy logs the request before that,
#: and a 90 kB header must not make a 90 kB log line.
_ACCESS_LOG_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH):256% %PROTOCOL%" '
    "%RESPONSE_CODE% grpc=%GRPC_STATUS_NUMBER% flags=%RESPONSE_FLAGS% "
    "ttfb_ms=%RESPONSE_DURATION% total_ms=%DURATION% "
    "upstream=%UPSTREAM_HOST% rid=%REQ(X-REQUEST-ID):128%\n"
)


#: Where Envoy's admin interface may bind: loopback only (it serves
#: ``/quitquitquit``, ``/config_dump`` and runtime changes to anyone who reaches it).
LOOPBACK_ADMIN_HOSTS = ("127.0.0.1", "::1", "localhost")

#: ALPN the TLS ingress offers: gRPC needs ``h2``; curl and urllib may speak HTTP/1.1.
INGRESS_ALPN = ("h2", "http/1.1")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one side of a TLS connection (paths as Envoy reads them).

    Attributes:
      cert: certificate chain (leaf first).
      key: its private key.
      ca: CA bundle that verifies the peer; None: the peer is not verified
        (the ingress without client certificates).
    """

    cert: str
    key: str
    ca: str | None = None


@dataclass(frozen=True)
class EnvoySettings:
    """Everything that varies between renderings of the bootstrap.

    Attributes:
      ingress_host: address the client listener binds.
      ingress_port: client port (HTTP/2 gRPC and HTTP/1.1 JSON); 0 lets the
        kernel pick one (read it back from admin ``/listeners``).
      admin_host: address of the admin interface.
      admin_port: admin port (``/ready``, ``/stats/prometheus``); 0 picks one
        (Envoy writes it to ``--admin-address-path``).
      router_host: the router's host: an IP literal gives a STATIC cluster, a
        name a STRICT_DNS one.
      router_port: the router's gRPC port.
      more_routers: further router endpoints (``host:port``, IP literals or,
        with a name as ``router_host``, names) in the same cluster: Envoy
        balances over them and health-checks each.
      health_check_interval_s: seconds between Envoy's gRPC health checks
        (``grpc.health.v1.Health/Check``) of each router endpoint; a router
        that answers NOT_SERVING (it drains after SIGTERM) or not at all is
        out of balancing after ``health_check_unhealthy_threshold`` checks,
        back after one SERVING answer.
      health_check_unhealthy_threshold: failed checks that take a router out.
      openai_port: the router's OpenAI-compatible HTTP port; None: no OpenAI
        routes (those paths then reach the transcoder, which answers 404).
      retriever_host, retriever_port: the retriever's gRPC address: its
        methods (``/llmesh.v1.RetrieverService/*``, gRPC only, no JSON
        transcoding) are routed there; None: no retriever route (those paths
        reach the router, which answers UNIMPLEMENTED).
      descriptor_path: descriptor set for the transcoder; a relative path is
        resolved by Envoy against its working directory.
      stream_idle_timeout_s: seconds a stream of a non-generation call
        (ListModels, health, reflection, unknown paths) may go without any
        byte in either direction before Envoy resets it; 0 disables it. The
        generation methods (:data:`GENERATION_METHODS`) have no Envoy idle
        timeout: ``llmesh up`` gives the router the same value as its
        ``GenerateStream`` session idle limit.
      connect_timeout_s: seconds to open a TCP connection to the router.
      num_retries: retries on UNAVAILABLE or reset before any response byte.
      keepalive_interval_s: seconds between HTTP/2 PINGs on idle connections
        (upstream and downstream); the router's gRPC server accepts pings
        without data every 10 s or more (``SERVER_OPTIONS``), so stay above.
      keepalive_timeout_s: seconds to wait for a PING ack before closing.
      max_connections: circuit breaker: connections to the router.
      max_pending_requests: circuit breaker: requests queued for a connection.
      max_requests: circuit breaker: concurrent streams to the router.
      max_retries: circuit breaker: concurrent retries to the router.
      max_downstream_connections: most client connections Envoy holds open
        (overload manager); more are refused.
      access_log_path: where the per-request access log goes (``/dev/stdout``
        lands in the Envoy log file under ``llmesh up``); None: no access log.
      max_request_headers_kb: most KiB of request headers (all of them, and
        any single one over HTTP/2). More: HTTP/1 gets 431; HTTP/2 can only
        drop the connection (GOAWAY, COMPRESSION_ERROR). Below it every header
        reaches the router, which accepts metadata up to
        ``services.common.grpc_util.MAX_METADATA_BYTES`` (more than this plus
        what Envoy adds) and refuses a bad ``x-request-id`` with
        INVALID_ARGUMENT (HTTP 400), never RESOURCE_EXHAUSTED (429, "retry").
      ops_port: port of the ``ops`` listener on ``ingress_host`` (``GET /ready``
        and ``GET /stats/prometheus`` of the admin interface, for probes and
        scraping where admin stays on loopback); None: no such listener.
      tls: terminate TLS on the ingress listener with this certificate (TLS
        1.2 or later, ALPN ``h2,http/1.1``: gRPC and HTTP on one port); None:
        cleartext ingress.
      plaintext_port: with ``tls`` set, a second cleartext listener
        (``ingress-plaintext``) on this port of ``ingress_host`` with the same
        routes; None: none (with TLS on, nothing listens in clear).
      router_tls: Envoy → router gRPC over mutual TLS: ``cert``/``key`` is
        Envoy's client certificate, ``ca`` the mesh CA that signed the
        router's (the router's SAN must name ``router_host``); None: cleartext.
      max_request_bytes: most bytes of a request body Envoy buffers and
        forwards (buffer filter); a larger body gets 413 (HTTP) or a gRPC
        error naming the limit before it reaches the router. Only on the
        one-message routes (``Generate``, ``GenerateJson``, OpenAI); off on
        ``GenerateStream`` and ``/`` (bidirectional streams whose body ends
        late or never: the router's 64 MiB gRPC message limit applies there)
        and on the retriever's route (its own per-field limits answer). 4 MiB holds a
        128k-token prompt as JSON.
      max_concurrent_streams: most HTTP/2 streams one client connection may
        have open (SETTINGS_MAX_CONCURRENT_STREAMS); the router's admission
        control refuses earlier, this only bounds Envoy's own memory per
        connection. 1024: above a 16-stream CPU mesh and a GPU engine's
        batch (a few hundred) multiplexed over one connection.
      max_heap_bytes: the heap size the overload manager measures against
        (``fixed_heap`` resource monitor).
      shrink_heap_threshold: fraction of ``max_heap_bytes`` at which Envoy
        returns free memory to the system (``shrink_heap``).
      stop_accepting_requests_threshold: fraction at which Envoy answers new
        requests with 503 at once (``stop_accepting_requests``), keeping the
        running ones.
      upstream_stream_window_bytes: Envoy's HTTP/2 receive window per stream
        from the router (``initial_stream_window_size`` of the router
        cluster; Envoy's default is 256 MiB): what the router may send on a
        stream beyond what Envoy has passed on toward the client. 65,536
        (Envoy's minimum is 65,535) is hundreds of token deltas, ample for a
        stream of tokens on loopback.
      downstream_stream_window_bytes: the ingress's HTTP/2 window per client
        stream (``initial_stream_window_size`` of the connection manager;
        Envoy's default is 256 MiB). Envoy uses it both as the window it
        grants a client's request body and as the limit of what it buffers
        per stream toward the client ("http2 stream limits", Envoy's flow
        control FAQ): a client that stops reading holds at most about this
        plus ``upstream_stream_window_bytes`` in Envoy (measured: 1,117,680
        bytes read from the router at 1 MiB + 64 KiB), after which Envoy stops
        reading from the router, the router's writes block and its
        slow-reader budget (``--client-write-timeout-s``) applies. With
        Envoy's default a stalled client could hold a whole answer (up to
        256 MiB) in Envoy and the budget never started. 1 MiB keeps a 4 MiB
        request body to a few round trips; tests/e2e/test_mesh_slow_reader.py
        uses 64 KiB to keep its answer short.
    """

    ingress_host: str = "127.0.0.1"
    ingress_port: int = DEFAULT_INGRESS_PORT
    admin_host: str = "127.0.0.1"
    admin_port: int = DEFAULT_ADMIN_PORT
    router_host: str = "127.0.0.1"
    router_port: int = DEFAULT_ROUTER_PORT
    more_routers: tuple[str, ...] = ()
    health_check_interval_s: float = 1.0
    health_check_unhealthy_threshold: int = 1
    openai_port: int | None = DEFAULT_OPENAI_PORT
    retriever_host: str = "127.0.0.1"
    retriever_port: int | None = None
    descriptor_path: str = DESCRIPTOR_RELATIVE
    stream_idle_timeout_s: float = 300.0
    connect_timeout_s: float = 1.0
    num_retries: int = 2
    keepalive_interval_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    max_connections: int = 1024
    max_pending_requests: int = 1024
    max_requests: int = 4096
    max_retries: int = 64
    max_downstream_connections: int = 10_000
    access_log_path: str | None = "/dev/stdout"
    max_request_headers_kb: int = 96
    ops_port: int | None = None
    tls: TlsFiles | None = None
    plaintext_port: int | None = None
    router_tls: TlsFiles | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 1024
    max_heap_bytes: int = 1024 * 1024 * 1024
    shrink_heap_threshold: float = 0.95
    stop_accepting_requests_threshold: float = 0.98
    upstream_stream_window_bytes: int = 65_536
    downstream_stream_window_bytes: int = 1_048_576


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _keepalive(settings: EnvoySettings) -> KeepaliveSettings:
    return KeepaliveSettings(
        interval=_seconds(settings.keepalive_interval_s),
        timeout=_seconds(settings.keepalive_timeout_s),
    )


def _transcoder(settings: EnvoySettings) -> HttpFilter:
    config = GrpcJsonTranscoder(
        proto_descriptor=settings.descriptor_path,
        services=[PUBLIC_SERVICE],
        print_options=GrpcJsonTranscoderPrintOptions(
            add_whitespace=False,
            always_print_primitive_fields=False,
            always_print_enums_as_ints=False,
            preserve_proto_field_names=True,
        ),
        convert_grpc_status=True,
        # A JSON request to an unknown path or with the wrong method gets 404
        # from Envoy, instead of reaching the router and coming back as 503.
        # gRPC requests (content-type application/grpc) always pass through.
        # A query parameter no field takes (`/v1/generate?max_tokens=3`) is a
        # 400, not silently dropped. (Unknown *body* fields: Envoy has no
        # option, so /v1/generate's body reaches the router raw and is parsed
        # there, strictly: services/router/json_request.py.)
        request_validation_options=GrpcJsonTranscoderRequestValidationOptions(
            reject_unknown_method=True, reject_unknown_query_parameters=True),
    )
    return HttpFilter(name="envoy.filters.http.grpc_json_transcoder", typed_config=Any.pack(config))


_BUFFER = "envoy.filters.http.buffer"


def _buffer(settings: EnvoySettings) -> HttpFilter:
    """Envoy's buffer filter as the request-size backstop: a body over
    ``max_request_bytes`` gets 413 (reshaped by :func:`_local_replies`) and
    never reaches the router. On the routes whose request is one message
    (``Generate``, ``GenerateJson``, the OpenAI paths); off on streams that
    send as they go (``GenerateStream``, reflection, the catch-all ``/``),
    where the router's 64 MiB message limit is the bound, and on the
    retriever's route (:func:`_retriever_routes`)."""
    return HttpFilter(name=_BUFFER, typed_config=Any.pack(
        Buffer(max_request_bytes=settings.max_request_bytes)))


def _grpc_stats() -> HttpFilter:
    config = GrpcStats(
        enable_upstream_stats=True,
        individual_method_stats_allowlist=GrpcMethodList(
            services=[GrpcMethodListService(name=PUBLIC_SERVICE, method_names=list(PUBLIC_METHODS))]
        ),
    )
    return HttpFilter(name="envoy.filters.http.grpc_stats", typed_config=Any.pack(config))


def _access_log(settings: EnvoySettings) -> list[AccessLog]:
    if settings.access_log_path is None:
        return []
    config = FileAccessLog(
        path=settings.access_log_path,
        log_format=SubstitutionFormatString(
            text_format_source=DataSource(inline_string=_ACCESS_LOG_FORMAT)
        ),
    )
    return [AccessLog(name="envoy.access_loggers.file", typed_config=Any.pack(config))]


def _route_action(settings: EnvoySettings, *, idle_timeout_s: float | None = None,
                  cluster: str = ROUTER_CLUSTER, deadline_at_envoy: bool = True) -> RouteAction:
    """The action every route shares; ``idle_timeout_s`` 0 turns Envoy's stream
    idle timeout off for the route (None: the connection manager's applies).
    ``deadline_at_envoy`` False: Envoy does not end the stream at the
    client's ``grpc-timeout`` (the upstream does, with a status): a
    generation's response headers leave at dispatch, and Envoy can only
    reset a stream whose headers went out (the client read INTERNAL, not
    DEADLINE_EXCEEDED, when that reset beat its own timer; CI's soak test).

    Source: ``RouteAction.idle_timeout``, "a value of 0 will completely disable
    the route's idle timeout, even if a connection manager stream idle timeout
    is configured" (envoyproxy.io, api-v3 config.route.v3.RouteAction).
    """
    return RouteAction(
        cluster=cluster,
        # 0 disables the route timeout: Envoy's 15 s default cuts long generations.
        timeout=_seconds(0),
        idle_timeout=None if idle_timeout_s is None else _seconds(idle_timeout_s),
        # A client's grpc-timeout header becomes the stream's deadline, uncapped.
        max_stream_duration=(RouteActionMaxStreamDuration(grpc_timeout_header_max=_seconds(0))
                             if deadline_at_envoy else None),
        retry_policy=RetryPolicy(
            # Envoy retries only before response headers went downstream, so a
            # started generation is never replayed.
            retry_on="unavailable,reset,connect-failure,refused-stream",
            num_retries=settings.num_retries,
            retry_back_off=RetryPolicyRetryBackOff(
                base_interval=_seconds(0.025), max_interval=_seconds(0.25)
            ),
            # A retry goes to another router when there is one (a draining
            # router answers UNAVAILABLE until its health check fails).
            retry_host_predicate=[RetryPolicyRetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=Any.pack(PreviousHostsPredicate()))],
            host_selection_retry_max_attempts=3,
        ),
    )


def _routes(settings: EnvoySettings) -> list[Route]:
    """One route per generation method (gRPC path; JSON requests match it after
    the transcoder rewrote their path), idle timeout off; then ``/``."""
    # GenerateStream is bidirectional: its request body ends only with the
    # session, so the buffer filter (which waits for the end) is off there and
    # on ``/`` (reflection is a bidirectional stream too).
    unbuffered = _unbuffered()
    generation = [
        Route(name=f"llmesh-{method}", match=RouteMatch(path=f"/{PUBLIC_SERVICE}/{method}"),
              route=_route_action(settings, idle_timeout_s=0, deadline_at_envoy=False),
              typed_per_filter_config=unbuffered if method == "GenerateStream" else {})
        for method in GENERATION_METHODS
    ]
    return [*generation, *_openai_routes(settings), *_retriever_routes(settings),
            Route(name="llmesh", match=RouteMatch(prefix="/"), route=_route_action(settings),
                  typed_per_filter_config=unbuffered)]


def _retriever_routes(settings: EnvoySettings) -> list[Route]:
    """``/llmesh.v1.RetrieverService/*`` → the retriever (when there is one),
    without the buffer filter's ``max_request_bytes``: an ingest may carry
    many documents, and the retriever's own limits (a document's text, a
    query; its 64 MiB gRPC message limit) answer with the field at fault
    (``documents[0].text: is 10485760 bytes, over the service's document size
    limit...``), where Envoy could only say "Payload Too Large". Envoy streams
    the body under its flow-control window, as on ``/``."""
    if settings.retriever_port is None:
        return []
    return [Route(name="retriever", match=RouteMatch(prefix=RETRIEVER_PREFIX),
                  route=_route_action(settings, cluster=RETRIEVER_CLUSTER),
                  typed_per_filter_config=_unbuffered())]


def _retriever_cluster(settings: EnvoySettings) -> list[Cluster]:
    """The retriever's gRPC cluster (the router cluster's settings at its address)."""
    if settings.retriever_port is None:
        return []
    at_retriever = replace(settings, router_host=settings.retriever_host, more_routers=())
    return [_router_cluster(at_retriever, name=RETRIEVER_CLUSTER,
                            port=settings.retriever_port, grpc=True)]


def _unbuffered() -> dict[str, Any]:
    """Per-route config that turns the buffer filter off."""
    return {_BUFFER: Any.pack(BufferPerRoute(disabled=True))}


def _openai_routes(settings: EnvoySettings) -> list[Route]:
    """The OpenAI paths → the router's HTTP port, transcoder off, idle timeout off
    (the router ends a request at its deadline; Envoy never cuts a live stream)."""
    if settings.openai_port is None:
        return []
    off = {_TRANSCODER: Any.pack(FilterConfig(disabled=True))}
    matches = [RouteMatch(path=path) for path in OPENAI_PATHS]
    matches.append(RouteMatch(prefix=OPENAI_PREFIX))
    names = [f"openai{path}".replace("/", "-") for path in OPENAI_PATHS] + ["openai-v1-model"]
    return [Route(name=name, match=match, typed_per_filter_config=off,
                  route=_route_action(settings, idle_timeout_s=0, cluster=OPENAI_CLUSTER))
            for name, match in zip(names, matches)]


def _http_connection_manager(settings: EnvoySettings) -> HttpConnectionManager:
    return HttpConnectionManager(
        stat_prefix="ingress",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        stream_idle_timeout=_seconds(settings.stream_idle_timeout_s),
        max_request_headers_kb=settings.max_request_headers_kb,
        http2_protocol_options=Http2ProtocolOptions(
            connection_keepalive=_keepalive(settings),
            max_concurrent_streams=settings.max_concurrent_streams,
            initial_stream_window_size=settings.downstream_stream_window_bytes,
            # HPACK's per-header limit (64 KiB by default) as large as the
            # total, so one large header meets the same limit as many.
            max_header_field_size_kb=settings.max_request_headers_kb,
        ),
        route_config=RouteConfiguration(
            name="llmesh",
            virtual_hosts=[VirtualHost(name="llmesh", domains=["*"], routes=_routes(settings))],
        ),
        http_filters=[
            _buffer(settings),
            _transcoder(settings),
            _grpc_stats(),
            HttpFilter(name="envoy.filters.http.router", typed_config=Any.pack(Router())),
        ],
        access_log=_access_log(settings),
        local_reply_config=_local_replies(settings),
    )


def _status_is(code: int, name: str,
               op: ComparisonFilterOp = ComparisonFilterOp.EQ) -> AccessLogFilter:
    return AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
        op=op,
        value=RuntimeUInt32(default_value=code, runtime_key=f"llmesh.local_reply.{name}"))))


def _path_under(*paths: str) -> AccessLogFilter:
    """The request's ``:path`` is one of ``paths``, below one (``/``), or one
    with a query (``?``): one RE2 full match (Envoy's ``safe_regex``)."""
    pattern = "(?:" + "|".join(re.escape(path) for path in paths) + ")(?:[/?].*)?"
    return AccessLogFilter(header_filter=HeaderFilter(header=HeaderMatcher(
        name=":path", string_match=StringMatcher(safe_regex=RegexMatcher(regex=pattern)))))


def _path_starts_v1() -> AccessLogFilter:
    """The request's ``:path`` starts with ``/v1/``."""
    return AccessLogFilter(header_filter=HeaderFilter(header=HeaderMatcher(
        name=":path", string_match=StringMatcher(prefix="/v1/"))))


def _both(*filters: AccessLogFilter) -> AccessLogFilter:
    """Every one of ``filters`` matches."""
    return AccessLogFilter(and_filter=AndFilter(filters=list(filters)))


def _openai_error(status_filter: AccessLogFilter, message: str, kind: str,
                  code: str | None) -> ResponseMapper:
    """Envoy's local reply on an OpenAI path (:data:`OPENAI_PATHS`, and
    ``/v1/models/{id}`` below one) with ``status_filter``'s status, as
    the router's OpenAI errors are: ``{"error": {"message", "type", "param",
    "code"}}`` (``services/router/openai_format.py``, ``OpenAIError``)."""
    body = Struct.from_dict({"error": {"message": message, "type": kind, "param": None,
                                       "code": code}})
    return ResponseMapper(
        filter=_both(status_filter, _path_under(*OPENAI_PATHS)),
        body_format_override=SubstitutionFormatString(json_format=body,
                                                      content_type="application/json"))


def _local_replies(settings: EnvoySettings) -> LocalReplyConfig:
    """Envoy's own replies, reshaped for their callers (the first mapper that
    matches applies). Source: Envoy docs, "Local reply modification"
    (http_conn_man); a gRPC caller gets the body as ``grpc-message``.

    * 413 (a body over ``max_request_bytes``): on the OpenAI paths, the
      router's own 413 (``request_too_large``, naming Envoy's limit); else
      ``grpc-status: 8`` (RESOURCE_EXHAUSTED: Envoy maps HTTP 413 to UNKNOWN)
      and a message naming the limit and what to do, instead of "Payload Too
      Large". The retriever's route has no such limit (its own per-field
      limits answer, :func:`_retriever_routes`).
    * 404 under ``/v1/`` (no route, or a path the transcoder cannot resolve)
      is the router's own 404 (``services/router/openai_http.py``): an
      OpenAI error body, ``{"error": {"message", "type", "param", "code":
      "unknown_url"}}``, as OpenAI answers an unknown URL.
    * Any other error Envoy answers on an OpenAI path (503 no healthy router
      or overload, 5xx, 4xx) keeps its status and Envoy's text as the message
      of an OpenAI error body (503 as the router's ``service_unavailable``).

    Not reshaped: Envoy's 431 (headers over ``max_request_headers_kb``,
    HTTP/1 only) stays its plain text: the HTTP/1 codec answers it before the
    connection manager has a stream or a path (measured: a local-reply mapper
    for 431 never applies).
    """
    limit = settings.max_request_bytes
    resource_exhausted = HeaderValueOption(
        header=HeaderValue(key="grpc-status", value="8"),
        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)
    not_found_body = Struct.from_dict({"error": {  # the router's own (openai_http.py)
        "message": "unknown route %REQ(:METHOD)% %REQ(:PATH)%; this server has POST "
                   "/v1/chat/completions, POST /v1/completions, GET /v1/models, POST "
                   "/tokenize, POST /detokenize and POST /v1/embeddings",
        "type": "invalid_request_error", "param": None, "code": "unknown_url"}})
    too_large = _status_is(413, "too_large")
    return LocalReplyConfig(mappers=[
        _openai_error(too_large, f"request body too large: the mesh's ingress takes at most "
                      f"{limit} bytes (Envoy's max_request_bytes); send a shorter prompt or "
                      "fewer, smaller tools", "invalid_request_error", "request_too_large"),
        ResponseMapper(filter=too_large, headers_to_add=[resource_exhausted],
                       body_format_override=SubstitutionFormatString(
                           text_format_source=DataSource(inline_string=(
                               f"request too large: over {limit} bytes, the most the mesh's "
                               "ingress takes on this route (Envoy's max_request_bytes); "
                               "send a shorter prompt, or raise max_request_bytes in the "
                               "Envoy config")))),
        ResponseMapper(
            filter=_both(_status_is(404, "not_found"), _path_starts_v1()),
            body_format_override=SubstitutionFormatString(
                json_format=not_found_body, content_type="application/json")),
        _openai_error(_status_is(503, "unavailable"), "%LOCAL_REPLY_BODY%",
                      "service_unavailable_error", "service_unavailable"),
        _openai_error(_status_is(500, "server_error", ComparisonFilterOp.GE),
                      "%LOCAL_REPLY_BODY%", "internal_error", None),
        _openai_error(_status_is(400, "client_error", ComparisonFilterOp.GE),
                      "%LOCAL_REPLY_BODY%", "invalid_request_error", None),
    ])


def _data(path: str) -> DataSource:
    return DataSource(filename=path)


def _tls_params() -> TlsParameters:
    return TlsParameters(tls_minimum_protocol_version=TlsParametersTlsProtocol.TLSv1_2)


def _downstream_tls(tls: TlsFiles) -> TransportSocket:
    """TLS termination for the ingress (Envoy ``DownstreamTlsContext``): TLS
    1.2+, ALPN :data:`INGRESS_ALPN` (the AUTO codec then picks HTTP/2 or
    HTTP/1.1 from it); with ``tls.ca``, client certificates signed by it are
    required."""
    context = DownstreamTlsContext(
        common_tls_context=CommonTlsContext(
            tls_params=_tls_params(),
            tls_certificates=[TlsCertificate(certificate_chain=_data(tls.cert),
                                             private_key=_data(tls.key))],
            alpn_protocols=list(INGRESS_ALPN),
            validation_context=(None if tls.ca is None else
                                CertificateValidationContext(trusted_ca=_data(tls.ca))),
        ),
        require_client_certificate=tls.ca is not None,
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=Any.pack(context))


def _upstream_tls(tls: TlsFiles, host: str) -> TransportSocket:
    """Envoy → router over mutual TLS (``UpstreamTlsContext``): Envoy presents
    ``tls.cert``, verifies the router's chain against ``tls.ca`` and its SAN
    against ``host`` (IP or DNS), ALPN ``h2`` (gRPC)."""
    san_type = (SubjectAltNameMatcherSanType.IP_ADDRESS if _is_ip(host)
                else SubjectAltNameMatcherSanType.DNS)
    validation = CertificateValidationContext(
        trusted_ca=_data(tls.ca) if tls.ca else None,
        match_typed_subject_alt_names=[SubjectAltNameMatcher(
            san_type=san_type, matcher=StringMatcher(exact=host))],
    )
    context = UpstreamTlsContext(
        common_tls_context=CommonTlsContext(
            tls_params=_tls_params(),
            tls_certificates=[TlsCertificate(certificate_chain=_data(tls.cert),
                                             private_key=_data(tls.key))],
            validation_context=validation,
            alpn_protocols=["h2"],
        ),
        sni="" if _is_ip(host) else host,
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=Any.pack(context))


def _listener(settings: EnvoySettings, *, name: str = "ingress", port: int | None = None,
              tls: TlsFiles | None = None) -> Listener:
    """The client listener ``name`` on ``port`` (default ``ingress_port``),
    terminating TLS when ``tls`` is given."""
    hcm = _http_connection_manager(settings)
    return Listener(
        name=name,
        address=_address(settings.ingress_host,
                         settings.ingress_port if port is None else port),
        # Off so a second Envoy on the same port fails to bind instead of
        # silently sharing its traffic (SO_REUSEPORT is on by default on Linux).
        enable_reuse_port=False,
        filter_chains=[
            FilterChain(
                filters=[
                    Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=Any.pack(hcm),
                    )
                ],
                transport_socket=None if tls is None else _downstream_tls(tls),
            )
        ],
    )


def _ingress_listeners(settings: EnvoySettings) -> list[Listener]:
    """``ingress`` (TLS when ``settings.tls``), and ``ingress-plaintext`` when
    TLS is on and ``plaintext_port`` asks for a cleartext one too."""
    listeners = [_listener(settings, tls=settings.tls)]
    if settings.tls is not None and settings.plaintext_port is not None:
        listeners.append(_listener(settings, name="ingress-plaintext",
                                   port=settings.plaintext_port))
    return listeners


def _router_cluster(settings: EnvoySettings, *, name: str = ROUTER_CLUSTER,
                    port: int | None = None, grpc: bool | None = None) -> Cluster:
    """A cluster of the router: gRPC over HTTP/2 (``router``), or its OpenAI
    port over HTTP/1.1 (``router_openai``: aiohttp speaks no cleartext HTTP/2);
    ``grpc`` True makes another name a gRPC cluster (default: ``router`` only)."""
    grpc_cluster = name == ROUTER_CLUSTER if grpc is None else grpc
    protocol = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions(
                connection_keepalive=_keepalive(settings),
                initial_stream_window_size=settings.upstream_stream_window_bytes)
        ) if grpc_cluster else HttpProtocolOptionsExplicitHttpConfig(
            http_protocol_options=Http1ProtocolOptions()),
        common_http_protocol_options=CoreHttpProtocolOptions(idle_timeout=_seconds(3600)),
    )
    port = settings.router_port if port is None else port
    return Cluster(
        name=name,
        type=(
            ClusterDiscoveryType.STATIC
            if _is_ip(settings.router_host)
            else ClusterDiscoveryType.STRICT_DNS
        ),
        connect_timeout=_seconds(settings.connect_timeout_s),
        lb_policy=ClusterLbPolicy.LEAST_REQUEST,
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": Any.pack(protocol)
        },
        circuit_breakers=CircuitBreakers(
            thresholds=[
                CircuitBreakersThresholds(
                    priority=RoutingPriority.DEFAULT,
                    max_connections=settings.max_connections,
                    max_pending_requests=settings.max_pending_requests,
                    max_requests=settings.max_requests,
                    max_retries=settings.max_retries,
                    track_remaining=True,
                )
            ]
        ),
        load_assignment=ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                LocalityLbEndpoints(
                    lb_endpoints=[
                        LbEndpoint(endpoint=Endpoint(address=_address(host, endpoint_port)))
                        for host, endpoint_port in _router_endpoints(
                            settings, port, grpc_cluster=grpc_cluster)
                    ]
                )
            ],
        ),
        health_checks=[_grpc_health_check(settings)] if grpc_cluster else [],
        transport_socket=(_upstream_tls(settings.router_tls, settings.router_host)
                          if grpc_cluster and settings.router_tls is not None else None),
    )


def _router_endpoints(settings: EnvoySettings, port: int, *, grpc_cluster: bool
                      ) -> list[tuple[str, int]]:
    """``router_host`` at ``port``, then (gRPC cluster only: each router's
    OpenAI port is its own) every ``more_routers`` endpoint."""
    endpoints = [(settings.router_host, port)]
    if grpc_cluster:
        for extra in settings.more_routers:
            host, _, extra_port = extra.rpartition(":")
            endpoints.append((host.strip("[]"), int(extra_port)))
    return endpoints


def _grpc_health_check(settings: EnvoySettings) -> HealthCheck:
    """Active gRPC health checks of each router endpoint: a draining router
    (NOT_SERVING) leaves balancing within one interval. ``no_traffic_interval``
    too, or an idle cluster is checked only every 60 s (Envoy's default)."""
    interval = _seconds(settings.health_check_interval_s)
    return HealthCheck(
        timeout=_seconds(max(0.5, settings.health_check_interval_s)),
        interval=interval,
        no_traffic_interval=interval,
        unhealthy_threshold=settings.health_check_unhealthy_threshold,
        healthy_threshold=1,
        grpc_health_check=HealthCheckGrpcHealthCheck(),
    )


def _stats_config() -> StatsConfig:
    """Tag extractors for grpc_stats names such as
    ``cluster.router.grpc.llmesh.v1.GenerationService.Generate.success``.

    Envoy's default ``envoy.grpc_bridge_service`` / ``..._method`` extractors
    take one dot-free token each, so a dotted package splits (service
    ``llmesh``, method ``v1``). These replace the defaults of the same names
    (Envoy skips a default whose name a custom tag uses): the service is
    everything between ``grpc.`` and the last two tokens (method and stat).
    """
    return StatsConfig(
        stats_tags=[
            TagSpecifier(
                tag_name="envoy.grpc_bridge_service",
                regex=r"^(?:cluster)\.[^.]+\.grpc\.((.+)\.)[^.]+\.[^.]+$",
            ),
            TagSpecifier(
                tag_name="envoy.grpc_bridge_method",
                regex=r"^(?:cluster)\.[^.]+\.grpc\..+\.(([^.]+)\.)[^.]+$",
            ),
        ],
        use_all_default_tags=True,
    )


_HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"


def _overload_manager(settings: EnvoySettings) -> OverloadManager:
    """The connection limit, and the heap watch: past ``shrink_heap_threshold``
    of ``max_heap_bytes`` Envoy frees memory, past
    ``stop_accepting_requests_threshold`` it refuses new requests (503).
    Source: Envoy docs, "Overload manager" (configuration/operations)."""
    monitor = DownstreamConnectionsConfig(
        max_active_downstream_connections=settings.max_downstream_connections
    )

    def action(name: str, threshold: float) -> OverloadAction:
        return OverloadAction(name=f"envoy.overload_actions.{name}", triggers=[
            Trigger(name=_HEAP_MONITOR, threshold=ThresholdTrigger(value=threshold))])

    return OverloadManager(
        refresh_interval=_seconds(0.25),
        resource_monitors=[
            ResourceMonitor(
                name="envoy.resource_monitors.global_downstream_max_connections",
                typed_config=Any.pack(monitor),
            ),
            ResourceMonitor(name=_HEAP_MONITOR, typed_config=Any.pack(
                FixedHeapConfig(max_heap_size_bytes=settings.max_heap_bytes))),
        ],
        actions=[action("shrink_heap", settings.shrink_heap_threshold),
                 action("stop_accepting_requests", settings.stop_accepting_requests_threshold)],
    )


def _ops_listener(settings: EnvoySettings, port: int) -> Listener:
    """``GET`` of :data:`OPS_PATHS` → the admin cluster; anything else 404."""
    get = [HeaderMatcher(name=":method", string_match=StringMatcher(exact="GET"))]
    routes = [Route(name=f"ops{path}".replace("/", "-"), match=RouteMatch(path=path, headers=get),
                    route=RouteAction(cluster=ADMIN_CLUSTER, timeout=_seconds(5)))
              for path in OPS_PATHS]
    routes.append(Route(name="ops-other", match=RouteMatch(prefix="/"),
                        direct_response=DirectResponseAction(status=404)))
    hcm = HttpConnectionManager(
        stat_prefix="ops",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        route_config=RouteConfiguration(
            name="ops", virtual_hosts=[VirtualHost(name="ops", domains=["*"], routes=routes)]),
        http_filters=[HttpFilter(name="envoy.filters.http.router", typed_config=Any.pack(Router()))],
    )
    return Listener(
        name="ops",
        address=_address(settings.ingress_host, port),
        enable_reuse_port=False,
        # Probes and scrapes pass when clients hold every connection the
        # overload manager allows (else a connection flood fails readiness
        # and gets Envoy restarted, dropping every stream it carries).
        ignore_global_conn_limit=True,
        filter_chains=[FilterChain(filters=[Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=Any.pack(hcm))])],
    )


def _admin_cluster(settings: EnvoySettings) -> Cluster:
    """The admin interface as an upstream of the ``ops`` listener (HTTP/1.1)."""
    host = "127.0.0.1" if settings.admin_host in ("0.0.0.0", "::") else settings.admin_host
    return Cluster(
        name=ADMIN_CLUSTER,
        type=ClusterDiscoveryType.STATIC if _is_ip(host) else ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=_seconds(settings.connect_timeout_s),
        load_assignment=ClusterLoadAssignment(
            cluster_name=ADMIN_CLUSTER,
            endpoints=[LocalityLbEndpoints(lb_endpoints=[LbEndpoint(
                endpoint=Endpoint(address=_address(host, settings.admin_port)))])],
        ),
    )


def build_bootstrap(settings: EnvoySettings | None = None) -> Bootstrap:
    """Builds Envoy's static bootstrap for ``settings`` (defaults: the checked-in ports).

    Raises:
      ValueError: ``admin_host`` is not a loopback address (:data:`LOOPBACK_ADMIN_HOSTS`).
    """
    settings = settings or EnvoySettings()
    if settings.admin_host not in LOOPBACK_ADMIN_HOSTS:
        raise ValueError(f"Envoy's admin must bind loopback ({', '.join(LOOPBACK_ADMIN_HOSTS)}), "
                         f"not {settings.admin_host!r}: expose the ops listener (ops_port) "
                         "for probes and scraping instead")
    return Bootstrap(
        admin=Admin(address=_address(settings.admin_host, settings.admin_port)),
        stats_config=_stats_config(),
        overload_manager=_overload_manager(settings),
        static_resources=BootstrapStaticResources(
            listeners=[*_ingress_listeners(settings), *(
                [] if settings.ops_port is None else [_ops_listener(settings, settings.ops_port)])],
            clusters=[_router_cluster(settings), *(
                [] if settings.openai_port is None else
                [_router_cluster(settings, name=OPENAI_CLUSTER, port=settings.openai_port)]),
                *_retriever_cluster(settings), *(
                [] if settings.ops_port is None else [_admin_cluster(settings)])],
        ),
    )


def bootstrap_dict(settings: EnvoySettings | None = None) -> dict[str, AnyType]:
    """The bootstrap as proto3 JSON (snake_case keys, durations as ``"300s"``)."""
    return build_bootstrap(settings).to_dict(casing=betterproto2.Casing.SNAKE)


def kubernetes_settings() -> EnvoySettings:
    """The rendering for ``deploy/k8s/base`` (:data:`K8S_CONFIG_RELATIVE`):
    ingress on every address, admin on loopback only, the ``ops`` listener for
    probes and Prometheus, the router by its headless Service name
    (STRICT_DNS: every router pod an endpoint, re-resolved every 5 s), the
    descriptor relative to the image's working directory (``/app``)."""
    return EnvoySettings(ingress_host="0.0.0.0", admin_host="127.0.0.1",
                         router_host=K8S_ROUTER_HOST, ops_port=K8S_OPS_PORT)


_HEADER = """\
# Envoy front proxy for llmesh. GENERATED, do not edit by hand:
#   python -m services.cli.envoy_config {flags}--write {path}
# Defaults: ingress {ingress_host}:{ingress_port} (gRPC + JSON + OpenAI), admin
# {admin_host}:{admin_port}, router at {router_host}:{router_port} (OpenAI HTTP: {openai_port}). Run from the repository root (the
# descriptor path is relative):  envoy -c {path}
# Why each setting: envoy/README.md.
"""


class _Dumper(yaml.SafeDumper):
    """Safe YAML that writes strings holding a newline double-quoted (``"...\\n"``)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = '"' if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def render_yaml(settings: EnvoySettings | None = None, *, kubernetes: bool = False) -> str:
    """The bootstrap as a YAML document with a short generated-file header
    (``kubernetes``: the header names the ``--k8s`` command)."""
    settings = settings or EnvoySettings()
    body = yaml.dump(
        bootstrap_dict(settings), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
        width=1_000,
    )
    command = ({"flags": "--k8s ", "path": K8S_CONFIG_RELATIVE} if kubernetes
               else {"flags": "", "path": "envoy/envoy.yaml"})
    return _HEADER.format(**command, **vars(settings)) + body


def write_config(path: Path, settings: EnvoySettings | None = None) -> Path:
    """Writes :func:`render_yaml` to ``path`` and returns it."""
    path.write_text(render_yaml(settings))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m services.cli.envoy_config``: print or write the bootstrap YAML.

    Returns 0, or 1 with ``--check`` when the file differs from a fresh rendering.
    """
    defaults = EnvoySettings()
    parser = argparse.ArgumentParser(
        prog="python -m services.cli.envoy_config", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--write", type=Path, help="write the YAML here instead of stdout")
    parser.add_argument("--check", type=Path, help="exit 1 if this file differs from the rendering")
    parser.add_argument("--k8s", action="store_true",
                        help="the Kubernetes rendering (deploy/k8s/base); other flags are ignored")
    parser.add_argument("--ingress-host", default=defaults.ingress_host)
    parser.add_argument("--ingress-port", type=int, default=defaults.ingress_port)
    parser.add_argument("--admin-host", default=defaults.admin_host)
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port)
    parser.add_argument("--router-host", default=defaults.router_host)
    parser.add_argument("--router-port", type=int, default=defaults.router_port)
    parser.add_argument("--openai-port", type=int, default=defaults.openai_port,
                        help="the router's OpenAI HTTP port; -1: no OpenAI routes")
    parser.add_argument("--descriptor-path", default=defaults.descriptor_path)
    parser.add_argument(
        "--stream-idle-timeout", type=float, default=defaults.stream_idle_timeout_s,
        help="seconds without bytes before a stream is reset (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    settings = EnvoySettings(
        ingress_host=args.ingress_host,
        ingress_port=args.ingress_port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        router_host=args.router_host,
        router_port=args.router_port,
        openai_port=None if args.openai_port < 0 else args.openai_port,
        descriptor_path=args.descriptor_path,
        stream_idle_timeout_s=args.stream_idle_timeout,
    )
    text = (render_yaml(kubernetes_settings(), kubernetes=True) if args.k8s
            else render_yaml(settings))
    if args.check is not None:
        if args.check.read_text() != text:
            print(f"{args.check} differs from the builder: run with --write {args.check}",
                  file=sys.stderr)
            return 1
        return 0
    if args.write is not None:
        args.write.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
