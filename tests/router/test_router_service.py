"""The router over real gRPC against in-process fake tokenizer, engine and cache."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import grpc
import pytest
import structlog
import structlog.testing
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from llmesh.v1 import (
    cache_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.common import tracing
from services.common.sampling import Priority
from services.common.wire.engine_stream import EngineStart, StreamCancel, pack_requests
from services.router.admission import AdmissionConfig
from services.router.generation import Delta, Finished
from services.router.metrics import RouterMetrics
from services.router import service as router_service
from services.router.service import RouterConfig, RouterService
from services.router.validation import validate_request
from tests.router.router_fakes import (
    CACHED_PROMPT_TOKENS,
    EOS,
    FakeCache,
    FakeEngine,
    FakeTokenizer,
    encode,
    serve,
    template,
)

REPLY = "Paris is the capital of France."
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
CANCELLED = common_pb2.FINISH_REASON_CANCELLED


@dataclass
class Mesh:
    tokenizer: FakeTokenizer
    engines: list[FakeEngine]
    cache: FakeCache | None
    router: RouterService
    stub: generation_pb2_grpc.GenerationServiceStub
    registry: CollectorRegistry
    servers: list[grpc.aio.Server] = field(default_factory=list)
    engine_servers: list[grpc.aio.Server] = field(default_factory=list)
    channel: grpc.aio.Channel | None = None  # the client channel to the router

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def make_mesh(*, engines: int = 1, cache: bool = True, reply: str = REPLY,
                    max_model_len: int = 256, cache_servicer=None, **config):
    """The fake tokenizer, engines and cache (``cache_servicer``: another
    servicer in the fake cache's place, e.g. the real CacheService) behind a
    real router; ``config``: more RouterConfig fields."""
    servers = []
    tokenizer = FakeTokenizer()
    server, tok_target = await serve(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                                     tokenizer)
    servers.append(server)
    fakes, targets, engine_servers = [], [], []
    for i in range(engines):
        fake = FakeEngine(reply, max_model_len=max_model_len, replica_id=f"replica-{i}")
        server, target = await serve(engine_pb2_grpc.add_EngineServiceServicer_to_server, fake)
        fakes.append(fake)
        targets.append(target)
        engine_servers.append(server)
    fake_cache, cache_target = None, None
    if cache:
        fake_cache = FakeCache() if cache_servicer is None else cache_servicer
        server, cache_target = await serve(cache_pb2_grpc.add_CacheServiceServicer_to_server,
                                           fake_cache)
        servers.append(server)
    registry = CollectorRegistry()
    router = RouterService(
        RouterConfig(tokenizer=tok_target, engines=tuple(targets), cache=cache_target,
                     startup_timeout=10, **config),
        metrics=RouterMetrics(registry))
    await router.start()
    router_server = grpc.aio.server()
    router.register(router_server)
    port = router_server.add_insecure_port("127.0.0.1:0")
    await router_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    mesh = Mesh(tokenizer, fakes, fake_cache, router,
                generation_pb2_grpc.GenerationServiceStub(channel), registry,
                servers + engine_servers, engine_servers, channel)
    try:
        yield mesh
    finally:
        await channel.close()
        await router_server.stop(None)
        await router.close()
        for server in mesh.servers:
            await server.stop(None)


async def collect(call) -> list[generation_pb2.GenerateResponse]:
    return [response async for response in call]


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def greedy(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, **kw)


async def wait_for(predicate, timeout: float = 3.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- #
# Generate


async def test_prompt_streams_the_reply_and_a_final_message():
    async with make_mesh(max_model_len=1024) as mesh:
        responses = await collect(mesh.stub.Generate(
            generation_pb2.GenerateRequest(request_id="r-1", prompt="Capital of France?")))
    final = responses[-1]
    assert text_of(responses) == REPLY
    assert [i for r in responses for i in r.token_ids] == encode(REPLY) + [EOS]
    assert all(r.request_id == "r-1" for r in responses)
    assert all(r.finish_reason == 0 for r in responses[:-1])
    assert final.finish_reason == STOP
    assert final.matched_stop == ""
    assert final.usage.prompt_tokens == len("Capital of France?")
    assert final.usage.completion_tokens == len(REPLY) + 1
    assert final.usage.cached_prompt_tokens == 3
    assert final.cached is False
    start = mesh.engines[0].log.starts[0]
    assert list(start.prompt_token_ids) == encode("Capital of France?")
    assert start.request_id == "r-1"
    assert start.sampling.max_tokens == 256  # the default


async def test_the_response_headers_leave_once_the_engine_has_the_request_not_with_the_first_token():
    """The client gets the call's headers while the engine prefills (a 3 s
    first token here), so the first token travels alone behind them (a
    request computed alone: ``bypass_cache``); a request refused before
    dispatch (here OUT_OF_RANGE) still reaches no engine."""
    async with make_mesh() as mesh:
        mesh.engines[0].first_delay = 3.0
        call = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="Capital of France?", sampling=greedy(max_tokens=2), bypass_cache=True))
        await asyncio.wait_for(call.initial_metadata(), timeout=1.5)
        await wait_for(lambda: len(mesh.engines[0].log.starts) == 1)
        call.cancel()
        refused = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="Capital of France?", sampling=greedy(max_tokens=10**9)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(refused)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert len(mesh.engines[0].log.starts) == 1


async def test_the_engine_start_is_written_before_the_response_headers_are_sent(monkeypatch):
    """The start leaves for the engine first: the response headers (and the
    queue-time bookkeeping) follow it instead of holding it in the call's
    queue until the router next waits."""
    unsent_at_headers: list[int] = []
    send_headers = router_service._send_headers

    async def recording(context) -> None:
        unsent_at_headers.append(sum(engine.unsent for pool in mesh.router.pools.values()
                                     for engine in pool.engines))
        await send_headers(context)

    monkeypatch.setattr(router_service, "_send_headers", recording)
    async with make_mesh() as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="Capital of France?", sampling=greedy(max_tokens=2), bypass_cache=True)))
    assert text_of(responses) == REPLY[:2]
    assert unsent_at_headers == [0]


async def test_prompt_token_ids_reach_the_engine_as_sent_or_are_refused_naming_them():
    async with make_mesh() as mesh:
        ids = encode("Capital?")
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt_tokens=generation_pb2.PromptTokens(token_ids=ids))))
        assert text_of(responses) == REPLY and responses[-1].usage.prompt_tokens == len(ids)
        assert list(mesh.engines[0].log.starts[-1].prompt_token_ids) == ids
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                prompt_tokens=generation_pb2.PromptTokens(token_ids=[65, 0x110000]))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt_tokens.token_ids: token id 1114112 is not")


async def test_request_id_comes_from_metadata_and_reaches_every_hop():
    async with make_mesh() as mesh:
        call = mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="hi"),
                                  metadata=(("x-request-id", "meta-7"),))
        responses = await collect(call)
        trailing = dict(await call.trailing_metadata())
    assert {r.request_id for r in responses} == {"meta-7"}
    assert trailing["x-request-id"] == "meta-7"
    assert mesh.engines[0].log.starts[0].request_id == "meta-7"


async def test_a_new_request_id_is_made_when_none_is_given():
    async with make_mesh() as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="a")))
    ids = {r.request_id for r in responses}
    assert len(ids) == 1 and len(ids.pop()) == 32


async def test_stop_string_never_leaks_and_cancels_the_engine():
    async with make_mesh() as mesh:
        mesh.engines[0].step_delay = 0.01
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(stop=["capital", "zzz"]))))
        await wait_for(lambda: mesh.engines[0].log.ended)
    assert text_of(responses) == "Paris is the "
    for r in responses:
        assert "c" not in r.text  # no part of "capital" is ever sent
    final = responses[-1]
    assert final.finish_reason == STOP
    assert final.matched_stop == "capital"
    # usage ends at the token that completed the stop string
    assert final.usage.completion_tokens == len("Paris is the capital")
    assert mesh.engines[0].log.ended[0] == "cancel_msg"


async def test_stop_string_split_over_many_tokens_per_step():
    async with make_mesh() as mesh:
        mesh.engines[0].tokens_per_step = 4
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(stop=["of Fr"]))))
    assert text_of(responses) == "Paris is the capital "
    assert responses[-1].matched_stop == "of Fr"


@pytest.mark.parametrize("tokens_per_step", [1, 3, 8, 16])
async def test_a_stop_string_inside_a_multi_token_step_ends_ids_usage_and_cache_there(
        tokens_per_step):
    """Speculative decoding delivers several ids per message: ids, usage, the
    router's token counter and the stored cache entry must end at the id that
    completed the stop string, as with one id per message."""
    async with make_mesh() as mesh:
        mesh.engines[0].tokens_per_step = tokens_per_step
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(stop=["the"]))))
        await wait_for(lambda: mesh.cache.puts == 1)
        stored = next(iter(mesh.cache.store.values()))
        generated = mesh.metric("llmesh:generation_tokens_total", model_name="fake-model")
    # One id per character: the "e" of "the" completes the stop string.
    through_stop = encode("Paris is the")
    ids = [i for r in responses for i in r.token_ids]
    assert text_of(responses) == "Paris is "
    assert ids == through_stop
    assert responses[-1].usage.completion_tokens == len(through_stop) == generated
    assert list(stored.token_ids) == through_stop
    assert stored.text == "Paris is "


async def test_cached_prompt_tokens_are_reported_when_a_stop_string_ends_it():
    async with make_mesh(cache=False) as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(stop=["the"]))))
    assert responses[-1].matched_stop == "the"
    assert responses[-1].usage.cached_prompt_tokens == CACHED_PROMPT_TOKENS


async def test_stop_token_id_text_is_not_returned():
    async with make_mesh() as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(stop_token_ids=[ord(" ")]))))
    assert text_of(responses) == "Paris"
    assert responses[-1].finish_reason == STOP
    assert responses[-1].usage.completion_tokens == len("Paris ")


async def test_max_tokens_ends_with_length():
    async with make_mesh() as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=5))))
    assert text_of(responses) == "Paris"
    assert responses[-1].finish_reason == LENGTH
    assert responses[-1].usage.completion_tokens == 5


async def test_max_tokens_is_clamped_to_the_room_the_prompt_leaves():
    async with make_mesh(max_model_len=20) as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="x" * 15, sampling=greedy(max_tokens=19))))
        assert mesh.engines[0].log.starts[0].sampling.max_tokens == 5
    assert responses[-1].finish_reason == LENGTH
    assert responses[-1].usage.completion_tokens == 5


async def test_prompt_longer_than_the_window_is_out_of_range():
    async with make_mesh(max_model_len=20) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="x" * 20)))
        assert mesh.engines[0].log.starts == []
        assert mesh.metric("llmesh:requests_total", model_name="fake-model",
                           outcome="out_of_range", priority="interactive") == 1
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith("prompt: the prompt is 20 tokens")
    assert "20 tokens" in info.value.details() and "window is 20" in info.value.details()


async def test_max_tokens_above_cap_is_out_of_range():
    async with make_mesh(max_tokens_cap=100, default_max_tokens=10) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                prompt="q", sampling=greedy(max_tokens=101))))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith("sampling.max_tokens:")


@pytest.mark.parametrize("request_fields,code,field", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "input"),
    (dict(chat=generation_pb2.Chat()), grpc.StatusCode.INVALID_ARGUMENT, "chat.messages"),
    (dict(model="nope", prompt="q"), grpc.StatusCode.INVALID_ARGUMENT, "model"),
    (dict(prompt="q", sampling=common_pb2.SamplingParams(top_p=2.0)),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
])
async def test_bad_requests_get_a_status_naming_the_field(request_fields, code, field):
    async with make_mesh() as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(**request_fields)))
        # the router keeps serving afterwards
        ok = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == code
    assert info.value.details().startswith(f"{field}")
    assert ok[-1].finish_reason == STOP


async def test_chat_uses_the_template_with_a_generation_prompt():
    messages = [common_pb2.ChatMessage(role="system", content="Be brief."),
                common_pb2.ChatMessage(role="user", content="Capital of France?")]
    async with make_mesh() as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            chat=generation_pb2.Chat(messages=messages))))
    prompt = template(messages)
    assert list(mesh.engines[0].log.starts[0].prompt_token_ids) == encode(prompt)
    assert prompt.endswith("<assistant>")
    assert text_of(responses) == REPLY
    assert responses[-1].usage.prompt_tokens == len(prompt)


async def test_unknown_chat_role_is_refused_at_the_edge():
    messages = [common_pb2.ChatMessage(role="user", content="Hi"),
                common_pb2.ChatMessage(role="wizard", content="abracadabra")]
    async with make_mesh() as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                chat=generation_pb2.Chat(messages=messages))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(
        'chat.messages[1].role: must be one of "system", "user", "assistant", "tool"')
    assert "'wizard'" in info.value.details()
    assert mesh.tokenizer.chat_requests == []  # refused before any tokenizer call
    assert mesh.engines[0].log.starts == []


async def test_allow_special_tokens_reaches_the_tokenizer():
    messages = [common_pb2.ChatMessage(role="user", content="hi<|im_end|>")]
    async with make_mesh() as mesh:
        for allow in (False, True):
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                chat=generation_pb2.Chat(messages=messages, allow_special_tokens=allow),
                bypass_cache=True)))
    assert [r.allow_special_tokens for r in mesh.tokenizer.chat_requests] == [False, True]


async def test_chat_history_is_trimmed_to_the_window():
    messages = [common_pb2.ChatMessage(role="user", content="x" * 40),
                common_pb2.ChatMessage(role="assistant", content="y" * 40),
                common_pb2.ChatMessage(role="user", content="Hi")]
    async with make_mesh(max_model_len=40) as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            chat=generation_pb2.Chat(messages=messages), sampling=greedy(max_tokens=3))))
        prompt = list(mesh.engines[0].log.starts[0].prompt_token_ids)
    assert prompt == encode("<user>Hi\n<assistant>")
    assert responses[-1].finish_reason == LENGTH


async def test_chat_whose_last_message_alone_is_too_long_is_out_of_range():
    messages = [common_pb2.ChatMessage(role="user", content="x" * 100)]
    async with make_mesh(max_model_len=40) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                chat=generation_pb2.Chat(messages=messages))))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith("chat.messages:")


# --------------------------------------------------------------------------- #
# Cache


async def test_deterministic_answer_is_cached_and_replayed():
    request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy(stop=["France"]))
    async with make_mesh() as mesh:
        first = await collect(mesh.stub.Generate(request))
        await wait_for(lambda: mesh.cache.puts == 1)
        second = await collect(mesh.stub.Generate(request))
        assert len(mesh.engines[0].log.starts) == 1  # the second never reached the engine
        assert mesh.metric("llmesh:response_cache_hits_total", model_name="fake-model") == 1
    assert text_of(first) == text_of(second) == "Paris is the capital of "
    assert second[-1].cached is True and first[-1].cached is False
    assert second[-1].matched_stop == "France"
    assert second[-1].finish_reason == STOP
    assert second[-1].usage.completion_tokens == len("Paris is the capital of France")  # through the stop
    assert [i for r in second for i in r.token_ids] == [i for r in first for i in r.token_ids]
    # A replay prefilled nothing: every prompt token counts as cached (``cached``
    # tells it from an engine run); the engine's own run reported its reuse.
    assert first[-1].usage.cached_prompt_tokens == CACHED_PROMPT_TOKENS
    assert second[-1].usage.cached_prompt_tokens == second[-1].usage.prompt_tokens == 1


async def test_bypass_cache_skips_the_lookup_but_stores_the_answer():
    async with make_mesh() as mesh:
        pipeline = mesh.router._pipeline
        request = validate_request(
            generation_pb2.GenerateRequest(prompt="q"), request_id="b1",
            models=mesh.router.models, default_model=mesh.router.default_model)
        bypass = dataclasses.replace(request, bypass_cache=True)
        events = [e async for e in pipeline.run(bypass, received_at=time.monotonic())]
        await wait_for(lambda: mesh.cache.puts == 1)
        assert mesh.cache.gets == 0
        again = [e async for e in pipeline.run(bypass, received_at=time.monotonic())]
        assert mesh.cache.gets == 0 and len(mesh.engines[0].log.starts) == 2
        cached = [e async for e in pipeline.run(request, received_at=time.monotonic())]
    assert isinstance(events[-1], Finished) and not events[-1].cached
    assert isinstance(again[-1], Finished) and not again[-1].cached
    assert isinstance(cached[-1], Finished) and cached[-1].cached
    assert "".join(e.text for e in cached if isinstance(e, Delta)) == REPLY


async def test_seeded_sampling_is_cached_but_unseeded_is_not():
    seeded = generation_pb2.GenerateRequest(
        prompt="q", sampling=common_pb2.SamplingParams(temperature=0.8, seed=1))
    unseeded = generation_pb2.GenerateRequest(
        prompt="q", sampling=common_pb2.SamplingParams(temperature=0.8))
    async with make_mesh() as mesh:
        await collect(mesh.stub.Generate(unseeded))
        await collect(mesh.stub.Generate(unseeded))
        assert mesh.cache.gets == 0 and mesh.cache.puts == 0
        await collect(mesh.stub.Generate(seeded))
        await wait_for(lambda: mesh.cache.puts == 1)
        again = await collect(mesh.stub.Generate(seeded))
    assert again[-1].cached is True


async def test_a_failing_cache_never_fails_the_request():
    async with make_mesh() as mesh:
        mesh.cache.fail = True
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
        await wait_for(lambda: mesh.cache.puts == 1)
    assert text_of(responses) == REPLY
    # One lookup, asked twice: on the call, which the cache ends, then unary
    # (services/router/cache_lookups.py), which it fails too: a miss.
    assert mesh.cache.gets == 2


async def test_without_a_cache_everything_still_works():
    async with make_mesh(cache=False) as mesh:
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert text_of(responses) == REPLY
    assert responses[-1].cached is False


# --------------------------------------------------------------------------- #
# Engines: errors, routing, cancel, deadline


async def test_engine_unavailable_is_unavailable_with_a_clear_message():
    async with make_mesh() as mesh:
        mesh.engines[0].fail_code = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no engine replica could take the request" in info.value.details()


async def test_a_stopped_engine_is_unavailable():
    async with make_mesh() as mesh:
        await mesh.engine_servers[0].stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"),
                                             timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine" in info.value.details()


async def test_engine_refusal_keeps_its_code():
    async with make_mesh() as mesh:
        mesh.engines[0].fail_code = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused" in info.value.details()


async def test_engine_refusing_a_field_as_unimplemented_is_invalid_argument_naming_it():
    """An engine from before issue 30 answered UNIMPLEMENTED for a field its
    backend cannot honour: the client's to drop, so INVALID_ARGUMENT."""
    async with make_mesh() as mesh:
        mesh.engines[0].fail_code = grpc.StatusCode.UNIMPLEMENTED
        mesh.engines[0].fail_message = "sampling.min_tokens: is not implemented by demo"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "sampling.min_tokens: is not implemented by demo"


