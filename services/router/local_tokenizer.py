"""Prompt ids in the router's own process, the tokenizer service as the fallback.

The tokenizer service owns the definitions and chat templates; the router
already fetches the definition at start (``GetTokenizer``, for
detokenization), and since the service sends the chat template and the
special tokens it renders with beside it, the router rebuilds the same
:class:`~services.tokenizer.tokenizer.Tokenizer`
(:meth:`Tokenizer.from_definition`) and makes a request's prompt ids (raw
prompt text, or the chat template with history trimmed to the budget) without
a round trip, as SGLang's model gateway and Dynamo's frontend do. Same code,
same definition, same template: the same ids and the same refusals (statuses
from :func:`~services.tokenizer.status.status_of_error`) as the service's
``Tokenize``/``ApplyChatTemplate``
(``tests/tokenizer/test_tokenizer_router_local.py`` checks SmolLM2 and
Gemma 3). Why, in numbers: docs/architecture.md "What the mesh costs".

The service stays the fallback: for a model whose definition did not come
with a template field (an older service) or did not load here, and for a
request the in-process tokenizer fails on unexpectedly (a bug: logged, then
asked of the service).

Texts up to :data:`DEFAULT_INLINE_ENCODE_MAX_CHARS` characters are tokenized
on the event loop (a short chat: ~0.1-0.5 ms); longer ones on a worker thread
(the Rust encoder releases the GIL), as the service does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import structlog

from services.common.wire.chat import ChatMessage, ChatPrompt
from services.common.wire.tokenizer_info import TokenizerInfo
from services.common.wire.tools import FunctionTool
from services.router.clients import (
    TokenizerClient,
    TokenizerDefinition,
    UpstreamError,
    timeout_until,
)
from services.tokenizer.status import status_of_error
from services.tokenizer.tokenizer import (
    DEFAULT_CHAT_ROLES,
    DEFAULT_INLINE_ENCODE_MAX_CHARS,
    Tokenizer,
)

log = structlog.get_logger()

_T = TypeVar("_T")
#: ``UpstreamError.target`` of a refusal made in the router's process.
IN_PROCESS = "the router's in-process tokenizer"


class PromptTokenizer:
    """A model's prompt ids for the pipeline: in process when the tokenizer
    service's definition allows it, else from the service.

    Same methods, arguments and errors as :class:`TokenizerClient`'s
    ``tokenize`` and ``apply_chat_template``: :class:`UpstreamError` with the
    status the service would answer (service ``tokenizer``; ``target`` says
    in process).
    """

    def __init__(self, service: TokenizerClient, local: Tokenizer | None, *,
                 inline_max_chars: int = DEFAULT_INLINE_ENCODE_MAX_CHARS) -> None:
        """Args:
          service: the model's tokenizer service (the fallback).
          local: the same tokenizer rebuilt here, or None to ask the service.
          inline_max_chars: longer texts are tokenized on a worker thread.
        """
        self._service = service
        self._local = local
        self._inline_max = inline_max_chars

    @classmethod
    async def load(cls, service: TokenizerClient, definition: TokenizerDefinition,
                   info: TokenizerInfo) -> PromptTokenizer:
        """Rebuilds the service's tokenizer from ``definition`` on a worker thread
        (seconds: :meth:`Tokenizer.from_definition`); without a template
        field in it, or when it does not load (logged), prompts go to the
        service."""
        if definition.chat_template is None:
            log.info("prompt_tokenization", where="tokenizer service",
                     why="GetTokenizer sent no chat_template field (an older service)")
            return cls(service, None)
        try:
            local = await asyncio.to_thread(
                Tokenizer.from_definition, definition.data.decode(), info.model,
                eos_token_ids=info.eos_token_ids, chat_template=definition.chat_template,
                special_tokens=definition.special_tokens,
                chat_roles=info.chat_roles or DEFAULT_CHAT_ROLES)
        except (ValueError, ImportError) as err:
            log.warning("prompt_tokenization", where="tokenizer service",
                        why=f"the definition does not load here: {err}")
            return cls(service, None)
        if local.info.vocab_size != definition.vocab_size:
            log.warning("prompt_tokenization", where="tokenizer service",
                        why=f"vocabulary of {local.info.vocab_size} ids here, "
                            f"{definition.vocab_size} in the service")
            return cls(service, None)
        log.info("prompt_tokenization", where="router", model=info.model)
        return cls(service, local)

    @property
    def in_process(self) -> bool:
        """Whether prompts are tokenized in this process."""
        return self._local is not None

    async def tokenize(self, text: str, *, add_special_tokens: bool, request_id: str,
                       deadline: float | None, traceparent: str = "") -> tuple[int, ...]:
        """Text to ids (the service's ``Tokenize``); ``traceparent``: the
        caller's span, passed on when the service is asked (W3C, "" when not
        traced). Raises :class:`UpstreamError`."""
        if self._local is not None:
            timeout_until(deadline)
            ids = await self._local_call(len(text), self._local.encode, text,
                                         add_special_tokens)
            if ids is not None:
                return tuple(ids)
        return await self._service.tokenize(text, add_special_tokens=add_special_tokens,
                                            request_id=request_id, deadline=deadline,
                                            traceparent=traceparent)

    async def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
        max_prompt_tokens: int, request_id: str, deadline: float | None,
        allow_special_tokens: bool = False, traceparent: str = "",
        tools: Sequence[FunctionTool] = (),
    ) -> ChatPrompt:
        """Messages to prompt ids within ``max_prompt_tokens`` (the service's
        ``ApplyChatTemplate``); ``traceparent`` as for :meth:`tokenize`;
        ``tools``: the template's ``tools`` (the ``template`` tool format).

        Raises:
          UpstreamError: FAILED_PRECONDITION (no chat template), OUT_OF_RANGE
            (even the last message alone does not fit), INVALID_ARGUMENT (a
            role or content the template refuses), DEADLINE_EXCEEDED, or the
            service's transport error on the fallback.
        """
        if self._local is not None:
            timeout_until(deadline)
            prompt = await self._local_call(
                sum(len(m.content) for m in messages), self._local.apply_chat_template,
                messages, add_generation_prompt, max_prompt_tokens, allow_special_tokens, tools)
            if prompt is not None:
                return prompt
        return await self._service.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            max_prompt_tokens=max_prompt_tokens, request_id=request_id, deadline=deadline,
            allow_special_tokens=allow_special_tokens, traceparent=traceparent, tools=tools)

    async def _local_call(self, chars: int, fn: Callable[..., _T], *args: object) -> _T | None:
        """``fn(*args)`` here (on a worker thread above ``inline_max_chars``);
        None after an unexpected failure (logged: the caller asks the service).

        Raises:
          UpstreamError: the service's status for the tokenizer's refusal.
        """
        try:
            if chars > self._inline_max:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)
        except Exception as err:
            code = status_of_error(err)
            if code is grpc.StatusCode.INTERNAL:
                log.warning("prompt_tokenization_fell_back", error=repr(err))
                return None
            raise UpstreamError("tokenizer", IN_PROCESS, code, str(err)) from err
