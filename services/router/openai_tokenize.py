"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (vLLM docs,
"OpenAI-Compatible Server", Tokenizer API: ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest`` and their responses).

* ``/tokenize`` with ``prompt`` (text): ``{"model"?, "prompt",
  "add_special_tokens" (default true), "return_token_strs" (default false)}``;
  with ``messages`` (OpenAI chat messages, rendered through the model's own
  chat template): ``{"model"?, "messages", "tools"?, "add_generation_prompt"
  (default true), "return_token_strs"}``, the tools (OpenAI's function tools,
  validated as a generation's) rendered as a generation renders them (the
  model's tool format: :mod:`services.router.tools.formats`), so the count is
  a generation's prompt (``add_special_tokens: true`` and
  ``continue_final_message: true`` are refused naming them: the template
  writes the model's special tokens itself, and the tokenizer service has no
  continuation mode). Answer: ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs`` null unless asked; each token's text as in
  logprobs, ``bytes:\\xNN`` for bytes that are not whole characters, where
  vLLM gives the vocabulary's spelling).
* ``/detokenize``: ``{"model"?, "tokens"}`` → ``{"prompt"}``, the ids' text
  with special tokens as their markup (vLLM's ``tokenizer.decode(tokens)``),
  so that ``/tokenize`` of it with ``add_special_tokens: false`` gives the
  ids back; ``tokens: []`` is ``{"prompt": ""}``, as vLLM answers.

The same ids as generation: ``/tokenize`` asks the model's tokenizer the
pipeline uses (:class:`~services.router.local_tokenizer.PromptTokenizer`: the
tokenizer service's definition and template, in process with
``--tokenize-in-router``, else the service), and ``/detokenize`` decodes with
the service's own definition (:class:`~services.common.detokenizer.TokenizersDecoder`).
The body's ``model``, ``prompt`` and ``messages`` are parsed and validated as a
generation's (:func:`~services.router.openai_protocol.parse_body`, the shared
validation): unknown model 404, a tenant's model 403, bad messages 400.

Refusals (:class:`InvalidRequestError`, 400 with ``param``): ids that are not
integers in ``[0, vocab_size)`` name ``tokens``; the tokenizer refusing the
input names the field. A prompt of more tokens than the model's
``max_model_len`` is counted, not refused (vLLM skips the context check for
its tokenizer endpoints: a client counts to truncate), but text that cannot
fit the window at any tokenization (the shared validation's byte bound,
``max_model_len`` × the longest token's bytes) is refused naming ``prompt``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from llmesh.v1 import generation_pb2

from services.common.sampling import InvalidRequestError
from services.router.clients import UpstreamError
from services.router.generation import upstream_to_generation_error
from services.router.openai_protocol import Endpoint, parse_body
from services.router.validation import PROMPT_TOKENS_FIELD, GenerationRequest

if TYPE_CHECKING:
    from services.router.service import RouterService

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"

#: Validates a request at the shared edge (:meth:`RouterService.validate` with
#: the call's headers and tenant bound).
Validate = Callable[[generation_pb2.GenerateRequest], GenerationRequest]

_PROMPT_KEYS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_KEYS = frozenset({"model", "messages", "tools", "add_special_tokens",
                        "add_generation_prompt", "continue_final_message", "return_token_strs"})


@dataclass(frozen=True)
class TokenizeOptions:
    """What a ``/tokenize`` body asks besides its input (vLLM's defaults)."""

    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


async def tokenize(router: RouterService, validate: Validate, data: Mapping[str, Any], *,
                   request_id: str, deadline: float | None) -> dict[str, Any]:
    """The ``/tokenize`` answer for a body (its JSON object).

    Raises:
      InvalidRequestError: a bad field (400 naming it), an unknown model (404).
      AuthError: the tenant may not use the model (403).
      GenerationError: the tokenizer service failed (its status).
    """
    chat = "messages" in data
    allowed = _CHAT_KEYS if chat else _PROMPT_KEYS
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InvalidRequestError(unknown[0], f"unrecognized argument for {TOKENIZE_PATH}; it "
                                  f"takes {', '.join(sorted(allowed))}")
    options = _options(data, chat)
    if not chat and not isinstance(data.get("prompt"), str):
        raise InvalidRequestError("prompt", "must be text (a string) to tokenize, or send "
                                            "`messages`")
    parsed = parse_body(Endpoint.CHAT if chat else Endpoint.COMPLETIONS,
                        {k: data[k] for k in ("model", "prompt", "messages", "tools")
                         if k in data})
    request = validate(parsed.generate)
    limits = router.models[request.model]
    pipeline = router.pipeline_for(request)
    # No refusal past max_model_len (vLLM's rule): the count is what a client
    # asks for to truncate its prompt.
    ids = await _token_ids(router, request, options, request_id=request_id, deadline=deadline)
    strs = [pipeline.token_texts.text(i) for i in ids] if options.return_token_strs else None
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": list(ids),
            "token_strs": strs}


