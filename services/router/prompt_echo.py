"""The prompt at the head of a completion's choices: OpenAI's ``echo``.

lm-evaluation-harness scores a continuation (``loglikelihood`` tasks, its
``local-completions`` model) with one ``/v1/completions`` request: the
context and continuation as token ids, ``echo: true``, ``logprobs: 1``,
``max_tokens`` 0 or 1; it reads ``choices[0].logprobs.token_logprobs`` of the
prompt's positions. vLLM answers it from the engine's prompt logprobs; so does
llmesh, with no second scorer:

1. :func:`echo_request` makes sure the request carries prompt ids (a text
   prompt is tokenized here, once, by the pipeline's own tokenizer, and the
   ids replace the text, so the engine sees exactly the ids echoed);
2. the engine computes ``prompt_logprobs`` (set by
   :mod:`services.router.openai_protocol`: as many alternatives as ``logprobs``);
3. :meth:`EchoedPrompt.entries` are the prompt's entries, which the
   response builder (:meth:`~services.router.openai_format.ResponseBuilder._echoed`)
   puts before each choice's generated tokens, in the response or on the
   choice's first stream chunk: the first prompt token has ``null`` logprob
   and ``null`` top logprobs (nothing predicts it), as OpenAI and vLLM answer.

The echoed text is the text of the prompt ids: every token's bytes, special
tokens as their markup (Gemma's ``<bos>``), i.e. what ``/detokenize`` returns
for them (vLLM's ``tokenizer.decode(prompt_token_ids)`` for a token prompt).
For a text prompt whose tokenizer adds no special token (SmolLM2) that is the
prompt itself. ``text_offset`` indexes this text exactly
(:class:`~services.router.openai_format.TextOffsets`). With ``max_tokens: 0``
(:attr:`EchoedPrompt.only`) the choice is the prompt alone; the token the
engine computed for it is dropped (still counted in ``usage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.router.generation import GenerationPipeline
from services.router.validation import GenerationRequest


@dataclass(frozen=True)
class EchoedPrompt:
    """The prompt a completion echoes.

    Attributes:
      token_ids: the prompt ids the engine was given.
      tokens: each id's text (``TokenLogprob.token``'s form: ``bytes:\\xNN``
        for bytes that are not whole characters).
      text: the ids' text: their bytes joined, decoded (invalid UTF-8 as U+FFFD).
      only: ``max_tokens: 0``: the choice is the prompt alone.
    """

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    text: str
    only: bool = False

    def entries(self, prompt_logprobs: Sequence[PositionLogprobs]
                ) -> tuple[PositionLogprobs, ...]:
        """One entry per prompt token: the first one's (its logprob a
        placeholder: :func:`~services.router.openai_format.completion_logprobs`
        writes ``null`` for it), then the engine's ``prompt_logprobs`` (one per
        later token; none when logprobs were not asked for)."""
        if not self.token_ids:
            return ()
        first = PositionLogprobs(TokenLogprob(self.token_ids[0], 0.0, 0, self.tokens[0]), ())
        if prompt_logprobs:
            return (first, *prompt_logprobs)
        return (first, *(PositionLogprobs(TokenLogprob(i, 0.0, 0, t), ())
                         for i, t in zip(self.token_ids[1:], self.tokens[1:], strict=True)))


async def echo_request(pipeline: GenerationPipeline, request: GenerationRequest, *,
                       only: bool, deadline: float | None
                       ) -> tuple[GenerationRequest, EchoedPrompt]:
    """``request`` with prompt ids (a text prompt tokenized once, here), and
    the prompt it echoes.

    Raises:
      InvalidRequestError: the tokenizer refused the prompt.
      GenerationError: the tokenizer failed.
    """
    ids = request.prompt_token_ids
    if ids is None:
        ids = await pipeline.prompt_ids(request, deadline=deadline)
        request = dataclasses.replace(request, prompt=None, prompt_token_ids=ids)
    tokens = tuple(pipeline.token_texts.text(i) for i in ids)
    text = b"".join(pipeline.decoder.token_bytes(i) for i in ids).decode("utf-8", "replace")
    return request, EchoedPrompt(ids, tokens, text, only)


__all__ = ["EchoedPrompt", "echo_request"]
