"""Admission control (and the deadline) on the real mesh (Envoy, router, tokenizer, two torch
engines with 2 sequence slots each, SmolLM2): exact refusals, each at once
with an honest retry hint, the router's queue bounded, HTTP 429 with
Retry-After, and the limits on ListModels."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import statistics
import time
import urllib.error
import urllib.request

import grpc
import pytest

from llmesh.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.cli.mesh import Mesh
from tests.e2e.overload_client import (SLOTS_PER_ENGINE, SMALL_ENGINES, Outcome, long_request,
                                       run_one)
from tests.e2e.shared_mesh import SharedMesh

pytestmark = pytest.mark.mesh

SLOTS = SLOTS_PER_ENGINE * SMALL_ENGINES
QUEUE = 4


@pytest.fixture(scope="module")
def small_mesh(two_small_engines: SharedMesh) -> Mesh:
    """Two engines of 2 slots (conftest.py; test_mesh_overload takes them over
    next), a router queue of 4 per class, no response cache."""
    return two_small_engines.get(["--max-queued-requests", str(QUEUE)])


async def probe_admitted(stub: generation_pb2_grpc.GenerationServiceStub) -> float:
    """Retries a one-token request every 20 ms until one is not refused; returns
    when that one was sent (a refusal comes back in milliseconds; an admitted
    request stays open in the queue)."""
    while True:
        sent = time.monotonic()
        call = stub.Generate(long_request(1, "probe"), timeout=120)
        try:
            await asyncio.wait_for(call.read(), 0.3)
            return sent
        except TimeoutError:
            return sent  # queued: admitted
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        await asyncio.sleep(0.02)


async def refusals_back(tasks: list[asyncio.Task[Outcome]], expected: int) -> None:
    """Returns once ``expected`` of ``tasks`` ended RESOURCE_EXHAUSTED, or all
    ended (the test's count assertion then says what came back)."""
    pending = set(tasks)
    while pending and sum(t.done() and t.result().code == grpc.StatusCode.RESOURCE_EXHAUSTED
                          for t in tasks) < expected:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)


def router_gauge(mesh: Mesh, name: str) -> float:
    body = urllib.request.urlopen(f"http://{mesh.router.metrics_address}/metrics",
                                  timeout=5).read().decode()
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", body, re.M):
        total = max(total, float(match.group(1)))
    return total


async def sample_queue_depth(mesh: Mesh, stop: asyncio.Event, seen: list[float]) -> None:
    while not stop.is_set():
        seen.append(await asyncio.to_thread(router_gauge, mesh, "llmesh:router_queue_depth"))
        await asyncio.sleep(0.05)


