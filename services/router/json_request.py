"""``POST /v1/generate`` bodies: proto3 JSON into a ``GenerateRequest``, strictly.

Envoy's gRPC-JSON transcoder drops JSON fields the target message does not
define, and Envoy 1.40 has no option against it: ``request_validation_options``
covers unknown methods, unknown query parameters and binding collisions only
(envoyproxy/envoy#46623 asks for exactly this and was closed unanswered). So
``/v1/generate`` is bound to ``GenerateJson``, whose request is a
``google.api.HttpBody``: the transcoder forwards the raw body and this module
reads it with the proto3 JSON mapping (https://protobuf.dev/programming-guides/json/),
refusing what protobuf's own parser refuses by default
(``json_format.Parse(..., ignore_unknown_fields=False)``), with the path of the
offending field in the message:

* an unknown field (``sampling.max_token: unknown field; did you mean
  "max_tokens"? ...``), including sampling fields written at the top level
  (OpenAI's layout: the message says to put them in ``sampling``) and the
  fields the API does not have, or has under another name (``best_of``,
  ``response_format``, ``tools``...: :data:`NOT_SUPPORTED_YET` says why and
  what to do instead);
* a value of the wrong JSON type, a field given twice (``max_tokens`` and
  ``maxTokens``, or a repeated key), both members of a oneof (``prompt`` and
  ``chat``);
* a body that is empty, not UTF-8, not JSON, or not a JSON object.

Every refusal is :class:`InvalidRequestError` with INVALID_ARGUMENT (Envoy
answers HTTP 400 with ``{"code": 3, "message": "..."}``). Values are only
parsed here; their ranges are checked by :func:`validate_request` like any
gRPC request's.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from llmesh.v1 import common_pb2, generation_pb2
from services.common.sampling import InvalidRequestError

#: Names clients send (OpenAI / vLLM request fields) that llmesh does not
#: implement yet, or takes elsewhere, and what to do instead. Refused wherever
#: the message has no such field.
NOT_SUPPORTED_YET: dict[str, str] = {
    "best_of": "one completion per request is returned; set `sampling.n` for several "
               "and pick one",
    "top_logprobs": "set `sampling.logprobs` to the number of alternatives per token",
    "response_format": "set `sampling.structured_output` (json_schema, json_object, regex, "
                       "grammar or choice); OpenAI's `response_format` is taken by "
                       "/v1/chat/completions",
    "guided_json": "set `sampling.structured_output.json_schema`",
    "guided_regex": "set `sampling.structured_output.regex`",
    "guided_choice": "set `sampling.structured_output.choice`",
    "guided_grammar": "set `sampling.structured_output.grammar`",
    "tools": 'tools go inside "chat": {"chat": {"messages": [...], "tools": [...]}}',
    "tool_choice": 'the tool choice goes inside "chat": {"chat": {"toolChoice": '
                   '{"mode": "TOOL_CHOICE_MODE_REQUIRED"}}}',
    "parallel_tool_calls": 'it goes inside "chat": {"chat": {"parallelToolCalls": false}}',
    "stream": "the answer always streams: Generate sends deltas (through Envoy's "
              "JSON one array, written as they arrive); drop the field",
    "min_p": "min-p sampling is not supported yet; use `sampling.top_p` or `sampling.top_k`",
}

_EXPECTED = {
    FieldDescriptor.TYPE_STRING: "a JSON string",
    FieldDescriptor.TYPE_BOOL: "true or false",
    FieldDescriptor.TYPE_FLOAT: "a number",
    FieldDescriptor.TYPE_DOUBLE: "a number",
    FieldDescriptor.TYPE_INT32: "a 32-bit integer",
    FieldDescriptor.TYPE_SINT32: "a 32-bit integer",
    FieldDescriptor.TYPE_SFIXED32: "a 32-bit integer",
    FieldDescriptor.TYPE_UINT32: "a non-negative 32-bit integer",
    FieldDescriptor.TYPE_FIXED32: "a non-negative 32-bit integer",
    FieldDescriptor.TYPE_INT64: "a 64-bit integer",
    FieldDescriptor.TYPE_SINT64: "a 64-bit integer",
    FieldDescriptor.TYPE_SFIXED64: "a 64-bit integer",
    FieldDescriptor.TYPE_UINT64: "a non-negative 64-bit integer",
    FieldDescriptor.TYPE_FIXED64: "a non-negative 64-bit integer",
    FieldDescriptor.TYPE_BYTES: "base64 text",
}

_REQUEST = generation_pb2.GenerateRequest.DESCRIPTOR
_SAMPLING = common_pb2.SamplingParams.DESCRIPTOR
_EXAMPLE = '{"prompt": "Hello", "sampling": {"max_tokens": 16}}'


class _Object(dict):  # type: ignore[type-arg]
    """A JSON object that remembers the keys it was given more than once."""

    repeated_keys: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = []
        for key, _ in pairs:
            if key in seen:
                repeated.append(key)
            seen.add(key)
        obj.repeated_keys = tuple(repeated)
    return obj


def parse_generate_json(body: bytes) -> generation_pb2.GenerateRequest:
    """The ``GenerateRequest`` a ``POST /v1/generate`` body holds.

    Args:
      body: the raw HTTP body (``google.api.HttpBody.data``), UTF-8 JSON.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming the field (``body`` for the
        body as a whole), as listed in the module docstring.
    """
    data = _load(body)
    _check_message(data, _REQUEST, "")
    request = generation_pb2.GenerateRequest()
    try:
        json_format.ParseDict(data, request)
    except (json_format.ParseError, ValueError, TypeError) as err:  # what the checks missed
        raise InvalidRequestError("body", f"cannot be read as a GenerateRequest: {err}") from err
    return request


def _load(body: bytes) -> _Object:
    """The body as a JSON object (keys given twice remembered)."""
    if not body.strip():
        raise InvalidRequestError(
            "body", f"is empty; send a GenerateRequest as JSON, e.g. {_EXAMPLE}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequestError(
            "body", f"is not UTF-8 (bad byte at offset {err.start})") from err
    try:
        data = json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(
            "body", f"is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
        ) from err
    if not isinstance(data, dict):
        raise InvalidRequestError(
            "body", f"must be a JSON object (a GenerateRequest), got {_kind(data)}; "
                    f"e.g. {_EXAMPLE}")
    return data


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: object) -> str:
    """How a JSON value reads in a message: ``the string 'x'``, ``an array``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value if len(value) <= 40 else value[:37] + '...'!r}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _keys(descriptor: Descriptor) -> dict[str, FieldDescriptor]:
    """JSON keys a message accepts: proto field names and their lowerCamelCase forms."""
    keys = {field.name: field for field in descriptor.fields}
    keys.update({field.json_name: field for field in descriptor.fields})
    return keys


