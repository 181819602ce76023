"""``Chat.tools``, ``tool_choice`` and ``parallel_tool_calls`` checked once, at
the router's edge (both edges: OpenAI bodies become the same protobuf).

Every refusal is :class:`~services.common.sampling.InvalidRequestError`
(INVALID_ARGUMENT) naming the field (``chat.tools[1].parameters_json``,
``chat.tool_choice.function_name``), which the OpenAI edge turns into the
parameter the client wrote (``tools[1].function.parameters``, ``tool_choice``).
A schema is compiled by llguidance here (no tokenizer needed), so a tool that
the engine could not constrain never reaches it.
"""

from __future__ import annotations

import dataclasses
import json
import re

import llguidance
from llmesh.v1 import generation_pb2

from services.common.sampling import (
    ConstraintKind,
    InvalidRequestError,
    SamplingOptions,
    StructuredOutput,
)
from services.common.wire.tools import (
    FunctionTool,
    ToolChoice,
    ToolChoiceMode,
    ToolRequest,
)
from services.router.tools.grammar import arguments_grammar, tool_grammar

#: Most tools per request.
MAX_TOOLS = 64
#: Bytes of tool definitions a request may send per token of the model's
#: context window (:func:`tools_byte_limit`). JSON schemas and descriptions
#: take ~3-4 UTF-8 bytes a token in BPE vocabularies, so tools at the limit
#: already fill about the whole window once rendered into the prompt.
TOOLS_BYTES_PER_CONTEXT_TOKEN = 4
#: Longest accepted error text from llguidance.
_MAX_ERROR_CHARS = 300
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def tools_byte_limit(max_model_len: int) -> int:
    """The most bytes of tool definitions (:func:`tools_bytes`) a request to a
    model with a context window of ``max_model_len`` tokens may send."""
    return max_model_len * TOOLS_BYTES_PER_CONTEXT_TOKEN


def tools_bytes(chat: generation_pb2.Chat) -> int:
    """The UTF-8 bytes of ``chat``'s tool definitions: every function's name,
    description and parameters JSON (what the prompt renders)."""
    return sum(len(text.encode("utf-8", "surrogatepass")) for t in chat.tools
               for text in (t.name, t.description, t.parameters_json))


def tool_request(chat: generation_pb2.Chat, *, max_bytes: int | None = None
                 ) -> ToolRequest | None:
    """The validated tools of ``chat``, or None when it has none and no choice.

    Args:
      max_bytes: the most bytes of tool definitions (:func:`tools_bytes`;
        :func:`tools_byte_limit` of the model), checked before any schema is
        parsed or compiled; None: no limit.

    Raises:
      InvalidRequestError: too many tools or bytes of them, a bad or repeated
        name, a schema that is not JSON or that llguidance cannot compile, a
        ``tool_choice`` mode that is unknown, or that needs tools the request
        lacks, or that names an absent function.
    """
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidRequestError("chat.tools", f"at most {MAX_TOOLS} tools, got "
                                                f"{len(chat.tools)}")
    if max_bytes is not None and (size := tools_bytes(chat)) > max_bytes:
        raise InvalidRequestError("chat.tools", (
            f"the tool definitions (names, descriptions and parameter schemas) take {size} "
            f"bytes, more than this model's limit of {max_bytes} bytes "
            f"({TOOLS_BYTES_PER_CONTEXT_TOKEN} per token of its context window): they "
            "would fill the prompt; send fewer or shorter tools"))
    tools = tuple(_tool(i, pb) for i, pb in enumerate(chat.tools))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidRequestError(f"chat.tools[{i}].name",
                                      f"{tool.name!r} is given twice; names must be unique")
        seen.add(tool.name)
    if chat.tool_choice.WhichOneof("choice") == "mode" \
            and chat.tool_choice.mode not in (generation_pb2.TOOL_CHOICE_MODE_AUTO,
                                              generation_pb2.TOOL_CHOICE_MODE_NONE,
                                              generation_pb2.TOOL_CHOICE_MODE_REQUIRED):
        raise InvalidRequestError("chat.tool_choice.mode", f"unknown value "
                                  f"{chat.tool_choice.mode}; use AUTO, NONE or REQUIRED")
    choice = ToolChoice.from_pb(chat.tool_choice, has_tools=bool(tools))
    if choice.mode is ToolChoiceMode.NAMED and choice.function_name not in seen:
        raise InvalidRequestError(
            "chat.tool_choice.function_name",
            f"names {choice.function_name[:64]!r}, which is not one of the request's tools"
            + (f" ({', '.join(sorted(seen))})" if seen else " (it has none)"))
    if choice.mode is ToolChoiceMode.REQUIRED and not tools:
        raise InvalidRequestError("chat.tool_choice", "required needs at least one tool")
    if not tools and not chat.HasField("parallel_tool_calls"):
        return None
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return ToolRequest(tools, choice, parallel)


