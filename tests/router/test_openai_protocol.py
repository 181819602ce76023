"""OpenAI bodies into the shared ``GenerateRequest``, and refusals naming the parameter."""

from __future__ import annotations

import json

import grpc
import pytest
from llmesh.v1 import common_pb2

from services.common.sampling import InvalidRequestError
from services.router.openai_protocol import Endpoint, openai_param, parse_request
from services.router.validation import ModelLimits, validate_request

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
MODELS = {"m": ModelLimits(model="m", max_model_len=2048, vocab_size=1000,
                           has_chat_template=True, default_max_tokens=16, max_tokens_cap=512)}
USER = [{"role": "user", "content": "hi"}]


def parse(endpoint: Endpoint, **body):
    return parse_request(endpoint, json.dumps(body).encode())


def refused(endpoint: Endpoint, body: object) -> InvalidRequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(InvalidRequestError) as info:
        parse_request(endpoint, raw)
    return info.value


def test_chat_body_maps_every_sampling_field():
    parsed = parse(CHAT, model="m", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], max_completion_tokens=7, temperature=0.5, top_p=0.9, n=3, seed=42, stop="END",
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": -100, "5": 2.5},
        logprobs=True, top_logprobs=4, user="u1", stream=True,
        stream_options={"include_usage": True}, top_k=-1, min_tokens=2,
        repetition_penalty=1.2, include_stop_str_in_output=True, ignore_eos=True,
        stop_token_ids=[3, 4], prompt_logprobs=1)
    pb = parsed.generate
    assert pb.model == "m" and parsed.stream and parsed.include_usage
    assert [(m.role, m.content) for m in pb.chat.messages] == [("system", "be brief"),
                                                               ("user", "ab")]
    s = pb.sampling
    assert (s.max_tokens, s.n, s.seed, list(s.stop), s.logprobs) == (7, 3, 42, ["END"], 4)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert dict(s.logit_bias) == {17: -100.0, 5: 2.5}
    assert s.HasField("top_k") and s.top_k == 0  # vLLM's -1 is "off"
    assert (s.min_tokens, s.include_stop_str_in_output, s.ignore_eos) == (2, True, True)
    assert list(s.stop_token_ids) == [3, 4] and s.prompt_logprobs == 1
    assert s.repetition_penalty == pytest.approx(1.2)
    assert parsed.max_tokens_param == "max_completion_tokens"


def test_completions_logprobs_is_a_count_and_a_one_prompt_list_is_accepted():
    pb = parse(COMPLETIONS, prompt=["Once"], logprobs=2, max_tokens=3, echo=False,
               best_of=1).generate
    assert pb.prompt == "Once" and pb.sampling.logprobs == 2 and pb.sampling.max_tokens == 3


def test_chat_logprobs_without_top_logprobs_asks_for_the_chosen_token_only():
    s = parse(CHAT, messages=USER, logprobs=True).generate.sampling
    assert s.HasField("logprobs") and s.logprobs == 0
    assert not parse(CHAT, messages=USER).generate.sampling.HasField("logprobs")


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json_schema", '{"type": "object"}'),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_grammar": "start: 'a'"}, "grammar", "start: 'a'"),
    ({"structured_outputs": {"json": {"type": "string"}}}, "json_schema", '{"type": "string"}'),
])
def test_output_constraints_map_to_structured_output(body, kind, spec):
    out = parse(CHAT, messages=USER, **body).generate.sampling.structured_output
    assert out.WhichOneof("constraint") == kind and getattr(out, kind) == spec


def test_choice_constraint_and_text_format():
    out = parse(CHAT, messages=USER, guided_choice=["yes", "no"]).generate.sampling
    assert list(out.structured_output.choice.choices) == ["yes", "no"]
    plain = parse(CHAT, messages=USER, response_format={"type": "text"}).generate.sampling
    assert not plain.HasField("structured_output")