async def test_engine_error_finish_is_internal():
    async with make_mesh() as mesh:
        mesh.engines[0].finish_with_error = True
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == grpc.StatusCode.INTERNAL


async def test_a_failing_replica_is_skipped():
    async with make_mesh(engines=2) as mesh:
        mesh.engines[0].fail_code = grpc.StatusCode.UNAVAILABLE
        sampled = common_pb2.SamplingParams(temperature=1.0)  # not cacheable
        for _ in range(3):
            responses = await collect(mesh.stub.Generate(
                generation_pb2.GenerateRequest(prompt="q", sampling=sampled)))
            assert text_of(responses) == REPLY
        assert len(mesh.engines[1].log.starts) == 3


async def test_concurrent_requests_go_to_the_least_loaded_replica():
    async with make_mesh(engines=2) as mesh:
        for engine in mesh.engines:
            engine.step_delay = 0.02
        calls = [collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt=f"q{i}")))
                 for i in range(4)]
        results = await asyncio.gather(*calls)
        assert [len(e.log.starts) for e in mesh.engines] == [2, 2]
        assert [e.in_flight for e in mesh.router._engines] == [0, 0]
    assert all(text_of(r) == REPLY for r in results)


async def test_the_router_follows_each_open_streams_progress_on_its_replica():
    """Routing bounds the wait for a slot from this router's open streams
    (their max_tokens less the tokens they generated): the record follows
    every token the engine sends, and goes when the stream ends."""
    async with make_mesh() as mesh:
        mesh.engines[0].step_delay = 0.02
        engine = mesh.router._engines[0]
        call = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=40, ignore_eos=True), bypass_cache=True))
        received = 0
        while received < 5:
            received += len((await call.read()).token_ids)
        (opened,) = engine.open_requests
        assert opened.max_tokens == 40 and opened.generated[0] >= received
        assert engine.tokens_left(Priority.BATCH) == [40 - opened.generated[0]]
        assert engine.tokens_left(Priority.INTERACTIVE) == [40 - opened.generated[0]]
        while await call.read() is not grpc.aio.EOF:
            pass
        assert engine.open_requests == set() and engine.sequences == 0


