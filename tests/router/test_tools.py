"""Tool calling's parts without a mesh: the Hermes renderer, the grammar
(compiled against SmolLM2's real vocabulary), the incremental parser, the
edge validation and the OpenAI shapes. Through the mesh:
tests/e2e/test_mesh_tools.py."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator

import grpc
import llguidance
import pytest
from llmesh.v1 import generation_pb2

from services.common.model_files import default_model_path
from services.common.sampling import FinishReason, InvalidRequestError
from services.common.wire.engine_stream import Usage
from services.common.wire.chat import ChatMessage
from services.common.wire.tools import (
    FunctionTool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    ToolRequest,
)
from services.router.generation import Delta, Finished
from services.router.openai_protocol import Endpoint, openai_param, parse_request
from services.router.tools import hermes
from services.router.tools.formats import ToolCallFormat, has_tool_section, parse_flag, resolve
from services.router.tools.grammar import tool_grammar
from services.router.tools.openai import message_body
from services.router.tools.parser import ToolCallParser
from services.router.tools.stream import with_tool_calls
from services.router.tools.validate import tool_request
from services.router.validation import validate_request
from tests.router.test_router_validation import CHAT_LIMITS
from tests.tokenizer.tokenizer_helpers import TOOLS_TEMPLATE

WEATHER = FunctionTool("get_weather", "Current weather of a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
TIME = FunctionTool("get_time", "", json.dumps({
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}))
CALL = hermes.call_text("get_weather", '{"city": "Paris \\"}{", "unit": "c"}')


# ------------------------------------------------------------------ parser


def _parse(pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    ids = iter(f"call_{i}" for i in range(10))
    parser = ToolCallParser(lambda: next(ids))
    content, deltas = [], []
    for piece in pieces:
        text, calls = parser.feed(piece)
        content.append(text)
        deltas += calls
    content.append(parser.finish())
    return "".join(content), deltas


@pytest.mark.parametrize("split", ["whole", "chars", "random"])
def test_parser_gives_the_same_calls_for_any_split_of_the_text(split: str) -> None:
    text = "Let me check.\n" + CALL + "\n" + hermes.call_text("get_time", '{"zone": "CET"}')
    if split == "whole":
        pieces = [text]
    elif split == "chars":
        pieces = list(text)
    else:
        rng, pieces, at = random.Random(7), [], 0
        while at < len(text):
            size = rng.randint(1, 9)
            pieces.append(text[at:at + size])
            at += size
    content, deltas = _parse(pieces)
    assert content == "Let me check.\n"
    assert message_body(deltas) == [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris \\"}{", "unit": "c"}'}},
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
    firsts = [d for d in deltas if d.id]
    assert [d.index for d in firsts] == [0, 1] and all(d.name for d in firsts)


def test_parser_holds_back_a_partial_marker_and_releases_plain_text() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool_") == ("a ", [])
    assert parser.feed("box>") == ("<tool_box>", [])
    assert parser.feed(" <to") == (" ", [])
    assert parser.finish() == "<to"


# ----------------------------------------------------------------- render


def test_render_puts_tools_in_the_system_turn_and_results_in_a_user_turn() -> None:
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Weather?"),
                ChatMessage("assistant", "", (ToolCall("call_1", "get_weather",
                                                       '{"city": "Oslo", "unit": "c"}'),)),
                ChatMessage("tool", "3 C", tool_call_id="call_1"),
                ChatMessage("tool", "windy", tool_call_id="call_2"))
    out = hermes.render(messages, (WEATHER,))
    assert out[0].role == "system" and out[0].content.startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0].content and "<tools>" in out[0].content
    assert out[2] == ChatMessage("assistant", hermes.call_text(
        "get_weather", '{"city": "Oslo", "unit": "c"}'))
    assert out[3] == ChatMessage("user", "<tool_response>\n3 C\n</tool_response>\n"
                                         "<tool_response>\nwindy\n</tool_response>")
    assert len(out) == 4 and all(not m.tool_calls for m in out)
    # A template that renders `tool` turns (ChatML) gets the results there, bare.
    turns = hermes.render(messages, (WEATHER,), tool_turns=True)
    assert turns[:3] == out[:3]
    assert turns[3:] == (ChatMessage("tool", "3 C"), ChatMessage("tool", "windy"))
    limits = dataclasses.replace(CHAT_LIMITS, tool_turns=True)
    pb = _openai({"tools": [_tool({"type": "object"})]})
    pb.chat.messages.add(role="assistant").tool_calls.add(id="c1", name="f", arguments="{}")
    pb.chat.messages.add(role="tool", content="3 C", tool_call_id="c1")
    served = validate_request(pb, request_id="r", models={"tiny": limits}, default_model="tiny")
    assert served.messages is not None and served.messages[-1] == ChatMessage("tool", "3 C")


# ---------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def lltok() -> llguidance.LLTokenizer:
    from services.engine.torch_backend.structured_output import load_tokenizer
    return load_tokenizer(default_model_path(), 49152, (0, 2))


def _accepts(tok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar), log_level=0)
    return all(matcher.consume_token(t) for t in tok.tokenize_str(text)) \
        and matcher.is_accepting()


def _grammar(mode: ToolChoiceMode, name: str = "", parallel: bool = True) -> str:
    grammar = tool_grammar(ToolRequest((WEATHER, TIME), ToolChoice(mode, name), parallel))
    assert grammar is not None
    return grammar


def test_required_grammar_admits_valid_calls_only(lltok: llguidance.LLTokenizer) -> None:
    required = _grammar(ToolChoiceMode.REQUIRED)
    good = hermes.call_text("get_weather", '{"city": "Oslo", "unit": "f"}')
    assert _accepts(lltok, required, good)
    assert _accepts(lltok, required, good + "\n" + hermes.call_text("get_time",
                                                                    '{"zone": "UTC"}'))
    assert not _accepts(lltok, required, "Sure! " + good)  # no text
    assert not _accepts(lltok, required, hermes.call_text("get_weather",
                                                          '{"city": "Oslo", "unit": "k"}'))
    assert not _accepts(lltok, required, hermes.call_text("nope", "{}"))
    single = _grammar(ToolChoiceMode.REQUIRED, parallel=False)
    assert not _accepts(lltok, single, good + "\n" + good)
    named = _grammar(ToolChoiceMode.NAMED, "get_time")
    assert not _accepts(lltok, named, good)
    assert _accepts(lltok, named, hermes.call_text("get_time", '{"zone": "UTC"}'))


def test_auto_grammar_is_free_text_until_the_marker_then_a_valid_call(
        lltok: llguidance.LLTokenizer) -> None:
    auto = _grammar(ToolChoiceMode.AUTO)
    assert _accepts(lltok, auto, "Paris is the capital of France.")
    assert _accepts(lltok, auto, "Checking.\n" + hermes.call_text(
        "get_time", '{"zone": "UTC"}'))
    assert not _accepts(lltok, auto, 'Checking. <tool_call>\n{"name": "x"}')
    assert tool_grammar(ToolRequest((WEATHER,), ToolChoice(ToolChoiceMode.NONE))) is None


# ------------------------------------------------------------- validation


def _chat(body: dict) -> generation_pb2.Chat:
    return parse_request(Endpoint.CHAT, json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], **body}).encode()).generate.chat


def _tool(parameters: object, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [_tool({"type": "object"}),
                _tool({"type": "object", "properties": {"a": {"type": "strng"}}}, "g")]},
     "tools[1].function.parameters"),
    ({"tools": [_tool({"type": "object"})],
      "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool({"type": "object"}, "bad name")]}, "tools[0].function.name"),
    ({"tools": [_tool({"type": "object"}), _tool({"type": "object"})]},
     "tools[1].function.name"),
])
def test_bad_tools_are_refused_naming_the_openai_parameter(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tool_request(_chat(body))
    assert openai_param(info.value.field) == param


def test_openai_tools_become_the_typed_request() -> None:
    chat = _chat({"tools": [_tool(json.loads(WEATHER.parameters_schema), "get_weather")],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                  "parallel_tool_calls": False})
    request = tool_request(chat)
    assert request is not None and request.choice == ToolChoice(ToolChoiceMode.NAMED,
                                                                "get_weather")
    assert not request.parallel and request.tools[0].name == "get_weather"
    assert ToolChoice.from_pb(request.choice.to_pb(), has_tools=True) == request.choice
    assert tool_request(_chat({})) is None


def test_tools_over_the_models_byte_limit_are_refused_naming_tools_before_compiling() -> None:
    """QA, issue 33: a huge tool schema became a huge prompt with no stated
    limit. Now 4 bytes of definitions per token of the context window."""
    limit = CHAT_LIMITS.max_model_len * 4
    described = {"type": "function", "function": {
        "name": "f", "description": "x" * (limit - len('f{"type": "object"}')),
        "parameters": {"type": "object"}}}
    at_limit = _openai({"tools": [described]})
    validate_request(at_limit, request_id="r", models={"tiny": CHAT_LIMITS},
                     default_model="tiny")
    described["function"]["description"] += "x"
    with pytest.raises(InvalidRequestError) as info:
        validate_request(_openai({"tools": [described]}), request_id="r",
                         models={"tiny": CHAT_LIMITS}, default_model="tiny")
    assert openai_param(info.value.field) == "tools"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"take {limit + 1} bytes, more than this model's limit of {limit} bytes" \
        in str(info.value)


# ------------------------------------------------------------ the format flag


def test_tool_call_format_flag_per_model_and_none_refuses_tools() -> None:
    formats = dict(map(parse_flag, ["none", "smol=auto"]))
    assert resolve(formats, "smol", None) is ToolCallFormat.HERMES  # auto, no tool section
    assert resolve(formats, "gemma", TOOLS_TEMPLATE.read_text()) is ToolCallFormat.NONE
    assert resolve({}, "any", None) is ToolCallFormat.HERMES
    with pytest.raises(ValueError, match="FORMAT one of auto, template, hermes, none"):
        parse_flag("smol=qwen")
    limits = dataclasses.replace(CHAT_LIMITS, tool_call_format=ToolCallFormat.NONE)
    pb = generation_pb2.GenerateRequest(chat=_chat({"tools": [_tool({"type": "object"})]}))
    with pytest.raises(InvalidRequestError) as info:
        validate_request(pb, request_id="r", models={"tiny": limits}, default_model="tiny")
    assert info.value.field == "chat.tools"
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    served = validate_request(pb, request_id="r", models={"tiny": CHAT_LIMITS},
                              default_model="tiny")
    assert served.sampling.structured_output is not None  # auto: the call grammar
    assert served.messages is not None and "<tools>" in served.messages[0].content


def test_auto_is_template_for_a_template_with_a_tool_section() -> None:
    """``auto`` reads the template: a tool section (the ``tools`` variable)
    makes it ``template``; a forced ``hermes`` stays Hermes."""
    tools_template = TOOLS_TEMPLATE.read_text()
    assert has_tool_section(tools_template)
    assert not has_tool_section("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not has_tool_section("{% set tools = 1 %}{{ tools }}")  # its own, not the caller's
    assert not has_tool_section(None)
    assert resolve({}, "smol", tools_template) is ToolCallFormat.TEMPLATE
    assert resolve(dict([parse_flag("hermes")]), "smol", tools_template) is ToolCallFormat.HERMES


def test_template_format_passes_tools_calls_and_results_to_the_template() -> None:
    """Under ``template`` the router leaves the turns structured (the tokenizer
    gives them to the template) and the tools as ``chat_tools``; the call is
    still constrained in the Hermes syntax."""
    limits = dataclasses.replace(CHAT_LIMITS, tool_call_format=ToolCallFormat.TEMPLATE)
    pb = generation_pb2.GenerateRequest(chat=_chat({"tools": [_tool({"type": "object"})]}))
    pb.chat.messages.add(role="assistant").tool_calls.add(id="call_1", name="f",
                                                          arguments='{"a": 1}')
    pb.chat.messages.add(role="tool", content="3", tool_call_id="call_1")
    served = validate_request(pb, request_id="r", models={"tiny": limits}, default_model="tiny")
    assert served.chat_tools == served.tools.tools and served.chat_tools[0].name == "f"
    assert served.messages == (ChatMessage(pb.chat.messages[0].role, pb.chat.messages[0].content),
                               ChatMessage("assistant", "", (ToolCall("call_1", "f", '{"a": 1}'),)),
                               ChatMessage("tool", "3", tool_call_id="call_1"))
    assert served.sampling.structured_output is not None
    hermes_served = validate_request(pb, request_id="r", models={"tiny": CHAT_LIMITS},
                                     default_model="tiny")
    assert hermes_served.chat_tools == () and "<tools>" in hermes_served.messages[0].content


# ----------------------------------------------- what may not cut a call (QA)


def _openai(body: dict) -> generation_pb2.GenerateRequest:
    return parse_request(Endpoint.CHAT, json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], **body}).encode()).generate


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["}"]}, "stop"), ({"stop_token_ids": [99]}, "stop_token_ids"),
    ({"min_tokens": 5}, "min_tokens")])
@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "f"}}])
def test_stops_and_min_tokens_are_refused_where_a_call_may_be_made(
        extra: dict, param: str, choice: object) -> None:
    """A stop string cut a call's arguments mid-JSON and the call was reported
    as finished; min_tokens failed only after the call had streamed."""
    pb = _openai({"tools": [_tool({"type": "object"})], "tool_choice": choice, **extra})
    with pytest.raises(InvalidRequestError) as info:
        validate_request(pb, request_id="r", models={"tiny": CHAT_LIMITS},
                         default_model="tiny")
    assert openai_param(info.value.field) == param
    assert "tool" in str(info.value)
    none = _openai({"tools": [_tool({"type": "object"})], "tool_choice": "none", **extra})
    validate_request(none, request_id="r", models={"tiny": CHAT_LIMITS}, default_model="tiny")


async def _events(*events: Delta | Finished) -> AsyncIterator[Delta | Finished]:
    for event in events:
        yield event


@pytest.mark.parametrize(("calls_only", "content"), [(True, ""), (False, "<tool_ca")])
async def test_a_call_marker_cut_by_max_tokens_is_never_content_when_only_calls_are_allowed(
        calls_only: bool, content: str) -> None:
    """tool_choice required, max_tokens 1..4: "<", "<tool", ... came back as content."""
    usage = Usage(prompt_tokens=5, completion_tokens=4)
    got = [e async for e in with_tool_calls(_events(
        Delta("<tool_ca", (1, 2, 3, 4)), Finished(FinishReason.LENGTH, "", usage)),
        calls_only=calls_only)]
    text = "".join(e.text for e in got if isinstance(e, Delta))
    assert text == content
    assert [e.reason for e in got if isinstance(e, Finished)] == [FinishReason.LENGTH]


_CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function",
     "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_a",
                                          "content": "21"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "hi"}, _CALLED,
      {"role": "tool", "tool_call_id": "call_b", "content": "21"}],
     "messages[2].tool_call_id"),
    ([{"role": "user", "content": "hi"},
      {**_CALLED, "tool_calls": [{**_CALLED["tool_calls"][0],
                                  "function": {"name": "f", "arguments": "{not json"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
])
def test_a_history_whose_calls_and_results_disagree_is_refused(
        messages: list[dict], param: str) -> None:
    """QA: an orphan tool result, a tool_call_id answering no call and
    arguments that are not JSON were accepted (and pasted into the prompt)."""
    pb = parse_request(Endpoint.CHAT, json.dumps(
        {"messages": messages, "tools": [_tool({"type": "object"})]}).encode()).generate
    with pytest.raises(InvalidRequestError) as info:
        validate_request(pb, request_id="r", models={"tiny": CHAT_LIMITS},
                         default_model="tiny")
    assert openai_param(info.value.field) == param
    good = [{"role": "user", "content": "hi"}, _CALLED,
            {"role": "tool", "tool_call_id": "call_a", "content": "21"}]
    validate_request(parse_request(Endpoint.CHAT, json.dumps(
        {"messages": good, "tools": [_tool({"type": "object"})]}).encode()).generate,
        request_id="r", models={"tiny": CHAT_LIMITS}, default_model="tiny")
