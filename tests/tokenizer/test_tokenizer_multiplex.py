"""TokenizerService.Multiplex (the router's path for prompts) over real gRPC on
loopback with the real tokenizers, and the router's TokenizerClient on it."""

from __future__ import annotations

import asyncio
import gc
import queue
import time

import grpc
import pytest
from llmesh.v1 import common_pb2, tokenizer_pb2

from services.common.wire.chat import ChatMessage
from services.router.clients import TokenizerClient, UpstreamError
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.tokenizer_helpers import HARD_TEXT, Client, ServerThread, sample, start_server

pytestmark = pytest.mark.model

Request = tokenizer_pb2.TokenizerServiceMultiplexRequest


def chat(call_id: int, *messages: tuple[str, str], budget: int = 0) -> Request:
    return Request(call_id=call_id, request_id=f"r{call_id}",
                   apply_chat_template=tokenizer_pb2.ApplyChatTemplateRequest(
                       messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                       add_generation_prompt=True, max_prompt_tokens=budget))


def tokenize(call_id: int, text: str) -> Request:
    return Request(call_id=call_id, request_id=f"r{call_id}",
                   tokenize=tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=True))


class OpenCall:
    """A Multiplex call whose messages the test sends one at a time."""

    def __init__(self, client: Client) -> None:
        self._outgoing: queue.Queue[Request | None] = queue.Queue()
        self.call = client.stub.Multiplex(iter(self._outgoing.get, None), timeout=60)

    def send(self, *messages: Request) -> None:
        for message in messages:
            self._outgoing.put(message)

    def answer(self) -> tokenizer_pb2.TokenizerServiceMultiplexResponse:
        return next(self.call)

    def close(self) -> None:
        self._outgoing.put(None)


def test_answers_equal_the_unary_calls_and_errors_end_only_their_request(
        smollm: Tokenizer, smollm_client: Client, gemma_client: Client) -> None:
    messages = [tokenize(1, HARD_TEXT),
                chat(2, ("system", "Be brief."), ("user", "Hi <|im_end|> there")),
                chat(3, ("user", "a"), ("wizard", "b")),
                Request(call_id=4),
                chat(5, ("user", "x " * 200), budget=20),
                tokenize(6, "still here")]
    answers = {a.call_id: a for a in smollm_client.stub.Multiplex(iter(messages), timeout=30)}
    assert sorted(answers) == [1, 2, 3, 4, 5, 6]  # the call stayed open past the errors
    assert list(answers[1].tokenize.token_ids) == smollm_client.tokenize(HARD_TEXT, True)
    unary = smollm_client.chat([("system", "Be brief."), ("user", "Hi <|im_end|> there")])
    assert answers[2].apply_chat_template == unary and answers[2].status_code == 0
    assert answers[3].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "messages[1].role" in answers[3].status_message
    assert answers[4].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "tokenize" in answers[4].status_message
    assert answers[5].status_code == grpc.StatusCode.OUT_OF_RANGE.value[0]
    assert "max_prompt_tokens=20" in answers[5].status_message
    assert list(answers[6].tokenize.token_ids) == smollm.encode("still here", True)
    no_template, = gemma_client.stub.Multiplex(iter([chat(7, ("user", "hi"))]), timeout=30)
    assert no_template.status_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]


def test_a_long_input_holds_up_no_later_request(
        smollm: Tokenizer, smollm_client: Client) -> None:
    big = HARD_TEXT * 4000  # ~250k characters: hundreds of ms on a worker thread
    call = OpenCall(smollm_client)
    try:
        call.send(tokenize(1, big), tokenize(2, "short"))
        first, second = call.answer(), call.answer()
        assert (first.call_id, second.call_id) == (2, 1)
        assert list(first.tokenize.token_ids) == smollm.encode("short", True)
        assert list(second.tokenize.token_ids) == smollm.encode(big, True)
        # Reusing an id while its request is open ends the call.
        call.send(tokenize(3, big), tokenize(3, "again"))
        with pytest.raises(grpc.RpcError) as err:
            call.answer()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "call_id 3 is still open" in err.value.details()
    finally:
        call.close()


