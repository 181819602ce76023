"""The state of one request inside the torch engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.kv_events import BlockHash
from services.common.logprobs import PositionLogprobs
from services.common.sampling import FinishReason, InvalidRequestError, SpeculativeMethod
from services.engine.backend import DeltaSink
from services.engine.torch_backend.grammar_mask import GrammarMatcher
from services.engine.torch_backend.logits_processors import LogitsProcessorState
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.types import SequenceRequest, TokenDelta


@dataclass(eq=False)
class ChoiceGroup:
    """The ``sampling.n`` choices of one request (n > 1), as vLLM's parallel sampling.

    Choice 0 (the leader) is scheduled alone and prefills the prompt; the step
    that computes its last prompt token samples every choice's first token
    from that one row of logits, each with the choice's own generator, and
    :meth:`Scheduler.update_from_output` then *forks* the others: they join the
    running batch sharing the leader's prompt KV blocks (see
    :meth:`KVCacheManager.fork`). From then on every choice is an ordinary
    sequence that finishes on its own.

    Attributes:
      choices: all n sequences, by index (``choices[0]`` is the leader).
      pending: choices not forked yet (owned by the leader, in no queue); they
        finish with the leader if it finishes before forking (cancel, error).
      cancelled_choices: indexes of choices cancelled on their own before the
        fork (applied at the fork).
    """

    choices: list[Sequence] = field(default_factory=list)
    pending: list[Sequence] = field(default_factory=list)
    cancelled_choices: set[int] = field(default_factory=set)


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's tokens, progress and delivery channel.

    Owned by the engine thread once the engine core took it in (the
    scheduler and the KV cache manager write it); before that by the
    :class:`~services.engine.torch_backend.inbox.Inbox`, which finishes it
    CANCELLED itself when it is cancelled while still pending.

    Attributes:
      request: the request as admitted.
      arrival: admission counter, unique per engine: FIFO order within a
        priority, and the key of its KV block table and proposer state (its
        request id may come back, as a new sequence, once it is cancelled).
      sampling: the sampler's view of its parameters (holds its generator).
      sink: where its deltas are delivered (on ``sink.loop``; None in unit tests).
      token_ids: prompt followed by generated tokens.
      num_computed_tokens: leading tokens whose keys/values are in its KV blocks
        (prefix-cache hits included); the scheduler catches it up to ``num_tokens``.
      num_cached_tokens: prompt tokens found in the prefix cache when it was
        first scheduled (-1 until then).
      block_hashes: chained hashes of its full blocks, written by the KV cache manager.
      status: waiting, running or finished.
      num_preemptions: times its blocks were taken back for others.
      cancelled: set at the engine's intake of its cancel; it finishes with
        CANCELLED at the next step boundary (or layer, see ``engine_core``).
      finish_reason: NONE until it finished.
      spec_method: its speculative proposer (the request's choice or the
        engine's default; NONE: no speculation).
      num_spec_tokens: most tokens proposed for it per step.
      spec_token_ids: proposals for its next step (lookahead tokens, not yet
        verified; never part of ``token_ids``). Written after a step by the
        engine core, consumed by the next :meth:`Scheduler.schedule`.
      grammar: its structured-output matcher (None: unconstrained); advanced
        by the scheduler with each committed token.
      processors: its logits processors and their output-token counts (None
        when it uses no penalty, logit bias or min_tokens); fed by
        :meth:`append_token`.
      priority_key: (priority, arrival), the scheduling order.
      num_undelivered: generated tokens not delivered yet (the newest of
        ``token_ids``): counted by :meth:`append_token` (and a fork's first
        token), taken by the next :meth:`delta`.
      pending_logprobs: with ``sampling.logprobs``: the entries of the
        generated tokens not yet delivered (one per token, in order); the
        next :meth:`delta` takes them.
      prompt_logprobs: with ``sampling.prompt_logprobs``: entry ``i`` for the
        prompt token at position ``i + 1`` (see
        :mod:`~services.engine.torch_backend.logprobs`); delivered once, on
        the first delta after they are complete.
      prompt_logprobs_sent: they were delivered.
      index: its choice among the request's ``sampling.n`` (0..n-1).
      group: the request's choices when ``sampling.n`` > 1 (shared by all of
        them), None otherwise.
      scheduled_at: when it was first scheduled (``time.monotonic()`` seconds;
        0.0 while waiting), delivered on its deltas (``TokenDelta.scheduled_at``).
      refusal: why the request failed for a reason of its own, not the
        engine's (its constraint failed mid-generation), as the field-named
        error its last delta carries (``TokenDelta.error_status``); None
        otherwise.
    """

    request: SequenceRequest
    arrival: int
    sampling: SamplingRow = field(default_factory=SamplingRow)
    sink: DeltaSink | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    cancelled: bool = False
    finish_reason: FinishReason = FinishReason.NONE
    spec_method: SpeculativeMethod = SpeculativeMethod.NONE
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None
    processors: LogitsProcessorState | None = None
    priority_key: tuple[int, int] = field(init=False, repr=False)
    num_undelivered: int = 0
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list, repr=False)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list, repr=False)
    prompt_logprobs_sent: bool = False
    index: int = 0
    group: ChoiceGroup | None = field(default=None, repr=False)
    refusal: InvalidRequestError | None = None
    scheduled_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
        self.priority_key = (int(self.request.priority), self.arrival)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        """Its traffic class (:class:`~services.common.sampling.Priority`; lower first)."""
        return self.priority_key[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.NONE

    def append_token(self, token_id: int) -> None:
        """Appends a generated (verified) token; its processors count it."""
        self.token_ids.append(token_id)
        self.num_undelivered += 1
        if self.processors is not None:
            self.processors.append(token_id)

    @property
    def choices(self) -> list[Sequence]:
        """Every choice of its request (itself alone when n is 1)."""
        return [self] if self.group is None else self.group.choices

    @property
    def all_choices_finished(self) -> bool:
        """True when every choice of its request finished."""
        return all(choice.finished for choice in self.choices)

    def __lt__(self, other: Sequence) -> bool:
        """Scheduling order: priority (INTERACTIVE first), then arrival."""
        return self.priority_key < other.priority_key

    def delta(self, error: str = "") -> TokenDelta:
        """The delta announcing its tokens not delivered yet (the newest
        ``num_undelivered``; none after a cancel) and the finish reason, if
        finished, with the pending log-probabilities and, once complete and
        not yet sent, the prompt's. Mutates (takes those); only the thread that
        owns the sequence builds its deltas."""
        new, self.num_undelivered = self.num_undelivered, 0
        token_ids = tuple(self.token_ids[len(self.token_ids) - new:]) if new else ()
        logprobs, self.pending_logprobs = tuple(self.pending_logprobs), []
        prompt_logprobs: tuple[PositionLogprobs, ...] = ()
        if (self.request.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) >= self.num_prompt_tokens - 1):
            prompt_logprobs, self.prompt_logprobs_sent = tuple(self.prompt_logprobs), True
            self.prompt_logprobs = []
        return TokenDelta(
            request_id=self.request.request_id,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_generated_tokens=len(self.token_ids) - len(self.request.prompt_token_ids),
            num_cached_tokens=max(self.num_cached_tokens, 0),
            error=str(self.refusal) if self.refusal is not None and self.finished else error,
            error_status=(self.refusal.code.name
                          if self.refusal is not None and self.finished else ""),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            index=self.index,
            scheduled_at=self.scheduled_at,
        )
