"""``llmesh.v1.GenerationService``: the router's public gRPC API.

:class:`RouterService` implements the server kit's ``Service`` protocol and the
generated ``GenerationServiceServicer``. The request pipeline itself lives in
:mod:`services.router.generation`; this module converts protobuf at the edge,
binds the request id to logs and maps errors to gRPC statuses:

* INVALID_ARGUMENT / OUT_OF_RANGE: a bad field; the message names it.
* INVALID_ARGUMENT also for an unknown ``model``; the message lists the served ids.
* INVALID_ARGUMENT also for bytes that do not parse (a string with invalid
  UTF-8): the server kit refuses them, the router counts them.
* UNAUTHENTICATED: the router runs with ``--api-keys`` and the call has no
  key (``authorization: Bearer <key>`` or ``x-api-key``) or an unknown one;
  PERMISSION_DENIED: the key's tenant may not use the model (the message
  names it). See :mod:`services.router.tenancy`; health and reflection stay
  open.
* FAILED_PRECONDITION: ``chat`` input to a model without a chat template; or
  ``GenerateStream`` got a second ``start`` while a
  generation still runs on the stream (the stream ends; send ``cancel`` and
  wait for the final message, or wait for it, before the next ``start``).
* RESOURCE_EXHAUSTED: admission control refused at once (the class's queue
  is full, or the deadline cannot be met given the predicted wait; see
  :mod:`services.router.admission`), with trailing metadata
  ``retry-after-ms`` (and ``retry-after`` in seconds, for HTTP); or every
  engine replica refused for lack of capacity; or the key's tenant is over
  one of its limits (:mod:`services.router.tenant_limits`: the message names
  the limit and the tenant), with the same ``retry-after-ms``.
* UNAVAILABLE: no engine replica (or the tokenizer) is reachable, the router is
  still starting, or it is draining. A draining router also ends every
  ``GenerateStream`` session UNAVAILABLE (reconnect: Envoy or the client
  takes another router): at once when no generation runs on it, else right
  after the running generation's final message.
* DEADLINE_EXCEEDED: the call's deadline passed (every hop gets the time left),
  or a ``GenerateStream`` reached its session idle limit (nothing running and
  no client message for ``--stream-idle-timeout`` seconds).
* INTERNAL: a bug; the message carries the request id to find the logs.

Request id: ``GenerateRequest.request_id``, else ``x-request-id`` metadata,
else a new one; echoed in every response, in trailing metadata
(``x-request-id``) and bound to every log line of the request. An
``x-request-id`` that is not a valid id (more than 128 characters, not
printable ASCII) is INVALID_ARGUMENT naming ``x-request-id``. Prompt and
output text are logged only with ``--log-content``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc
import structlog

from llmesh.v1 import generation_pb2, generation_pb2_grpc
from services.common import tracing
from services.common.grpc_util import call_headers, request_id_from, request_id_of
from services.common.logging import REQUEST_ID_METADATA_KEY, bind_request_id
from services.common.logprobs import logprobs_to_pb
from services.common.sampling import InvalidRequestError, Priority
from services.router.admission import AdmissionConfig, AdmissionController, AdmissionRefused
from services.router.api_keys import API_KEY_HEADER, AUTHORIZATION_HEADER, Tenant
from services.router.cascade.edge import alias_card, served_problem, validate_alias
from services.router.cascade.metrics import CascadeMetrics
from services.router.cascade.policy import MODE_HEADER, CascadePolicy
from services.router.cascade.runner import Cascade
from services.router.clients import CacheClient
from services.router.discovery import (
    DEFAULT_RESOLVE_INTERVAL_S,
    EngineTarget,
    Resolver,
    make_resolver,
)
from services.router.engine_client import EngineClient
from services.router.generation import (
    NONE_KNOWN,
    Delta,
    Event,
    GenerationError,
    GenerationPipeline,
    Progress,
    no_replica_message,
)
from services.router.history.attach import attach_history
from services.router.history.settings import HistorySettings
from services.router.json_request import parse_generate_json
from services.router.metrics import RouterMetrics
from services.router.openai_http import OpenAIServer
from services.router.replicas import ReplicaSet
from services.router.model_pool import (
    ModelPool,
    NoEngineYet,
    PoolConfig,
    PoolSettings,
    open_pool,
)
from services.router.retrieval.client import RetrieverClient
from services.router.retrieval.stage import DEFAULT_RETRIEVAL_TIMEOUT_S, RetrievalStage
from services.router.routing import CostWeights, RoutingPolicy, RoutingSession
from services.router.stream_session import StreamGeneration, StreamSession
from services.router.tenancy import AuthError, Tenancy
from services.router.slow_reader import DEFAULT_CLIENT_WRITE_TIMEOUT_S
from services.router.tools.formats import ToolCallFormat
from services.router.tools.stream import with_tool_calls
from services.router.validation import (
    TENANT_METADATA_KEY,
    GenerationRequest,
    ModelLimits,
    reject_unknown_fields,
    validate_request,
    validate_request_id,
)

log = structlog.get_logger()

#: After the tokenizer and engines are up, how long start() still waits for the
#: (optional) cache before serving without it (seconds).
CACHE_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class RouterConfig:
    """The router's own settings (the common server flags are separate).

    Attributes:
      tokenizer: ``host:port`` of the (first, default) model's tokenizer service.
      engines: its engine replicas (at least one value): ``host:port`` each,
        or ``dns:///NAME:PORT`` for every address NAME resolves to
        (:mod:`services.router.discovery`).
      pools: each further model's tokenizer and engines
        (:mod:`services.router.model_pool`); requests choose by ``model``.
      cache: ``host:port`` of the cache service, or None to run without one.
      default_max_tokens: completion tokens when a request sets none.
      max_tokens_cap: most completion tokens a request may ask for.
      log_content: log prompt and output text (off: they may be private).
      startup_timeout: seconds start() waits for tokenizer and engines to serve.
      cache_timeout: the most seconds one cache call may take; a response
        store may go unanswered on a connected channel for 4 times it, at
        least 5 s (:func:`services.router.cache_stores.store_timeout_for`).
      stream_idle_timeout: the session idle limit of ``GenerateStream``: seconds
        a stream may go with no generation running and no client message
        (before the first ``start``, or between turns); then the router ends
        it with DEADLINE_EXCEEDED. 0 disables the limit. A running
        generation never counts as idle, however long it waits in a queue.
      tokenize_in_router: make prompt ids in the router
        (:mod:`services.router.local_tokenizer`, loaded in the background after
        the router serves), the tokenizer service the fallback; False: every
        prompt from the service.
      client_write_timeout_s: the slow-reader budget
        (:mod:`services.router.slow_reader`): seconds a write to a client may
        stay blocked while its generation runs; 0: none.
      admission: the admission limits (:mod:`services.router.admission`).
      routing_policy: how a replica is picked (:mod:`services.router.routing`);
        None: ``kv_aware`` with more than one engine, else ``least_load``.
      routing_weights: the ``kv_aware`` cost's constants.
      openai_port: port of the OpenAI-compatible HTTP server
        (:mod:`services.router.openai_http`) on the service host; 0 picks a
        free one; None: no HTTP server.
      resolve_interval_s: seconds between resolutions of ``dns:///`` engines.
      dns_nameserver: ``IP[:PORT]`` of the DNS server that resolves them; None:
        the system's resolver (``/etc/hosts``, ``resolv.conf``).
      api_keys: the API key file (:mod:`services.router.api_keys`); None:
        auth off (``x-tenant-id`` names the tenant, no per-tenant limits).
      tool_call_formats: ``--tool-call-format`` by model id ("" every
        model's default; :mod:`services.router.tools.formats`).
      cascade: the cascade between two served models
        (:mod:`services.router.cascade`), or None.
      retriever: ``host:port`` of the retriever (``--retriever-address``);
        None: requests with ``retrieval`` are FAILED_PRECONDITION and
        ``/v1/embeddings`` answers 400.
      retrieval_timeout_s: cap on one retriever call (``--retrieval-timeout-ms``).
      history: chat history compaction (``--history-budget-tokens``,
        :mod:`services.router.history`); off by default.
    """

    tokenizer: str
    engines: tuple[str, ...]
    cache: str | None = None
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    log_content: bool = False
    startup_timeout: float = 600.0
    cache_timeout: float = 0.5
    stream_idle_timeout: float = 300.0
    client_write_timeout_s: float = DEFAULT_CLIENT_WRITE_TIMEOUT_S
    tokenize_in_router: bool = True
    admission: AdmissionConfig = AdmissionConfig()
    routing_policy: RoutingPolicy | None = None
    routing_weights: CostWeights = CostWeights()
    pools: tuple[PoolConfig, ...] = ()
    openai_port: int | None = None
    resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    tool_call_formats: Mapping[str, ToolCallFormat] = field(default_factory=dict)
    dns_nameserver: str | None = None
    api_keys: str | None = None
    cascade: CascadePolicy | None = None
    retriever: str | None = None
    retrieval_timeout_s: float = DEFAULT_RETRIEVAL_TIMEOUT_S
    history: HistorySettings = HistorySettings()

    def all_pools(self) -> list[PoolConfig]:
        """Every model's pool, the default (``tokenizer``, ``engines``) first."""
        return [PoolConfig(self.tokenizer, tuple(self.engines)), *self.pools]

    def __post_init__(self) -> None:
        if self.client_write_timeout_s < 0:
            raise ValueError(f"client_write_timeout_s must be >= 0 (0: no budget), "
                             f"got {self.client_write_timeout_s}")
        if self.stream_idle_timeout < 0:
            raise ValueError(
                f"stream_idle_timeout must be >= 0 (0: no limit), got {self.stream_idle_timeout}")
        if not self.engines:
            raise ValueError("at least one engine address is needed (--engine HOST:PORT)")
        for target in (*self.engines, *(e for pool in self.pools for e in pool.engines)):
            EngineTarget.parse(target)
        if self.resolve_interval_s <= 0:
            raise ValueError(f"the engine resolve interval must be > 0 seconds, got "
                             f"{self.resolve_interval_s:g}")
        if self.retrieval_timeout_s <= 0:
            raise ValueError(f"the retrieval timeout must be > 0, got "
                             f"{self.retrieval_timeout_s * 1e3:g} ms")
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens must be in [1, max_tokens_cap={self.max_tokens_cap}], "
                f"got {self.default_max_tokens}")