async def test_client_cancel_drops_the_engine_stream_at_once():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        call = mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"))
        first = await call.read()
        assert first.text or first.token_ids
        call.cancel()
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
        await wait_for(lambda: mesh.metric("llmesh:requests_total", model_name="fake-model",
                                           outcome="cancelled", priority="interactive") == 1)
        assert engine.log.active == 0


async def test_requests_to_a_replica_share_one_multiplex_call():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.01
        sampled = common_pb2.SamplingParams(temperature=1.0)  # not cacheable
        results = await asyncio.gather(*[collect(mesh.stub.Generate(
            generation_pb2.GenerateRequest(prompt=f"q{i}", sampling=sampled)))
            for i in range(6)])
        assert all(text_of(r) == REPLY for r in results)
        assert len(engine.log.starts) == 6
        assert len(engine.log.metadata) == 1  # one call, not one per request
        assert engine.log.late_cancels == 0  # finished requests are not cancelled


async def test_a_replica_that_drops_its_call_fails_only_its_open_requests_and_is_called_again():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        call = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=50, ignore_eos=True)))
        assert (await call.read()).token_ids
        await engine.drop_calls()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        # Tokens had streamed, so no other replica may take over: UNAVAILABLE.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == ("engine replica 'replica-0' of model 'fake-model' is "
                                        "unavailable; retry the request")
        engine.step_delay = 0.0
        # The failed call took the replica out of routing until a health probe
        # (sent at once) found it SERVING: back within a few milliseconds.
        replicas = mesh.router._replicas
        await wait_for(lambda: replicas.serving() == list(replicas.engines), timeout=1)
        again = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q2", sampling=greedy())))
        assert text_of(again) == REPLY
        assert len(engine.log.metadata) == 2  # a new call


