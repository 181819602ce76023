"""The OpenAI-compatible API of the whole mesh, through Envoy, with the official
``openai`` client and the real SmolLM2 model. (429 / 503 / an engine refusing
a field need a crafted mesh state: tests/router/test_openai_http.py, same
server, fake engines.)"""

from __future__ import annotations

import json
import time
import uuid
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from llmesh.v1 import engine_pb2_grpc

from services.cli.mesh import Mesh
from tests.e2e.mesh_client import CAPITAL_QUESTION, chat_request, generate
from tests.e2e.test_mesh_e2e import wait_engine_idle

pytestmark = pytest.mark.mesh

QUESTION = [{"role": "user", "content": CAPITAL_QUESTION}]
#: Generated tokens each streaming test asks for (ignore_eos: exactly this many).
STREAM_TOKENS = 24


def test_models_list_has_openai_shape_and_llmesh_cards_moved(mesh: Mesh, model: str) -> None:
    with urllib.request.urlopen(f"{mesh.http_url}/v1/models", timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == model and card["object"] == "model" and card["owned_by"] == "llmesh"
    assert card["max_model_len"] > 0 and isinstance(card["created"], int)
    with urllib.request.urlopen(f"{mesh.http_url}/v1/llmesh/models", timeout=10) as reply:
        assert json.loads(reply.read())["models"][0]["id"] == model  # the transcoder's


def test_chat_answer_equals_the_grpc_answer(client: openai.OpenAI, model: str,
                                            ingress_channel: grpc.Channel) -> None:
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                          temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer and chat.object == "chat.completion"
    assert chat.choices[0].finish_reason in ("stop", "length")
    grpc_answer = generate(ingress_channel, chat_request(max_tokens=16))
    assert answer == grpc_answer.text  # one pipeline: same prompt ids, same greedy tokens
    assert chat.usage.prompt_tokens == grpc_answer.last.usage.prompt_tokens
    assert chat.usage.completion_tokens == grpc_answer.last.usage.completion_tokens


def test_completion_non_streaming_and_streaming_agree(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0}
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
              if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text


def test_chat_stream_arrives_as_tokens_are_generated_and_ends_with_usage(
        client: openai.OpenAI, model: str) -> None:
    # A question of its own: an identical greedy request sent before would be
    # replayed from the response cache in one chunk (the OpenAI API has no bypass).
    fresh = [{"role": "user", "content": f"Tell me a story about {uuid.uuid4().hex[:8]}."}]
    started = time.monotonic()
    arrivals, texts, chunks = [], [], []
    stream = client.chat.completions.create(
        model=model, messages=fresh, max_completion_tokens=STREAM_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    content_arrivals = []
    for chunk in stream:
        arrivals.append(time.monotonic() - started)
        chunks.append(chunk)
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
            if texts[-1]:
                content_arrivals.append(arrivals[-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == STREAM_TOKENS
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content_arrivals) > STREAM_TOKENS // 4  # many chunks, not one
    # The chunks left as the engine's steps ended, not all at the end: they are
    # spread over a good part of the call (each step is milliseconds; how many
    # steps 24 tokens take depends on how many tokens speculation accepts, so
    # no fixed share of the time is the prefill's).
    spread = content_arrivals[-1] - content_arrivals[0]
    assert spread > 0.2 * arrivals[-1], (content_arrivals, arrivals[-1])
    apart = [b - a for a, b in zip(content_arrivals, content_arrivals[1:]) if b - a > 0.001]
    assert len(apart) >= 3, content_arrivals


def test_bad_parameter_is_400_naming_it(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, top_p=1.5)
    assert info.value.status_code == 400 and info.value.body["param"] == "top_p"
    assert "top_p" in info.value.message and "(0, 1]" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=["a", "b"])
    assert info.value.body["param"] == "prompt"


def test_unknown_model_is_404_listing_the_served_ids(client: openai.OpenAI,
                                                      model: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found" and model in info.value.message


def test_unknown_field_is_400_naming_it(mesh: Mesh) -> None:
    request = urllib.request.Request(
        f"{mesh.http_url}/v1/chat/completions", method="POST",
        data=json.dumps({"messages": QUESTION, "temprature": 0.5}).encode(),
        headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and error["param"] == "temprature"


def test_client_disconnect_frees_the_engine_sequence(mesh: Mesh, client: openai.OpenAI,
                                                     model: str) -> None:
    engine = engine_pb2_grpc.EngineServiceStub(
        grpc.insecure_channel(mesh.engines[0].grpc_address))
    stream = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 2:
            break
    stream.close()  # the client leaves mid-generation
    # 1,000 tokens take many seconds; the sequence must leave the engine at once.
    assert wait_engine_idle(engine, within_s=3.0) < 3.0


def test_chat_logprobs_of_greedy_tokens_are_their_top_alternative(client: openai.OpenAI,
                                                                  model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(item.token for item in content).startswith(
        chat.choices[0].message.content)
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.logprob == max(t.logprob for t in item.top_logprobs)  # greedy: the argmax
        assert item.token == item.top_logprobs[0].token and item.bytes == list(
            item.token.encode())


def test_a_constraint_that_fails_while_generating_is_400_naming_it(
        client: openai.OpenAI, model: str) -> None:
    """llguidance's lexer limit, reached only while generating: a 400 naming the
    parameter with llguidance's reason (not a 500 the client retries), without
    the engine's address; the engine serves on."""
    with pytest.raises(openai.BadRequestError) as info:
        client.with_options(max_retries=0).completions.create(
            model=model, prompt="Write:", max_tokens=8,
            extra_body={"guided_regex": "(a{1000}){1000}"})
    assert info.value.body["param"] == "guided_regex"
    message = info.value.body["message"]
    assert message.startswith("guided_regex: the constraint failed after")
    assert "too many" in message and "127.0.0.1" not in message
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices


#: A completion that writes words and emoji, whose bytes SmolLM2's byte-level
#: BPE spells in fragments (``bytes:\xf0\x9f`` ...).
EMOJI_PROMPT = "I love pizza 🍕 and sushi 🍣 and tacos 🌮 and"


def test_completion_text_offsets_index_the_text_through_multibyte_characters(
        client: openai.OpenAI, model: str) -> None:
    """Issue 30, bug 3: a token that is part of a character (``bytes:\\xNN``)
    advanced ``text_offset`` by its 14-character spelling. Every offset now
    indexes the text: monotone, within it, each whole-character token's text
    found there, and a fragment's offset at the character its first byte
    belongs to; the stream's offsets are the same."""
    kwargs = {"model": model, "prompt": EMOJI_PROMPT, "max_tokens": 16, "temperature": 0,
              "logprobs": 1}
    whole = client.completions.create(**kwargs).choices[0]
    text, tokens, offsets = whole.text, whole.logprobs.tokens, whole.logprobs.text_offset
    fragments = [t for t in tokens if t.startswith("bytes:")]
    assert fragments and len(fragments) < len(tokens), tokens  # both kinds are exercised
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    for token, offset in zip(tokens, offsets, strict=True):
        if token.startswith("bytes:"):
            first = int(token[len("bytes:\\x"):][:2], 16)
            assert ord(text[offset]) == first if first < 0x80 else ord(text[offset]) >= 0x80
        else:
            assert text[offset:].startswith(token), (token, offset, text)
    streamed = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs]
    assert "".join(c.text for c in streamed) == text
    assert [o for c in streamed for o in c.logprobs.text_offset] == offsets


def test_min_tokens_extends_a_grammar_or_is_400_naming_it(
        client: openai.OpenAI, model: str, ingress_channel: grpc.Channel) -> None:
    """Issue 30, bug 4: ``min_tokens`` was ignored by constrained requests.
    A grammar that admits more is extended until ``min_tokens`` (the model
    alone answers "yes" and stops); one that admits nothing more by then is
    refused naming ``min_tokens``, over OpenAI (400) and gRPC (INVALID_ARGUMENT)."""
    question = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    regex = "(yes|no)(, really)*"
    alone = client.chat.completions.create(model=model, messages=question, max_tokens=12,
                                           extra_body={"guided_regex": regex})
    assert alone.choices[0].message.content == "yes"
    held = client.chat.completions.create(model=model, messages=question, max_tokens=12,
                                          extra_body={"guided_regex": regex, "min_tokens": 10})
    assert held.usage.completion_tokens >= 10
    assert held.choices[0].message.content.startswith("yes, really, really")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="A digit:", max_tokens=8,
                                  extra_body={"guided_regex": "[0-9]", "min_tokens": 5})
    assert info.value.body["param"] == "min_tokens"
    assert info.value.body["message"].startswith(
        "min_tokens: the output constraint (guided_regex) admits no token after")
    request = chat_request("A digit, please.", max_tokens=8, min_tokens=5)
    request.sampling.structured_output.regex = "[0-9]"
    with pytest.raises(grpc.RpcError) as refused:
        generate(ingress_channel, request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("sampling.min_tokens: the output constraint")


def test_another_cache_salt_shares_no_cached_tokens_where_the_same_salt_hits(
        client: openai.OpenAI, model: str) -> None:
    tag = uuid.uuid4().hex[:8]  # a prompt no earlier request shares a block of
    prompt = (f"[{tag}] The quarterly report lists revenue, costs and the outlook for "
              "each region; the board reads it before the meeting, and the auditors "
              "check its figures against the ledger. Summary:")

    def cached(salt: str) -> tuple[int, int]:
        usage = client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0,
            extra_body={"cache_salt": salt}).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    first, prompt_tokens = cached(f"a-{tag}")
    assert first == 0 and prompt_tokens > 32
    assert cached(f"a-{tag}") == (prompt_tokens, prompt_tokens)  # the same salt: a hit
    assert cached(f"b-{tag}") == (0, prompt_tokens)  # another salt: nothing shared
