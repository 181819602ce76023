"""The router's live view of one engine replica's load, from ``EngineService.StreamLoad``.

The engine sends its load at once, then whenever it changes (at most every
20 ms: about one decode step) and at least every 500 ms. :class:`LoadWatch`
keeps the latest report and when it arrived; :meth:`LoadWatch.current`
gives it with its age, so a router policy can treat a replica whose load is
older than :data:`STALE_AFTER_S` (two heartbeats missed) as saturated.

Between two reports the router adds what it dispatched itself
(:meth:`LoadWatch.dispatched`): the prompt tokens of requests it sent to the
replica after the last report, which the engine had not counted yet. Without
it, requests that arrive together all see the same report and pile onto the
one replica that looked cheapest. It likewise takes off the sequences of its
own streams that ended there after the last report (:meth:`LoadWatch.ended`),
which the report still counts, for the free-slot check
(:attr:`LoadView.sequences`): without it a slot that one of them freed
looked taken until the next report (CI: a holder's slot freed on one 2-slot
engine, the report 20-200 ms old still showed it full, the request went to
the other, full engine and waited there behind two streams, while admission,
which counts that free slot, gave it to batch requests that came later).
The kv_aware cost keeps them until the report (:mod:`services.router.routing`).

The call is opened again 0.1 s after it ends (doubling to 2 s while calls
keep failing on a live connection) with ``wait_for_ready``: while the engine
is unreachable the new call waits for the channel to connect instead of
failing at once, so the backoff does not grow while the engine is down, and a
restarted engine's load arrives as soon as the channel reconnects, when its
health probe brings it back into routing (:mod:`services.router.replicas`).

Threading: everything on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass

import grpc
import structlog

from llmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.tasks import cancel_and_wait
from services.common.wire.engine_info import LoadStats

log = structlog.get_logger()

#: Seconds after which a load report counts as stale (the engine sends one at
#: least every 0.5 s).
STALE_AFTER_S = 1.0
_RETRY_S = (0.1, 2.0)


@dataclass(frozen=True)
class LoadView:
    """A replica's load as the router sees it now.

    Attributes:
      load: the engine's last report (None before the first).
      age_s: seconds since it arrived (inf before the first).
      unreported_prefill_tokens: prompt tokens the router sent the replica
        after that report.
      unreported_sequences: sequences (a request's ``n`` choices each) the
        router sent the replica after that report: the report's unit.
      ended_unreported: sequences of this router's streams that ended on the
        replica after that report (the report still counts them).
    """

    load: LoadStats | None
    age_s: float
    unreported_prefill_tokens: int
    unreported_sequences: int = 0
    ended_unreported: int = 0

    @property
    def sequences(self) -> int:
        """Sequences on the replica by the report brought up to date (the
        free-slot check's count): its running + waiting, plus the sequences
        sent since, less this router's sequences that ended since; never
        below 0, and 0 before a report. Still a lagging count (a report sent just before a request reached
        the engine, or just after a stream ended there but before its end
        reached this router, misses it): the router's own open streams
        (:class:`~services.router.engine_client.EngineClient`) are exact."""
        if self.load is None:
            return 0
        return max(self.load.num_running + self.load.num_waiting + self.unreported_sequences
                   - self.ended_unreported, 0)

    @property
    def stale(self) -> bool:
        """True when the report is missing or older than :data:`STALE_AFTER_S`."""
        return self.load is None or self.age_s > STALE_AFTER_S


class LoadWatch:
    """Follows one replica's ``StreamLoad`` (see the module docstring).

    Args:
      channel: the replica's channel (shared with its other calls).
      target: ``host:port``, for logs.
    """

    def __init__(self, channel: grpc.aio.Channel, target: str) -> None:
        self._stub = engine_pb2_grpc.EngineServiceStub(channel)
        self.target = target
        self._load: LoadStats | None = None
        self._received_at = 0.0
        self._unreported = 0
        self._unreported_sequences = 0
        self._ended = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts following the stream (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), context=contextvars.Context(),
                                             name=f"load {self.target}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def dispatched(self, prompt_tokens: int, sequences: int = 1) -> None:
        """Counts a request sent to the replica, its prefill tokens and its
        ``sequences`` (its ``n`` choices: the engine reports each as running),
        until the replica's next report."""
        self._unreported += prompt_tokens
        self._unreported_sequences += sequences

    def ended(self, sequences: int) -> None:
        """Counts ``sequences`` of this router's streams that ended on the
        replica (their slots are free) until its next report."""
        self._ended += sequences

    def observe(self, load: LoadStats) -> None:
        """Takes a report (as the stream delivers it): what was sent and what
        ended before it is in it."""
        self._load = load
        self._received_at = asyncio.get_running_loop().time()
        self._unreported = self._unreported_sequences = self._ended = 0

    def current(self) -> LoadView:
        """The latest report, its age and what was sent and ended since. Pure."""
        age = (float("inf") if self._load is None
               else asyncio.get_running_loop().time() - self._received_at)
        return LoadView(self._load, age, self._unreported, self._unreported_sequences,
                        self._ended)

    async def _run(self) -> None:
        retry = _RETRY_S[0]
        while True:
            call = self._stub.StreamLoad(engine_pb2.StreamLoadRequest(), wait_for_ready=True)
            try:
                async for message in call:
                    self.observe(LoadStats.from_pb(message.load))
                    retry = _RETRY_S[0]
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # an engine without it
                    log.warning("engine_load_stream_unimplemented", engine=self.target)
                    return
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    log.warning("engine_load_stream_failed", engine=self.target,
                                code=err.code().name, details=err.details())
            finally:
                call.cancel()
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_S[1])
