"""Router events as OpenAI response bodies, stream chunks and error bodies.

Shapes follow the OpenAI API reference ("The chat completion object", "The
chat completion chunk object", "The completion object") and, for what OpenAI
does not have, vLLM's OpenAI-compatible server (``prompt_logprobs``,
``finish_reason: "abort"``):

* a :class:`Delta` of choice ``i`` is one chunk with one choice (``index: i``);
  a chat choice's first chunk carries ``role: "assistant"``;
* a :class:`Finished` is a chunk with an empty delta and the choice's
  ``finish_reason`` (STOP → ``stop``, LENGTH → ``length``, CANCELLED →
  ``abort``); with ``n`` > 1 every choice ends on its own;
* usage (``prompt_tokens``, ``completion_tokens`` summed over the choices,
  ``total_tokens``, ``prompt_tokens_details.cached_tokens``, and llmesh's
  ``history: {turns_summarized, tokens_saved}`` when a summary replaced old
  turns: :mod:`services.router.history`) goes in the
  response, or in a last chunk with ``choices: []`` when the client asked for
  ``stream_options.include_usage`` (then every other chunk has ``usage: null``);
* logprobs: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
  completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}`` (``text_offset``: characters of the choice's text before
  the token, :class:`TextOffsets`; a token of a stop string cut from the
  text starts at the text's end, though a stream has already sent the
  offsets of the stop string's earlier tokens, which may lie past it);
  prompt logprobs as vLLM returns them: one entry per prompt
  token, ``null`` for the first, else ``{token_id: {logprob, rank,
  decoded_token}}`` (top-level ``prompt_logprobs`` in a chat response, per
  choice in a completion; on the chunk that carries them when streaming);
* completions ``echo`` (:mod:`services.router.prompt_echo`): each choice's
  ``text`` and ``logprobs`` start with the prompt's (its first token's
  logprob and top logprobs ``null``), or are the prompt alone with
  ``max_tokens: 0``; streamed as vLLM streams it, the prompt on each
  choice's first chunk (:meth:`ResponseBuilder._echoed`, one rule for both
  shapes, so the chunks join to the response).
* retrieval (:mod:`services.router.retrieval.openai`): ``llmesh_retrieval``
  at the top level of the response, or on each choice's last chunk.

Errors: :func:`error_for_status` maps a gRPC status of the shared pipeline to
the HTTP status and ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import FinishReason
from services.common.wire.engine_stream import Usage
from services.common.wire.tools import ToolCallDelta
from services.router.cascade.path import AnswerPath
from services.router.generation import Delta, Finished
from services.router.openai_protocol import Endpoint
from services.router.prompt_echo import EchoedPrompt
from services.router.retrieval.report import RetrievalReport
from services.router.tools import openai as tools

_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                   FinishReason.CANCELLED: "abort", FinishReason.TOOL_CALLS: "tool_calls"}


def token_bytes(token: str) -> list[int]:
    """The UTF-8 bytes of a token's text; ``bytes:\\xNN`` escapes (a token that
    is not whole characters, see ``llmesh.v1.TokenLogprob.token``) are decoded."""
    if not token.startswith("bytes:"):
        return list(token.encode("utf-8"))
    out: list[int] = []
    rest = token[len("bytes:"):]
    while rest:
        if rest.startswith("\\x") and len(rest) >= 4:
            try:
                out.append(int(rest[2:4], 16))
                rest = rest[4:]
                continue
            except ValueError:
                pass
        out.extend(rest[0].encode("utf-8"))
        rest = rest[1:]
    return out


def _chat_token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": token_bytes(entry.token)}


def chat_logprobs(entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: one item per generated token."""
    return {"content": [{**_chat_token(e.chosen),
                         "top_logprobs": [_chat_token(t) for t in e.top]} for e in entries]}


