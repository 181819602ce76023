"""Validation of the public ``GenerateRequest`` into a typed request.

Every bad field raises :class:`InvalidRequestError` (from
``services.common.sampling``) whose message starts with the field's name as the
client wrote it (``prompt``, ``chat.messages[2].role``, ``sampling.top_p``)
and says what is allowed. Codes:

* INVALID_ARGUMENT: a malformed or missing value.
* OUT_OF_RANGE: a value beyond a limit: ``sampling.max_tokens`` above the
  server cap, or a prompt that leaves no room in the context window.
* INVALID_ARGUMENT also for an unknown ``model``; the message lists the
  known model ids. (generation.proto's comment still says NOT_FOUND; the
  mesh's tests and brief say INVALID_ARGUMENT: one constant,
  :data:`UNKNOWN_MODEL_CODE`, decides.)
* FAILED_PRECONDITION: ``chat`` input to a model without a chat template (a
  base model): the request is well formed, the model cannot take it.

Unknown fields: a request carrying field numbers this router's proto does not
have (a client built from a newer ``llmesh.v1``) is INVALID_ARGUMENT naming the
message and the numbers, rather than served without what the client asked
for (:func:`reject_unknown_fields`). JSON bodies are parsed as strictly by
:mod:`services.router.json_request`.

Validation runs in two steps: :func:`validate_request` checks what can be
checked on the request alone; :func:`fit_to_context` checks the prompt's token
count once the tokenizer has produced it.

Context window policy: ``max_tokens`` (explicit or the server default) is
*clamped* to the room the prompt leaves (``max_model_len - prompt_tokens``),
as vLLM does when no explicit limit is given; such a generation ends with
FINISH_REASON_LENGTH when the window is full. Only a prompt that leaves no
room for even one generated token is refused (OUT_OF_RANGE).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from llmesh.v1 import common_pb2, generation_pb2
from services.common.cache_scope import check_salt, owner, resolve
from services.common.detokenizer import first_out_of_range
from services.common.sampling import (
    InvalidRequestError,
    Priority,
    SamplingOptions,
    SpeculativeOptions,
)
from services.common.wire.chat import ChatMessage
from services.common.wire.tools import FunctionTool, ToolRequest
from services.router.cascade.policy import CascadeLeg
from services.router.retrieval.spec import RetrievalSpec, retrieval_spec
from services.router.tools.formats import ToolCallFormat
from services.router.tools.hermes import needs_render, render
from services.router.tools.validate import constrain, tool_request, tools_byte_limit

#: Most characters in a caller-chosen request id (it travels as gRPC metadata).
MAX_REQUEST_ID_LENGTH = 128
#: Most stop strings per request.
MAX_STOP_STRINGS = 16
#: Most characters in one stop string (held-back text is at most this long).
MAX_STOP_STRING_LENGTH = 256
#: Status for an unknown model id.
UNKNOWN_MODEL_CODE = grpc.StatusCode.INVALID_ARGUMENT
#: Upper bound of the UTF-8 bytes one token covers in the supported tokenizers
#: (SmolLM2's longest token is 81 bytes): text longer than
#: ``max_model_len * MAX_BYTES_PER_TOKEN`` bytes cannot fit and is refused untokenized.
MAX_BYTES_PER_TOKEN = 128
#: A chat history may hold this many context windows of text (oldest turns are dropped).
MAX_HISTORY_WINDOWS = 4
#: A chat role is a plain name: no spaces, no template markup such as ``<|im_end|>``.
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")

_KNOWN_PRIORITIES = (
    common_pb2.PRIORITY_UNSPECIFIED, common_pb2.PRIORITY_INTERACTIVE, common_pb2.PRIORITY_BATCH,
)


@dataclass(frozen=True)
class ModelLimits:
    """What the router serves for one model id.

    Attributes:
      model: model id as listed by ListModels.
      max_model_len: context window in tokens (prompt + completion).
      vocab_size: vocabulary size (token ids must be below it), or None if unknown.
      has_chat_template: whether chat input is accepted.
      default_max_tokens: completion tokens when the request sets none.
      max_tokens_cap: most completion tokens a request may ask for.
      eos_token_ids: the model's end-of-sequence ids (their text is never returned).
      chat_roles: the message roles the chat template accepts (from the
        tokenizer); empty: not advertised, any plain name passes here and the
        tokenizer decides.
      tool_call_format: how tools are rendered and called
        (:mod:`services.router.tools.formats`, resolved: TEMPLATE, HERMES or NONE).
      tool_turns: the chat template renders a ``tool`` turn after an assistant
        turn (:func:`~services.router.tools.formats.takes_tool_turns`) and the
        tokenizer accepts the role: the Hermes format writes tool results there
        (:func:`~services.router.tools.hermes.render`).
    """

    model: str
    max_model_len: int
    vocab_size: int | None
    has_chat_template: bool
    default_max_tokens: int
    max_tokens_cap: int
    eos_token_ids: tuple[int, ...] = ()
    chat_roles: tuple[str, ...] = ()
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES
    tool_turns: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request.

    Exactly one of ``prompt``, ``messages`` and ``prompt_token_ids`` (ids
    checked against the vocabulary, sent to the engine as they are) is set.
    ``sampling.max_tokens``
    is the requested (or default) count, before clamping to the context window.
    ``bypass_cache``: skip the response-cache lookup (a fresh answer is still
    stored). ``speculative``: the engine's speculative decoding switch, passed
    through (it changes speed, not greedy or seeded output, so it is not part
    of the response-cache key). ``allow_special_tokens``: special-token text in
    chat contents becomes control tokens (``Chat.allow_special_tokens``); it
    changes the prompt ids, which the cache key holds. ``tenant``: the
    key's tenant, or without keys the ``x-tenant-id`` metadata ("" without
    one), for admission fairness. ``cache_scope``: the scope of every cache
    the request reads or fills (:mod:`services.common.cache_scope`: tenant or
    cache group, and the request's ``cache_salt``; "" the shared scope).
    ``traceparent``/``tracestate``: the client's W3C trace context (gRPC
    metadata or HTTP headers; "" none), the parent of the request's spans
    (:mod:`services.router.request_trace`); a malformed one is ignored.
    ``tools``: the chat's validated tools (:mod:`services.router.tools`), None
    without; when the model may call them, their grammar is
    ``sampling.structured_output``. In the ``hermes`` tool format they are
    already rendered into ``messages``; in the ``template`` format they are
    ``chat_tools``, which the chat template renders (with the messages'
    ``tool_calls`` and ``tool_call_id``). ``cascade``: set on a request to the
    cascade alias (:mod:`services.router.cascade`; ``model`` is then the leg's
    model), None otherwise. ``retrieval``: the passages to retrieve and insert
    (:mod:`services.router.retrieval`), None without.
    ``summarize_history``: ``history.summarize`` (None unset: the router's
    setting; :mod:`services.router.history`). ``history_exempt``: a request
    the router makes itself (a history summary), bound by the context window
    only.
    """

    request_id: str
    model: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    sampling: SamplingOptions
    priority: Priority
    bypass_cache: bool = False
    speculative: SpeculativeOptions = SpeculativeOptions()
    allow_special_tokens: bool = False
    tenant: str = ""
    cache_scope: str = ""
    traceparent: str = ""
    tracestate: str = ""
    prompt_token_ids: tuple[int, ...] | None = None
    tools: ToolRequest | None = None
    chat_tools: tuple[FunctionTool, ...] = ()
    cascade: CascadeLeg | None = None
    retrieval: RetrievalSpec | None = None
    summarize_history: bool | None = None
    history_exempt: bool = False

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def input_field(self) -> str:
        """Field name to blame for the prompt's length (``prompt``,
        ``chat.messages`` or ``prompt_tokens.token_ids``)."""
        if self.prompt_token_ids is not None:
            return PROMPT_TOKENS_FIELD
        return "chat.messages" if self.is_chat else "prompt"