def constrain(sampling: SamplingOptions, tools: ToolRequest | None) -> SamplingOptions:
    """``sampling`` with the tool-call grammar as its output constraint.

    A request that may call tools takes no stop strings, stop token ids or
    ``min_tokens``: a stop match could cut a call's arguments mid-JSON (and
    the call would look finished), and a minimum length past the call's end
    has no valid continuation. Refused here, before any engine work.

    Raises:
      InvalidRequestError: the request also sets ``sampling.structured_output``
        (one constraint at a time), ``sampling.stop``, ``sampling.stop_token_ids``
        or ``sampling.min_tokens``, and may call tools.
    """
    grammar = tool_grammar(tools) if tools is not None else None
    if grammar is None:
        return sampling
    if sampling.structured_output is not None:
        raise InvalidRequestError(
            "sampling.structured_output", "cannot be combined with tools (their calls are "
            "constrained already); drop it or set tool_choice to none")
    for field, value, why in (
            ("stop", sampling.stop, "a stop match could cut a tool call's arguments"),
            ("stop_token_ids", sampling.stop_token_ids,
             "a stop token could cut a tool call's arguments"),
            ("min_tokens", sampling.min_tokens,
             "a tool call ends where its grammar does, not at a minimum length")):
        if value:
            raise InvalidRequestError(
                f"sampling.{field}", f"cannot be combined with tools that may be called "
                f"({why}); drop it or set tool_choice to none")
    return dataclasses.replace(
        sampling, structured_output=StructuredOutput(ConstraintKind.GRAMMAR, grammar))


def _tool(index: int, pb: generation_pb2.FunctionTool) -> FunctionTool:
    where = f"chat.tools[{index}]"
    if not _NAME.fullmatch(pb.name):
        raise InvalidRequestError(f"{where}.name", f"must be 1..64 characters of A-Z, a-z, "
                                                   f"0-9, _ and -, got {pb.name[:64]!r}")
    tool = FunctionTool.from_pb(pb)
    field = f"{where}.parameters_json"
    try:
        schema = json.loads(tool.parameters_schema)
    except ValueError as err:
        raise InvalidRequestError(field, f"is not valid JSON: {err}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(field, f"a JSON schema is an object or a boolean, got "
                                         f"{type(schema).__name__}")
    if isinstance(schema, dict) and schema.get("type", "object") != "object":
        raise InvalidRequestError(field, 'the arguments must be an object: use '
                                         '{"type": "object", "properties": ...}')
    error = llguidance.LLMatcher.validate_grammar(
        llguidance.grammar_from("lark", arguments_grammar(tool)))
    if error:
        message = error.strip()
        if len(message) > _MAX_ERROR_CHARS:
            message = message[:_MAX_ERROR_CHARS] + " …"
        raise InvalidRequestError(field, f"the grammar engine cannot compile this schema: "
                                         f"{message}")
    return tool


__all__ = ["MAX_TOOLS", "constrain", "tool_request"]
