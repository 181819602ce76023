"""The narrow interface every engine backend implements, and its errors.

A backend runs a :class:`SequenceRequest` and hands its :class:`TokenDelta`
values to the :class:`DeltaSink` registered with it (:meth:`EngineBackend.submit`),
and owns everything below that line (scheduling, KV cache, model). The torch
engine calls the sinks from its step loop, one event-loop callback per step for
every request that advanced, with no task or queue per request; the transport's
sink is its outbox (:mod:`services.engine.multiplex`). :meth:`EngineBackend.generate`
is the same sink read as an async iterator, for one-request callers (the
deprecated ``Generate`` RPC, tests, benchmarks). The gRPC servicer
(:mod:`services.engine.service`) and the contract tests
(``tests/engine/test_backend_contract.py``) speak only this interface, so
``torch`` and ``tensorrt_llm`` stay interchangeable.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Protocol

import grpc
from services.common.kv_events import KVEvent, KVSnapshot
from services.engine.delta_stream import DeltaStream
from services.engine.types import (BlockCounts, EngineResources, LoadStats, ModelInfo,
                                  SequenceRequest, TokenDelta)


class EngineError(Exception):
    """Base of the errors a backend raises for a request it will not run.

    Attributes:
      code: the gRPC status the servicer returns for it.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class EngineUnavailableError(EngineError):
    """The backend is not started, is shutting down, or cannot run here."""

    code = grpc.StatusCode.UNAVAILABLE


class QueueFullError(EngineError):
    """The waiting queue is at its limit; retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DuplicateRequestError(EngineError):
    """A request with the same id is already in flight on this engine."""

    code = grpc.StatusCode.ALREADY_EXISTS


class DeltaSink(Protocol):
    """Where one request's deltas go: the transport's end, registered with
    :meth:`EngineBackend.submit`. Both methods are called on :attr:`loop` (the
    event loop that submitted the request), never on an engine thread, and
    must not block it."""

    #: The event loop the sink lives on.
    loop: asyncio.AbstractEventLoop

    def deliver(self, delta: TokenDelta) -> None:
        """Takes the request's next delta (one per choice that advanced in a
        step; a choice's last one has a finish reason, and nothing follows the
        last choice's)."""

    def fail(self, error: Exception) -> None:
        """The request ended without a last delta: refused after ``submit``
        returned (an :class:`EngineError` or ``InvalidRequestError``, e.g. its
        output constraint did not compile), or the backend failed it
        unexpectedly (any other exception: INTERNAL). Nothing follows."""


class Submission(Protocol):
    """A request :meth:`EngineBackend.submit` took."""

    def cancel(self) -> None:
        """Finishes the request at once if it still runs (its sink may still get
        a CANCELLED last delta); this request only, never a newer one with its
        id. Never raises."""


class PumpedSubmission:
    """A submission read by one task from a per-request async iterator of
    deltas into its sink: the adapter of a backend whose library streams each
    request on its own (TensorRT-LLM's ``generate_async``). An exception from
    the iterator (its refusal, or a failure) fails the sink; :meth:`cancel`
    cancels the task, and closing the iterator cancels the request."""

    def __init__(self, deltas: AsyncIterator[TokenDelta], sink: DeltaSink) -> None:
        self._task = sink.loop.create_task(self._pump(deltas, sink))

    @staticmethod
    async def _pump(deltas: AsyncIterator[TokenDelta], sink: DeltaSink) -> None:
        try:
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for delta in deltas:
                    sink.deliver(delta)
        except Exception as exc:  # noqa: BLE001 - the request's end, told to its sink
            sink.fail(exc)

    def cancel(self) -> None:
        self._task.cancel()