#: Metadata naming the tenant whose fair share a request draws on (admission).
TENANT_METADATA_KEY = "x-tenant-id"


def validate_request_id(request_id: str, field: str = "request_id") -> None:
    """A request id is 1..128 printable ASCII characters (it becomes metadata).

    Args:
      request_id: the id to check.
      field: where it came from, for the message: ``request_id`` (the request
        field) or ``x-request-id`` (the header / gRPC metadata).

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``field`` and the limit.
    """
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequestError(
            field, f"must be at most {MAX_REQUEST_ID_LENGTH} characters, "
            f"got {len(request_id)}")
    if not (request_id.isascii() and request_id.isprintable()):  # 0x20..0x7e
        raise InvalidRequestError(
            field, "must be printable ASCII (characters 0x20..0x7e)")


def reject_unknown_fields(message: Message, path: str = "") -> None:
    """Refuses a message, or any message inside it, that holds unknown field numbers.

    protobuf keeps the fields of a newer schema as "unknown fields" when it
    parses a message (https://protobuf.dev/programming-guides/proto3/#unknowns);
    serving such a request would silently ignore what the client asked for.

    Args:
      message: the request (or a part of it).
      path: its field path from the request (``sampling``, ``chat.messages[1]``);
        "" for the request itself.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming the message (``request`` for
        the request itself) and the unknown field numbers.
    """
    numbers = sorted({f.field_number for f in UnknownFieldSet(message)})
    if numbers:
        plural = "s" if len(numbers) > 1 else ""
        raise InvalidRequestError(
            path or "request",
            f"unknown field number{plural} {', '.join(map(str, numbers))}: "
            f"{message.DESCRIPTOR.full_name} on this server has no such field{plural} "
            "(a client built from a newer llmesh.v1 proto?); leave them unset or upgrade the mesh")
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:  # a map: its values, if messages
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    reject_unknown_fields(item, f"{name}[{key!r}]")
        elif field.is_repeated:
            for index, item in enumerate(value):
                reject_unknown_fields(item, f"{name}[{index}]")
        else:
            reject_unknown_fields(value, name)


