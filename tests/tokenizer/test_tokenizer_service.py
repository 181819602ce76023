"""TokenizerService over real gRPC on loopback, with the real tokenizers."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Mapping

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmesh.v1 import tokenizer_pb2
from llmesh.v1.tokenizer_pb2_grpc import TokenizerServiceStub

from services.common.detokenizer import IncrementalDetokenizer, TokenizersDecoder
from services.router.clients import TokenizerClient
from services.tokenizer.service import DEFINITION_CHUNK_BYTES
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.tokenizer_helpers import (
    HARD_FRAGMENTS,
    HARD_TEXT,
    Client,
    ServerThread,
    sample,
    split,
    start_server,
)

pytestmark = pytest.mark.model

TOKENIZERS = ["smollm", "gemma"]
HARD_TEXTS = st.lists(st.sampled_from(HARD_FRAGMENTS), min_size=1, max_size=16).map("".join)


def _client(name: str, request: pytest.FixtureRequest) -> tuple[Tokenizer, Client]:
    return request.getfixturevalue(name), request.getfixturevalue(f"{name}_client")


def _hf_chat_ids(tok: Tokenizer, messages: list[tuple[str, str]], gen: bool) -> list[int]:
    out = tok.hf_tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], add_generation_prompt=gen,
        tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


# -- Tokenize -> Detokenize round trip ------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=HARD_TEXTS, data=st.data())
def test_round_trip_any_chunking(name: str, text: str, data: st.DataObject,
                                 request: pytest.FixtureRequest) -> None:
    tok, client = _client(name, request)
    ids = client.tokenize(text, add_special_tokens=True)
    assert ids == tok.hf_tokenizer.encode(text, add_special_tokens=True)
    if data.draw(st.booleans(), label="one id per message"):
        chunks = [[i] for i in ids]
    else:
        cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)))
        chunks = split(ids, cuts)
    deltas = client.detokenize(chunks, skip_special_tokens=True)
    assert len(deltas) == len(chunks)  # one response per request message
    assert "".join(deltas) == tok.hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_hard_text_one_id_per_message(name: str, request: pytest.FixtureRequest) -> None:
    tok, client = _client(name, request)
    ids = client.tokenize(HARD_TEXT)
    deltas = client.detokenize([[i] for i in ids])
    assert "".join(deltas) == HARD_TEXT == tok.hf_tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 0  # partial characters were held back


def test_skip_special_tokens_is_read_from_the_first_message(smollm_client: Client) -> None:
    ids = smollm_client.tokenize("Hi")
    requests = [tokenizer_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=True),
                tokenizer_pb2.DetokenizeRequest(token_ids=[2], skip_special_tokens=False),
                tokenizer_pb2.DetokenizeRequest(flush=True)]
    assert [r.text for r in smollm_client.stub.Detokenize(iter(requests))] == ["Hi", "", ""]
    requests[0].skip_special_tokens = False
    assert [r.text for r in smollm_client.stub.Detokenize(iter(requests))] == [
        "Hi", "<|im_end|>", ""]


def test_token_text_ends_are_sent_only_when_the_first_message_asks(
        smollm_client: Client) -> None:
    ids = smollm_client.tokenize("Hi 😀 there")
    def run(ask: bool):
        requests = [tokenizer_pb2.DetokenizeRequest(token_ids=ids[:3], token_text_ends=ask),
                    tokenizer_pb2.DetokenizeRequest(token_ids=ids[3:], flush=True)]
        return [(r.text, list(r.token_text_ends))
                for r in smollm_client.stub.Detokenize(iter(requests))]
    asked = run(True)
    assert [text for text, _ in asked] == [text for text, _ in run(False)]
    assert all(not ends for _, ends in run(False))
    assert "".join(text for text, _ in asked) == "Hi 😀 there"
    for text, ends in asked:
        assert ends == sorted(ends) and ends[-1] == len(text)
    assert [len(ends) for _, ends in asked] == [3, len(ids) - 3]


def test_flush_emits_held_text_and_starts_a_new_sequence(smollm_client: Client) -> None:
    emoji = smollm_client.tokenize("😀")  # three ids, one character
    requests = [
        tokenizer_pb2.DetokenizeRequest(token_ids=emoji[:2]),
        tokenizer_pb2.DetokenizeRequest(flush=True),  # incomplete bytes come out as U+FFFD
        tokenizer_pb2.DetokenizeRequest(token_ids=smollm_client.tokenize("new")),
        tokenizer_pb2.DetokenizeRequest(token_ids=emoji[:2]),
        tokenizer_pb2.DetokenizeRequest(token_ids=emoji[2:], flush=True),
        tokenizer_pb2.DetokenizeRequest(),  # no ids: empty text
    ]
    assert [r.text for r in smollm_client.stub.Detokenize(iter(requests))] == [
        "", "\ufffd", "new", "", "😀", ""]


# -- ApplyChatTemplate -----------------------------------------------------------


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(smollm: Tokenizer, smollm_client: Client,
                                            gen: bool) -> None:
    messages = [("system", "Be brief."), ("user", "hi 👋"), ("assistant", "hello"),
                ("user", "日本語? e\u0301")]
    reply = smollm_client.chat(messages, add_generation_prompt=gen)
    assert list(reply.token_ids) == _hf_chat_ids(smollm, messages, gen)
    assert reply.num_dropped_messages == 0
    no_system = messages[1:]  # the template adds its default system prompt
    assert list(smollm_client.chat(no_system, gen).token_ids) == _hf_chat_ids(
        smollm, no_system, gen)


def test_chat_trimming_over_grpc(smollm: Tokenizer, smollm_client: Client) -> None:
    messages = [("system", "S.")] + [
        (role, f"turn {i} " + "blah " * 20) for i, role in
        enumerate(["user", "assistant"] * 4)] + [("user", "final?")]
    kept = [messages[0], *messages[5:]]  # four oldest turns dropped
    budget = len(_hf_chat_ids(smollm, kept, True))
    reply = smollm_client.chat(messages, True, budget)
    assert reply.num_dropped_messages == 4
    assert list(reply.token_ids) == _hf_chat_ids(smollm, kept, True)


def test_long_conversation_is_trimmed_on_a_worker_thread(smollm: Tokenizer,
                                                          smollm_client: Client) -> None:
    # Over inline_encode_max_chars of content: rendered and encoded off the event loop.
    messages = [("user", "long " * 3000), ("assistant", "ok"), ("user", "x")]
    reply = smollm_client.chat(messages, True, 100)
    assert reply.num_dropped_messages == 1
    assert list(reply.token_ids) == _hf_chat_ids(smollm, messages[1:], True)
    assert len(smollm_client.chat(messages).token_ids) > 3000


# -- GetTokenizerInfo --------------------------------------------------------------


def test_tokenizer_info(smollm_client: Client, gemma_client: Client) -> None:
    info = smollm_client.stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    assert (info.model, info.vocab_size, list(info.eos_token_ids), info.bos_token_id,
            info.has_chat_template) == ("SmolLM2-135M-Instruct", 49152, [2], 1, True)
    assert info.HasField("bos_token_id")
    info = gemma_client.stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    assert (info.model, info.vocab_size, list(info.eos_token_ids), info.bos_token_id,
            info.has_chat_template) == ("gemma-3-270m-q4_k_m", 262144, [1], 2, False)


# -- errors ------------------------------------------------------------------------


def _status(call: Callable[..., object], *args: object) -> tuple[grpc.StatusCode, str]:
    """Code and details of the RpcError that ``call(*args)`` raises."""
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("bad_ids", [[-1], [5, 49152], [2**31 - 1]])
def test_detokenize_rejects_out_of_range_ids(smollm_client: Client, bad_ids: list[int]) -> None:
    code, details = _status(smollm_client.detokenize, [[1], bad_ids])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in details and str([i for i in bad_ids if not 0 <= i < 49152][0]) in details


def test_chat_errors(smollm_client: Client, gemma_client: Client) -> None:
    code, details = _status(smollm_client.chat, [])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages" in details
    code, details = _status(smollm_client.chat, [("user", "a"), ("", "b")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[1].role" in details
    code, details = _status(gemma_client.chat, [("user", "hi")])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in details
    code, details = _status(smollm_client.chat, [("user", "x " * 200)], True, 20)
    assert code == grpc.StatusCode.OUT_OF_RANGE and "max_prompt_tokens=20" in details


def test_service_keeps_serving_after_errors(
        smollm_client: Client, smollm_server: tuple[ServerThread, TokenizerMetrics]) -> None:
    metrics = smollm_server[1]
    before = sample(metrics, "llmesh:tokenizer_requests_total",
                    method="Detokenize", code="INVALID_ARGUMENT")
    for _ in range(3):
        _status(smollm_client.detokenize, [[-5]])
        _status(smollm_client.chat, [])
    assert sample(metrics, "llmesh:tokenizer_requests_total", method="Detokenize",
                  code="INVALID_ARGUMENT") == before + 3
    ids = smollm_client.tokenize("still here")
    assert len(ids) == 2
    assert "".join(smollm_client.detokenize([ids[:1], ids[1:]])) == "still here"
    assert sample(metrics, "llmesh:tokenizer_detokenize_streams") == 0


def test_cancelled_stream_is_cleaned_up(
        smollm: Tokenizer, smollm_client: Client,
        smollm_server: tuple[ServerThread, TokenizerMetrics]) -> None:
    metrics = smollm_server[1]
    still = smollm.encode("still")
    gate = threading.Event()

    def requests():  # type: ignore[no-untyped-def]
        yield tokenizer_pb2.DetokenizeRequest(token_ids=still)
        gate.wait(10)

    call = smollm_client.stub.Detokenize(requests())
    assert next(call).text == "still"
    assert sample(metrics, "llmesh:tokenizer_detokenize_streams") == 1
    call.cancel()
    gate.set()
    deadline = time.monotonic() + 5
    while sample(metrics, "llmesh:tokenizer_detokenize_streams") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sample(metrics, "llmesh:tokenizer_detokenize_streams") == 0
    assert smollm_client.tokenize("still") == still


def test_unavailable_before_start_and_while_draining(smollm: Tokenizer) -> None:
    still, here = smollm.encode("still here")
    server, _ = start_server(smollm, start_service=False)
    client = Client(server.target)
    try:
        code, details = _status(client.tokenize, "x")
        assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
        server.call(server.service.start())
        assert client.tokenize("still") == [still]
        # An open stream survives the drain; new calls are refused.
        gate = threading.Event()

        def requests():  # type: ignore[no-untyped-def]
            yield tokenizer_pb2.DetokenizeRequest(token_ids=[still])
            gate.wait(10)
            yield tokenizer_pb2.DetokenizeRequest(token_ids=[here], flush=True)

        call = client.stub.Detokenize(requests())
        assert next(call).text == "still"
        server.call(server.service.drain())
        code, details = _status(client.tokenize, "x")
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
        code, _ = _status(client.detokenize, [[1]])
        assert code == grpc.StatusCode.UNAVAILABLE
        gate.set()
        assert [r.text for r in call] == [" here"]
    finally:
        client.close()
        server.stop()


# -- long inputs and metrics ------------------------------------------------------


def test_long_text_is_encoded_off_the_event_loop(
        smollm: Tokenizer, smollm_client: Client,
        smollm_server: tuple[ServerThread, TokenizerMetrics]) -> None:
    big = HARD_TEXT * 4000  # ~250k characters: hundreds of ms of encoding
    metrics = smollm_server[1]
    tokens_before = sample(metrics, "llmesh:tokenizer_tokens_total", method="Tokenize")
    future = smollm_client.stub.Tokenize.future(tokenizer_pb2.TokenizeRequest(text=big))
    small_latencies = []
    still = smollm.encode("still")
    while not future.done():
        started = time.perf_counter()
        assert smollm_client.tokenize("still") == still
        small_latencies.append(time.perf_counter() - started)
    ids = list(future.result().token_ids)
    assert ids == smollm.encode(big)
    assert len(small_latencies) >= 3  # small calls were answered during the long encode
    assert sorted(small_latencies)[len(small_latencies) // 2] < 0.1
    assert sample(metrics, "llmesh:tokenizer_tokens_total", method="Tokenize") == (
        tokens_before + len(ids) + len(small_latencies))


def test_metrics_count_calls_and_tokens(
        smollm_client: Client, smollm_server: tuple[ServerThread, TokenizerMetrics]) -> None:
    metrics = smollm_server[1]
    count = sample(metrics, "llmesh:tokenizer_request_duration_seconds_count", method="Tokenize")
    ok = sample(metrics, "llmesh:tokenizer_requests_total", method="Tokenize", code="OK")
    detok = sample(metrics, "llmesh:tokenizer_tokens_total", method="Detokenize")
    ids = smollm_client.tokenize("one two three")
    smollm_client.detokenize([ids[:1], ids[1:]])
    assert sample(metrics, "llmesh:tokenizer_request_duration_seconds_count",
                  method="Tokenize") == count + 1
    assert sample(metrics, "llmesh:tokenizer_requests_total", method="Tokenize",
                  code="OK") == ok + 1
    assert sample(metrics, "llmesh:tokenizer_tokens_total", method="Detokenize") == detok + 3
    assert sample(metrics, "llmesh:tokenizer_request_duration_seconds_bucket",
                  method="Detokenize", le="0.001") > 0  # sub-millisecond resolution


def _router_decoder(server: ServerThread) -> TokenizersDecoder:
    """What the router loads at start: the service's definition over GetTokenizer."""
    async def fetch() -> TokenizersDecoder:
        client = TokenizerClient(server.target)
        try:
            return await client.decoder()
        finally:
            await client.close()

    return asyncio.run(fetch())