class TextOffsets:
    """Where each token's text starts in a choice's text (OpenAI's completions
    ``text_offset``), fed the choice's tokens in order.

    An offset counts characters (code points, as Python's ``len`` and
    OpenAI's offsets do) of the text the earlier tokens produced: their bytes
    (:func:`token_bytes`, so a ``bytes:\\xNN`` token counts as the bytes it
    stands for, never as its 14-character spelling) decoded as UTF-8, a
    character counted once its last byte has arrived. For tokens of whole
    characters that is vLLM's rule (the previous offset plus the previous
    token's length). A token that is part of a multi-byte character (half of
    an emoji) gets the offset of the character its first byte belongs to, so
    every token of one emoji has that emoji's offset; vLLM instead adds one
    per fragment (each decodes alone to U+FFFD), which drifts past the text.
    Invalid bytes count as the U+FFFD the text holds for them. A special
    token counts by its text, which the choice's text leaves out: only EOS
    and stop token ids are expected, and they end the choice, so no offset
    comes after them. Not thread-safe: one per choice.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def feed(self, entries: Sequence[PositionLogprobs]) -> list[int]:
        """The offsets of ``entries``' chosen tokens, the next tokens of the choice."""
        offsets = []
        for entry in entries:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(bytes(token_bytes(entry.chosen.token))))
        return offsets


def completion_logprobs(entries: Sequence[PositionLogprobs], text_offsets: Sequence[int],
                        *, unscored_first: bool = False) -> dict[str, Any]:
    """OpenAI completions ``logprobs``; ``text_offsets[i]`` is where entry
    ``i``'s token starts in the choice's text (characters, :class:`TextOffsets`).
    ``unscored_first``: entry 0 is an echoed prompt's first token, which
    nothing predicts: ``null`` logprob and top logprobs (OpenAI, vLLM)."""
    body = {"tokens": [e.chosen.token for e in entries],
            "token_logprobs": [e.chosen.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": list(text_offsets)}
    if unscored_first and entries:
        body["token_logprobs"][0] = body["top_logprobs"][0] = None
    return body


def prompt_logprobs(entries: Sequence[PositionLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing
    predicts it), then ``{token_id: {logprob, rank, decoded_token}}`` with the
    prompt's token and the top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        position = {str(t.token_id): {"logprob": t.logprob, "rank": t.rank,
                                      "decoded_token": t.token}
                    for t in (entry.chosen, *entry.top)}
        out.append(position)
    return out


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int
               ) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    offsets: TextOffsets = field(default_factory=TextOffsets)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    started: bool = False
    finish_reason: str | None = None