@pytest.mark.parametrize("endpoint, body, param, words", [
    (CHAT, {"messages": USER, "frobnicate": 1}, "frobnicate", "unrecognized"),
    (CHAT, {"messages": USER, "prompt": "x"}, "prompt", "/v1/completions"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "several prompts"),
    (COMPLETIONS, {"prompt": [[1], [2]]}, "prompt", "several prompts"),
    (COMPLETIONS, {"prompt": [1, 2.5]}, "prompt", "integer"),
    (COMPLETIONS, {"prompt": [1, 2**40]}, "prompt", "out of range"),
    (COMPLETIONS, {"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens",
     "/v1/chat/completions"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature", "number"),
    (CHAT, {"messages": USER, "stop": [1]}, "stop", "string"),
    (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs", "logprobs: true"),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    (CHAT, {"messages": USER, "seed": -1}, "seed", ">= 0"),
    (CHAT, {"messages": USER, "max_tokens": 2**40}, "max_tokens", "out of range"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]",
     "only function tools are supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "text parts"),
    (CHAT, {"messages": USER, "guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex", "only one"),
    (CHAT, {"messages": USER, "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens", "differs"),
    (COMPLETIONS, {"prompt": "a", "best_of": 3}, "best_of", "not supported"),
    (CHAT, {"messages": USER, "cache_salt": 7}, "cache_salt", "string"),
    # QA: a nested boolean of the wrong type was named without its object.
    (CHAT, {"messages": USER, "history": {"summarize": "no"}}, "history.summarize",
     "true or false"),
    (CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "true or false"),
])
def test_refusals_name_the_parameter(endpoint, body, param, words):
    err = refused(endpoint, body)
    assert err.field == param and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in str(err)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": None}, {"role": "user"}, {"role": "system", "content": None},
    {"role": "tool", "content": None, "tool_call_id": "c1"},
    {"role": "assistant", "content": None}, {"role": "assistant", "content": None,
                                              "tool_calls": []},
])
def test_null_content_is_refused_but_for_an_assistant_message_with_tool_calls(message):
    """QA, issue 33: null content was read as "" for every role; OpenAI allows
    it only on an assistant message that carries tool_calls."""
    err = refused(CHAT, {"messages": [*USER, message]})
    assert err.field == "messages[1].content" and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "null only in an assistant message with tool_calls" in str(err)
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    chat = parse(CHAT, messages=[*USER, called]).generate.chat
    assert chat.messages[1].content == "" and chat.messages[1].tool_calls[0].name == "f"


@pytest.mark.parametrize("raw", [b"", b"[1]", b"{not json", b"\xff"])
def test_bodies_that_are_not_a_json_object_blame_the_body(raw):
    assert refused(CHAT, raw).field == "body"


@pytest.mark.parametrize("prompt", [[5, 7, 9], [[5, 7, 9]]])
def test_a_token_id_prompt_goes_to_the_engine_as_it_is(prompt):
    # lm-evaluation-harness sends a batch of one list of ids; a flat list is the same.
    parsed = parse(COMPLETIONS, model="m", prompt=prompt, max_tokens=1)
    assert list(parsed.generate.prompt_tokens.token_ids) == [5, 7, 9]
    validated = validate_request(parsed.generate, request_id="r", models=MODELS,
                                 default_model="m")
    assert validated.prompt_token_ids == (5, 7, 9) and validated.prompt is None
    assert validated.input_field == "prompt_tokens.token_ids"


@pytest.mark.parametrize("prompt, words", [([1, 1000], "token id 1000 is not in the "
                                                       "vocabulary of 'm' (ids 0..999)"),
                                           ([-1], "token id -1"), ([], "at least one")])
def test_a_token_id_prompt_outside_the_vocabulary_is_refused_naming_prompt(prompt, words):
    parsed = parse(COMPLETIONS, model="m", prompt=prompt)
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(info.value)
    assert openai_param(info.value.field, parsed) == "prompt"


def test_echo_asks_the_engine_for_the_prompt_logprobs_and_max_tokens_0_for_one_token():
    # lm-evaluation-harness's loglikelihood request (vLLM's echo_without_generation).
    parsed = parse(COMPLETIONS, prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=0)
    sampling = parsed.generate.sampling
    assert parsed.echo and parsed.echo_only and not parsed.prompt_logprobs
    assert (sampling.max_tokens, sampling.logprobs, sampling.prompt_logprobs) == (1, 1, 1)
    generating = parse(COMPLETIONS, prompt="x", echo=True, logprobs=2, max_tokens=1,
                       prompt_logprobs=0)
    assert generating.echo and not generating.echo_only and generating.prompt_logprobs
    assert generating.generate.sampling.prompt_logprobs == 0  # the client's own count
    text_only = parse(COMPLETIONS, prompt="x", echo=True).generate.sampling
    assert not text_only.HasField("prompt_logprobs")  # no logprobs: none asked of the engine
    streamed = parse(COMPLETIONS, prompt=[1, 2], echo=True, logprobs=1, max_tokens=0,
                     stream=True)  # streamed as vLLM streams it (once refused naming echo)
    assert streamed.stream and streamed.echo_only
    assert streamed.generate.sampling.prompt_logprobs == 1
    with pytest.raises(InvalidRequestError) as info:  # 0 without echo: refused as before
        validate_request(parse(COMPLETIONS, model="m", prompt="x", max_tokens=0).generate,
                         request_id="r", models=MODELS, default_model="m")
    assert info.value.field == "sampling.max_tokens"


def test_ranges_are_checked_by_the_shared_validation_and_renamed():
    parsed = parse(CHAT, messages=USER, model="m", top_logprobs=21, logprobs=True)
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert info.value.field == "sampling.logprobs"
    assert openai_param(info.value.field, parsed) == "top_logprobs"
    parsed = parse(CHAT, messages=[{"role": "bad role", "content": "x"}], model="m")
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert openai_param(info.value.field, parsed) == "messages[0].role"
    parsed = parse(CHAT, messages=USER, max_completion_tokens=10_000)
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert openai_param(info.value.field, parsed) == "max_completion_tokens"


def test_cache_salt_is_vllms_and_checked_by_the_shared_validation():
    for endpoint, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "a"})):
        assert parse(endpoint, **body, cache_salt="s3cret").generate.cache_salt == "s3cret"
        assert not parse(endpoint, **body).generate.HasField("cache_salt")
    parsed = parse(CHAT, messages=USER, model="m", cache_salt="")
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert openai_param(info.value.field, parsed) == "cache_salt"


