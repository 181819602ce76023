"""The scheduler: waiting and running queues, the per-step token budget, preemption.

Two verbs, as in vLLM v1: :meth:`Scheduler.schedule` decides what the next
model step computes, and :meth:`Scheduler.update_from_output` books what it
produced. There are no prefill and decode phases: every sequence catches its
``num_computed_tokens`` up to its ``num_tokens`` under the step's token budget,
so a long prompt is computed in chunks while the other sequences keep
decoding, and a prefix-cache hit simply starts a sequence further along.

Policy:

* Order is priority (INTERACTIVE before BATCH), then arrival. A step plans,
  in this order: the running sequences' decodes (one token each, plus
  proposals); the prompt chunks of running sequences that outrank the first
  waiting sequence by priority; waiting sequences joining in order while the
  budget, ``max_num_seqs`` and free blocks allow; the other running prompt
  chunks with what budget is left. The head of the waiting queue is never
  overtaken (no starvation of long prompts). So a long prompt's chunked
  prefill never holds up a decode, nor an arrival of its class or a higher
  one: a short request arriving during an 8,000-token prefill joins at the
  next step and decodes beside the remaining chunks.
* Prompt chunks of a lower priority are bounded by what outranks them in the
  step (:class:`~services.engine.torch_backend.step_budget.StepBudget`):
  beside a higher-priority decode they share the few tokens that keep the
  step within ``outranked_prefill_slowdown`` (2) times its decode-only time
  by the engine's measured step profile (``step_profile``), at least
  ``MIN_OUTRANKED_PREFILL_TOKENS`` a step, so a BATCH prefill does not
  stretch an INTERACTIVE stream's inter-token latency yet always progresses;
  the running prompt chunks planned after the waiting joins get nothing when
  a prompt chunk of a higher priority is in the step (an INTERACTIVE prompt's
  step carries no BATCH prefill: its TTFT). Equal priorities share the
  budget as above; a step without a higher priority gives the whole budget.
  The tokens held back are ``SchedulerOutput.deferred_prompt_tokens``.
* Preemption for priority: when every sequence slot is taken and a waiting
  sequence outranks the last running one by priority (an INTERACTIVE arrival
  while BATCH sequences fill ``max_num_seqs``), that running sequence (lowest
  priority, latest arrival) is preempted before the step is planned, and the
  waiting one joins in the same step. Nothing is preempted for a sequence of
  equal priority (arrival order alone never preempts).
* Preemption for blocks: when a running sequence needs a block and none is
  free, the last running sequence in order not yet planned in this step
  (possibly itself) is preempted. No sequence joins in a step that preempted for blocks.
* A preempted sequence's blocks are freed, its full ones staying in the
  prefix cache (evicted only when blocks run short), and it goes back to the
  waiting queue with its tokens, to be recomputed (mostly from the prefix
  cache) when it is next in order. Its output is the one of an uninterrupted
  run: the kernels are batch-invariant and its sampler draws once per token
  from its own generator.
* A cancelled running sequence leaves at the next step boundary (or sooner:
  the engine core ends the sequences of a step it abandoned because all of
  them were cancelled, with :meth:`Scheduler.finish`); a cancelled waiting one
  leaves the queue at once (:meth:`Scheduler.abort`).
* A sequence that still collects its prompt log-probabilities
  (``sampling.prompt_logprobs``) takes no prefix-cache hit: its prompt is
  computed in full, for the logits of every position (it still stores its
  blocks for others).
* Speculative decoding is bookkeeping (vLLM v1): a decoding sequence's
  proposals (``seq.spec_token_ids``) are lookahead tokens computed with its
  last token in the same step (``1 + k`` tokens of the budget, KV slots
  reserved for all of them); :meth:`Scheduler.update_from_output` appends the
  accepted ones and the target's next token and sets ``num_computed_tokens``
  to the verified tokens only, so rejected tokens' slots are overwritten
  later. Blocks reserved beyond the new length stay in the sequence's table
  (reused by its next steps, freed with it); only blocks full of verified
  tokens are ever hashed into the prefix cache. Proposals are dropped (never
  another sequence preempted) when the budget or the blocks are short.

* Parallel sampling (``sampling.n`` > 1, vLLM's ``n``): only choice 0 of a
  request is queued and scheduled; it prefills the prompt once. The step that
  computes its last prompt token yields one sampled token per choice (the
  engine core samples that row of logits once per choice, each with the
  choice's own generator), and :meth:`Scheduler.update_from_output` forks
  the other choices (:class:`~services.engine.torch_backend.sequence.ChoiceGroup`):
  each joins the running batch with the prompt computed, sharing its full
  KV blocks and with its own copy of the partial last one
  (:meth:`KVCacheManager.fork`; the copy is in ``SchedulerOutput.block_copies``,
  made before the next forward). A choice that finds no sequence slot or no
  free block for its copy joins the waiting queue instead, to be computed
  like a preempted sequence (its full prompt blocks hit the prefix cache).
  From then on each choice is an ordinary sequence: it finishes, is
  preempted and recomputed on its own.

Not thread-safe: only the engine core's worker thread calls it (under its state lock).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from services.common.sampling import FinishReason, InvalidRequestError
from services.common.step_profile import StepProfile
from services.engine.torch_backend.block_pool import OutOfBlocksError
from services.engine.torch_backend.kv_cache_manager import NO_HIT, BlockCopy, KVCacheManager
from services.engine.torch_backend.logprobs import collects_prompt_logprobs
from services.engine.torch_backend.sequence import Sequence, SequenceStatus
from services.engine.torch_backend.step_budget import StepBudget, outranked_prefill_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the scheduler.

    Attributes:
      max_model_len: context window; a sequence reaching it finishes with LENGTH.
      max_num_seqs: most sequences in the running batch.
      max_num_batched_tokens: most tokens computed in one step (all sequences).
      max_chunk_tokens: most tokens one sequence computes in one step (None: the
        whole budget).
      eos_token_ids: ids that finish a sequence with STOP unless it ignores EOS.
      outranked_prefill_slowdown: in a step that carries a higher-priority
        decode, lower-priority prompt chunks share the tokens that keep the
        step within this many times its decode-only time by the engine's step
        profile (:func:`~services.engine.torch_backend.step_budget.outranked_prefill_tokens`,
        at least ``MIN_OUTRANKED_PREFILL_TOKENS``); None: no such limit (they
        take what budget is left).
    """

    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_chunk_tokens: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    outranked_prefill_slowdown: float | None = 2.0

    def __post_init__(self) -> None:
        slowdown = self.outranked_prefill_slowdown
        if slowdown is not None and not slowdown >= 1.0:
            raise ValueError(f"outranked_prefill_slowdown must be >= 1, got {slowdown}")


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
      seq: the sequence.
      start: its computed tokens before the step (position of its first new token).
      num_tokens: tokens it computes in the step.
      samples: True when the step computes its last token, so the step samples
        its next token.
      spec_token_ids: speculative tokens computed after its last token (the
        last ``len(spec_token_ids)`` of ``num_tokens``); the step scores them.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_logits(self) -> int:
        """Logit rows it needs: its last token's and one per speculative token."""
        return 1 + len(self.spec_token_ids)

    @property
    def forks(self) -> tuple[Sequence, ...]:
        """The choices forked from it after this step (its request's unforked
        choices when the step samples its first token); each needs a sampled
        token of its own from this sequence's last logits row."""
        group = self.seq.group
        if not self.samples or group is None or not group.pending:
            return ()
        return tuple(group.pending)