def resolve_model(name: str, models: Mapping[str, ModelLimits], default: str) -> ModelLimits:
    """The model a request names ("" means ``default``).

    Raises:
      InvalidRequestError: :data:`UNKNOWN_MODEL_CODE` naming ``model`` and listing
        the known ids.
    """
    limits = models.get(name or default)
    if limits is None:
        known = ", ".join(repr(m) for m in sorted(models))
        raise InvalidRequestError(
            "model", f"unknown model {name!r}; this mesh serves {known} "
            "(or leave it empty for the default)", UNKNOWN_MODEL_CODE)
    return limits


def _check_text_size(field: str, text: str, limits: ModelLimits) -> None:
    """Refuses text that cannot fit the context window before anyone tokenizes it.

    No token of a supported tokenizer spans more than :data:`MAX_BYTES_PER_TOKEN`
    bytes, so longer text is more than ``max_model_len`` tokens for sure.
    """
    limit = limits.max_model_len * MAX_BYTES_PER_TOKEN
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise InvalidRequestError(
            field, f"{size} bytes of text cannot fit the model's context window of "
            f"{limits.max_model_len} tokens (at most {limit} bytes are even tokenized); "
            "shorten it", grpc.StatusCode.OUT_OF_RANGE)


def _validate_messages(chat: generation_pb2.Chat, limits: ModelLimits,
                       tools: ToolRequest | None) -> tuple[ChatMessage, ...]:
    """The chat's turns, checked; in the ``hermes`` tool format, tools and tool
    turns rendered as plain messages (:mod:`services.router.tools.hermes`);
    in the ``template`` format left to the chat template."""
    if not limits.has_chat_template:
        raise InvalidRequestError(
            "chat", f"model {limits.model!r} has no chat template; send `prompt` text instead",
            grpc.StatusCode.FAILED_PRECONDITION)
    if not chat.messages:
        raise InvalidRequestError(
            "chat.messages", "must hold at least one message (role and content)")
    messages = tuple(ChatMessage.from_pb(m) for m in chat.messages)
    rendered = limits.tool_call_format is not ToolCallFormat.TEMPLATE and (
        tools is not None or needs_render(messages))
    for i, message in enumerate(chat.messages):
        if not (rendered and message.role == "tool"):  # rendered: a user turn
            _validate_role(i, message.role, limits)
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(f"chat.messages[{i}].tool_calls",
                                      "only an assistant turn holds tool calls")
    _check_tool_turns(chat.messages)
    # The oldest turns may be dropped to fit, but never the last one.
    _check_text_size(f"chat.messages[{len(chat.messages) - 1}].content",
                     chat.messages[-1].content, limits)
    total = sum(len(m.content) for m in chat.messages)
    if total > MAX_HISTORY_WINDOWS * limits.max_model_len * MAX_BYTES_PER_TOKEN:
        raise InvalidRequestError(
            "chat.messages", f"the conversation holds {total} characters, more than "
            f"{MAX_HISTORY_WINDOWS} context windows' worth; send only recent turns",
            grpc.StatusCode.OUT_OF_RANGE)
    if rendered:
        return render(messages, tools.tools if tools is not None else (),
                      tool_turns=limits.tool_turns)
    return messages