async def test_upstream_failures_name_the_replica_to_clients_and_the_address_only_in_the_log():
    """QA, issue 33: a client saw ``engine at 127.0.0.1:42719 is unavailable:
    ... Connection reset by peer``. The client gets the replica's id, the
    model and what to do; the address and the cause go to the router's log
    line with the request id."""
    async with make_mesh(tokenize_in_router=False) as mesh:
        engine = mesh.engines[0]
        engine.fail_code = grpc.StatusCode.UNAVAILABLE
        engine.fail_message = "recvmsg: Connection reset by peer"
        with structlog.testing.capture_logs(
                processors=[structlog.contextvars.merge_contextvars]) as logs:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                    prompt="q", request_id="rid-1")))
            engine.fail_code = None
            await mesh.servers[0].stop(None)  # the tokenizer
            with pytest.raises(grpc.aio.AioRpcError) as no_tokenizer:
                await collect(mesh.stub.Generate(
                    generation_pb2.GenerateRequest(prompt="q", request_id="rid-2"), timeout=5))
    engine_target = mesh.router._engines[0].target
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == (
        "no engine replica could take the request for model 'fake-model' (tried replica-0: "
        "UNAVAILABLE); retry in a few seconds")
    assert no_tokenizer.value.code() == grpc.StatusCode.UNAVAILABLE
    assert no_tokenizer.value.details() == (
        "the tokenizer for model 'fake-model' is unavailable; retry the request")
    logged = [e for e in logs if e.get("engine") == engine_target
              and "Connection reset by peer" in e.get("details", "")]
    assert logged and logged[0]["request_id"] == "rid-1"
    logged = [e for e in logs if e.get("upstream") == "tokenizer"]
    assert logged and logged[0]["request_id"] == "rid-2"
    assert logged[0]["target"].startswith("127.0.0.1:") and logged[0]["details"]


