"""``POST /v1/generate`` bodies: strict proto3 JSON, every refusal naming its field."""

from __future__ import annotations

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2
from services.common.sampling import InvalidRequestError
from services.router.json_request import NOT_SUPPORTED_YET, parse_generate_json


def refused(body: str | bytes) -> str:
    with pytest.raises(InvalidRequestError) as info:
        parse_generate_json(body.encode() if isinstance(body, str) else body)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value)


def test_a_full_request_parses_with_proto_or_camel_case_names():
    request = parse_generate_json(
        b'{"request_id": "r1", "chat": {"messages": [{"role": "user", "content": "Hi"}]},'
        b' "sampling": {"maxTokens": "7", "temperature": 0.5, "seed": "18446744073709551615",'
        b' "stop": ["\\n"], "ignore_eos": true}, "priority": "PRIORITY_BATCH",'
        b' "bypassCache": true, "speculative": {"method": 2, "num_speculative_tokens": 4}}')
    assert request == generation_pb2.GenerateRequest(
        request_id="r1",
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")]),
        sampling=common_pb2.SamplingParams(max_tokens=7, temperature=0.5, seed=2**64 - 1,
                                           stop=["\n"], ignore_eos=True),
        priority=common_pb2.PRIORITY_BATCH, bypass_cache=True,
        speculative=common_pb2.SpeculativeParams(method=common_pb2.SPECULATIVE_METHOD_NGRAM,
                                                 num_speculative_tokens=4))


def test_null_means_unset():
    request = parse_generate_json(b'{"prompt": "Hi", "chat": null, "sampling": {"top_p": null}}')
    assert request.WhichOneof("input") == "prompt"
    assert not request.sampling.HasField("top_p")


@pytest.mark.parametrize(("body", "message"), [
    ('{"prompt": "Hi", "sampling": {"max_token": 3}}',
     'sampling.max_token: unknown field; did you mean "max_tokens"? (SamplingParams has '
     "temperature, top_p, top_k, seed, max_tokens, stop, stop_token_ids, ignore_eos, "
     "logprobs, prompt_logprobs, n, presence_penalty, frequency_penalty, repetition_penalty, "
     "min_tokens, logit_bias, include_stop_str_in_output, structured_output)"),
    ('{"prompt": "Hi", "temprature": 0}',
     'temprature: unknown field; did you mean "sampling.temperature"?'),
    ('{"prompt": "Hi", "max_tokens": 3}',
     'max_tokens: unknown field; sampling fields go inside "sampling"'),
    ('{"messages": [{"role": "user", "content": "Hi"}]}',
     'messages: unknown field; chat messages go inside "chat"'),
    ('{"chat": {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}}',
     "chat.messages[0].name: unknown field (ChatMessage has role, content, tool_calls, "
     "tool_call_id)"),
])
def test_unknown_fields_are_named_with_their_path(body, message):
    assert refused(body).startswith(message)


@pytest.mark.parametrize("name", ["top_logprobs", "response_format", "best_of", "stream"])
def test_fields_the_api_does_not_have_yet_are_refused_anywhere(name):
    assert refused(f'{{"prompt": "Hi", "{name}": 1}}') == \
        f"{name}: not supported: {NOT_SUPPORTED_YET[name]}"
    assert refused(f'{{"prompt": "Hi", "sampling": {{"{name}": 1}}}}').startswith(
        f"sampling.{name}: not supported: ")


