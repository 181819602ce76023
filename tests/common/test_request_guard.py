"""Requests whose bytes do not parse: INVALID_ARGUMENT naming the message and
field, counted, logged once per interval, in every service and RPC kind.

Real gRPC servers on loopback get hand-built protobuf bytes through a generic
channel (``request_serializer`` = identity): the router in process (on the
server kit's :func:`make_server`, over fake tokenizer, engine and cache), and
the cache service as its own process (``python -m services.cache``: the kit's
``run_service``, its real JSON log).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client import CollectorRegistry

from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    engine_pb2_grpc,
    generation_pb2,
    tokenizer_pb2_grpc,
)
from services.common.request_guard import LogThrottle, UnparsableRequest, diagnose
from services.common.active_calls import ActiveCalls
from services.common.server import make_server
from services.router.metrics import RouterMetrics
from services.router.service import RouterConfig, RouterService
from tests.router.router_fakes import FakeCache, FakeEngine, FakeTokenizer, serve

ROOT = Path(__file__).resolve().parents[2]
GENERATE = "/llmesh.v1.GenerationService/Generate"
GENERATE_STREAM = "/llmesh.v1.GenerationService/GenerateStream"
UTF8_RULE = ("holds invalid UTF-8 (protobuf string fields must be UTF-8 text; send arbitrary "
             "bytes in a bytes field)")


def _identity(data: bytes) -> bytes:
    return data


def with_bad_utf8(message, placeholder: str = "@@") -> bytes:
    """``message``'s bytes with the (single) ``placeholder`` string replaced by
    the same number of bytes that are not UTF-8 (0xff 0xfe ...)."""
    raw = message.SerializeToString()
    marker = placeholder.encode()
    assert raw.count(marker) == 1
    return raw.replace(marker, bytes([0xFF, 0xFE] * len(marker))[:len(marker)])


def bad_prompt() -> bytes:
    raw = with_bad_utf8(generation_pb2.GenerateRequest(prompt="@"), "@")
    assert raw == b"\x1a\x01\xff"  # field 3 (prompt), length 1, byte 0xff
    return raw


def bad_chat() -> bytes:
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="system", content="Be brief.")
    request.chat.messages.add(role="user", content="hi @@")
    return with_bad_utf8(request)


def refusal(message_type: str, field: str) -> str:
    return f"{message_type}: the request could not be parsed: field `{field}` {UTF8_RULE}"


# --------------------------------------------------------------------------- #
# The diagnosis and the throttle, without a server.


def test_the_diagnosis_names_the_string_field_with_its_path() -> None:
    descriptor = generation_pb2.GenerateRequest.DESCRIPTOR
    assert diagnose(bad_prompt(), descriptor) == UnparsableRequest(
        "llmesh.v1.GenerateRequest", "prompt")
    assert diagnose(bad_chat(), descriptor).field == "chat.messages[1].content"
    stop = with_bad_utf8(generation_pb2.GenerateRequest(
        prompt="ok", sampling=common_pb2.SamplingParams(stop=["a", "@@", "b"])))
    assert diagnose(stop, descriptor).field == "sampling.stop[1]"


def test_corrupt_wire_format_gets_a_message_without_a_field() -> None:
    truncated = generation_pb2.GenerateRequest(prompt="hello").SerializeToString()[:-2]
    with pytest.raises(Exception, match="parsing"):
        generation_pb2.GenerateRequest.FromString(truncated)
    found = diagnose(truncated, generation_pb2.GenerateRequest.DESCRIPTOR)
    assert found.field is None
    assert found.message == (
        "llmesh.v1.GenerateRequest: the request could not be parsed: the bytes are not a "
        "valid protobuf encoding of this message (truncated or corrupt wire format, or a "
        "string field holds invalid UTF-8)")


def test_the_throttle_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    now = [100.0]
    throttle = LogThrottle(10.0, clock=lambda: now[0])
    assert throttle.admit() == 0
    assert [throttle.admit() for _ in range(4)] == [None] * 4
    now[0] = 109.9
    assert throttle.admit() is None
    now[0] = 110.0
    assert throttle.admit() == 5  # the five held back since the last line
    assert throttle.admit() is None


# --------------------------------------------------------------------------- #
# The router, in process, on the kit's server.


@contextlib.asynccontextmanager
async def router_on_the_kit(calls: ActiveCalls | None = None,
                            ) -> AsyncIterator[tuple[grpc.aio.Channel, FakeEngine,
                                                     CollectorRegistry]]:
    """A router on :func:`make_server` over fakes (its calls counted in
    ``calls``); yields (channel, engine, registry)."""
    servers = []
    tok_server, tok_target = await serve(
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, FakeTokenizer())
    engine = FakeEngine("a long reply that keeps the engine busy for a while " * 4,
                        max_model_len=1024)
    engine.step_delay = 0.02
    engine_server, engine_target = await serve(
        engine_pb2_grpc.add_EngineServiceServicer_to_server, engine)
    cache_server, cache_target = await serve(
        cache_pb2_grpc.add_CacheServiceServicer_to_server, FakeCache())
    servers += [tok_server, engine_server, cache_server]
    registry = CollectorRegistry()
    router = RouterService(RouterConfig(tokenizer=tok_target, engines=(engine_target,),
                                        cache=cache_target, startup_timeout=10),
                           metrics=RouterMetrics(registry))
    await router.start()
    server = make_server(router, calls)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, engine, registry
    finally:
        await channel.close()
        await server.stop(None)
        await router.close()
        for each in servers:
            await each.stop(None)


def invalid_argument_count(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("llmesh:requests_total", {
        "model_name": "fake-model", "outcome": "invalid_argument",
        "priority": "interactive"}) or 0.0


async def generate_raw(channel: grpc.aio.Channel, raw: bytes) -> grpc.aio.AioRpcError:
    call = channel.unary_stream(GENERATE, request_serializer=_identity,
                                response_deserializer=generation_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in call(raw, timeout=10):
            pass
    return refused.value


def unparsable_lines(logs: list[dict]) -> list[dict]:
    return [line for line in logs if line["event"] == "request_unparsable"]


async def test_generate_with_invalid_utf8_is_invalid_argument_counted_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with router_on_the_kit() as (channel, _engine, registry):
        with structlog.testing.capture_logs() as logs:
            errors = [await generate_raw(channel, bad_prompt()) for _ in range(5)]
            errors.append(await generate_raw(channel, bad_chat()))
        assert {e.code() for e in errors} == {grpc.StatusCode.INVALID_ARGUMENT}
        assert errors[0].details() == refusal("llmesh.v1.GenerateRequest", "prompt")
        assert errors[-1].details() == refusal("llmesh.v1.GenerateRequest",
                                               "chat.messages[1].content")
        assert invalid_argument_count(registry) == 6
        # One warning for six bad requests, no traceback (grpc logs none either).
        lines = unparsable_lines(logs)
        assert len(lines) == 1, logs
        assert lines[0]["log_level"] == "warning"
        assert (lines[0]["method"], lines[0]["message_type"], lines[0]["field"]) == (
            GENERATE, "llmesh.v1.GenerateRequest", "prompt")
        assert not [r for r in caplog.records if r.name.startswith("grpc")], caplog.text
        assert not [line for line in logs if line["log_level"] in ("error", "critical")]

        # The same server still serves a good request.
        good = generation_pb2.GenerateRequest(
            prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=3))
        call = channel.unary_stream(
            GENERATE, request_serializer=_identity,
            response_deserializer=generation_pb2.GenerateResponse.FromString)
        responses = [r async for r in call(good.SerializeToString(), timeout=10)]
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert invalid_argument_count(registry) == 6


def stream_start(max_tokens: int) -> bytes:
    return generation_pb2.GenerateStreamRequest(start=generation_pb2.GenerateRequest(
        prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    ).SerializeToString()


def _stream_call(channel: grpc.aio.Channel):
    return channel.stream_stream(
        GENERATE_STREAM, request_serializer=_identity,
        response_deserializer=generation_pb2.GenerateStreamResponse.FromString)(timeout=10)


async def test_generate_stream_refuses_each_unparsable_message_and_frees_the_engine() -> None:
    bad_start = with_bad_utf8(generation_pb2.GenerateStreamRequest(
        start=generation_pb2.GenerateRequest(prompt="@@")))
    async with router_on_the_kit() as (channel, engine, registry):
        with structlog.testing.capture_logs() as logs:
            # The first message does not parse.
            call = _stream_call(channel)
            await call.write(bad_start)
            with pytest.raises(grpc.aio.AioRpcError) as first:
                await call.read()
            assert first.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert first.value.details() == refusal("llmesh.v1.GenerateStreamRequest",
                                                     "start.prompt")

            # A generation runs; the next message does not parse: the stream ends
            # INVALID_ARGUMENT and the router drops the engine's stream.
            call = _stream_call(channel)
            await call.write(stream_start(max_tokens=200))
            first_delta = await call.read()
            assert first_delta.response.token_ids  # the generation runs
            await call.write(bad_start)
            with pytest.raises(grpc.aio.AioRpcError) as later:
                while True:
                    message = await call.read()
                    assert message is not grpc.aio.EOF, "the stream ended OK"
            assert later.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert later.value.details() == first.value.details()
            end = time.monotonic() + 5
            while engine.log.active and time.monotonic() < end:
                await asyncio.sleep(0.01)
            assert engine.log.active == 0
        assert invalid_argument_count(registry) == 2
        assert len(unparsable_lines(logs)) == 1
        assert not [line for line in logs if line["log_level"] in ("error", "critical")]

        # A good stream on the same server still works.
        call = _stream_call(channel)
        await call.write(stream_start(max_tokens=2))
        await call.done_writing()
        replies = [m async for m in call]
        assert replies[-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert await call.code() == grpc.StatusCode.OK


# --------------------------------------------------------------------------- #
# Another service as its own process: the kit's run_service and its JSON log.


@pytest.fixture
def cache_process(tmp_path: Path):
    """``python -m services.cache`` (embedded store); yields (port, stderr log path)."""
    port_file, log_path = tmp_path / "ports.json", tmp_path / "cache.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services" / "gen")]))
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cache", "--port", "0", "--metrics-port", "-1",
             "--port-file", str(port_file)],
            cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield json.loads(port_file.read_text())["grpc_port"], log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def test_the_cache_health_and_reflection_refuse_bad_bytes_in_one_log_line(
        cache_process: tuple[int, Path]) -> None:
    port, log_path = cache_process
    bad_key = with_bad_utf8(cache_pb2.GetCachedResponseRequest(
        key=cache_pb2.CacheKey(model="@@", prompt_token_ids=[1, 2])))
    good = cache_pb2.GetCachedResponseRequest(
        key=cache_pb2.CacheKey(model="m", prompt_token_ids=[1, 2]))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        get = channel.unary_unary(
            "/llmesh.v1.CacheService/GetCachedResponse", request_serializer=_identity,
            response_deserializer=cache_pb2.GetCachedResponseResponse.FromString)
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as refused:
                get(bad_key, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == refusal("llmesh.v1.GetCachedResponseRequest",
                                                      "key.model")
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=_identity,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        with pytest.raises(grpc.RpcError) as health:
            check(with_bad_utf8(health_pb2.HealthCheckRequest(service="@@")), timeout=10)
        assert health.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert health.value.details() == refusal("grpc.health.v1.HealthCheckRequest", "service")
        # A bidi stream served by an async generator (server reflection).
        reflect = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=_identity,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        bad_reflection = with_bad_utf8(reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="@@"))
        with pytest.raises(grpc.RpcError) as listed:
            list(reflect(iter([bad_reflection]), timeout=10))
        assert listed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "`file_containing_symbol`" in listed.value.details()
        # The service still answers good requests.
        assert get(good.SerializeToString(), timeout=10).found is False
    text = log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    unparsable = [line for line in lines if line["event"] == "request_unparsable"]
    assert len(unparsable) == 1, text
    assert unparsable[0]["level"] == "warning" and unparsable[0]["field"] == "key.model"
    assert "Traceback" not in text and "Unexpected" not in text, text
    assert not [line for line in lines if line["level"] in ("error", "critical")], text