def detokenize(router: RouterService, validate: Validate,
               data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/detokenize`` answer for a body (its JSON object).

    Raises:
      InvalidRequestError: ``tokens`` missing, not integers, or outside the
        model's vocabulary (400 naming ``tokens``); an unknown model (404).
      AuthError: the tenant may not use the model (403).
    """
    unknown = sorted(set(data) - {"model", "tokens"})
    if unknown:
        raise InvalidRequestError(unknown[0], f"unrecognized argument for {DETOKENIZE_PATH}; "
                                  "it takes model and tokens")
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise InvalidRequestError("tokens", "must be an array of integer token ids")
    model = data.get("model") or ""
    if not isinstance(model, str):
        raise InvalidRequestError("model", "must be a string")
    pb = generation_pb2.GenerateRequest(model=model)
    try:
        # The ids against the model's vocabulary; no ids decode to "" (vLLM's
        # answer), the model and tenant checked as for one id.
        pb.prompt_tokens.token_ids.extend(tokens or (0,))
        request = validate(pb)
    except ValueError as err:  # an id beyond int32, or the shared validation's refusal
        if isinstance(err, InvalidRequestError) and err.field != PROMPT_TOKENS_FIELD:
            raise
        raise InvalidRequestError("tokens", str(err).removeprefix(
            f"{PROMPT_TOKENS_FIELD}: ")) from err
    text = router.pipeline_for(request).decoder.decode(tuple(tokens),
                                                        skip_special_tokens=False)
    return {"prompt": text}


def _options(data: Mapping[str, Any], chat: bool) -> TokenizeOptions:
    flags = {}
    for key in ("add_special_tokens", "add_generation_prompt", "continue_final_message",
                "return_token_strs"):
        value = data.get(key)
        if value is not None and not isinstance(value, bool):
            raise InvalidRequestError(key, "must be true or false")
        flags[key] = value
    if chat and flags["add_special_tokens"]:
        raise InvalidRequestError("add_special_tokens", "is for `prompt` text; the chat "
                                  "template writes the model's special tokens itself")
    if flags["continue_final_message"]:
        raise InvalidRequestError("continue_final_message", "is not supported; send "
                                  "add_generation_prompt instead")
    return TokenizeOptions(
        add_special_tokens=not chat and flags["add_special_tokens"] is not False,
        add_generation_prompt=flags["add_generation_prompt"] is not False,
        return_token_strs=bool(flags["return_token_strs"]))


async def _token_ids(router: RouterService, request: GenerationRequest,
                     options: TokenizeOptions, *, request_id: str,
                     deadline: float | None) -> tuple[int, ...]:
    """The ids of the request's prompt or messages, with ``options``, no history
    trimmed. Raises InvalidRequestError (the tokenizer refused) or
    GenerationError (it failed)."""
    tokenizer = router.pipeline_for(request).tokenizer
    field = "messages" if request.messages is not None else "prompt"
    try:
        if request.messages is not None:
            chat = await tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=options.add_generation_prompt,
                max_prompt_tokens=0, request_id=request_id, deadline=deadline,
                tools=request.chat_tools)
            return chat.token_ids
        assert request.prompt is not None
        return await tokenizer.tokenize(request.prompt,
                                        add_special_tokens=options.add_special_tokens,
                                        request_id=request_id, deadline=deadline)
    except UpstreamError as err:
        if err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise InvalidRequestError(field, f"the tokenizer refused it: {err.details}",
                                      err.code) from err
        raise upstream_to_generation_error(err, model=request.model) from err


__all__ = ["DETOKENIZE_PATH", "TOKENIZE_PATH", "TokenizeOptions", "detokenize", "tokenize"]
