"""The llguidance grammar that makes a request's tool calls valid by construction.

The grammar is Lark as llguidance reads it (llguidance ``docs/syntax.md``,
"Tool calling" and "Lazy lexemes"; the shape of ``llguidance.StructTag``), in
the Hermes format of :mod:`.hermes`. Each function is one alternative: its
name as a literal, then ``%json {schema}`` for its arguments (the schema
compiled by llguidance's JSON-schema compiler, with
:data:`~services.common.sampling.JSON_COMPILE_OPTIONS`):

* REQUIRED: ``start: calls`` (one call, or with ``parallel`` one or more
  separated by ``\\n``); NAMED: exactly one call of that function;
* AUTO: ``start: TEXT | trigger calls`` where ``trigger[lazy]: TEXT
  "<tool_call>"``: free text, and the first ``<tool_call>`` the model writes
  ends the text (a lazy lexeme ends at its first match) and everything after
  it is a constrained call. Text that holds ``<tool_call>`` but no valid call
  is impossible: the text-only branch cannot contain the marker either
  (checked with the real tokenizer in the tests);
* NONE: no grammar (free text).

The engine compiles the grammar as any ``structured_output.grammar``; the
router checks it first, without a tokenizer
(``LLMatcher.validate_grammar``), so a schema llguidance cannot compile is
refused at the edge.
"""

from __future__ import annotations

import json

from services.common.sampling import JSON_COMPILE_OPTIONS
from services.common.wire.tools import FunctionTool, ToolChoiceMode, ToolRequest
from services.router.tools.hermes import (
    ARGUMENTS_PREFIX,
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    NAME_PREFIX,
)


def arguments_schema(tool: FunctionTool) -> str:
    """The function's schema with the mesh's JSON compile options, as JSON text."""
    schema = json.loads(tool.parameters_schema)
    if schema is True or schema == {}:
        schema = {"type": "object"}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_COMPILE_OPTIONS}
    return json.dumps(schema)


def arguments_grammar(tool: FunctionTool) -> str:
    """A Lark grammar of one function's arguments alone (for edge checks)."""
    return f"start: %json {arguments_schema(tool)}\n"


def tool_grammar(request: ToolRequest) -> str | None:
    """The Lark grammar of the answer, or None when it is free text (NONE)."""
    if not request.may_call:
        return None
    tools = request.tools
    if request.choice.mode is ToolChoiceMode.NAMED:
        tools = tuple(t for t in tools if t.name == request.choice.function_name)
    many = request.parallel and request.choice.mode is not ToolChoiceMode.NAMED
    rules = ["%llguidance {}"]
    body = "call_body"
    more = f' ({_lit(CALL_SEPARATOR + CALL_OPEN)} {body})*' if many else ""
    if request.choice.mode is ToolChoiceMode.AUTO:
        rules += ["start: TEXT | trigger " + body + more,
                  f"trigger[lazy]: TEXT {_lit(CALL_OPEN)}",
                  r"TEXT: /(.|\n)*/"]
    else:
        rules.append(f"start: {_lit(CALL_OPEN)} {body}{more}")
    names = " | ".join(f"fn_{i}" for i in range(len(tools)))
    rules.append(f"{body}: {_lit(NAME_PREFIX)} ({names}) {_lit(CALL_CLOSE)}")
    for i, tool in enumerate(tools):
        rules.append(f"fn_{i}: {_lit(tool.name + ARGUMENTS_PREFIX)} "
                     f"%json {arguments_schema(tool)}")
    return "\n".join(rules) + "\n"


def _lit(text: str) -> str:
    return json.dumps(text)


__all__ = ["arguments_grammar", "arguments_schema", "tool_grammar"]