async def test_queued_requests_end_unavailable_when_the_last_replica_dies():
    """With its only replica gone, a request queued in the router ends at once
    with UNAVAILABLE, not at its deadline or never."""
    async with make_mesh(admission=AdmissionConfig(max_running_per_replica=1)) as mesh:
        mesh.engines[0].step_delay = 0.05
        long = greedy(max_tokens=200, ignore_eos=True)
        running = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=long, bypass_cache=True))
        assert (await running.read()).token_ids
        queued = asyncio.ensure_future(collect(mesh.stub.Generate(
            generation_pb2.GenerateRequest(prompt="q2", sampling=long, bypass_cache=True))))
        await wait_for(lambda: mesh.router.admission["fake-model"].queue_depth(
            Priority.INTERACTIVE) == 1)
        stopped = time.monotonic()
        await mesh.engine_servers[0].stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await queued
        assert time.monotonic() - stopped < 1.0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no engine replica is serving" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            while await running.read() is not grpc.aio.EOF:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_traced_request_s_admission_wait_and_attributes_are_recorded(monkeypatch):
    """A request computed alone: its ``llmesh.admission_wait`` (timed on the
    way, recorded when it ends) is a child of ``llmesh.generate`` inside its
    time, and the request's parameters are on ``llmesh.generate``; a wait that
    fails (a deadline the queue cannot meet) is an ERROR span at once."""
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    exporter = InMemorySpanExporter()
    tracing.configure("router", None, exporter=exporter)
    try:
        async with make_mesh(admission=AdmissionConfig(max_running_per_replica=1)) as mesh:
            mesh.engines[0].step_delay = 0.05
            running = mesh.stub.Generate(generation_pb2.GenerateRequest(
                request_id="traced", prompt="q", bypass_cache=True,
                sampling=greedy(max_tokens=200, ignore_eos=True)))
            assert (await running.read()).token_ids
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                    prompt="q2", bypass_cache=True, sampling=greedy(max_tokens=200)),
                    timeout=0.3))
            assert late.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                         grpc.StatusCode.RESOURCE_EXHAUSTED)
            running.cancel()
            await wait_for(lambda: len([s for s in exporter.get_finished_spans()
                                        if s.name == "llmesh.generate"]) == 2)
    finally:
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    generate = next(s for s in spans if s.name == "llmesh.generate"
                    and s.attributes[tracing.REQUEST_ID] == "traced")
    assert generate.attributes[tracing.REQUEST_MAX_TOKENS] == 200
    assert generate.attributes["llmesh.priority"] == "interactive"
    waits = {s.context.trace_id: s for s in spans if s.name == "llmesh.admission_wait"}
    admitted = waits.pop(generate.context.trace_id)
    assert admitted.parent.span_id == generate.context.span_id
    assert generate.start_time <= admitted.start_time <= admitted.end_time <= generate.end_time
    assert admitted.status.is_ok
    (refused,) = waits.values()
    assert not refused.status.is_ok and refused.status.description