def test_a_burst_into_an_idle_mesh_refuses_exactly_the_excess_at_once(small_mesh: Mesh) -> None:
    async def scenario() -> list[Outcome]:
        async with grpc.aio.insecure_channel(small_mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return await asyncio.gather(*(run_one(stub, long_request(24, f"b{i}"))
                                          for i in range(SLOTS + QUEUE + 4)))

    outcomes = asyncio.run(scenario())
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    assert len(refused) == 4 and len(done) == SLOTS + QUEUE, [(o.code, o.details) for o in outcomes]
    assert all(o.tokens == 24 for o in done)
    for o in refused:
        assert o.retry_after_ms is not None and o.retry_after_ms > 0
        assert "queue" in o.details and "full" in o.details


# Under pytest-xdist it runs alone: its refusal latencies (a median under a 10th
# of the real wait) are the mesh's, not the other worker's test on the same 2
# cores (a fresh-clone CI on two workers measured all 8 refusals at 104.6 ms,
# one stall shared alike).
def short_of_its_max_tokens(tag: str) -> generation_pb2.GenerateRequest:
    """A request that stops after a few of its 256 tokens (at the first "e",
    "o", "3" or line end of the numbers it lists): a small share of its
    ``max_tokens``."""
    request = long_request(256, tag)
    request.sampling.stop.extend(["e", "o", "3", "\n"])
    return request


# after_short_requests, QA: 10 requests that ended after a few of their 256
# tokens made every running stream look one token from its end (a hint of the
# share of max_tokens the finished ones used): "retry after 10 ms" against a
# real wait of 3.96 s. The hint now follows each stream's own progress.
@pytest.mark.whole_machine
@pytest.mark.parametrize("after_short_requests", [False, True])
def test_a_saturated_mesh_refuses_with_a_hint_within_2x_of_the_real_wait(
        small_mesh: Mesh, after_short_requests: bool) -> None:
    async def scenario() -> tuple[list[Outcome], list[Outcome], float, list[float]]:
        async with grpc.aio.insecure_channel(small_mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            if after_short_requests:
                shorts = [o for wave in range(0, 12, SLOTS)
                          for o in await asyncio.gather(*(run_one(
                              stub, short_of_its_max_tokens(f"short{i}"))
                              for i in range(wave, wave + SLOTS)))]
                assert all(o.code == grpc.StatusCode.OK and o.tokens < 32 for o in shorts), [
                    (o.code, o.tokens) for o in shorts]
            stop, depths = asyncio.Event(), []
            sampler = asyncio.create_task(sample_queue_depth(small_mesh, stop, depths))
            started = [asyncio.Event() for _ in range(SLOTS)]
            running = [asyncio.create_task(run_one(stub, long_request(96, f"s{i}"),
                                                   first_token=started[i]))
                       for i in range(SLOTS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            burst_tasks = [asyncio.create_task(run_one(stub, long_request(8, f"x{i}")))
                           for i in range(12)]
            # The probe starts once the refusals are back, not after the queued
            # requests' 8 tokens too (QA: waiting for the whole burst added
            # their run to the "real wait", up to 2.8x the hint under load).
            await refusals_back(burst_tasks, 12 - QUEUE)
            refused_at = min(t.result().ended_at for t in burst_tasks if t.done()
                             and t.result().code == grpc.StatusCode.RESOURCE_EXHAUSTED)
            admitted_at = await probe_admitted(stub)
            burst = await asyncio.gather(*burst_tasks)
            saturating = await asyncio.gather(*running)
            stop.set()
            await sampler
            return saturating, burst, admitted_at - refused_at, depths

    # The refusal times are the mesh's: no collection of this test process's
    # heap (models and tokenizers of earlier tests) may stall the client
    # mid-burst (one did for ~60 ms in a full-suite run, delaying all 8 alike).
    gc.collect()
    gc.disable()
    try:
        saturating, burst, real_wait, depths = asyncio.run(scenario())
    finally:
        gc.enable()
    queued = [o for o in burst if o.code == grpc.StatusCode.OK]
    refused = [o for o in burst if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(queued) == QUEUE and len(refused) == 12 - QUEUE, [o.details for o in burst]
    assert all(o.tokens == 8 for o in queued) and all(o.tokens == 96 for o in saturating)
    # At once: no refusal waits for an engine slot; one that did would take the
    # whole real wait (1.2-1.7 s here). The bounds are ratios of that wait, not
    # fixed times: a refusal's own time is the CPU its hops (Envoy, router,
    # client) wait for while both engines decode on the same 2 cores (one at a
    # time, beside other work: 1-6 ms straight to the router, 10-14 ms through
    # Envoy), and the burst of 12 comes from one client and is handled by one
    # router, so each refusal queues behind the requests sent with it: 9-42 ms
    # here, 31-65 ms and more (a median of 55 ms, over the fixed 50 ms bound this
    # test had) in one run of the project's CI. The median is held to a 10th of
    # the real wait, the slowest to a 5th.
    latencies = sorted(o.latency for o in refused)
    assert statistics.median(latencies) < real_wait / 10, ([round(x, 4) for x in latencies],
                                                           real_wait)
    assert latencies[-1] < real_wait / 5, ([round(x, 4) for x in latencies], real_wait)
    hints = [o.retry_after_ms / 1e3 for o in refused if o.retry_after_ms]
    print(f"retry hints {hints} s; a retry was admitted after {real_wait:.3f} s; refusals in "
          f"{sorted(round(o.latency * 1e3, 1) for o in refused)} ms")
    assert len(hints) == len(refused)
    for hint in hints:
        assert real_wait / 2 <= hint <= real_wait * 2, (hints, real_wait)
    assert depths and max(depths) <= QUEUE


def test_an_http_refusal_is_a_429_with_retry_after(small_mesh: Mesh) -> None:
    body = json.dumps({"prompt": "Count to a thousand:", "bypass_cache": True,
                       "sampling": {"max_tokens": 64, "ignore_eos": True}}).encode()

    async def scenario() -> tuple[int, dict[str, str]]:
        async with grpc.aio.insecure_channel(small_mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            fill = [asyncio.create_task(run_one(stub, long_request(64, f"h{i}")))
                    for i in range(SLOTS + QUEUE)]
            # Until the queue is full (the slots filled first), not a fixed sleep:
            # on a busy machine the fill may take longer than any guess.
            for _ in range(200):
                if await asyncio.to_thread(router_gauge, small_mesh,
                                           "llmesh:router_queue_depth") >= QUEUE:
                    break
                await asyncio.sleep(0.05)
            status, headers = await asyncio.to_thread(post, body)
            await asyncio.gather(*fill)
            return status, headers

    def post(data: bytes) -> tuple[int, dict[str, str]]:
        request = urllib.request.Request(f"{small_mesh.http_url}/v1/generate", data=data,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers)
        except urllib.error.HTTPError as err:
            return err.code, {k.lower(): v for k, v in err.headers.items()}

    status, headers = asyncio.run(scenario())
    assert status == 429, headers
    assert int(headers["retry-after"]) >= 1
    assert int(headers["retry-after-ms"]) >= 1


def test_list_models_reports_the_admission_limits(small_mesh: Mesh) -> None:
    with grpc.insecure_channel(small_mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        card = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models[0]
    assert card.admission.enabled
    assert card.admission.max_queued_requests == QUEUE
    assert card.admission.max_running_requests == SLOTS
    assert card.admission.batch_window_ms == 10


def test_a_2_second_deadline_ends_a_long_generation_and_frees_the_engine(
        small_mesh: Mesh) -> None:
    def running() -> int:
        total = 0
        for engine in small_mesh.engines:
            with grpc.insecure_channel(engine.grpc_address) as channel:
                load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(
                    engine_pb2.GetLoadRequest(), timeout=5)
                total += load.num_running + load.num_waiting
        return total

    with grpc.insecure_channel(small_mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stub.Generate(long_request(2000, "deadline"), timeout=2.0):
                pass
        ended = time.monotonic()
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended - began < 2.3, ended - began
    while running() and time.monotonic() - ended < 1.0:
        time.sleep(0.05)
    assert running() == 0, "the engine still runs the sequence 1 s after the deadline"
