"""The Hermes tool format: how tools, calls and results are written in a prompt,
and the exact text of a generated call.

Hermes-2-Pro / Qwen2.5 (NousResearch "Hermes-Function-Calling"; Qwen2.5's
chat template): the tools' JSON signatures inside ``<tools></tools>`` in the
system turn, each call as ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``
(several separated by ``\\n``), each result in a ``tool`` turn of its own
where the model's template renders one (ChatML), else as
``<tool_response>\\n…\\n</tool_response>`` inside a ``user`` turn (consecutive
results share one turn, as Qwen2.5 renders them; a ``user`` turn keeps
templates that accept only alternating user/assistant turns working). It is rendered as
plain chat messages before the model's own chat template is applied, so the
tokenizer service and the router's in-process tokenizer see the same messages
and give the same ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.common.wire.chat import ChatMessage
from services.common.wire.tools import FunctionTool

CALL_OPEN = "<tool_call>"
#: What follows ``<tool_call>`` up to the function name.
NAME_PREFIX = '\n{"name": "'
#: What follows the name up to the arguments object.
ARGUMENTS_PREFIX = '", "arguments": '
#: What follows the arguments object.
CALL_CLOSE = "}\n</tool_call>"
#: Between two calls of one answer.
CALL_SEPARATOR = "\n"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_CALL_HELP = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_text(name: str, arguments_json: str) -> str:
    """A call as the model writes it."""
    return f"{CALL_OPEN}{NAME_PREFIX}{name}{ARGUMENTS_PREFIX}{arguments_json}{CALL_CLOSE}"


def tools_block(tools: Sequence[FunctionTool]) -> str:
    """The system-turn text that presents ``tools``."""
    return _INSTRUCTIONS + "\n".join(json.dumps(t.as_openai()) for t in tools) + _CALL_HELP


def render(messages: Sequence[ChatMessage], tools: Sequence[FunctionTool], *,
           tool_turns: bool = False) -> tuple[ChatMessage, ...]:
    """Plain chat messages (role and content only) for the model's template.

    ``tools`` (none: no tools block) go into the first system turn (one is
    added when there is none); an assistant turn's ``tool_calls`` are appended
    to its content. ``tool`` turns stay ``tool`` turns of the result alone
    where the template renders them (``tool_turns``,
    :func:`~services.router.tools.formats.takes_tool_turns`: ChatML's
    ``<|im_start|>tool``); else they become ``<tool_response>`` blocks in a
    ``user`` turn (Gemma 3's turns must alternate). A model never trained on
    the Hermes format (SmolLM2) answers a ``tool`` turn in words, but copies
    a ``<tool_response>`` block back as its answer.
    """
    out: list[ChatMessage] = []
    if tools:
        block = tools_block(tools)
        if messages and messages[0].role == "system":
            first = messages[0].content
            out.append(ChatMessage("system", f"{first}\n\n{block}" if first else block))
            messages = messages[1:]
        else:
            out.append(ChatMessage("system", block))
    for message in messages:
        if message.role == "tool" and tool_turns:
            out.append(ChatMessage("tool", message.content))
        elif message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.startswith("<tool_response>"):
                out[-1] = ChatMessage("user", f"{out[-1].content}\n{response}")
            else:
                out.append(ChatMessage("user", response))
        elif message.tool_calls:
            calls = CALL_SEPARATOR.join(call_text(c.name, c.arguments_json)
                                        for c in message.tool_calls)
            content = f"{message.content}\n{calls}" if message.content else calls
            out.append(ChatMessage(message.role, content))
        else:
            out.append(ChatMessage(message.role, message.content))
    return tuple(out)


def needs_render(messages: Sequence[ChatMessage]) -> bool:
    """Whether any turn carries tool calls or a tool call's result (a ``tool``
    turn without ``tool_call_id`` in a request without tools is left to the
    template, as before tools existed)."""
    return any(m.tool_calls or m.tool_call_id for m in messages)


__all__ = ["ARGUMENTS_PREFIX", "CALL_CLOSE", "CALL_OPEN", "CALL_SEPARATOR", "NAME_PREFIX",
           "call_text", "needs_render", "render", "tools_block"]