class _Abort(Exception):
    """Ends the call with ``code``, ``message`` and extra trailing metadata
    (raised inside handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


#: The router ends a call this many seconds before the client's deadline, so its
#: DEADLINE_EXCEEDED status (and the engine's cancel) lands before the deadline
#: resets the stream at Envoy or gRPC (a reset reaches the client as INTERNAL).
DEADLINE_MARGIN_SECONDS = 0.1
#: A short deadline keeps this share of itself: the margin never takes more
#: than a fifth of the time the client gave (a 90 ms call gets 72 ms of work).
DEADLINE_MARGIN_SHARE = 0.2


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The router's deadline for the call as ``time.monotonic()`` seconds, or None:
    the client's deadline less :data:`DEADLINE_MARGIN_SECONDS`, or less a fifth
    of the time left when that is shorter."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    margin = min(DEADLINE_MARGIN_SECONDS, max(remaining, 0.0) * DEADLINE_MARGIN_SHARE)
    return time.monotonic() + remaining - margin


async def _send_headers(context: grpc.aio.ServicerContext) -> None:
    """Sends the call's response headers now, unless a message already took
    them (a cascade's second leg is dispatched after the first leg's text)."""
    with contextlib.suppress(grpc.aio.UsageError):
        await context.send_initial_metadata(())


def _response(request_id: str, event: Event) -> generation_pb2.GenerateResponse:
    """``event`` as the message to the client. Only the fields the event sets
    are given (a plain delta, the message of nearly every token, costs 2 µs
    to build here; passing every field, empty ones too, cost 5.7 µs)."""
    path = event.path
    if isinstance(event, Delta):
        response = generation_pb2.GenerateResponse(
            request_id=request_id, text=event.text, token_ids=event.token_ids,
            index=event.index)
        if event.logprobs:
            response.logprobs.extend(logprobs_to_pb(event.logprobs))
        if event.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_pb(event.prompt_logprobs))
        if event.tool_calls:
            response.tool_calls.extend(c.to_pb() for c in event.tool_calls)
        if path is not None:
            response.model = path.model
            response.cascade.CopyFrom(path.to_pb())
        return response
    response = generation_pb2.GenerateResponse(
        request_id=request_id, finish_reason=int(event.reason),
        matched_stop=event.matched_stop, usage=event.usage.to_pb(), cached=event.cached,
        index=event.index, model=event.model, cascade=None if path is None else path.to_pb())
    if event.retrieval is not None:
        response.retrieval.CopyFrom(event.retrieval.used_pb())
        response.retrieval_latency.CopyFrom(event.retrieval.latency_pb())
    return response


def _as_abort(err: BaseException, request_id: str) -> _Abort:
    """The status for an exception out of validation or the pipeline."""
    if isinstance(err, _Abort):
        return err
    if isinstance(err, AuthError):
        return _Abort(err.code, err.message)
    if isinstance(err, InvalidRequestError):
        return _Abort(err.code, str(err))
    if isinstance(err, GenerationError):
        return _Abort(err.code, err.message, err.trailing_metadata)
    log.error("internal_error", exc_info=err)
    return _Abort(grpc.StatusCode.INTERNAL,
                  f"internal error in the router (request_id={request_id}); see its logs")


class RouterService(generation_pb2_grpc.GenerationServiceServicer):
    """The router: public API, validation, routing and stop strings."""

    service_names = ("llmesh.v1.GenerationService",)

    def __init__(self, config: RouterConfig, *, metrics: RouterMetrics | None = None) -> None:
        """Args:
          config: addresses and limits.
          metrics: the metric families (default: on the process-wide registry).

        Raises:
          KeyFileError: ``config.api_keys`` cannot be used (one line, no secrets).
        """
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        #: API keys, tenants and their limits (auth off without ``api_keys``).
        self.tenancy = Tenancy(config.api_keys, self.metrics)
        self.default_model = ""
        #: Served models by id, in the order configured (the first is the default).
        self.pools: dict[str, ModelPool] = {}
        self._cache: CacheClient | None = None
        #: The retrieval stage every pool's pipeline shares (its client: None
        #: without ``retriever``); made in :meth:`start`.
        self.retrieval: RetrievalStage | None = None
        self._draining = False
        self._openai: OpenAIServer | None = None
        #: Pools opened, by their index in ``config.all_pools()``.
        self._opened: dict[int, ModelPool] = {}
        #: Pools with no engine yet (only DNS names), being opened in the background.
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._started = False
        self._settings: PoolSettings | None = None
        self._resolver: Resolver | None = None
        #: Each open ``GenerateStream`` call's session (drain() tells them).
        self._stream_sessions: set[StreamSession] = set()
        self.cascade = (None if config.cascade is None else
                        Cascade(config.cascade, CascadeMetrics(self.metrics.registry)))

    # ------------------------------------------------------------ lifecycle

    @property
    def models(self) -> dict[str, ModelLimits]:
        """Each served model's limits, by id."""
        return {model: pool.limits for model, pool in self.pools.items()}

    @property
    def admission(self) -> dict[str, AdmissionController]:
        """Each served model's admission controller, by id."""
        return {model: pool.admission for model, pool in self.pools.items()}

    @property
    def _default_pool(self) -> ModelPool | None:
        return self.pools.get(self.default_model)

    @property
    def _pipeline(self) -> GenerationPipeline | None:
        """The default model's pipeline (None before :meth:`start`)."""
        pool = self._default_pool
        return pool.pipeline if pool is not None else None

    @property
    def _engines(self) -> list[EngineClient]:
        """The default model's engine clients."""
        pool = self._default_pool
        return pool.engines if pool is not None else []

    @property
    def _replicas(self) -> ReplicaSet | None:
        """The default model's replica set."""
        pool = self._default_pool
        return pool.replicas if pool is not None else None

    def register(self, server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self, server)

    async def listen_extra(self, host: str) -> dict[str, int]:
        """Starts the OpenAI-compatible HTTP server when configured (it answers
        503 until :meth:`start` returns); returns ``{"openai_port": port}``.
        Also makes SIGHUP reload the API key file (:meth:`Tenancy.reload`)."""
        if self.tenancy.keys_path is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.tenancy.reload)
        if self.config.openai_port is None:
            return {}
        self._openai = OpenAIServer(self, host, self.config.openai_port)
        return {"openai_port": await self._openai.start()}

    async def start(self) -> None:
        """Connects to every model's tokenizer and engines and to the cache, waits
        for them to serve, reads each model's limits. Health turns SERVING when
        this returns.

        A pool with only ``dns:///`` engines none of which serves yet (its
        names resolve to no address, or no address served within
        ``startup_timeout``) does not fail the start: once its tokenizer
        serves, the router serves without it (warning ``no_engine_known``;
        its requests end UNAVAILABLE) and adds it when an engine serves.

        Raises:
          UpstreamError: a tokenizer or a static engine did not serve within
            ``startup_timeout`` seconds.
          RuntimeError: the engine replicas of one pool serve different models,
            or two pools serve the same model id.
        """
        cfg = self.config
        self.tenancy.warn_if_locked_out()  # logging is set up by now (not in __init__)
        self._cache = (CacheClient(cfg.cache, timeout=cfg.cache_timeout,
                                   on_store=self.metrics.observe_cache_store)
                       if cfg.cache else None)
        cache_ready = (asyncio.create_task(self._cache.wait_until_serving(cfg.startup_timeout))
                       if self._cache is not None else None)
        self.retrieval = RetrievalStage(
            RetrieverClient(cfg.retriever) if cfg.retriever else None,
            self.metrics.retrieval, cfg.retrieval_timeout_s)
        self._settings = self._pool_settings()
        self._resolver = make_resolver(cfg.dns_nameserver)
        configs = cfg.all_pools()
        opened = await asyncio.gather(
            *(open_pool(pool, self._settings, self._cache, self.metrics, self._resolver,
                        wait_for_engines=False)
              for pool in configs),
            return_exceptions=True)
        pools = {i: p for i, p in enumerate(opened) if isinstance(p, ModelPool)}
        if (failure := _start_failure(opened, pools)) is not None:
            if cache_ready is not None:
                cache_ready.cancel()
            await asyncio.gather(*(p.close() for p in pools.values()), return_exceptions=True)
            raise failure
        self._opened = pools
        self._install()
        self._started = True
        for index, result in enumerate(opened):
            if isinstance(result, NoEngineYet):
                log.warning("no_engine_known", engines=list(configs[index].engines),
                            tokenizer=configs[index].tokenizer, why=str(result),
                            effect="its requests end UNAVAILABLE until an engine of the "
                                   "DNS name serves (resolved again every "
                                   f"{cfg.resolve_interval_s:g} s)")
                self._pending[index] = asyncio.create_task(
                    self._open_later(index, configs[index]), name=f"open pool {index}")
        if cache_ready is not None:
            await self._await_cache(cache_ready)
        for pool in pools.values():
            self._log_ready(pool)
        if not self._pending:
            self._all_pools_open()
        self._check_cascade()

    def _check_cascade(self) -> None:
        """Refuses to start with a cascade whose models are not configured
        (a pool still opening may serve them later) or whose window passes
        the small model's context (:func:`served_problem`)."""
        policy = self.config.cascade
        if policy is None:
            return
        problem = served_problem(policy, self.models, complete=not self._pending)
        if problem is not None:
            raise RuntimeError(problem)
        log.info("cascade_ready", policy=policy.describe())

    def _all_pools_open(self) -> None:
        """Once every pool is open: the tenants' model lists, and a warning for
        each ``--tool-call-format MODEL=`` that names no served model (a typo
        would otherwise leave that model's format at the default unnoticed)."""
        self.tenancy.set_served_models(self.pools)
        for model in sorted(set(self.config.tool_call_formats) - {""} - set(self.pools)):
            log.warning("tool_call_format_unknown_model", model=model,
                        served=sorted(self.pools),
                        effect="the flag applies to no model; check the model id")

    def _pool_settings(self) -> PoolSettings:
        """What every model pool takes from the router's configuration."""
        cfg = self.config
        return PoolSettings(
            default_max_tokens=cfg.default_max_tokens, max_tokens_cap=cfg.max_tokens_cap,
            startup_timeout=cfg.startup_timeout, admission=cfg.admission,
            routing_policy=cfg.routing_policy, routing_weights=cfg.routing_weights,
            log_content=cfg.log_content, resolve_interval_s=cfg.resolve_interval_s,
            client_write_timeout_s=cfg.client_write_timeout_s,
            tokenize_in_router=cfg.tokenize_in_router,
            tool_call_formats=cfg.tool_call_formats, retrieval=self.retrieval)

    def _install(self) -> None:
        """Serves the pools opened so far, in the order configured."""
        self.pools = {pool.model: pool for _, pool in sorted(self._opened.items())}
        self.default_model = self._opened[0].model if 0 in self._opened else ""
        attach_history(self.pools, self.config.history, self._cache, self.metrics.history,
                       _Summaries(self))

    def _log_ready(self, pool: ModelPool) -> None:
        log.info("router_ready", model=pool.model, max_model_len=pool.limits.max_model_len,
                 engines=[e.target for e in pool.engines], tokenizer=pool.tokenizer.target,
                 cache=self.config.cache, chat=pool.limits.has_chat_template,
                 backends=sorted({i.backend for i in pool.infos}),
                 routing_policy=pool.policy.value,
                 replica_ids=[i.replica_id for i in pool.infos],
                 default=pool.model == self.default_model)

    async def _open_later(self, index: int, config: PoolConfig) -> None:
        """Opens a pool that had no engine at start, once one serves (retrying
        every resolve interval after a failure), and serves it."""
        settings = dataclasses.replace(self._settings, startup_timeout=math.inf)
        while True:
            try:
                pool = await open_pool(config, settings, self._cache, self.metrics,
                                       self._resolver)
            except Exception as err:  # noqa: BLE001 - logged, tried again
                log.warning("pool_open_failed", engines=list(config.engines),
                            error=f"{type(err).__name__}: {err}")
                await asyncio.sleep(self.config.resolve_interval_s)
                continue
            if (other := self.pools.get(pool.model)) is not None:
                log.error("pool_not_served", error=str(_duplicate_model(other, pool)))
                await pool.close()
                return
            self._opened[index] = pool
            self._install()
            self._pending.pop(index, None)
            self._log_ready(pool)
            if not self._pending:
                self._all_pools_open()
            return

    async def _await_cache(self, ready: asyncio.Task[None]) -> None:
        assert self._cache is not None
        done, _ = await asyncio.wait({ready}, timeout=CACHE_GRACE_SECONDS)
        if ready in done and ready.exception() is None:
            return
        if ready not in done:
            ready.cancel()
        # The cache is optional: serve without hits until it answers.
        log.warning("cache_not_ready", target=self._cache.target,
                    detail=str(ready.exception()) if ready in done else "still starting")

    async def drain(self) -> None:
        """Refuses new generations (UNAVAILABLE); running ones may finish. Each
        ``GenerateStream`` session ends UNAVAILABLE
        (:data:`~services.router.stream_session.STREAM_DRAIN_MESSAGE`):
        at once when no generation runs on it, else once its generation ends; an
        idle session would otherwise hold the drain to its deadline."""
        self._draining = True
        for session in self._stream_sessions:
            session.drain()

    async def close(self) -> None:
        """Closes the HTTP server and the channels (after the gRPC server stopped)."""
        if self.tenancy.keys_path is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        for task in self._pending.values():
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)
        if self._openai is not None:
            await self._openai.close()
        await asyncio.gather(*(pool.close() for pool in self.pools.values()),
                             return_exceptions=True)
        if self._cache is not None:
            await self._cache.close()
        if self.retrieval is not None and self.retrieval.client is not None:
            await self.retrieval.client.close()

    # -------------------------------------------------------------- helpers

    def check_accepting(self) -> None:
        """Refuses every generation while the router drains or starts (gRPC and
        the OpenAI edge).

        Raises:
          GenerationError: UNAVAILABLE, saying which.
        """
        if self._draining:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE,
                                  "the router is draining (shutting down); retry on another "
                                  "instance")
        if not self._started:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE,
                                  "the router is starting (waiting for tokenizer and engines)")

    def pipeline_for(self, request: GenerationRequest) -> GenerationPipeline:
        """The pipeline of the (validated, hence served) model ``request`` names."""
        return self.pools[request.model].pipeline

    def authenticate(self, authorization: str | None, api_key: str | None) -> Tenant | None:
        """The calling tenant from the call's key headers (both edges); None:
        auth is off.

        Raises:
          AuthError: UNAUTHENTICATED.
        """
        return self.tenancy.authenticate(authorization, api_key)

    def validate(self, pb: generation_pb2.GenerateRequest, request_id: str, *,
                 header_request_id: str | None, header_tenant: str | None,
                 tenant: Tenant | None = None, traceparent: str | None = None,
                 tracestate: str | None = None,
                 header_cascade: str | None = None) -> GenerationRequest:
        """:func:`validate_request` against the served models (both edges),
        then whether ``tenant`` (the key's; None: auth off, ``header_tenant``
        names the tenant) may use the model. ``traceparent``/``tracestate``:
        the call's W3C trace context headers, kept (unchecked) while tracing is on.
        A request to the cascade alias is validated as each of its two models
        (:func:`validate_alias`; ``header_cascade``: the ``x-llmesh-cascade``
        header; the tenant's ``cascade`` setting is the mode when neither
        the request nor the header names one).

        Raises:
          InvalidRequestError: the first bad field.
          AuthError: PERMISSION_DENIED, the tenant may not use the model.
          GenerationError: UNAVAILABLE, the model may be a pool's whose
            engines are not serving yet (only when such a pool exists).
        """
        cascade = validate_alias(pb, header_cascade, self.config.cascade, functools.partial(
            self.validate, request_id=request_id, header_request_id=header_request_id,
            header_tenant=header_tenant, tenant=tenant, traceparent=traceparent,
            tracestate=tracestate), tenant_mode=None if tenant is None else tenant.cascade)
        if cascade is not None:
            return cascade
        if self._pending and (pb.model or self.default_model) not in self.pools:
            # Perhaps the model of a pool whose engines are not up yet.
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, no_replica_message(NONE_KNOWN))
        if not (traceparent and tracing.enabled()):
            traceparent = tracestate = None
        validated = validate_request(
            pb, request_id=request_id, models=self.models, default_model=self.default_model,
            header_request_id=header_request_id,
            header_tenant=header_tenant if tenant is None else tenant.id,
            cache_group="" if tenant is None else tenant.cache_group,
            traceparent=traceparent or "", tracestate=tracestate or "")
        self.tenancy.check_model(tenant, validated.model)
        return validated

    def run(self, tenant: Tenant | None, request: GenerationRequest, *, received_at: float,
            deadline: float | None, progress: Progress | None = None,
            session: RoutingSession | None = None) -> AsyncIterator[Event]:
        """The model's pipeline, under the tenant's limits when auth is on
        (both edges; :meth:`Tenancy.run`), with tool calls parsed out of the
        text when the request may call tools (:mod:`services.router.tools`).
        A request to the cascade alias runs its legs so
        (:meth:`Cascade.run`)."""
        def run_model(leg: GenerationRequest, leg_progress: Progress | None
                      ) -> AsyncIterator[Event]:
            if tenant is None:
                return self.pipeline_for(leg).run(leg, received_at=received_at,
                                                  deadline=deadline, progress=leg_progress,
                                                  session=session)
            return self.tenancy.run(tenant, leg, self.pipeline_for(leg),
                                    received_at=received_at, deadline=deadline,
                                    progress=leg_progress, session=session)

        if request.cascade is not None and self.cascade is not None:
            events = self.cascade.run(request, run_model,
                                      progress=Progress() if progress is None else progress)
        else:
            events = run_model(request, progress)
        if request.tools is not None and request.tools.may_call:
            return with_tool_calls(events, calls_only=request.tools.calls_only)
        return events

    def _authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant of a call with ``headers`` (:func:`call_headers`)."""
        return self.authenticate(headers.get(AUTHORIZATION_HEADER), headers.get(API_KEY_HEADER))

    def _validate(self, pb: generation_pb2.GenerateRequest, request_id: str,
                  headers: Mapping[str, str], tenant: Tenant | None) -> GenerationRequest:
        """:meth:`validate` with the call's ``headers`` (:func:`call_headers`)."""
        return self.validate(
            pb, request_id, header_request_id=headers.get(REQUEST_ID_METADATA_KEY),
            header_tenant=headers.get(TENANT_METADATA_KEY), tenant=tenant,
            traceparent=headers.get(tracing.TRACEPARENT),
            tracestate=headers.get(tracing.TRACESTATE),
            header_cascade=headers.get(MODE_HEADER))

    def model_cards(self, tenant: Tenant | None) -> list[ModelLimits]:
        """The models ``tenant`` may use (all, with auth off), in the order
        configured, then the cascade's alias when it may use both its models."""
        visible = set(self.tenancy.visible_models(tenant, self.models))
        cards = {m: limits for m, limits in self.models.items() if m in visible}
        alias = alias_card(self.config.cascade, cards)
        return [*cards.values(), *([alias] if alias is not None else [])]

    def count_refused(self, pb: generation_pb2.GenerateRequest, code: grpc.StatusCode) -> None:
        """Counts a request refused before the pipeline ran it (it counts the rest)."""
        model = pb.model if pb.model in self.models else self.default_model
        self.metrics.observe_refused(model=model, outcome=code.name.lower(),
                                     priority=Priority.from_pb(pb.priority).name.lower())

    def count_unparsable_request(self, method: str) -> None:
        """Counts a generation request whose bytes did not parse (the server kit
        refused it INVALID_ARGUMENT before a handler ran: see
        :mod:`services.common.request_guard`); ``method`` is the full gRPC name."""
        service = self.service_names[0]
        if method in (f"/{service}/Generate", f"/{service}/GenerateStream"):
            self.count_refused(generation_pb2.GenerateRequest(),
                                grpc.StatusCode.INVALID_ARGUMENT)

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, err: _Abort, request_id: str) -> None:
        if err.code != grpc.StatusCode.CANCELLED:
            log.info("request_refused", code=err.code.name, message=err.message)
        # A message quoting client text may hold a lone surrogate (a JSON key
        # "\ud800"): gRPC cannot encode it, and the call would never end.
        message = err.message.encode("utf-8", "backslashreplace").decode("utf-8")
        await context.abort(err.code, message, trailing_metadata=(
            (REQUEST_ID_METADATA_KEY, request_id), *err.trailing_metadata))

    # ------------------------------------------------------------------ RPCs

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Server-streaming generation: text deltas, then one final message.

        The response headers (initial metadata) leave as soon as an engine
        replica has the request, while it prefills, so the first token is a
        bare message behind them (on this VM the headers riding with the
        first token cost it 0.3-1.2 ms through the router and Envoy,
        docs/architecture.md "What the mesh costs"). A request refused before
        that (validation, admission, no replica, the tokenizer) still ends
        with a status alone, which Envoy may retry on another router."""
        async with contextlib.aclosing(self._generate(request, context,
                                                      commit_early=True)) as responses:
            async for response in responses:
                yield response

    async def _generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext, *,
        commit_early: bool,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """:meth:`Generate`; ``commit_early`` False: the headers leave with the
        first message (or the status), for the JSON transcoder, which maps a
        status sent alone to the HTTP status."""
        received_at = time.monotonic()
        # An invalid request.request_id is refused by validation below; until then
        # a safe id stands in (it goes into metadata and logs).
        headers = call_headers(context)
        request_id = _safe_request_id(request_id_of(headers, request.request_id))
        bind_request_id(request_id)
        context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, request_id),))
        failure: _Abort | None = None
        validated: GenerationRequest | None = None
        try:
            tenant = self._authenticate(headers)
            self.check_accepting()
            validated = self._validate(request, request_id, headers, tenant)
            progress = Progress(on_dispatch=functools.partial(_send_headers, context)
                                if commit_early else None)
            events = self.run(tenant, validated, received_at=received_at,
                              deadline=_deadline(context), progress=progress)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield _response(request_id, event)
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            failure = _as_abort(err, request_id)
            if validated is None:  # else the pipeline counted it
                self.count_refused(request, failure.code)
        if failure is not None:
            await self._abort(context, failure, request_id)

    async def GenerateJson(
        self, request: generation_pb2.GenerateJsonRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """``POST /v1/generate`` (through Envoy): the JSON body parsed strictly
        (:func:`parse_generate_json`: INVALID_ARGUMENT naming an unknown or
        malformed field), then exactly :meth:`Generate`."""
        try:
            parsed = parse_generate_json(request.body.data)
        except InvalidRequestError as err:
            request_id = _safe_request_id(request_id_from(context))
            self.count_refused(generation_pb2.GenerateRequest(), err.code)
            await self._abort(context, _Abort(err.code, str(err)), request_id)
            return
        async for response in self._generate(parsed, context, commit_early=False):
            yield response

    async def GenerateStream(
        self, request_iterator: AsyncIterator[generation_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Bidirectional generation: ``start``, deltas, optional ``cancel``, next ``start``.

        One generation runs at a time. A ``cancel`` (without ``request_id``, or
        with the running one's) ends the running generation with a final
        FINISH_REASON_CANCELLED message; a cancel with nothing running, or naming
        another id (e.g. one that just ended), is ignored. A second ``start``
        while one runs ends the stream with FAILED_PRECONDITION. A failed
        generation ends the stream with its status. When the client half-closes,
        the running generation finishes, then the call ends OK. A stream with
        nothing running and no client message for ``stream_idle_timeout``
        seconds ends with DEADLINE_EXCEEDED (the session idle limit). When the
        router drains, the stream ends UNAVAILABLE once nothing runs on it (at
        once if nothing does; a ``start`` during the drain is refused
        UNAVAILABLE too).
        """
        headers = call_headers(context)
        stream_id = _safe_request_id(request_id_of(headers))
        bind_request_id(stream_id)
        try:  # once per call: every turn of the stream is this tenant's
            tenant = self._authenticate(headers)
        except AuthError as err:
            await self._abort(context, _as_abort(err, stream_id), stream_id)
            return
        session = StreamSession(_StreamCall(self, context, tenant, headers), stream_id,
                                idle_timeout_s=self.config.stream_idle_timeout)
        self._stream_sessions.add(session)
        try:
            await session.run(request_iterator)
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            await self._abort(context, _as_abort(err, session.last_id), session.last_id)
        finally:
            self._stream_sessions.discard(session)

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext,
    ) -> generation_pb2.ListModelsResponse:
        """The served models with their context window and max_tokens cap;
        INVALID_ARGUMENT for a request with field numbers this proto lacks.
        With API keys on it needs a key (UNAUTHENTICATED) and lists only the
        models the key's tenant may use, as OpenAI's ``GET /v1/models`` lists
        a key's models: a tenant learns nothing of the others' models."""
        try:
            reject_unknown_fields(request)
            tenant = self._authenticate(call_headers(context))
        except (InvalidRequestError, AuthError) as err:
            await context.abort(err.code, str(err))
        return generation_pb2.ListModelsResponse(models=[
            generation_pb2.ModelCard(id=m.model, max_model_len=m.max_model_len,
                                     max_tokens_cap=m.max_tokens_cap, chat=m.has_chat_template,
                                     admission=self._admission_limits(m.model))
            for m in self.model_cards(tenant)
        ])

    def _admission_limits(self, model: str) -> generation_pb2.AdmissionLimits | None:
        pool = self.pools.get(model)
        if pool is None:
            return None
        controller = pool.admission
        cfg = controller.config
        return generation_pb2.AdmissionLimits(
            enabled=cfg.enabled, max_queued_requests=cfg.max_queued_requests,
            max_queued_prompt_tokens=cfg.max_queued_prompt_tokens,
            max_running_requests=controller.max_running,
            batch_window_ms=round(cfg.batch_window_s * 1e3),
            max_queue_wait_ms=round(cfg.max_queue_wait_s * 1e3))


