"""Admission control at the router: bounded queues per traffic class, a
concurrency cap per replica, fair dispatch between tenants, and an honest
retry hint.

One :class:`AdmissionController` per served model owns every piece of
admission state (the queues, the running set, the tenants' counters); it runs
on the router's event loop and is never touched from another thread.

**Admitting.** :meth:`AdmissionController.admit` either grants a running slot
at once (nothing of its class or a higher one is queued and a replica has
room), queues the request, or refuses it at once with
:class:`AdmissionRefused` (RESOURCE_EXHAUSTED, no engine call):

* ``queue_full``: the class's queue holds ``max_queued_requests`` requests;
* ``queued_tokens``: the class's queued prompt tokens would pass
  ``max_queued_prompt_tokens``;
* ``deadline``: the call's deadline is before the predicted queue wait plus
  the request's predicted prefill time. RESOURCE_EXHAUSTED, not
  DEADLINE_EXCEEDED: the cause is the mesh's load, not the client's clock, a
  retry after the hint can succeed, and standard retry policies (gRPC's,
  Envoy's ``retry_on: resource-exhausted``) treat it so.

**Claiming before the size is known.** :meth:`AdmissionController.claim`
takes the place :meth:`~AdmissionController.admit` would (a slot, or a queue
position, or a refusal) without waiting; :meth:`Claim.wait` then awaits the
slot. A retrieval-augmented request claims at arrival, before its prompt
exists (0 prompt tokens, its ``max_tokens``), so it queues while its passages
are retrieved, and :meth:`Claim.settle` gives the exact size once it is
tokenized: a queued place is then checked for ``queued_tokens`` and
``deadline`` as a sized one is at ``admit``; a granted one's KV reservation
and tenant counter move to the size, and its prefill is timed from then.
While unsized, a queued place counts no prompt tokens and a granted one
reserves only its ``max_tokens``.

**Capacity.** The router keeps at most ``max_running`` requests running over
the replicas in service (the sum of each replica's cap:
``--max-running-per-replica``, else the replica's ``max_num_seqs``) and
reserves each running request's prompt + ``max_tokens`` against those
replicas' KV capacity times ``kv_overcommit`` (TensorRT-LLM's
``GUARANTEED_NO_EVICT`` is 1.0; more lets the engine preempt and recompute
when blocks run short). A request alone always fits. Running requests are
counted per replica, as Dynamo's and llm-d's routers count a worker's
in-flight requests: the pipeline tells a granted slot where it runs
(:meth:`Ticket.place`), and a request running on a replica that left the set
(draining, removed, failed) holds none of the slots or KV of the replicas
that remain; it only runs out on its own replica (QA: with two 8-slot
engines, one draining with 8 running, nothing was admitted until those 8
ended while the other engine sat idle). A granted request not placed yet
counts against the replicas in service. Slots count engine sequences, as
the replicas' ``max_num_seqs`` does: a request with ``n`` choices takes
``n`` (at most a whole replica's; QA: four n=2 requests on two 2-slot
engines were all admitted, and two of them waited ~10 s inside the engines,
out of the queue and its hint). The free capacity is counted per
replica: the sum over the replicas in service of their cap less the requests
placed there (never below 0 on one replica), less the granted requests not
placed yet; the KV limit likewise, with each replica's KV capacity times
``kv_overcommit``. So a request the routing placed on a replica beyond its
slots, to wait there for the replica that holds its prefix, takes no slot or
KV of another replica (QA: two 2-slot engines, "a" full, "b" running one; a
question waiting on "a" made an unrelated request queue in the router for
0.3-0.9 s beside "b"'s free slot). The router, not the engine, then
holds the queue, so the order below decides who runs next; the engine's own waiting limit stays a backstop.
An interactive request counts only the interactive requests against the cap
and the KV limit: when batch requests fill them, it is dispatched at once
and the engine preempts a batch sequence for it (the engine's preemption for
priority; the preempted sequence resumes from its cached blocks when a slot
frees), so interactive traffic never waits for a batch request to end.

**Dispatch order** when a slot frees (or the batch window closes):

1. the aging bound: a request queued ``max_queue_wait`` or longer goes first
   (oldest first), whatever its class or tenant;
2. interactive before batch;
3. within a class, tenants by *virtual token counter* (VTC: Sheng et al.,
   "Fairness in Serving Large Language Models", OSDI 2024): each tenant's
   counter grows by ``w_prompt`` per prompt token at dispatch and ``w_output``
   per completion token at the end (1 and 2, the weights of the paper's
   evaluation); the tenant with the smallest counter goes next, and a tenant
   that becomes active is lifted to the smallest counter of the tenants
   already queued, so idle time banks no credit. Ties go to the earliest
   arrival. Requests without ``x-tenant-id`` share the tenant ``""``: one
   tenant is plain FIFO;
4. within a tenant, FIFO.

Batch-class requests wait up to ``batch_window`` after the oldest queued
batch request arrived, so that a burst enters the engine together (one
prefill step) instead of one by one.

**The retry hint** (``retry-after-ms``) is the predicted time until the
refused request's class has a free queue position: the k-th slot to free,
where k is the number of requests that must be dispatched before one of this
class is (only the requests counted against the replicas in service: one
ending on a replica that left frees nothing here; free slots there count as
dispatches that need no wait; on a replica holding more requests than its
slots, its soonest ends go to the requests waiting there and free nothing
for the queue). Each running request's end is its expected tokens left at
its own measured decode rate (time per output token since its first token;
the model's running mean before it has one), plus its prefill time while it
has no token yet (prompt tokens times the measured prefill time per token).

Its tokens left follow its own progress, per sequence (choice): the pipeline
places the ticket with its stream's record (:meth:`Ticket.place`,
:class:`~services.router.engine_client.OpenRequest`: tokens each choice
generated). A sequence that generated ``g`` of its ``max_tokens`` ``m`` and
runs on is expected to end as the finished sequences that ran longer than
it has did: ``m`` times their mean share of ``max_tokens`` (the last
:data:`LENGTH_SAMPLES` finished sequences), less ``g``; when none ran that
long (or none finished yet), at ``m``, the bound (exact with ``ignore_eos``).
A request of ``n`` choices ends with its longest: its tokens left times
``n`` at its measured rate (which counts every choice's tokens). A residual life, not a mean length: the mean share of all finished requests
(the earlier estimator) made every stream past it look one token from its
end (QA: 10 short requests ended at EOS after a few of their 256 tokens,
then 4 streams of 800 tokens filled the slots: a 10 ms hint, the slot freed
3.96 s later). When k exceeds the slots that free, each further round adds
the mean measured service time. The hint is never under
:data:`MIN_QUEUE_RETRY_S` (100 ms): a slot frees at an engine step's end and
a retry pays a refusal's round trip and tokenization again. No other
constant: a mesh that drains faster gives a shorter hint.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import grpc

from services.common.sampling import Priority

if TYPE_CHECKING:
    from services.router.engine_client import OpenRequest

#: VTC weights (Sheng et al. 2024, section 5): a completion token costs twice a prompt token.
W_PROMPT = 1.0
W_OUTPUT = 2.0
#: Smoothing of the running means the hint uses (weight of the newest sample).
EWMA_ALPHA = 0.2
#: Before any request finished: time per output token and prefill time per
#: token assumed (seconds); replaced by measurements after the first one.
INITIAL_TPOT_S = 0.05
INITIAL_PREFILL_S_PER_TOKEN = 0.0005
#: Finished sequences whose length (share of ``max_tokens``) the hint learns from.
LENGTH_SAMPLES = 64
#: The retry-after-ms value is never below this (ms).
MIN_RETRY_AFTER_MS = 1
#: The queue's retry hint is never below this (seconds): a slot frees at an
#: engine step's end and a retry pays a refusal's round trip (27-30 ms through
#: Envoy measured here) and its tokenization again; a hint of a few ms (QA: 7
#: and 10 ms, a slot really freed 3.96 s later) only brings a burst of retries
#: that are refused again. gRPC retry policies' initial backoff and Envoy's
#: retry back-off (25 ms base, 250 ms max) are of this order; the HTTP
#: ``Retry-After`` (whole seconds) rounds it up to 1 s.
MIN_QUEUE_RETRY_S = 0.1
#: ... nor above this (ms).
MAX_RETRY_AFTER_MS = 600_000
#: Refusal reasons (the ``reason`` label of the rejected-requests metric).
RefusalReason = Literal["queue_full", "queued_tokens", "deadline"]


@dataclass(frozen=True)
class AdmissionConfig:
    """The router's admission flags (one set for every model it serves).

    Attributes:
      enabled: False: no router queue and no refusals (every request goes to an
        engine at once, as before admission control existed).
      max_queued_requests: most requests queued per model and traffic class.
      max_queued_prompt_tokens: most prompt tokens queued per model and class.
      max_running_per_replica: sequences the router keeps running on one
        replica; 0: the replica's ``max_num_seqs`` (or 256 if it does not say).
      kv_overcommit: running requests may reserve this many times the
        replicas' KV capacity (prompt + max_tokens each); 0: no KV check.
      batch_window_s: a batch-class request waits up to this long after the
        oldest queued batch request arrived, to be dispatched with others.
      max_queue_wait_s: the aging bound: a request queued this long is
        dispatched next, ahead of class and tenant order.
    """

    enabled: bool = True
    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 1_048_576
    max_running_per_replica: int = 0
    kv_overcommit: float = 1.0
    batch_window_s: float = 0.010
    max_queue_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0 or self.max_queued_prompt_tokens < 0:
            raise ValueError("the admission queue limits must be >= 0")
        if self.max_running_per_replica < 0:
            raise ValueError(
                f"max_running_per_replica must be >= 0 (0: the replica's max_num_seqs), "
                f"got {self.max_running_per_replica}")
        if self.kv_overcommit < 0:
            raise ValueError(f"kv_overcommit must be >= 0, got {self.kv_overcommit}")
        if self.batch_window_s < 0 or self.max_queue_wait_s <= 0:
            raise ValueError("batch_window_s must be >= 0 and max_queue_wait_s > 0")


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica may run: ``max_num_seqs`` sequences (0: not known) and
    ``kv_capacity_tokens`` of KV cache (0: not known)."""

    max_num_seqs: int = 0
    kv_capacity_tokens: int = 0


