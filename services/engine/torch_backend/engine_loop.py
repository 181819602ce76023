"""The torch engine's request loop: one worker thread steps the model.

The asyncio side (``submit`` / ``cancel`` / ``load``) never runs the model: it
pushes sequences into a waiting queue ordered by (priority, arrival) and sets
cancel flags. One dedicated worker thread takes the next sequence, runs it
step by step (a prefill chunk of at most ``prefill_chunk_size`` tokens, or one
decode token per step) and hands each step's token to the request's asyncio
queue with ``loop.call_soon_threadsafe`` as soon as the step ends.

This walking skeleton runs one sequence at a time; the next stage replaces
:meth:`EngineLoop._schedule` / :meth:`EngineLoop._step` with a scheduler over a
paged KV cache and batched steps, keeping the same asyncio-facing verbs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable

import torch

from services.common.sampling import FinishReason
from services.engine.backend import DuplicateRequestError, EngineUnavailableError, QueueFullError
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.sampler import SamplingRow, sample
from services.engine.torch_backend.sequence import Sequence
from services.engine.types import EngineRequest, LoadStats, TokenDelta

StepObserver = Callable[[float], None]


class EngineLoop:
    """Waiting queue + one worker thread that runs the model.

    Args:
      runner: the model runner (used only on the worker thread).
      eos_token_ids: ids that finish a sequence with STOP unless it ignores EOS.
      max_model_len: context window; a sequence reaching it finishes with LENGTH.
      max_num_waiting: most sequences waiting; ``submit`` raises QueueFullError beyond.
      prefill_chunk_size: most prompt tokens computed in one step (bounds how long
        a cancel waits behind a long prompt).
      step_observer: called on the worker thread with each step's duration (seconds).
    """

    def __init__(self, runner: ModelRunner, *, eos_token_ids: Iterable[int], max_model_len: int,
                 max_num_waiting: int = 256, prefill_chunk_size: int = 128,
                 step_observer: StepObserver | None = None) -> None:
        self._runner = runner
        self._eos = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._max_num_waiting = max_num_waiting
        self._prefill_chunk_size = prefill_chunk_size
        self._step_observer = step_observer
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._running: Sequence | None = None
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._kv_tokens_in_use = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- asyncio side -------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker thread. Mutates; a second call does nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()

    def submit(self, request: EngineRequest,
               loop: asyncio.AbstractEventLoop) -> asyncio.Queue[TokenDelta]:
        """Queues ``request``; returns the queue its deltas arrive on (owned by ``loop``).

        Raises:
          EngineUnavailableError: not started or stopping.
          DuplicateRequestError: the id is in flight.
          QueueFullError: ``max_num_waiting`` sequences are waiting.
        """
        row = SamplingRow.from_options(request.sampling, self._runner.device)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        with self._lock:
            if self._thread is None or self._stopping:
                raise EngineUnavailableError("the torch engine is not running")
            if request.request_id in self._by_id:
                raise DuplicateRequestError(f"request {request.request_id!r} is already running")
            if len(self._waiting) >= self._max_num_waiting:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting (limit {self._max_num_waiting})")
            seq = Sequence(request, next(self._arrivals), queue, loop, row)
            self._by_id[request.request_id] = seq
            heapq.heappush(self._waiting, (int(request.priority), seq.arrival, seq))
            self._wakeup.notify()
        return queue

    def cancel(self, request_id: str) -> bool:
        """Finishes ``request_id`` with CANCELLED: at once if waiting, else at the
        next step boundary. Thread-safe. Returns False if it is not in flight."""
        with self._lock:
            seq = self._by_id.get(request_id)
            if seq is None:
                return False
            seq.cancelled = True
            entry = next((e for e in self._waiting if e[2] is seq), None)
            if entry is not None:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                del self._by_id[request_id]
                seq.finish_reason = FinishReason.CANCELLED
        if entry is not None:
            _deliver(seq, ())
        return True

    def load(self) -> LoadStats:
        """Running / waiting sequences and the fraction of the KV budget
        (``max_model_len`` tokens) reserved. Lock-free snapshot."""
        return LoadStats(
            num_running=0 if self._running is None else 1,
            num_waiting=len(self._waiting),
            kv_cache_usage=self._kv_tokens_in_use / self._max_model_len,
        )

    def stop(self) -> None:
        """Stops the worker after its current step (blocking: call it off the event
        loop), then finishes every sequence left with ERROR. Idempotent."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            left = [e[2] for e in self._waiting]
            if self._running is not None:
                left.insert(0, self._running)
            self._waiting.clear()
        for seq in left:
            self._finish(seq, FinishReason.ERROR, (), "the engine shut down")

    # ---- worker thread ------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while (seq := self._schedule()) is not None:
                try:
                    self._step(seq)
                except Exception as exc:  # noqa: BLE001 - the request fails, the engine lives
                    self._finish(seq, FinishReason.ERROR, (), f"{type(exc).__name__}: {exc}")

    def _schedule(self) -> Sequence | None:
        """The sequence to step next (blocks while idle); None once stopping."""
        with self._lock:
            while not self._stopping and self._running is None and not self._waiting:
                self._wakeup.wait()
            if self._stopping:
                return None
            if self._running is None:
                self._running = heapq.heappop(self._waiting)[2]
            return self._running

    def _step(self, seq: Sequence) -> None:
        """One model step of ``seq``: a prefill chunk, or a decode token."""
        if seq.cancelled:
            self._finish(seq, FinishReason.CANCELLED, ())
            return
        began = time.perf_counter()
        if seq.cache is None:
            self._allocate(seq)
        assert seq.cache is not None
        chunk = seq.next_chunk(self._prefill_chunk_size)
        logits = self._runner.run([StepInput(chunk, seq.num_computed_tokens, seq.cache)])
        seq.num_computed_tokens += len(chunk)
        if seq.num_computed_tokens < seq.num_tokens:  # prefill continues next step
            self._observe(began)
            return
        token = int(sample(logits, [seq.sampling])[0])
        seq.token_ids.append(token)
        reason = self._stop_reason(seq, token)
        self._observe(began)
        if reason is FinishReason.NONE:
            _deliver(seq, (token,))
        else:
            self._finish(seq, reason, (token,))

    def _allocate(self, seq: Sequence) -> None:
        capacity = min(seq.num_prompt_tokens + seq.request.sampling.max_tokens,
                       self._max_model_len)
        seq.cache = self._runner.allocate(capacity)
        self._kv_tokens_in_use = capacity

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason:
        options = seq.request.sampling
        if token in self._eos and not options.ignore_eos:
            return FinishReason.STOP
        if token in options.stop_token_ids:
            return FinishReason.STOP
        if seq.num_generated_tokens >= options.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self._max_model_len:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _finish(self, seq: Sequence, reason: FinishReason, token_ids: tuple[int, ...],
                error: str = "") -> None:
        """Frees ``seq`` (load drops first), then delivers its last delta."""
        seq.finish_reason = reason
        seq.cache = None
        with self._lock:
            self._by_id.pop(seq.request_id, None)
            if self._running is seq:
                self._running = None
                self._kv_tokens_in_use = 0
        _deliver(seq, token_ids, error)

    def _observe(self, began: float) -> None:
        if self._step_observer is not None:
            self._step_observer(time.perf_counter() - began)


def _deliver(seq: Sequence, token_ids: tuple[int, ...], error: str = "") -> None:
    """Hands a delta to ``seq``'s event loop (thread-safe); dropped if that loop closed."""
    try:
        seq.loop.call_soon_threadsafe(seq.queue.put_nowait, seq.delta(token_ids, error))
    except RuntimeError:
        pass