def _check_message(obj: object, descriptor: Descriptor, path: str) -> None:
    """Checks a JSON object against ``descriptor``, recursively; ``path`` names it."""
    if not isinstance(obj, dict):
        raise InvalidRequestError(
            path, f"must be a JSON object ({descriptor.name}), got {_kind(obj)}")
    repeated = getattr(obj, "repeated_keys", ())
    if repeated:
        raise InvalidRequestError(_join(path, repeated[0]), "is given more than once")
    keys = _keys(descriptor)
    seen: dict[FieldDescriptor, str] = {}
    for key, value in obj.items():
        where = _join(path, key)
        field = keys.get(key)
        if field is None:
            raise _unknown_field(where, key, descriptor)
        if field in seen:
            raise InvalidRequestError(where, f"is given twice (as {seen[field]!r} and {key!r})")
        seen[field] = key
        if value is not None:  # proto3 JSON: null means "not set"
            _check_value(value, field, where)
    _check_oneofs(obj, seen, descriptor, path)


def _check_oneofs(obj: dict[str, Any], seen: dict[FieldDescriptor, str],
                  descriptor: Descriptor, path: str) -> None:
    for oneof in descriptor.oneofs:
        given = [key for field, key in seen.items()
                 if field.containing_oneof is oneof and obj[key] is not None]
        if len(given) > 1:
            names = [f"`{f.name}`" for f in oneof.fields]
            members = ", ".join(names[:-1]) + " or " + names[-1]
            raise InvalidRequestError(
                _join(path, oneof.name), f"set only one of {members}, got {' and '.join(given)}")


