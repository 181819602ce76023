"""The routing policies (services/router/routing.py): the kv_aware cost, the
order each policy gives, session affinity and the fallbacks, on real
EngineClient objects whose load views are set by the test."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from services.common.sampling import Priority
from services.common.step_profile import StepProfile
from services.common.wire.engine_info import LoadStats, ModelInfo
from services.router.engine_client import EngineClient, OpenRequest
from services.router.load_watch import LoadView
from services.router.metrics import RouterMetrics
from services.common.kv_events import PrefixMatch
from services.router.routing import (
    CachedPrefix,
    CostWeights,
    ReplicaPicker,
    RouteHint,
    RoutingPolicy,
    RoutingSession,
    SlotUse,
    replica_cost,
    slot_wait_s,
)

W = CostWeights(decode_horizon_tokens=256.0, kv_full_usage=0.95, affinity_slack_tokens=2048.0)
#: A measured profile of the shape one engine core gives (SmolLM2 int4):
#: 1.1 ms a prompt token, a decode step of r rows 9.2 ms + 1.6 ms a row.
ONE_CORE = StepProfile(1.1e-3, tuple(9.2e-3 + 1.6e-3 * rows for rows in range(1, 65)))


def view(running: int = 0, pending: int = 0, usage: float = 0.1, age: float = 0.1,
         unreported: int = 0, profile: StepProfile = StepProfile(),
         unreported_sequences: int = 0) -> LoadView:
    return LoadView(LoadStats(running, 0, usage, pending, profile), age, unreported,
                    unreported_sequences)


class FixedLoad:
    """Stands in for a LoadWatch: the view the test sets."""

    def __init__(self, current: LoadView) -> None:
        self.view = current
        self.dispatched_tokens = self.dispatched_sequences = 0

    def current(self) -> LoadView:
        return self.view

    def dispatched(self, tokens: int, sequences: int = 1) -> None:
        self.dispatched_tokens += tokens
        self.dispatched_sequences += sequences

    def ended(self, sequences: int) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[list[EngineClient]]:
    clients = [EngineClient(f"127.0.0.1:{9 + i}") for i in range(3)]  # never called
    for client in clients:
        client.load_watch = FixedLoad(view())  # type: ignore[assignment]
    yield clients
    for client in clients:
        await client.close()


def picker(policy: RoutingPolicy) -> ReplicaPicker:
    return ReplicaPicker(policy, None, RouterMetrics(CollectorRegistry()), W)


def matches(result: dict[EngineClient, int | CachedPrefix]
            ) -> asyncio.Task[dict[EngineClient, CachedPrefix]]:
    """A resolved lookup; an int is that many tokens in the replica's pool."""
    async def resolved() -> dict[EngineClient, CachedPrefix]:
        return {engine: CachedPrefix(held) if isinstance(held, int) else held
                for engine, held in result.items()}
    return asyncio.ensure_future(resolved())


def test_cost_prices_the_request_and_what_the_batch_loses_in_step_times() -> None:
    c, t = ONE_CORE.prefill_token_s, ONE_CORE.decode_step
    alone = view(profile=ONE_CORE)
    assert replica_cost(RouteHint(800, max_tokens=16), 0, alone, W) == \
        pytest.approx(800 * c + 16 * t(1))
    assert replica_cost(RouteHint(800, max_tokens=16), 768, alone, W) == \
        pytest.approx(32 * c + 16 * t(1))
    # 4 running + 2 sent since the report: the request waits for 150 queued
    # prompt tokens, then decodes in a batch of 7; the 6 lose its 32-token
    # prefill and 15 slower steps each.
    busy = view(running=4, pending=100, unreported=50, unreported_sequences=2, profile=ONE_CORE)
    assert replica_cost(RouteHint(800, max_tokens=16), 768, busy, W) == pytest.approx(
        (150 + 32) * c + 16 * t(7) + 6 * (32 * c + 15 * (t(7) - t(6))))
    # n choices add n rows; max_tokens beyond the horizon counts as the horizon
    assert replica_cost(RouteHint(800, max_tokens=10_000, num_choices=2), 768, alone, W) == \
        pytest.approx(2 * (32 * c + 256 * t(2)))