def _check_tool_turns(messages: Sequence[generation_pb2.ChatMessage]) -> None:
    """A conversation's calls and results agree (OpenAI refuses the same): each
    assistant call's ``arguments`` is a JSON object, and a ``tool`` turn that
    names a ``tool_call_id`` answers a call made earlier in the conversation.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming
        ``chat.messages[i].tool_calls[j].arguments`` or
        ``chat.messages[i].tool_call_id``.
    """
    called: set[str] = set()
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidRequestError(
                    f"chat.messages[{i}].tool_calls[{j}].arguments",
                    "must be a JSON object (the arguments the call was made with)")
            called.add(call.id)
        if message.role == "tool" and message.tool_call_id \
                and message.tool_call_id not in called:
            raise InvalidRequestError(
                f"chat.messages[{i}].tool_call_id",
                f"{message.tool_call_id[:64]!r} answers no call of an earlier assistant "
                "turn; a tool result follows the assistant turn whose tool_calls made it")


def _validate_role(i: int, role: str, limits: ModelLimits) -> None:
    """A role is one the model's chat template accepts (``limits.chat_roles``,
    when the tokenizer lists them), and in any case a plain name."""
    if limits.chat_roles and role not in limits.chat_roles:
        allowed = ", ".join(f'"{r}"' for r in limits.chat_roles)
        raise InvalidRequestError(
            f"chat.messages[{i}].role",
            f"must be one of {allowed} (the roles the chat template of model "
            f"{limits.model!r} accepts), got {role[:40]!r}")
    if not _ROLE.fullmatch(role):
        raise InvalidRequestError(
            f"chat.messages[{i}].role",
            f"must be a plain name such as \"system\", \"user\" or \"assistant\" "
            f"(letters, digits, '_' or '-', at most 32), got {role[:40]!r}")


def _validate_stops(sampling: common_pb2.SamplingParams) -> None:
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop)}")
    for stop in sampling.stop:
        if len(stop) > MAX_STOP_STRING_LENGTH:
            raise InvalidRequestError(
                "sampling.stop", f"each stop string must be at most {MAX_STOP_STRING_LENGTH} "
                f"characters, got one of {len(stop)}")


#: The field of a prompt given as token ids (``GenerateRequest.prompt_tokens``).
PROMPT_TOKENS_FIELD = "prompt_tokens.token_ids"


def check_prompt_token_ids(token_ids: Sequence[int], limits: ModelLimits,
                           field: str = PROMPT_TOKENS_FIELD) -> tuple[int, ...]:
    """Prompt ids a caller wrote: at least one, each in ``[0, vocab_size)``
    (when the vocabulary size is known). The context window is checked once
    the request is fitted (:func:`fit_to_context`), as for a tokenized prompt.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``field``.
    """
    if not token_ids:
        raise InvalidRequestError(field, "must hold at least one token id")
    if limits.vocab_size is not None:
        bad = first_out_of_range(token_ids, limits.vocab_size)
        if bad is not None:
            raise InvalidRequestError(
                field, f"token id {bad} is not in the vocabulary of {limits.model!r} "
                f"(ids 0..{limits.vocab_size - 1})")
    return tuple(token_ids)