@pytest.fixture(scope="module")
def router_decoders(smollm_server, gemma_server) -> dict[str, TokenizersDecoder]:
    return {"smollm": _router_decoder(smollm_server[0]),
            "gemma": _router_decoder(gemma_server[0])}


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=HARD_TEXTS, data=st.data())
def test_the_routers_in_process_detokenizer_equals_the_service(
        name: str, text: str, data: st.DataObject, router_decoders,
        request: pytest.FixtureRequest) -> None:
    """The router decodes with the definition GetTokenizer hands out: for
    SmolLM2's byte-level BPE and Gemma's SentencePiece with byte fallback, any
    chunking gives the service's Detokenize deltas' text, equal to a one-shot
    decode, never a partial character."""
    tok, client = _client(name, request)
    decoder = router_decoders[name]
    assert decoder.vocab_size == tok.info.vocab_size
    ids = tok.encode(text, add_special_tokens=True)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6), label="cuts")
    chunks = split(ids, cuts)
    for skip in (False, True):
        local = IncrementalDetokenizer(decoder, skip_special_tokens=skip)
        deltas = [local.add(chunk) for chunk in chunks] + [local.flush()]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert "".join(client.detokenize(chunks, skip_special_tokens=skip)) == "".join(deltas)
        assert not any("\ufffd" in d for d in deltas if "\ufffd" not in text)


