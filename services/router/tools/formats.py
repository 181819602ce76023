"""The tool format each served model uses (the router's ``--tool-call-format``).

``--tool-call-format [MODEL=]FORMAT`` (repeatable; without ``MODEL=`` it is
every model's default):

* ``template``: the model's chat template renders the tools, the assistant
  turns' ``tool_calls`` and the ``tool`` turns itself: the router passes them
  to the tokenizer as structured data (``ApplyChatTemplate``'s ``tools``, and
  ``tool_calls`` / ``tool_call_id`` on each message), which gives them to the
  template as transformers' ``apply_chat_template(messages, tools=...)`` does.
  The calls the model writes are constrained and parsed in the Hermes syntax
  (``<tool_call>{"name": …, "arguments": …}</tool_call>``, :mod:`.hermes`):
  what Qwen2.5's, Hermes-2-Pro's and SmolLM3's templates teach. A template
  that teaches another call syntax needs ``hermes`` (or a new format).
* ``hermes``: the router writes tools, calls and results as plain messages in
  the Hermes format (:func:`.hermes.render`: ``<tools>`` in the system turn;
  results in a ``tool`` turn where the template takes one,
  :func:`takes_tool_turns`) before any template sees them, whatever the template.
* ``none``: tool calling off for the model (a request with ``tools`` is
  FAILED_PRECONDITION naming ``chat.tools``).
* ``auto`` (the default): ``template`` when the chat template has a tool
  section (:func:`has_tool_section`: it reads the ``tools`` variable), else
  ``hermes`` (SmolLM2's ChatML and Gemma 3's templates have none).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

import jinja2
import jinja2.meta
import jinja2.sandbox


class ToolCallFormat(enum.Enum):
    """How a model's tools, calls and results are written (see the module doc)."""

    AUTO = "auto"
    TEMPLATE = "template"
    HERMES = "hermes"
    NONE = "none"


def parse_flag(text: str) -> tuple[str, ToolCallFormat]:
    """``[MODEL=]FORMAT`` → (model, or "" for every model; format).

    Raises:
      ValueError: an unknown format.
    """
    model, sep, name = text.rpartition("=")
    try:
        return (model.strip() if sep else "", ToolCallFormat(name.strip()))
    except ValueError:
        raise ValueError(f"--tool-call-format {text!r}: expected [MODEL=]FORMAT with FORMAT "
                         f"one of {', '.join(f.value for f in ToolCallFormat)}") from None


def has_tool_section(chat_template: str | None) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable (a global
    of the template, as transformers passes it). A template Jinja cannot parse
    here (an extension tag) is searched for the word ``tools`` instead."""
    if not chat_template:
        return False
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", chat_template) is not None


#: What :func:`takes_tool_turns` renders: a ``tool`` turn after a call.
_PROBE_RESULT = "\x00tool result\x00"
_PROBE = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
          {"role": "tool", "content": _PROBE_RESULT})


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def takes_tool_turns(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders a ``tool`` turn after an
    assistant turn (ChatML's ``<|im_start|>tool``), found by rendering one as
    transformers would (sandboxed; ``raise_exception`` raises). Gemma 3's
    refuses it (its turns must alternate user/model); a template that fails
    here for any reason counts as refusing it. The Hermes format writes tool
    results in such a turn where the template takes one
    (:func:`.hermes.render`)."""
    if not chat_template:
        return False
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    try:
        text = env.from_string(chat_template).render(messages=list(_PROBE),
                                                     add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a TemplateError, or whatever the template does
        return False
    return _PROBE_RESULT in text


def resolve(formats: Mapping[str, ToolCallFormat], model: str,
            chat_template: str | None) -> ToolCallFormat:
    """The format ``model`` uses: its own flag, else the default flag, else
    ``auto``; ``auto`` is TEMPLATE when ``chat_template`` (the tokenizer's,
    None when unknown) has a tool section, else HERMES (module doc)."""
    chosen = formats.get(model, formats.get("", ToolCallFormat.AUTO))
    if chosen is not ToolCallFormat.AUTO:
        return chosen
    return ToolCallFormat.TEMPLATE if has_tool_section(chat_template) else ToolCallFormat.HERMES


__all__ = ["ToolCallFormat", "has_tool_section", "parse_flag", "resolve", "takes_tool_turns"]