async def test_an_offload_tier_hit_costs_a_restore_between_a_pool_hit_and_a_miss(
        engines: list[EngineClient]) -> None:
    """A replica holding the prompt's first 768 tokens in its KV offload tier
    is priced by its measured restore time for them (not a prefill): above
    the replica holding them in its pool, far below the one holding nothing,
    and chosen over the latter."""
    c, t = ONE_CORE.prefill_token_s, ONE_CORE.decode_step
    tiered = StepProfile(ONE_CORE.prefill_token_s, ONE_CORE.decode_step_s, restore_token_s=2e-4)
    alone = view(profile=tiered)
    hint = RouteHint(800, max_tokens=16)
    pool_hit = replica_cost(hint, 768, alone, W)
    tier_hit = replica_cost(hint, 0, alone, W, offloaded_tokens=768)
    miss = replica_cost(hint, 0, alone, W)
    assert tier_hit == pytest.approx(32 * c + 768 * 2e-4 + 16 * t(1))
    assert pool_hit < tier_hit < miss
    offloaded, cold, _ = engines
    for engine in (offloaded, cold):
        engine.load_watch.view = view(profile=tiered)  # type: ignore[attr-defined]
    kv = picker(RoutingPolicy.KV_AWARE)
    for _ in range(2):  # whatever the rotation
        choice = await kv.choose([cold, offloaded], Priority.INTERACTIVE,
                                 RouteHint(800, matches({offloaded: CachedPrefix(0, 768)}),
                                           max_tokens=16))
        assert choice.order[0] is offloaded
    kv.routed(offloaded, choice, RouteHint(800, max_tokens=16))
    assert offloaded.load_watch.dispatched_tokens == 32  # type: ignore[attr-defined]


@pytest.mark.parametrize("output_tokens, spread_at", [(64, 2), (16, 5)])
async def test_a_hot_prefix_spreads_once_the_batch_costs_more_than_a_prefill(
        engines: list[EngineClient], output_tokens: int, spread_at: int) -> None:
    """Issue 30, bug 2: the holder of a hot 400-token prefix with N streams
    decoding against an idle replica. By the measured profile, one more
    stream on the holder costs 30 prompt tokens (33 ms) plus L steps in a
    batch of N + 1 and makes each of the N lose 33 ms and L - 1 steps' growth
    (1.6 ms each); the idle replica costs the 430-token prefill (473 ms) and L
    steps of one row. L = 64: 724.2 + 236.2 N ms against 1164.2 ms, so the
    second stream stays and the third spreads; L = 16: 205.8 + 82.6 N against
    645.8 ms, within 10 % (a tie, to the less loaded) from N = 5, so the sixth
    spreads. (The old cost, 8 prefill tokens a running sequence, kept every
    stream on the holder up to N = 50.)"""
    holder, idle, _ = engines
    kv = picker(RoutingPolicy.KV_AWARE)
    hint = RouteHint(430, matches({holder: 400}), max_tokens=output_tokens)
    idle.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    for running in range(spread_at + 1):
        holder.load_watch.view = view(running, profile=ONE_CORE)  # type: ignore[attr-defined]
        holder.in_flight = running
        chosen = (await kv.choose(engines[:2], Priority.INTERACTIVE, hint)).order[0]
        assert chosen is (holder if running < spread_at else idle), running


async def test_near_costs_tie_and_go_to_the_less_loaded_then_in_turn(
        engines: list[EngineClient]) -> None:
    """Two idle replicas whose measured profiles differ by noise (5 %) share
    sequential requests in turn; a 20 % difference does not tie."""
    a, b, _ = engines
    a.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    for factor, firsts in ((1.05, [a, b, a, b]), (1.2, [a, a, a, a])):
        b.load_watch.view = view(profile=StepProfile(  # type: ignore[attr-defined]
            factor * ONE_CORE.prefill_token_s, tuple(factor * s for s in ONE_CORE.decode_step_s)))
        kv = picker(RoutingPolicy.KV_AWARE)
        assert [(await kv.choose(engines[:2], Priority.BATCH, RouteHint(40, max_tokens=2))
                 ).order[0] for _ in range(4)] == firsts
    b.in_flight = 1
    b.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    assert (await kv.choose(engines[:2], Priority.BATCH, RouteHint(40))).order[0] is a


