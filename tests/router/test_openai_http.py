"""The router's OpenAI HTTP server with the official ``openai`` client, against
in-process fake tokenizer / engine / cache over real gRPC (no model): statuses
that need a crafted mesh state (429, 503, an engine refusing a field),
disconnect, streaming order.
The real mesh through Envoy is tests/e2e/test_mesh_openai.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import grpc
import openai
import pytest
import structlog.testing

from llmesh.v1 import common_pb2, engine_pb2, generation_pb2
from services.router.admission import AdmissionConfig
from tests.router.test_router_service import REPLY, collect, make_mesh, wait_for

USER = [{"role": "user", "content": "hi"}]


@contextlib.asynccontextmanager
async def served(**config):
    """The fake mesh with the router's HTTP server; yields (mesh, client, base url)."""
    async with make_mesh(openai_port=0, **config) as mesh:
        ports = await mesh.router.listen_extra("127.0.0.1")
        base = f"http://127.0.0.1:{ports['openai_port']}"
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            yield mesh, client, base
        finally:
            await client.close()


async def test_chat_and_completion_answers_have_openai_shape():
    async with served() as (_, client, _base):
        chat = await client.chat.completions.create(model="fake-model", messages=USER,
                                                    max_tokens=64)
        assert chat.choices[0].message.content == REPLY
        assert chat.choices[0].finish_reason == "stop" and chat.object == "chat.completion"
        assert chat.usage.completion_tokens == len(REPLY) + 1  # EOS counts
        text = await client.completions.create(model="fake-model", prompt="x", max_tokens=5)
        assert text.choices[0].text == REPLY[:5] and text.choices[0].finish_reason == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


async def test_stream_chunks_leave_as_tokens_are_generated():
    async with served() as (mesh, client, _):
        mesh.engines[0].step_delay = 0.02
        arrivals = []
        stream = await client.chat.completions.create(
            model="fake-model", messages=USER, stream=True,
            stream_options={"include_usage": True})
        pieces = []
        async for chunk in stream:
            arrivals.append(time.monotonic())
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            last = chunk
        assert "".join(pieces) == REPLY
        assert last.choices == [] and last.usage.completion_tokens == len(REPLY) + 1
        # ~32 steps 20 ms apart: the first chunk came long before the last.
        assert arrivals[-1] - arrivals[0] > 0.3


async def test_admission_refusal_is_429_with_retry_after():
    admission = AdmissionConfig(max_running_per_replica=1, max_queued_requests=0)
    async with served(admission=admission) as (mesh, client, base):
        mesh.engines[0].step_delay = 0.05
        running = asyncio.create_task(client.chat.completions.create(
            model="fake-model", messages=USER))
        await wait_for(lambda: mesh.engines[0].log.active == 1)
        async with aiohttp.ClientSession() as session:
            other = [{"role": "user", "content": "another"}]  # not coalesced with the first
            async with session.post(f"{base}/v1/chat/completions",
                                    json={"messages": other}) as reply:
                assert reply.status == 429
                assert int(reply.headers["Retry-After"]) >= 1
                error = (await reply.json())["error"]
        assert error["type"] == "rate_limit_error" and error["message"]
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="fake-model", messages=other)
        running.cancel()


async def test_a_draining_router_answers_503():
    async with served() as (mesh, client, _):
        await mesh.router.drain()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="fake-model", messages=USER)
        assert info.value.status_code == 503 and "draining" in info.value.message


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.UNIMPLEMENTED])  # an engine before issue 30
async def test_a_field_the_engine_cannot_honour_is_400_and_sent_once(code):
    """Issue 30, bug 5: a 501 made the official client (2 retries of every
    5xx by default) send the request three times. Now 400
    ``invalid_request_error`` naming the parameter, as vLLM answers, and the
    engine sees it once."""
    async with served() as (mesh, _, base):
        engine = mesh.engines[0]
        engine.fail_code = code
        engine.fail_message = "sampling.min_tokens: is not implemented by the demo engine backend"
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused") as client:
            assert client.max_retries == 2  # the client's default
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="fake-model", messages=USER,
                                                     extra_body={"min_tokens": 2})
        assert info.value.status_code == 400
        error = info.value.body
        assert (error["type"], error["param"]) == ("invalid_request_error", "min_tokens")
        assert error["message"].startswith("min_tokens: is not implemented")
        assert len(engine.log.deadlines) == 1  # one request reached the engine