@dataclass(frozen=True)
class _StreamCall:
    """The router's side of one ``GenerateStream`` call
    (:class:`~services.router.stream_session.StreamHost`)."""

    router: RouterService
    context: grpc.aio.ServicerContext
    tenant: Tenant | None
    headers: Mapping[str, str]  # the call's (:func:`call_headers`)

    @property
    def draining(self) -> bool:
        return self.router._draining

    def open(self, start: generation_pb2.GenerateRequest, request_id: str,
             routing: RoutingSession) -> StreamGeneration:
        received_at = time.monotonic()
        request_id = _safe_request_id(request_id)  # validation refuses a bad start.request_id
        try:
            self.router.check_accepting()
            validated = self.router._validate(start, request_id, self.headers,
                                              self.tenant)
        except Exception as err:
            code = (err.code if isinstance(err, (_Abort, InvalidRequestError, GenerationError,
                                                 AuthError))
                    else grpc.StatusCode.INTERNAL)
            self.router.count_refused(start, code)
            raise
        progress = Progress()
        events = self.router.run(self.tenant, validated, received_at=received_at,
                                 deadline=_deadline(self.context), progress=progress,
                                 session=routing)
        return StreamGeneration(validated.request_id, events, validated.sampling.n, progress)

    def count_refused(self, start: generation_pb2.GenerateRequest,
                      code: grpc.StatusCode) -> None:
        self.router.count_refused(start, code)

    async def write(self, request_id: str, event: Event) -> None:
        await self.context.write(generation_pb2.GenerateStreamResponse(
            response=_response(request_id, event)))