#: Cap of a replica that reports no ``max_num_seqs`` (and no flag sets one).
DEFAULT_REPLICA_CAP = 256


@dataclass(frozen=True)
class Job:
    """What admission needs to know of a request (token counts after tokenization).

    ``max_tokens`` is the clamped completion budget; ``tenant`` the
    ``x-tenant-id`` ("" when none); ``sequences`` the engine sequence slots it
    holds while it runs (one per choice: a request with ``n`` choices runs
    ``n`` sequences, and replicas' caps count sequences).
    """

    request_id: str
    priority: Priority
    tenant: str
    prompt_tokens: int
    max_tokens: int
    sequences: int = 1

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


class AdmissionRefused(Exception):
    """The request is refused at once (RESOURCE_EXHAUSTED).

    Attributes:
      reason: a :data:`RefusalReason`.
      retry_after_s: when a retry is predicted to be admitted (seconds).
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, reason: RefusalReason, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_ms(self) -> int:
        return retry_after_ms(self.retry_after_s)


class NoReplicaServing(Exception):
    """A queued request ended because no replica is left to serve it (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


def retry_after_ms(seconds: float) -> int:
    """``seconds`` as the ``retry-after-ms`` value: whole ms, rounded up, clamped."""
    return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, math.ceil(seconds * 1e3)))


