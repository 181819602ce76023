"""Per-tenant limits: requests per minute, tokens per minute, requests in flight.

One :class:`TenantLimiter` per router owns every tenant's counters; it runs
on the router's event loop only. A request takes a :class:`Lease` when it
starts (:meth:`TenantLimiter.begin`: checks ``max_concurrent`` and
``requests_per_minute``, before any tokenizer call), reserves its tokens once
its prompt is tokenized (:meth:`Lease.reserve`: prompt tokens + the clamped
``max_tokens`` x ``n``, checked against ``tokens_per_minute``, before the
model's admission queue), and settles when it ends (:meth:`Lease.end`, in a
``finally``: success, cancel, error or deadline alike), which replaces the
reservation by the tokens really used, so unused reservation is returned at
once. Each tenant has its own counters: a tenant over a limit never touches
another's.

**Windows.** Both per-minute limits are a *sliding window log* (every charge
kept with its time for 60 s; see e.g. Cloudflare, "How we built rate
limiting capable of scaling to millions of domains", 2017, and the window
semantics of OpenAI's RPM/TPM limits): the usage is the exact sum of the
charges of the last 60 s, with no burst at a fixed window's edge and no
refill-rate approximation, and the retry hint is exact: the time until the
oldest charges leave the window and free enough room. Its memory is one
entry per request of the last minute (bounded by ``requests_per_minute``
for limited tenants), which is fine at a router's request rates.

**Refusals** (:class:`TenantLimited`, an :class:`AdmissionRefused`: the same
RESOURCE_EXHAUSTED with ``retry-after-ms`` / HTTP 429 ``Retry-After`` path
as the admission queue's refusals) name the limit, its value and the tenant.
The hint is the time the window needs to free enough; for
``max_concurrent``, the tenant's mean request duration less the age of its
oldest request in flight (1 s before any request ended). A reservation that
is larger than ``tokens_per_minute`` alone can never pass: OUT_OF_RANGE
naming ``max_tokens``.

What is billed: a request that ends with a finish reason (stop, length,
cancelled) is charged its prompt + completion tokens; a request that failed
(an error status, e.g. refused by the admission queue) only the completion
tokens it received, so that refusals do not burn a tenant's quota.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc

from services.common.sampling import InvalidRequestError
from services.router.admission import AdmissionRefused
from services.router.api_keys import TenantLimits

#: The sliding window of the per-minute limits (seconds).
WINDOW_S = 60.0
#: The ``max_concurrent`` hint before a tenant's first request ended (seconds).
INITIAL_DURATION_S = 1.0
#: Weight of the newest duration in the running mean.
DURATION_ALPHA = 0.2
LimitName = Literal["requests_per_minute", "tokens_per_minute", "max_concurrent"]


class TenantLimited(AdmissionRefused):
    """A tenant is over one of its limits (RESOURCE_EXHAUSTED with the hint).

    Attributes:
      limit: which (:data:`LimitName`, also ``reason``).
      tenant: the tenant's id.
    """

    def __init__(self, limit: LimitName, tenant: str, message: str,
                 retry_after_s: float) -> None:
        super().__init__(limit, message, retry_after_s)  # type: ignore[arg-type]
        self.limit = limit
        self.tenant = tenant


class LimitObserver:
    """Where the limiter reports (the router's metrics implement it)."""

    def limited(self, tenant: str, limit: str) -> None: ...
    def settled(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass(eq=False)
class _Charge:
    at: float
    amount: int


@dataclass
class _TenantState:
    requests: collections.deque[_Charge] = field(default_factory=collections.deque)
    tokens: collections.deque[_Charge] = field(default_factory=collections.deque)
    in_flight: dict[int, float] = field(default_factory=dict)  # lease id -> start
    reserved: int = 0  # tokens reserved by leases not yet ended
    mean_duration_s: float | None = None


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's counters now (tests and diagnostics)."""

    in_flight: int
    requests_in_window: int
    tokens_in_window: int
    reserved_tokens: int


class Lease:
    """One request's hold on its tenant's counters; :meth:`end` exactly once
    when the request ends (later calls do nothing)."""

    def __init__(self, limiter: TenantLimiter, tenant: str, limits: TenantLimits,
                 lease_id: int, request: _Charge) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self.limits = limits
        self._id = lease_id
        self._request = request
        self._charge: _Charge | None = None
        self.reserved = 0
        self.ended = False

    def reserve(self, prompt_tokens: int, max_tokens: int, *, prompt_field: str = "prompt",
                retrieval: bool = False) -> None:
        """Reserves ``prompt_tokens + max_tokens`` (the completion budget:
        ``max_tokens`` x ``n``) against ``tokens_per_minute``. A refusal for
        the prompt alone names ``prompt_field`` (the request's input field)
        and, with ``retrieval``, the passages.

        Raises:
          TenantLimited: ``tokens_per_minute`` would be passed (hint: when the
            window frees enough).
          InvalidRequestError: OUT_OF_RANGE: the reservation alone is larger
            than the limit, on ``sampling.max_tokens``, or on ``prompt`` when
            the prompt alone is (a smaller ``max_tokens`` cannot help).
        """
        self._limiter._reserve(self, prompt_tokens, max_tokens, prompt_field, retrieval)

    def refund_request(self) -> None:
        """Takes the request back out of ``requests_per_minute``: another
        lease counts it (a cascade leg that handed the request on before
        admission)."""
        with contextlib.suppress(ValueError):  # already left the window
            self._limiter._tenants[self.tenant].requests.remove(self._request)

    def end(self, *, prompt_tokens: int, completion_tokens: int, failed: bool) -> None:
        """Ends the request: frees its in-flight slot and settles its
        reservation to what is billed (see the module doc)."""
        if self.ended:
            return
        self.ended = True
        self._limiter._end(self, prompt_tokens, completion_tokens, failed)


class TenantLimiter:
    """Every tenant's counters (see the module doc). Single event loop only."""

    def __init__(self, *, observer: LimitObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._observer = observer if observer is not None else LimitObserver()
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._next_id = 0

    def begin(self, tenant: str, limits: TenantLimits, *, background: bool = False) -> Lease:
        """A lease for a new request of ``tenant`` under ``limits``.

        ``background``: work the router does on the tenant's behalf (a
        history summary), which must never cost the tenant's own requests a
        refusal: it holds no ``max_concurrent`` slot and is not counted in
        ``requests_per_minute`` (nor in the mean duration behind the hints);
        its tokens are reserved and billed as any request's. It still starts
        only when a foreground request could (the same refusals).

        Raises:
          TenantLimited: ``max_concurrent`` or ``requests_per_minute`` reached.
        """
        now = self._clock()
        state = self._tenants.setdefault(tenant, _TenantState())
        refused = _start_refusal(state, tenant, limits, now)
        if refused is not None:
            self._refuse(refused)
        request = _Charge(now, 0 if background else 1)
        self._next_id += 1
        if not background:
            state.requests.append(request)
            state.in_flight[self._next_id] = now
        return Lease(self, tenant, limits, self._next_id, request)

    def check(self, tenant: str, limits: TenantLimits, *, tokens: int) -> TenantLimited | None:
        """The refusal a request of ``tenant`` reserving ``tokens`` would meet
        now (:meth:`begin`, then :meth:`Lease.reserve`), or None; charges and
        counts nothing. Background work asks before it commits to anything
        (a history summary, :mod:`services.router.history.compactor`)."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        now = self._clock()
        return (_start_refusal(state, tenant, limits, now)
                or _token_refusal(state, tenant, limits.tokens_per_minute, tokens, now))

    def usage(self, tenant: str) -> TenantUsage:
        state = self._tenants.get(tenant, _TenantState())
        now = self._clock()
        _expire(state.requests, now)
        _expire(state.tokens, now)
        return TenantUsage(len(state.in_flight), sum(c.amount for c in state.requests),
                           sum(c.amount for c in state.tokens), state.reserved)

    # ------------------------------------------------------------ internals

    def _reserve(self, lease: Lease, prompt_tokens: int, max_tokens: int,
                 prompt_field: str = "prompt", retrieval: bool = False) -> None:
        if lease.ended or lease._charge is not None:
            raise RuntimeError("a lease reserves once, before it ends")
        limit = lease.limits.tokens_per_minute
        state = self._tenants[lease.tenant]
        now = self._clock()
        _expire(state.tokens, now)
        tokens = prompt_tokens + max_tokens
        if limit and tokens > limit:
            # QA: a RAG prompt of 1,421 tokens (its passages) was told to lower max_tokens (8).
            passages = " or retrieve fewer passages (retrieval.top_k)" if retrieval else ""
            field, fix = ((prompt_field, f"shorten the prompt{passages}")
                          if prompt_tokens >= limit
                          else ("sampling.max_tokens", "lower max_tokens (or n)"))
            raise InvalidRequestError(field, (
                f"the request needs {tokens} tokens ({prompt_tokens} prompt + {max_tokens} "
                f"completion: max_tokens x n), more than the tokens_per_minute limit of "
                f"tenant {lease.tenant!r} ({limit}); {fix}"), grpc.StatusCode.OUT_OF_RANGE)
        refused = _token_refusal(state, lease.tenant, limit, tokens, now)
        if refused is not None:
            self._refuse(refused)
        lease._charge = _Charge(now, tokens)
        lease.reserved = tokens
        state.tokens.append(lease._charge)
        state.reserved += tokens

    def _end(self, lease: Lease, prompt_tokens: int, completion_tokens: int,
             failed: bool) -> None:
        state = self._tenants[lease.tenant]
        started = state.in_flight.pop(lease._id, None)  # None: a background lease
        now = self._clock()
        if not failed and started is not None:
            duration = now - started
            state.mean_duration_s = duration if state.mean_duration_s is None else (
                DURATION_ALPHA * duration + (1 - DURATION_ALPHA) * state.mean_duration_s)
        billed_prompt = 0 if failed else prompt_tokens
        if lease._charge is not None:
            state.reserved -= lease.reserved
            lease._charge.amount = billed_prompt + completion_tokens
            lease.reserved = 0
        elif billed_prompt + completion_tokens:
            state.tokens.append(_Charge(now, billed_prompt + completion_tokens))
        self._observer.settled(lease.tenant, billed_prompt, completion_tokens)
        if not state.in_flight and not state.requests and not state.tokens:
            del self._tenants[lease.tenant]  # idle: forget it

    def _refuse(self, refused: TenantLimited) -> None:
        self._observer.limited(refused.tenant, refused.limit)
        raise refused


def _limited(tenant: str, limit: LimitName, message: str, wait_s: float) -> TenantLimited:
    refused = TenantLimited(limit, tenant, message, wait_s)
    refused.message = f"{message}; retry after {refused.retry_after_ms} ms"
    refused.args = (refused.message,)
    return refused


def _start_refusal(state: _TenantState, tenant: str, limits: TenantLimits,
                   now: float) -> TenantLimited | None:
    """Why a new request of ``tenant`` may not start now (``max_concurrent``,
    ``requests_per_minute``), or None."""
    _expire(state.requests, now)
    if limits.max_concurrent and len(state.in_flight) >= limits.max_concurrent:
        oldest = min(state.in_flight.values())
        mean = state.mean_duration_s or INITIAL_DURATION_S
        return _limited(tenant, "max_concurrent", (
            f"tenant {tenant!r} has {len(state.in_flight)} requests in flight, its "
            f"max_concurrent limit is {limits.max_concurrent}"), max(mean - (now - oldest), 0))
    if limits.requests_per_minute and len(state.requests) >= limits.requests_per_minute:
        wait = _time_to_free(state.requests, 1, limits.requests_per_minute, now)
        return _limited(tenant, "requests_per_minute", (
            f"tenant {tenant!r} made {len(state.requests)} requests in the last "
            f"{WINDOW_S:g} s, its requests_per_minute limit is "
            f"{limits.requests_per_minute}"), wait)
    return None


def _token_refusal(state: _TenantState, tenant: str, limit: int, tokens: int,
                   now: float) -> TenantLimited | None:
    """Why ``tokens`` more would pass ``tokens_per_minute`` (0: none) now, or None."""
    _expire(state.tokens, now)
    used = sum(c.amount for c in state.tokens)
    if not limit or used + tokens <= limit:
        return None
    return _limited(tenant, "tokens_per_minute", (
        f"tenant {tenant!r} used or reserved {used} tokens in the last "
        f"{WINDOW_S:g} s; {tokens} more (prompt + max_tokens) would pass its "
        f"tokens_per_minute limit of {limit}"), _time_to_free(state.tokens, tokens, limit, now))


def _expire(charges: collections.deque[_Charge], now: float) -> None:
    while charges and charges[0].at <= now - WINDOW_S:
        charges.popleft()


def _time_to_free(charges: collections.deque[_Charge], needed: int, limit: int,
                  now: float) -> float:
    """Seconds until the charges left in the window leave room for ``needed``
    (``needed <= limit``): the oldest leave first."""
    used = sum(c.amount for c in charges)
    wait = 0.0
    for charge in charges:
        if used + needed <= limit:
            break
        used -= charge.amount
        wait = charge.at + WINDOW_S - now
    return max(wait, 0.0)


__all__ = ["Lease", "LimitObserver", "TenantLimited", "TenantLimiter", "TenantUsage",
           "WINDOW_S"]