async def test_a_capacity_bound_shared_prefix_keeps_going_to_its_holder(
        engines: list[EngineClient]) -> None:
    """The issue's shared-prefix workload: 768-token prefixes, 16 tokens out,
    four streams: the holder with all four running beats a prefill of 800
    tokens on an idle replica (547 ms against 1,053 ms)."""
    holder, idle, _ = engines
    holder.load_watch.view = view(4, profile=ONE_CORE)  # type: ignore[attr-defined]
    idle.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(800, matches({holder: 768}), max_tokens=16))
    assert choice.order == [holder, idle]
    assert choice.costs[holder] == pytest.approx(0.5472)
    assert choice.costs[idle] == pytest.approx(1.0528)


async def test_each_replica_is_priced_by_its_own_profile(
        engines: list[EngineClient]) -> None:
    """A replica twice as slow (both measured) loses an uncached request it
    would win on equal hardware; one with no report uses the priors."""
    fast, slow, _ = engines
    doubled = StepProfile(2 * ONE_CORE.prefill_token_s,
                          tuple(2 * s for s in ONE_CORE.decode_step_s))
    fast.load_watch.view = view(1, profile=ONE_CORE)  # type: ignore[attr-defined]
    slow.load_watch.view = view(profile=doubled)  # type: ignore[attr-defined]
    kv = picker(RoutingPolicy.KV_AWARE)
    assert (await kv.choose(engines[:2], Priority.INTERACTIVE,
                            RouteHint(400, max_tokens=16))).order[0] is fast
    slow.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    assert (await kv.choose(engines[:2], Priority.INTERACTIVE,
                            RouteHint(400, max_tokens=16))).order[0] is slow


async def test_a_replica_that_measured_nothing_is_priced_as_its_measured_peer(
        engines: list[EngineClient]) -> None:
    """A fresh replica (no profile yet) beside one that measured a machine
    slower than the priors' is priced by its peer's profile, not by the
    priors (which would make it look twice as fast)."""
    measured, fresh, _ = engines
    measured.load_watch.view = view(1, profile=ONE_CORE)  # type: ignore[attr-defined]
    fresh.load_watch.view = view()  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(400, max_tokens=16))
    assert choice.costs[fresh] == pytest.approx(400 * 1.1e-3 + 16 * ONE_CORE.decode_step(1))


@pytest.mark.parametrize("stale", [view(age=1.5), LoadView(None, math.inf, 0), view(usage=0.97)])
def test_a_stale_or_full_replica_counts_as_saturated(stale: LoadView) -> None:
    assert math.isinf(replica_cost(RouteHint(10), 0, stale, W))


async def test_kv_aware_prefers_the_replica_holding_the_prefix(
        engines: list[EngineClient]) -> None:
    a, b, c = engines
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines, Priority.INTERACTIVE, RouteHint(800, matches({b: 768})))
    assert choice.order[0] is b
    assert choice.costs[b] == pytest.approx(StepProfile().prefill_s(32)
                                            + StepProfile().decode_step(1))
    assert choice.costs[a] == pytest.approx(StepProfile().prefill_s(800)
                                            + StepProfile().decode_step(1))


async def test_kv_aware_weighs_the_prefix_against_load(engines: list[EngineClient]) -> None:
    a, b, _ = engines
    b.load_watch.view = view(pending=2000)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(800, matches({b: 768})))
    assert choice.order == [a, b]  # a prefill of 800 tokens < of 32 + 2000


async def test_saturated_replicas_go_last_and_ties_go_to_the_least_loaded(
        engines: list[EngineClient]) -> None:
    a, b, c = engines
    a.load_watch.view = view(age=5.0)  # type: ignore[attr-defined]
    b.in_flight = 3
    choice = await picker(RoutingPolicy.KV_AWARE).choose(engines, Priority.INTERACTIVE,
                                                         RouteHint(100))
    assert choice.order == [c, b, a]