async def test_an_engine_failure_names_the_replica_not_its_address():
    """QA, issue 33: the 503 said ``engine at 127.0.0.1:PORT is unavailable:
    ... Connection reset by peer``; now the replica's id, the model and what to do."""
    async with served() as (mesh, client, _):
        mesh.engines[0].fail_code = grpc.StatusCode.UNAVAILABLE
        mesh.engines[0].fail_message = "recvmsg: Connection reset by peer"
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="fake-model", messages=USER)
    assert info.value.status_code == 503
    assert info.value.body["message"] == (
        "no engine replica could take the request for model 'fake-model' (tried replica-0: "
        "UNAVAILABLE); retry in a few seconds")


async def test_min_tokens_beside_a_choice_is_400_naming_both_and_never_reaches_an_engine():
    """Issue 30, bug 4: ``choice`` + ``min_tokens`` was answered with one
    token. A choice cannot be lengthened, so the pair is refused at the edge,
    over OpenAI (400) and gRPC (INVALID_ARGUMENT) alike."""
    async with served() as (mesh, client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="fake-model", prompt="Yes or no?",
                                            extra_body={"guided_choice": ["yes", "no"],
                                                        "min_tokens": 10})
        error = info.value.body
        assert (error["type"], error["param"]) == ("invalid_request_error", "min_tokens")
        assert error["message"].startswith("min_tokens: cannot be honoured beside a choice "
                                           "constraint (guided_choice)")  # as the client named it
        assert "sampling." not in error["message"]
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="fake-model", prompt="Yes or no?",
                                            extra_body={"structured_outputs": {"choice": ["y"]},
                                                        "min_tokens": 10})
        assert "beside a choice constraint (structured_outputs.choice)" in \
            info.value.body["message"]
        request = generation_pb2.GenerateRequest(prompt="Yes or no?", sampling=(
            common_pb2.SamplingParams(min_tokens=10, structured_output=common_pb2.StructuredOutput(
                choice=common_pb2.ChoiceConstraint(choices=["yes", "no"])))))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(mesh.stub.Generate(request))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("sampling.min_tokens: cannot be honoured "
                                                  "beside a choice constraint "
                                                  "(sampling.structured_output.choice)")
        assert not mesh.engines[0].log.deadlines


async def test_disconnect_mid_stream_cancels_the_engine_sequence():
    async with served() as (mesh, _, base):
        engine = mesh.engines[0]
        engine.step_delay = 0.05
        async with aiohttp.ClientSession() as session:
            reply = await session.post(f"{base}/v1/completions",
                                       json={"prompt": "x", "stream": True})
            assert reply.status == 200
            assert (await reply.content.readline()).startswith(b"data: ")
            reply.close()  # the client goes away mid-stream
        await wait_for(lambda: engine.log.active == 0)
        assert engine.log.ended == ["cancel_msg"]


async def test_unknown_route_and_model_are_404_in_openai_shape():
    async with served() as (_, client, base):
        async with aiohttp.ClientSession() as session, \
                session.get(f"{base}/v1/nothing") as reply:
            assert reply.status == 404
            assert (await reply.json())["error"]["code"] == "unknown_url"
        async with aiohttp.ClientSession() as session, \
                session.get(f"{base}/v1/chat/completions") as reply:
            assert reply.status == 405
            assert (await reply.json())["error"]["code"] == "method_not_allowed"
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="gpt-4", messages=USER)
        assert "fake-model" in info.value.message and info.value.body["param"] == "model"