def _validate_input(pb: generation_pb2.GenerateRequest, limits: ModelLimits,
                    tools: ToolRequest | None = None,
                    ) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """The request's text input: ``(prompt, None)``, ``(None, messages)``, or
    ``(None, None)`` for prompt token ids (:func:`check_prompt_token_ids`).

    Raises:
      InvalidRequestError: none is set, an empty prompt, or a text or
        message over the limits.
    """
    which = pb.WhichOneof("input")
    if which is None:
        raise InvalidRequestError(
            "input", "set exactly one of `prompt` (raw text), `chat` (messages) or "
            "`prompt_tokens` (token ids)")
    if which == "prompt_tokens":
        return None, None
    if which == "prompt":
        if not pb.prompt:
            raise InvalidRequestError("prompt", "must be non-empty text")
        _check_text_size("prompt", pb.prompt, limits)
        return pb.prompt, None
    return None, _validate_messages(pb.chat, limits, tools)


def _validate_tools(pb: generation_pb2.GenerateRequest,
                    limits: ModelLimits) -> ToolRequest | None:
    """The chat's tools and tool choice (None for a prompt).

    Raises:
      InvalidRequestError: FAILED_PRECONDITION naming ``chat.tools`` where the
        model is served with ``--tool-call-format MODEL=none``; INVALID_ARGUMENT
        for a bad tool, or tools over the model's byte limit (:func:`tool_request`,
        :func:`tools_byte_limit`).
    """
    tools = (tool_request(pb.chat, max_bytes=tools_byte_limit(limits.max_model_len))
             if pb.WhichOneof("input") == "chat" else None)
    if tools is not None and tools.tools and limits.tool_call_format is ToolCallFormat.NONE:
        raise InvalidRequestError(
            "chat.tools", f"model {limits.model!r} is served without tool calling "
            f"(the router's --tool-call-format {limits.model}=none)",
            grpc.StatusCode.FAILED_PRECONDITION)
    return tools


def validate_request(
    pb: generation_pb2.GenerateRequest, *, request_id: str,
    models: Mapping[str, ModelLimits], default_model: str,
    header_request_id: str | None = None, header_tenant: str | None = None,
    cache_group: str = "", traceparent: str = "", tracestate: str = "",
) -> GenerationRequest:
    """Validates every field of ``pb`` that needs no tokenizer.

    Args:
      request_id: the id to use (from ``pb.request_id``, metadata or new); it is
        checked only when the client set ``pb.request_id``.
      models: the served models by id.
      default_model: the id used when ``pb.model`` is empty.
      header_request_id: the call's ``x-request-id`` metadata, if it has one
        (Envoy sets it on every call); checked like ``request_id``.
      header_tenant: the call's ``x-tenant-id`` metadata, if any: the tenant
        whose fair share the request draws on; 1..128 printable ASCII.
      cache_group: the cache group the tenant's key-file entry opts into (""
        none): it owns the request's cache scope instead of the tenant.
      traceparent, tracestate: the call's W3C trace context, kept as given.

    Raises:
      InvalidRequestError: the first bad field, with its gRPC code.
    """
    if header_request_id is not None:
        validate_request_id(header_request_id, field="x-request-id")
    if header_tenant is not None:
        validate_request_id(header_tenant, field=TENANT_METADATA_KEY)
    reject_unknown_fields(pb)
    if pb.request_id:
        validate_request_id(pb.request_id)
    limits = resolve_model(pb.model, models, default_model)
    tools = _validate_tools(pb, limits)
    prompt, messages = _validate_input(pb, limits, tools)
    token_ids = (check_prompt_token_ids(pb.prompt_tokens.token_ids, limits)
                 if pb.HasField("prompt_tokens") else None)
    _validate_stops(pb.sampling)
    sampling = constrain(_sampling_of(pb.sampling, limits), tools)
    if pb.priority not in _KNOWN_PRIORITIES:
        raise InvalidRequestError(
            "priority", f"unknown value {pb.priority}; use PRIORITY_INTERACTIVE (1) or "
            "PRIORITY_BATCH (2)")
    speculative = SpeculativeOptions.from_pb(pb.speculative)
    salt = check_salt(pb.cache_salt) if pb.HasField("cache_salt") else ""
    return GenerationRequest(
        request_id=request_id, model=limits.model, prompt=prompt, messages=messages,
        sampling=sampling, priority=Priority.from_pb(pb.priority),
        bypass_cache=pb.bypass_cache, speculative=speculative,
        allow_special_tokens=messages is not None and pb.chat.allow_special_tokens,
        tenant=header_tenant or "",
        cache_scope=resolve(owner(header_tenant or "", cache_group), salt),
        prompt_token_ids=token_ids,
        tools=tools,
        chat_tools=(tools.tools if tools is not None and messages is not None
                    and limits.tool_call_format is ToolCallFormat.TEMPLATE else ()),
        retrieval=retrieval_spec(pb, messages),
        summarize_history=_summarize_history(pb),
        traceparent=traceparent, tracestate=tracestate,
    )