async def test_a_session_stays_on_its_replica_unless_it_costs_too_much(
        engines: list[EngineClient]) -> None:
    a, b, _ = engines
    session = RoutingSession(replica=b)
    kv = picker(RoutingPolicy.KV_AWARE)
    hint = RouteHint(800, None, session)
    b.load_watch.view = view(pending=1000)  # type: ignore[attr-defined]
    assert (await kv.choose(engines[:2], Priority.INTERACTIVE, hint)).order[0] is b
    b.load_watch.view = view(pending=5000)  # type: ignore[attr-defined]
    assert (await kv.choose(engines[:2], Priority.INTERACTIVE, hint)).order[0] is a
    b.load_watch.view = view(age=3.0)  # type: ignore[attr-defined]
    assert (await kv.choose(engines[:2], Priority.INTERACTIVE, hint)).order[0] is a


async def test_round_robin_rotates_and_least_load_counts_open_requests(
        engines: list[EngineClient]) -> None:
    rr = picker(RoutingPolicy.ROUND_ROBIN)
    firsts = [(await rr.choose(engines, Priority.BATCH, RouteHint(10))).order[0]
              for _ in range(6)]
    assert firsts == engines * 2
    a, b, c = engines
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    ll = picker(RoutingPolicy.LEAST_LOAD)
    assert (await ll.choose(engines, Priority.BATCH, RouteHint(10))).order == [b, c, a]


async def test_a_replica_with_no_free_slot_costs_a_wait(engines: list[EngineClient]) -> None:
    a, b, _ = engines
    for engine in (a, b):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
    b.load_watch.view = view(running=2)  # type: ignore[attr-defined]
    kv = picker(RoutingPolicy.KV_AWARE)
    batch = await kv.choose(engines[:2], Priority.BATCH, RouteHint(100, matches({b: 96})))
    assert batch.order == [a, b]  # 100 prompt tokens < 4 + a slot wait of 2048
    # An interactive request would preempt one of b's batch sequences (QA:
    # num_preemptions 0 -> 1 on the prefix holder while the other replica was
    # idle): the idle replica starts it at once and goes first.
    interactive = await kv.choose(engines[:2], Priority.INTERACTIVE,
                                  RouteHint(100, matches({b: 96})))
    assert interactive.order == [a, b]
    # Both full of batch sequences: the engine preempts batch ones for an
    # interactive request, so only interactive ones hold slots against it and
    # the prefix decides.
    a.load_watch.view = view(running=2)  # type: ignore[attr-defined]
    interactive = await kv.choose(engines[:2], Priority.INTERACTIVE,
                                  RouteHint(100, matches({b: 96})))
    assert interactive.order == [b, a]


async def test_streams_this_router_opened_hold_slots_the_report_does_not_show_yet(
        engines: list[EngineClient]) -> None:
    """Requests arriving together: the replica's report (idle) predates them
    and may reset the unreported count before it shows them; the router's
    own open streams still fill the slots (CI: all four batch streams of
    test_mesh_overload went to one 2-slot engine, two waited 0.85 s)."""
    a, b, _ = engines
    for engine in (a, b):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
    kv = picker(RoutingPolicy.KV_AWARE)
    first = b.opened(Priority.BATCH)
    b.opened(Priority.BATCH)
    batch = await kv.choose(engines[:2], Priority.BATCH, RouteHint(100, matches({b: 96})))
    assert batch.order == [a, b]
    b.closed(first)
    batch = await kv.choose(engines[:2], Priority.BATCH, RouteHint(100, matches({b: 96})))
    assert batch.order == [b, a]


def two_slot_pair(engines: list[EngineClient]) -> tuple[EngineClient, EngineClient]:
    """Two replicas of 2 sequence slots: ``free`` holds one interactive stream of
    this router, ``full`` two (the third and fourth of 4 streams sent together)."""
    free, full, _ = engines
    for engine in (free, full):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
    free.opened(Priority.INTERACTIVE)
    full.opened(Priority.INTERACTIVE)
    full.opened(Priority.INTERACTIVE)
    full.load_watch.view = view(running=2, profile=ONE_CORE)  # type: ignore[attr-defined]
    free.load_watch.view = view(running=1, profile=ONE_CORE)  # type: ignore[attr-defined]
    return free, full