class AdmissionObserver:
    """Where the controller reports (the router's metrics implement it; the
    default does nothing)."""

    def queue_changed(self, priority: Priority, depth: int, tokens: int) -> None: ...
    def running_changed(self, running: int) -> None: ...
    def refused(self, priority: Priority, reason: str, retry_after_s: float) -> None: ...
    def dispatched(self, priority: Priority, tenant: str, waited_s: float) -> None: ...


@dataclass(eq=False)
class _Entry:
    job: Job
    arrived_at: float
    seq: int
    granted: asyncio.Future[Ticket]


@dataclass(eq=False)
class Ticket:
    """A granted running slot; :meth:`release` when the request ends (idempotent).

    The pipeline calls :meth:`on_tokens` as tokens leave, so the controller
    can predict when this slot frees.
    """

    job: Job
    dispatched_at: float
    _controller: AdmissionController | None
    #: The replica it runs on (the key :meth:`AdmissionController.set_replicas`
    #: knows it by), None until :meth:`place`.
    replica: Hashable | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    #: Tokens that left with the first delivery (several with speculative
    #: decoding or a first chunk): they took no time after ``first_token_at``.
    first_tokens: int = 0
    #: Its stream's record on its replica (:meth:`place`), None before.
    progress: OpenRequest | None = None
    _released: bool = field(default=False, repr=False)

    def on_tokens(self, count: int, now: float) -> None:
        """``count`` more completion tokens left at ``now`` (``time.monotonic()``)."""
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self.first_tokens = count
        self.last_token_at = now
        self.completion_tokens += count

    def measured_tpot_s(self) -> float | None:
        """Seconds per output token after the first delivery: the time since it
        over the tokens that came after it; None before a later delivery. (The
        first delivery's own tokens are not in the divisor: with several of them
        in it, e.g. accepted drafts, dividing by ``completion_tokens - 1`` made
        the rate look up to that many times faster and the retry hint as short.)"""
        later = self.completion_tokens - self.first_tokens
        if later <= 0 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / later

    def place(self, replica: Hashable, progress: OpenRequest | None = None) -> None:
        """The request now runs on ``replica`` (a key of the controller's
        :meth:`~AdmissionController.set_replicas`; again on each replica
        tried). From then it counts against that replica's capacity only.
        ``progress``: its stream's record there (tokens each choice generated,
        kept by the pipeline), from which the retry hint predicts its end."""
        self.progress = progress
        if not self._released and self._controller is not None:
            self._controller._place(self, replica)

    def release(self) -> None:
        """Frees the slot (and dispatches what it makes room for)."""
        if self._released:
            return
        self._released = True
        if self._controller is not None:
            self._controller._release(self)

    def generated_per_sequence(self) -> list[int]:
        """Tokens each of its sequences (choices) generated: the stream's own
        record (:meth:`place`), else one sequence of ``completion_tokens``."""
        if self.progress is not None and self.progress.generated:
            return list(self.progress.generated)
        return [self.completion_tokens]

    def _tokens_left(self, lengths: _LengthShares) -> int:
        """Expected tokens left, each sequence's from its own progress
        (:meth:`_LengthShares.tokens_left`), in the unit of the measured rate:
        that counts every sequence's tokens (one step yields one token of each
        of its ``n`` sequences), so the request ends after its longest
        sequence's tokens left times ``n`` of them."""
        progress = self.progress
        if progress is None or not progress.generated:
            return lengths.tokens_left(self.completion_tokens, self.job.max_tokens)
        left = [lengths.tokens_left(done, self.job.max_tokens)
                for i, done in enumerate(progress.generated) if i not in progress.finished]
        return max(left, default=1) * progress.choices

    def remaining_s(self, now: float, model_tpot_s: float, prefill_s_per_token: float,
                    lengths: _LengthShares) -> float:
        """Predicted seconds until this request ends (see the module doc)."""
        left = self._tokens_left(lengths)
        if self.first_token_at is None:
            prefill = self.job.prompt_tokens * prefill_s_per_token
            return max(self.dispatched_at + prefill - now, 0.0) + left * model_tpot_s
        tpot = self.measured_tpot_s()
        return left * (model_tpot_s if tpot is None else tpot)