class EngineBackend(abc.ABC):
    """One model replica: token ids in, token-id deltas out.

    Lifecycle: ``start()`` once (idempotent), then any number of concurrent
    ``submit()`` (or ``generate()``) calls, then ``shutdown()``. Methods other
    than ``start`` and ``shutdown`` are called on the event loop thread and
    never block it.
    """

    #: Backend name as the CLI and ``GetModelInfo`` spell it.
    name: ClassVar[str]

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model and warms it up. Mutates the backend (ready afterwards);
        a second call returns at once.

        Raises:
          EngineUnavailableError: the backend cannot run on this machine (e.g. its
            library is not installed).
          FileNotFoundError / ValueError: the model path or options are wrong.
        """

    def check_available(self) -> None:
        """Checks, cheaply and without loading anything, that this backend can
        run on this machine (its library is installed), so the CLI can refuse
        it before binding a port. Pure. The default: nothing to check.

        Raises:
          EngineUnavailableError: it cannot (the message says what to install).
        """

    def check_model_files(self) -> None:
        """Checks, cheaply and without reading weights, that the model path names
        files this backend can load (a GGUF, a checkpoint directory's config and
        weight files), so the CLI can refuse a broken one in one line before
        binding a port. The default: nothing to check.

        Raises:
          FileNotFoundError / ValueError: the path or a file is missing or
            unusable (the message names it).
        """

    def startup_fields(self) -> dict[str, Any]:
        """Settings resolved by ``start()`` for the ``engine_ready`` log line
        (e.g. the concrete dtype of ``--dtype auto``, the KV cache's bytes).
        Pure. The default: none."""
        return {}

    def resources(self) -> EngineResources:
        """What the engine runs on (compute threads, KV tier capacity), for the
        gauges the service sets once ``start()`` has returned. Thread-safe. The
        default: nothing known (zeros)."""
        return EngineResources()

    @property
    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        """The served model's limits. Pure.

        Raises:
          EngineUnavailableError: before ``start()`` returned.
        """

    @abc.abstractmethod
    def submit(self, request: SequenceRequest, sink: DeltaSink) -> Submission:
        """Admits ``request``; its deltas go to ``sink.deliver`` as engine steps
        end. Each choice's last delta has a finish reason (STOP, LENGTH,
        CANCELLED or ERROR); nothing follows the last choice's. A refusal found
        after this returns goes to ``sink.fail`` instead. Call it on
        ``sink.loop``.

        Raises:
          InvalidRequestError: empty prompt, a token id outside the vocabulary, or
            prompt + max_tokens beyond the context window (OUT_OF_RANGE).
          DuplicateRequestError: ``request.request_id`` is already in flight.
          QueueFullError: the waiting queue is full.
          EngineUnavailableError: not started, or shutting down.
        """

    async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
        """Runs ``request`` and streams its deltas: :meth:`submit` with a
        :class:`~services.engine.delta_stream.DeltaStream` as the sink (deltas
        that pile up while the consumer is busy are merged per choice).

        The sequence is admitted on the first ``__anext__``. The last delta has a
        finish reason; the iterator ends after it. Closing the iterator early
        (``aclose()`` or cancelling the task that iterates it) cancels the
        sequence at once and frees its KV cache.

        Raises (from ``__anext__``): what :meth:`submit` raises (from the first),
        or what its sink was failed with.
        """
        stream = DeltaStream(request.sampling.n, asyncio.get_running_loop())
        submission = self.submit(request, stream)
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.ended:  # this request's sequences, never a newer one with its id
                submission.cancel()

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Asks the sequence ``request_id`` to finish with CANCELLED. Mutates.

        A waiting sequence leaves the queue at once; a running one stops by the
        end of the step in progress (the torch engine: at the forward's next layer
        when that step computes nothing else) and is never scheduled again. Its
        stream then yields a last delta with ``FinishReason.CANCELLED``. Never raises.

        Returns:
          True if the request was in flight, False if unknown or already finished.
        """

    def cancel_choice(self, request_id: str, index: int) -> bool:
        """Asks choice ``index`` of the request ``request_id`` (``sampling.n`` > 1)
        to finish with CANCELLED, alone; its other choices go on, and its KV
        blocks are freed as with :meth:`cancel`. Mutates; never raises.

        Returns:
          True if that choice was in flight. The default (a backend that
          refuses ``n`` > 1) knows no choices: False.
        """
        return False

    @abc.abstractmethod
    def load(self) -> LoadStats:
        """A snapshot of running / waiting sequences and KV usage. Pure, cheap."""

    def drain_kv_events(self) -> list[KVEvent]:
        """KV cache events (blocks stored / removed / all cleared) since the last
        call, oldest first, for the prefix index. Thread-safe. A backend without
        a prefix cache it can describe returns none (the default)."""
        return []

    def kv_events_dropped(self) -> int:
        """Running count of KV events dropped undrained (the bounded buffer was
        full); 0 by default. Thread-safe."""
        return 0

    def kv_snapshot(self) -> KVSnapshot | None:
        """Every block hash of the prefix cache now, taken atomically with
        dropping the undrained events (see :class:`KVSnapshot`); None when the
        backend publishes no KV events (the default). Thread-safe."""
        return None

    def kv_block_counts(self) -> BlockCounts | None:
        """KV blocks by state, from a check of the block bookkeeping; None when
        not known (the default) or when the check fails. Thread-safe."""
        return None

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Finishes every in-flight sequence (ERROR: engine shut down), stops the
        backend's workers and frees the model. Mutates; idempotent."""