SLOW = StepProfile(ONE_CORE.prefill_token_s, tuple(4 * s for s in ONE_CORE.decode_step_s))


@pytest.mark.parametrize("case", ["full_holds_the_prompt", "free_report_stale",
                                  "free_measured_slower"])
async def test_a_replica_with_a_free_slot_goes_before_one_where_the_request_would_wait(
        engines: list[EngineClient], case: str) -> None:
    """CI (test_mesh_overload's SIGKILL test) once split 4 interactive streams
    3/1 over two 2-slot engines: the fourth waited on the full one for a
    sequence to finish. Each input here made the full replica the cheaper in
    a cost where waiting counted as a 2,048-token prefill: a prefix hit
    there (a prompt it holds), a stale report from the free one (its last
    step took over 1 s: it costs infinity), the free one's profile measured
    slower (under contention). A free slot now comes first, whatever the cost."""
    free, full = two_slot_pair(engines)
    hint = RouteHint(96, max_tokens=96)
    if case == "full_holds_the_prompt":
        hint = RouteHint(4000, matches({full: 3984}), max_tokens=96)
    else:
        stale = case == "free_report_stale"
        free.load_watch.view = view(  # type: ignore[attr-defined]
            running=1, age=1.5 if stale else 0.1, profile=ONE_CORE if stale else SLOW)
    choice = await picker(RoutingPolicy.KV_AWARE).choose([full, free], Priority.INTERACTIVE, hint)
    assert choice.order == [free, full], choice.costs
    session = RoutingSession(replica=full)  # the previous turn's replica is full
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        [full, free], Priority.INTERACTIVE, RouteHint(4000, matches({full: 3984}), session))
    assert choice.order[0] is free


async def test_the_prefix_holder_wins_while_both_have_a_free_slot(
        engines: list[EngineClient]) -> None:
    """The cache-aware preference stays when both replicas would start the request
    at once: the one holding the prompt goes first though it runs more."""
    free, full = two_slot_pair(engines)
    full.closed(next(iter(full.open_requests)))
    full.load_watch.view = view(running=1, profile=ONE_CORE)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        [free, full], Priority.INTERACTIVE, RouteHint(4000, matches({full: 3984}), max_tokens=96))
    assert choice.order == [full, free]


def holder_and_free(engines: list[EngineClient], generated: int, max_tokens: int,
                    *, waiting: int = 0) -> tuple[EngineClient, EngineClient]:
    """Two replicas of 2 slots: ``holder`` runs 2 interactive streams of this
    router, each ``generated`` of ``max_tokens`` tokens in (and ``waiting``
    requests the engine reports queued: another router's); ``free`` idle."""
    holder, free, _ = engines
    for engine in (holder, free):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
    for _ in range(2):
        holder.opened(Priority.INTERACTIVE, 1, max_tokens).advance(0, generated)
    holder.load_watch.view = LoadView(  # type: ignore[attr-defined]
        LoadStats(2, waiting, 0.1, 0, ONE_CORE), 0.1, 0, 0)
    free.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    return holder, free


async def test_a_long_cached_prefix_waits_for_its_holder_about_to_free_a_slot(
        engines: list[EngineClient]) -> None:
    """QA: a 4,000-token prompt whose prefix the full replica held went to the
    free one and prefilled whole (TTFT 3.3-4.3 s against ~1 s had it waited).
    The holder's streams have 6 tokens left: a slot frees within 6 steps of
    12.4 ms, then 16 tokens to prefill (~0.09 s), against 4.4 s of prefill on
    the free replica: waiting wins, and a session there stays."""
    holder, free = holder_and_free(engines, generated=90, max_tokens=96)
    hint = RouteHint(4000, matches({holder: 3984}), max_tokens=96)
    kv = picker(RoutingPolicy.KV_AWARE)
    assert (await kv.choose([free, holder], Priority.INTERACTIVE, hint)).order == [holder, free]
    assert (await kv.choose([free, holder], Priority.BATCH, hint)).order == [holder, free]
    session = RoutingSession(replica=holder)
    choice = await kv.choose([free, holder], Priority.INTERACTIVE,
                             RouteHint(4000, matches({holder: 3984}), session, 96))
    assert choice.order[0] is holder


