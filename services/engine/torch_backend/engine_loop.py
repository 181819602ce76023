"""The torch engine's loop: one worker thread steps the scheduler and the model.

A step is ``schedule → run → sample → update → deliver``:

1. :meth:`Scheduler.schedule` (under the loop's lock) picks every running
   sequence's next tokens and lets waiting ones join (in-flight batching,
   chunked prefill, prefix hits, preemption);
2. :meth:`ModelRunner.run` computes all scheduled tokens in one batched forward
   over the paged KV cache (outside the lock);
3. :func:`~services.engine.torch_backend.step_sampler.sample_step` samples
   one token per sequence that caught up with its length, or verifies its
   speculative tokens (accepted ones plus the target's own token);
4. :meth:`Scheduler.update_from_output` (under the lock) books the step and
   finishes sequences that stopped;
5. the :class:`~services.engine.torch_backend.speculative.Speculator` (if
   any) proposes the next step's lookahead tokens of the sequences that just
   produced tokens;
6. the step's deltas go to their requests' asyncio queues as soon as the
   step ends, in one ``loop.call_soon_threadsafe`` per event loop (one
   wake-up of the loop per step, not one per sequence).

The asyncio side (``submit`` / ``cancel`` / ``load``) never runs the model. A
cancel takes the lock and flags the sequence, so it is always applied before
the next :meth:`Scheduler.schedule` (which drops flagged sequences first: no
chunk is ever planned for a sequence already cancelled). A waiting sequence
cancelled leaves the queue at once; a running one leaves, and its blocks
return to the pool, at the first of:

* the next layer boundary of the forward in progress, when every sequence of
  that step is cancelled (the forward asks before each layer and is
  abandoned: the step's tokens are half written, so their blocks are freed
  without entering the prefix cache, and no step is observed);
* the end of the step in progress, when it computes live sequences too.

So a cancel waits at most one layer of a step it has to itself (a long
prompt's chunk alone), and at most one step otherwise: a step computes at
most ``max_num_batched_tokens`` tokens and a sequence at most
``max_chunk_tokens`` of them (``--max-num-batched-tokens``,
``--prefill-chunk-size``). Only the worker thread changes KV block state, so
the runner reads block tables without the lock.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import Callable

import structlog
import torch

from services.common.sampling import FinishReason
from services.engine.backend import DuplicateRequestError, EngineUnavailableError, QueueFullError
from services.engine.kv_events import KVEvent
from services.engine.torch_backend.block_pool import BlockCounts
from services.engine.torch_backend.model import StepAbandoned
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.scheduler import Scheduler, SchedulerOutput
from services.engine.torch_backend.sequence import Sequence
from services.engine.torch_backend.speculative import Speculator
from services.engine.torch_backend.step_sampler import StepRow, sample_step
from services.engine.types import LoadStats, SequenceRequest, StepStats, TokenDelta

log = structlog.get_logger()


StepObserver = Callable[[StepStats], None]
#: A delta and the asyncio queue it goes to.
_Put = tuple[asyncio.Queue[TokenDelta], TokenDelta]


class EngineLoop:
    """Request intake + one worker thread stepping the scheduler and the model.

    Args:
      runner: the model runner (used only on the worker thread), its KV cache allocated.
      scheduler: the scheduler over that KV cache.
      max_num_waiting: most sequences waiting; ``submit`` raises QueueFullError beyond.
      step_observer: called on the worker thread after each step.
      speculator: proposes speculative tokens (None: no speculation).
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, *, max_num_waiting: int = 256,
                 step_observer: StepObserver | None = None,
                 speculator: Speculator | None = None) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self._speculator = speculator
        self._kv = scheduler.kv
        self._max_num_waiting = max_num_waiting
        self._step_observer = step_observer
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._arrivals = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- asyncio side -------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker on a new daemon thread named ``engine-step``. Mutates; a
        second call does nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()

    def run_here(self, on_ready: Callable[[], None] | None = None) -> None:
        """Runs the worker on the calling thread until :meth:`stop` (for a thread
        that built the model first, see ``TorchBackend.start``); ``on_ready`` is
        called once ``submit`` accepts requests.

        Raises:
          RuntimeError: the worker already runs.
        """
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine loop already runs")
            self._thread = threading.current_thread()
        if on_ready is not None:
            on_ready()
        self._run()

    def submit(self, request: SequenceRequest,
               loop: asyncio.AbstractEventLoop) -> asyncio.Queue[TokenDelta]:
        """Queues ``request``; returns the queue its deltas arrive on (owned by ``loop``).

        Raises:
          EngineUnavailableError: not started or stopping.
          DuplicateRequestError: the id is in flight.
          QueueFullError: ``max_num_waiting`` sequences would still wait after
            the free sequence slots (``max_num_seqs`` minus the running ones)
            are taken.
        """
        row = SamplingRow.from_options(request.sampling, self._runner.device)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        with self._lock:
            if self._thread is None or self._stopping:
                raise EngineUnavailableError("the torch engine is not running")
            if self._scheduler.get(request.request_id) is not None:
                raise DuplicateRequestError(f"request {request.request_id!r} is already running")
            waiting = self._scheduler.num_waiting
            free_slots = max(self._scheduler.config.max_num_seqs - self._scheduler.num_running, 0)
            # A request that takes a free slot at the next step never counts as
            # waiting: a burst into an idle engine may fill the slots and the queue.
            if waiting + 1 - free_slots > self._max_num_waiting:
                raise QueueFullError(f"{waiting} requests are waiting for {free_slots} free "
                                     f"sequence slots (limit {self._max_num_waiting} beyond "
                                     "the free slots)")
            seq = Sequence(request, next(self._arrivals), row, queue, loop)
            if self._speculator is not None:
                seq.spec_method, seq.num_spec_tokens = self._speculator.resolve(
                    request.speculative)
            self._scheduler.add(seq)
            self._wakeup.notify()
        return queue

    def cancel(self, request_id: str) -> bool:
        """Finishes ``request_id`` with CANCELLED: at once if waiting, else before
        the next step is planned, at the next layer of a step that computes only
        cancelled sequences, or at the end of the step in progress (see the module
        docstring). Thread-safe. Returns False if it is not in flight."""
        with self._lock:
            seq = self._scheduler.get(request_id)
            if seq is None or seq.cancelled:
                return seq is not None
            if not self._scheduler.abort(seq):
                return True
        _deliver(seq, ())
        return True

    @property
    def speculator(self) -> Speculator | None:
        """The speculative decoding of this loop (None: off)."""
        return self._speculator

    def load(self) -> LoadStats:
        """Running / waiting sequences and the fraction of KV blocks in use.
        Lock-free snapshot."""
        return LoadStats(num_running=self._scheduler.num_running,
                         num_waiting=self._scheduler.num_waiting,
                         kv_cache_usage=self._kv.usage)

    def check_integrity(self) -> BlockCounts:
        """Checks the KV block bookkeeping between steps (when nothing runs or
        waits, also that no block is used, the draft model's included: its
        blocks change outside the lock, so they are checked only then).
        Thread-safe.

        Raises:
          KVIntegrityError: naming the inconsistency.
        """
        with self._lock:
            idle = not self._scheduler.has_work()
            counts = self._kv.check_integrity(idle=idle)
            if idle and self._speculator is not None:
                self._speculator.check_integrity(idle=True)
            return counts

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events (blocks stored / removed) since the last call. Thread-safe."""
        return self._kv.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash if no block is in use. Thread-safe."""
        with self._lock:
            return self._kv.reset_prefix_cache()

    def stop(self) -> None:
        """Stops the worker after its current step (blocking: call it off the event
        loop), then finishes every sequence left with ERROR. Idempotent."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            left = self._scheduler.finish_all(FinishReason.ERROR)
        _deliver_all([(seq, (), "the engine shut down") for seq in left])

    # ---- worker thread ------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                try:
                    planned = self._schedule()
                    if planned is None:
                        return
                    began, out = planned
                    if self._speculator is not None and (out.finished or out.preempted):
                        self._speculator.retain(self._running_ids())
                    _deliver_all([(seq, (), "") for seq in out.finished])
                    if out.scheduled:
                        self._step(began, out)
                except Exception as exc:  # noqa: BLE001 - a bug must not hang every request
                    self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        """Finishes every sequence with ERROR after an unexpected failure outside the
        forward (a bug); the engine keeps serving new requests."""
        error = f"{type(exc).__name__}: {exc}"
        log.exception("engine_loop_failed", error=error)
        with self._lock:
            left = self._scheduler.finish_all(FinishReason.ERROR)
        if self._speculator is not None:
            self._speculator.retain(())
        _deliver_all([(seq, (), error) for seq in left])

    def _schedule(self) -> tuple[float, SchedulerOutput] | None:
        """The next step's plan (blocks while idle); None once stopping."""
        with self._lock:
            while not self._stopping and not self._scheduler.has_work():
                self._wakeup.wait()
            if self._stopping:
                return None
            began = time.perf_counter()
            return began, self._scheduler.schedule()

    def _step(self, began: float, out: SchedulerOutput) -> None:
        kv = self._kv
        inputs = []
        for s in out.scheduled:
            verified = s.num_tokens - len(s.spec_token_ids)
            tokens = s.seq.token_ids[s.start:s.start + verified]
            if s.spec_token_ids:
                tokens = tokens + list(s.spec_token_ids)
            inputs.append(StepInput(tokens, s.start, kv.block_ids(s.seq), s.samples,
                                    s.num_logits, s.seq.num_prompt_tokens))
        try:
            logits = self._runner.run(inputs, functools.partial(
                _all_cancelled, [s.seq for s in out.scheduled]))
            rows = [StepRow(s.seq.sampling, s.spec_token_ids)
                    for s in out.scheduled if s.samples]
            sampled = sample_step(logits, rows) if rows else []
        except StepAbandoned:
            self._end_step(out, FinishReason.CANCELLED)
            return
        except Exception as exc:  # noqa: BLE001 - the requests fail, the engine lives
            self._fail_step(out, exc)
            return
        with self._lock:
            updates = self._scheduler.update_from_output(out, sampled)
        if self._speculator is not None:
            self._speculator.propose([u.seq for u in updates if not u.finished],
                                     self._scheduler.num_running)
            if any(u.finished for u in updates) or out.preempted:
                self._speculator.retain(self._running_ids())
        if self._step_observer is not None:
            self._step_observer(_step_stats(time.perf_counter() - began, out, sampled))
        _deliver_all([(update.seq, update.token_ids, "") for update in updates])

    def _running_ids(self) -> set[str]:
        return {seq.request_id for seq in self._scheduler.running}

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
        with self._lock:
            for seq in ended:
                self._scheduler.finish(seq, reason)
        if self._speculator is not None:
            self._speculator.retain(self._running_ids())
        _deliver_all([(seq, (), error) for seq in ended])


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
    return StepStats(duration_s, out.num_scheduled_tokens, len(out.scheduled),
                     len(out.preempted), out.prefix_queries, out.prefix_hits,
                     drafts, draft_tokens, accepted, tuple(per_pos))


def _deliver(seq: Sequence, token_ids: tuple[int, ...], error: str = "") -> None:
    """Hands one delta to ``seq``'s event loop (see :func:`_deliver_all`)."""
    _deliver_all([(seq, token_ids, error)])


def _deliver_all(items: list[tuple[Sequence, tuple[int, ...], str]]) -> None:
    """Hands each ``(sequence, token ids, error)`` delta to its sequence's event
    loop, thread-safe: the deltas are built here (on the worker thread, in
    order) and put on their queues by one callback per loop, so a step of 16
    sequences wakes the loop once. A loop that closed drops its deltas."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Put]] = {}
    for seq, token_ids, error in items:
        if seq.loop is not None and seq.queue is not None:
            by_loop.setdefault(seq.loop, []).append((seq.queue, seq.delta(token_ids, error)))
    for loop, deltas in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, deltas)
        except RuntimeError:
            pass


def _put_all(deltas: list[_Put]) -> None:
    for queue, delta in deltas:
        queue.put_nowait(delta)