@dataclass(eq=False)
class Claim:
    """A request's place in admission (:meth:`AdmissionController.claim`):
    a running slot granted, or a place in its class's queue."""

    _controller: AdmissionController
    _entry: _Entry

    @property
    def granted(self) -> bool:
        """Whether the slot is granted (:meth:`wait` returns at once)."""
        future = self._entry.granted
        return future.done() and not future.cancelled() and future.exception() is None

    @property
    def granted_at(self) -> float | None:
        """When the slot was granted (the controller's clock: ``time.monotonic()``
        in the router), or None while it is not."""
        return self._entry.granted.result().dispatched_at if self.granted else None

    async def wait(self, deadline: float | None = None) -> Ticket:
        """The running slot, once granted.

        Raises:
          TimeoutError: ``deadline`` (``time.monotonic()``) passed while queued
            (the place is given up).
          NoReplicaServing: the controller ended the queue
            (:meth:`AdmissionController.fail_queued`).
          asyncio.CancelledError: cancelled while queued (the place is given up).
        """
        if self.granted:  # at once (the usual case): no timer, no shield
            return self._entry.granted.result()
        clock = self._controller._clock
        try:
            async with asyncio.timeout_at(None if deadline is None
                                          else _loop_time(deadline, clock)):
                return await asyncio.shield(self._entry.granted)
        except BaseException:
            self.cancel()
            raise

    def settle(self, prompt_tokens: int, max_tokens: int, *,
               deadline: float | None = None) -> None:
        """The job's exact size, once its prompt is tokenized: a queued job is
        checked as :meth:`AdmissionController.claim` checks a sized one
        (queued tokens, deadline; a refusal gives the place up), a running
        one's KV reservation and tenant counter are moved to it.

        Raises:
          AdmissionRefused: ``queued_tokens`` or ``deadline``, with the hint.
        """
        job = dataclasses.replace(self._entry.job, prompt_tokens=prompt_tokens,
                                  max_tokens=max_tokens)
        self._controller._settle(self._entry, job, deadline)

    def cancel(self) -> None:
        """Gives the place up (idempotent): leaves the queue, or releases the slot."""
        self._controller._leave(self._entry)


def _granted(loop: asyncio.AbstractEventLoop, ticket: Ticket) -> asyncio.Future[Ticket]:
    future: asyncio.Future[Ticket] = loop.create_future()
    future.set_result(ticket)
    return future


class _Ewma:
    def __init__(self, initial: float) -> None:
        self.value = initial
        self.samples = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else (
            EWMA_ALPHA * sample + (1 - EWMA_ALPHA) * self.value)
        self.samples += 1


class _LengthShares:
    """How long sequences run: the share of their ``max_tokens`` that each of
    the last :data:`LENGTH_SAMPLES` finished sequences generated, and from it
    the expected tokens left of one still running (module doc, "retry hint")."""

    def __init__(self) -> None:
        self._shares: collections.deque[float] = collections.deque(maxlen=LENGTH_SAMPLES)

    def add(self, generated: int, max_tokens: int) -> None:
        """A sequence ended after ``generated`` of its ``max_tokens`` tokens."""
        if max_tokens > 0:
            self._shares.append(min(generated / max_tokens, 1.0))

    def tokens_left(self, generated: int, max_tokens: int) -> int:
        """Tokens a sequence that generated ``generated`` of ``max_tokens``
        and runs on is expected to generate still: ``max_tokens`` times the
        mean share of the finished sequences that ran longer than it has, less
        ``generated``; with none (none finished yet, or none ran this long),
        all of ``max_tokens`` less ``generated``, the bound. At least 1."""
        if max_tokens <= 0:
            return 1
        done = generated / max_tokens
        longer = [share for share in self._shares if share > done]
        share = sum(longer) / len(longer) if longer else 1.0
        return max(math.ceil(share * max_tokens) - generated, 1)


class _ClassQueue:
    """One traffic class's queue: FIFO per tenant, tenants by virtual counter."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, collections.deque[_Entry]] = {}
        self.counters: dict[str, float] = {}
        self.depth = 0
        self.tokens = 0

    def push(self, entry: _Entry) -> None:
        tenant = entry.job.tenant
        queue = self.by_tenant.get(tenant)
        if queue is None:
            # VTC's lift: a tenant that turns active starts at the least counter
            # of the active ones, never below its own (no credit for idle time).
            active = [self.counters[t] for t in self.by_tenant]
            floor = min(active) if active else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            queue = self.by_tenant[tenant] = collections.deque()
        queue.append(entry)
        self.depth += 1
        self.tokens += entry.job.prompt_tokens

    def remove(self, entry: _Entry) -> None:
        queue = self.by_tenant[entry.job.tenant]
        queue.remove(entry)
        self._forget(entry)

    def peek_next(self) -> _Entry:
        """The next entry by (tenant counter, arrival); the queue must not be empty."""
        tenant = min(self.by_tenant,
                     key=lambda t: (self.counters[t], self.by_tenant[t][0].seq))
        return self.by_tenant[tenant][0]

    def oldest(self) -> _Entry | None:
        heads = [q[0] for q in self.by_tenant.values()]
        return min(heads, key=lambda e: e.seq) if heads else None

    def charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        if len(self.counters) > 4096 and tenant not in self.by_tenant:
            # Bound the memory of tenants gone idle: forget all idle counters
            # (they would be lifted to the active floor on return anyway).
            for idle in [t for t in self.counters if t not in self.by_tenant]:
                del self.counters[idle]

    def _forget(self, entry: _Entry) -> None:
        tenant = entry.job.tenant
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]
        self.depth -= 1
        self.tokens -= entry.job.prompt_tokens


@dataclass
class _Tally:
    """Running requests of one replica (or of none yet): how many sequences, and the
    KV tokens they reserve; of those, the interactive ones."""

    running: int = 0
    kv: int = 0
    interactive_running: int = 0
    interactive_kv: int = 0

    def add(self, job: Job, sign: int = 1) -> None:
        """Counts ``job``'s sequences in (``sign`` 1) or out (-1)."""
        self.running += sign * job.sequences
        self.kv += sign * job.kv_tokens
        if job.priority is Priority.INTERACTIVE:
            self.interactive_running += sign * job.sequences
            self.interactive_kv += sign * job.kv_tokens

    def counted(self, interactive: bool) -> tuple[int, int]:
        """(running, KV tokens reserved): the interactive ones' only, or all."""
        if interactive:
            return self.interactive_running, self.interactive_kv
        return self.running, self.kv

    def merge(self, other: _Tally) -> None:
        self.running += other.running
        self.kv += other.kv
        self.interactive_running += other.interactive_running
        self.interactive_kv += other.interactive_kv


