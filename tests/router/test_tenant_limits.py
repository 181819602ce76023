"""Per-tenant limits on a fake clock: exact sliding-window refusals and hints,
settlement that returns unused reservation, tenants kept apart, and (a
property) counters back to zero once every request ended."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling import InvalidRequestError
from services.router.admission import AdmissionRefused
from services.router.api_keys import TenantLimits
from services.router.tenant_limits import (
    WINDOW_S,
    Lease,
    LimitObserver,
    TenantLimited,
    TenantLimiter,
    TenantUsage,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Seen(LimitObserver):
    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []
        self.billed: list[tuple[str, int, int]] = []

    def limited(self, tenant: str, limit: str) -> None:
        self.refused.append((tenant, limit))

    def settled(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.billed.append((tenant, prompt_tokens, completion_tokens))


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_tokens_per_minute_refuses_with_the_time_the_window_frees(clock: Clock) -> None:
    seen = Seen()
    limiter = TenantLimiter(clock=clock, observer=seen)
    limits = TenantLimits(tokens_per_minute=100)
    first = limiter.begin("a", limits)
    first.reserve(10, 50)  # 60 reserved at t=0
    clock.now += 5
    second = limiter.begin("a", limits)
    with pytest.raises(TenantLimited) as info:
        second.reserve(10, 40)  # 60 + 50 > 100
    err = info.value
    assert isinstance(err, AdmissionRefused) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.limit == "tokens_per_minute" and err.tenant == "a"
    assert "tenant 'a'" in err.message and "tokens_per_minute limit of 100" in err.message
    assert err.retry_after_s == pytest.approx(WINDOW_S - 5)  # when the first charge leaves
    assert seen.refused == [("a", "tokens_per_minute")]
    second.end(prompt_tokens=0, completion_tokens=0, failed=True)
    # The first ends early, using 10 + 12: the unused 38 come back at once.
    first.end(prompt_tokens=10, completion_tokens=12, failed=False)
    assert limiter.usage("a").tokens_in_window == 22 and limiter.usage("a").reserved_tokens == 0
    third = limiter.begin("a", limits)
    third.reserve(10, 60)  # 22 + 70 <= 100
    clock.now += WINDOW_S - 4  # the first request's 22 tokens leave the window
    assert limiter.usage("a").tokens_in_window == 70


def test_requests_per_minute_is_a_sliding_window(clock: Clock) -> None:
    limiter = TenantLimiter(clock=clock)
    limits = TenantLimits(requests_per_minute=2)
    for step in (0, 20):
        clock.now += step
        limiter.begin("a", limits).end(prompt_tokens=1, completion_tokens=1, failed=False)
    clock.now += 10
    with pytest.raises(TenantLimited) as info:
        limiter.begin("a", limits)
    assert info.value.limit == "requests_per_minute"
    assert info.value.retry_after_s == pytest.approx(WINDOW_S - 30)
    clock.now += WINDOW_S - 30
    limiter.begin("a", limits)  # the oldest left: room for one


def test_max_concurrent_counts_requests_in_flight(clock: Clock) -> None:
    limiter = TenantLimiter(clock=clock)
    limits = TenantLimits(max_concurrent=1)
    lease = limiter.begin("a", limits)
    with pytest.raises(TenantLimited) as info:
        limiter.begin("a", limits)
    assert info.value.limit == "max_concurrent" and "max_concurrent limit is 1" in str(info.value)
    lease.end(prompt_tokens=0, completion_tokens=0, failed=False)
    lease.end(prompt_tokens=0, completion_tokens=0, failed=False)  # idempotent
    limiter.begin("a", limits)


def test_background_work_holds_no_slot_and_no_request_but_its_tokens(clock: Clock) -> None:
    limiter = TenantLimiter(clock=clock)
    limits = TenantLimits(max_concurrent=1, requests_per_minute=1, tokens_per_minute=100)
    summary = limiter.begin("a", limits, background=True)
    summary.reserve(10, 20)
    turn = limiter.begin("a", limits)  # the tenant's own request still starts
    assert limiter.usage("a") == TenantUsage(in_flight=1, requests_in_window=1,
                                             tokens_in_window=30, reserved_tokens=30)
    summary.end(prompt_tokens=10, completion_tokens=5, failed=False)
    turn.end(prompt_tokens=0, completion_tokens=0, failed=False)
    assert limiter.usage("a").tokens_in_window == 15  # billed as any request
    with pytest.raises(TenantLimited):  # but it starts only when a request could
        limiter.begin("a", limits, background=True)


def test_a_tenant_over_its_limit_does_not_touch_another(clock: Clock) -> None:
    limiter = TenantLimiter(clock=clock)
    small = TenantLimits(tokens_per_minute=10, max_concurrent=1)
    limiter.begin("a", small).reserve(5, 5)
    with pytest.raises(TenantLimited):
        limiter.begin("a", small)
    lease = limiter.begin("b", small)
    lease.reserve(5, 5)
    assert limiter.usage("b").reserved_tokens == 10


def test_a_reservation_larger_than_the_limit_is_out_of_range(clock: Clock) -> None:
    limiter = TenantLimiter(clock=clock)
    lease = limiter.begin("a", TenantLimits(tokens_per_minute=10))
    with pytest.raises(InvalidRequestError) as info:
        lease.reserve(4, 7)
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.field == "sampling.max_tokens"
    assert "tokens_per_minute limit of tenant 'a' (10)" in str(info.value)
    # QA: a prompt over the limit on its own (a RAG prompt's passages) names the
    # prompt; lowering max_tokens could not help.
    with pytest.raises(InvalidRequestError) as info:
        limiter.begin("b", TenantLimits(tokens_per_minute=10)).reserve(
            12, 2, prompt_field="chat.messages", retrieval=True)
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.field == "chat.messages"
    assert "(12 prompt + 2 completion: max_tokens x n)" in str(info.value)
    assert "retrieval.top_k" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:  # no retrieval: no passages to cut
        limiter.begin("c", TenantLimits(tokens_per_minute=10)).reserve(12, 2)
    assert info.value.field == "prompt" and "retrieval" not in str(info.value)


def test_a_failed_request_is_billed_only_its_completion_tokens(clock: Clock) -> None:
    seen = Seen()
    limiter = TenantLimiter(clock=clock, observer=seen)
    lease = limiter.begin("a", TenantLimits(tokens_per_minute=1000))
    lease.reserve(100, 100)
    lease.end(prompt_tokens=100, completion_tokens=3, failed=True)
    assert limiter.usage("a").tokens_in_window == 3 and seen.billed == [("a", 0, 3)]


# One request's life: (tenant, prompt, max_tokens, used share, how it ends).
requests = st.lists(st.tuples(
    st.sampled_from(["a", "b", "c"]), st.integers(0, 50), st.integers(0, 50),
    st.floats(0, 1), st.sampled_from(["finish", "cancel", "error", "no_reserve"]),
    st.integers(0, 3)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(requests, st.randoms(use_true_random=False))
def test_counters_return_to_zero_when_every_request_ended(plan, rnd) -> None:
    clock = Clock()
    limiter = TenantLimiter(clock=clock)
    limits = TenantLimits(requests_per_minute=20, tokens_per_minute=300, max_concurrent=4)
    open_leases: list[tuple[Lease, int, int, float, str]] = []
    billed: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    for tenant, prompt, max_tokens, share, ending, advance in plan:
        clock.now += advance * 0.01  # well inside the window: nothing expires
        try:
            lease = limiter.begin(tenant, limits)
        except TenantLimited:
            continue
        if ending != "no_reserve":
            try:
                lease.reserve(prompt, max_tokens)
            except (TenantLimited, InvalidRequestError):
                lease.end(prompt_tokens=prompt, completion_tokens=0, failed=True)
                continue
        open_leases.append((lease, prompt, max_tokens, share, ending))
        if rnd.random() < 0.5:  # end some in between, in random order
            lease, prompt, max_tokens, share, ending = open_leases.pop(
                rnd.randrange(len(open_leases)))
            billed[lease.tenant] += end(lease, prompt, max_tokens, share, ending)
    rnd.shuffle(open_leases)
    for lease, prompt, max_tokens, share, ending in open_leases:
        billed[lease.tenant] += end(lease, prompt, max_tokens, share, ending)
    for tenant, total in billed.items():
        usage = limiter.usage(tenant)
        assert usage.in_flight == 0 and usage.reserved_tokens == 0
        assert usage.tokens_in_window == total


def end(lease: Lease, prompt: int, max_tokens: int, share: float, ending: str) -> int:
    completion = int(max_tokens * share)
    failed = ending == "error"
    lease.end(prompt_tokens=prompt, completion_tokens=completion, failed=failed)
    return completion + (0 if failed else prompt)


def test_a_refunded_request_leaves_requests_per_minute() -> None:
    """A cascade leg that hands its request on before admission (the prompt
    rule) is not counted: the leg that serves it is."""
    limiter = TenantLimiter(clock=Clock())
    limits = TenantLimits(requests_per_minute=1)
    lease = limiter.begin("t", limits)
    lease.refund_request()
    lease.end(prompt_tokens=5, completion_tokens=0, failed=True)
    limiter.begin("t", limits).end(prompt_tokens=5, completion_tokens=3, failed=False)
    assert limiter.usage("t").requests_in_window == 1
    with pytest.raises(TenantLimited):
        limiter.begin("t", limits)


def test_check_says_what_begin_and_reserve_would_refuse_and_charges_nothing() -> None:
    limiter = TenantLimiter(clock=Clock())
    limits = TenantLimits(max_concurrent=1, tokens_per_minute=100)
    assert limiter.check("t", limits, tokens=50) is None  # a tenant never seen
    lease = limiter.begin("t", limits)
    lease.reserve(10, 40)
    refused = limiter.check("t", limits, tokens=10)
    assert refused is not None and refused.limit == "max_concurrent"
    lease.end(prompt_tokens=10, completion_tokens=40, failed=False)
    assert limiter.check("t", limits, tokens=50) is None
    refused = limiter.check("t", limits, tokens=51)
    assert refused is not None and refused.limit == "tokens_per_minute"
    # the checks charged nothing: one request, the one that ran
    assert (limiter.usage("t").requests_in_window, limiter.usage("t").in_flight) == (1, 0)