def test_a_parsed_request_passes_the_shared_validation():
    parsed = parse(CHAT, messages=USER, model="m", n=2, seed=1, temperature=1.0,
                   logit_bias={"7": 1})
    request = validate_request(parsed.generate, request_id="r", models=MODELS,
                               default_model="m")
    assert request.sampling.n == 2 and request.sampling.logit_bias == ((7, 1.0),)
    assert request.messages is not None and request.sampling.seed == 1


def test_null_values_mean_unset():
    s = parse(CHAT, messages=USER, temperature=None, stop=None, seed=None).generate.sampling
    assert s == common_pb2.SamplingParams()


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": " "}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "not json {"}}},
     "response_format"),
])
def test_a_refused_constraint_names_the_parameter_that_set_it(body, param):
    parsed = parse(COMPLETIONS, prompt="x", model="m", **body)
    with pytest.raises(InvalidRequestError) as info:
        validate_request(parsed.generate, request_id="r", models=MODELS, default_model="m")
    assert openai_param(info.value.field, parsed) == param
    assert openai_param("sampling.structured_output.choice.choices") == \
        "response_format.choice.choices"  # no request: the dot is kept


def test_developer_role_store_and_metadata_are_what_openai_clients_send():
    parsed = parse(CHAT, model="m", store=False, metadata={"k": "v"},
                   messages=[{"role": "developer", "content": "Be brief."}, *USER])
    assert [(m.role, m.content) for m in parsed.generate.chat.messages] == [
        ("system", "Be brief."), ("user", "hi")]
