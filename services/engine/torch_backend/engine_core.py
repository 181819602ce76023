"""The torch engine's core: one worker thread owns the requests, the scheduler and the step.

:class:`EngineCore` is the one owner of every in-flight request inside the
engine. Callers on other threads (an event loop's handlers) never touch the
scheduler or the KV cache: they put commands in its
:class:`~services.engine.torch_backend.inbox.Inbox` (``submit``, ``cancel``)
and read a published :class:`~services.engine.types.LoadStats` snapshot
(``load``). The worker thread takes the commands in at each intake point:

* before each step is planned;
* before each layer of the forward in progress (submits join the waiting
  queue, cancels are applied: a cancelled waiting sequence leaves and gets
  its last delta at once, a running one is flagged).

A step is ``intake → schedule → run → sample → update → deliver``:

1. :meth:`Scheduler.schedule` picks every running sequence's next tokens and
   lets waiting ones join (in-flight batching, chunked prefill, prefix hits,
   preemption);
2. :meth:`ModelRunner.run` computes all scheduled tokens in one batched
   forward over the paged KV cache;
3. :func:`~services.engine.torch_backend.step_sampler.sample_step` samples
   one token per sequence that caught up with its length, or verifies its
   speculative tokens (accepted ones plus the target's own token); the
   sequences that ask get the log-probabilities of their prompt chunk and of
   their new tokens from the same raw logits
   (:mod:`~services.engine.torch_backend.logprobs`);
4. :meth:`Scheduler.update_from_output` books the step and finishes
   sequences that stopped;
5. the :class:`~services.engine.torch_backend.speculative.Speculator` (if
   any) proposes the next step's lookahead tokens of the sequences that just
   produced tokens;
6. the step's deltas go to their requests' sinks
   (:class:`~services.engine.backend.DeltaSink`, e.g. the ``Multiplex``
   call's outbox) as soon as the step ends, in one
   ``loop.call_soon_threadsafe`` per event loop (one wake-up of the loop per
   step, not one per sequence; no task or queue per request). After a step
   that produced a request's first token, the worker hands the CPU and the
   GIL to the event loop before the next step: it waits (at most
   ``first_token_handoff_s``) until each loop has run the step's deliveries
   and the tasks they woke (the transport's write), see
   :func:`_deliver_all`.

A cancelled running sequence leaves, and its blocks return to the pool, at
the first of:

* the next layer boundary of the forward in progress, when every sequence of
  that step is cancelled (the forward is abandoned: the step's tokens are half
  written, so their blocks are freed without entering the prefix cache, and no
  step is observed);
* the end of the step in progress, when it computes live sequences too;
* the next :meth:`Scheduler.schedule` otherwise (flagged sequences are dropped
  first: no chunk is ever planned for a sequence already cancelled).

So a cancel waits at most one layer of a step it has to itself (a long
prompt's chunk alone), and at most one step otherwise: a step computes at
most ``max_num_batched_tokens`` tokens and a sequence at most
``max_chunk_tokens`` of them (``--max-num-batched-tokens``,
``--prefill-chunk-size``).

Threading: the worker thread is the only writer of the scheduler, the KV
cache manager and every sequence it has taken in. It holds ``_state_lock``
while it mutates them (intake, schedule, update, finish), never during the
forward; :meth:`check_integrity` and :meth:`reset_prefix_cache` take it to
see (or, for the latter, change only when no block is in use) consistent
state from another thread. Callers never wait for a step: ``submit`` and
``cancel`` take only the inbox's lock, held for a few list operations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from services.common.kv_events import KVEvent, KVSnapshot
from services.common.logprobs import PositionLogprobs
from services.common.sampling import FinishReason
from services.common.step_profile import StepProfile
from services.engine.backend import DeltaSink
from services.engine.torch_backend.block_pool import BlockCounts
from services.engine.torch_backend.grammar_mask import GrammarMatcher
from services.engine.torch_backend.inbox import Inbox
from services.engine.torch_backend.logits_processors import LogitsProcessorState
from services.engine.torch_backend.logprobs import (
    add_prompt_logprobs,
    position_logprobs,
    prompt_rows,
)
from services.engine.torch_backend.model import StepAbandoned
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.scheduler import Scheduler, SchedulerOutput
from services.engine.torch_backend.sequence import ChoiceGroup, Sequence, SequenceStatus
from services.engine.torch_backend.speculative import Speculator
from services.engine.torch_backend.step_timer import StepTimer
from services.engine.torch_backend.step_sampler import StepRow, sample_step
from services.engine.types import LoadStats, SequenceRequest, StepStats, TokenDelta

log = structlog.get_logger()


StepObserver = Callable[[StepStats], None]
#: Seconds between two refreshes of the step profile in the load report.
PROFILE_REFRESH_S = 0.25
#: A delta and the sink it goes to.
_Put = tuple[DeltaSink, TokenDelta]
#: Most seconds the worker waits, after a step that produced a request's
#: first token, for the event loop to run that step's deliveries and what
#: they woke (the transport's write of the first token) before it starts
#: the next step. Without the wait the next step's Python parts held the
#: GIL and its OpenMP team both cores of a 2-CPU VM while the loop waited
#: to write: step end → ``Multiplex`` message written took 0.45 ms at the
#: median and 1.3 ms at p75 (30 requests, 2026-12-07).
FIRST_TOKEN_HANDOFF_S = 0.002


class EngineCore:
    """The engine's one owner of requests: a command inbox + one worker thread
    stepping the scheduler and the model.

    Args:
      runner: the model runner (used only on the worker thread), its KV cache allocated.
      scheduler: the scheduler over that KV cache (touched only by the worker thread).
      max_num_waiting: most sequences waiting beyond the free sequence slots;
        ``submit`` raises QueueFullError beyond.
      step_observer: called on the worker thread after each step.
      speculator: proposes speculative tokens (None: no speculation).
      layer_observer: called on the worker thread before each layer of a
        step's forward (the thread governor's ``observe_layer``); cheap.
      first_token_handoff_s: most seconds the worker waits after a step that
        produced a request's first token, for the sinks' event loops to run
        its deliveries (see :func:`_deliver_all`); 0: no wait.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, *, max_num_waiting: int = 256,
                 step_observer: StepObserver | None = None,
                 speculator: Speculator | None = None,
                 layer_observer: Callable[[], None] | None = None,
                 first_token_handoff_s: float = FIRST_TOKEN_HANDOFF_S) -> None:
        self._runner = runner
        self._handoff_s = first_token_handoff_s
        self._scheduler = scheduler
        self._speculator = speculator
        self._kv = scheduler.kv
        self._step_observer = step_observer
        self._layer_observer = layer_observer
        self._inbox = Inbox(scheduler.config.max_num_seqs, max_num_waiting)
        self._state_lock = threading.Lock()
        self._arrivals = itertools.count()
        self._timer = StepTimer(None if speculator is None else speculator.cost,
                                scheduler.config.max_num_seqs)
        self._profile = StepProfile()
        self._profiled_at = 0.0
        self._snapshot = _Snapshot(0, 0.0, 0, self._profile)
        self._thread: threading.Thread | None = None

    # ---- any thread -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker on a new daemon thread named ``engine-step``. Mutates; a
        second call does nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._inbox.open()
            self._thread.start()

    def run_here(self, on_ready: Callable[[], None] | None = None) -> None:
        """Runs the worker on the calling thread until :meth:`stop` (for a thread
        that built the model first, see ``TorchBackend.start``); ``on_ready`` is
        called once ``submit`` accepts requests.

        Raises:
          RuntimeError: the worker already runs.
        """
        if self._thread is not None:
            raise RuntimeError("the engine core already runs")
        self._thread = threading.current_thread()
        self._inbox.open()
        if on_ready is not None:
            on_ready()
        self._run()

    def submit(self, request: SequenceRequest, sink: DeltaSink,
               grammar: GrammarMatcher | None = None) -> Submitted:
        """Queues ``request``; its deltas go to ``sink.deliver``, called on
        ``sink.loop`` (one callback per step for all the sinks of that loop).
        ``grammar``: its structured-output matcher (the worker thread's from now on;
        choices 1..n-1 get copies of it).

        Raises:
          EngineUnavailableError: not started or stopping.
          DuplicateRequestError: the id is in flight.
          QueueFullError: ``max_num_seqs`` + ``max_num_waiting`` requests are in
            flight (a request that takes a free sequence slot at the next step
            never counts as waiting).
        """
        choices = [self._choice(request, index, sink,
                                None if grammar is None or index == 0 else grammar.fork())
                   for index in range(request.sampling.n)]
        choices[0].grammar = grammar
        seq = choices[0]
        if len(choices) > 1:
            seq.group = ChoiceGroup(choices, choices[1:])
            for choice in choices[1:]:
                choice.group = seq.group
        self._inbox.submit(seq)
        return Submitted(sink, seq)

    def _choice(self, request: SequenceRequest, index: int, sink: DeltaSink,
                grammar: GrammarMatcher | None) -> Sequence:
        """The sequence of choice ``index``: its own generator, seeded with
        ``SamplingOptions.choice_seed(index)`` (from the OS when unseeded), and
        its own grammar matcher."""
        options = request.sampling
        if index:
            options = dataclasses.replace(options, seed=options.choice_seed(index))
        row = SamplingRow.from_options(options, self._runner.device)
        seq = Sequence(request, next(self._arrivals), row, sink, index=index,
                       prompt_logprobs_sent=index > 0,  # prompt_logprobs: choice 0's only
                       processors=LogitsProcessorState.for_request(  # each choice its own
                           request.sampling, request.prompt_token_ids,
                           self._scheduler.config.eos_token_ids),
                       grammar=grammar)
        if self._speculator is not None:
            seq.spec_method, seq.num_spec_tokens = self._speculator.resolve(request.speculative)
        return seq

    def cancel(self, request_id: str, submitted: Submitted | None = None) -> bool:
        """Finishes ``request_id`` (only if it is ``submitted``'s, when given) with
        CANCELLED: its id may be used again at once. The sequence leaves at once
        if the worker has not taken it in yet or it waits; else as the module
        docstring says. Thread-safe; never waits for a step. Returns False if it
        is not in flight."""
        found, resolved = self._inbox.cancel(
            request_id, None if submitted is None else submitted.seq)
        if resolved is not None:
            _deliver(resolved)
        return found

    def cancel_choice(self, request_id: str, index: int,
                      submitted: Submitted | None = None) -> bool:
        """Finishes choice ``index`` of ``request_id`` (``sampling.n`` > 1) with
        CANCELLED, alone: its blocks are freed at the next intake (or at the fork,
        before it); the other choices go on. Thread-safe; never waits for a
        step. Returns False if there is no such unfinished choice in flight."""
        return self._inbox.cancel_choice(
            request_id, index, None if submitted is None else submitted.seq)

    @property
    def speculator(self) -> Speculator | None:
        """The speculative decoding of this core (None: off)."""
        return self._speculator

    def load(self) -> LoadStats:
        """Running / waiting requests and the fraction of KV blocks in use. Lock-free:
        running and KV usage as of the worker's last intake or step, waiting =
        the requests in flight beyond those running (a submit or cancel counts
        at once)."""
        snapshot = self._snapshot
        return LoadStats(num_running=snapshot.num_running,
                         num_waiting=max(len(self._inbox) - snapshot.num_running, 0),
                         kv_cache_usage=snapshot.kv_cache_usage,
                         num_pending_prefill_tokens=snapshot.num_pending_prefill_tokens,
                         step_profile=snapshot.step_profile)

    def check_integrity(self) -> BlockCounts:
        """Checks the KV block bookkeeping between two mutations by the worker
        (when nothing runs or waits, also that no block is used, the draft
        model's included: its blocks change outside the lock, so they are
        checked only then). Thread-safe.

        Raises:
          KVIntegrityError: naming the inconsistency.
        """
        with self._state_lock:
            idle = not self._scheduler.has_work() and not self._inbox.has_commands()
            counts = self._kv.check_integrity(idle=idle)
            if idle and self._speculator is not None:
                self._speculator.check_integrity(idle=True)
            return counts

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events (blocks stored / removed) since the last call. Thread-safe."""
        return self._kv.take_events()

    def kv_events_dropped(self) -> int:
        """KV events dropped undrained so far (running count). Thread-safe."""
        return self._kv.pool.events_dropped

    def kv_snapshot(self) -> KVSnapshot:
        """Every block hash in the prefix cache now, taken together with dropping
        the events not yet drained (they are in the snapshot), so that the events
        drained afterwards apply on top of it. Thread-safe (takes the state lock
        for a copy of the hash map: ~1 ms per 10,000 blocks)."""
        with self._state_lock:
            self._kv.take_events()
            return KVSnapshot(self._kv.cached_hashes(), self._kv.pool.events_dropped,
                              self._kv.offloaded_hashes())

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash if no block is in use. Thread-safe."""
        with self._state_lock:
            return self._kv.reset_prefix_cache()

    def stop(self) -> None:
        """Stops the worker after its current step (blocking: call it off the event
        loop), then finishes every sequence left with ERROR. Idempotent."""
        self._inbox.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._state_lock:
            left = self._scheduler.finish_all(FinishReason.ERROR)
            for seq in self._inbox.clear():
                seq.finish_reason = FinishReason.ERROR
                left.append(seq)
            self._publish()
        _deliver_all([(seq, "the engine shut down") for seq in left])

    # ---- worker thread --------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                try:
                    planned = self._schedule()
                    if planned is None:
                        return
                    began, out = planned
                    if self._speculator is not None and (out.finished or out.preempted):
                        self._speculator.retain(self._running_keys())
                    self._deliver_finished([(seq, "") for seq in out.finished])
                    if out.scheduled:
                        self._step(began, out)
                except Exception as exc:  # noqa: BLE001 - a bug must not hang every request
                    self._fail_all(exc)

    def _take_in(self) -> None:
        """Applies what the inbox holds (under the state lock): submits join the
        waiting queue, cancels flag their sequence (a waiting one leaves now and
        gets its last delta). Each command applies on its own: one that fails
        finishes its sequence with ERROR and leaves the others untouched."""
        if not self._inbox.has_commands():
            return
        intake = self._inbox.take()
        ended: list[tuple[Sequence, str]] = []
        with self._state_lock:
            for seq in intake.submits:
                try:
                    self._scheduler.add(seq)
                except Exception as exc:  # noqa: BLE001 - its request fails, no other
                    seq.finish_reason = FinishReason.ERROR
                    ended.append((seq, f"{type(exc).__name__}: {exc}"))
            for seq in intake.cancels:
                try:
                    ended.extend((s, "") for s in self._scheduler.abort_request(seq))
                except Exception as exc:  # noqa: BLE001 - its request fails, no other
                    self._scheduler.finish(seq, FinishReason.ERROR)
                    ended.append((seq, f"{type(exc).__name__}: {exc}"))
            for seq, index in intake.choice_cancels:
                ended.extend((s, "") for s in self._scheduler.abort_choice(seq, index))
            self._publish()
        self._deliver_finished(ended)

    def _publish(self) -> None:
        """Publishes the load snapshot (under the state lock)."""
        self._snapshot = _Snapshot(self._scheduler.num_running, self._kv.usage,
                                   self._scheduler.pending_prefill_tokens(), self._profile)

    def _time_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Times the step (:class:`StepTimer`); refreshes the reported profile
        (and the scheduler's, :attr:`Scheduler.step_profile`) at most every
        :data:`PROFILE_REFRESH_S`, and when the engine goes idle (so an idle
        engine reports all it measured)."""
        self._timer.observe(out, seconds)
        now = time.monotonic()
        if now - self._profiled_at >= PROFILE_REFRESH_S or not self._scheduler.has_work():
            profile = self._timer.profile()
            if self._kv.offload is not None:  # a restored token's cost, beside a computed one's
                profile = dataclasses.replace(
                    profile, restore_token_s=self._kv.offload.restore_block_s / self._kv.block_size)
            self._profile, self._profiled_at = profile, now
            self._scheduler.step_profile = profile  # sizes outranked prompt chunks

    def _fail_all(self, exc: Exception) -> None:
        """Finishes every sequence with ERROR after an unexpected failure outside the
        forward (a bug); the engine keeps serving new requests."""
        error = f"{type(exc).__name__}: {exc}"
        log.exception("engine_core_failed", error=error)
        with self._state_lock:
            left = self._scheduler.finish_all(FinishReason.ERROR)
            self._publish()
        if self._speculator is not None:
            self._speculator.retain(())
        self._deliver_finished([(seq, error) for seq in left])

    def _schedule(self) -> tuple[float, SchedulerOutput] | None:
        """Takes in commands, then plans the next step (blocks while idle); None
        once stopping."""
        while True:
            self._take_in()
            if self._scheduler.has_work():
                break
            if not self._inbox.wait():
                return None
        if self._inbox.stopping:
            return None
        with self._state_lock:
            began = time.perf_counter()
            out = self._scheduler.schedule()
            self._publish()
            return began, out

    def _between_layers(self, seqs: list[Sequence]) -> bool:
        """Asked by the forward before each layer: takes in commands, then says
        whether every sequence of the step is cancelled (the forward is then
        abandoned). O(1) in a step without commands or cancels. Tells the
        layer observer first."""
        if self._layer_observer is not None:
            self._layer_observer()
        self._take_in()
        return _all_cancelled(seqs)

    def _step(self, began: float, out: SchedulerOutput) -> None:
        kv = self._kv
        inputs = []
        # Leading logit rows of each sequence that score prompt tokens (prompt_logprobs).
        extra = [prompt_rows(s.seq, s.start, s.num_tokens) for s in out.scheduled]
        for s, num_prompt_rows in zip(out.scheduled, extra):
            verified = s.num_tokens - len(s.spec_token_ids)
            tokens = s.seq.token_ids[s.start:s.start + verified]
            if s.spec_token_ids:
                tokens = tokens + list(s.spec_token_ids)
            num_logits = (s.num_logits if s.samples else 0) + num_prompt_rows
            inputs.append(StepInput(tokens, s.start, kv.block_ids(s.seq), num_logits > 0,
                                    max(num_logits, 1), s.seq.num_prompt_tokens))
        try:
            logits = self._runner.run(inputs, functools.partial(
                self._between_layers, [s.seq for s in out.scheduled]))
            if any(extra):
                logits = self._take_prompt_rows(out, extra, logits)
            forked, rows, own = _with_forks(logits, out)
            sampled = sample_step(forked, rows) if rows else []
            logprobs = self._generated_logprobs(out, logits, sampled)
        except StepAbandoned:
            self._end_step(out, FinishReason.CANCELLED)
            return
        except Exception as exc:  # noqa: BLE001 - the requests fail, the engine lives
            self._fail_step(out, exc)
            return
        with self._state_lock:
            updated = self._scheduler.update_from_output(out, sampled)
            self._time_step(out, time.perf_counter() - began)
            self._publish()
        for seq in updated:
            entries = logprobs.get(seq)
            if entries is not None:
                seq.pending_logprobs.extend(entries[:seq.num_undelivered])
        if out.block_copies:  # forked choices' partial blocks, before their next forward
            cache = self._runner.kv_cache
            assert cache is not None
            cache.copy_blocks([c.src for c in out.block_copies],
                              [c.dst for c in out.block_copies])
        if self._speculator is not None:
            self._speculator.observe_step(_verified(out, [sampled[i] for i in own]),
                                          time.perf_counter() - began,
                                          out.num_scheduled_tokens, _decode_only(out))
            self._speculator.propose([seq for seq in updated if not seq.finished],
                                     self._scheduler.num_running)
            if any(seq.finished for seq in updated) or out.preempted:
                self._speculator.retain(self._running_keys())
        if self._step_observer is not None:
            stats = _step_stats(time.perf_counter() - began, out, [sampled[i] for i in own])
            if self._kv.offload is not None:  # its counts change on this thread only
                stats = dataclasses.replace(stats, offload=self._kv.offload.take_stats())
            if self._speculator is not None:
                tokens, nbytes = self._speculator.cache_size()
                stats = dataclasses.replace(stats, suffix_cache_tokens=tokens,
                                            suffix_cache_bytes=nbytes)
            self._step_observer(stats)
        self._deliver_finished([(seq, "") for seq in updated], handoff=True)

    @staticmethod
    def _take_prompt_rows(out: SchedulerOutput, extra: list[int],
                          logits: torch.Tensor) -> torch.Tensor:
        """Books the prompt log-probabilities of the step's prompt-scoring rows
        (``extra[i]`` leading rows of scheduled sequence ``i``) and returns the
        sampling rows only, in order."""
        keep: list[int] = []
        offset = 0
        for s, num_prompt_rows in zip(out.scheduled, extra):
            if num_prompt_rows:
                add_prompt_logprobs(s.seq, s.start, logits[offset:offset + num_prompt_rows])
                offset += num_prompt_rows
            if s.samples:
                keep.extend(range(offset, offset + s.num_logits))
                offset += s.num_logits
        return logits[keep]

    @staticmethod
    def _generated_logprobs(out: SchedulerOutput, logits: torch.Tensor,
                            sampled: list[list[int]]) -> dict[Sequence, list[PositionLogprobs]]:
        """Log-probabilities of each emitted token of the sequences that ask
        (``sampling.logprobs``): token ``j`` of a sequence from its own logit
        row ``j`` (a speculative run's accepted tokens from their target rows,
        the bonus token from the last); the first token of each choice forked
        after the step from its leader's row (``sampled`` holds those after
        the leader's, see :func:`_with_forks`)."""
        found: dict[Sequence, list[PositionLogprobs]] = {}
        offset = index = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            k = s.seq.request.sampling.logprobs
            for seq in (s.seq, *s.forks):
                tokens = sampled[index]
                if k is not None:
                    found[seq] = position_logprobs(logits[offset:offset + len(tokens)],
                                                   tokens, k)
                index += 1
            offset += s.num_logits
        return found

    def _running_keys(self) -> set[int]:
        return {seq.arrival for seq in self._scheduler.running}

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> None:
        """Finishes the step's sequences with ERROR after a failed forward."""
        error = f"{type(exc).__name__}: {exc}"
        log.warning("engine_step_failed", error=error, batch_size=len(out.scheduled))
        self._end_step(out, FinishReason.ERROR, error)

    def _end_step(self, out: SchedulerOutput, reason: FinishReason, error: str = "") -> None:
        """Finishes every sequence of a step whose forward did not complete (failed,
        or abandoned because all of them were cancelled) with ``reason``; their
        blocks are freed without entering the prefix cache (the step's tokens are
        not, or only partly, computed)."""
        ended = [item.seq for item in out.scheduled]
        with self._state_lock:
            for seq in ended:
                self._scheduler.finish(seq, reason)
            self._publish()
        if self._speculator is not None:
            self._speculator.retain(self._running_keys())
        self._deliver_finished([(seq, error) for seq in ended])

    def _deliver_finished(self, items: list[tuple[Sequence, str]],
                          handoff: bool = False) -> None:
        """Delivers ``items`` (see :func:`_deliver_all`) after taking the
        finished sequences' ids out of the request table; with ``handoff``
        (a step's deliveries, on the worker) and a first token among them,
        waits for the event loops (``first_token_handoff_s``)."""
        if not items:
            return
        items = _with_unforked(items)
        done = [seq for seq, _ in items if seq.finished]
        if done:
            self._inbox.finished_all(done)
            if self._speculator is not None:  # the suffix cache learns their outputs
                self._speculator.finished(done)
        handed = _deliver_all(items, first_token_handoff=handoff and self._handoff_s > 0)
        if handed:
            _wait_all(handed, self._handoff_s)


@dataclass(frozen=True)
class Submitted:
    """A submitted request: the sink its deltas go to, and its sequence (a
    handle for :meth:`EngineCore.cancel`; owned by the worker thread)."""

    sink: DeltaSink
    seq: Sequence


@dataclass(frozen=True)
class _Snapshot:
    """What the worker published after its last mutation."""

    num_running: int
    kv_cache_usage: float
    num_pending_prefill_tokens: int
    step_profile: StepProfile


def _all_cancelled(seqs: list[Sequence]) -> bool:
    """True when every sequence of ``seqs`` is cancelled; asked by the forward
    before each layer, without the lock (``cancelled`` only ever turns True).
    Stops at the first live sequence: O(1) in a step without cancels."""
    for seq in seqs:
        if not seq.cancelled:
            return False
    return True


def _step_stats(duration_s: float, out: SchedulerOutput,
                sampled: list[list[int]]) -> StepStats:
    """The step's :class:`StepStats`; speculative counts follow vLLM: a draft is
    a sequence whose proposals were scored, accepted tokens are counted as
    verified (before a stop cut the run short)."""
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    index = 0
    for item in out.scheduled:
        if not item.samples:
            continue
        k = len(item.spec_token_ids)
        if k:
            num_accepted = len(sampled[index]) - 1
            drafts += 1
            draft_tokens += k
            accepted += num_accepted
            if len(per_pos) < num_accepted:
                per_pos.extend([0] * (num_accepted - len(per_pos)))
            for position in range(num_accepted):
                per_pos[position] += 1
        index += 1
    prompt_computed = sum(max(min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                              - item.start, 0) for item in out.scheduled)
    return StepStats(duration_s, out.num_scheduled_tokens, len(out.scheduled),
                     len(out.preempted), out.prefix_queries, out.prefix_hits,
                     drafts, draft_tokens, accepted, tuple(per_pos), prompt_computed,
                     out.deferred_prompt_tokens)


def _verified(out: SchedulerOutput, sampled: list[list[int]]
              ) -> list[tuple[Sequence, int, int]]:
    """``(sequence, proposals scored, proposals accepted)`` of each scheduled
    sequence that sampled (``sampled``: their emitted tokens, in order)."""
    found: list[tuple[Sequence, int, int]] = []
    index = 0
    for item in out.scheduled:
        if not item.samples:
            continue
        found.append((item.seq, len(item.spec_token_ids), len(sampled[index]) - 1))
        index += 1
    return found


def _decode_only(out: SchedulerOutput) -> bool:
    """True when no scheduled sequence computed prompt tokens this step."""
    return all(item.start >= item.seq.num_prompt_tokens for item in out.scheduled)


def _with_forks(logits: torch.Tensor, out: SchedulerOutput
                ) -> tuple[torch.Tensor, list[StepRow], list[int]]:
    """The step's sampling rows, with one more row per choice forked after
    the step (:attr:`ScheduledSequence.forks`): a copy of its leader's last
    logits row, sampled with the choice's own generator. Returns the logits
    (rows repeated where needed), the rows in the order
    :meth:`Scheduler.update_from_output` reads them, and the positions of the
    scheduled sequences' own rows among them."""
    rows: list[StepRow] = []
    own: list[int] = []
    index: list[int] = []
    offset = 0
    for item in out.scheduled:
        if not item.samples:
            continue
        own.append(len(rows))
        rows.append(StepRow(item.seq.sampling, item.spec_token_ids, item.seq.processors,
                            item.seq.grammar))
        index.extend(range(offset, offset + item.num_logits))
        for child in item.forks:  # its processors' output is empty, like its leader's now
            rows.append(StepRow(child.sampling, (), child.processors, child.grammar))
            index.append(offset)
        offset += item.num_logits
    if len(index) == offset:
        return logits, rows, own
    return logits[torch.tensor(index, device=logits.device)], rows, own


def _with_unforked(items: list[tuple[Sequence, str]]) -> list[tuple[Sequence, str]]:
    """``items`` plus, after a finished choice 0 whose request's other choices
    were never forked (cancelled, failed or stopped before its first token),
    those choices, finished with its reason. Marks them finished. Idempotent."""
    if not any(seq.group is not None and seq.group.pending for seq, _ in items):
        return items
    expanded: list[tuple[Sequence, str]] = []
    for seq, error in items:
        expanded.append((seq, error))
        group = seq.group
        if group is None or not group.pending or not seq.finished:
            continue
        for child in group.pending:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = seq.finish_reason
            expanded.append((child, error))
        group.pending = []
    return expanded


def _deliver(seq: Sequence, error: str = "") -> None:
    """Hands one delta to ``seq``'s event loop (see :func:`_deliver_all`)."""
    _deliver_all([(seq, error)])


def _deliver_all(items: list[tuple[Sequence, str]], *,
                 first_token_handoff: bool = False) -> list[threading.Event]:
    """Hands each ``(sequence, error)``'s delta (its tokens not delivered yet,
    :meth:`Sequence.delta`) to its sequence's sink, thread-safe: the deltas
    are built here (on the worker thread, in order) and delivered by one
    callback per event loop, so a step of 16 sequences wakes the loop once. A
    loop that closed drops its deltas; a sequence without a sink (unit tests)
    has its delta taken all the same, so that the next one starts after it.

    Returns:
      with ``first_token_handoff``, when a delta carries its request's first
      token: one event per loop handed deltas, set on that loop once its
      callback and the callbacks it scheduled (the tasks its deliveries woke,
      e.g. the ``Multiplex`` writer) have run; else none.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[_Put]] = {}
    first = False
    for seq, error in _with_unforked(items):
        delta = seq.delta(error)
        if seq.sink is not None:
            by_loop.setdefault(seq.sink.loop, []).append((seq.sink, delta))
            first = first or _is_first(delta)
    handed: list[threading.Event] = []
    for loop, deltas in by_loop.items():
        done = threading.Event() if first and first_token_handoff else None
        try:
            loop.call_soon_threadsafe(_deliver_step, deltas, done)
        except RuntimeError:
            continue
        if done is not None:
            handed.append(done)
    return handed


def _is_first(delta: TokenDelta) -> bool:
    """True when ``delta`` carries its choice's first generated tokens."""
    return bool(delta.token_ids) and delta.num_generated_tokens == len(delta.token_ids)


def _wait_all(events: list[threading.Event], timeout_s: float) -> None:
    """Waits until every event of ``events`` is set, ``timeout_s`` at most in all."""
    deadline = time.monotonic() + timeout_s
    for event in events:
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            return


def _deliver_step(deltas: list[_Put], done: threading.Event | None = None) -> None:
    """On the sinks' event loop: one step's deltas, in order. A sink that
    raises (a bug) is logged and fails its request alone; the step's other
    sinks still get theirs. ``done`` is set once the callbacks scheduled by
    now (the tasks the deliveries woke) have run: ``call_soon`` runs callbacks
    in order."""
    for sink, delta in deltas:
        try:
            sink.deliver(delta)
        except Exception as exc:  # noqa: BLE001 - one request's bug, not the step's
            log.exception("delta_sink_failed", request_id=delta.request_id)
            sink.fail(exc)
    if done is not None:
        asyncio.get_running_loop().call_soon(done.set)