#: Serialized ``SamplingParams`` up to this size are remembered (:func:`_sampling_of`);
#: larger ones (long stop lists, JSON schemas) are converted each time.
_REMEMBERED_SAMPLING_BYTES = 512


def _sampling_of(pb: common_pb2.SamplingParams, limits: ModelLimits) -> SamplingOptions:
    """:meth:`SamplingOptions.from_pb` of ``pb`` (no unknown fields: checked
    before) with the model's limits, remembered when small: clients send the
    same few settings again and again, and the conversion with its checks
    cost ~10 us warm (several times that in a cold request) on the first
    token's path. The options are immutable, so requests share them; a
    refusal is not remembered (it raises again).

    Raises:
      InvalidRequestError: as :meth:`SamplingOptions.from_pb`.
    """
    data = pb.SerializeToString(deterministic=True)
    if len(data) > _REMEMBERED_SAMPLING_BYTES:
        return SamplingOptions.from_pb(pb, default_max_tokens=limits.default_max_tokens,
                                       max_tokens_cap=limits.max_tokens_cap,
                                       vocab_size=limits.vocab_size)
    return _remembered_sampling(data, limits.default_max_tokens, limits.max_tokens_cap,
                                limits.vocab_size)


@functools.lru_cache(maxsize=512)
def _remembered_sampling(data: bytes, default_max_tokens: int, max_tokens_cap: int,
                         vocab_size: int | None) -> SamplingOptions:
    return SamplingOptions.from_pb(
        common_pb2.SamplingParams.FromString(data), default_max_tokens=default_max_tokens,
        max_tokens_cap=max_tokens_cap, vocab_size=vocab_size)


def _summarize_history(pb: generation_pb2.GenerateRequest) -> bool | None:
    """``history.summarize``; None when unset (the router's setting)."""
    return pb.history.summarize if pb.history.HasField("summarize") else None


def fit_to_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, *,
                   field: str) -> int:
    """The completion budget once the prompt is tokenized.

    Args:
      num_prompt_tokens: tokens in the prompt (template applied).
      max_tokens: requested completion tokens.
      max_model_len: context window in tokens.
      field: the input field to blame (:attr:`GenerationRequest.input_field`).

    Returns:
      ``min(max_tokens, max_model_len - num_prompt_tokens)``: at least 1.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT when the prompt has no tokens;
        OUT_OF_RANGE when ``num_prompt_tokens + 1 > max_model_len``.
    """
    if num_prompt_tokens == 0:
        raise InvalidRequestError(field, "the input produced no tokens; send some text")
    if num_prompt_tokens + 1 > max_model_len:
        raise InvalidRequestError(
            field, f"the prompt is {num_prompt_tokens} tokens but the model's context window "
            f"is {max_model_len} tokens, which must hold the prompt plus at least 1 generated "
            f"token: shorten it to at most {max_model_len - 1} tokens",
            grpc.StatusCode.OUT_OF_RANGE)
    return min(max_tokens, max_model_len - num_prompt_tokens)