async def test_a_slow_reader_gets_the_tokens_that_piled_up_in_one_delta():
    # Coalescing toward slow clients: updates that arrive while the consumer is
    # busy merge into one delta (never a queue of messages), text unchanged.
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.005
        request = validate_request(
            generation_pb2.GenerateRequest(prompt="q", bypass_cache=True), request_id="slow",
            models=mesh.router.models, default_model=mesh.router.default_model)
        deltas = []
        async for event in mesh.router._pipeline.run(request, received_at=time.monotonic()):
            if isinstance(event, Delta):
                deltas.append(event)
                if len(deltas) == 1:
                    await asyncio.sleep(0.3)  # the engine streams on meanwhile
        assert "".join(d.text for d in deltas) == REPLY
        assert len(deltas[0].token_ids) == 1
        assert len(deltas[1].token_ids) >= 10  # what came during the pause, at once
        assert len(deltas) < len(REPLY) // 2


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
async def test_deadline_is_passed_on_and_honoured(shared: bool):
    """``shared``: a greedy request runs as a shared generation (single flight)."""
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                prompt="q", bypass_cache=not shared), timeout=0.5))
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Tokens had streamed: the message says the answer was cut, not that none came.
    assert "after" in info.value.details() and "generated tokens" in info.value.details()
    assert "waiting for the engine" not in info.value.details()
    if shared:
        # A shared generation's engine stream has no deadline: each subscriber
        # ends at its own on the router's clock, and the last one leaving
        # cancels the sequence (above: "cancel_msg").
        assert engine.log.deadlines == [None]
    else:
        # the engine got the time the client had left (the wire format rounds up a little)
        assert engine.log.deadlines[0] is not None and 0 < engine.log.deadlines[0] <= 0.52


async def test_a_deadline_before_the_first_token_says_so():
    async with make_mesh() as mesh:
        mesh.engines[0].first_delay = 1.0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"),
                                             timeout=0.4))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "before the first token" in info.value.details()
    assert "allow a longer deadline" in info.value.details()


async def test_a_short_deadline_keeps_most_of_its_time():
    """The router ends a call before the client's deadline so that its own
    status arrives, but by at most a fifth of a short deadline: a 90 ms call
    is served, not refused at once (the margin used to be a flat 100 ms). A
    first call without a deadline opens the channels, so the timed one measures
    serving, not connection set-up on a loaded machine."""
    async with make_mesh() as mesh:
        await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=2)), timeout=10))
        responses = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=2)), timeout=0.09))
    assert responses[-1].finish_reason == LENGTH and text_of(responses) == REPLY[:2]


class _TimeLeft:
    """A ServicerContext's ``time_remaining`` and nothing else."""

    def __init__(self, remaining: float | None) -> None:
        self._remaining = remaining

    def time_remaining(self) -> float | None:
        return self._remaining


@pytest.mark.parametrize(("remaining", "margin"), [
    (None, None), (10.0, 0.1), (0.5, 0.1), (0.09, 0.018), (0.0, 0.0), (-1.0, 0.0)])