def test_counts_each_request_under_its_operation_and_refuses_while_draining(
        smollm: Tokenizer) -> None:
    server, metrics = start_server(smollm)
    client = Client(server.target)
    call = OpenCall(client)
    try:
        call.send(chat(1, ("user", "Hello")), tokenize(2, "Hello"))
        assert [call.answer().status_code for _ in range(2)] == [0, 0]
        assert sample(metrics, "llmesh:tokenizer_requests_total",
                      method="ApplyChatTemplate", code="OK") == 1
        assert sample(metrics, "llmesh:tokenizer_requests_total",
                      method="Tokenize", code="OK") == 1
        server.call(server.service.drain())
        call.send(tokenize(3, "Hello"))
        refused = call.answer()
        assert refused.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "draining" in refused.status_message
        assert sample(metrics, "llmesh:tokenizer_requests_total",
                      method="Tokenize", code="UNAVAILABLE") == 1
    finally:
        call.close()
        client.close()
        server.stop()


def test_the_routers_client_shares_one_call_and_maps_statuses(
        smollm: Tokenizer, smollm_server: tuple[ServerThread, TokenizerMetrics],
        smollm_client: Client) -> None:
    server = smollm_server[0]
    questions = [f"Question {i}: why is the sky blue?" for i in range(24)]

    async def scenario() -> tuple[list, UpstreamError, UpstreamError, tuple[int, ...]]:
        client = TokenizerClient(server.target)
        try:
            prompts = await asyncio.gather(*(client.apply_chat_template(
                [ChatMessage("user", q)], add_generation_prompt=True, max_prompt_tokens=0,
                request_id=f"q{i}", deadline=None) for i, q in enumerate(questions)))
            with pytest.raises(UpstreamError) as refused:
                await client.apply_chat_template(
                    [ChatMessage("wizard", "hi")], add_generation_prompt=True,
                    max_prompt_tokens=0, request_id="bad", deadline=None)
            with pytest.raises(UpstreamError) as late:
                await client.tokenize(HARD_TEXT * 4000, add_special_tokens=True,
                                      request_id="late", deadline=time.monotonic() + 0.01)
            still = await client.tokenize("still", add_special_tokens=True,
                                          request_id="still", deadline=time.monotonic() + 30)
            return prompts, refused.value, late.value, still
        finally:
            await client.close()

    prompts, refused, late, still = asyncio.run(scenario())
    for question, prompt in zip(questions, prompts):
        assert list(prompt.token_ids) == list(smollm_client.chat([("user", question)]).token_ids)
    assert (refused.service, refused.code) == ("tokenizer", grpc.StatusCode.INVALID_ARGUMENT)
    assert "role" in refused.details
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert still == tuple(smollm.encode("still", True))


def test_the_routers_client_fails_fast_when_the_tokenizer_dies_and_reconnects(
        smollm: Tokenizer) -> None:
    server, _ = start_server(smollm)
    target = server.target
    port = server.port

    unhandled: list[dict] = []

    async def scenario() -> tuple[UpstreamError, float, tuple[int, ...]]:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        client = TokenizerClient(target)
        try:
            await client.tokenize("warm", add_special_tokens=False, request_id="w",
                                  deadline=None)
            await asyncio.to_thread(server.stop)
            began = time.monotonic()
            with pytest.raises(UpstreamError) as gone:
                await client.tokenize("gone", add_special_tokens=False, request_id="g",
                                      deadline=time.monotonic() + 10)
            took = time.monotonic() - began
            again = await asyncio.to_thread(_restart_on, smollm, port)
            try:
                for _ in range(100):  # the channel reconnects (backoff capped at 1 s)
                    try:
                        ids = await client.tokenize("back", add_special_tokens=False,
                                                    request_id="b",
                                                    deadline=time.monotonic() + 5)
                        break
                    except UpstreamError as err:
                        assert err.code == grpc.StatusCode.UNAVAILABLE, err
                        await asyncio.sleep(0.05)
                return gone.value, took, ids
            finally:
                await asyncio.to_thread(again.stop)
        finally:
            await client.close()
            gc.collect()  # an exception no one retrieved is reported when its future goes

    gone, took, ids = asyncio.run(scenario())
    assert not unhandled, unhandled
    assert gone.code == grpc.StatusCode.UNAVAILABLE and gone.service == "tokenizer"
    assert "\n" not in gone.details and "debug_error_string" not in gone.details, gone.details
    assert took < 1.0
    assert ids == tuple(smollm.encode("back"))


def _restart_on(tokenizer: Tokenizer, port: int) -> ServerThread:
    """A new TokenizerService on ``port`` (the old one stopped)."""
    return start_server(tokenizer, port=port)[0]
