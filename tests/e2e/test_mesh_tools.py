"""Tool calling through Envoy on the real SmolLM2 mesh: the official ``openai``
client and the gRPC ``GenerationService`` (issue 33's "Must show")."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion
from llmesh.v1 import common_pb2, generation_pb2

from tests.e2e.mesh_client import generate

pytestmark = pytest.mark.mesh

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
               "required": ["zone"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": TIME_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
#: Leaves the arguments open, so that samples differ.
OPEN_ASK = [{"role": "user", "content": "Pick any city you like and check its weather."}]


def _schema(name: str) -> dict:
    return {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}[name]


def test_required_and_named_calls_validate_for_50_seeded_samples(
        client: openai.OpenAI, model: str) -> None:
    def sample(seed: int):
        choice = "required" if seed % 2 else {"type": "function",
                                              "function": {"name": "get_weather"}}
        return client.chat.completions.create(
            model=model, messages=OPEN_ASK, tools=[WEATHER, TIME], tool_choice=choice,
            parallel_tool_calls=False, temperature=0.8, seed=seed, max_tokens=64)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(sample, range(50)))
    calls = []
    for seed, answer in enumerate(answers):
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments),
                                _schema(call.function.name))
            assert seed % 2 or call.function.name == "get_weather"  # the named function
            calls.append(call.function.arguments)
    assert len(calls) == 50
    # sampled, not one answer 50 times (seeded: the same 50 answers every run)
    assert len(set(calls)) >= 10, calls


def test_streamed_deltas_assemble_into_the_non_streamed_call(
        client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "messages": ASK, "tools": [WEATHER, TIME],
              "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
              "max_tokens": 64}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish, usage, firsts = None, None, 0
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                if piece.id:
                    firsts += 1
                    assert piece.type == "function" and piece.function.name
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected and firsts == len(expected)
    assert finish == "tool_calls" == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_parallel_tool_calls_give_two_indexed_calls(client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris, and what time is it "
                                       "in UTC? Call both tools."}]
    answer = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=True, temperature=0, max_tokens=96)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 2, calls
    assert {c.function.name for c in calls} == {"get_weather", "get_time"}
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def run_tool_loop(client: openai.OpenAI, model: str, **first_options: object
                  ) -> tuple[ChatCompletion, ChatCompletion]:
    """user → a required call of get_weather → its ``tool`` result → a text
    answer (checked); the first and the final answer."""
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        **first_options)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=40)
    message = final.choices[0].message
    assert final.choices[0].finish_reason in ("stop", "length")
    assert not message.tool_calls and message.content and "<tool_call>" not in message.content
    return first, final


def test_full_loop_call_then_tool_result_then_text_answer(
        client: openai.OpenAI, model: str) -> None:
    _, final = run_tool_loop(client, model, max_tokens=48)
    # QA, issue 33: the result, rendered as a <tool_response> block in a user
    # turn, came back as the answer; in a ChatML tool turn SmolLM2 answers it.
    assert "<tool_response>" not in final.choices[0].message.content
    assert "21" in final.choices[0].message.content


def test_auto_answers_in_text_when_no_tool_is_needed(client: openai.OpenAI, model: str) -> None:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=24)
    choice = answer.choices[0]
    assert not choice.message.tool_calls and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"type": "strng"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
])
def test_uncompilable_schema_or_absent_function_is_400_naming_it(
        client: openai.OpenAI, model: str, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_grpc_edge_returns_the_same_call_as_openai(client: openai.OpenAI, model: str,
                                                   ingress_channel: grpc.Channel) -> None:
    answer = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        parallel_tool_calls=False, max_tokens=48)
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(
            messages=[common_pb2.ChatMessage(role="user", content=ASK[0]["content"])],
            tools=[generation_pb2.FunctionTool(
                name="get_weather", description=WEATHER["function"]["description"],
                parameters_json=json.dumps(WEATHER_SCHEMA))],
            tool_choice=generation_pb2.ToolChoice(
                mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
            parallel_tool_calls=False),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=48), bypass_cache=True)
    stub_result = generate(ingress_channel, request)
    assert stub_result.last is not None
    assert stub_result.last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert stub_result.text == ""
    expected = answer.choices[0].message.tool_calls[0]
    first = stub_result.tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_")
    assert all(p.index == 0 and not p.id for p in stub_result.tool_calls[1:])
    arguments = "".join(p.arguments for p in stub_result.tool_calls)
    assert (first.name, arguments) == (expected.function.name, expected.function.arguments)
