"""Typed values inside the engine service.

Protobuf stays at the gRPC edge (:mod:`services.engine.service`); backends, the
request loop and the tests speak in these frozen dataclasses only.
:class:`ModelInfo`, :class:`LoadStats` and :class:`TokenDelta` travel to the
router and are defined once, for both ends, in :mod:`services.common.wire`
(imported here so the engine's modules keep one place to import its types
from).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.sampling import Priority, SamplingOptions, SpeculativeOptions
from services.common.wire.engine_info import LoadStats, ModelInfo
from services.common.wire.engine_stream import TokenDelta, merge_deltas

__all__ = ["BlockCounts", "LoadStats", "ModelInfo", "OffloadStats", "SequenceRequest",
           "StepStats", "TokenDelta", "merge_deltas"]


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate (the protobuf ``llmesh.v1.EngineRequest``,
    converted and checked by the service edge).

    Attributes:
      request_id: unique among the requests in flight on this engine.
      prompt_token_ids: prompt token ids, at least one, each in ``[0, vocab_size)``.
      sampling: validated sampling and stopping options.
      priority: traffic class; INTERACTIVE is scheduled before BATCH.
      speculative: the request's speculative decoding switch (engine defaults
        where unset).
      tenant: whose request it is ("" for none).
      cache_scope: the request's cache scope (:mod:`services.common.cache_scope`;
        "" the shared one): its prefix-cache blocks are hashed in it (only
        requests of one scope reuse each other's KV), and what the engine
        learns from outputs (the suffix cache) stays in it where so configured.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    priority: Priority = Priority.INTERACTIVE
    speculative: SpeculativeOptions = SpeculativeOptions()
    tenant: str = ""
    cache_scope: str = ""


@dataclass(frozen=True)
class BlockCounts:
    """How many KV blocks are in each state (``free + cached + used == total``;
    a leak shows as ``used > 0`` when the engine is idle)."""

    free: int
    cached: int
    used: int
    total: int


@dataclass(frozen=True)
class OffloadStats:
    """What the KV offload tier did since its stats were last taken (counts in
    blocks; see :mod:`~services.engine.torch_backend.kv_offload`).

    Attributes:
      queries: prompt blocks looked up there (full blocks the pool missed).
      hits: of those, blocks found there (each then restored).
      stored: blocks copied in from the pool (evictions).
      restored: blocks copied back into the pool.
      evicted: blocks dropped by the tier's LRU.
      restore_seconds: seconds of each restore (one sequence's blocks at once).
      num_bytes: bytes held when taken (not a delta).
    """

    queries: int = 0
    hits: int = 0
    stored: int = 0
    restored: int = 0
    evicted: int = 0
    restore_seconds: tuple[float, ...] = ()
    num_bytes: int = 0


@dataclass(frozen=True)
class EngineResources:
    """What the engine runs on, known once it has started (before any step).

    Attributes:
      num_threads: compute threads its next step runs on: the thread
        governor's count (its ceiling, ``--num-threads`` or torch's default,
        under any cgroup CPU quota), or ``--num-threads`` / torch's default
        with ``--no-adaptive-threads``; 0 when the backend does not say.
      kv_offload_capacity_bytes: the KV offload tier's capacity in bytes (0: no tier).
    """

    num_threads: int = 0
    kv_offload_capacity_bytes: int = 0


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one engine step did (passed to the step observer, e.g. metrics).

    Attributes:
      duration_s: wall time of the step (schedule, forward, sample, update).
      num_scheduled_tokens: tokens computed.
      batch_size: sequences that computed tokens.
      num_preemptions: sequences preempted to make room.
      prefix_queries: prompt tokens looked up in the prefix cache.
      prefix_hits: of those, tokens found computed.
      spec_num_drafts: sequences whose speculative tokens were verified.
      spec_num_draft_tokens: speculative tokens verified.
      spec_num_accepted_tokens: of those, accepted.
      spec_accepted_per_pos: accepted tokens by position in the proposal (0-based).
      num_prompt_tokens_computed: prompt tokens whose keys/values the step
        computed (prefix-cache hits and prompts shared by ``sampling.n``
        choices not counted; recomputed ones after a preemption counted).
      num_prompt_tokens_deferred: prompt tokens of lower priorities the step
        held back for a higher-priority decode or prompt beside them
        (``SchedulerOutput.deferred_prompt_tokens``).
      suffix_cache_tokens, suffix_cache_bytes: after the step, the suffix
        decoding cache's tokens and estimated bytes (0 without one).
      offload: the KV offload tier's stats since the previous step (None without one).
      num_threads: compute threads the next step runs on (the thread
        governor's count; 0: not governed).
      cpu_throttled_s: seconds the cgroup's CPU quota held the engine back
        since the previous step's stats.
      contention_events: times the engine dropped a thread for CPU contention
        since the previous step's stats.
    """

    duration_s: float
    num_scheduled_tokens: int
    batch_size: int
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_deferred: int = 0
    suffix_cache_tokens: int = 0
    suffix_cache_bytes: int = 0
    offload: OffloadStats | None = None
    num_threads: int = 0
    cpu_throttled_s: float = 0.0
    contention_events: int = 0
