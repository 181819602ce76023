"""Several models behind one router (services.router.model_pool): each with its
own tokenizer and engines, requests routed by ``model``, listed by ListModels;
an unknown model is INVALID_ARGUMENT listing the served ids, chat input to a
model without a chat template FAILED_PRECONDITION. Real gRPC on loopback with
the fake tokenizer and engines of router_fakes (no model)."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import structlog
from prometheus_client import CollectorRegistry

from llmesh.v1 import (
    cache_pb2_grpc,
    common_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.router.__main__ import build_parser
from services.router.metrics import RouterMetrics
from services.router.model_pool import PoolConfig
from services.router.service import RouterConfig, RouterService
from services.router.tools.formats import ToolCallFormat
from tests.router.router_fakes import FakeCache, FakeEngine, FakeTokenizer, serve

CHAT_REPLY = "Paris is the capital of France."
BASE_REPLY = "Bonjour tout le monde."


@contextlib.asynccontextmanager
async def two_models(*, second_model: str = "base-model", tool_call_formats=None,
                     second_chat: bool = False, registry: CollectorRegistry | None = None,
                     started: list[RouterService] | None = None, **config):
    """A router serving ``fake-model`` (chat; the default) and ``second_model``
    (a chat template only with ``second_chat``), each with its own tokenizer
    and one engine; ``registry``: the router's metrics; ``started`` gets the
    router; ``config``: more RouterConfig fields."""
    servers: list[grpc.aio.Server] = []

    async def start(add, servicer) -> str:
        server, target = await serve(add, servicer)
        servers.append(server)
        return target

    chat_engine = FakeEngine(CHAT_REPLY)
    base_engine = FakeEngine(BASE_REPLY, model=second_model, max_model_len=128)
    config = RouterConfig(
        tokenizer=await start(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                              FakeTokenizer()),
        engines=(await start(engine_pb2_grpc.add_EngineServiceServicer_to_server,
                             chat_engine),),
        cache=await start(cache_pb2_grpc.add_CacheServiceServicer_to_server, FakeCache()),
        startup_timeout=10, tool_call_formats=tool_call_formats or {},
        pools=(PoolConfig(
            await start(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server,
                        FakeTokenizer(model=second_model, has_chat_template=second_chat)),
            (await start(engine_pb2_grpc.add_EngineServiceServicer_to_server,
                         base_engine),)),), **config)
    router = RouterService(config, metrics=RouterMetrics(registry or CollectorRegistry()))
    if started is not None:
        started.append(router)
    try:
        await router.start()
        router_server = grpc.aio.server()
        router.register(router_server)
        port = router_server.add_insecure_port("127.0.0.1:0")
        await router_server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generation_pb2_grpc.GenerationServiceStub(channel), chat_engine, base_engine
        await router_server.stop(None)
    finally:
        await router.close()
        for server in servers:
            await server.stop(None)


async def text(stub, **request) -> str:
    responses = [r async for r in stub.Generate(generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=64), **request),
        timeout=10)]
    assert responses[-1].finish_reason
    return "".join(r.text for r in responses)


async def test_requests_go_to_the_pool_of_the_model_they_name():
    async with two_models() as (stub, chat_engine, base_engine):
        assert await text(stub, prompt="q1") == CHAT_REPLY  # "" is the default model
        assert await text(stub, model="fake-model", prompt="q2") == CHAT_REPLY
        assert await text(stub, model="base-model", prompt="q1") == BASE_REPLY
        chat = generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="q")])
        assert await text(stub, model="fake-model", chat=chat) == CHAT_REPLY
        listed = await stub.ListModels(generation_pb2.ListModelsRequest())
    assert len(chat_engine.log.starts) == 3 and len(base_engine.log.starts) == 1
    assert [(m.id, m.chat, m.max_model_len) for m in listed.models] == [
        ("fake-model", True, 256), ("base-model", False, 128)]
    assert all(m.admission.enabled for m in listed.models)


async def test_an_unknown_model_lists_the_served_ids_and_chat_needs_a_template():
    async with two_models() as (stub, chat_engine, base_engine):
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await text(stub, model="gpt-4", prompt="q")
        with pytest.raises(grpc.aio.AioRpcError) as no_template:
            await text(stub, model="base-model", chat=generation_pb2.Chat(
                messages=[common_pb2.ChatMessage(role="user", content="q")]))
        assert await text(stub, model="base-model", prompt="q") == BASE_REPLY  # still serving
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model 'gpt-4'" in unknown.value.details()
    assert "'base-model', 'fake-model'" in unknown.value.details()
    assert no_template.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'base-model' has no chat template" in no_template.value.details()
    assert not chat_engine.log.starts and len(base_engine.log.starts) == 1


async def test_two_pools_of_one_model_id_do_not_start():
    with pytest.raises(RuntimeError, match="two pools serve model 'fake-model'"):
        async with two_models(second_model="fake-model"):
            pass


async def test_a_tool_call_format_for_no_served_model_is_a_warning():
    """QA: --tool-call-format nosuchmodel=none started silently."""
    formats = {"nosuchmodel": ToolCallFormat.NONE, "base-model": ToolCallFormat.NONE,
               "": ToolCallFormat.HERMES}
    with structlog.testing.capture_logs() as logs:
        async with two_models(tool_call_formats=formats):
            pass
    warned = [e for e in logs if e["event"] == "tool_call_format_unknown_model"]
    assert [(e["model"], e["served"]) for e in warned] == [
        ("nosuchmodel", ["base-model", "fake-model"])]


def test_a_bad_tool_call_format_flag_names_the_formats(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-format", "bogus"])
    assert "one of auto, template, hermes, none" in capsys.readouterr().err


async def test_a_cascade_window_past_the_small_models_context_is_refused_at_start():
    """QA: ``--cascade-window 1000000000`` was accepted (every answer would be
    held back whole); the router refuses to start, naming the flag."""
    from services.router.cascade.policy import CascadePolicy

    with pytest.raises(RuntimeError, match=r"--cascade-window 1000000000: .*\(256 tokens\)"):
        async with two_models(cascade=CascadePolicy("fake-model", "base-model",
                                                    window_tokens=10**9)):
            pass
    async with two_models(cascade=CascadePolicy("fake-model", "base-model",
                                                window_tokens=256)):
        pass


async def test_the_cascade_prompt_rule_tokenizes_the_prompt_once():
    """Issue 34: the prompt-only rule tokenized the prompt, then the small leg
    did again; now the rule reads the small leg's own prompt ids."""
    from services.router.cascade.policy import CascadePolicy

    registry = CollectorRegistry()

    def tokenized(model: str) -> float:
        return sum(registry.get_sample_value("llmesh:router_tokenize_total",
                                             {"model_name": model, "path": path}) or 0.0
                   for path in ("local", "service"))

    policy = CascadePolicy("fake-model", "base-model", max_prompt_tokens=40)
    async with two_models(cascade=policy, registry=registry) as (stub, chat_engine, base_engine):
        assert await text(stub, model="auto", prompt="short") == CHAT_REPLY
        assert (tokenized("fake-model"), tokenized("base-model")) == (1, 0)
        assert await text(stub, model="auto", prompt="long " * 12) == BASE_REPLY
        assert (tokenized("fake-model"), tokenized("base-model")) == (2, 1)
    assert len(chat_engine.log.starts) == 1 and len(base_engine.log.starts) == 1