def _start_failure(opened: list[ModelPool | BaseException], pools: dict[int, ModelPool]
                   ) -> BaseException | None:
    """Why the router cannot start with the pools ``open_pool`` gave: the first
    pool that failed (a pool still waiting for its DNS engines,
    :class:`NoEngineYet`, is not a failure), else two pools serving the same
    model; None when it can."""
    failure = next((p for p in opened if isinstance(p, BaseException)
                    and not isinstance(p, NoEngineYet)), None)
    if failure is not None:
        return failure
    seen: dict[str, ModelPool] = {}
    for pool in pools.values():
        if pool.model in seen:
            return _duplicate_model(seen[pool.model], pool)
        seen[pool.model] = pool
    return None


class _Summaries:
    """History summaries run as the chat's tenant (:class:`SummaryRunner`)."""

    def __init__(self, router: RouterService) -> None:
        self._router = router

    def refusal(self, request: GenerationRequest) -> AdmissionRefused | None:
        return self._router.tenancy.background_refusal(request)

    def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        return self._router.tenancy.run_background(request, self._router.pipeline_for(request))


def _duplicate_model(first: ModelPool, second: ModelPool) -> RuntimeError:
    return RuntimeError(
        f"two pools serve model {first.model!r} (engines {[e.target for e in first.engines]} "
        f"and {[e.target for e in second.engines]}); give each model its own id "
        "(the engine's --served-model-name) or put the engines in one pool")


def _safe_request_id(request_id: str) -> str:
    """``request_id`` if it is a valid id, else a new one (for ids from metadata)."""
    try:
        validate_request_id(request_id)
    except InvalidRequestError:
        return uuid.uuid4().hex
    return request_id or uuid.uuid4().hex


__all__ = ["RouterConfig", "RouterService"]