def test_the_deadline_margin_is_a_fifth_of_a_short_deadline_and_100_ms_at_most(
        remaining, margin):
    before = time.monotonic()
    deadline = router_service._deadline(_TimeLeft(remaining))
    after = time.monotonic()
    if remaining is None:
        assert deadline is None
        return
    assert before + remaining - margin - 1e-9 <= deadline <= after + remaining - margin + 1e-9


async def test_draining_router_refuses_new_requests():
    async with make_mesh() as mesh:
        await mesh.router.drain()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q")))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in info.value.details()


async def test_list_models():
    async with make_mesh(max_model_len=300, max_tokens_cap=1000) as mesh:
        reply = await mesh.stub.ListModels(generation_pb2.ListModelsRequest())
    assert [(m.id, m.max_model_len, m.max_tokens_cap, m.chat) for m in reply.models] == [
        ("fake-model", 300, 299, True)]


async def test_list_models_refuses_unknown_field_numbers():
    async with make_mesh() as mesh:
        call = mesh.channel.unary_unary(
            "/llmesh.v1.GenerationService/ListModels",
            response_deserializer=generation_pb2.ListModelsResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"\xa8\x03\x01", timeout=5)  # field 53, varint 1
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: unknown field number 53: ")


async def test_generate_stream_names_unknown_field_numbers_by_their_path():
    """Unknown field numbers on a GenerateStream message are refused naming where
    they are (the top-level message, or inside ``start``), not "set start or cancel"."""
    start = generation_pb2.GenerateRequest(prompt="q").SerializeToString() + b"\xa8\x03\x01"
    cases = [(b"\xa8\x03\x01", "request: unknown field number 53: "
              "llmesh.v1.GenerateStreamRequest"),
             (b"\x0a" + bytes([len(start)]) + start, "start: unknown field number 53: "
              "llmesh.v1.GenerateRequest")]
    async with make_mesh() as mesh:
        stream = mesh.channel.stream_stream(
            "/llmesh.v1.GenerationService/GenerateStream",
            response_deserializer=generation_pb2.GenerateStreamResponse.FromString)
        for raw, message in cases:
            call = stream(iter([raw]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in call]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(message), info.value.details()
        assert mesh.engines[0].log.starts == []
        assert mesh.metric("llmesh:requests_total", model_name="fake-model",
                           outcome="invalid_argument", priority="interactive") == 1


async def test_metrics_are_observed():
    async with make_mesh() as mesh:
        await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", priority=common_pb2.PRIORITY_BATCH)))
        labels = dict(model_name="fake-model")
        assert mesh.metric("llmesh:requests_total", outcome="stop", priority="batch",
                           **labels) == 1
        assert mesh.metric("llmesh:time_to_first_token_seconds_count", **labels) == 1
        assert mesh.metric("llmesh:e2e_request_latency_seconds_count", **labels) == 1
        assert mesh.metric("llmesh:request_queue_time_seconds_count", **labels) == 1
        assert mesh.metric("llmesh:inter_token_latency_seconds_count", **labels) == len(REPLY)
        assert mesh.metric("llmesh:prompt_tokens_total", **labels) == 1
        assert mesh.metric("llmesh:generation_tokens_total", **labels) == len(REPLY) + 1


async def test_token_metrics_are_observed_after_the_token_is_handed_on():
    # The first token's way to its client carries no histogram work: its TTFT
    # (and each later token's ITL, and the request's prefix hits) is observed
    # once the consumer (the write to the client) comes back for more.
    async with make_mesh() as mesh:
        request = validate_request(
            generation_pb2.GenerateRequest(prompt="q", bypass_cache=True), request_id="ttft",
            models=mesh.router.models, default_model=mesh.router.default_model)
        labels = dict(model_name="fake-model")
        seen = []
        async for event in mesh.router._pipeline.run(request, received_at=time.monotonic()):
            seen.append((mesh.metric("llmesh:time_to_first_token_seconds_count", **labels),
                         mesh.metric("llmesh:inter_token_latency_seconds_count", **labels)))
        assert seen[:3] == [(0, 0), (1, 0), (1, 1)]
        assert mesh.metric("llmesh:time_to_first_token_seconds_count", **labels) == 1
        assert mesh.metric("llmesh:inter_token_latency_seconds_count", **labels) == len(REPLY)
        assert mesh.metric("llmesh:router_prefix_hit_tokens_count", **labels) == 1


async def test_a_consumer_that_stops_at_the_first_token_still_counts_its_ttft():
    async with make_mesh() as mesh:
        request = validate_request(
            generation_pb2.GenerateRequest(prompt="q", bypass_cache=True), request_id="gone",
            models=mesh.router.models, default_model=mesh.router.default_model)
        events = mesh.router._pipeline.run(request, received_at=time.monotonic())
        assert isinstance(await anext(events), Delta)
        await events.aclose()  # the client went away during the first write
        labels = dict(model_name="fake-model")
        assert mesh.metric("llmesh:time_to_first_token_seconds_count", **labels) == 1
        assert mesh.metric("llmesh:router_prefix_hit_tokens_count", **labels) == 1


# --------------------------------------------------------------------------- #
# GenerateStream


def start(prompt: str, **kw) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        start=generation_pb2.GenerateRequest(prompt=prompt, **kw))


def cancel(request_id: str = "") -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        cancel=generation_pb2.CancelGeneration(request_id=request_id))