@pytest.mark.parametrize("case", ["streams_just_started", "prefix_saves_little",
                                  "other_routers_requests_wait_there"])
async def test_a_wait_not_repaid_before_the_first_token_goes_to_the_free_replica(
        engines: list[EngineClient], case: str) -> None:
    """The holder's streams just started (512 tokens left each: a slot frees
    in ~6.3 s, the free replica prefills the whole 4,000 tokens in 4.4 s); or
    the prefix saves less than the wait (one 16-token block of a 100-token
    prompt: 74 ms of wait + 92 ms of prefill against 110 ms); or the engine
    reports 2 requests waiting there that this router did not send (3 of the
    holder's sequences must end, only 2 are of known length: the wait has no
    bound, whatever the prefix). The free slot goes first."""
    generated, max_tokens, prompt, cached, waiting = {
        "streams_just_started": (0, 512, 4000, 3984, 0),
        "prefix_saves_little": (90, 96, 100, 16, 0),
        "other_routers_requests_wait_there": (90, 96, 4000, 3984, 2)}[case]
    holder, free = holder_and_free(engines, generated, max_tokens, waiting=waiting)
    hint = RouteHint(prompt, matches({holder: cached}), max_tokens=96)
    choice = await picker(RoutingPolicy.KV_AWARE).choose([holder, free], Priority.BATCH, hint)
    assert choice.order == [free, holder], choice.costs


def test_the_wait_for_a_slot_is_the_soonest_ends_of_this_routers_streams() -> None:
    """A slot frees when the soonest of the sequences ahead ends: each runs
    at most its max_tokens (EOS may end it sooner: a bound), one token a step
    of a full batch; a request of n choices waits for the n-th soonest."""
    full = StepProfile(1e-3, (0.010, 0.012))
    slots = SlotUse(busy=2, max_num_seqs=2, need=1, tokens_left=(5, 40))
    assert slot_wait_s(slots, full) == pytest.approx(5 * 0.012)
    assert slot_wait_s(SlotUse(2, 2, 2, (5, 40)), full) == pytest.approx(40 * 0.012)
    assert slot_wait_s(SlotUse(2, 2, 1, ()), full) is None  # lengths unknown
    assert slot_wait_s(SlotUse(1, 2, 1, ()), full) == 0.0  # a free slot
    record = OpenRequest(Priority.BATCH, 96, [0, 0])
    record.advance(0, 90)
    record.advance(1, 3, finished=True)
    assert record.tokens_left() == [6, 0]  # a finished choice frees its slot
    assert OpenRequest(Priority.BATCH, 0, [0]).tokens_left() == []  # no max_tokens: unknown


async def test_a_request_of_n_choices_needs_n_free_slots_to_start_at_once(
        engines: list[EngineClient]) -> None:
    """Each choice of ``n`` runs as its own engine sequence (QA: an n=2 request
    on the prefix holder's 2 slots, and a request sent 1 s later went there
    too and waited 5 s while the other replica was idle): this router counts
    a request's sequences, and a request starts at once only where all its
    choices find a slot."""
    holder, other, _ = engines
    for engine in (holder, other):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
        engine.load_watch.view = view(profile=ONE_CORE)  # type: ignore[attr-defined]
    pair = holder.opened(Priority.INTERACTIVE, 2)  # the report does not show it yet
    kv = picker(RoutingPolicy.KV_AWARE)
    hint = RouteHint(4000, matches({holder: 3984}), max_tokens=96)
    assert (await kv.choose([holder, other], Priority.INTERACTIVE, hint)).order == [other, holder]
    holder.closed(pair)
    other.opened(Priority.BATCH)  # one slot of two taken: room for n=1, not for n=2
    two = RouteHint(4000, matches({holder: 3984}), max_tokens=96, num_choices=2)
    assert (await kv.choose([other, holder], Priority.BATCH, two)).order[0] is holder
    assert (other.sequences, other.in_flight, holder.sequences) == (1, 1, 0)