@pytest.mark.parametrize(("body", "message"), [
    (b"", "body: is empty"),
    (b"   ", "body: is empty"),
    (b"\xff{}", "body: is not UTF-8 (bad byte at offset 0)"),
    (b'{"prompt": ', "body: is not valid JSON: Expecting value at line 1 column 12"),
    (b'["Hi"]', "body: must be a JSON object (a GenerateRequest), got an array"),
    (b'{"prompt": "Hi", "sampling": [1]}',
     "sampling: must be a JSON object (SamplingParams), got an array"),
    (b'{"prompt": "Hi", "sampling": {"max_tokens": "x"}}',
     "sampling.max_tokens: must be a 32-bit integer, got the string 'x'"),
    (b'{"prompt": "Hi", "sampling": {"max_tokens": 2.5}}',
     "sampling.max_tokens: must be a 32-bit integer, got the number 2.5"),
    (b'{"prompt": "Hi", "sampling": {"seed": -1}}',
     "sampling.seed: must be a non-negative 64-bit integer, got the number -1"),
    (b'{"prompt": "Hi", "sampling": {"stop": "x"}}',
     "sampling.stop: must be a JSON array, got the string 'x'"),
    (b'{"prompt": "Hi", "sampling": {"stop": ["a", 1]}}',
     "sampling.stop[1]: must be a JSON string, got the number 1"),
    (b'{"prompt": "Hi", "sampling": {"ignore_eos": "yes"}}',
     "sampling.ignore_eos: must be true or false, got the string 'yes'"),
    (b'{"prompt": "Hi", "priority": "HIGH"}',
     "priority: must be one of PRIORITY_UNSPECIFIED, PRIORITY_INTERACTIVE, PRIORITY_BATCH"),
    (b'{"prompt": "\\ud800"}', "prompt: must be valid Unicode text"),
    (b'{"prompt": "Hi", "prompt": "Ho"}', "prompt: is given more than once"),
    (b'{"prompt": "Hi", "sampling": {"max_tokens": 1, "maxTokens": 2}}',
     "sampling.maxTokens: is given twice (as 'max_tokens' and 'maxTokens')"),
    (b'{"prompt": "Hi", "chat": {"messages": []}}',
     "input: set only one of `prompt`, `chat` or `prompt_tokens`, got prompt and chat"),
])
def test_malformed_bodies_and_values_are_named(body, message):
    assert refused(body).startswith(message)


@pytest.mark.parametrize("name", ["n", "logprobs", "presence_penalty", "min_tokens"])
def test_sampling_fields_at_the_top_level_are_pointed_into_sampling(name):
    assert refused(f'{{"prompt": "Hi", "{name}": 1}}').startswith(
        f'{name}: unknown field; sampling fields go inside "sampling"')


def test_penalties_min_tokens_logit_bias_and_include_stop_parse_inside_sampling():
    request = parse_generate_json(
        b'{"prompt": "Hi", "sampling": {"presence_penalty": 0.5, "frequency_penalty": -1,'
        b' "repetition_penalty": 1.2, "min_tokens": 3, "logit_bias": {"17": -100},'
        b' "include_stop_str_in_output": true}}')
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == pytest.approx(1.2) and sampling.min_tokens == 3
    assert dict(sampling.logit_bias) == {17: -100.0} and sampling.include_stop_str_in_output
    assert refused('{"prompt": "Hi", "min_tokens": 3}').startswith(
        'min_tokens: unknown field; sampling fields go inside "sampling"')


@pytest.mark.parametrize(("bias", "message"), [
    ('[1]', "sampling.logit_bias: must be a JSON object, got an array"),
    ('{"x": 1}', "sampling.logit_bias['x']: must be a 32-bit integer, got the string 'x'"),
    ('{"3": "y"}', "sampling.logit_bias['3']: must be a number, got the string 'y'"),
])
def test_a_bad_logit_bias_map_is_named(bias, message):
    assert refused(f'{{"prompt": "Hi", "sampling": {{"logit_bias": {bias}}}}}') == message


def test_chat_tools_parse_from_proto3_json():
    request = parse_generate_json(
        b'{"chat": {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"name": "f", '
        b'"parametersJson": "{\\"type\\": \\"object\\"}"}], "toolChoice": {"mode": '
        b'"TOOL_CHOICE_MODE_REQUIRED"}, "parallelToolCalls": false}}')
    assert request.chat.tools[0].name == "f" and not request.chat.parallel_tool_calls
    assert request.chat.tool_choice.mode == generation_pb2.TOOL_CHOICE_MODE_REQUIRED
    assert refused('{"prompt": "Hi", "tools": []}').startswith('tools: not supported: tools '
                                                               'go inside "chat"')