async def test_a_chat_to_the_alias_in_mode_small_needs_only_the_small_models_template():
    """QA: a chat to ``auto`` was refused ("'base-model' has no chat template")
    although mode ``small`` never asks the large model; in mode ``auto`` it
    still is (it may escalate)."""
    from services.router.cascade.policy import CascadePolicy

    chat = generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="q")])
    async with two_models(cascade=CascadePolicy("fake-model", "base-model")) as (stub, _, _):
        responses = [r async for r in stub.Generate(generation_pb2.GenerateRequest(
            model="auto", chat=chat, cascade=generation_pb2.CASCADE_MODE_SMALL,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8)), timeout=10)]
        assert responses[-1].model == "fake-model"
        assert responses[-1].cascade.reason == "mode_small"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await text(stub, model="auto", chat=chat)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'base-model' has no chat template" in refused.value.details()


async def test_a_tenants_cascade_setting_is_its_requests_default_mode(tmp_path):
    """Issue 34: the prompt-only rule's "tenant setting": a key file entry's
    ``cascade`` is the mode of the tenant's requests to the alias that name
    none (field or header), on gRPC and the OpenAI edge alike."""
    import json

    import openai

    from services.router.api_keys import hash_key
    from services.router.cascade.policy import CascadePolicy

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"id": "big", "keys": [hash_key("lmk_big")], "cascade": "large"},
        {"id": "plain", "keys": [hash_key("lmk_plain")]}]}))
    started: list[RouterService] = []
    async with two_models(cascade=CascadePolicy("fake-model", "base-model"),
                          api_keys=str(keys), openai_port=0,
                          started=started) as (stub, chat_engine, base_engine):

        async def answer(key: str, **extra) -> tuple[str, str]:
            responses = [r async for r in stub.Generate(generation_pb2.GenerateRequest(
                model="auto", prompt="q", sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=64), **extra),
                metadata=(("authorization", f"Bearer {key}"),), timeout=10)]
            return responses[-1].model, responses[-1].cascade.reason

        assert await answer("lmk_big") == ("base-model", "mode_large")
        assert await answer("lmk_plain") == ("fake-model", "confident")
        # the request's own mode wins
        assert await answer("lmk_big", cascade=generation_pb2.CASCADE_MODE_SMALL) == (
            "fake-model", "mode_small")
        ports = await started[0].listen_extra("127.0.0.1")
        base = f"http://127.0.0.1:{ports['openai_port']}/v1"
        for key, model, path in (("lmk_big", "base-model", "large; reason=mode_large"),
                                 ("lmk_plain", "fake-model", "small; reason=confident")):
            async with openai.AsyncOpenAI(base_url=base, api_key=key,
                                          max_retries=0) as client:
                reply = await client.completions.with_raw_response.create(
                    model="auto", prompt="q", max_tokens=8, temperature=0)
            assert reply.headers["x-llmesh-cascade-path"] == path
            assert reply.parse().model == model
        async with openai.AsyncOpenAI(base_url=base, api_key="lmk_big",
                                      max_retries=0) as client:
            reply = await client.completions.with_raw_response.create(
                model="auto", prompt="q", max_tokens=8, temperature=0,
                extra_headers={"x-llmesh-cascade": "small"})
        assert reply.headers["x-llmesh-cascade-path"] == "small; reason=mode_small"