async def test_the_load_view_adds_what_was_sent_and_takes_off_what_ended_since_the_report(
        ) -> None:
    engine = EngineClient("127.0.0.1:9")  # never called: its LoadWatch is not started
    try:
        watch = engine.load_watch
        assert watch.current().sequences == 0  # no report yet
        watch.observe(LoadStats(2, 1, 0.1))
        watch.dispatched(15)
        ended = engine.opened(Priority.BATCH, choices=2)
        engine.closed(ended)
        engine.closed(ended)  # once
        now = watch.current()
        assert (now.unreported_sequences, now.ended_unreported, now.sequences) == (1, 2, 2)
        for _ in range(5):
            watch.ended(1)
        assert watch.current().sequences == 0  # never below 0
        watch.observe(LoadStats(1, 0, 0.1))  # it counts what was sent and ended before it
        now = watch.current()
        assert (now.unreported_sequences, now.ended_unreported, now.sequences) == (0, 0, 1)
    finally:
        await engine.close()


async def test_a_slot_this_routers_stream_freed_is_free_before_the_report_shows_it() -> None:
    """CI (test_mesh_overload, interactive before batch): two 2-slot engines
    each ran two of this router's streams; one on ``free`` ended and
    admission, counting that free slot, granted a queued interactive
    request. ``free``'s last report (20-200 ms old) still showed 2 running, so
    neither replica started it at once and the cost chose ``full`` (``free``
    measured slower under contention): it waited there for a stream to end
    while the free slot went to batch requests that came later. The ended
    stream's slot is free in ``free``'s load view until its next report."""
    free, full = EngineClient("127.0.0.1:9"), EngineClient("127.0.0.1:10")  # never called
    try:
        for engine, profile in ((free, SLOW), (full, ONE_CORE)):
            engine.info = ModelInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
            streams = [engine.opened(Priority.INTERACTIVE, max_tokens=24) for _ in range(2)]
            for stream in streams:
                stream.advance(0, 20)  # 4 tokens left each
            engine.load_watch.observe(LoadStats(2, 0, 0.1, 0, profile))
        ended = next(iter(free.open_requests))
        free.closed(ended)
        kv = picker(RoutingPolicy.KV_AWARE)
        for priority in (Priority.INTERACTIVE, Priority.BATCH):
            choice = await kv.choose([full, free], priority, RouteHint(15, max_tokens=4))
            assert choice.order == [free, full], (priority, choice.costs)
        free.load_watch.observe(LoadStats(1, 0, 0.1, 0, SLOW))  # the report catches up
        choice = await kv.choose([full, free], Priority.BATCH, RouteHint(15, max_tokens=4))
        assert choice.order == [free, full], choice.costs
    finally:
        await asyncio.gather(free.close(), full.close())


async def test_routed_books_the_unreported_prefill(engines: list[EngineClient]) -> None:
    a, b, _ = engines
    kv = picker(RoutingPolicy.KV_AWARE)
    hint = RouteHint(800, matches({b: 512}), num_choices=3)
    choice = await kv.choose(engines[:2], Priority.INTERACTIVE, hint)
    kv.routed(b, choice, hint)
    # the prefill after the hit, and n=3 sequences (the engine reports each running)
    assert b.load_watch.dispatched_tokens == 288  # type: ignore[attr-defined]
    assert b.load_watch.dispatched_sequences == 3  # type: ignore[attr-defined]


async def test_a_request_of_n_choices_is_counted_and_taken_off_as_n_sequences() -> None:
    """QA: dispatched counted a request of n=4 as 1 and its end took off 4, so
    an engine still running 2 looked empty until its next report."""
    engine = EngineClient("127.0.0.1:9")  # never called: its LoadWatch is not started
    try:
        watch = engine.load_watch
        watch.observe(LoadStats(2, 0, 0.1))  # A and B running
        watch.dispatched(10, 4)  # C, n=4
        assert watch.current().sequences == 6
        c = engine.opened(Priority.BATCH, choices=4)
        engine.closed(c)
        assert watch.current().sequences == 2  # A and B still run
    finally:
        await engine.close()


