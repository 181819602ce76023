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

On by default (``--no-tokenize-in-router``: every prompt from the service).
The definition loads in the background, after the router serves
(:meth:`PromptTokenizer.start`: importing ``transformers`` and parsing the
definition take 1-3 s here, which the router's start to SERVING no longer
pays); until it has loaded, prompts go to the service. The service stays the
fallback: for a model whose definition did not come with a template field (an
older service) or did not load here, and for a request the in-process
tokenizer fails on unexpectedly (a bug: logged, then asked of the service).
Which path answered each prompt is counted
(``llmesh:router_tokenize_total{path="local|service"}``, and
``llmesh:router_tokenizer_in_process`` turns 1 once loaded:
:class:`TokenizeObserver`).

Texts up to :data:`DEFAULT_INLINE_ENCODE_MAX_CHARS` characters are tokenized
on the event loop (a short chat: ~0.1-0.5 ms); longer ones on a worker thread
(the Rust encoder releases the GIL), as the service does.
"""

from __future__ import annotations

import asyncio
import threading
import time
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


class TokenizeObserver:
    """Where a :class:`PromptTokenizer` reports (the router's metrics implement
    it; the default does nothing)."""

    def served(self, path: str) -> None:
        """One prompt answered by ``path``: ``local`` or ``service``."""

    def loaded(self, in_process: bool) -> None:
        """Whether prompts are now tokenized in this process."""


class PromptTokenizer:
    """A model's prompt ids for the pipeline: in process once the tokenizer
    service's definition has loaded here, else from the service.

    Same methods, arguments and errors as :class:`TokenizerClient`'s
    ``tokenize`` and ``apply_chat_template``: :class:`UpstreamError` with the
    status the service would answer (service ``tokenizer``; ``target`` says
    in process). Owner of its background load (:meth:`close` stops it).
    """

    def __init__(self, service: TokenizerClient, local: Tokenizer | None = None, *,
                 observer: TokenizeObserver | None = None,
                 inline_max_chars: int = DEFAULT_INLINE_ENCODE_MAX_CHARS) -> None:
        """Args:
          service: the model's tokenizer service (the fallback).
          local: the same tokenizer rebuilt here, or None to ask the service
            (until :meth:`start`'s load sets it).
          observer: told which path served each prompt, and when it loaded.
          inline_max_chars: longer texts are tokenized on a worker thread.
        """
        self._service = service
        self._local = local
        self._observer = observer or TokenizeObserver()
        self._inline_max = inline_max_chars
        self._loading: asyncio.Task[None] | None = None
        self._observer.loaded(local is not None)

    @classmethod
    def start(cls, service: TokenizerClient, definition: TokenizerDefinition,
              info: TokenizerInfo, *, observer: TokenizeObserver | None = None
              ) -> PromptTokenizer:
        """A tokenizer that asks the service at once and rebuilds the
        service's tokenizer from ``definition`` in the background (on a daemon
        thread, so that a router stopping meanwhile does not wait for it);
        once loaded, prompts are made here. Without a template field in the
        definition, or when it does not load (logged), prompts stay the
        service's. Needs a running event loop."""
        prompts = cls(service, observer=observer)
        if definition.chat_template is None:
            log.info("prompt_tokenization", where="tokenizer service",
                     why="GetTokenizer sent no chat_template field (an older service)")
            return prompts
        prompts._loading = asyncio.create_task(prompts._load(definition, info),
                                               name=f"prompt-tokenizer-load {info.model}")
        return prompts

    @classmethod
    async def load(cls, service: TokenizerClient, definition: TokenizerDefinition,
                   info: TokenizerInfo, *, observer: TokenizeObserver | None = None
                   ) -> PromptTokenizer:
        """:meth:`start`, then waits until the load has ended (seconds)."""
        prompts = cls.start(service, definition, info, observer=observer)
        await prompts.ready()
        return prompts

    async def ready(self) -> bool:
        """Waits for the background load to end; whether prompts are now made
        in this process."""
        if self._loading is not None:
            await asyncio.shield(self._loading)
        return self.in_process

    async def close(self) -> None:
        """Stops waiting for the background load (its thread ends on its own)."""
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)

    async def _load(self, definition: TokenizerDefinition, info: TokenizerInfo) -> None:
        """Rebuilds the tokenizer (:meth:`Tokenizer.from_definition`) and, when
        its vocabulary matches the service's, makes it the prompts' path; any
        failure is logged and leaves the service in charge."""
        began = time.monotonic()
        try:
            local = await _on_daemon_thread(
                Tokenizer.from_definition, definition.data.decode(), info.model,
                eos_token_ids=info.eos_token_ids, chat_template=definition.chat_template,
                special_tokens=definition.special_tokens,
                chat_roles=info.chat_roles or DEFAULT_CHAT_ROLES)
        except Exception as err:  # any failure here leaves the service in charge
            log.warning("prompt_tokenization", where="tokenizer service",
                        why=f"the definition does not load here: {err!r}")
            return
        if local.info.vocab_size != definition.vocab_size:
            log.warning("prompt_tokenization", where="tokenizer service",
                        why=f"vocabulary of {local.info.vocab_size} ids here, "
                            f"{definition.vocab_size} in the service")
            return
        self._local = local
        self._observer.loaded(True)
        log.info("prompt_tokenization", where="router", model=info.model,
                 load_s=round(time.monotonic() - began, 3))

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
        self._observer.served("service")
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
        self._observer.served("service")
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
                result = await asyncio.to_thread(fn, *args)
            else:
                result = fn(*args)
        except Exception as err:
            code = status_of_error(err)
            if code is grpc.StatusCode.INTERNAL:
                log.warning("prompt_tokenization_fell_back", error=repr(err))
                return None
            self._observer.served("local")
            raise UpstreamError("tokenizer", IN_PROCESS, code, str(err)) from err
        self._observer.served("local")
        return result


async def _on_daemon_thread(fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
    """``fn(*args, **kwargs)`` on a new daemon thread: unlike
    :func:`asyncio.to_thread`, neither the loop's shutdown nor the
    interpreter's exit waits for it (a router told to stop while its
    tokenizer still loads exits at once). Cancelling the caller abandons the
    result."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, err: BaseException | None) -> None:
        if done.cancelled():
            return
        if err is not None:
            done.set_exception(err)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result, err = fn(*args, **kwargs), None
        except BaseException as caught:  # handed to the awaiting task
            result, err = None, caught
        try:
            loop.call_soon_threadsafe(settle, result, err)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=work, name=f"daemon {getattr(fn, '__name__', fn)}",
                     daemon=True).start()
    return await done