async def test_an_error_after_streaming_began_is_an_sse_error_event():
    async with served() as (mesh, _, base):
        mesh.engines[0].finish_with_error = True
        async with aiohttp.ClientSession() as session, \
                session.post(f"{base}/v1/completions",
                             json={"prompt": "x", "stream": True}) as reply:
            assert reply.status == 200
            body = (await reply.read()).decode()
        events = [line for line in body.split("\n\n") if line]
        assert '"error"' in events[-1] and "[DONE]" not in body


async def _raw(base: str, head: bytes) -> tuple[int, bytes]:
    """Sends ``head`` (request line and headers, CRLF-separated) as is; the
    status and body of the answer."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)  # the server closes after it
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(("head", "status", "code"), [
    # a header line over the 256 KiB limit: 431 (RFC 6585), not aiohttp's text 400
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\ntraceparent: 00-" + b"a" * 300_000, 431,
     "request_header_fields_too_large"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here", 400, "malformed_request"),
], ids=["header-300KB", "header-no-colon"])
async def test_an_unparsable_request_is_an_openai_error_and_one_warning(
        head: bytes, status: int, code: str, caplog: pytest.LogCaptureFixture) -> None:
    async with served() as (_, _client, base):
        with structlog.testing.capture_logs() as logs:
            got, body = await _raw(base, head)
    assert got == status, body
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    assert len(error["message"]) < 300
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == ["http_request_unparsable"]
    # aiohttp's own "Error handling request" line (error level, with a traceback) is gone
    assert [r for r in caplog.records if r.name.startswith("aiohttp")
            and r.levelno >= logging.WARNING] == []


async def test_a_60_kb_traceparent_header_is_served() -> None:
    """Envoy forwards up to 96 KiB of headers; the OpenAI endpoint takes them
    (an unusable traceparent is ignored, as on gRPC), aiohttp's 8 KiB did not."""
    async with served() as (_, _client, base):
        got, body = await _raw(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: "
                                     b"close\r\ntraceparent: 00-" + b"a" * 60_000)
    assert got == 200, body
    assert [m["id"] for m in json.loads(body)["data"]] == ["fake-model"]
async def post_json(base: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}{path}", json=body) as reply:
        return reply.status, await reply.json()


async def test_tokenize_and_detokenize_answer_in_vllms_shapes():
    # The fake tokenizer: one id per code point; its template "<role>content\n".
    async with served() as (_, _client, base):
        status, body = await post_json(base, "/tokenize", {"prompt": "Paris é"})
        assert status == 200
        assert body == {"count": 7, "max_model_len": 256, "tokens": [ord(c) for c in "Paris é"],
                        "token_strs": None}
        _, chat = await post_json(base, "/tokenize", {
            "model": "fake-model", "messages": USER, "return_token_strs": True})
        assert "".join(chat["token_strs"]) == "<user>hi\n<assistant>"
        assert chat["tokens"] == [ord(c) for c in "<user>hi\n<assistant>"]
        status, back = await post_json(base, "/detokenize", {"tokens": chat["tokens"]})
        assert status == 200 and back == {"prompt": "<user>hi\n<assistant>"}
        # vLLM's answers: no ids are no text; a prompt past the window is counted.
        assert await post_json(base, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
        status, long = await post_json(base, "/tokenize", {"prompt": "x" * 300})
        assert status == 200 and (long["count"], long["max_model_len"]) == (300, 256)


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/detokenize", {"tokens": [80, 0x110000]}, 400, "tokens", "not in the vocabulary"),
    ("/detokenize", {"tokens": [80, 2**40]}, 400, "tokens", "out of range"),
    ("/detokenize", {"tokens": ["P"]}, 400, "tokens", "integer token ids"),
    ("/detokenize", {"tokens": [80], "model": "gpt-4"}, 404, "model", "fake-model"),
    ("/detokenize", {"tokens": [], "model": "gpt-4"}, 404, "model", "fake-model"),
    ("/tokenize", {"prompt": "x" * 256 * 128 + "x"}, 400, "prompt", "context window"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "text"),
    ("/tokenize", {"messages": USER, "continue_final_message": True}, 400,
     "continue_final_message", "not supported"),
    ("/tokenize", {"messages": [{"role": "user"}], "echo": True}, 400, "echo",
     "unrecognized"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, 400,
     "messages[0].role", "nobody"),
])
async def test_tokenizer_endpoint_refusals_name_the_parameter(path, body, status, param, words):
    async with served() as (_, _client, base):
        got, reply = await post_json(base, path, body)
    assert got == status and reply["error"]["param"] == param
    assert words in reply["error"]["message"]