async def test_a_failed_prefix_lookup_routes_by_load(engines: list[EngineClient]) -> None:
    async def broken() -> dict[EngineClient, int]:
        raise RuntimeError("index down")
    a, b, _ = engines
    b.load_watch.view = view(pending=10)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(100, asyncio.ensure_future(broken())))
    assert choice.order == [a, b]


@pytest.mark.parametrize("field, value", [("decode_horizon_tokens", -5.0),
                                          ("affinity_slack_tokens", math.nan),
                                          ("slot_wait_tokens", math.inf),
                                          ("kv_full_usage", 0.0)])
def test_weights_must_be_finite_and_non_negative(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CostWeights(**{field: value})


async def test_replicas_sharing_an_id_get_no_prefix_matches(
        engines: list[EngineClient]) -> None:
    from services.router.routing import duplicate_replica_ids
    a, b, c = engines
    for engine, replica in ((a, "dup"), (b, "dup"), (c, "c")):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", replica_id=replica,
                                  kv_block_size=16, kv_hash_seed=b"s" * 32)
    assert duplicate_replica_ids(engines) == {"dup"}


async def test_prefix_lookups_hash_the_prompt_in_the_requests_cache_scope(
        engines: list[EngineClient]) -> None:
    # The engine seeds a scoped request's block 0 with scoped_seed (its KV events
    # name the blocks so); the router must ask the index for the same hashes, or a
    # tenant's prompt would match another's blocks (and route by them).
    from services.common.block_hash import prompt_block_hashes, scoped_seed

    class RecordingIndex:
        def __init__(self) -> None:
            self.asked: list[list[bytes]] = []

        async def score_prefix(self, hashes: list[bytes], *, deadline: float
                               ) -> dict[str, PrefixMatch]:
            self.asked.append(list(hashes))
            return {"a": PrefixMatch(len(hashes)), "b": PrefixMatch(0, 1)}

    a, b, _ = engines
    seed = b"s" * 32
    for engine, replica in ((a, "a"), (b, "b")):
        engine.info = ModelInfo("m", 1024, 100, (2,), "torch", replica_id=replica,
                                  kv_block_size=16, kv_hash_seed=seed)
    index = RecordingIndex()
    kv = ReplicaPicker(RoutingPolicy.KV_AWARE, index,  # type: ignore[arg-type]
                       RouterMetrics(CollectorRegistry()), W)
    prompt = list(range(40))
    assert await kv.prefix_matches(prompt, [a, b], "scope-a") == \
        {a: CachedPrefix(32), b: CachedPrefix(0, 16)}
    assert await kv.prefix_matches(prompt, [a, b]) == {a: CachedPrefix(32), b: CachedPrefix(0, 16)}
    assert index.asked == [prompt_block_hashes(scoped_seed(seed, "scope-a"), prompt, 16),
                           prompt_block_hashes(seed, prompt, 16)]
    assert index.asked[0] != index.asked[1]


@pytest.mark.parametrize("flag, value, words", [
    ("--kv-aware-decode-horizon", "-1", "must be >= 1 token"),
    ("--kv-aware-decode-horizon", "0", "must be >= 1 token"),
    ("--kv-aware-decode-horizon", "1.5", "expected a whole number of tokens"),
    ("--kv-aware-decode-horizon", "nan", "expected a whole number of tokens"),
    ("--kv-aware-affinity-slack", "-1", "must be a finite number >= 0"),
    ("--kv-aware-affinity-slack", "inf", "must be a finite number >= 0"),
])
def test_a_bad_routing_flag_is_refused_naming_the_flag(
        flag: str, value: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    from services.router.__main__ import build_parser
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--tokenizer", "t:1", "--engine", "e:1", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {words}" in capsys.readouterr().err


def test_the_routing_flags_parse_to_the_cost_weights_units() -> None:
    from services.router.__main__ import build_parser
    args = build_parser().parse_args(["--tokenizer", "t:1", "--engine", "e:1",
                                      "--kv-aware-decode-horizon", "64",
                                      "--kv-aware-affinity-slack", "512.5"])
    assert (args.kv_aware_decode_horizon, args.kv_aware_affinity_slack) == (64, 512.5)
    assert build_parser().parse_args(["--tokenizer", "t:1", "--engine", "e:1"]
                                     ).kv_aware_decode_horizon == 256