@dataclass
class SchedulerOutput:
    """What one step computes, and what the scheduler did to get there.

    Attributes:
      scheduled: sequences with tokens to compute, running ones first, in
        scheduling order.
      num_scheduled_tokens: sum of their ``num_tokens``.
      preempted: sequences sent back to the waiting queue in this step.
      finished: sequences that left at this boundary without computing
        (cancelled while running); deliver their last delta.
      prefix_queries: prompt tokens looked up in the prefix cache.
      prefix_hits: of those, tokens found computed in the pool (blocks restored
        from the offload tier are counted by the tier).
      block_copies: KV blocks to copy before the next forward (forked choices'
        partial blocks), written by :meth:`Scheduler.update_from_output`.
      deferred_prompt_tokens: prompt tokens held back by priority in this step
        (:class:`~services.engine.torch_backend.step_budget.StepBudget`).
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    block_copies: list[BlockCopy] = field(default_factory=list)
    deferred_prompt_tokens: int = 0


class Scheduler:
    """Owns the waiting queue and the running batch of the sequences the engine
    core hands it (from :meth:`add` until they finish). Sequences are told
    apart by identity, never by request id: a cancelled request's id may come
    back (a new sequence) while the old sequence still runs to its next step.

    Args:
      config: limits.
      kv: the KV cache manager (block tables); the scheduler allocates and frees
        through it.

    Attributes:
      step_profile: the engine's measured step costs, which size the prompt
        chunks of lower priorities beside a higher-priority decode; the
        engine core refreshes it (priors until then).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self._waiting: list[Sequence] = []  # heap by (priority, arrival)
        self.running: list[Sequence] = []  # sorted by (priority, arrival)
        self.num_preemptions = 0  # for blocks and for priority
        self.num_priority_preemptions = 0
        self.step_profile = StepProfile()

    # ---- queries (pure) -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """True while a sequence waits or runs."""
        return bool(self._waiting or self.running)

    def waiting(self) -> list[Sequence]:
        """The waiting sequences in the order they would join."""
        return sorted(self._waiting)

    def pending_prefill_tokens(self) -> int:
        """Tokens still to compute before the waiting sequences and the running
        ones in prefill produce their next token (prefix hits of waiting ones
        not yet known: counted as work). O(waiting + running)."""
        pending = sum(seq.num_tokens - seq.num_computed_tokens for seq in self._waiting)
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1:
                pending += left
        return pending

    # ---- verbs (mutate) ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, seq)

    def abort(self, seq: Sequence) -> bool:
        """Cancels ``seq``: a waiting one leaves the queue now (finished,
        CANCELLED); a running one is flagged and leaves at the next
        :meth:`schedule`.

        Returns:
          True if it was waiting and is finished now.
        """
        seq.cancelled = True
        if seq.status is not SequenceStatus.WAITING:
            return False
        self._waiting.remove(seq)
        heapq.heapify(self._waiting)
        self.kv.free(seq)  # a waiting sequence holds no blocks; keep it leak-proof anyway
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.CANCELLED
        return True

    def abort_request(self, seq: Sequence) -> list[Sequence]:
        """Cancels every unfinished choice of ``seq``'s request (see :meth:`abort`;
        unforked choices finish with choice 0). Returns those finished now."""
        pending = () if seq.group is None else seq.group.pending
        return [choice for choice in seq.choices
                if not choice.finished and choice not in pending and self.abort(choice)]

    def abort_choice(self, seq: Sequence, index: int) -> list[Sequence]:
        """Cancels choice ``index`` of ``seq``'s request alone (the others go
        on); before the fork it is noted and applied at the fork. Returns the
        sequences finished now."""
        group = seq.group
        if group is None:
            return [seq] if index == 0 and self.abort(seq) else []
        if not 0 <= index < len(group.choices) or group.choices[index].finished:
            return []
        if group.pending:  # not forked yet: choice 0 still prefills for the others
            group.cancelled_choices.add(index)
            return []
        choice = group.choices[index]
        return [choice] if self.abort(choice) else []

    def schedule(self) -> SchedulerOutput:
        """Plans the next step (see the module docstring for the policy); allocates
        the blocks its tokens need."""
        out = SchedulerOutput()
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, FinishReason.CANCELLED)
            out.finished.append(seq)
        self._preempt_for_priority(out)
        num_preempted_for_priority = len(out.preempted)
        decodes, early_chunks, late_chunks = self._split_running()
        planned: set[Sequence] = set()
        budget = StepBudget(self.config.max_num_batched_tokens)
        self._schedule_running(out, budget, decodes, planned)
        self._limit_outranked_prefill(out, budget)
        self._schedule_running(out, budget, early_chunks, planned)
        if len(out.preempted) == num_preempted_for_priority:  # none for blocks
            self._schedule_waiting(out, budget, planned)
        self._limit_below_prompts(budget, planned)
        self._schedule_running(out, budget, late_chunks, planned)
        out.deferred_prompt_tokens = budget.deferred_tokens
        return out

    def _limit_outranked_prefill(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """After the decodes are planned (``out.scheduled`` holds them alone):
        prompt chunks ranked below the best of them share the tokens that keep
        the step within ``outranked_prefill_slowdown`` times its decode-only
        time (:mod:`~services.engine.torch_backend.step_budget`), so a BATCH
        prefill does not stretch an INTERACTIVE sequence's inter-token latency."""
        slowdown = self.config.outranked_prefill_slowdown
        if slowdown is None or not out.scheduled:
            return
        top = min(item.seq.priority for item in out.scheduled)
        budget.limit(top, outranked_prefill_tokens(self.step_profile,
                                                   out.num_scheduled_tokens, slowdown))

    @staticmethod
    def _limit_below_prompts(budget: StepBudget, planned: set[Sequence]) -> None:
        """Before the late prompt chunks: none of a lower priority than a prompt
        chunk already planned, so that an INTERACTIVE prompt's step is not
        lengthened by BATCH prefill (its TTFT would pay for those tokens; on
        CPU a step's time grows with its tokens). They go on in the next step."""
        top = min((seq.priority for seq in planned
                   if seq.num_tokens - seq.num_computed_tokens > 1), default=None)
        if top is not None:
            budget.limit(top, 0)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: SequenceOf[int | SequenceOf[int]]) -> list[Sequence]:
        """Books a computed step: appends each sampling sequence's new tokens (up
        to the first stop among them), moves ``num_computed_tokens`` to its
        verified tokens (back over rejected speculative ones), registers its
        newly full blocks in the prefix cache, and finishes (and frees) the
        sequences that stopped or were cancelled meanwhile.

        Args:
          out: the step's plan from :meth:`schedule`.
          sampled: per scheduled sequence with ``samples``, in order: its next
            token, or (speculative steps) its accepted speculative tokens
            followed by the target's own next token (1 to ``1 + k`` ids, the
            first ``len - 1`` equal to its leading ``spec_token_ids``).

        Returns:
          the sequences that produced a token or finished, in order: each
          holds its new tokens (up to a stop, all verified) as its newest
          ``num_undelivered`` ids, which its next :meth:`Sequence.delta` takes.
        """
        updates: list[Sequence] = []
        next_sample = 0
        for item in out.scheduled:
            seq = item.seq
            seq.spec_token_ids.clear()  # consumed; the loop proposes anew after the step
            if not item.samples:
                seq.num_computed_tokens = item.start + item.num_tokens
                self.kv.cache_computed_blocks(seq)
                if seq.cancelled:
                    self._finish(seq, FinishReason.CANCELLED)
                    updates.append(seq)
                continue
            entry = sampled[next_sample]
            next_sample += 1
            forks = item.forks
            fork_entries = sampled[next_sample:next_sample + len(forks)]
            next_sample += len(forks)
            verified = item.start + item.num_tokens - len(item.spec_token_ids)
            if seq.cancelled:
                seq.num_computed_tokens = verified
                self.kv.cache_computed_blocks(seq)
                self._finish(seq, FinishReason.CANCELLED)
                updates.append(seq)
                continue
            tokens = (entry,) if isinstance(entry, int) else tuple(entry)
            if forks:
                forked = self._fork(seq, verified, fork_entries, out)
                if seq.group is not None and 0 in seq.group.cancelled_choices:
                    self._finish(seq, FinishReason.CANCELLED)
                    updates.append(seq)
                    updates.extend(forked)
                    continue
            else:
                forked = []
            self._book_tokens(seq, tokens, verified)
            updates.append(seq)
            updates.extend(forked)
        return updates

    def _book_tokens(self, seq: Sequence, tokens: tuple[int, ...],
                     verified: int) -> None:
        """Appends ``tokens`` to ``seq`` up to the first that stops it, moves
        its ``num_computed_tokens`` to ``verified`` plus the speculative ones
        accepted, caches its full blocks and finishes it if it stopped."""
        reason = FinishReason.NONE
        emitted = 0
        for token in tokens:
            seq.append_token(token)
            emitted += 1
            reason = self._stop_reason(seq, token)
            if reason is not FinishReason.NONE:
                break
        # Every emitted token but the last was a speculative input of this step.
        seq.num_computed_tokens = verified + emitted - 1
        self.kv.cache_computed_blocks(seq)
        if reason is not FinishReason.NONE:
            self._finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finishes ``seq`` now with ``reason`` (e.g. ERROR after a failed step),
        waiting or running; frees its blocks without caching them."""
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
            heapq.heapify(self._waiting)
        self._finish(seq, reason)

    def finish_all(self, reason: FinishReason) -> list[Sequence]:
        """Finishes every waiting and running sequence with ``reason`` (shutdown,
        or a failed step); returns them."""
        left = list(self.running) + sorted(self._waiting)
        for seq in list(self.running):
            self._finish(seq, reason)
        for seq in self._waiting:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        self._waiting.clear()
        return left

    # ---- internals ------------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int) -> int:
        wanted = seq.num_tokens - seq.num_computed_tokens
        if wanted == 1 and seq.spec_token_ids:  # a decode and its lookahead tokens
            return min(1 + len(seq.spec_token_ids), budget)
        cap = self.config.max_chunk_tokens
        return min(wanted, budget) if cap is None else min(wanted, budget, cap)

    def _split_running(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """The running sequences in the order their tokens are planned: decodes;
        prompt chunks that outrank the first waiting sequence by priority; the
        other prompt chunks (after the waiting ones join). Each list in
        scheduling order."""
        head = self._waiting[0] if self._waiting else None
        decodes: list[Sequence] = []
        early: list[Sequence] = []
        late: list[Sequence] = []
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                decodes.append(seq)
            elif head is None or seq.priority < head.priority:
                early.append(seq)
            else:
                late.append(seq)
        return decodes, early, late

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget, seqs: list[Sequence],
                          planned: set[Sequence]) -> None:
        """Plans ``seqs`` (running, in order) while budget is left, each within
        its priority's allowance. One that needs a block when none is free
        preempts the last running sequence not planned in this step (possibly
        itself)."""
        for seq in seqs:
            if budget.tokens <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted in this step
                continue
            wanted = self._chunk(seq, budget.tokens)
            num_new = self._chunk(seq, budget.allowance(seq.priority))
            if num_new <= 0:  # outranked in this step: next step
                budget.take(seq.priority, 0, wanted)
                continue
            decoding = seq.num_tokens - seq.num_computed_tokens == 1
            while not self.kv.allocate_slots(seq, num_new):
                if decoding and num_new > 1:  # drop proposals before preempting anyone
                    num_new = 1
                    continue
                victim = next(s for s in reversed(self.running) if s not in planned)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_scheduled(out, seq, num_new)
                planned.add(seq)
                budget.take(seq.priority, num_new, wanted)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Preempts the last running sequences while every slot is taken and a
        waiting sequence outranks them by priority; one slot per such waiting
        sequence, in order (see the module docstring)."""
        running, waiting = self.running, self._waiting
        free_slots = self.config.max_num_seqs - len(running)
        if not waiting or not running or waiting[0].priority >= running[-1].priority:
            return  # the common case: nothing outranks the running batch
        for seq in sorted(waiting):
            if free_slots > 0:
                free_slots -= 1
                continue
            victim = running[-1] if running else None
            if victim is None or seq.priority >= victim.priority:
                return
            self._preempt(victim)
            out.preempted.append(victim)
            self.num_priority_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget,
                          planned: set[Sequence]) -> None:
        """Lets waiting sequences join in order while the budget (each within
        its priority's allowance), ``max_num_seqs`` and free blocks allow; the
        head is never overtaken."""
        waiting = self._waiting
        while waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            seq = waiting[0]
            # Cached positions have no logits: a sequence still collecting its
            # prompt log-probabilities computes its prompt in full (vLLM v1 too).
            looks_up = self.kv.enable_caching and not collects_prompt_logprobs(seq)
            hit = self.kv.find_prefix(seq) if looks_up else NO_HIT
            wanted = min(seq.num_tokens - hit.num_tokens, budget.tokens,
                         self.config.max_chunk_tokens or budget.tokens)
            num_new = min(wanted, budget.allowance(seq.priority))
            if num_new <= 0:  # outranked in this step: it joins at the next
                budget.take(seq.priority, 0, wanted)
                return
            if not self.kv.allocate_slots(seq, num_new, hit):
                return
            heapq.heappop(waiting)
            seq.num_computed_tokens = hit.num_tokens
            if seq.num_cached_tokens < 0:  # first scheduled
                seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt_tokens)
                seq.scheduled_at = time.monotonic()
            if looks_up:  # the pool's hits (blocks restored from the offload tier apart)
                out.prefix_queries += seq.num_tokens
                out.prefix_hits += hit.num_pool_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq)
            self._add_scheduled(out, seq, num_new)
            planned.add(seq)
            budget.take(seq.priority, num_new, wanted)

    @staticmethod
    def _add_scheduled(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        spec: tuple[int, ...] = ()
        if num_new > 1 and start + 1 == seq.num_tokens:
            spec = tuple(seq.spec_token_ids[:num_new - 1])
        out.scheduled.append(ScheduledSequence(seq, start, num_new,
                                               start + num_new - len(spec) == seq.num_tokens,
                                               spec))
        out.num_scheduled_tokens += num_new

    def _fork(self, leader: Sequence, num_tokens: int,
              entries: SequenceOf[int | SequenceOf[int]],
              out: SchedulerOutput) -> list[Sequence]:
        """Forks the leader's unforked choices after the step that computed its
        ``num_tokens`` prompt tokens, each with its first token (``entries``, in
        their order); see the module docstring. Returns them (updated, as
        :meth:`update_from_output` returns its sequences)."""
        assert leader.group is not None
        group = leader.group
        leader.num_computed_tokens = num_tokens
        self.kv.cache_computed_blocks(leader)  # its prompt blocks, before they are shared
        children, group.pending = group.pending, []
        updates: list[Sequence] = []
        for child, entry in zip(children, entries, strict=True):
            if child.index in group.cancelled_choices:
                child.status = SequenceStatus.FINISHED
                child.finish_reason = FinishReason.CANCELLED
                updates.append(child)
                continue
            token = entry if isinstance(entry, int) else entry[0]
            child.token_ids.append(token)
            child.num_undelivered = 1
            child.num_cached_tokens = max(leader.num_cached_tokens, 0)
            child.scheduled_at = leader.scheduled_at
            reason = self._stop_reason(child, token)
            if reason is not FinishReason.NONE:
                child.status = SequenceStatus.FINISHED
                child.finish_reason = reason
            else:
                self._join_forked(leader, child, num_tokens, out)
            updates.append(child)
        return updates

    def _join_forked(self, leader: Sequence, child: Sequence, num_tokens: int,
                     out: SchedulerOutput) -> None:
        """Puts a forked choice in the running batch on the leader's prompt KV,
        or, without a sequence slot or a block for its copy, in the waiting
        queue to be computed from scratch (mostly prefix-cache hits)."""
        if len(self.running) < self.config.max_num_seqs:
            try:
                copy = self.kv.fork(leader, child, num_tokens)
            except OutOfBlocksError:
                pass
            else:
                if copy is not None:
                    out.block_copies.append(copy)
                child.num_computed_tokens = num_tokens
                child.status = SequenceStatus.RUNNING
                bisect.insort(self.running, child)
                return
        self.add(child)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.kv.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason:
        """Why ``seq`` ends after appending ``token`` (NONE: it goes on). A
        constrained sequence's grammar advances here, once per committed token,
        and ends it with STOP once it takes no further token (with ERROR and an
        INVALID_ARGUMENT refusal naming ``min_tokens`` when that comes before
        ``min_tokens``: EOS is masked until then, so the grammar is extended
        wherever it admits more, and this is where it cannot be). A matcher that
        fails (llguidance's limits, e.g. more than 2,000 alternatives in a row
        of the parse or a regex too large for its lexer, can be hit only while
        generating) ends it with ERROR and an INVALID_ARGUMENT refusal naming
        the constraint and llguidance's reason: the request's own fault."""
        options = seq.request.sampling
        if seq.grammar is not None:
            if not seq.grammar.accept(token):
                why = _shorten(seq.grammar.error) or "it refused a token"
                seq.refusal = InvalidRequestError(
                    "sampling.structured_output",
                    f"the constraint failed after {seq.num_generated_tokens} generated tokens: "
                    f"{why}; simplify it (fewer alternatives, a smaller regex or schema)")
                return FinishReason.ERROR
            if seq.grammar.finished:
                if seq.num_generated_tokens < options.min_tokens:
                    seq.refusal = InvalidRequestError(
                        "sampling.min_tokens",
                        f"the output constraint (sampling.structured_output) admits no token "
                        f"after {seq.num_generated_tokens} generated tokens, fewer than "
                        f"min_tokens = {options.min_tokens}; lower min_tokens or loosen the "
                        f"constraint")
                    return FinishReason.ERROR
                return FinishReason.STOP
        if token in self.config.eos_token_ids and not options.ignore_eos:
            return FinishReason.STOP
        if token in options.stop_token_ids:
            return FinishReason.STOP
        if seq.num_generated_tokens >= options.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return FinishReason.NONE


def _shorten(text: str, limit: int = 400) -> str:
    """``text`` cut to ``limit`` characters (llguidance's errors quote the whole grammar)."""
    return text if len(text) <= limit else text[:limit] + " [...]"
