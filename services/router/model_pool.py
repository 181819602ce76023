"""One served model inside the router: its tokenizer, its engine replicas, its
admission controller and the request pipeline over them.

A router serves one or more models (``--engine``/``--tokenizer`` for the first,
``--model-pool`` for each further one). Every model has a pool of its own: its
own tokenizer (a model's ids mean nothing to another's vocabulary), its own
replicas, replica set and routing, and its own admission limits. The response
cache and the prefix index are shared: their keys cover the model (the block
hash is seeded with the model id, :mod:`services.common.block_hash`), so two
models never meet there. Requests are sent to the pool their ``model`` field
names; :func:`services.router.validation.resolve_model` refuses an unknown one.

A pool's engines may come from DNS (``dns:///NAME:PORT``,
:mod:`services.router.discovery`): at start the pool waits for every static
engine and, when it has none, for the first address of its names to serve
(re-resolving until ``startup_timeout``); its limits come from those. A pool
with only DNS names whose names resolve to no address (no engine is up yet,
e.g. while a model is fetched), or none of whose addresses served in time,
does not fail the router's start: :func:`open_pool` raises
:class:`NoEngineYet` once the tokenizer serves, and the router opens the pool
later (:func:`open_pool` with ``wait_for_engines``, no time limit). Every
further address joins later through the replica set, once SERVING and only
when its ``GetModelInfo`` fits the limits (the same model, a context window no
smaller); one that does not stays out, with a warning (``engine_not_admitted``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.detokenizer import TokenizersDecoder
from services.common.wire.engine_info import ModelInfo
from services.common.wire.tokenizer_info import TokenizerInfo
from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    NoReplicaServing,
    ReplicaCapacity,
)
from services.router.clients import (
    CacheClient,
    TokenizerClient,
    TokenizerDefinition,
    UpstreamError,
)
from services.router.discovery import (
    DEFAULT_RESOLVE_INTERVAL_S,
    Discovery,
    EngineTarget,
    Resolver,
    SystemResolver,
)
from services.router.engine_client import EngineClient
from services.router.generation import GenerationPipeline
from services.router.local_tokenizer import PromptTokenizer
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet
from services.router.retrieval.stage import RetrievalStage
from services.router.routing import (
    CostWeights,
    ReplicaPicker,
    RoutingPolicy,
    duplicate_replica_ids,
)
from services.router.tools.formats import ToolCallFormat
from services.router.tools.formats import resolve as resolve_tool_call_format
from services.router.tools.formats import takes_tool_turns
from services.router.validation import ModelLimits

log = structlog.get_logger()


@dataclass(frozen=True)
class PoolConfig:
    """Where one model is served.

    Attributes:
      tokenizer: ``host:port`` of the model's tokenizer service.
      engines: its engine replicas: ``host:port`` or ``dns:///NAME:PORT``
        each (at least one).
    """

    tokenizer: str
    engines: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> PoolConfig:
        """``TOKENIZER=ENGINE[,ENGINE...]`` (the ``--model-pool`` flag's form).

        Raises:
          ValueError: no ``=``, an empty tokenizer, no engine address or a bad
            one (see :meth:`EngineTarget.parse`).
        """
        tokenizer, sep, engines = text.partition("=")
        addresses = tuple(e.strip() for e in engines.split(",") if e.strip())
        if not sep or not tokenizer.strip() or not addresses:
            raise ValueError(f"--model-pool {text!r}: expected TOKENIZER_HOST:PORT="
                             "ENGINE[,ENGINE...], each ENGINE HOST:PORT or dns:///NAME:PORT")
        for address in addresses:
            try:
                EngineTarget.parse(address)
            except ValueError as err:
                raise ValueError(f"--model-pool {text!r}: {err}") from None
        return cls(tokenizer.strip(), addresses)


@dataclass(frozen=True)
class PoolSettings:
    """The router-wide settings every pool applies to its own model."""

    default_max_tokens: int
    max_tokens_cap: int
    startup_timeout: float
    admission: AdmissionConfig
    routing_policy: RoutingPolicy | None
    routing_weights: CostWeights
    log_content: bool
    resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    #: the slow-reader budget (:mod:`services.router.slow_reader`); 0: none
    client_write_timeout_s: float = 0.0
    #: prompt ids made in the router (:mod:`services.router.local_tokenizer`)
    tokenize_in_router: bool = True
    #: ``--tool-call-format`` by model id (:mod:`services.router.tools.formats`)
    tool_call_formats: Mapping[str, ToolCallFormat] = field(default_factory=dict)
    #: the router's retrieval stage (:mod:`services.router.retrieval`), shared
    retrieval: RetrievalStage | None = None


class NoEngineYet(Exception):
    """A pool with only ``dns:///`` engines found no serving address at start;
    its tokenizer serves. The router serves without it and opens it later."""

    def __init__(self, names: str, known: list[str]) -> None:
        super().__init__(f"no engine of {names} is serving yet (addresses: "
                         f"{', '.join(known) or 'none'})")
        self.names = names
        self.known = known


class ModelPool:
    """The clients, replica set, admission and pipeline of one model (owner of
    all of them: :meth:`close` closes them).

    Attributes:
      limits: the model's limits (id, context window, chat template ...).
      tokenizer, engines, replicas, admission, pipeline: its parts.
      infos: the replicas' ``GetModelInfo`` answers at start.
      policy: the routing policy in force.
    """

    def __init__(self, limits: ModelLimits, tokenizer: TokenizerClient,
                 infos: list[ModelInfo], admission: AdmissionController,
                 replicas: ReplicaSet, pipeline: GenerationPipeline, policy: RoutingPolicy,
                 discovery: Discovery) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.infos = infos
        self.admission = admission
        self.replicas = replicas
        self.pipeline = pipeline
        self.policy = policy
        self.discovery = discovery

    @property
    def model(self) -> str:
        return self.limits.model

    @property
    def engines(self) -> list[EngineClient]:
        """The pool's replicas now (discovery adds and removes them)."""
        return self.replicas.engines

    async def close(self) -> None:
        """Stops discovery, the replica set and the pipeline, then the prompt
        tokenizer's background load, and closes the channels."""
        await self.discovery.close()
        await self.replicas.close()
        await self.pipeline.close()
        await asyncio.gather(self.pipeline.tokenizer.close(), self.tokenizer.close(),
                             *(e.close() for e in self.engines), return_exceptions=True)


def _default_policy(targets: list[EngineTarget]) -> RoutingPolicy:
    """KV-aware routing where there is more than one replica to choose from
    (several targets, or a DNS name), least load otherwise."""
    several = len(targets) > 1 or any(t.dns for t in targets)
    return RoutingPolicy.KV_AWARE if several else RoutingPolicy.LEAST_LOAD


def _engine_client(policy: RoutingPolicy, target: str) -> EngineClient:
    """A client of the engine at ``target``, following its load when ``policy``
    reads it (KV-aware routing only)."""
    engine = EngineClient(target)
    if policy is RoutingPolicy.KV_AWARE:
        engine.load_watch.start()
    return engine


def _replica_set(engines: list[EngineClient], capacities: list[ReplicaCapacity],
                 admission: AdmissionController, limits: ModelLimits, metrics: RouterMetrics,
                 make_client: Callable[[str], EngineClient],
                 discovery: Discovery) -> ReplicaSet:
    """The pool's replicas (not started), tied to ``admission``: its
    concurrency cap follows the replicas in routing, and when none is left the
    queued requests end UNAVAILABLE (nothing would serve them)."""

    def replicas_changed(capacities: dict[EngineClient, ReplicaCapacity]) -> None:
        admission.set_replicas(capacities)
        if not capacities:
            failed = admission.fail_queued(NoReplicaServing(
                f"no engine replica is serving model {limits.model!r} (of "
                f"{len(replicas.engines)} known, each failed or is draining) while the "
                "request waited in the router's queue; retry in a few seconds"))
            if failed:
                log.warning("queued_requests_failed", model=limits.model, requests=failed,
                            why="no engine replica is serving")

    replicas = ReplicaSet(engines, capacities, on_change=replicas_changed, metrics=metrics,
                          make_client=make_client, admit=functools.partial(admit_replica, limits),
                          on_lost=discovery.resolve_soon)
    return replicas


def _start_routing(replicas: ReplicaSet, discovery: Discovery, engines: list[EngineClient],
                   limits: ModelLimits) -> None:
    """Starts probing the replicas and resolving the pool's DNS names (their
    other addresses join once they serve); warns when two of the first
    ``engines`` share a replica id."""
    replicas.start()
    discovery.attach(replicas)
    discovery.apply()
    discovery.start()
    if shared := duplicate_replica_ids(engines):
        log.warning("engine_replica_ids_not_unique", model=limits.model,
                    replica_ids=sorted(shared),
                    effect="their prefix-index matches are ignored; give each engine "
                           "its own --replica-id")


async def open_pool(config: PoolConfig, settings: PoolSettings, cache: CacheClient | None,
                    metrics: RouterMetrics, resolver: Resolver | None = None, *,
                    wait_for_engines: bool = True) -> ModelPool:
    """Connects to the pool's tokenizer and engines, waits for them to serve and
    builds its parts. On failure the clients opened here are closed.

    Args:
      resolver: resolves the pool's ``dns:///`` engines (default: the system's).
      wait_for_engines: False: a pool with only ``dns:///`` engines raises
        :class:`NoEngineYet` (once its tokenizer serves) instead of waiting
        while its names resolve to no address, or failing when no address
        served within ``startup_timeout``.

    Raises:
      NoEngineYet: see ``wait_for_engines``.
      UpstreamError: the tokenizer, a static engine, or (without a static one)
        any address of the DNS names did not serve within
        ``settings.startup_timeout`` seconds.
      RuntimeError: the replicas serve different models, or report a context
        window below 2 tokens.
    """
    targets = [EngineTarget.parse(t) for t in config.engines]
    policy = settings.routing_policy or _default_policy(targets)
    make_client = functools.partial(_engine_client, policy)
    tokenizer = TokenizerClient(config.tokenizer)
    engines: list[EngineClient] = []
    discovery = Discovery(targets, resolver or SystemResolver(), metrics,
                          interval_s=settings.resolve_interval_s)
    try:
        ready = asyncio.create_task(tokenizer.wait_until_serving(settings.startup_timeout))
        try:
            engines = await _first_engines(discovery, make_client, settings,
                                           wait_unknown=wait_for_engines)
        except NoEngineYet:
            await ready  # the router serves once the tokenizer does
            raise
        except BaseException:
            ready.cancel()
            raise
        await ready
        infos = list(await asyncio.gather(*(engine.model_info() for engine in engines)))
        tok_info, decoder, definition = await _tokenizer_parts(tokenizer)
        limits = model_limits(infos, tok_info, settings, definition.chat_template)
    except BaseException:
        await asyncio.gather(tokenizer.close(), *(e.close() for e in engines),
                             return_exceptions=True)
        raise
    capacities = [ReplicaCapacity(i.max_num_seqs, i.kv_capacity_tokens) for i in infos]
    admission = _admission(limits.model, settings.admission,
                           dict(zip(engines, capacities, strict=True)), metrics)
    replicas = _replica_set(engines, capacities, admission, limits, metrics, make_client,
                            discovery)
    _start_routing(replicas, discovery, engines, limits)
    pipeline = _pipeline(settings, limits, tokenizer, (tok_info, decoder, definition), replicas,
                         admission, cache, metrics, policy)
    return ModelPool(limits, tokenizer, infos, admission, replicas, pipeline, policy, discovery)


def _pipeline(settings: PoolSettings, limits: ModelLimits, tokenizer: TokenizerClient,
              parts: tuple[TokenizerInfo, TokenizersDecoder, TokenizerDefinition],
              replicas: ReplicaSet, admission: AdmissionController, cache: CacheClient | None,
              metrics: RouterMetrics, policy: RoutingPolicy) -> GenerationPipeline:
    """The pool's request pipeline: prompt ids made in process (or by the
    tokenizer service), detokenizing with ``parts``' decoder."""
    tok_info, decoder, definition = parts
    observer = metrics.tokenize_observer(limits.model)
    prompts = (PromptTokenizer.start(tokenizer, definition, tok_info, observer=observer)
               if settings.tokenize_in_router else PromptTokenizer(tokenizer, observer=observer))
    return GenerationPipeline(
        tokenizer=prompts, decoder=decoder, replicas=replicas, cache=cache,
        models={limits.model: limits}, metrics=metrics, log_content=settings.log_content,
        admission={limits.model: admission},
        client_write_timeout_s=settings.client_write_timeout_s,
        picker=ReplicaPicker(policy, cache, metrics, settings.routing_weights),
        retrieval=settings.retrieval)


async def _tokenizer_parts(tokenizer: TokenizerClient
                           ) -> tuple[TokenizerInfo, TokenizersDecoder, TokenizerDefinition]:
    """The tokenizer's facts and its definition (``GetTokenizer``), loaded for
    detokenization (on a worker thread). The definition's chat template
    (None: none, or not sent) is the one the service renders with; with
    ``--tokenize-in-router`` the pool's :class:`PromptTokenizer` loads the
    definition again in the background for prompt ids in this process
    (:meth:`PromptTokenizer.start`: the service answers until then, and stays
    the fallback). Raises :class:`UpstreamError`."""
    info, definition = await asyncio.gather(tokenizer.info(), tokenizer.definition())
    return info, await definition.decoder(), definition


async def _first_engines(discovery: Discovery, make_client: Callable[[str], EngineClient],
                         settings: PoolSettings, *, wait_unknown: bool = True
                         ) -> list[EngineClient]:
    """The replicas the pool starts with: every static one (waited for), else
    those addresses of the names that serve first (resolved again every
    resolve interval until ``startup_timeout``).

    Raises:
      UpstreamError: UNAVAILABLE/DEADLINE_EXCEEDED, nothing served in time.
      NoEngineYet: not ``wait_unknown``, no static engine, and the names
        resolve to no address, or none served in time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.startup_timeout
    static = [make_client(target) for target in discovery.static]
    try:
        await asyncio.gather(*(e.wait_until_serving(settings.startup_timeout) for e in static))
        await discovery.resolve_all()
    except BaseException:
        await asyncio.gather(*(e.close() for e in static), return_exceptions=True)
        raise
    if static:
        return static
    names = ", ".join(str(name) for name in discovery.names)
    while True:
        addresses = discovery.wanted()
        if not addresses and not wait_unknown:
            raise NoEngineYet(names, [])
        wait = max(0.1, min(settings.resolve_interval_s, deadline - loop.time()))
        candidates = [make_client(address) for address in addresses]
        results = await asyncio.gather(*(e.wait_until_serving(wait) for e in candidates),
                                       return_exceptions=True)
        serving = [e for e, r in zip(candidates, results, strict=True) if r is None]
        await asyncio.gather(*(e.close() for e in candidates if e not in serving),
                             return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, UpstreamError):
                await asyncio.gather(*(e.close() for e in serving), return_exceptions=True)
                raise result
        if serving:
            return serving
        if loop.time() >= deadline:
            if not wait_unknown:
                raise NoEngineYet(names, addresses)
            raise UpstreamError(
                "engine", names, grpc.StatusCode.UNAVAILABLE,
                f"no address of {names} served within {settings.startup_timeout:g} s "
                f"(last addresses: {addresses or 'none'})")
        if not addresses:
            await asyncio.sleep(wait)
        await discovery.resolve_all()


def admit_replica(limits: ModelLimits, info: ModelInfo) -> str | None:
    """Why a replica that joins later may not serve the pool (None: it may)."""
    if (info.model or limits.model) != limits.model:
        return (f"it serves model {info.model!r}, the pool serves {limits.model!r}; "
                "give it its own pool (--model-pool) or fix its DNS name")
    if info.max_model_len < limits.max_model_len:
        return (f"its max_model_len {info.max_model_len} is below the pool's "
                f"{limits.max_model_len}; start it with --max-model-len "
                f"{limits.max_model_len} or more")
    return None


def model_limits(infos: list[ModelInfo], tok: TokenizerInfo,
                 settings: PoolSettings, chat_template: str | None = None) -> ModelLimits:
    """The model's limits from its replicas' and tokenizer's answers
    (``chat_template``: the tokenizer's, which picks the ``auto`` tool format).

    Raises:
      RuntimeError: the replicas serve different models, or a context window
        below 2 tokens.
    """
    names = {info.model for info in infos}
    if len(names) > 1:
        raise RuntimeError(
            f"engine replicas of one pool serve different models {sorted(names)}; give each "
            "model its own pool (--model-pool TOKENIZER=ENGINE,...) and tokenizer")
    model = infos[0].model or tok.model or "default"
    if tok.model and tok.model != model:
        log.warning("tokenizer_model_differs", engine_model=model, tokenizer_model=tok.model)
    max_model_len = min(info.max_model_len for info in infos)
    if max_model_len < 2:
        raise RuntimeError(f"engines of {model!r} report max_model_len={max_model_len}; "
                           "need >= 2")
    cap = min(settings.max_tokens_cap, max_model_len - 1)
    return ModelLimits(
        model=model, max_model_len=max_model_len,
        vocab_size=infos[0].vocab_size or tok.vocab_size or None,
        has_chat_template=tok.has_chat_template, chat_roles=tok.chat_roles,
        default_max_tokens=min(settings.default_max_tokens, cap), max_tokens_cap=cap,
        eos_token_ids=tuple(sorted({*infos[0].eos_token_ids, *tok.eos_token_ids})),
        tool_call_format=resolve_tool_call_format(settings.tool_call_formats, model,
                                                  chat_template),
        tool_turns=takes_tool_turns(chat_template) and (
            not tok.chat_roles or "tool" in tok.chat_roles))


def _admission(model: str, config: AdmissionConfig,
               capacities: dict[EngineClient, ReplicaCapacity],
               metrics: RouterMetrics) -> AdmissionController:
    """The model's admission controller, sized from its replicas' capacity
    (keyed by client: the pipeline places each ticket on its replica)."""
    observer = metrics.admission_observer(model)
    controller = AdmissionController(config, model, capacities, observer=observer)
    observer.limits({
        "enabled": float(config.enabled),
        "max_queued_requests": config.max_queued_requests,
        "max_queued_prompt_tokens": config.max_queued_prompt_tokens,
        "max_running_requests": controller.max_running,
        "kv_limit_tokens": controller.kv_limit,
        "batch_window_seconds": config.batch_window_s,
        "max_queue_wait_seconds": config.max_queue_wait_s,
    })
    log.info("admission_limits", model=model, enabled=config.enabled,
             max_running=controller.max_running, kv_limit_tokens=controller.kv_limit,
             max_queued_requests=config.max_queued_requests,
             max_queued_prompt_tokens=config.max_queued_prompt_tokens)
    return controller