class AdmissionController:
    """Admission for one model (see the module doc). Single event loop only."""

    def __init__(self, config: AdmissionConfig, model: str,
                 replicas: Mapping[Hashable, ReplicaCapacity] | Iterable[ReplicaCapacity], *,
                 observer: AdmissionObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
          config: the limits.
          model: the model id (for messages).
          replicas: each replica's capacity by the key its tickets are placed
            with (:meth:`Ticket.place`); a plain iterable keys them 0, 1, ...
          observer: metrics sink.
          clock: ``time.monotonic`` (tests may pass another).
        """
        self.config = config
        self.model = model
        self._observer = observer if observer is not None else AdmissionObserver()
        self._clock = clock
        self._queues = {p: _ClassQueue() for p in Priority}
        self._running: set[Ticket] = set()
        # The running requests by the replica they run on (None: not placed yet).
        self._tallies: dict[Hashable | None, _Tally] = {None: _Tally()}
        self._capacity: dict[Hashable, ReplicaCapacity] = {}
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._tpot = _Ewma(INITIAL_TPOT_S)
        self._prefill = _Ewma(INITIAL_PREFILL_S_PER_TOKEN)
        self._lengths = _LengthShares()
        self._service = _Ewma(0.0)
        self.set_replicas(replicas)

    # ------------------------------------------------------------- limits

    def set_replicas(self, replicas: Mapping[Hashable, ReplicaCapacity]
                     | Iterable[ReplicaCapacity]) -> None:
        """Sets the replicas in service and their capacity, by the key tickets
        are placed with (a plain iterable: keys 0, 1, ...), e.g. when one
        leaves or rejoins; the requests running on a replica not in it stop
        counting. Dispatches what the new capacity makes room for."""
        self._capacity = dict(replicas if isinstance(replicas, Mapping)
                              else enumerate(replicas))
        for key in [k for k, t in self._tallies.items()
                    if k is not None and not t.running and k not in self._capacity]:
            del self._tallies[key]
        caps = list(self._capacity.values())
        per = self.config.max_running_per_replica
        self._slots = {k: per or r.max_num_seqs or DEFAULT_REPLICA_CAP
                       for k, r in self._capacity.items()}
        self.max_running = sum(self._slots.values())
        kv_known = (bool(caps) and all(r.kv_capacity_tokens for r in caps)
                    and self.config.kv_overcommit > 0)
        self._kv_limits = {k: int(r.kv_capacity_tokens * self.config.kv_overcommit)
                           if kv_known else 0 for k, r in self._capacity.items()}
        self.kv_limit = sum(self._kv_limits.values())
        self._pump()

    @property
    def num_running(self) -> int:
        """Requests running, on any replica (those in service or not)."""
        return len(self._running)

    @property
    def reserved_kv_tokens(self) -> int:
        """KV tokens (prompt + ``max_tokens``) the requests counted against the
        replicas in service reserve."""
        return self._held().kv

    @property
    def num_running_in_service(self) -> int:
        """Requests counted against the replicas in service (placed on one of
        them, or not placed yet)."""
        return self._held().running

    def queue_depth(self, priority: Priority) -> int:
        return self._queues[priority].depth

    def queued_tokens(self, priority: Priority) -> int:
        return self._queues[priority].tokens

    # --------------------------------------------------------------- admit

    async def admit(self, job: Job, *, deadline: float | None = None) -> Ticket:
        """A running slot for ``job``: at once, or after queueing
        (:meth:`claim`, then :meth:`Claim.wait`).

        Args:
          deadline: the call's ``time.monotonic()`` deadline, or None.

        Raises:
          AdmissionRefused: refused at once (queue full, queued tokens, deadline
            not meetable), with the retry hint.
          TimeoutError: the deadline passed while queued (the entry is gone).
          asyncio.CancelledError: cancelled while queued (the entry is gone).
        """
        return await self.claim(job, deadline=deadline).wait(deadline)

    def would_queue(self, job: Job) -> bool:
        """Whether ``job`` would wait for a running slot now: requests ahead of
        it, or no room for it (:meth:`claim` would queue it until one frees,
        or refuse it). The batch window is not such a wait: a BATCH job that
        would be granted once its window passed answers False. Pure."""
        if not self.config.enabled:
            return False
        return not (self._ahead_of_new(job) == 0 and self._fits(job))

    def claim(self, job: Job, *, deadline: float | None = None) -> Claim:
        """Takes ``job``'s place now, without waiting: a running slot when one
        is free (the module doc's rule), else a place in its class's queue.
        :meth:`Claim.wait` awaits the slot; :meth:`Claim.settle` gives the
        job's exact size when it was claimed before it was known (a request
        whose prompt waits for its retrieved passages queues meanwhile:
        ``job.prompt_tokens`` 0 until settled); :meth:`Claim.cancel` leaves.

        Raises:
          AdmissionRefused: refused at once (queue full, queued tokens, deadline
            not meetable with what ``job`` says), with the retry hint.
        """
        now = self._clock()
        loop = asyncio.get_running_loop()
        window = self.config.batch_window_s if job.priority is Priority.BATCH else 0.0
        if not self.config.enabled or (window == 0 and not self.would_queue(job)):
            return Claim(self, _Entry(job, now, -1, _granted(loop, self._grant(job, now))))
        queue = self._queues[job.priority]
        if queue.depth >= self.config.max_queued_requests:
            self._refuse_full(job.priority)
        self._check_queueable(job, now, deadline, ahead=self._ahead_of_new(job),
                              queued=queue.depth, queued_tokens=queue.tokens)
        entry = _Entry(job, now, next(self._seq), loop.create_future())
        queue.push(entry)
        self._queue_changed(job.priority)
        self._pump()
        return Claim(self, entry)

    def _check_queueable(self, job: Job, now: float, deadline: float | None, *, ahead: int,
                         queued: int, queued_tokens: int) -> None:
        """Refuses ``job`` for its class's queue, which holds ``queued`` other
        requests of ``queued_tokens`` prompt tokens: its prompt tokens over the
        limit, or its deadline before the predicted wait (``ahead`` requests
        dispatched first) plus its prefill. Raises AdmissionRefused."""
        cfg = self.config
        if queued_tokens + job.prompt_tokens > cfg.max_queued_prompt_tokens and queued:
            self._refuse(job.priority, "queued_tokens", (
                f"the router's {job.priority.name.lower()} queue for model {self.model!r} "
                f"holds {queued_tokens} prompt tokens; {job.prompt_tokens} more would pass "
                f"the limit of {cfg.max_queued_prompt_tokens}"))
        if deadline is not None:
            wait = self.predicted_wait_s(job.priority, extra_ahead=ahead)
            prefill = job.prompt_tokens * self._prefill.value
            if now + wait + prefill > deadline:
                self._refuse(job.priority, "deadline", (
                    f"the call's deadline ({max(deadline - now, 0) * 1e3:.0f} ms left) cannot "
                    f"be met: predicted queue wait {wait * 1e3:.0f} ms + prefill "
                    f"{prefill * 1e3:.0f} ms on model {self.model!r}"), wait)

    def _settle(self, entry: _Entry, job: Job, deadline: float | None) -> None:
        """:meth:`Claim.settle`: ``entry``'s job becomes ``job`` (its exact size)."""
        granted = entry.granted
        if granted.done():
            if not granted.cancelled() and granted.exception() is None:
                self._resize(granted.result(), job)
            return
        queue = self._queues[job.priority]
        ahead = sum(self._queues[p].depth for p in Priority if p < job.priority) + sum(
            1 for q in queue.by_tenant.values() for e in q if e.seq < entry.seq)
        try:
            self._check_queueable(job, self._clock(), deadline, ahead=ahead,
                                  queued=queue.depth - 1,
                                  queued_tokens=queue.tokens - entry.job.prompt_tokens)
        except AdmissionRefused:
            self._leave(entry)
            raise
        queue.tokens += job.prompt_tokens - entry.job.prompt_tokens
        entry.job = job
        self._queue_changed(job.priority)
        self._pump()

    def _resize(self, ticket: Ticket, job: Job) -> None:
        """A running ``ticket``'s reservation and its tenant's counter moved to
        ``job``'s size; its engine work starts now (the prefill rate is learnt
        from here)."""
        old = ticket.job
        if ticket not in self._running:
            ticket.job = job
            return
        tally = self._tallies[ticket.replica]
        tally.add(old, -1)
        tally.add(job)
        self._queues[job.priority].charge(job.tenant,
                                          W_PROMPT * (job.prompt_tokens - old.prompt_tokens))
        ticket.job = job
        ticket.dispatched_at = max(ticket.dispatched_at, self._clock())
        self._pump()

    def _leave(self, entry: _Entry) -> None:
        """:meth:`Claim.cancel`: ``entry`` leaves the queue, or its slot is released."""
        granted = entry.granted
        if granted.done():
            if not granted.cancelled() and granted.exception() is None:
                granted.result().release()
            # else: ended by fail_queued, which removed the entry
            return
        granted.cancel()
        queue = self._queues[entry.job.priority]
        queue.remove(entry)
        self._queue_changed(entry.job.priority)
        self._pump()

    def fail_queued(self, error: Exception) -> int:
        """Ends every queued request's :meth:`admit` with ``error`` (the router
        does so when no replica is left to serve them, so that nothing waits
        without a bound); returns how many."""
        failed = 0
        for priority, queue in self._queues.items():
            for entry in [e for q in queue.by_tenant.values() for e in q]:
                queue.remove(entry)
                if not entry.granted.done():
                    entry.granted.set_exception(error)
                    failed += 1
            self._queue_changed(priority)
        self._arm_timer(self._clock())
        return failed

    # ---------------------------------------------------------- the hint

    def predicted_wait_s(self, priority: Priority, *, extra_ahead: int = 0) -> float:
        """Predicted seconds until a request of ``priority`` would be dispatched
        after ``extra_ahead`` others (the module doc's prediction)."""
        now = self._clock()
        floor = self._window_left(now) if priority is Priority.BATCH else 0.0
        needed = 1 + extra_ahead  # our dispatch is the needed-th from now
        slots, kv = self._free()
        free = 0 if self.kv_limit and kv <= 0 else slots
        if needed <= free:
            return floor
        ends = self._slot_frees(now)
        if not ends:
            return floor
        rounds, index = divmod(needed - free - 1, len(ends))
        service = self._service.value or ends[-1]
        return max(ends[index] + rounds * service, floor)

    def _slot_frees(self, now: float) -> list[float]:
        """Predicted seconds until each slot of the replicas in service frees
        for a new request, soonest first: every counted request's predicted end
        (:meth:`Ticket.remaining_s`), less, on a replica holding more requests
        than its slots, as many of its soonest ends as it holds beyond them
        (those slots go to the requests placed there to wait)."""
        by_replica: dict[Hashable | None, list[float]] = collections.defaultdict(list)
        for ticket in self._running:
            if self._in_service(ticket.replica):
                end = ticket.remaining_s(now, self._tpot.value, self._prefill.value,
                                         self._lengths)
                by_replica[ticket.replica].extend([end] * ticket.job.sequences)
        frees: list[float] = []
        for replica, ends in by_replica.items():
            ends.sort()
            excess = 0 if replica is None else max(len(ends) - self._slots[replica], 0)
            frees.extend(ends[excess:])
        return sorted(frees)

    def retry_after_s(self, priority: Priority) -> float:
        """The hint for a request of ``priority`` refused now: until its class's
        queue has a free position (one of its class dispatched)."""
        ahead = sum(self._queues[p].depth for p in Priority if p < priority)
        return max(self.predicted_wait_s(priority, extra_ahead=ahead), MIN_QUEUE_RETRY_S)

    # ------------------------------------------------------------ internals

    def _ahead_of_new(self, job: Job) -> int:
        """Requests dispatched before a new ``job`` (FIFO estimate of its place)."""
        return sum(self._queues[p].depth for p in Priority if p <= job.priority)

    def refuse_if_full(self, priority: Priority) -> None:
        """Refuses a new request of ``priority`` before it is tokenized when
        :meth:`admit` would refuse it whatever its size: its class's queue is
        full (and not empty: someone is ahead of it). The router calls it
        first, so an overloaded mesh says no without a tokenizer or cache
        round trip.

        Raises:
          AdmissionRefused: ``queue_full``, with the retry hint.
        """
        depth = self._queues[priority].depth
        if self.config.enabled and depth and depth >= self.config.max_queued_requests:
            self._refuse_full(priority)

    def _refuse_full(self, priority: Priority) -> None:
        depth, limit = self._queues[priority].depth, self.config.max_queued_requests
        self._refuse(priority, "queue_full", (
            f"the router's {priority.name.lower()} queue for model {self.model!r} "
            f"is full ({depth} requests waiting, limit {limit})"))

    def _refuse(self, priority: Priority, reason: RefusalReason, message: str,
                wait_s: float | None = None) -> None:
        retry = (self.retry_after_s(priority) if wait_s is None
                 else max(wait_s, MIN_QUEUE_RETRY_S))
        self._observer.refused(priority, reason, retry)
        raise AdmissionRefused(reason, f"{message}; retry after {retry_after_ms(retry)} ms",
                               retry)

    def _fits(self, job: Job) -> bool:
        """Whether ``job`` may run now: a free slot and room in the KV limit
        (:meth:`_free`; a request alone always fits the KV limit). An
        interactive job counts only the interactive requests running: the
        engines preempt batch sequences for it (see the module doc)."""
        interactive = job.priority is Priority.INTERACTIVE
        slots, kv = self._free(interactive=interactive)
        # n choices need n slots (at most a whole replica's: more run there in turns)
        if slots < min(job.sequences, max(self._slots.values(), default=1)):
            return False
        if not self.kv_limit:
            return True
        alone = not self._held().counted(interactive)[0]
        return alone or kv >= job.kv_tokens

    def _free(self, *, interactive: bool = False) -> tuple[int, int]:
        """Free sequence slots and free KV tokens (prompt + ``max_tokens``
        reservations) over the replicas in service, counted per replica: the
        sum over them of their cap (KV limit) less what is placed on them,
        never below 0 on one replica, less what the granted requests not
        placed yet hold. A request placed on a replica beyond its slots
        (waiting there by the routing's choice) uses no other replica's slot
        or KV. May be negative (more granted, not placed, than free).
        ``interactive``: count only the interactive requests."""
        slots = kv = 0
        for replica, cap in self._slots.items():
            tally = self._tallies.get(replica) or _Tally()
            running, reserved = tally.counted(interactive)
            slots += max(cap - running, 0)
            kv += max(self._kv_limits[replica] - reserved, 0)
        running, reserved = self._tallies[None].counted(interactive)
        return slots - running, kv - reserved

    def _in_service(self, replica: Hashable | None) -> bool:
        """Whether requests on ``replica`` count against the capacity (it is in
        service, or None: not placed yet)."""
        return replica is None or replica in self._capacity

    def _held(self) -> _Tally:
        """The running requests counted against the replicas in service."""
        total = _Tally()
        for replica, tally in self._tallies.items():
            if self._in_service(replica):
                total.merge(tally)
        return total

    def _place(self, ticket: Ticket, replica: Hashable) -> None:
        """:meth:`Ticket.place`: ``ticket`` counts against ``replica`` from now."""
        if ticket not in self._running or ticket.replica == replica:
            return
        self._tallies[ticket.replica].add(ticket.job, -1)
        self._forget_tally(ticket.replica)
        self._tallies.setdefault(replica, _Tally()).add(ticket.job)
        ticket.replica = replica
        self._pump()  # placed on a replica that left: its slot is free here

    def _forget_tally(self, replica: Hashable | None) -> None:
        """Drops an empty tally of a replica not in service (bounded memory
        while replicas come and go)."""
        tally = self._tallies.get(replica)
        if tally is not None and not tally.running and not self._in_service(replica):
            del self._tallies[replica]

    def _window_left(self, now: float) -> float:
        oldest = self._queues[Priority.BATCH].oldest()
        if oldest is None:
            return self.config.batch_window_s
        return max(oldest.arrived_at + self.config.batch_window_s - now, 0.0)

    def _grant(self, job: Job, now: float) -> Ticket:
        ticket = Ticket(job, now, self)
        self._running.add(ticket)
        self._tallies[None].add(job)
        self._queues[job.priority].charge(job.tenant, W_PROMPT * job.prompt_tokens)
        self._observer.running_changed(len(self._running))
        return ticket

    def _release(self, ticket: Ticket) -> None:
        if ticket not in self._running:
            return
        self._running.discard(ticket)
        self._tallies[ticket.replica].add(ticket.job, -1)
        self._forget_tally(ticket.replica)
        now = self._clock()
        self._queues[ticket.job.priority].charge(
            ticket.job.tenant, W_OUTPUT * ticket.completion_tokens)
        self._learn(ticket, now)
        self._observer.running_changed(len(self._running))
        self._pump()

    def _learn(self, ticket: Ticket, now: float) -> None:
        """Updates the running means from a request that ended."""
        if ticket.first_token_at is None:
            return  # cancelled or failed before a token: it says nothing of the rates
        self._service.add(now - ticket.dispatched_at)
        if ticket.job.prompt_tokens:
            self._prefill.add((ticket.first_token_at - ticket.dispatched_at)
                              / ticket.job.prompt_tokens)
        tpot = ticket.measured_tpot_s()
        if tpot is not None:
            self._tpot.add(tpot)
        for generated in ticket.generated_per_sequence():
            self._lengths.add(generated, ticket.job.max_tokens)

    def _next_entry(self, now: float) -> _Entry | None:
        """The entry to dispatch next (module doc order), or None (none eligible)."""
        aged = [e for e in (q.oldest() for q in self._queues.values())
                if e is not None and now - e.arrived_at >= self.config.max_queue_wait_s]
        if aged:
            return min(aged, key=lambda e: e.seq)
        interactive = self._queues[Priority.INTERACTIVE]
        if interactive.depth:
            return interactive.peek_next()
        batch = self._queues[Priority.BATCH]
        if batch.depth and self._window_left(now) <= 0:
            return batch.peek_next()
        return None

    def _pump(self) -> None:
        """Dispatches queued entries while they fit; arms the batch-window timer."""
        now = self._clock()
        while True:
            entry = self._next_entry(now)
            if entry is None or not self._fits(entry.job):
                break
            queue = self._queues[entry.job.priority]
            queue.remove(entry)
            self._queue_changed(entry.job.priority)
            if entry.granted.cancelled():
                continue
            ticket = self._grant(entry.job, now)
            entry.granted.set_result(ticket)
            self._observer.dispatched(entry.job.priority, entry.job.tenant,
                                      now - entry.arrived_at)
        self._arm_timer(now)

    def _arm_timer(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = self._queues[Priority.BATCH]
        left = self._window_left(now)
        if batch.depth and left > 0 and not self._queues[Priority.INTERACTIVE].depth:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing queued
                self._timer = asyncio.get_running_loop().call_later(left, self._pump)

    def _queue_changed(self, priority: Priority) -> None:
        queue = self._queues[priority]
        self._observer.queue_changed(priority, queue.depth, queue.tokens)


def _loop_time(deadline: float, clock: Callable[[], float]) -> float:
    """``deadline`` (on ``clock``) on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - clock())


__all__ = [
    "AdmissionConfig", "AdmissionController", "AdmissionObserver", "AdmissionRefused",
    "Claim", "Job", "ReplicaCapacity", "Ticket", "retry_after_ms",
]