async def test_echo_with_n_gives_every_choice_the_prompt_logprobs_when_choice_0_ends_first():
    """QA, issue 33: the engine sends the prompt's logprobs on choice 0's first
    update; when choice 0 ended CANCELLED before any token, that update held
    no token and the router dropped it, so every choice's prompt entries read
    0.0."""
    def entry(token: int, logprob: float) -> common_pb2.PositionLogprobs:
        return common_pb2.PositionLogprobs(chosen=common_pb2.TokenLogprob(
            token_id=token, logprob=logprob, rank=1))

    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=0)
    async with served() as (mesh, client, _):
        mesh.engines[0].script = [
            engine_pb2.SequenceUpdate(  # choice 0 ends before its first token
                index=0, finish_reason=common_pb2.FINISH_REASON_CANCELLED, usage=usage,
                prompt_logprobs=[entry(58, -1.5), entry(59, -2.5)]),
            engine_pb2.SequenceUpdate(
                index=1, token_ids=[ord("A")], logprobs=[entry(ord("A"), -0.25)],
                finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage)]
        answer = await client.completions.create(
            model="fake-model", prompt=[81, 58, 59], max_tokens=1, n=2, echo=True,
            logprobs=1, temperature=1.0)
    by_index = {c.index: c for c in answer.choices}
    assert by_index[1].text == "Q:;A"
    assert by_index[1].logprobs.token_logprobs == [None, -1.5, -2.5, -0.25]
    assert by_index[0].logprobs.token_logprobs == [None, -1.5, -2.5]


async def test_echo_puts_the_prompt_before_the_completion_or_alone_with_max_tokens_0():
    async with served() as (mesh, client, _):
        both = await client.completions.create(model="fake-model", prompt="Q:", max_tokens=5,
                                               echo=True)
        assert both.choices[0].text == "Q:" + REPLY[:5]
        alone = await client.completions.create(model="fake-model", prompt=[81, 58],
                                                max_tokens=0, echo=True)
        assert alone.choices[0].text == "Q:" and alone.usage.prompt_tokens == 2
        # The dropped token is not billed (it was: completion_tokens 1).
        assert (alone.usage.completion_tokens, alone.usage.total_tokens) == (0, 2)
        # The engine got the ids as sent, and one token to compute for the prompt alone.
        start = mesh.engines[0].log.starts[-1]
        assert list(start.prompt_token_ids) == [81, 58] and start.sampling.max_tokens == 1
        # Streamed: the first chunk carries the prompt, the chunks join to the same text.
        for prompt, max_tokens in (("Q:", 5), ([81, 58], 0)):
            chunks = [c async for c in await client.completions.create(
                model="fake-model", prompt=prompt, max_tokens=max_tokens, echo=True,
                stream=True)]
            assert chunks[0].choices[0].text.startswith("Q:")
            assert "".join(c.choices[0].text for c in chunks) == \
                ("Q:" + REPLY[:5] if max_tokens else "Q:")
            assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize",
                                  "/v1/embeddings"])
async def test_a_body_over_the_limit_is_413_in_openai_shape(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp's own answer was a text 413 (or, caught as any error, a 500)."""
    monkeypatch.setattr("services.router.openai_http.MAX_BODY_BYTES", 64 * 1024)
    async with served() as (_, client, base):
        big = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 70_000}]}
        async with aiohttp.ClientSession() as session, \
                session.post(f"{base}{path}", json=big) as reply:
            assert reply.status == 413
            assert reply.content_type == "application/json"
            error = (await reply.json())["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", None, "request_too_large")
        assert "65536 bytes" in error["message"]
        # the server goes on serving
        chat = await client.chat.completions.create(model="fake-model", messages=USER)
        assert chat.choices[0].message.content == REPLY
