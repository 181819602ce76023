"""Request coalescing (single flight) in the router: identical deterministic
requests in flight share one engine generation. The router runs over real
gRPC against the fake engines (their ``log.starts`` count generations); the
last tests drive :class:`SingleFlight` on its own."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2
from services.router.single_flight import DeadlinePassed, SingleFlight
from tests.router.router_fakes import encode
from tests.router.test_router_service import (
    REPLY,
    collect,
    greedy,
    make_mesh,
    text_of,
    wait_for,
)

N = 6
MODEL = "fake-model"


def request(prompt: str = "q", **kw) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, **kw)


def as_content(responses) -> tuple:
    """A stream's content without the request id (each subscriber has its own)
    and without its message boundaries: deltas that wait for a subscriber's
    transport are merged (the slow-reader pacing, services/router/slow_reader.py),
    so a subscriber that lags gets the same tokens in fewer messages."""
    last = responses[-1] if responses else generation_pb2.GenerateResponse()
    return ("".join(r.text for r in responses),
            tuple(t for r in responses for t in r.token_ids),
            last.finish_reason, last.matched_stop, last.usage.prompt_tokens,
            last.usage.completion_tokens, last.usage.cached_prompt_tokens,
            {r.cached for r in responses})


async def status_of(call) -> tuple[grpc.StatusCode, str, list]:
    """(code, details, messages) of a call expected to fail."""
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            got.append(response)
    return info.value.code(), info.value.details(), got


async def read_rest(call) -> list[generation_pb2.GenerateResponse]:
    """The remaining messages of a call read with ``read()`` (iteration may not be mixed in)."""
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:
        out.append(response)
    return out


def flights(mesh) -> int:
    return len(mesh.router._pipeline._flights)


# --------------------------------------------------------------------------- #
# Through the router


async def test_identical_concurrent_greedy_requests_share_one_generation():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.2  # every request arrives before the first token
        results = await asyncio.gather(*[
            collect(mesh.stub.Generate(request(request_id=f"r{i}"))) for i in range(N)])
        assert len(engine.log.starts) == 1
        assert mesh.cache is not None and mesh.cache.gets == 1  # one lookup, by the flight
        assert flights(mesh) == 0
        assert mesh.metric("llmesh:router_coalesced_requests_total", model_name=MODEL) == N - 1
        # Each follower is a request of its own in the router's metrics.
        assert mesh.metric("llmesh:requests_total", model_name=MODEL, outcome="stop",
                           priority="interactive") == N
        assert mesh.metric("llmesh:time_to_first_token_seconds_count",
                           model_name=MODEL) == N
        assert mesh.metric("llmesh:e2e_request_latency_seconds_count", model_name=MODEL) == N
        assert mesh.metric("llmesh:request_queue_time_seconds_count", model_name=MODEL) == 1
        tokens = len(encode(REPLY)) + 1
        assert mesh.metric("llmesh:generation_tokens_total", model_name=MODEL) == N * tokens
    streams = [as_content(r) for r in results]
    assert all(s == streams[0] for s in streams)
    assert text_of(results[0]) == REPLY
    assert results[0][-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert results[0][-1].usage.completion_tokens == tokens
    assert [{r.request_id for r in rs} for rs in results] == [{f"r{i}"} for i in range(N)]
    assert engine.log.starts[0].request_id in {f"r{i}" for i in range(N)}


async def test_a_follower_that_joins_late_replays_the_stream_from_the_start():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.03
        leader = mesh.stub.Generate(request(request_id="leader"))
        early = [await leader.read() for _ in range(3)]
        follower = await collect(mesh.stub.Generate(request(request_id="follower")))
        rest = await read_rest(leader)
        assert len(engine.log.starts) == 1
    assert as_content(follower) == as_content(early + rest)
    assert text_of(follower) == REPLY


async def test_the_leader_cancelling_does_not_stop_the_others():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.03
        leader = mesh.stub.Generate(request(request_id="leader"))
        first = await leader.read()
        assert first.token_ids
        followers = [mesh.stub.Generate(request(request_id=f"f{i}")) for i in range(N - 1)]
        for call in followers:  # each has joined (its replay starts at once)
            assert (await call.read()).token_ids == first.token_ids
        leader.cancel()
        await wait_for(lambda: mesh.metric(
            "llmesh:requests_total", model_name=MODEL, outcome="cancelled",
            priority="interactive") == 1)
        rests = await asyncio.gather(*[read_rest(call) for call in followers])
        assert len(engine.log.starts) == 1
        assert engine.log.ended == ["finished"]
    for rest in rests:
        assert first.text + text_of(rest) == REPLY
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_stream_cancel_of_the_leader_does_not_stop_a_follower():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.03
        stream = mesh.stub.GenerateStream()
        await stream.write(generation_pb2.GenerateStreamRequest(start=request(request_id="g1")))
        assert (await stream.read()).response.token_ids
        follower = mesh.stub.Generate(request(request_id="f"))
        assert (await follower.read()).token_ids
        await stream.write(generation_pb2.GenerateStreamRequest(
            cancel=generation_pb2.CancelGeneration(request_id="g1")))
        while not (final := (await stream.read()).response).finish_reason:
            pass
        await stream.done_writing()
        rest = await read_rest(follower)
        assert len(engine.log.starts) == 1 and engine.log.ended == ["finished"]
    assert final.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert 1 <= final.usage.completion_tokens < len(REPLY)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_every_subscriber_leaving_cancels_the_engine_stream():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        calls = [mesh.stub.Generate(request(request_id=f"r{i}")) for i in range(N)]
        for call in calls:
            assert (await call.read()).token_ids
        for call in calls[:-1]:
            call.cancel()
        await asyncio.sleep(0.12)
        assert engine.log.ended == []  # one subscriber is left: it runs on
        calls[-1].cancel()
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
        assert len(engine.log.starts) == 1 and engine.log.active == 0
        await wait_for(lambda: flights(mesh) == 0)
        # The next identical request starts a new generation (nothing was stored).
        again = await collect(mesh.stub.Generate(request()))
        assert text_of(again) == REPLY and len(engine.log.starts) == 2


@pytest.mark.parametrize("failure", ["refused", "error_finish"])
async def test_a_failure_reaches_every_subscriber_with_the_same_status(failure: str):
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.2
        if failure == "refused":  # before the first token
            engine.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        else:  # after every token
            engine.finish_with_error = True
        outcomes = await asyncio.gather(*[
            status_of(mesh.stub.Generate(request(request_id=f"r{i}"))) for i in range(N)])
        assert len(engine.log.deadlines) == 1  # one start reached the engine
        assert flights(mesh) == 0
        code = outcomes[0][0]
        assert mesh.metric("llmesh:requests_total", model_name=MODEL,
                           outcome=code.name.lower(), priority="interactive") == N
    expected = (grpc.StatusCode.INVALID_ARGUMENT if failure == "refused"
                else grpc.StatusCode.INTERNAL)
    assert code == expected
    assert {(c, d) for c, d, _ in outcomes} == {outcomes[0][:2]}
    assert len({repr(as_content(got)) for _, _, got in outcomes}) == 1


async def test_sampled_requests_without_a_seed_never_coalesce():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        sampled = common_pb2.SamplingParams(temperature=0.8)
        await asyncio.gather(*[collect(mesh.stub.Generate(request(sampling=sampled)))
                               for _ in range(N)])
        assert len(engine.log.starts) == N
        assert mesh.metric("llmesh:router_coalesced_requests_total", model_name=MODEL) == 0


async def test_seeded_requests_coalesce():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        seeded = common_pb2.SamplingParams(temperature=0.8, seed=7)
        await asyncio.gather(*[collect(mesh.stub.Generate(request(sampling=seeded)))
                               for _ in range(N)])
        assert len(engine.log.starts) == 1


async def test_bypass_cache_requests_never_coalesce():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        await asyncio.gather(*[collect(mesh.stub.Generate(request(bypass_cache=True)))
                               for _ in range(3)])
        assert len(engine.log.starts) == 3


async def test_requests_that_differ_in_what_decides_the_output_run_apart():
    variants = [
        request(sampling=greedy(max_tokens=5)),
        request(sampling=greedy(max_tokens=6)),
        request(sampling=greedy(max_tokens=6, stop=["capital"])),
        request(sampling=greedy(max_tokens=6, stop_token_ids=[ord("s")])),
        request(sampling=greedy(max_tokens=6, ignore_eos=True)),
        request(sampling=greedy(max_tokens=6), priority=common_pb2.PRIORITY_BATCH),
        request(sampling=greedy(max_tokens=6), speculative=common_pb2.SpeculativeParams(
            method=common_pb2.SPECULATIVE_METHOD_NGRAM)),
        request("other", sampling=greedy(max_tokens=6)),
    ]
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        results = await asyncio.gather(*[collect(mesh.stub.Generate(v)) for v in variants])
        assert len(engine.log.starts) == len(variants)
        assert mesh.metric("llmesh:router_coalesced_requests_total", model_name=MODEL) == 0
    assert text_of(results[0]) == REPLY[:5] and text_of(results[1]) == REPLY[:6]


async def test_max_tokens_clamped_to_the_same_room_coalesce():
    """The key holds max_tokens after fitting to the context window."""
    prompt = "p" * 20
    async with make_mesh(max_model_len=32) as mesh:  # 12 tokens of room after the prompt
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        await asyncio.gather(*[collect(mesh.stub.Generate(request(
            prompt, sampling=greedy(max_tokens=m)))) for m in (20, 30)])
        assert len(engine.log.starts) == 1
        assert engine.log.starts[0].sampling.max_tokens == 32 - len(
            engine.log.starts[0].prompt_token_ids) < 20


async def test_a_finished_generation_is_no_longer_in_flight():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        first = await collect(mesh.stub.Generate(request()))
        assert flights(mesh) == 0
        second = await collect(mesh.stub.Generate(request()))  # the response cache
        assert len(engine.log.starts) == 1
    assert second[-1].cached and not first[-1].cached
    assert text_of(second) == text_of(first) == REPLY


async def test_without_a_cache_identical_requests_coalesce_and_a_later_one_runs_anew():
    async with make_mesh(cache=False) as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.1
        await asyncio.gather(*[collect(mesh.stub.Generate(request())) for _ in range(3)])
        assert len(engine.log.starts) == 1
        again = await collect(mesh.stub.Generate(request()))
        assert len(engine.log.starts) == 2 and text_of(again) == REPLY


async def test_each_subscriber_ends_at_its_own_deadline():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        leader = asyncio.ensure_future(collect(mesh.stub.Generate(request(request_id="long"))))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        code, details, got = await status_of(
            mesh.stub.Generate(request(request_id="short"), timeout=0.5))
        took = time.monotonic() - started
        full = await leader
        assert len(engine.log.starts) == 1 and engine.log.ended == ["finished"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "after" in details and "generated tokens" in details
    assert 0.3 < took < 0.5
    assert got and text_of(got) == REPLY[:len(text_of(got))]
    assert text_of(full) == REPLY


async def test_a_deadline_before_the_first_token_of_a_shared_generation_says_so():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.first_delay = 0.6
        outcomes = await asyncio.gather(*[
            status_of(mesh.stub.Generate(request(), timeout=0.3)) for _ in range(3)])
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
        assert len(engine.log.starts) == 1
    for code, details, got in outcomes:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and not got
        assert "before the first token" in details and "allow a longer deadline" in details


# --------------------------------------------------------------------------- #
# SingleFlight on its own


class Boom(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def make_flights() -> SingleFlight[int, None]:
    return SingleFlight(clone=lambda err: Boom(getattr(err, "code", "?")),
                        stopped=lambda: Boom("stopped"))


async def test_single_flight_buffers_and_unregisters_when_the_work_ends():
    table = make_flights()
    gate = asyncio.Event()

    async def work(flight):
        yield 1
        await gate.wait()
        yield 2

    leader = table.start("k", None, None, work)
    assert (await leader.__anext__()) == 1
    follower = table.join("k", None)
    assert follower is not None
    gate.set()
    assert [e async for e in follower] == [1, 2]
    assert [e async for e in leader] == [2]
    assert len(table) == 0 and table.join("k", None) is None


async def test_single_flight_failure_gives_each_subscriber_its_own_exception():
    table = make_flights()

    async def work(flight):
        yield 1
        raise Boom("bad")

    subs = [table.start("k", None, None, work)]
    subs.append(table.join("k", None))
    errors = []
    for sub in subs:
        with pytest.raises(Boom) as info:
            async for _ in sub:
                pass
        errors.append(info.value)
    assert [e.code for e in errors] == ["bad", "bad"] and errors[0] is not errors[1]
    assert len(table) == 0


async def test_single_flight_last_leaver_cancels_the_work():
    table = make_flights()
    cleaned = asyncio.Event()

    async def work(flight):
        try:
            yield 1
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    a = table.start("k", None, None, work)
    b = table.join("k", None)
    assert await a.__anext__() == 1
    await a.aclose()
    await asyncio.sleep(0.01)
    assert not cleaned.is_set() and len(table) == 1
    await b.aclose()
    assert len(table) == 0  # at once: a new request starts anew
    await asyncio.wait_for(cleaned.wait(), 1)


async def test_single_flight_deadlines():
    """A follower joins only if the work cannot end for a deadline before its
    own; each subscriber's own clock ends its wait."""
    table = make_flights()
    admitted = asyncio.Event()
    now = time.monotonic()

    async def work(flight):
        with flight.bound_by(now + 10):  # e.g. an admission wait
            await admitted.wait()
        yield 1
        await asyncio.Event().wait()

    leader = table.start("k", now + 10, None, work)
    await asyncio.sleep(0)
    assert table.join("k", now + 11) is None  # could outlive the bound
    assert table.join("k", None) is None
    short = table.join("k", now + 0.05)
    assert short is not None
    with pytest.raises(DeadlinePassed):
        await short.__anext__()
    admitted.set()
    assert await leader.__anext__() == 1
    later = table.join("k", now + 60)  # nothing binds the work now
    assert later is not None and await later.__anext__() == 1
    await leader.aclose()
    await later.aclose()
    assert len(table) == 0


async def test_single_flight_close_wakes_subscribers_with_a_status():
    table = make_flights()

    async def work(flight):
        await asyncio.Event().wait()
        yield 1

    sub = table.start("k", None, None, work)
    waiting = asyncio.ensure_future(sub.__anext__())
    await asyncio.sleep(0.01)
    await table.close()
    with pytest.raises(Boom) as info:
        await waiting
    assert info.value.code == "stopped"


async def test_a_cancelled_subscriber_reraises_cancelled_error():
    table = make_flights()

    async def work(flight):
        await asyncio.Event().wait()
        yield 1

    sub = table.start("k", None, None, work)
    waiting = asyncio.ensure_future(sub.__anext__())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await sub.aclose()
    assert len(table) == 0
