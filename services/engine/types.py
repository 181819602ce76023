"""Typed values inside the engine service.

Protobuf stays at the gRPC edge (:mod:`services.engine.service`); backends, the
request loop and the tests speak in these frozen dataclasses only.
:class:`ModelInfo` and :class:`LoadStats` travel to the router and are defined
once, for both ends, in :mod:`services.common.wire.engine_info` (imported
here so the engine's modules keep one place to import its types from).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc

from services.common.logprobs import PositionLogprobs
from services.common.sampling import FinishReason, Priority, SamplingOptions, SpeculativeOptions
from services.common.wire.engine_info import LoadStats, ModelInfo

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
class TokenDelta:
    """Token ids a sequence produced since its previous delta.

    The last delta of a sequence has ``finish_reason != FinishReason.NONE``;
    every delta carries the running token counts.

    Attributes:
      request_id: the request this delta belongs to.
      token_ids: new token ids (may be empty on the last delta, e.g. after a cancel).
        A final stop token (EOS or a stop token id) is included; the router
        does not render its text.
      finish_reason: ``FinishReason.NONE`` until the last delta.
      num_prompt_tokens: tokens in the prompt.
      num_generated_tokens: tokens generated so far, including a final stop token.
      num_cached_tokens: prompt tokens whose KV cache was reused.
      error: why the engine failed the request (only with ``FinishReason.ERROR``).
      logprobs: with ``sampling.logprobs``: one entry per id in ``token_ids``.
      prompt_logprobs: with ``sampling.prompt_logprobs``: one entry per prompt
        token after the first, on the first delta of choice 0 only.
      error_status: with ``FinishReason.ERROR``: the gRPC status name the
        request ends with when the failure is the request's own (e.g.
        ``INVALID_ARGUMENT``: its output constraint failed mid-generation);
        "" means INTERNAL (the engine failed).
      index: the choice (0..n-1) of a request with ``sampling.n`` > 1; each
        choice ends with its own last delta, and the token counts are its own
        (``num_generated_tokens`` of that choice).
      scheduled_at: when the sequence was first scheduled (``time.monotonic()``
        seconds; 0.0 before, or from a backend that does not say): the end of
        its engine queue time and the start of its prefill (its trace spans).
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0
    error: str = ""
    error_status: str = ""
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    index: int = 0
    scheduled_at: float = 0.0

    @property
    def finished(self) -> bool:
        """True on the last delta of a sequence."""
        return self.finish_reason is not FinishReason.NONE

    @property
    def error_code(self) -> grpc.StatusCode:
        """The status a failed (``FinishReason.ERROR``) request ends with:
        ``error_status``'s, INTERNAL when that is empty."""
        return grpc.StatusCode[self.error_status] if self.error_status else \
            grpc.StatusCode.INTERNAL


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
    suffix_cache_tokens: int = 0
    suffix_cache_bytes: int = 0
    offload: OffloadStats | None = None
    num_threads: int = 0
    cpu_throttled_s: float = 0.0
    contention_events: int = 0


def merge_deltas(first: TokenDelta, second: TokenDelta) -> TokenDelta:
    """One delta carrying ``first``'s then ``second``'s tokens (and their
    log-probabilities, and the prompt's from whichever carries them), with
    ``second``'s counts and finish reason (same request and choice)."""
    return replace(second, token_ids=first.token_ids + second.token_ids,
                   logprobs=first.logprobs + second.logprobs,
                   prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)
