"""OpenAI request bodies into ``GenerateRequest`` protobufs, strictly.

``POST /v1/chat/completions`` and ``POST /v1/completions`` bodies (OpenAI API
reference, "Chat" and "Completions"; vLLM's extra parameters, vLLM docs
"OpenAI-Compatible Server") become the same ``llmesh.v1.GenerateRequest`` a
gRPC client sends, so that :func:`services.router.validation.validate_request`
checks every range once for both edges. This module checks only what the
proto cannot hold: JSON types, OpenAI's shapes (``stop`` as a string or a
list, ``logit_bias`` keys as strings, ``response_format``...) and fields that
have no meaning here. Output formatting is :mod:`services.router.openai_format`.

Refusals raise :class:`InvalidRequestError` (INVALID_ARGUMENT) whose ``field``
is the OpenAI parameter (``top_logprobs``, ``messages[1].content``);
:func:`openai_param` turns a field name of the shared validation
(``sampling.top_p``, ``chat.messages[0].role``) into the parameter the client
wrote, so both kinds of refusal name what the client sent.

Field mapping (OpenAI / vLLM name → ``GenerateRequest``):

* ``model`` → ``model``; ``messages`` (content: a string, or a list of
  ``{"type": "text"}`` parts, joined) → ``chat.messages``; ``prompt`` (a
  string, or a list of exactly one string) → ``prompt``; ``prompt`` as token
  ids (an array of integers, or an array holding one such array, as
  lm-evaluation-harness sends it) → ``prompt_tokens``. Several prompts and
  non-text parts (images, audio) are refused naming the field.
* ``echo: true`` (completions; :mod:`services.router.prompt_echo`): the
  choice's ``text`` and ``logprobs`` start with the prompt's; with
  ``logprobs`` the prompt's logprobs are asked of the engine
  (``sampling.prompt_logprobs``, the same count); ``max_tokens: 0`` then
  means the prompt alone (the engine computes one token, which is dropped,
  as vLLM does). With ``stream: true`` each choice's first chunk carries
  the prompt (vLLM's shape; :mod:`services.router.openai_format`).
* ``max_completion_tokens`` (chat) or ``max_tokens`` → ``sampling.max_tokens``
  (both given and different: refused); ``temperature``, ``top_p``, ``seed``,
  ``n``, ``presence_penalty``, ``frequency_penalty``, ``stop`` → the sampling
  fields of the same names; ``logit_bias`` (token id strings → bias) →
  ``sampling.logit_bias``.
* chat ``logprobs: true`` + ``top_logprobs: k`` → ``sampling.logprobs = k``
  (``k`` 0 when absent); completions ``logprobs: k`` → ``sampling.logprobs = k``.
* ``response_format``: ``text`` → nothing; ``json_object`` →
  ``structured_output.json_object``; ``json_schema`` (``json_schema.schema``)
  → ``structured_output.json_schema``.
* vLLM extras: ``top_k`` (-1 means off, as in vLLM), ``min_tokens``,
  ``repetition_penalty``, ``include_stop_str_in_output``, ``ignore_eos``,
  ``stop_token_ids``, ``prompt_logprobs``, ``structured_outputs`` (``json`` |
  ``regex`` | ``choice`` | ``grammar`` | ``json_object``) and the older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
  at most one constraint in all.
* vLLM's ``cache_salt`` (a string) → ``cache_salt``: scopes every cache of
  the request further within its tenant's scope
  (:mod:`services.common.cache_scope`).
* llmesh's ``history`` (chat): ``{"summarize": false}`` →
  ``history.summarize``: history past the model's budget is only trimmed
  (:mod:`services.router.history`).
* ``stream`` and ``stream_options.include_usage`` (its other keys are
  refused; it needs ``stream: true``, as OpenAI and vLLM require).
* Accepted and ignored: ``user`` (an end-user id for abuse tracking; the mesh's
  tenant comes from ``x-tenant-id`` / the API key),
  ``suffix: null``, ``best_of`` equal to ``n``, and ``null`` for any known
  field (unset).
* ``tools``, ``tool_choice``, ``parallel_tool_calls`` and messages'
  ``tool_calls`` / ``tool_call_id`` → the ``chat`` tool fields
  (:mod:`services.router.tools.openai`).
* llmesh's ``retrieval`` (chat only) → ``retrieval``
  (:mod:`services.router.retrieval.openai`).
* Anything else is refused naming it: the mesh never serves a request without
  what the client asked for.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmesh.v1 import common_pb2, generation_pb2

from services.common.sampling import InvalidRequestError
from services.router.tools import openai as tools
from services.router.retrieval.openai import parse_retrieval


class Endpoint(enum.Enum):
    """Which OpenAI route a body came to."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI body.

    Attributes:
      endpoint: the route.
      generate: the request for the shared pipeline (not validated yet:
        :func:`validate_request` does that).
      model: the ``model`` the client sent ("": the default), echoed back.
      stream: answer as Server-Sent Events.
      include_usage: with ``stream``: a last chunk with ``choices: []`` and usage.
      max_tokens_param: the parameter that set ``sampling.max_tokens``
        (``max_tokens`` or ``max_completion_tokens``), for error messages.
      constraint_param: the parameter that set the output constraint
        (``response_format``, ``guided_json``, ``structured_outputs.regex``...).
      echo: completions ``echo``: the prompt leads each choice's text and logprobs.
      echo_only: ``echo`` with ``max_tokens: 0``: the prompt alone (the one
        token the engine computes is dropped).
      prompt_logprobs: the client asked for ``prompt_logprobs`` itself (not
        only through ``echo``), so the response carries them.
    """

    endpoint: Endpoint
    generate: generation_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    max_tokens_param: str = "max_tokens"
    constraint_param: str = "response_format"
    echo: bool = False
    echo_only: bool = False
    prompt_logprobs: bool = False


_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
    "response_format",
    # OpenAI platform bookkeeping (stored completions): accepted and ignored
    "store", "metadata",
    # vLLM's extra parameters
    "top_k", "min_tokens", "repetition_penalty", "include_stop_str_in_output", "ignore_eos",
    "stop_token_ids", "prompt_logprobs", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "cache_salt",
})
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools",
                        "tool_choice", "parallel_tool_calls", "history", "retrieval"})
_COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})
_KNOWN = {Endpoint.CHAT: _COMMON | _CHAT_ONLY, Endpoint.COMPLETIONS: _COMMON | _COMPLETIONS_ONLY}
#: Parameters whose absence of support deserves a pointer rather than "unknown".
_UNSUPPORTED_HINTS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "min_p": "min-p sampling is not supported; use top_p or top_k",
}
#: vLLM's ``structured_outputs`` keys → ``StructuredOutput`` oneof members.
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice", "json_object": "json_object"}


def parse_request(endpoint: Endpoint, body: bytes) -> OpenAIRequest:
    """The request an OpenAI body holds.

    Args:
      endpoint: the route it came to.
      body: the raw HTTP body, UTF-8 JSON.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming the parameter (``body`` for
        the body as a whole), as listed in the module docstring.
    """
    return parse_body(endpoint, load_body(body))


def parse_body(endpoint: Endpoint, data: Mapping[str, Any]) -> OpenAIRequest:
    """:func:`parse_request` of a body already read by :func:`load_body`."""
    unknown = sorted(key for key in data if key not in _KNOWN[endpoint])
    if unknown:
        raise _unknown(endpoint, unknown)
    data = {key: value for key, value in data.items() if value is not None}
    pb = generation_pb2.GenerateRequest(model=_string(data, "model", default=""))
    if endpoint is Endpoint.CHAT:
        _chat_input(data, pb)
    else:
        _completion_input(data, pb)
    if "cache_salt" in data:  # range checked once, by the shared validation
        pb.cache_salt = _string(data, "cache_salt")
    if "retrieval" in data:
        parse_retrieval(data["retrieval"], pb.retrieval)
    if "history" in data:
        _history(data["history"], pb.history)
    stream = _bool(data, "stream")
    include_usage = _stream_options(data, stream)
    max_param = _sampling(endpoint, data, pb.sampling)
    constraint_param = _structured(data, pb.sampling.structured_output)
    asked_prompt_logprobs = pb.sampling.HasField("prompt_logprobs")
    echo = endpoint is Endpoint.COMPLETIONS and _bool(data, "echo")
    echo_only = echo and _echo(pb.sampling)
    return OpenAIRequest(endpoint, pb, pb.model, stream, include_usage, max_param,
                         constraint_param, echo, echo_only, asked_prompt_logprobs)


#: Shared-validation field → OpenAI parameter, longest prefix first.
_PARAM_PREFIXES: tuple[tuple[str, str], ...] = (
    ("sampling.structured_output", "response_format"),
    ("chat.messages", "messages"),
    ("sampling.", ""),
    ("chat", "messages"),
)


def openai_param(field: str, request: OpenAIRequest | None = None) -> str:
    """The OpenAI parameter for a field name of the shared validation.

    ``sampling.top_p`` → ``top_p``, ``chat.messages[1].role`` →
    ``messages[1].role``, ``sampling.max_tokens`` → the parameter that set it.
    """
    if field == "sampling.max_tokens" and request is not None:
        return request.max_tokens_param
    if field == "sampling.logprobs" and request is not None \
            and request.endpoint is Endpoint.CHAT:
        return "top_logprobs"
    tool_param = tools.openai_param(field)
    if tool_param is not None:
        return tool_param
    if field.startswith("sampling.structured_output") and request is not None:
        return request.constraint_param  # the parameter the client set it with
    if field.startswith("prompt_tokens"):
        return "prompt"  # token ids are the completions' prompt
    for prefix, replacement in _PARAM_PREFIXES:
        if field.startswith(prefix):
            rest = field[len(prefix):].lstrip(".")
            if not replacement:
                return rest
            return replacement + ("" if not rest or rest.startswith("[") else ".") + rest
    return field


# ---------------------------------------------------------------- reading


def load_body(body: bytes) -> dict[str, Any]:
    """The JSON object of an HTTP body.

    Raises:
      InvalidRequestError: naming ``body``: empty, not UTF-8, not JSON, not an
        object, or holding an unpaired surrogate escape.
    """
    if not body.strip():
        raise InvalidRequestError("body", "is empty; send the request as a JSON object")
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidRequestError("body", f"is not UTF-8 (bad byte at offset {err.start})") \
            from err
    except json.JSONDecodeError as err:
        raise InvalidRequestError(
            "body", f"is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from err
    if not isinstance(data, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    try:  # a lone surrogate escape ("\\ud800") parses, but no string field can hold it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            "body", "holds an unpaired surrogate escape (\\ud800-\\udfff) in a string; "
            "strings must be valid Unicode (escape a character outside the BMP as a "
            "surrogate pair)") from err
    return data


def _unknown(endpoint: Endpoint, keys: list[str]) -> InvalidRequestError:
    key = keys[0]
    hint = _UNSUPPORTED_HINTS.get(key)
    if hint is None and key in (_CHAT_ONLY | _COMPLETIONS_ONLY):
        other = "/v1/completions" if endpoint is Endpoint.CHAT else "/v1/chat/completions"
        hint = f"it belongs to {other}, not {endpoint.value}"
    names = ", ".join(repr(k) for k in keys)
    return InvalidRequestError(
        key, f"unrecognized request argument{'s' if len(keys) > 1 else ''} {names}"
        + (f": {hint}" if hint else f"; {endpoint.value} takes "
           f"{', '.join(sorted(_KNOWN[endpoint]))}"))


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)


def _string(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise InvalidRequestError(key, f"must be a string, got {_kind(value)}")
    return value


def _bool(data: Mapping[str, Any], key: str, parent: str = "") -> bool:
    """``data[key]`` (False when absent); ``parent``: the object ``data`` is
    inside, named with the field (``history.summarize``).

    Raises:
      InvalidRequestError: naming the field, when not a JSON boolean.
    """
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{parent}.{key}" if parent else key,
                                  f"must be true or false, got {_kind(value)}")
    return value


def _int(value: object, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(key, f"must be an integer, got {_kind(value)}")
    return value


def _float(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise InvalidRequestError(key, f"must be a finite number, got {_kind(value)}")
    return float(value)


def _set(target: Any, name: str, value: object, key: str) -> None:
    """Sets a protobuf field; a value the field cannot hold (an int beyond
    int32, a negative seed) is refused naming ``key``."""
    try:
        setattr(target, name, value)
    except (ValueError, TypeError) as err:
        raise InvalidRequestError(key, f"{value!r} is out of range for this field ({err})") \
            from err


def _text_content(content: object, where: str) -> str:
    """A message's content: a string, or text parts joined (OpenAI's array form)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(where, f"must be a string or an array of text parts, "
                                         f"got {_kind(content)}")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _kind(part)
            raise InvalidRequestError(f"{where}[{index}]", f"only text parts "
                                      f'({{"type": "text", "text": ...}}) are supported, '
                                      f"got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _content(message: Mapping[str, Any], role: str, where: str) -> object:
    """A message's ``content``, ``""`` for the one case OpenAI lets it be null
    or absent: an assistant message with ``tool_calls``.

    Raises:
      InvalidRequestError: null or absent anywhere else, naming ``messages[i].content``.
    """
    content = message.get("content")
    if content is not None:
        return content
    if role == "assistant" and message.get("tool_calls"):
        return ""
    raise InvalidRequestError(f"{where}.content", "is required (null only in an assistant "
                                                  "message with tool_calls)")


def _chat_input(data: Mapping[str, Any], pb: generation_pb2.GenerateRequest) -> None:
    if "prompt" in data:
        raise InvalidRequestError("prompt", "chat completions take `messages`; send `prompt` "
                                            "to /v1/completions")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError("messages", f"must be an array of messages, got "
                                              f"{_kind(messages) if messages is not None else 'nothing'}")
    pb.chat.SetInParent()
    tools.parse_tools(data, pb.chat)
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(where, f"must be an object, got {_kind(message)}")
        extra = sorted(set(message) - {"role", "content", "name"} - tools.MESSAGE_KEYS)
        if extra:
            raise InvalidRequestError(f"{where}.{extra[0]}", "is not supported (messages take "
                                      "role, content, tool_calls and tool_call_id)")
        if message.get("name") is not None:
            raise InvalidRequestError(f"{where}.name", "participant names are not supported "
                                                       "by the chat template; leave it unset")
        role = _string(message, "role", default="") if "role" in message else ""
        if role == "developer":  # OpenAI's newer name for the system turn
            role = "system"
        content = _text_content(_content(message, role, where), f"{where}.content")
        tools.parse_message_tools(message, where, pb.chat.messages.add(role=role,
                                                                       content=content))


def _completion_input(data: Mapping[str, Any], pb: generation_pb2.GenerateRequest) -> None:
    if "messages" in data:
        raise InvalidRequestError("messages", "completions take `prompt`; send `messages` to "
                                              "/v1/chat/completions")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if _token_ids(prompt):
        assert isinstance(prompt, list)
        pb.prompt_tokens.SetInParent()  # an empty list: refused by the shared validation
        for token_id in prompt:
            try:
                pb.prompt_tokens.token_ids.append(_int(token_id, "prompt"))
            except ValueError as err:
                if isinstance(err, InvalidRequestError):
                    raise
                raise InvalidRequestError("prompt", f"token id {token_id!r} is out of range") \
                    from err
    elif isinstance(prompt, list):
        raise InvalidRequestError(
            "prompt", "one prompt per request, a string or an array of token ids: a list "
            "of several prompts (or of strings and ids mixed) is not supported; send one "
            "request per prompt")
    elif isinstance(prompt, str):
        pb.prompt = prompt
    else:
        raise InvalidRequestError("prompt", f"must be a string or an array of token ids, got "
                                            f"{_kind(prompt) if prompt is not None else 'nothing'}")
    if data.get("suffix") not in (None, ""):
        raise InvalidRequestError("suffix", "suffixes (fill-in-the-middle) are not supported")
    if "best_of" in data:
        best_of, n = _int(data["best_of"], "best_of"), _int(data.get("n", 1), "n")
        if best_of != n:
            raise InvalidRequestError("best_of", f"must equal n ({n}): choosing the best of "
                                                 "several samples is not supported")


def _token_ids(prompt: object) -> bool:
    """Whether ``prompt`` is an array of token ids (integers; JSON has no other
    way to spell them), as opposed to text or a batch of prompts."""
    return isinstance(prompt, list) and all(
        isinstance(i, (int, float)) and not isinstance(i, bool) for i in prompt)


def _echo(sampling: common_pb2.SamplingParams) -> bool:
    """Sets what ``echo: true`` needs on ``sampling``; returns whether it is
    ``max_tokens: 0`` (the prompt alone, vLLM's ``echo_without_generation``)."""
    if sampling.HasField("logprobs") and not sampling.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = sampling.logprobs  # the prompt's tokens as the choice's
    only = sampling.HasField("max_tokens") and sampling.max_tokens == 0
    if only:
        sampling.max_tokens = 1  # one forward pass computes the prompt's logprobs
    return only


def _history(options: Any, history: generation_pb2.HistoryOptions) -> None:
    """llmesh's ``history`` object (``summarize`` only)."""
    if not isinstance(options, dict):
        raise InvalidRequestError("history", f"must be an object, got {_kind(options)}")
    extra = sorted(set(options) - {"summarize"})
    if extra:
        raise InvalidRequestError(f"history.{extra[0]}", "is not supported (only summarize is)")
    if options.get("summarize") is not None:
        history.summarize = _bool(options, "summarize", "history")


def _stream_options(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options", "is allowed only with stream: true")
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", f"must be an object, got {_kind(options)}")
    extra = sorted(set(options) - {"include_usage"})
    if extra:
        raise InvalidRequestError(f"stream_options.{extra[0]}", "is not supported "
                                                                "(only include_usage is)")
    if "include_usage" not in options:
        return False
    return _bool(options, "include_usage", "stream_options")


# ---------------------------------------------------------------- sampling


def _sampling(endpoint: Endpoint, data: Mapping[str, Any],
              sampling: common_pb2.SamplingParams) -> str:
    """Fills ``sampling`` from the body; returns the parameter that set max_tokens."""
    max_param = _max_tokens(data, sampling)
    floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")
    for key in floats:
        if key in data:
            _set(sampling, key, _float(data[key], key), key)
    for key in ("n", "min_tokens", "prompt_logprobs"):
        if key in data:
            _set(sampling, key, _int(data[key], key), key)
    if "seed" in data:
        seed = _int(data["seed"], "seed")
        if seed < 0:
            raise InvalidRequestError("seed", f"must be >= 0, got {seed}")
        _set(sampling, "seed", seed, "seed")
    if "top_k" in data:
        top_k = _int(data["top_k"], "top_k")
        _set(sampling, "top_k", 0 if top_k == -1 else top_k, "top_k")  # vLLM: -1 is off
    for key in ("ignore_eos", "include_stop_str_in_output"):
        if key in data:
            setattr(sampling, key, _bool(data, key))
    _stop(data, sampling)
    _logit_bias(data, sampling)
    _logprobs(endpoint, data, sampling)
    return max_param


def _max_tokens(data: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> str:
    given = {key: _int(data[key], key) for key in ("max_completion_tokens", "max_tokens")
             if key in data}
    if len(set(given.values())) > 1:
        raise InvalidRequestError("max_completion_tokens", "differs from max_tokens; send "
                                  "only max_completion_tokens (max_tokens is its old name)")
    if not given:
        return "max_tokens"
    key, value = next(iter(given.items()))
    _set(sampling, "max_tokens", value, key)
    return key


def _stop(data: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    stop = data.get("stop")
    if stop is None:
        pass
    elif isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sampling.stop.extend(stop)
    else:
        raise InvalidRequestError("stop", f"must be a string or an array of strings, "
                                          f"got {_kind(stop)}")
    ids = data.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise InvalidRequestError("stop_token_ids", f"must be an array of token ids, "
                                                        f"got {_kind(ids)}")
        for token_id in ids:
            try:
                sampling.stop_token_ids.append(_int(token_id, "stop_token_ids"))
            except ValueError as err:
                raise InvalidRequestError("stop_token_ids", f"{token_id!r} is out of range") \
                    from err


_TOKEN_ID = re.compile(r"-?[0-9]{1,10}")


def _logit_bias(data: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    bias = data.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", f"must be an object mapping token ids to "
                                                f"biases, got {_kind(bias)}")
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError("logit_bias", f"keys are token ids as strings "
                                                    f"(\"1234\"), got {key[:40]!r}")
        try:
            sampling.logit_bias[int(key)] = _float(value, "logit_bias")
        except ValueError as err:
            if isinstance(err, InvalidRequestError):
                raise
            raise InvalidRequestError("logit_bias", f"token id {key} is out of range") from err


def _logprobs(endpoint: Endpoint, data: Mapping[str, Any],
              sampling: common_pb2.SamplingParams) -> None:
    if endpoint is Endpoint.COMPLETIONS:
        if "logprobs" in data:
            _set(sampling, "logprobs", _int(data["logprobs"], "logprobs"), "logprobs")
        return
    wanted = _bool(data, "logprobs")
    if "top_logprobs" in data:
        top = _int(data["top_logprobs"], "top_logprobs")
        if not wanted:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        _set(sampling, "logprobs", top, "top_logprobs")
    elif wanted:
        sampling.logprobs = 0


def _structured(data: Mapping[str, Any], out: common_pb2.StructuredOutput) -> str:
    """At most one constraint from ``response_format``, ``structured_outputs``
    and the ``guided_*`` parameters; returns the parameter that set it
    (``response_format`` when none did)."""
    setters: list[tuple[str, Callable[[], None]]] = []
    fmt = data.get("response_format")
    if fmt is not None:
        setters += _response_format(fmt, out)
    so = data.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs", f"must be an object, "
                                                            f"got {_kind(so)}")
        for key, value in so.items():
            if value is None or value is False:
                continue
            if key not in _STRUCTURED_KEYS:
                raise InvalidRequestError(
                    f"structured_outputs.{key}", f"is not supported; use one of "
                    f"{', '.join(sorted(_STRUCTURED_KEYS))}")
            setters.append((f"structured_outputs.{key}",
                            _constraint_setter(_STRUCTURED_KEYS[key], value,
                                               f"structured_outputs.{key}", out)))
    for key, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                      ("guided_grammar", "grammar"), ("guided_choice", "choice")):
        if key in data:
            setters.append((key, _constraint_setter(kind, data[key], key, out)))
    if len(setters) > 1:
        names = " and ".join(name for name, _ in setters)
        raise InvalidRequestError(setters[1][0], f"set only one output constraint, got {names}")
    for _, apply in setters:
        apply()
    return setters[0][0] if setters else "response_format"


def _response_format(fmt: object, out: common_pb2.StructuredOutput
                     ) -> list[tuple[str, Callable[[], None]]]:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError("response_format", 'must be an object with a "type" '
                                  '("text", "json_object" or "json_schema")')
    kind = fmt["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", _constraint_setter("json_object", True,
                                                       "response_format", out))]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format.json_schema", 'must be an object with '
                                      'a "schema" (and a "name")')
        return [("response_format", _constraint_setter(
            "json_schema", spec["schema"], "response_format.json_schema.schema", out))]
    raise InvalidRequestError("response_format.type", f'must be "text", "json_object" or '
                                                      f'"json_schema", got {kind[:40]!r}')


def _constraint_setter(kind: str, value: object, key: str,
                       out: common_pb2.StructuredOutput) -> Callable[[], None]:
    """Checks ``value``'s JSON type for ``kind``; returns what sets it on ``out``."""
    if kind == "json_schema":
        if isinstance(value, str):
            text = value
        elif isinstance(value, (dict, bool)):
            text = json.dumps(value)
        else:
            raise InvalidRequestError(key, f"must be a JSON schema (an object), "
                                           f"got {_kind(value)}")
        return lambda: setattr(out, "json_schema", text)
    if kind == "json_object":
        return lambda: setattr(out, "json_object", True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(key, f"must be an array of strings, got {_kind(value)}")
        return lambda: out.choice.choices.extend(value)
    if not isinstance(value, str):
        raise InvalidRequestError(key, f"must be a string, got {_kind(value)}")
    return lambda: setattr(out, kind, value)


__all__ = ["Endpoint", "OpenAIRequest", "openai_param", "parse_request"]