@dataclass
class ResponseBuilder:
    """Turns one request's events into OpenAI bodies (see the module doc).

    Attributes:
      endpoint: chat or completions.
      request_id: the mesh's request id (``chatcmpl-<id>`` / ``cmpl-<id>``).
      model: the served model id; for the cascade alias, the model that
        produced the answer once its first event names it (``path``).
      logprobs: the client asked for logprobs (``null`` otherwise).
      echo: the prompt each completion choice starts with (``echo: true``;
        :mod:`services.router.prompt_echo`), or None.
      show_prompt_logprobs: the client asked for ``prompt_logprobs`` (not
        only through ``echo``): the response carries them.
      created: Unix seconds.
      path: for the cascade alias, the answer's path (from its first event).
    """

    endpoint: Endpoint
    request_id: str
    model: str
    logprobs: bool = False
    include_usage: bool = False
    echo: EchoedPrompt | None = None
    show_prompt_logprobs: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    path: AnswerPath | None = None
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _usage: list[Usage] = field(default_factory=list)
    _prompt_logprobs: list[dict[str, Any] | None] | None = None
    _held: list[Delta | Finished] = field(default_factory=list)
    _echo_started: set[int] = field(default_factory=set)
    _prompt_scored: bool = False
    _prompt_entries: tuple[PositionLogprobs, ...] = ()
    #: the request's retrieval (from its first Finished), None without
    retrieval: RetrievalReport | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def finished_choices(self) -> int:
        return sum(1 for c in self._choices.values() if c.finish_reason is not None)

    # ------------------------------------------------------------- streaming

    def chunks(self, event: Delta | Finished) -> list[dict[str, Any]]:
        """The stream chunks for one event (and records it for :meth:`usage`):
        one, or with ``echo`` what :meth:`_echoed` makes of it (none while it
        waits for the prompt's logprobs, two for a choice that finishes with
        nothing but its prompt)."""
        self._note_path(event)
        return [self._chunk(e) for e in self._echoed(event)]

    def _note_path(self, event: Delta | Finished) -> None:
        if event.path is not None and self.path is None:
            self.path = event.path
            self.model = event.path.model

    def _chunk(self, event: Delta | Finished) -> dict[str, Any]:
        choice = self._choices.setdefault(event.index, _Choice())
        extra: dict[str, Any] = {}
        if isinstance(event, Finished):
            self._finish(choice, event)
            body = self._choice_chunk(event.index, choice, "", (), choice.finish_reason)
            if event.retrieval is not None:
                extra["llmesh_retrieval"] = event.retrieval.openai_body()
        else:
            self._add(choice, event)
            body = self._choice_chunk(event.index, choice, event.text, event.logprobs, None,
                                      choice.offsets.feed(event.logprobs))
            if event.tool_calls:
                body["delta"]["tool_calls"] = tools.delta_body(event.tool_calls)
            if event.prompt_logprobs and self.show_prompt_logprobs:
                extra["prompt_logprobs"] = prompt_logprobs(event.prompt_logprobs)
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                               [body])
        if self.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = self.usage()
        return chunk

    def _choice_chunk(self, index: int, choice: _Choice, text: str,
                      logprobs: Sequence[PositionLogprobs], finish_reason: str | None,
                      offsets: Sequence[int] = ()) -> dict[str, Any]:
        body: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {}
            if not choice.started:
                delta["role"] = "assistant"
            if text or (finish_reason is None and not choice.started):
                delta["content"] = text
            body["delta"] = delta
            body["logprobs"] = chat_logprobs(logprobs) if self.logprobs and logprobs else None
        else:
            body["text"] = text
            # An echoed prompt's first token leads the choice's first chunk.
            body["logprobs"] = (completion_logprobs(
                logprobs, offsets, unscored_first=self.echo is not None and not choice.started)
                if self.logprobs and logprobs else None)
        body["finish_reason"] = finish_reason
        choice.started = True
        return body

    # --------------------------------------------------------- non-streaming

    def add(self, event: Delta | Finished) -> None:
        """Records one event for :meth:`response`."""
        self._note_path(event)
        for echoed in self._echoed(event):
            choice = self._choices.setdefault(echoed.index, _Choice())
            if isinstance(echoed, Finished):
                self._finish(choice, echoed)
            else:
                self._add(choice, echoed)

    def response(self) -> dict[str, Any]:
        """The whole ``chat.completion`` / ``text_completion`` object."""
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            text = "".join(choice.text)
            body: dict[str, Any] = {"index": index}
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
                if choice.tool_calls:
                    body["message"]["tool_calls"] = tools.message_body(choice.tool_calls)
                    body["message"]["content"] = text or None
                body["logprobs"] = chat_logprobs(choice.logprobs) if self.logprobs else None
            else:
                body["text"] = text
                # Tokens of a stop string cut from the text start at its end.
                offsets = [min(o, len(text)) for o in TextOffsets().feed(choice.logprobs)]
                body["logprobs"] = (completion_logprobs(choice.logprobs, offsets,
                                                        unscored_first=self.echo is not None)
                                    if self.logprobs else None)
                if self._prompt_logprobs is not None and index == 0:
                    body["prompt_logprobs"] = self._prompt_logprobs
            body["finish_reason"] = choice.finish_reason
            choices.append(body)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self._prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs
        out["usage"] = self.usage()
        if self.retrieval is not None:
            out["llmesh_retrieval"] = self.retrieval.openai_body()
        return out

    def usage(self) -> dict[str, Any]:
        """Usage over every choice that finished: the prompt once, completion
        tokens summed (none for ``echo`` with ``max_tokens: 0``: the one token
        the engine computes for the prompt is dropped, so it is not billed)."""
        if not self._usage:
            return usage_body(0, 0, 0)
        prompt = max(u.prompt_tokens for u in self._usage)
        cached = max(u.cached_prompt_tokens for u in self._usage)
        scored_only = self.echo is not None and self.echo.only
        completion = 0 if scored_only else sum(u.completion_tokens for u in self._usage)
        body = usage_body(prompt, completion, cached)
        last = self._usage[-1]
        if last.history_turns_summarized:  # llmesh's extension (history compaction)
            body["history"] = {"turns_summarized": last.history_turns_summarized,
                               "tokens_saved": last.history_tokens_saved}
        return body

    # -------------------------------------------------------------- helpers

    def _add(self, choice: _Choice, delta: Delta) -> None:
        choice.text.append(delta.text)
        choice.tool_calls.extend(delta.tool_calls)
        choice.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs and self.show_prompt_logprobs:
            self._prompt_logprobs = prompt_logprobs(delta.prompt_logprobs)

    def _echoed(self, event: Delta | Finished) -> list[Delta | Finished]:
        """The events to format for ``event``: itself, or with ``echo`` (vLLM's
        streamed echo; one rule for both shapes) each choice's events led by
        the prompt (:meth:`_lead`). While the prompt's logprobs are asked for
        and not here (choice 0's first delta carries them), other choices'
        events wait, released in order after it (or after choice 0's finish,
        if it brings none)."""
        echo = self.echo
        if echo is None:
            return [event]
        carrier = (isinstance(event, Delta) and bool(event.prompt_logprobs)) or (
            isinstance(event, Finished) and event.index == 0)
        if self.logprobs and len(echo.token_ids) > 1 and not self._prompt_scored:
            if not carrier:
                self._held.append(event)
                return []
            self._prompt_scored = True
        if isinstance(event, Delta) and event.prompt_logprobs:
            self._prompt_entries = echo.entries(event.prompt_logprobs)
        released, self._held = [event, *self._held], []
        return [out for later in released for out in self._lead(echo, later)]

    def _lead(self, echo: EchoedPrompt, event: Delta | Finished) -> list[Delta | Finished]:
        """A choice's first event led by the prompt: one delta of the prompt's
        text and entries (:meth:`EchoedPrompt.entries`) then the event's, or,
        with ``max_tokens: 0``, the prompt's alone (the computed token's delta
        dropped, and every later one); a first :class:`Finished` follows a
        prompt delta. Later events pass as they are."""
        if event.index in self._echo_started:
            return [] if echo.only and isinstance(event, Delta) else [event]
        self._echo_started.add(event.index)
        prompt = Delta(echo.text, echo.token_ids, self._prompt_entries or echo.entries(()),
                       index=event.index)
        if isinstance(event, Finished):
            return [prompt, event]
        if echo.only:
            return [dataclasses.replace(prompt, prompt_logprobs=event.prompt_logprobs)]
        return [Delta(prompt.text + event.text, prompt.token_ids + event.token_ids,
                      prompt.logprobs + event.logprobs, event.prompt_logprobs, event.index,
                      event.tool_calls)]

    def _finish(self, choice: _Choice, finished: Finished) -> None:
        choice.finish_reason = _FINISH_REASONS.get(finished.reason, "stop")
        self._usage.append(finished.usage)
        self.retrieval = self.retrieval or finished.retrieval

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}