async def read_generation(call) -> list[generation_pb2.GenerateResponse]:
    out = []
    while True:
        message = await call.read()
        assert message is not grpc.aio.EOF
        out.append(message.response)
        if message.response.finish_reason:
            return out


async def test_stream_runs_several_generations_in_turn():
    async with make_mesh() as mesh:
        call = mesh.stub.GenerateStream()
        await call.write(start("one", request_id="g1"))
        first = await read_generation(call)
        await call.write(start("two", request_id="g2", sampling=greedy(max_tokens=3)))
        second = await read_generation(call)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert text_of(first) == REPLY and {r.request_id for r in first} == {"g1"}
    assert text_of(second) == "Par" and {r.request_id for r in second} == {"g2"}
    assert second[-1].finish_reason == LENGTH


async def test_stream_cancel_ends_with_cancelled_and_frees_the_engine():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        call = mesh.stub.GenerateStream()
        await call.write(start("one", request_id="g1"))
        got = [(await call.read()).response]
        await call.write(cancel("g1"))
        got += await read_generation(call)
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
        # the stream stays usable
        await call.write(start("two", sampling=greedy(max_tokens=2)))
        after = await read_generation(call)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    final = got[-1]
    assert final.finish_reason == CANCELLED
    assert final.request_id == "g1"
    assert 1 <= final.usage.completion_tokens < len(REPLY)
    assert final.usage.prompt_tokens == 3
    assert REPLY.startswith(text_of(got))
    assert text_of(after) == "Pa"


async def test_stream_cancel_naming_another_id_is_ignored():
    async with make_mesh() as mesh:
        mesh.engines[0].step_delay = 0.005
        call = mesh.stub.GenerateStream()
        await call.write(start("one", request_id="g1"))
        await call.write(cancel("old-one"))
        responses = await read_generation(call)
        await call.done_writing()
    assert text_of(responses) == REPLY
    assert responses[-1].finish_reason == STOP


async def test_stream_second_start_while_running_is_failed_precondition():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        call = mesh.stub.GenerateStream()
        await call.write(start("one", request_id="g1"))
        await call.read()
        await call.write(start("two"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                await call.read()
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "g1" in info.value.details()


async def test_stream_half_close_lets_the_generation_finish():
    async with make_mesh() as mesh:
        call = mesh.stub.GenerateStream()
        await call.write(start("one"))
        await call.done_writing()
        responses = []
        async for message in call:
            responses.append(message.response)
    assert text_of(responses) == REPLY
    assert responses[-1].finish_reason == STOP


async def test_stream_bad_start_ends_the_stream_with_its_status():
    async with make_mesh() as mesh:
        call = mesh.stub.GenerateStream()
        await call.write(start("", request_id="bad"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt:")


async def test_stream_client_cancel_drops_the_engine_stream():
    async with make_mesh() as mesh:
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        call = mesh.stub.GenerateStream()
        await call.write(start("one"))
        await call.read()
        call.cancel()
        await wait_for(lambda: engine.log.ended == ["cancel_msg"], timeout=2)
        assert engine.log.active == 0


async def test_stream_generation_error_ends_the_stream_with_its_status():
    async with make_mesh(max_model_len=20) as mesh:
        call = mesh.stub.GenerateStream()
        await call.write(start("x" * 30))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith("prompt:")


# --------------------------------------------------------------------------- #
# Logs


@pytest.mark.parametrize("log_content", [False, True])
async def test_text_is_logged_only_with_log_content(log_content):
    async with make_mesh(log_content=log_content) as mesh:
        with structlog.testing.capture_logs() as logs:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                prompt="secret question", request_id="log-1")))
    finished = [e for e in logs if e["event"] == "request_finished"]
    assert len(finished) == 1
    assert finished[0]["outcome"] == "stop"
    assert finished[0]["completion_tokens"] == len(REPLY) + 1
    dumped = repr(logs)
    assert ("secret question" in dumped) is log_content
    assert (REPLY in dumped) is log_content


async def test_the_speculative_switch_reaches_the_engine():
    speculative = common_pb2.SpeculativeParams(method=common_pb2.SPECULATIVE_METHOD_DRAFT,
                                               num_speculative_tokens=3)
    async with make_mesh() as mesh:
        await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=2), speculative=speculative)))
        await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=2), bypass_cache=True)))
        first, second = mesh.engines[0].log.starts
    assert first.speculative == speculative
    assert not second.HasField("speculative")  # unset: the engine's defaults


def test_a_burst_of_long_prompts_goes_out_in_messages_of_about_one_mib():
    # 10 prompts of 50,000 ids (at most ~250 kB each on the wire) and a cancel,
    # queued while the call's writer was busy.
    queued: list[EngineStart | StreamCancel] = [
        EngineStart(i, engine_pb2.EngineRequest(request_id=f"r{i}",
                                                prompt_token_ids=[7] * 50_000))
        for i in range(1, 11)]
    queued.append(StreamCancel(3))
    written = pack_requests(queued)
    assert [len(m.starts) for m in written] == [4, 4, 2]
    assert [s.stream_id for m in written for s in m.starts] == list(range(1, 11))
    assert [list(m.cancels) for m in written] == [[3], [], []]
