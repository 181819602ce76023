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
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    NoReplicaServing,
    ReplicaCapacity,
)
from services.router.clients import CacheClient, ReplicaInfo, TokenizerClient, TokenizerInfo
from services.router.engine_client import EngineClient
from services.router.generation import GenerationPipeline
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet
from services.router.routing import (
    CostWeights,
    ReplicaPicker,
    RoutingPolicy,
    duplicate_replica_ids,
)
from services.router.validation import ModelLimits

log = structlog.get_logger()


@dataclass(frozen=True)
class PoolConfig:
    """Where one model is served.

    Attributes:
      tokenizer: ``host:port`` of the model's tokenizer service.
      engines: ``host:port`` of each of its engine replicas (at least one).
    """

    tokenizer: str
    engines: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> PoolConfig:
        """``TOKENIZER=ENGINE[,ENGINE...]`` (the ``--model-pool`` flag's form).

        Raises:
          ValueError: no ``=``, an empty tokenizer or no engine address.
        """
        tokenizer, sep, engines = text.partition("=")
        addresses = tuple(e.strip() for e in engines.split(",") if e.strip())
        if not sep or not tokenizer.strip() or not addresses:
            raise ValueError(f"--model-pool {text!r}: expected TOKENIZER_HOST:PORT="
                             "ENGINE_HOST:PORT[,ENGINE_HOST:PORT...]")
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
                 engines: list[EngineClient], infos: list[ReplicaInfo],
                 admission: AdmissionController, replicas: ReplicaSet,
                 pipeline: GenerationPipeline, policy: RoutingPolicy) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.engines = engines
        self.infos = infos
        self.admission = admission
        self.replicas = replicas
        self.pipeline = pipeline
        self.policy = policy

    @property
    def model(self) -> str:
        return self.limits.model

    async def close(self) -> None:
        """Stops the replica set and the pipeline, then closes the channels."""
        await self.replicas.close()
        await self.pipeline.close()
        await asyncio.gather(self.tokenizer.close(), *(e.close() for e in self.engines),
                             return_exceptions=True)


async def open_pool(config: PoolConfig, settings: PoolSettings, cache: CacheClient | None,
                    metrics: RouterMetrics) -> ModelPool:
    """Connects to the pool's tokenizer and engines, waits for them to serve and
    builds its parts. On failure the clients opened here are closed.

    Raises:
      UpstreamError: the tokenizer or an engine did not serve within
        ``settings.startup_timeout`` seconds.
      RuntimeError: the replicas serve different models, or report a context
        window below 2 tokens.
    """
    tokenizer = TokenizerClient(config.tokenizer)
    engines = [EngineClient(target) for target in config.engines]
    try:
        await asyncio.gather(
            tokenizer.wait_until_serving(settings.startup_timeout),
            *(engine.wait_until_serving(settings.startup_timeout) for engine in engines))
        infos = list(await asyncio.gather(*(engine.model_info() for engine in engines)))
        tok_info, decoder = await asyncio.gather(tokenizer.info(), tokenizer.decoder())
        limits = model_limits(infos, tok_info, settings)
    except BaseException:
        await asyncio.gather(tokenizer.close(), *(e.close() for e in engines),
                             return_exceptions=True)
        raise
    capacities = [ReplicaCapacity(i.max_num_seqs, i.kv_capacity_tokens) for i in infos]
    admission = _admission(limits.model, settings.admission, capacities, metrics)

    def replicas_changed(capacities: list[ReplicaCapacity]) -> None:
        """Admission's concurrency cap follows the replicas in routing; when none
        is left, the queued requests end UNAVAILABLE (nothing would serve them)."""
        admission.set_replicas(capacities)
        if not capacities:
            failed = admission.fail_queued(NoReplicaServing(
                f"no engine replica is serving model {limits.model!r} (of {len(engines)} "
                "configured, each failed or is draining) while the request waited in the "
                "router's queue; retry in a few seconds"))
            if failed:
                log.warning("queued_requests_failed", model=limits.model, requests=failed,
                            why="no engine replica is serving")

    replicas = ReplicaSet(engines, capacities, on_change=replicas_changed, metrics=metrics)
    replicas.start()
    policy = settings.routing_policy or (
        RoutingPolicy.KV_AWARE if len(engines) > 1 else RoutingPolicy.LEAST_LOAD)
    if policy is RoutingPolicy.KV_AWARE:  # the only policy that reads engine load
        for engine in engines:
            engine.load_watch.start()
    if shared := duplicate_replica_ids(engines):
        log.warning("engine_replica_ids_not_unique", model=limits.model,
                    replica_ids=sorted(shared),
                    effect="their prefix-index matches are ignored; give each engine "
                           "its own --replica-id")
    pipeline = GenerationPipeline(
        tokenizer=tokenizer, decoder=decoder, replicas=replicas, cache=cache,
        models={limits.model: limits}, metrics=metrics, log_content=settings.log_content,
        admission={limits.model: admission},
        picker=ReplicaPicker(policy, cache, metrics, settings.routing_weights))
    return ModelPool(limits, tokenizer, engines, infos, admission, replicas, pipeline, policy)


def model_limits(infos: list[ReplicaInfo], tok: TokenizerInfo,
                 settings: PoolSettings) -> ModelLimits:
    """The model's limits from its replicas' and tokenizer's answers.

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
        eos_token_ids=tuple(sorted({*infos[0].eos_token_ids, *tok.eos_token_ids})))


def _admission(model: str, config: AdmissionConfig, capacities: list[ReplicaCapacity],
               metrics: RouterMetrics) -> AdmissionController:
    """The model's admission controller, sized from its replicas' capacity."""
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