def test_get_tokenizer_sends_the_definition_in_chunks_with_its_digest(
        gemma: Tokenizer, gemma_server: tuple[ServerThread, TokenizerMetrics]) -> None:
    channel = grpc.insecure_channel(gemma_server[0].target)
    try:
        replies = list(TokenizerServiceStub(channel).GetTokenizer(
            tokenizer_pb2.GetTokenizerRequest(), timeout=60))
    finally:
        channel.close()
    data = b"".join(r.definition_chunk for r in replies)
    head = replies[0]
    assert head.format == "huggingface-tokenizers-json"
    assert head.vocab_size == gemma.info.vocab_size == 262144
    assert head.total_bytes == len(data) and head.sha256 == hashlib.sha256(data).hexdigest()
    assert data.decode() == gemma.definition()
    assert len(replies) == -(-len(data) // DEFINITION_CHUNK_BYTES) > 4
    assert all(len(r.definition_chunk) <= DEFINITION_CHUNK_BYTES for r in replies)
    assert not any(r.sha256 or r.total_bytes for r in replies[1:])


def test_the_router_refuses_an_id_outside_the_vocabulary(router_decoders) -> None:
    """``tokenizers`` drops an unknown id silently; the decoder says so."""
    decoder = router_decoders["smollm"]
    for bad in ([49152], [-1], [5, 10**6]):
        with pytest.raises(ValueError, match="out of range"):
            decoder.check_token_ids(bad)
    decoder.check_token_ids([0, 49151])
