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
from services.router.clients import EngineLoad, ReplicaInfo
from services.router.engine_client import EngineClient
from services.router.load_watch import LoadView
from services.router.metrics import RouterMetrics
from services.router.routing import (
    CostWeights,
    ReplicaPicker,
    RouteHint,
    RoutingPolicy,
    RoutingSession,
    replica_cost,
)

W = CostWeights(decode_weight=16.0, kv_full_usage=0.95, affinity_slack_tokens=2048.0)


def view(running: int = 0, pending: int = 0, usage: float = 0.1, age: float = 0.1,
         unreported: int = 0) -> LoadView:
    return LoadView(EngineLoad(running, 0, usage, pending), age, unreported)


class FixedLoad:
    """Stands in for a LoadWatch: the view the test sets."""

    def __init__(self, current: LoadView) -> None:
        self.view = current
        self.dispatched_tokens = 0

    def current(self) -> LoadView:
        return self.view

    def dispatched(self, tokens: int) -> None:
        self.dispatched_tokens += tokens

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


def matches(result: dict[EngineClient, int]) -> asyncio.Task[dict[EngineClient, int]]:
    async def resolved() -> dict[EngineClient, int]:
        return result
    return asyncio.ensure_future(resolved())


def test_cost_is_the_prefill_work_ahead_of_the_first_token() -> None:
    assert replica_cost(800, 0, view(), W) == 800
    assert replica_cost(800, 768, view(), W) == 32
    assert replica_cost(800, 768, view(running=4, pending=100, unreported=50), W) == \
        32 + 100 + 50 + 16 * 4


@pytest.mark.parametrize("stale", [view(age=1.5), LoadView(None, math.inf, 0), view(usage=0.97)])
def test_a_stale_or_full_replica_counts_as_saturated(stale: LoadView) -> None:
    assert math.isinf(replica_cost(10, 0, stale, W))


async def test_kv_aware_prefers_the_replica_holding_the_prefix(
        engines: list[EngineClient]) -> None:
    a, b, c = engines
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines, Priority.INTERACTIVE, RouteHint(800, matches({b: 768})))
    assert choice.order[0] is b and choice.costs[b] == 32 and choice.costs[a] == 800


async def test_kv_aware_weighs_the_prefix_against_load(engines: list[EngineClient]) -> None:
    a, b, _ = engines
    b.load_watch.view = view(pending=2000)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(800, matches({b: 768})))
    assert choice.order == [a, b]  # 800 < 32 + 2000


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
        engine.info = ReplicaInfo("m", 1024, 100, (2,), "torch", max_num_seqs=2)
    b.load_watch.view = view(running=2)  # type: ignore[attr-defined]
    kv = picker(RoutingPolicy.KV_AWARE)
    batch = await kv.choose(engines[:2], Priority.BATCH, RouteHint(100, matches({b: 96})))
    assert batch.order == [a, b]  # 100 < 4 + 16 + 2048
    # The engine preempts batch sequences for an interactive request: only this
    # router's interactive ones hold slots against it.
    interactive = await kv.choose(engines[:2], Priority.INTERACTIVE,
                                  RouteHint(100, matches({b: 96})))
    assert interactive.order == [b, a]


async def test_routed_books_the_unreported_prefill(engines: list[EngineClient]) -> None:
    a, b, _ = engines
    kv = picker(RoutingPolicy.KV_AWARE)
    choice = await kv.choose(engines[:2], Priority.INTERACTIVE, RouteHint(800, matches({b: 512})))
    kv.routed(b, choice, 800)
    assert b.load_watch.dispatched_tokens == 288  # type: ignore[attr-defined]


async def test_a_failed_prefix_lookup_routes_by_load(engines: list[EngineClient]) -> None:
    async def broken() -> dict[EngineClient, int]:
        raise RuntimeError("index down")
    a, b, _ = engines
    b.load_watch.view = view(pending=10)  # type: ignore[attr-defined]
    choice = await picker(RoutingPolicy.KV_AWARE).choose(
        engines[:2], Priority.INTERACTIVE, RouteHint(100, asyncio.ensure_future(broken())))
    assert choice.order == [a, b]


@pytest.mark.parametrize("field, value", [("decode_weight", -5.0),
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
        engine.info = ReplicaInfo("m", 1024, 100, (2,), "torch", replica_id=replica,
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

        async def score_prefix(self, hashes: list[bytes], *, deadline: float) -> dict[str, int]:
            self.asked.append(list(hashes))
            return {"a": len(hashes)}

    a, b, _ = engines
    seed = b"s" * 32
    for engine, replica in ((a, "a"), (b, "b")):
        engine.info = ReplicaInfo("m", 1024, 100, (2,), "torch", replica_id=replica,
                                  kv_block_size=16, kv_hash_seed=seed)
    index = RecordingIndex()
    kv = ReplicaPicker(RoutingPolicy.KV_AWARE, index,  # type: ignore[arg-type]
                       RouterMetrics(CollectorRegistry()), W)
    prompt = list(range(40))
    assert await kv.prefix_matches(prompt, [a, b], "scope-a") == {a: 32}
    assert await kv.prefix_matches(prompt, [a, b]) == {a: 32}
    assert index.asked == [prompt_block_hashes(scoped_seed(seed, "scope-a"), prompt, 16),
                           prompt_block_hashes(seed, prompt, 16)]
    assert index.asked[0] != index.asked[1]