# ------------------------------------------------------------------ errors


@dataclass(frozen=True)
class OpenAIError:
    """An error answer: HTTP status, OpenAI's error body and extra headers.

    Attributes:
      status: HTTP status.
      message: what went wrong and what to do.
      type: OpenAI's error type (``invalid_request_error``...).
      param: the request parameter at fault, or None.
      code: a short machine-readable code, or None.
      retry_after_s: seconds for the ``Retry-After`` header (429), or None.
    """

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


#: gRPC status of the shared pipeline → (HTTP status, OpenAI error type, code).
#: A field the engine cannot honour reaches here as INVALID_ARGUMENT naming it
#: (400, as vLLM answers): never a 5xx, which the official client retries.
#: Any other status (UNIMPLEMENTED included: a method a service lacks, a
#: deployment fault) is 500.
_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
}


def error_for_status(code: grpc.StatusCode, message: str, *, param: str | None = None,
                     unknown_model: bool = False,
                     retry_after_s: int | None = None) -> OpenAIError:
    """The OpenAI error for a pipeline status.

    Args:
      code: the gRPC status the gRPC edge would return.
      message: its message (already actionable: it names the field and limit).
      param: the OpenAI parameter at fault (INVALID_ARGUMENT, OUT_OF_RANGE).
      unknown_model: the request named a model this mesh does not serve: 404
        ``model_not_found``, as OpenAI answers.
      retry_after_s: the admission refusal's hint (429 ``Retry-After``).
    """
    if unknown_model:
        return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")
    status, kind, short = _STATUS.get(code, (500, "internal_error", "internal_error"))
    if status == 400:
        short = code.name.lower()
    return OpenAIError(status, message, kind, param, short,
                       retry_after_s if status == 429 else None)


__all__ = ["OpenAIError", "ResponseBuilder", "TextOffsets", "chat_logprobs",
           "completion_logprobs", "error_for_status", "prompt_logprobs", "token_bytes",
           "usage_body"]