def _check_value(value: object, field: FieldDescriptor, where: str) -> None:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        _check_map(value, field, where)
    elif field.is_repeated:
        if not isinstance(value, list):
            raise InvalidRequestError(where, f"must be a JSON array, got {_kind(value)}")
        for index, item in enumerate(value):
            _check_single(item, field, f"{where}[{index}]")
    else:
        _check_single(value, field, where)


def _check_map(value: object, field: FieldDescriptor, where: str) -> None:
    """A proto3 JSON map: an object whose keys and values are checked as the
    entry's ``key`` and ``value`` (``{"17": -100}`` for ``map<int32, float>``)."""
    if not isinstance(value, dict):
        raise InvalidRequestError(where, f"must be a JSON object, got {_kind(value)}")
    entry = field.message_type.fields_by_name
    for key, item in value.items():
        _check_scalar(key, entry["key"], f"{where}[{key!r}]")
        _check_single(item, entry["value"], f"{where}[{key!r}]")


#: Well-known messages whose JSON form is any JSON object (not their fields).
_FREE_OBJECTS = frozenset({"google.protobuf.Struct"})


def _check_single(value: object, field: FieldDescriptor, where: str) -> None:
    if field.message_type is not None and field.message_type.full_name in _FREE_OBJECTS:
        if not isinstance(value, dict):  # its contents are any JSON (retrieval.filter)
            raise InvalidRequestError(where, f"must be a JSON object, got {_kind(value)}")
        return
    if field.message_type is not None:
        _check_message(value, field.message_type, where)
        return
    if field.enum_type is not None:
        names = [v.name for v in field.enum_type.values]
        known = value in names if isinstance(value, str) else (
            isinstance(value, int) and not isinstance(value, bool))
        if not known:
            raise InvalidRequestError(where, f"must be one of {', '.join(names)} (or its number), "
                                             f"got {_kind(value)}")
        return
    _check_scalar(value, field, where)


def _check_scalar(value: object, field: FieldDescriptor, where: str) -> None:
    """Parses one scalar with protobuf's own JSON rules (numbers may be strings, ...)."""
    if isinstance(value, str) and not _is_unicode(value):
        raise InvalidRequestError(
            where, "must be valid Unicode text; it holds an unpaired surrogate escape "
                   "(\\ud800-\\udfff not part of a pair)")
    cls = message_factory.GetMessageClass(field.containing_type)
    single = [value] if field.is_repeated else value
    try:
        json_format.ParseDict({field.name: single}, cls())
    except (json_format.ParseError, ValueError, TypeError) as err:
        raise InvalidRequestError(
            where, f"must be {_EXPECTED.get(field.type, 'a valid value')}, got {_kind(value)}"
        ) from err


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _closest(key: str, descriptor: Descriptor) -> str | None:
    """The known key most like ``key`` (a sampling one, dotted, for the request)."""
    close = difflib.get_close_matches(key, list(_keys(descriptor)), n=1)
    if close:
        return close[0]
    if descriptor is _REQUEST:
        close = difflib.get_close_matches(key, list(_keys(_SAMPLING)), n=1)
        if close:
            return f"sampling.{close[0]}"
    return None


def _unknown_field(where: str, key: str, descriptor: Descriptor) -> InvalidRequestError:
    reason = NOT_SUPPORTED_YET.get(key)
    if reason is not None:
        return InvalidRequestError(where, f"not supported: {reason}")
    names = [field.name for field in descriptor.fields]
    if descriptor is _REQUEST and key in _keys(_SAMPLING):
        hint = f'sampling fields go inside "sampling": {{"sampling": {{"{key}": ...}}}}'
    elif descriptor is _REQUEST and key == "messages":
        hint = 'chat messages go inside "chat": {"chat": {"messages": [...]}}'
    else:
        close = _closest(key, descriptor)
        hint = f'did you mean "{close}"?' if close else ""
    known = f"{descriptor.name} has {', '.join(names)}"
    return InvalidRequestError(where, f"unknown field; {hint} ({known})" if hint
                               else f"unknown field ({known})")


__all__ = ["NOT_SUPPORTED_YET", "parse_generate_json"]
