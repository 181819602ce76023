"""The load: when each request is sent, how many run at once, when to stop.

Arrivals follow ``vllm bench serve``: the gaps between requests are drawn
from a gamma distribution with shape ``burstiness`` and mean
``1 / request_rate``. Burstiness 1 is a Poisson process; below 1 the
arrivals are burstier, above 1 more regular. ``request_rate = inf`` sends
every request at once. ``max_concurrency`` caps the requests in flight
(a semaphore); with ``request_rate = inf`` it is a fixed number of clients,
each sending its next request as soon as the previous one ends.

Bounds: the run stops issuing requests after ``len(requests)`` requests or
``duration_s`` seconds, whichever comes first; requests already in flight
run to their end and count. Warm-up requests run before the clock starts
and are not counted.

Synthetic conversations (:func:`run_chats`) run closed loop instead: a
request's prompt holds the replies to the turns before it, so a turn is sent
only when the previous one has ended. ``max_concurrency`` is the number of
users; the conversations are dealt to them in turn (user ``u`` gets
conversations ``u``, ``u + users``, ...), and each user keeps all of its
conversations open, sending turn ``t`` of each of them, then turn ``t + 1``
of each (a user switching between open chats, or an agent serving several):
between two turns of one conversation, every other conversation takes about
one turn, so a KV cache smaller than all the conversations together
does not hold a returning conversation's history. There are no arrivals
(``request_rate`` must be ``inf``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from services.bench.backends import Backend
from services.bench.datasets import BenchRequest, ChatScript
from services.bench.records import RequestOutput
from services.bench.tokenizer import BenchTokenizer


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """How the requests are sent.

    Attributes:
      request_rate: mean requests per second; ``math.inf``: all at once.
      burstiness: gamma shape of the gaps (1: Poisson).
      max_concurrency: most requests in flight; ``None``: no cap.
      duration_s: stop issuing after this many seconds; ``None``: no bound.
      num_warmups: requests sent (and awaited) before the measured run.
    """

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    num_warmups: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass(slots=True)
class LoadResult:
    """What a measured run produced.

    Attributes:
      outputs: one record per request sent, in sending order.
      duration_s: from the first send to the end of the last request.
      not_sent: requests left unsent because the duration bound passed.
      start_time: ``time.perf_counter()`` at the start.
    """

    outputs: list[RequestOutput]
    duration_s: float
    not_sent: int
    start_time: float


def arrival_offsets(count: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Send times in seconds after the start; the first request goes at 0.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)), so their mean
    is ``1/rate`` and their coefficient of variation ``1/sqrt(burstiness)``.
    """
    if count <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def cycle(requests: Sequence[BenchRequest], count: int) -> Iterator[BenchRequest]:
    """``count`` requests taken from ``requests`` in order, wrapping around."""
    for i in range(count):
        yield requests[i % len(requests)]


async def run_warmup(backend: Backend, requests: Sequence[BenchRequest],
                     settings: LoadSettings) -> list[RequestOutput]:
    """Sends ``num_warmups`` requests (the dataset's first ones, wrapping), at most
    ``max_concurrency`` at a time; returns their records (not counted)."""
    if settings.num_warmups == 0 or not requests:
        return []
    limit = asyncio.Semaphore(settings.max_concurrency or settings.num_warmups)

    async def one(request: BenchRequest) -> RequestOutput:
        async with limit:
            return await backend.send(request)

    return list(await asyncio.gather(*(one(r) for r in cycle(requests, settings.num_warmups))))


async def run_load(backend: Backend, requests: Sequence[BenchRequest], settings: LoadSettings,
                   rng: np.random.Generator,
                   on_done: Callable[[RequestOutput], None] | None = None) -> LoadResult:
    """Sends ``requests`` as ``settings`` says and waits for every one sent.

    Args:
      on_done: called with each record as its request ends (the progress bar).
    """
    offsets = arrival_offsets(len(requests), settings.request_rate, settings.burstiness, rng)
    limit = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    start = time.perf_counter()
    deadline = start + settings.duration_s if settings.duration_s is not None else math.inf

    async def one(request: BenchRequest) -> RequestOutput | None:
        if limit is None:
            output = await backend.send(request)
        else:
            async with limit:
                if time.perf_counter() >= deadline:
                    return None  # waited for a slot past the bound: never sent
                output = await backend.send(request)
        output.tag, output.turn = request.tag, request.turn
        if on_done is not None:
            on_done(output)
        return output

    tasks: list[asyncio.Task[RequestOutput | None]] = []
    try:
        for request, offset in zip(requests, offsets, strict=True):
            send_at = start + offset
            if send_at >= deadline:
                break
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    end = time.perf_counter()
    outputs = [r for r in results if r is not None]
    return LoadResult(outputs, end - start, len(requests) - len(outputs), start)


async def run_chats(backend: Backend, chats: Sequence[ChatScript], tokenizer: BenchTokenizer,
                    settings: LoadSettings,
                    on_done: Callable[[RequestOutput], None] | None = None) -> LoadResult:
    """Runs ``chats`` closed loop: ``settings.max_concurrency`` users (default:
    one per conversation), each sending turn by turn across its conversations
    (see the module's docstring), every prompt carrying the replies received.

    A conversation whose turn failed sends no further turn (it has no reply to
    carry); those turns, and every turn not begun by ``duration_s``, count in
    ``not_sent``.

    Raises:
      ValueError: ``request_rate`` is not ``inf``, or ``chats`` is empty.
    """
    if not math.isinf(settings.request_rate):
        raise ValueError("conversations run closed loop: request_rate must be inf")
    if not chats:
        raise ValueError("no conversations to run")
    users = min(settings.max_concurrency or len(chats), len(chats))
    start = time.perf_counter()
    deadline = start + settings.duration_s if settings.duration_s is not None else math.inf

    async def user(mine: Sequence[ChatScript]) -> list[RequestOutput]:
        replies: dict[str, list[str]] = {chat.id: [] for chat in mine}
        outputs: list[RequestOutput] = []
        for turn in range(max(len(chat.user_turns) for chat in mine)):
            for chat in mine:
                if len(replies[chat.id]) != turn or turn >= len(chat.user_turns):
                    continue  # finished, or stopped by a failed turn
                if time.perf_counter() >= deadline:
                    return outputs
                request = chat.request(tokenizer, replies[chat.id])
                output = await backend.send(request)
                output.tag, output.turn = request.tag, request.turn
                outputs.append(output)
                if output.success:
                    replies[chat.id].append(output.generated_text)
                if on_done is not None:
                    on_done(output)
        return outputs

    per_user = await asyncio.gather(*(user(chats[u::users]) for u in range(users)))
    end = time.perf_counter()
    outputs = sorted((o for mine in per_user for o in mine), key=lambda o: o.start_time)
    total = sum(len(chat.user_turns) for chat in chats)
    return LoadResult(outputs, end - start, total - len(outputs), start)
