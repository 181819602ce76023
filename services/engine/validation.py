"""Checks of a request against the served model's limits.

They run once per request, in the backend's ``submit`` (the owner of the
model's limits and of its KV cache), whoever calls it: the engine service only
converts the protobuf and checks each field's own form
(:meth:`SamplingOptions.from_pb`), and maps these errors to their status.
Field names are those of ``llmesh.v1.EngineRequest`` as the client wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from services.common.sampling import InvalidRequestError, SamplingOptions
from services.engine.types import ModelInfo, SequenceRequest

PROMPT_FIELD = "prompt_token_ids"
MAX_TOKENS_FIELD = "sampling.max_tokens"


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Checks that the prompt is non-empty, in the vocabulary and leaves room to generate.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT for an empty prompt or an id outside
        ``[0, vocab_size)``; OUT_OF_RANGE when the prompt fills the context window.
    """
    if not prompt_token_ids:
        raise InvalidRequestError(PROMPT_FIELD, "must hold at least one token id")
    # min/max run in C: ~0.1 ms for 8k ids, where a Python loop took ~1 ms.
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        index, token_id = next((i, t) for i, t in enumerate(prompt_token_ids)
                               if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            PROMPT_FIELD,
            f"token id {token_id} at index {index} is outside the vocabulary [0, {vocab_size})",
        )
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            PROMPT_FIELD,
            f"prompt has {len(prompt_token_ids)} tokens but the context window is "
            f"{max_model_len} tokens; shorten it to at most {max_model_len - 1} tokens",
            grpc.StatusCode.OUT_OF_RANGE,
        )


def validate_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Checks ``prompt + max_tokens <= max_model_len``.

    Raises:
      InvalidRequestError: OUT_OF_RANGE naming ``sampling.max_tokens`` and the
        largest value that would fit.
    """
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            MAX_TOKENS_FIELD,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds the context window of {max_model_len} "
            f"tokens; set max_tokens <= {max_model_len - num_prompt_tokens} or shorten the prompt",
            grpc.StatusCode.OUT_OF_RANGE,
        )


def kv_tokens_needed(num_prompt_tokens: int, max_tokens: int, n: int = 1,
                     block_size: int = 1) -> int:
    """KV slots a request holds at most: one sequence's last computed token is
    number ``prompt + max_tokens - 1`` (the last sampled token is never
    computed); ``n`` choices share the prompt's full blocks and each hold their
    own copy of its partial last block plus their own tokens, in whole blocks
    of ``block_size``."""
    if n == 1:
        return num_prompt_tokens + max_tokens - 1
    shared = num_prompt_tokens // block_size * block_size
    own = -(-(num_prompt_tokens - shared + max_tokens - 1) // block_size) * block_size
    return shared + n * own


def validate_kv_capacity(num_prompt_tokens: int, max_tokens: int, capacity_tokens: int,
                         n: int = 1, block_size: int = 1) -> None:
    """Checks that the request's ``n`` sequences can ever fit in the replica's
    KV cache together (:func:`kv_tokens_needed`). A request beyond that would
    wait or be preempted forever, so it is refused as OUT_OF_RANGE ("never
    fits"), not RESOURCE_EXHAUSTED ("try later").

    Raises:
      InvalidRequestError: OUT_OF_RANGE naming ``prompt_token_ids`` when the
        prompt alone does not fit, ``sampling.n`` when one choice would fit but
        not ``n``, else ``sampling.max_tokens``, with the numbers.
    """
    needed = kv_tokens_needed(num_prompt_tokens, max_tokens, n, block_size)
    if needed <= capacity_tokens:
        return
    if n > 1 and kv_tokens_needed(num_prompt_tokens, max_tokens) <= capacity_tokens:
        raise InvalidRequestError(
            "sampling.n",
            f"{n} choices of prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
            f"need {needed} KV slots but this engine's KV cache holds {capacity_tokens} "
            f"tokens in all; lower n or max_tokens",
            grpc.StatusCode.OUT_OF_RANGE,
        )
    if num_prompt_tokens > capacity_tokens:
        raise InvalidRequestError(
            PROMPT_FIELD,
            f"prompt has {num_prompt_tokens} tokens but this engine's KV cache holds "
            f"{capacity_tokens} tokens in all; shorten it to at most {capacity_tokens} tokens "
            f"or send it to a replica with a larger KV cache",
            grpc.StatusCode.OUT_OF_RANGE,
        )
    raise InvalidRequestError(
        MAX_TOKENS_FIELD,
        f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
        f"slots but this engine's KV cache holds {capacity_tokens} tokens in all; set "
        f"max_tokens <= {capacity_tokens - num_prompt_tokens + 1} or shorten the prompt",
        grpc.StatusCode.OUT_OF_RANGE,
    )


def validate_request(request: SequenceRequest, info: ModelInfo) -> None:
    """Runs every check of this module on ``request``.

    Raises:
      InvalidRequestError: the first failing check (see the functions above), or
        a stop token id outside the vocabulary (INVALID_ARGUMENT).
    """
    validate_prompt(request.prompt_token_ids, info.vocab_size, info.max_model_len)
    validate_length(len(request.prompt_token_ids), request.sampling.max_tokens, info.max_model_len)
    for token_id in request.sampling.stop_token_ids:
        if not 0 <= token_id < info.vocab_size:
            raise InvalidRequestError(
                "sampling.stop_token_ids",
                f"token id {token_id} is outside the vocabulary [0, {info.vocab_size})",
            )
    for token_id, _ in request.sampling.logit_bias:
        if not 0 <= token_id < info.vocab_size:
            raise InvalidRequestError(
                "sampling.logit_bias",
                f"token id {token_id} is outside the vocabulary [0, {info.vocab_size})",
            )


#: The sampling fields a backend may or may not implement, as named in
#: ``llmesh.v1.SamplingParams``.
OPTIONAL_FEATURES = ("logprobs", "prompt_logprobs", "n", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                     "structured_output")


def used_features(sampling: SamplingOptions) -> list[str]:
    """The :data:`OPTIONAL_FEATURES` that ``sampling`` uses."""
    used = {
        "logprobs": sampling.logprobs is not None,
        "prompt_logprobs": sampling.prompt_logprobs is not None,
        "n": sampling.n != 1,
        "presence_penalty": sampling.presence_penalty != 0.0,
        "frequency_penalty": sampling.frequency_penalty != 0.0,
        "repetition_penalty": sampling.repetition_penalty != 1.0,
        "min_tokens": sampling.min_tokens != 0,
        "logit_bias": bool(sampling.logit_bias),
        "structured_output": sampling.structured_output is not None,
    }
    return [name for name in OPTIONAL_FEATURES if used[name]]


def refuse_unimplemented(sampling: SamplingOptions, implemented: frozenset[str],
                         backend: str, reasons: Mapping[str, str] | None = None) -> None:
    """Refuses a request that uses a sampling feature ``backend`` does not
    implement (never silently ignores it).

    The refusal is INVALID_ARGUMENT naming the field, as vLLM answers 400 for
    what it cannot do: the request is the client's to change (dropping the
    field helps, retrying does not). Not UNIMPLEMENTED, which gRPC means for a
    method the server lacks, and which the router's OpenAI endpoint would
    have to answer with a 5xx that clients retry.

    Args:
      reasons: per feature, the message after the field name (default: "is not
        implemented by the <backend> engine backend").

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming the first such field.
    """
    for name in used_features(sampling):
        if name not in implemented:
            message = (reasons or {}).get(
                name, f"is not implemented by the {backend} engine backend")
            raise InvalidRequestError(f"sampling.{name}", message)
